"""Every shipped ``configs/*.yaml`` parses and instantiates through the CLI; ``--print_config`` and ``--help``."""

from __future__ import annotations

import re
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
    (``data.init_args`` without a class, e.g. multi30k_gpu, qmsum) is meant to be stacked on a data/model config: the
    one its header stacks it on (``--config BASE --config NAME``), else ``demo.yaml``."""
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    if "class_path" in config.get("data", {}) or "task" in config.get("model", {}):
        return [f"--config={path}"]
    named = re.search(rf"--config (\w+) --config {path.stem}\b", path.read_text(encoding="utf-8"))
    base = ROOT / "configs" / f"{named[1]}.yaml" if named else DEMO
    return [f"--config={base}", f"--config={path}"]


def _data_folder(tmp_path: Path, shared_data: Path) -> None:
    """``data/`` as ``prepare`` writes it, from the shared corpora; QMSum's every-query files, which ``../shared``
    lacks, stood in by its general queries (the same fields)."""
    for corpus in (path for path in shared_data.iterdir() if path.is_dir()):
        (tmp_path / "data" / corpus.name).mkdir(parents=True)
        for file in corpus.iterdir():
            (tmp_path / "data" / corpus.name / file.name).symlink_to(file)
    for split in ("train", "val", "test"):
        (tmp_path / "data" / "qmsum" / f"{split}_all.jsonl").symlink_to(shared_data / "qmsum" / "val.jsonl")


def test_configs_are_found() -> None:
    assert {"demo.yaml", "multi30k.yaml", "summarization.yaml"} <= {path.name for path in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.stem)
def test_config_parses_and_instantiates(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    stack = _stack(path)
    args = [*stack, f"--trainer.default_root_dir={tmp_path}", *FAST]
    stacked = [yaml.safe_load(Path(arg.split("=", 1)[1]).read_text(encoding="utf-8")) for arg in stack]
    data = [value for c in stacked for value in ((c.get("data") or {}).get("init_args") or {}).values()]
    paths = [path for value in data for path in (value if isinstance(value, list) else [value])]
    if any(str(path).startswith("data/") for path in paths):  # data/<corpus>, as prepare writes it
        _data_folder(tmp_path, request.getfixturevalue("shared_data"))  # skips when it is absent
    init_from = (yaml.safe_load(path.read_text(encoding="utf-8")).get("model") or {}).get("init_from")
    if init_from is not None:
        STAND_INS[init_from](tmp_path / init_from)
    monkeypatch.chdir(tmp_path)  # data paths in configs are relative to the working directory
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
    typed = {arg.split("=", 1)[0] for arg in args}
    for key, value in config.get("model", {}).items():  # a stacked config's options win over its base's
        if key not in ("transformer", "init_from") and f"--model.{key}" not in typed:
            assert cli.config.model[key] == value, f"{path.name}: model.{key}"
    for key, value in config.get("data", {}).get("init_args", {}).items():
        if f"--data.init_args.{key}" not in typed:
            assert cli.config.data.init_args[key] == value, f"{path.name}: data.init_args.{key}"
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
