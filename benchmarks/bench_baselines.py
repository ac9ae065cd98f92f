"""The Lead and SCROLLS-naive baselines of a summarization file, scored as ``torch-handle test`` scores them.

    python benchmarks/bench_baselines.py data/qmsum/test_all.jsonl --train data/qmsum/train_all.jsonl \
        --query-field query
    python benchmarks/bench_baselines.py data/squality/dev_plot.jsonl --train data/squality/train_plot.jsonl

No model and no tokenizer: the rows are read by ``SummarizationDataModule`` (the query, a blank line, then the
document; every reference of a row) and scored by the metric code ``test`` runs (each document's best
reference, 0-100, the geometric mean of ROUGE-1/2/L). The naive baseline's ratio is the training file's mean
summary-to-input length ratio in characters, as SCROLLS takes it, or ``--naive-ratio``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from torch_handle.data import SummarizationDataModule
from torch_handle.metrics import GEOMETRIC_MEAN, Rouge, baseline_labels, geometric_mean, lead, naive, rouge_line


def baselines(
    test_file: str,
    train_file: str | None = None,
    query_field: str | None = None,
    lead_words: int = 100,
    naive_ratio: float | None = None,
) -> list[str]:
    """The lines ``test`` prints for the baselines of ``test_file``: Lead, naive (when it has a ratio), signature."""
    data = SummarizationDataModule(train_file=train_file, test_file=test_file, query_field=query_field)
    split = data.read_split("test")
    assert split is not None and split.targets is not None
    references = split.references or [()] * len(split.targets)
    references = [list(refs) or [target] for refs, target in zip(references, split.targets, strict=True)]
    ratio = naive_ratio if naive_ratio is not None else data.summary_ratio()
    labels = baseline_labels(lead_words, ratio)
    outputs = {labels["lead_"]: [lead(source, lead_words) for source in split.sources]}
    if ratio is not None:
        outputs[labels["naive_"]] = [naive(source, ratio) for source in split.sources]
    lines = [f"{test_file}: {len(split.sources)} inputs, {sum(map(len, references))} references"]
    metric = Rouge()
    for label, predictions in outputs.items():
        metric.reset()
        metric.update(predictions, references)
        scores = metric.compute()
        logged = {name: 100 * value for name, value in (scores | {GEOMETRIC_MEAN: geometric_mean(scores)}).items()}
        lines.append(str(rouge_line(label, logged, "")))
    return [*lines, f"({metric.signature})"]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("test_file", help="JSON lines with document, summary, and optionally summaries and a query")
    parser.add_argument("--train", help="training file, whose summary-to-input ratio sets the naive baseline's length")
    parser.add_argument("--query-field", help="JSON field of a query to put before the document (SCROLLS's QMSum)")
    parser.add_argument("--lead-words", type=int, default=100, help="words of the Lead baseline (default: 100)")
    parser.add_argument("--naive-ratio", type=float, help="the naive baseline's ratio instead of the training file's")
    options = parser.parse_args(argv)
    lines = baselines(options.test_file, options.train, options.query_field, options.lead_words, options.naive_ratio)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
