"""``benchmarks/bench_baselines.py`` scores the baselines as ``test`` does, so its RESULTS figures cannot rot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from rouge_score import rouge_scorer

from tests.helpers import ROOT
from torch_handle.metrics import split_sentences

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_baselines  # noqa: E402 - a script folder, not a package


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def test_the_naive_baseline_reads_its_ratio_from_the_training_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train = _write(tmp_path / "train.jsonl", [{"query": "Q?", "document": "x" * 16, "summary": "abcde"}])  # 5 / 20
    row = {"query": "Who won?", "document": "The red team won the game today.", "summary": "Red won."}
    test = _write(tmp_path / "test.jsonl", [row | {"summaries": ["Red won.", "The red team."]}])
    bench_baselines.main([test, "--train", train, "--query-field", "query", "--lead-words", "3"])
    header, lead, naive, signature = capsys.readouterr().out.strip().splitlines()
    assert header == f"{test}: 1 inputs, 2 references"
    source = "Who won?\n\nThe red team won the game today."
    scorer = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)
    for line, label, output in (
        (lead, "Lead-3 baseline", "Who won? The"),
        (naive, "naive baseline (SCROLLS: the input's first 25.00% of characters)", source[: len(source) // 4]),
    ):
        best = max(scorer.score(split_sentences(r), output)["rouge1"].fmeasure for r in ["Red won.", "The red team."])
        assert line.startswith(f"{label}: ROUGE-1 {100 * best:.2f}  ROUGE-2 "), line
    assert signature.startswith("(rouge-score ")
