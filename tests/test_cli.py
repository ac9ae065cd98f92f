"""``python cli.py`` end to end: fit, test on the last checkpoint, predict to a file, and one-line errors
(what runs leave for their user, files and printed lines: ``test_outputs.py``)."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from conftest import TINY_MODEL_ARGS

from tests.helpers import RUN_TIMEOUT
from torch_handle import cli as cli_module
from torch_handle.cli import main
from torch_handle.commands import PACKAGE, start, typed_command
from torch_handle.data.tokenizer import Tokenizer

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
@pytest.mark.parametrize("case", ["missing_file", "not_utf8", "folder", "device"])
def test_bad_predict_file_writes_no_predictions(tiny_demo_run: Path, tmp_path: Path, case: str) -> None:
    predict_file = {"folder": tmp_path, "device": Path("/dev/zero")}.get(case, tmp_path / "in.txt")
    if case == "not_utf8":
        _write(predict_file, b"the dog sees a cat\nthe cat \xe4 sees\n")
    written = set(tiny_demo_run.glob("predictions-*.txt"))  # the default output's names
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "predict",
                f"--config={DEMO}",
                f"--trainer.default_root_dir={tiny_demo_run}",
                f"--data.init_args.predict_file={predict_file}",
                *QUIET,
            ]
        )
    assert (
        exit_info.value.code
        == {
            "missing_file": f"error: {predict_file}: file not found; check the path",
            "not_utf8": f"error: {predict_file}:2: not UTF-8 (byte 0xe4); re-save the file as UTF-8",
            "folder": f"error: {tmp_path} is a folder, not a file; pass the path of a file in it",
            "device": "error: /dev/zero is not a regular file (a device, a pipe or a socket); pass the path of a file",
        }[case]
    )
    assert set(tiny_demo_run.glob("predictions-*.txt")) == written


def test_a_wrong_data_key_names_its_class_and_where_its_options_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """jsonargparse reports a bad key under ``data`` (a class or None) as a Union of failures; the line keeps the
    class's own complaint and points to its options."""
    config = tmp_path / "typo.yaml"
    config.write_text("data:\n  init_args:\n    train_fil: x\n")
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", "demo", "--config", str(config), f"--trainer.default_root_dir={tmp_path / 'run'}"])
    assert exit_.value.code == 2
    line = capsys.readouterr().err
    data = "torch_handle.data.TranslationDataModule"
    assert line.startswith(f"error: --data ({data}): Option 'train_fil' is not accepted (see "), line
    assert line.endswith(f" fit --data.help {data})\n") and line.count("\n") == 1, line
    assert not (tmp_path / "run").exists()


def test_ctrl_c_in_setup_is_one_line_and_exit_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C before the trainer runs (parsing the options, training the tokenizer): one line, no traceback, the
    status a shell reports for an interrupted command."""

    def interrupted(**_: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_module, "TorchHandleCLI", interrupted)
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", "demo"])
    assert exit_.value.code == 130
    assert capsys.readouterr().err == (
        "stopped by SIGINT (Ctrl-C) in setup (the options, the tokenizer): nothing was saved\n"
    )


def test_ctrl_c_while_the_libraries_import_is_one_line_and_exit_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C in the seconds torch and Lightning take to import, before any of our handling is loaded."""

    class Importing:
        def __getattr__(self, name: str) -> object:
            raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "torch_handle.cli", Importing())
    with pytest.raises(SystemExit) as exit_:
        start()
    assert exit_.value.code == 130
    assert capsys.readouterr().err == "stopped by SIGINT (Ctrl-C) while starting: nothing was saved\n"


@pytest.mark.slow
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


# --- a checkpoint decides the architecture; the user's decoding and backend options win ---------------------


def _tiny(run: Path) -> list[str]:
    return [f"--config={DEMO}", f"--trainer.default_root_dir={run}", *QUIET]


@pytest.mark.slow
def test_decoding_options_on_the_command_line_win_over_the_checkpoint(
    tiny_demo_run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    inputs = _write(tmp_path / "in.txt", "the dog sees a cat\nmy two old birds helped the king\n")
    output = tmp_path / "out.txt"
    args = [*_tiny(tiny_demo_run), f"--data.init_args.predict_file={inputs}", f"--prediction_writer.output={output}"]
    with caplog.at_level(logging.INFO):
        main(["predict", *args, "--model.num_beams=1", "--model.max_new_tokens=1", "--model.length_penalty=0.5"])
    # The checkpoint says num_beams=2, max_new_tokens=8, length_penalty=1.0; the run says what it used.
    used = re.search(r"Model from \S+: (.*)", _messages(caplog))
    assert used is not None, "a run from a checkpoint must say which decoding options it uses"
    assert {"num_beams=1", "max_new_tokens=1", "length_penalty=0.5"} <= set(used.group(1).split(", "))
    assert len(output.read_text(encoding="utf-8").splitlines()) == 2
    # The typed value reaches the module: one that does not fit the checkpoint's max_len=128 is refused.
    assert _cli_error(["predict", *args, "--model.max_new_tokens=200"]) == (
        "error: max_new_tokens=200 does not fit max_len=128 of position='sinusoidal': lower max_new_tokens or "
        "raise transformer.max_len"
    )


@pytest.mark.slow
def test_print_config_shows_the_checkpoint_architecture_and_the_typed_options(
    tiny_demo_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "test",
                *_tiny(tiny_demo_run),
                "--model.num_beams=3",
                "--model.transformer.attention_backend=naive",
                "--print_config",
            ]
        )
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)["model"]
    assert printed["transformer"]["d_model"] == 32  # the checkpoint's, not demo.yaml's 128
    assert printed["num_beams"] == 3 and printed["transformer"]["attention_backend"] == "naive"
    assert printed["max_new_tokens"] == 40  # demo.yaml's, set explicitly, over the checkpoint's 8


def _cli_error(args: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    code = exit_info.value.code
    assert isinstance(code, str), f"expected an error message, got exit code {code!r}"
    return code


@pytest.mark.slow
def test_architecture_option_contradicting_the_checkpoint_is_one_line(tiny_demo_run: Path, tmp_path: Path) -> None:
    last = tiny_demo_run / "checkpoints" / "last.ckpt"
    contradiction = (
        f"error: --model.transformer.{{key}}={{typed}} contradicts the checkpoint {last}, trained with "
        "transformer.{key}={saved}: drop the option (the architecture comes from the checkpoint) or pass the "
        "matching checkpoint"
    )
    message = _cli_error(["test", *_tiny(tiny_demo_run), "--model.transformer.d_model=64"])
    assert message == contradiction.format(key="d_model", typed=64, saved=32)
    # Resuming a differently sized model: the same line, before anything is written.
    root = tmp_path / "run"
    args = ["fit", f"--config={DEMO}", f"--trainer.default_root_dir={root}", *TINY_MODEL_ARGS, *QUIET]
    message = _cli_error([*args, "--model.transformer.d_ff=48", f"--ckpt_path={last}"])
    assert message == contradiction.format(key="d_ff", typed=48, saved=64)
    assert not root.exists()


@pytest.mark.slow
def test_predict_line_longer_than_the_model_context_is_cut_with_a_warning(tiny_demo_run: Path, tmp_path: Path) -> None:
    long_line = " ".join(["the dog sees a cat"] * 60)  # ~300 tokens; the model's max_len is 128
    inputs = _write(tmp_path / "in.txt", f"the cat\n{long_line}\n")
    output = tmp_path / "out.txt"
    args = [*_tiny(tiny_demo_run), f"--data.init_args.predict_file={inputs}", f"--prediction_writer.output={output}"]
    trained = r"the trained model's position tables read at most 128 positions: lowered --data.max_source_tokens=512 to"
    with pytest.warns(UserWarning, match=trained):
        main(["predict", *args, "--model.num_beams=1", "--data.init_args.max_source_tokens=512"])
    assert len(output.read_text(encoding="utf-8").splitlines()) == 2
    # The typed value reaches the module: one that does not fit the checkpoint's max_len=128 is refused.
    assert _cli_error(["predict", *args, "--model.max_new_tokens=200"]) == (
        "error: max_new_tokens=200 does not fit max_len=128 of position='sinusoidal': lower max_new_tokens or "
        "raise transformer.max_len"
    )


# --- one-line errors from constructors, module numbers and fit checkpoints, nothing written ----------------


def _fit(root: Path, *extra: str) -> list[str]:
    """A tiny ``fit`` that, if its error went unnoticed, would train one step and write a checkpoint."""
    return [
        "fit", f"--trainer.default_root_dir={root}", *TINY_MODEL_ARGS, "--data.init_args.bpe_vocab_size=300",
        "--data.init_args.demo_size=200", "--trainer.max_steps=1", "--trainer.limit_val_batches=0", *extra,
    ]  # fmt: skip


def _truncated_checkpoint(path: Path) -> Path:
    """The first half of a checkpoint, as a killed copy leaves it."""
    torch.save({"state_dict": {"weight": torch.zeros(4096)}}, path)
    return _write(path, path.read_bytes()[: path.stat().st_size // 2])


def _truncated_beside_another(folder: Path) -> Path:
    """A truncated ``last.ckpt`` beside an epoch's checkpoint, as a run killed while copying its last one leaves it."""
    torch.save({"state_dict": {}}, folder / "epoch.ckpt")
    _write(folder / "empty.ckpt", "")  # newer, but no hint: nothing to resume from
    return _truncated_checkpoint(folder / "last.ckpt")


def _evil_checkpoint(path: Path) -> Path:
    """A torch.save archive that names ``state_dict`` and, when unpickled, runs a command."""

    class Evil:
        def __reduce__(self) -> tuple:
            return (os.system, (f"touch {path.parent / 'pwned'}",))

    torch.save({"state_dict": {}, "payload": Evil()}, path)
    return path


ONE_LINE_ERRORS: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "missing_data_dir": (
        lambda t: _fit(t / "run", f"--data.init_args.data_dir={t / 'nope'}"),
        "error: data_dir {t}/nope not found; pass an existing folder, or omit it for the demo",
    ),
    "heads_do_not_divide_width": (
        lambda t: _fit(t / "run", "--model.transformer.num_heads=3"),
        "error: d_model=32 is not divisible by num_heads=3: choose num_heads that divides d_model",
    ),
    "attention_dropout_one": (
        lambda t: _fit(t / "run", "--model.transformer.attention_dropout=1"),
        "error: attention_dropout must be in [0, 1), got 1.0",
    ),
    "zero_max_tokens": (
        lambda t: _fit(t / "run", "--data.init_args.max_tokens=0"),
        "error: --data.max_tokens must be at least 1, got 0",
    ),
    "negative_lr": (lambda t: _fit(t / "run", "--model.lr=-0.001"), "error: --model.lr must be > 0, got -0.001"),
    "negative_warmup": (
        lambda t: _fit(t / "run", "--model.warmup_steps=-1"),
        "error: --model.warmup_steps must be >= 0, got -1",
    ),
    "label_smoothing_one": (
        lambda t: _fit(t / "run", "--model.label_smoothing=1"),
        "error: --model.label_smoothing must be in [0, 1), got 1.0",
    ),
    "zero_beams": (lambda t: _fit(t / "run", "--model.num_beams=0"), "error: --model.num_beams must be >= 1, got 0"),
    "zero_new_tokens": (
        lambda t: _fit(t / "run", "--model.max_new_tokens=0"),
        "error: --model.max_new_tokens must be >= 1, got 0",
    ),
    "top_k_without_monitor": (
        lambda t: _fit(t / "run", "--checkpoint.save_top_k=2"),
        "error: --checkpoint.save_top_k=2 keeps the best checkpoints by a metric: set --checkpoint.monitor "
        "(e.g. val/loss), or save_top_k to -1 (all), 0 or 1 (the last)",
    ),
    "fit_random_checkpoint": (
        lambda t: _fit(t / "run", f"--ckpt_path={_write(t / 'random.ckpt', random.Random(0).randbytes(4096))}"),
        "error: {t}/random.ckpt is not a checkpoint (not a torch.save archive): pass a .ckpt file",
    ),
    "fit_truncated_checkpoint": (
        lambda t: _fit(t / "run", f"--ckpt_path={_truncated_checkpoint(t / 'truncated.ckpt')}"),
        "error: {t}/truncated.ckpt is not a Lightning checkpoint (a truncated or damaged archive): pass another .ckpt",
    ),
    "fit_truncated_checkpoint_beside_another": (
        lambda t: _fit(t / "run", f"--ckpt_path={_truncated_beside_another(t)}"),
        "error: {t}/last.ckpt is not a Lightning checkpoint (a truncated or damaged archive): pass another .ckpt, "
        "such as {t}/epoch.ckpt",
    ),
    "fit_malicious_checkpoint": (
        lambda t: _fit(t / "run", f"--ckpt_path={_evil_checkpoint(t / 'evil.ckpt')}"),
        "error: {t}/evil.ckpt pickles 'posix.system', which is not plain data, so loading {t}/evil.ckpt could run "
        "code: refused; load only checkpoints you trust, re-saved by torch-handle",
    ),
}


@pytest.mark.parametrize("case", ONE_LINE_ERRORS)
def test_user_error_is_one_line_and_writes_nothing(case: str, tmp_path: Path) -> None:
    make_args, expected = ONE_LINE_ERRORS[case]
    args = [*make_args(tmp_path), *QUIET]
    assert _cli_error(args) == expected.format(t=tmp_path)
    assert not (tmp_path / "run").exists() and not (tmp_path / "pwned").exists()


def test_an_abbreviated_option_is_refused_not_taken_for_the_full_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse would read ``--trainer.max_step`` as ``--trainer.max_steps``: a typo must not pass for an option."""
    with pytest.raises(SystemExit) as exit_info:
        main([*_fit(tmp_path / "run", "--trainer.max_step=3"), *QUIET])
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: unrecognized arguments: --trainer.max_step=3 (see ") and "\n" not in line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_constructor_error_is_one_line_in_the_real_process(tmp_path: Path) -> None:
    """The real process: an error raised inside jsonargparse's instantiation prints one line, exit 1."""
    args = _fit(tmp_path / "run", f"--data.init_args.data_dir={tmp_path / 'nope'}")
    run = subprocess.run([sys.executable, "cli.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1] == (
        f"error: data_dir {tmp_path / 'nope'} not found; pass an existing folder, or omit it for the demo"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_predict_on_two_processes_writes_every_line_once_in_order(tiny_demo_run: Path, tmp_path: Path) -> None:
    """Five inputs over two ranks (one repeated to even the shards out), batched by length: the same file as one
    process, in input order."""
    inputs = _write(tmp_path / "in.txt", "the dog\nthe cat sees a bird\nmy king\n\ntwo old birds helped the dog\n")
    outputs = {}
    for devices in (1, 2):
        outputs[devices] = tmp_path / f"out{devices}.txt"
        run = subprocess.run(
            [
                sys.executable,
                "cli.py",
                "predict",
                *_tiny(tiny_demo_run),
                f"--data.init_args.predict_file={inputs}",
                f"--prediction_writer.output={outputs[devices]}",
                "--data.init_args.predict_batch_size=2",
                "--model.num_beams=1",
                "--trainer.accelerator=cpu",
                f"--trainer.devices={devices}",
                "--trainer.strategy=ddp" if devices > 1 else "--trainer.strategy=auto",
            ],  # fmt: skip
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
        )
        assert run.returncode == 0, run.stderr[-4000:]
    single = outputs[1].read_text(encoding="utf-8")
    assert single.count("\n") == 5
    assert outputs[2].read_text(encoding="utf-8") == single


def test_a_new_fit_in_a_run_folder_with_a_checkpoint_is_one_line_and_keeps_it(tiny_demo_run: Path) -> None:
    """Lightning would save the new run as ``last-v1.ckpt`` while ``test``, ``predict`` and ``--ckpt_path last``
    kept reading the earlier run's ``last.ckpt``."""
    before = {path: path.stat().st_mtime_ns for path in tiny_demo_run.rglob("*")}
    message = _cli_error(["fit", f"--trainer.default_root_dir={tiny_demo_run}", *QUIET])
    assert message == (
        f"error: {tiny_demo_run / 'checkpoints' / 'last.ckpt'} is an earlier run's: continue it with --ckpt_path "
        "last, or start a new run in another --trainer.default_root_dir"
    )
    assert {path: path.stat().st_mtime_ns for path in tiny_demo_run.rglob("*")} == before


def test_fit_beside_a_live_run_with_a_checkpoint_names_the_run(tmp_path: Path) -> None:
    """The folder's last.ckpt is not an earlier run's while a run is still writing it: the live run is named."""
    hold = f"import torch_handle.atomic as a; a.lock_run_folder({str(tmp_path)!r}); print(flush=True); input()"
    live = subprocess.Popen([sys.executable, "-c", hold], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        live.stdout.readline()  # the folder is locked
        _write(tmp_path / "checkpoints" / "last.ckpt", b"")
        message = _cli_error(["fit", f"--config={DEMO}", f"--trainer.default_root_dir={tmp_path}", *QUIET])
    finally:
        live.communicate(b"\n", timeout=60)
    assert message == (
        f"error: {tmp_path} is in use by another run (pid {live.pid}); wait for it to end, or give this run its "
        "own --trainer.default_root_dir"
    )


@pytest.mark.slow
def test_a_run_folder_that_lost_its_tokenizer_decodes_with_the_checkpoints(tiny_demo_run: Path, tmp_path: Path) -> None:
    inputs = _write(tmp_path / "in.txt", "the dog sees a cat\nmy two old birds helped the king\n")
    damaged = tmp_path / "run"
    shutil.copytree(tiny_demo_run / "checkpoints", damaged / "checkpoints")
    (damaged / "checkpoints" / "tokenizer.json").unlink()
    outputs = []
    for run in (tiny_demo_run, damaged):
        output = tmp_path / f"{run.name}.txt"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            main(
                [
                    "predict",
                    *_tiny(run),
                    f"--data.init_args.predict_file={inputs}",
                    f"--prediction_writer.output={output}",
                ]
            )
        outputs.append(output.read_text(encoding="utf-8"))
    assert outputs[1] == outputs[0]
    checkpoints = damaged / "checkpoints"
    assert f"{checkpoints}/tokenizer.json is missing: using the tokenizer saved in {checkpoints}/last.ckpt" in [
        str(w.message) for w in caught
    ]


@pytest.mark.slow
def test_a_tokenizer_with_an_id_past_its_vocabulary_is_one_line(tmp_path: Path) -> None:
    """The Rust library would size a table by the largest id and abort the process allocating it."""
    data = json.loads(Tokenizer.train(["one two three four five six"] * 20, vocab_size=300).to_str())
    vocab = data["model"]["vocab"]
    token = next(token for token, id_ in vocab.items() if id_ == 100)
    vocab[token] = 1_500_000_000
    path = _write(tmp_path / "tokenizer.json", json.dumps(data))
    run = subprocess.run(
        [sys.executable, "cli.py", "fit", f"--trainer.default_root_dir={tmp_path}", f"--data.tokenizer_path={path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert run.returncode == 1, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1] == (
        f"error: {path} is not a torch-handle tokenizer file: not a tokenizer JSON (token {token!r} has id "
        "1500000000, outside 0-16777215)"
    )


@pytest.mark.parametrize(
    ("argv0", "expected"),
    [
        ("/usr/local/bin/torch-handle", "torch-handle export"),
        ("cli.py", "python cli.py export"),
        (str(PACKAGE / "cli.py"), "python -m torch_handle.cli export"),
        (str(PACKAGE / "export" / "__main__.py"), "python -m torch_handle.export"),
        ("/opt/venv/lib/ipykernel_launcher.py", "torch-handle export"),  # from Python: the installed command
    ],
)
def test_messages_name_the_command_the_user_typed(argv0: str, expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [argv0])
    assert typed_command("export") == expected


def test_an_unknown_option_names_the_command_the_user_typed() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "torch_handle.cli", "fit", "--nosuch"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        "error: unrecognized arguments: --nosuch (see python -m torch_handle.cli fit --help)"
    )
