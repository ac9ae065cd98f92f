"""Does a summary depend on its document? ROUGE of a predictions file against its own references and against those of
another document asking the same question (the rows ``--shift`` further on), with the metric ``torch-handle test``
uses (best reference, mean F1, 0-100).

    torch-handle predict --config summarization --ckpt_path last \
        --data.init_args.predict_file data/squality/dev_all.jsonl --data.init_args.query_field query
    python benchmarks/rouge_control.py --inputs data/squality/dev_all.jsonl --predictions runs/.../predictions-*.txt

A model that summarizes its document scores lower against another document's references; one that writes the same
kind of text whatever it reads scores the same. The Lead baseline (the document's first ``--lead-words`` words) is
scored both ways too, as a text that does depend on its document. Prints a table; writes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from torch_handle.metrics import Rouge, lead

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table  # noqa: E402


def scores(predictions: list[str], references: list[list[str]]) -> list[float]:
    """ROUGE-1, ROUGE-2, ROUGE-L and their geometric mean, 0-100."""
    rouge = Rouge()
    rouge.update(predictions, references)
    result = rouge.compute()
    r1, r2, rl = (100 * float(result[key]) for key in ("rouge1", "rouge2", "rougeL"))
    return [r1, r2, rl, (r1 * r2 * rl) ** (1 / 3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", required=True, help="the JSON lines predicted from, with `summaries` or `summary`")
    parser.add_argument("--predictions", required=True, nargs="+", help="predict's output files, one line per input")
    parser.add_argument("--shift", type=int, default=5, help="rows to another document's same question (SQuALITY: 5)")
    parser.add_argument("--lead-words", type=int, default=100, help="the Lead baseline's words")
    args = parser.parse_args()
    with open(args.inputs, encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines]
    references = [row.get("summaries") or [row["summary"]] for row in rows]
    table = []
    outputs = {Path(path).parent.name: Path(path).read_text(encoding="utf-8").splitlines() for path in args.predictions}
    outputs[f"Lead-{args.lead_words}"] = [lead(row["document"], args.lead_words) for row in rows]
    for path, predictions in outputs.items():
        if len(predictions) != len(rows):
            raise SystemExit(f"error: {path} has {len(predictions)} lines for {len(rows)} inputs")
        other = [references[(i + args.shift) % len(rows)] for i in range(len(rows))]
        own, shifted = scores(predictions, references), scores(predictions, other)
        for label, values in (("its own document's", own), (f"another document's (+{args.shift} rows)", shifted)):
            table.append([path, label, *(f"{v:.2f}" for v in values)])
        words = sum(len(p.split()) for p in predictions) / len(predictions)
        table.append([path, f"{len(set(predictions))} distinct of {len(predictions)}; "
                      f"{words:.0f} words each on average", "", "", "", ""])  # fmt: skip
    print(markdown_table(["predictions", "scored against references of", "ROUGE-1", "ROUGE-2", "ROUGE-L", "GM"], table))


if __name__ == "__main__":
    main()
