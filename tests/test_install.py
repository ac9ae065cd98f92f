"""Installed like a package: a fresh virtualenv gets the ``torch-handle`` command, the shipped configs by name,
``torch_handle.callbacks`` (and no top-level ``callbacks``), and trains and tests the demo outside the checkout;
a ZeRO config without DeepSpeed says how to install it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from conftest import CorpusServer

from tests.helpers import ROOT, TINY_MODEL, env
from torch_handle import __version__
from torch_handle.cli import main
from torch_handle.commands import config_path, shipped_configs

UNSHIPPED = (".git", "build", "*.egg-info", "runs", "__pycache__", ".pytest_cache", ".ruff_cache")


def _run(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    run = subprocess.run(args, cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, f"{' '.join(map(str, args))}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv with this checkout installed (not editable). It sees the system's packages for the
    dependencies, so nothing is downloaded; the project itself comes only from the venv."""
    home = tmp_path_factory.mktemp("venv")
    venv.create(home, system_site_packages=True, with_pip=False)
    source = tmp_path_factory.mktemp("source") / "torch-handle"  # a clean copy: no stale build/ folder
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(*UNSHIPPED))
    pip = [sys.executable, "-m", "pip", "--python", str(home / "bin" / "python")]
    _run([*pip, "install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet", str(source)], home)
    return home


@pytest.mark.slow
def test_a_fresh_install_prepares_multi30k_trains_tests_and_translates_from_python(
    installed: Path, corpus_server: CorpusServer, tmp_path: Path
) -> None:
    """The README's path for a new user, outside the checkout: install, prepare, fit, test, then Python."""
    python, command = str(installed / "bin" / "python"), str(installed / "bin" / "torch-handle")
    where = _run([python, "-c", _WHERE], tmp_path).stdout.split()
    assert where[0].startswith(str(installed)), where  # the venv's copy, not the checkout
    assert where[1:] == ["None", "True", "True"], where  # no top-level callbacks; callbacks and configs inside
    assert _run([command, "--version"], tmp_path).stdout == f"torch-handle {__version__}\n"

    splits = ["train", "val", "test_2016_flickr"]  # those the local server has
    _run([command, "prepare", "multi30k", "--mirror", f"{corpus_server.url}/multi30k", "--splits", *splits], tmp_path)
    tiny = [
        "--config", "multi30k", *TINY_MODEL, "--model.max_new_tokens", "16", "--data.init_args.bpe_vocab_size", "500",
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", "run",
    ]  # fmt: skip
    _run([command, "fit", *tiny, "--trainer.max_steps", "20", "--trainer.limit_val_batches", "2"], tmp_path)
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
    tested = _run([command, "test", *tiny, "--trainer.limit_test_batches", "2"], tmp_path)
    assert "test/bleu" in tested.stdout

    sentences = ["A man in an orange hat starring at something.", "Two dogs play in the snow."]
    translated = _run([python, "-c", _TRANSLATE, *sentences], tmp_path).stdout.splitlines()
    predicted = tmp_path / "predicted.txt"
    (tmp_path / "sentences.en").write_text("".join(f"{line}\n" for line in sentences))
    predict = ["--data.init_args.predict_file", "sentences.en", "--prediction_writer.output", str(predicted)]
    _run([command, "predict", *tiny[2:], "--ckpt_path", "run/checkpoints/last.ckpt", *predict], tmp_path)
    assert translated == predicted.read_text().splitlines()  # the Python API writes what predict writes


_TRANSLATE = """
import sys, torch_handle
print("\\n".join(torch_handle.load("run").translate(sys.argv[1:])))
"""
_WHERE = """
import importlib.util, torch_handle, torch_handle.callbacks.checkpointing as c
from torch_handle.cli import shipped_configs
print(torch_handle.__file__, importlib.util.find_spec("callbacks"), c.__file__.startswith(torch_handle.__path__[0]),
      (shipped_configs() / "zero2.yaml").is_file())
"""


def test_config_by_unknown_name_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "zero4"])
    assert str(exit_info.value.code) == (
        "error: --config zero4: no such file, and no shipped config of that name (shipped: ddp, demo, ema, fsdp, "
        "fsdp2_tp, mlflow, multi30k, multi30k_gpu, pp, pretrain, qmsum, summarization, summarization_32k, "
        "summarization_cp, summarization_led, tp, translation_opus_mt, wandb, zero1, zero2, zero3, zero3_offload)"
    )


def test_a_folder_named_like_a_shipped_config_does_not_hide_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Run from where the run folder ``demo/`` or the data folder ``multi30k/`` lies, ``--config demo`` is still the
    shipped config; a file of that name would win."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()
    assert config_path("demo") == str(shipped_configs() / "demo.yaml")
    (tmp_path / "mine").write_text("seed_everything: 1\n")
    assert config_path("mine") == "mine"


def test_zero_config_without_deepspeed_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("torch_handle.strategies.deepspeed._DEEPSPEED_AVAILABLE", False)  # as without the extra
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "demo", "--config", "zero2", "--trainer.default_root_dir", str(tmp_path)])
    assert str(exit_info.value.code) == (
        "error: the ZeRO configs need DeepSpeed: pip install 'torch-handle[deepspeed]'"
    )
    assert not any(tmp_path.iterdir())  # nothing written


def test_top_level_commands(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--version"])
    assert capsys.readouterr().out == f"torch-handle {__version__}\n"
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert " export [-h] [--format {safetensors,ctranslate2,hf}] checkpoint output" in usage
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "prepare (download a corpus" in text and "export (a checkpoint to one safetensors file" in text
    assert "shipped config's name: ddp, demo, ema, fsdp," in text
