"""Installed like a package: a fresh virtualenv gets the ``torch-handle`` command, the shipped configs by name,
``torch_handle.callbacks`` (and no top-level ``callbacks``), and trains and tests the demo outside the checkout;
a ZeRO config without DeepSpeed says how to install it."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.helpers import ROOT, TINY_MODEL, env
from torch_handle import __version__
from torch_handle.cli import main


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
    pip = [sys.executable, "-m", "pip", "--python", str(home / "bin" / "python")]
    _run([*pip, "install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet", str(ROOT)], home)
    return home


@pytest.mark.slow
def test_installed_command_trains_and_tests_the_demo_outside_the_checkout(installed: Path, tmp_path: Path) -> None:
    python, command = installed / "bin" / "python", installed / "bin" / "torch-handle"
    where = _run([str(python), "-c", _WHERE], tmp_path).stdout.split()
    assert where[0].startswith(str(installed)), where  # the venv's copy, not the checkout
    assert where[1:] == ["None", "True", "True"], where  # no top-level callbacks; callbacks and configs inside
    assert _run([str(command), "--version"], tmp_path).stdout == f"torch-handle {__version__}\n"
    tiny = [
        *TINY_MODEL, "--model.transformer.max_len", "64", "--model.max_new_tokens", "16",
        "--data.init_args.demo_size", "400", "--data.init_args.bpe_vocab_size", "300",
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", "run", "--trainer.max_epochs", "1",
    ]  # fmt: skip
    _run([str(command), "fit", "--config", "demo", *tiny], tmp_path)
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
    tested = _run([str(command), "test", "--config", "demo", *tiny], tmp_path)
    assert "test/bleu" in tested.stdout


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
        "error: --config zero4: no such file, and no shipped config of that name (shipped: ddp, demo, fsdp, "
        "multi30k, summarization, summarization_32k, zero1, zero2, zero3, zero3_offload)"
    )


def test_zero_config_without_deepspeed_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("torch_handle.strategies._DEEPSPEED_AVAILABLE", False)  # as without the extra
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
    assert " export [-h] checkpoint output" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "prepare (download a corpus" in text and "export (a checkpoint to one safetensors file" in text
    assert "shipped config's name: ddp, demo, fsdp," in text
