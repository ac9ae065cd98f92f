"""``benchmarks/bench_multi30k.py --dry-run`` runs end to end on the shared Multi30k data, so the script that
produces the README's BLEU figures cannot rot between the runs that write them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from sacrebleu.metrics import BLEU

from tests.helpers import ROOT, RUN_TIMEOUT, env

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_multi30k import TOKENIZED, lc_norm_tok  # noqa: E402


def _bench(*args: str, cwd: Path) -> str:
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_multi30k.py"), *args]
    run = subprocess.run(command, cwd=cwd, env=env(), capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


@pytest.mark.slow
def test_dry_run_trains_scores_and_reads_a_run_back(shared_data: Path, tmp_path: Path) -> None:
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    data = ["--data", str(shared_data / "multi30k"), "--run", "run", "--threads", "1", "--dry-run"]
    fitted = _bench(*data, cwd=tmp_path)
    row = re.search(r"^\| test_2016_flickr \| 20 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| 41\.0 \| [\d.]+ \|$", fitted, re.M)
    assert row, fitted
    assert re.search(r"^Training: [\d.]+ min \(wall\)", fitted, re.M), fitted
    scored = _bench(*data, "--no-fit", cwd=tmp_path)  # the same run, its training time from its TensorBoard log
    assert re.search(r"^Training: [\d.]+ min \(first to last TensorBoard event of the run\)", scored, re.M), scored
    assert row.group(0).rsplit("|", 2)[0] in scored  # the same BLEU: decoding is deterministic
    assert (ROOT / "benchmarks" / "RESULTS.md").read_text() == results  # a dry run writes nothing


def test_lc_norm_tok_is_the_multi30k_repositorys_pipeline() -> None:
    """Lowercase, then Moses normalisation (typographic quotes become ASCII), then Moses tokenization with its
    escaping; the expected line is the one the Multi30k repository's ``tok/test_2016_flickr.lc.norm.tok.de`` holds
    for this caption, typed here with its ASCII quotes turned into typographic ones."""
    line = "Eine Frau auf einem Boot namens „El Corazon“ lässt schwarze Gewichte ins Wasser fallen."
    expected = "eine frau auf einem boot namens &quot; el corazon &quot; lässt schwarze gewichte ins wasser fallen ."
    assert lc_norm_tok([line]) == [expected]


def test_tokenized_bleu_counts_the_given_tokens_only() -> None:
    """multi-bleu.perl splits on spaces and nothing else, so the text must be tokenized first: a final period left
    on its word is a different token (13a would split it off and score the pair 100)."""
    reference = ["ein mann in einem blau-weißen t-shirt steht auf der straße ."]
    glued = ["ein mann in einem blau-weißen t-shirt steht auf der straße."]
    assert TOKENIZED.corpus_score(reference, [reference]).score == pytest.approx(100.0)
    assert BLEU().corpus_score(glued, [reference]).score == pytest.approx(100.0)
    assert TOKENIZED.corpus_score(glued, [reference]).score < 90
