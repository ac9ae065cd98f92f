"""What a run leaves for its user: prediction files and their printed paths, TensorBoard panels, the ``test``
summary, and warnings that say what really happened."""

from __future__ import annotations

import json
import logging
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_MODEL_ARGS
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import check, cli
from torch_handle.cli import main
from torch_handle.data import SummarizationDataModule
from torch_handle.metrics import bleu_signature, chrf_signature
from torch_handle.module import Seq2SeqModule

pytestmark = pytest.mark.usefixtures("single_thread")

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.yaml")
INPUTS = "the dog sees a cat\n\nmy two old birds helped the king\n"  # a blank line keeps its place


def _scalars(root: Path) -> dict[str, list[float]]:
    """Every scalar the run folder's TensorBoard event files hold, by tag."""
    scalars: dict[str, list[float]] = {}
    for events in sorted(root.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events)).Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(event.value for event in accumulator.Scalars(tag))
    return scalars


def _fit(root: Path, *extra: str) -> None:
    """The demo config's fit, tiny, with its default logger, logging every step."""
    main(
        [
            "fit",
            f"--config={DEMO}",
            f"--trainer.default_root_dir={root}",
            "--trainer.limit_val_batches=1",
            "--trainer.log_every_n_steps=1",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            "--data.init_args.demo_size=300",
            "--data.init_args.bpe_vocab_size=300",
            "--model.generate_every_n_val_epochs=0",
            *TINY_MODEL_ARGS,
            *extra,
        ]
    )


@pytest.mark.slow
def test_tensorboard_names_learning_rates_logs_tokens_per_second_and_the_unsmoothed_loss(tmp_path: Path) -> None:
    _fit(tmp_path / "smoothed", "--trainer.max_steps=4", "--throughput.window_size=2")
    logged = _scalars(tmp_path / "smoothed")
    assert {"lr/decay", "lr/no_decay", "train/loss", "train/objective", "val/loss", "val/objective"} <= logged.keys()
    assert "hp_metric" not in logged, "Lightning's placeholder hp_metric = -1 is logged"
    assert logged["lr/no_decay"] == logged["lr/decay"] and logged["lr/decay"][-1] > logged["lr/decay"][0]
    tokens = logged["train/device/items_per_sec"]  # the Throughput callback, on without being configured
    assert tokens and all(t > 0 for t in tokens)
    # The same first batch on the same initial weights: train/loss is the cross entropy without smoothing, so
    # it does not depend on label_smoothing, and equals the objective of a run without smoothing.
    _fit(tmp_path / "plain", "--trainer.max_steps=1", "--model.label_smoothing=0")
    plain = _scalars(tmp_path / "plain")
    assert logged["train/loss"][0] == pytest.approx(plain["train/loss"][0], rel=1e-6)
    assert plain["train/objective"][0] == pytest.approx(plain["train/loss"][0], rel=1e-6)
    assert logged["train/objective"][0] != pytest.approx(logged["train/loss"][0], rel=1e-4)
    assert logged["val/ppl"] == pytest.approx([torch.tensor(v).exp().item() for v in logged["val/loss"]], rel=1e-5)


def _versions(run: Path) -> list[str]:
    return sorted(path.name for path in run.rglob("version_*"))


@pytest.mark.slow
def test_predict_writes_a_new_file_each_run_and_prints_its_path_on_its_own_line(
    tiny_demo_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = tmp_path / "in.txt"
    inputs.write_text(INPUTS, encoding="utf-8")
    versions = _versions(tiny_demo_run)
    before = set(tiny_demo_run.glob("predictions-*.txt"))
    args = ["predict", f"--config={DEMO}", f"--trainer.default_root_dir={tiny_demo_run}"]
    args += [f"--data.init_args.predict_file={inputs}", "--trainer.enable_progress_bar=true"]
    printed = []
    for _ in range(2):  # within one second: the second run must not overwrite the first's file
        main(args)
        printed.append(capsys.readouterr().out.split("\n"))  # "\r" redraws the bar; a line ends at "\n"
    written = sorted(set(tiny_demo_run.glob("predictions-*.txt")) - before)
    assert len(written) == 2 and all(re.fullmatch(r"predictions-\d{8}-\d{6}(-\d+)?\.txt", p.name) for p in written)
    # each run printed its own file's path, on a line of its own (a second within one second gets "-1")
    assert [[line for line in lines if "predictions-" in line] for lines in printed] in (
        [[str(path)] for path in written],
        [[str(path)] for path in reversed(written)],
    )
    text = written[0].read_text(encoding="utf-8")
    assert text.count("\n") == 3 and written[1].read_text(encoding="utf-8") == text  # one line per input line
    assert _versions(tiny_demo_run) == versions, "predict created a logger folder"

    # ``-``: standard output holds the predictions and nothing else, in the real process.
    run = check(cli([*args[:-1], "--prediction_writer.output=-"]))
    assert run.stdout == text, run.stderr[-3000:]
    assert set(tiny_demo_run.glob("predictions-*.txt")) - before == set(written)


@pytest.mark.slow
def test_test_ends_with_the_score_its_signature_and_the_checkpoint(
    tiny_demo_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    versions = _versions(tiny_demo_run)
    main(["test", f"--config={DEMO}", f"--trainer.default_root_dir={tiny_demo_run}", "--trainer.limit_test_batches=2"])
    out = capsys.readouterr().out
    table = re.search(r"test/bleu[\s│|]+([\d.]+)", out)  # Lightning's plain or rich table
    assert table is not None, out
    chrf = re.search(r"test/chrf[\s│|]+([\d.]+)", out)
    assert chrf is not None, out
    tail = out[max(table.end(), chrf.end()) :].strip().splitlines()[-3:]  # the summary follows Lightning's table
    assert tail == [
        f"BLEU {float(table.group(1)):.2f}  (sacreBLEU {bleu_signature('13a')})",
        f"chrF2 {float(chrf.group(1)):.2f}  (sacreBLEU {chrf_signature()})",
        f"checkpoint: {tiny_demo_run / 'checkpoints' / 'last.ckpt'}",
    ]
    assert _versions(tiny_demo_run) == versions, "test created a logger folder"
    assert not (tiny_demo_run / "config.yaml").exists(), "evaluation without a logger saves no config"


def test_summarization_summary_names_the_rouge_variant_and_the_lead_baseline() -> None:
    module = Seq2SeqModule(task="summarization", vocab_size=300, lead_words=3)
    keys = ("rouge1", "rouge2", "rougeL", "rougeLsum")
    logged = {
        f"test/{prefix}{key}": torch.tensor(10.0 * i + j)
        for i, prefix in enumerate(("", "lead_"))
        for j, key in enumerate(keys)
    }
    model, lead, signature = module.summary(logged, "test")
    assert model == "model: ROUGE-1 0.00  ROUGE-2 1.00  ROUGE-L 2.00  ROUGE-Lsum 3.00"
    assert lead == "Lead-3 baseline: ROUGE-1 10.00  ROUGE-2 11.00  ROUGE-L 12.00  ROUGE-Lsum 13.00"
    assert signature.startswith("(rouge-score ") and "mean F1, Porter stemmer" in signature
    assert module.summary({"test/loss": torch.tensor(1.0)}, "test") == []  # nothing decoded: no summary


def _jsonl(path: Path, documents: list[str]) -> Path:
    path.write_text("".join(json.dumps({"document": d, "summary": "a short summary"}) + "\n" for d in documents))
    return path


def test_truncation_is_reported_only_where_documents_are_cut(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Training cuts a long document (warned); test and predict summarize it whole, hierarchically (not warned)."""
    documents = ["a short story", " ".join(f"word{i}" for i in range(100))]
    path = _jsonl(tmp_path / "docs.jsonl", documents)
    data = SummarizationDataModule(
        train_file=str(path), test_file=str(path), predict_file=str(path), bpe_vocab_size=300, max_source_tokens=16
    )
    with pytest.warns(UserWarning, match=rf"{path}: truncated 1 of 2 sources to 15 tokens"):
        data.setup("fit")
    with warnings.catch_warnings(), caplog.at_level(logging.INFO):
        warnings.simplefilter("error")  # any warning fails
        data.setup("test")
        data.setup("predict")
    said = f"{path}: 1 of 2 sources over 15 tokens are read whole, in windows (or cut: --model.long_documents cut)"
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith(said)] == [
        f"{said}; the test loss reads their first 15",
        said,
    ]
    cut = [flag for batch in data.test_dataloader() for flag in batch["src_truncated"]]
    assert sorted(cut) == [False, True]  # the module summarizes the long one hierarchically


def test_a_model_that_cuts_long_documents_has_their_truncation_warned(tmp_path: Path) -> None:
    """``--model.long_documents cut`` (the shipped summarization config's): test and predict cut as training does,
    and say so, not that they read the documents whole."""
    path = _jsonl(tmp_path / "docs.jsonl", ["a short story", " ".join(f"word{i}" for i in range(100))])
    data = SummarizationDataModule(
        train_file=str(path), test_file=str(path), predict_file=str(path), bpe_vocab_size=300, max_source_tokens=16
    )
    data.trainer = SimpleNamespace(lightning_module=SimpleNamespace(hparams=SimpleNamespace(long_documents="cut")))
    for stage in ("test", "predict"):
        with pytest.warns(UserWarning, match=rf"^{re.escape(str(path))}: truncated 1 of 2 sources to 15 tokens"):
            data.setup(stage)
