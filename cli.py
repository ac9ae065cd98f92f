"""torch-handle's command line: ``python cli.py {fit,validate,test,predict} --config configs/NAME.yaml``.

A thin LightningCLI: the LightningModule's and DataModules' typed signatures are the options (see
``--help``), the strategy is plain Trainer configuration, and shared values are linked, not repeated.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from typing_extensions import override

from callbacks.checkpointing import Checkpoint
from callbacks.prediction_writer import PredictionWriter
from torch_handle.checkpoints import TOKENIZER_FILE, CheckpointError, resolve_ckpt_path
from torch_handle.data.base import Seq2SeqDataModule
from torch_handle.errors import DataError, SetupError
from torch_handle.export import configure_from_exported, exported_metadata, exported_weights, is_exported
from torch_handle.model import BackendUnavailableError, ConfigError
from torch_handle.module import Seq2SeqModule

USER_ERRORS = (CheckpointError, ConfigError, DataError, SetupError, BackendUnavailableError)


def checkpoint_dir(root: str | None) -> str:
    return os.path.join(root or ".", "checkpoints")


class OneLineErrorParser(LightningArgumentParser):
    """Reports a bad option or config key as one ``error: ...`` line, without argparse's usage wall."""

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:  # jsonargparse's inner parsers raise, to be caught and retried
            super().error(message, ex)
        sys.stderr.write(f"error: {' '.join(message.split())} (see {self.prog.replace(' [options]', '')} --help)\n")
        self.exit(2)


class TorchHandleCLI(LightningCLI):
    """Adds checkpointing and prediction writing, links the vocabulary size, and finds the last checkpoint."""

    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 - LightningArgumentParser
        parser.add_lightning_class_args(Checkpoint, "checkpoint")
        parser.add_lightning_class_args(PredictionWriter, "prediction_writer")
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.link_arguments("trainer.default_root_dir", "checkpoint.dirpath", compute_fn=checkpoint_dir)
        parser.set_defaults(
            {
                "data": {"class_path": "torch_handle.data.TranslationDataModule"},
                "trainer.default_root_dir": "runs/default",
                # The data modules shard their token-budget batches per rank themselves.
                "trainer.use_distributed_sampler": False,
                "checkpoint.save_last": True,
            }
        )

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        """Also resolves ``--ckpt_path`` (by default the run's last checkpoint) and checks it before Lightning
        loads it for its hyper-parameters (or ``fit`` resumes from it): a bad or unsafe path is a one-line error,
        an interrupted save is recovered, and no model option is repeated."""
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        if subcommand not in ("fit", "validate", "test", "predict"):
            return
        config = self.config[subcommand]
        if is_exported(config.ckpt_path or ""):
            exported_metadata(config.ckpt_path)  # before LightningCLI torch.loads it for hyper-parameters
            return
        folder = checkpoint_dir(config.trainer.default_root_dir)
        config.ckpt_path = resolve_ckpt_path(config.ckpt_path, folder, fit=subcommand == "fit")

    def before_instantiate_classes(self) -> None:
        """Evaluation without ``--ckpt_path`` uses the run's last checkpoint, and its tokenizer."""
        if self.subcommand not in ("validate", "test", "predict"):
            return
        config = self.config[self.subcommand]
        self.exported = config.ckpt_path if is_exported(config.ckpt_path or "") else None
        if self.exported is not None:  # an exported model: weights are loaded in before_test/before_predict
            configure_from_exported(config, self.exported)
            config.ckpt_path = None
            return
        tokenizer = Path(config.ckpt_path).parent / TOKENIZER_FILE  # resolved in parse_arguments
        if config.data.init_args.tokenizer_path is None and tokenizer.is_file():
            config.data.init_args.tokenizer_path = str(tokenizer)

    def before_validate(self) -> None:
        self._load_exported()

    def before_test(self) -> None:
        self._load_exported()

    def before_predict(self) -> None:
        self._load_exported()

    def _load_exported(self) -> None:
        if self.exported is not None:
            self.model.model.load_state_dict(exported_weights(self.exported), strict=True)


def main(args: list[str] | None = None) -> None:
    try:
        TorchHandleCLI(
            Seq2SeqModule,
            Seq2SeqDataModule,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            parser_class=OneLineErrorParser,
            args=args,
        )
    except USER_ERRORS as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
