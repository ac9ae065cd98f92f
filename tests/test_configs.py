"""Every shipped ``configs/*.yaml`` parses and instantiates through the CLI; ``--print_config`` and ``--help``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.test_pretrained_led import stand_in_led
from tests.test_pretrained_marian import stand_in_opus_mt
from torch_handle.cli import OneLineErrorParser, main
from torch_handle.data.base import Seq2SeqDataModule
from torch_handle.lightning_cli import TorchHandleCLI
from torch_handle.module import Seq2SeqModule

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
DEMO = ROOT / "configs" / "demo.yaml"
FAST = ["--data.init_args.bpe_vocab_size=300"]  # tokenizer training is the slow part of instantiation
# Hugging Face folders that configs start from (--model.init_from), which cannot be downloaded here: a tiny model of
# the family stands in, at the same path.
STAND_INS = {"led-base-16384": stand_in_led, "Helsinki-NLP/opus-mt-en-de": stand_in_opus_mt}


def _stack(path: Path) -> list[str]:
    """A strategy config (only ``trainer:`` settings, e.g. ddp or zero*) or one that sets a data config's options
    (``data.init_args``, e.g. multi30k_gpu) is meant to be stacked on a data/model config; ``demo.yaml`` stands in for
    the one its header names."""
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    fragment = "model" not in config and "class_path" not in config.get("data", {})
    return [f"--config={DEMO}", f"--config={path}"] if fragment else [f"--config={path}"]


def test_configs_are_found() -> None:
    assert {"demo.yaml", "multi30k.yaml", "summarization.yaml"} <= {path.name for path in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.stem)
def test_config_parses_and_instantiates(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    data = (yaml.safe_load(path.read_text(encoding="utf-8")).get("data") or {}).get("init_args", {})
    paths = [path for value in data.values() for path in (value if isinstance(value, list) else [value])]
    if any(str(path).startswith("data/") for path in paths):  # data/<corpus>, as prepare writes it
        (tmp_path / "data").symlink_to(request.getfixturevalue("shared_data"))  # skips when it is absent
    init_from = (yaml.safe_load(path.read_text(encoding="utf-8")).get("model") or {}).get("init_from")
    if init_from is not None:
        STAND_INS[init_from](tmp_path / init_from)
    monkeypatch.chdir(tmp_path)  # data paths in configs are relative to the working directory
    args = [*_stack(path), f"--trainer.default_root_dir={tmp_path}", *FAST]
    if init_from is not None:  # such a config then trains for two steps, on batches the stand-in runs quickly
        args += ["--trainer.max_steps=2", "--trainer.limit_val_batches=1", "--data.init_args.max_tokens=1024"]
    cli = TorchHandleCLI(
        Seq2SeqModule,
        Seq2SeqDataModule,
        subclass_mode_data=True,
        parser_class=OneLineErrorParser,
        run=False,
        args=args,
    )
    assert isinstance(cli.model, Seq2SeqModule) and isinstance(cli.datamodule, Seq2SeqDataModule)
    assert cli.model.hparams.vocab_size == cli.datamodule.vocab_size  # linked, never typed twice
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    for key, value in config.get("model", {}).get("transformer", {}).items():
        assert getattr(cli.model.config, key) == value, f"{path.name}: model.transformer.{key}"
    if "class_path" in config.get("data", {}):
        assert type(cli.datamodule).__name__ == config["data"]["class_path"].rsplit(".", 1)[-1]
    if init_from is not None:  # the folder's architecture, weights and tokenizer train as the run's
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        assert cli.trainer.global_step == 2 and cli.model.hparams["init_from"] is None


def test_print_config_shows_the_resolved_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", f"--config={DEMO}", "--model.transformer.d_model=96", "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["transformer"]["d_model"] == 96
    assert (
        printed["model"]["transformer"]["num_heads"]
        == yaml.safe_load(DEMO.read_text())["model"]["transformer"]["num_heads"]
    )
    assert printed["data"]["class_path"] == "torch_handle.data.TranslationDataModule"


def test_help_documents_model_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code in (0, None)
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps long help lines
    assert "--model.transformer.d_model" in text
    assert "Width of every residual stream" in text  # TransformerConfig's docstring is the help
    assert "--model.label_smoothing" in text and "Label smoothing of the cross entropy" in text


def test_unknown_option_on_the_command_line_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", f"--config={DEMO}", "--model.transformer.d_modle=64"])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith("error: ") and "\n" not in message and "d_modle" in message
