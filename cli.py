"""torch-handle's command line: ``python cli.py {fit,validate,test,predict} --config configs/NAME.yaml``.

A thin LightningCLI: the LightningModule's and DataModules' typed signatures are the options (see
``--help``), the strategy is plain Trainer configuration, and shared values are linked, not repeated.
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI

from callbacks.checkpointing import TOKENIZER_FILE, Checkpoint
from callbacks.prediction_writer import PredictionWriter
from torch_handle.checkpoints import CheckpointError, check_checkpoint, last_checkpoint
from torch_handle.data.base import Seq2SeqDataModule
from torch_handle.errors import DataError
from torch_handle.model import BackendUnavailableError, ConfigError
from torch_handle.module import Seq2SeqModule

USER_ERRORS = (CheckpointError, ConfigError, DataError, BackendUnavailableError)


def checkpoint_dir(root: str | None) -> str:
    return os.path.join(root or ".", "checkpoints")


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

    def before_instantiate_classes(self) -> None:
        """Evaluation without ``--ckpt_path`` uses the run's last checkpoint, and its tokenizer."""
        if self.subcommand not in ("validate", "test", "predict"):
            return
        config = self.config[self.subcommand]
        folder = checkpoint_dir(config.trainer.default_root_dir)
        ckpt = last_checkpoint(folder) if config.ckpt_path in (None, "last") else check_checkpoint(config.ckpt_path)
        config.ckpt_path = str(ckpt)
        tokenizer = ckpt.parent / TOKENIZER_FILE
        if config.data.init_args.tokenizer_path is None and tokenizer.is_file():
            config.data.init_args.tokenizer_path = str(tokenizer)


def main(args: list[str] | None = None) -> None:
    try:
        TorchHandleCLI(
            Seq2SeqModule,
            Seq2SeqDataModule,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            args=args,
        )
    except USER_ERRORS as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
