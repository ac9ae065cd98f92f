"""``python cli.py`` end to end: fit, test on the last checkpoint, predict to a file, and one-line errors."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL_ARGS

from cli import main

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.yaml")
QUIET = ["--trainer.enable_progress_bar=false"]
SUMMARIZATION = "--data=torch_handle.data.SummarizationDataModule"

pytestmark = pytest.mark.usefixtures("single_thread")


def _messages(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(record.getMessage() for record in caplog.records)


@pytest.mark.slow
def test_test_without_ckpt_path_uses_the_last_checkpoint(tiny_demo_run: Path, caplog: pytest.LogCaptureFixture) -> None:
    last = tiny_demo_run / "checkpoints" / "last.ckpt"
    assert last.is_file() and (tiny_demo_run / "checkpoints" / "tokenizer.json").is_file()
    with caplog.at_level(logging.INFO):
        # No model options: the tiny model's hyper-parameters come from the checkpoint, not demo.yaml.
        main(["test", f"--config={DEMO}", f"--trainer.default_root_dir={tiny_demo_run}", *QUIET])
    assert f"Restoring states from the checkpoint path at {last}" in _messages(caplog)


@pytest.mark.slow
def test_predict_writes_one_output_per_input_line(
    tiny_demo_run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    inputs = tmp_path / "in.txt"
    inputs.write_text("the dog sees a cat\n\nmy two old birds helped the king\n", encoding="utf-8")
    with caplog.at_level(logging.INFO):
        main(
            [
                "predict",
                f"--config={DEMO}",
                f"--trainer.default_root_dir={tiny_demo_run}",
                f"--data.init_args.predict_file={inputs}",
                *QUIET,
            ]
        )
    written = re.search(r"Wrote (\d+) predictions to (\S+)", _messages(caplog))
    assert written is not None, "predict must say where it wrote its output"
    output = Path(written.group(2))
    assert int(written.group(1)) == 3
    assert output.read_text(encoding="utf-8").count("\n") == 3  # the blank input line keeps its place


# --- bad input: one line naming the problem, exit status non-zero, nothing half-written -------------------


def _write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def _parallel(tmp_path: Path, src: bytes | str, tgt: bytes | str) -> list[str]:
    data = tmp_path / "data"
    _write(data / "train.en", src)
    _write(data / "train.de", tgt)
    return ["fit", f"--data.init_args.data_dir={data}"]


def _unequal_lines(tmp_path: Path) -> list[str]:
    return _parallel(tmp_path, "a b\nc d\ne f\n", "x\ny\n")


def _empty_file(tmp_path: Path) -> list[str]:
    return _parallel(tmp_path, "", "x\n")


def _missing_file(tmp_path: Path) -> list[str]:
    data = tmp_path / "data"
    _write(data / "train.en", "a b\n")
    return ["fit", f"--data.init_args.data_dir={data}"]


def _not_utf8(tmp_path: Path) -> list[str]:
    return _parallel(tmp_path, b"good line\nbad \xff byte\n", b"x\ny\n")


def _json_without_field(tmp_path: Path) -> list[str]:
    path = _write(tmp_path / "train.jsonl", json.dumps({"document": "a b c", "abstract": "x"}) + "\n")
    return ["fit", SUMMARIZATION, f"--data.train_file={path}"]


def _document_too_long(tmp_path: Path) -> list[str]:
    document = " ".join(f"word{i}" for i in range(200))
    path = _write(tmp_path / "train.jsonl", json.dumps({"document": document, "summary": "short"}) + "\n")
    return [
        "fit",
        SUMMARIZATION,
        f"--data.train_file={path}",
        "--data.bpe_vocab_size=300",
        "--data.max_source_tokens=16",
        "--data.truncation=error",
        *TINY_MODEL_ARGS,
    ]


def _unknown_config_key(tmp_path: Path) -> list[str]:
    config = _write(tmp_path / "typo.yaml", "model:\n  lr: 0.001\n  learning_rate: 0.001\n")
    return ["fit", f"--config={DEMO}", f"--config={config}"]


def _missing_checkpoint(tmp_path: Path) -> list[str]:
    return ["test", f"--config={DEMO}", f"--ckpt_path={tmp_path / 'nope.ckpt'}"]


def _not_a_checkpoint(tmp_path: Path) -> list[str]:
    tokenizer = _write(tmp_path / "tokenizer.json", '{"version": "1.0"}')  # a real mix-up: the file beside it
    return ["test", f"--config={DEMO}", f"--ckpt_path={tokenizer}"]


BAD_INPUTS: dict[str, tuple[Callable[[Path], list[str]], tuple[str, ...]]] = {
    "unequal_line_counts": (_unequal_lines, ("train.en has 3 lines", "train.de has 2")),
    "empty_file": (_empty_file, ("train.en", "empty")),
    "missing_file": (_missing_file, ("train.de", "not found")),
    "not_utf8": (_not_utf8, ("train.en:2:", "not UTF-8")),
    "json_without_field": (_json_without_field, ("train.jsonl:1:", "'summary'", "--data.summary_field")),
    "document_too_long": (_document_too_long, ("train.jsonl:1:", "--data.max_source_tokens")),
    "unknown_config_key": (_unknown_config_key, ("learning_rate",)),
    "missing_checkpoint": (_missing_checkpoint, ("nope.ckpt", "does not exist")),
    "not_a_checkpoint": (_not_a_checkpoint, ("tokenizer.json", "not a checkpoint")),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_exits_with_one_line_and_writes_nothing(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_args, parts = BAD_INPUTS[case]
    root = tmp_path / "run"
    args = [*make_args(tmp_path), f"--trainer.default_root_dir={root}", *QUIET]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    code = exit_info.value.code
    assert code not in (0, None)
    # User errors exit with their message; option errors are printed by the parser, which exits with 2.
    message = code if isinstance(code, str) else capsys.readouterr().err.strip()
    assert message.startswith("error: ") and "\n" not in message, message
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"
    assert not list(root.rglob("*.ckpt")), "a failed run must not leave a checkpoint"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing_file", "not_utf8"])
def test_bad_predict_file_writes_no_predictions(tiny_demo_run: Path, tmp_path: Path, case: str) -> None:
    predict_file = tmp_path / "in.txt"
    if case == "not_utf8":
        _write(predict_file, b"the dog sees a cat\nthe cat \xe4 sees\n")
    output = tmp_path / "predictions.txt"
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "predict",
                f"--config={DEMO}",
                f"--trainer.default_root_dir={tiny_demo_run}",
                f"--data.init_args.predict_file={predict_file}",
                f"--prediction_writer.output={output}",
                *QUIET,
            ]
        )
    expected = f"{predict_file}:2: not UTF-8" if case == "not_utf8" else f"{predict_file}: file not found"
    assert isinstance(exit_info.value.code, str) and expected in exit_info.value.code
    assert not output.exists()


def test_process_prints_one_error_line_and_no_traceback(tmp_path: Path) -> None:
    """The real process: the message is stderr's last line, with no traceback before it."""
    run = subprocess.run(
        [sys.executable, "cli.py", *_not_utf8(tmp_path), f"--trainer.default_root_dir={tmp_path / 'run'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    assert "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'data' / 'train.en'}:2: not UTF-8 (byte 0xff); re-save the file as UTF-8"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_fit_checkpoint_loads_with_weights_only(tiny_demo_run: Path) -> None:
    checkpoint = torch.load(tiny_demo_run / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["hyper_parameters"]["transformer"]["d_model"] == 32  # the CLI passes the config as a dict
    assert checkpoint["global_step"] == 8
