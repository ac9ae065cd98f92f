"""``TorchHandleCLI``, the LightningCLI behind ``fit``, ``validate``, ``test`` and ``predict``: checkpointing,
throughput and prediction writing added, the vocabulary size linked, and ``--ckpt_path`` resolved (the run's last
checkpoint, a folder of shards merged for another strategy, an exported model, or a Hugging Face model folder)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from jsonargparse import Namespace
from jsonargparse._actions import _ActionPrintConfig
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from typing_extensions import override

from torch_handle.atomic import check_run_folder_free, lock_run_folder, temporary_folder
from torch_handle.callbacks.checkpointing import Checkpoint
from torch_handle.callbacks.prediction_writer import STDOUT, PredictionWriter
from torch_handle.callbacks.throughput import Throughput
from torch_handle.checkpoints import (
    TOKENIZER_FILE,
    CheckpointError,
    checkpoint_fields,
    folder_kind,
    resolve_ckpt_path,
)
from torch_handle.commands import typed_command
from torch_handle.errors import SetupError
from torch_handle.export import exported_metadata, exported_weights, is_exported, merged_checkpoint
from torch_handle.hparams import RUNTIME, explicit_model_options, merge_checkpoint_options
from torch_handle.layouts import deepspeed_refusal
from torch_handle.pretrained.reader import is_pretrained_folder
from torch_handle.pretrained.trained import init_path, init_tokenizer_path
from torch_handle.strategies import require_deepspeed
from torch_handle.tracking import configure_trackers, is_tracker, log_checkpoint_paths, record_run_ids

EVALUATE = ("validate", "test", "predict")
READS_FOLDERS: dict[str, type[Strategy]] = {
    "deepspeed": DeepSpeedStrategy,
    "fsdp": FSDPStrategy,
    "model_parallel": ModelParallelStrategy,
}
"""The strategy that reads each kind of checkpoint folder (:func:`~torch_handle.checkpoints.folder_kind`)."""
RESUME_KEYWORDS = ("last", "hpc", "registry")  # ``fit --ckpt_path`` values Lightning resolves itself


def checkpoint_dir(root: str | None) -> str:
    return os.path.join(root or ".", "checkpoints")


class TorchHandleCLI(LightningCLI):
    """Adds checkpointing, throughput and prediction writing, links the vocabulary size, and finds the last
    checkpoint."""

    merged_from: str | None = None
    """The checkpoint folder that evaluation merged into one file (:meth:`_merge_folder`)."""
    checkpoint_tokenizer: str | None = None
    """The tokenizer JSON that ``--ckpt_path`` holds (the data module's state), if any."""
    pretrained_from: str | None = None
    """The Hugging Face model folder that evaluation's ``--ckpt_path`` named (read as ``--model.init_from``)."""

    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 - LightningArgumentParser
        parser.add_lightning_class_args(Checkpoint, "checkpoint")
        parser.add_lightning_class_args(PredictionWriter, "prediction_writer")
        parser.add_lightning_class_args(Throughput, "throughput")
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
        """Also resolves ``--ckpt_path`` (by default the run's last checkpoint for evaluation), checks it before
        any pickle is read, and takes the model's architecture from it (see :mod:`torch_handle.hparams`).
        ``--print_config`` prints the options after that merge: the ones the run uses."""
        with _ActionPrintConfig.skip_print_config():
            super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        if subcommand is not None:
            ckpt = self._resolve_checkpoint(self.config[subcommand])
            if ckpt is not None:
                self._use_checkpoint_options(parser, subcommand, ckpt, sys.argv[1:] if args is None else args)
        _ActionPrintConfig.print_config_if_requested(parser, self.config)

    @override
    def _parse_ckpt_path(self) -> None:
        """Done in :meth:`parse_arguments`, which keeps the user's runtime options (Lightning's drops them)."""

    def _resolve_checkpoint(self, config: Namespace) -> Path | None:
        """The checked ``--ckpt_path``, before any pickle in it is read: ``last`` (by default for evaluation) is
        the run's last checkpoint, recovered from an interrupted save; None when there is none to load."""
        path = config.get("ckpt_path")
        if is_exported(path or ""):
            return None  # checked and loaded by configure_from_exported
        if path is not None and is_pretrained_folder(Path(path)):
            if self.config.subcommand == "fit":
                raise CheckpointError(f"{path} is a Hugging Face model folder: start from it with --model.init_from")
            return None  # read as --model.init_from by before_instantiate_classes
        if self.config.subcommand == "fit" and path in RESUME_KEYWORDS[1:]:
            return None  # hpc and registry: Lightning resolves them
        folder = checkpoint_dir(config.trainer.default_root_dir)
        config.ckpt_path = resolve_ckpt_path(path, folder, fit=self.config.subcommand == "fit")
        return None if config.ckpt_path in (None, "last") else Path(config.ckpt_path)

    def _use_checkpoint_options(
        self, parser: LightningArgumentParser, subcommand: str, ckpt: Path, args: list[str]
    ) -> None:
        try:
            fields = checkpoint_fields(ckpt)
        except Exception as err:  # noqa: BLE001 - a damaged or unsafe file: any reason is the same answer
            raise CheckpointError(
                f"{ckpt} cannot be loaded safely ({type(err).__name__}: damaged, or holds more than tensors and "
                f"plain values): pass a checkpoint that {typed_command('fit')} wrote"
            ) from err
        self.checkpoint_tokenizer = next(
            (v["tokenizer"] for v in fields.values() if isinstance(v, dict) and isinstance(v.get("tokenizer"), str)),
            None,
        )
        hparams = fields.get("hyper_parameters", {})
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        self.checkpoint_vocab_size = hparams.get("vocab_size")
        typed, in_configs = explicit_model_options(args)
        model, notes = merge_checkpoint_options(
            hparams, self.config[subcommand].model.as_dict(), typed, in_configs, str(ckpt)
        )
        if notes:
            rank_zero_warn(f"{ckpt} decides the model's options it was trained with: using {', '.join(notes)}")
        self.config = parser.parse_object({subcommand: {"model": model}}, self.config)
        used = self.config[subcommand].model
        rank_zero_info(
            f"Model from {ckpt}: " + ", ".join(f"{key}={used[key]}" for key in sorted(RUNTIME) if key in used)
        )

    def before_instantiate_classes(self) -> None:
        """Checks that need no instantiation; a run from a checkpoint (evaluation: by default the run's last) uses
        the tokenizer saved beside it."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        checkpoint = config.checkpoint
        if checkpoint.monitor is None and checkpoint.save_top_k not in (-1, 0, 1):
            raise SetupError(
                f"--checkpoint.save_top_k={checkpoint.save_top_k} keeps the best checkpoints by a metric: set "
                "--checkpoint.monitor (e.g. val/loss), or save_top_k to -1 (all), 0 or 1 (the last)"
            )
        last = Path(checkpoint_dir(config.trainer.default_root_dir)) / "last.ckpt"
        if self.subcommand == "fit" and config.get("ckpt_path") is None and os.path.lexists(last):
            # Lightning would save this run as last-v1.ckpt, and test, predict and --ckpt_path last would go on
            # reading the earlier run's last.ckpt. A run still writing there is named, as a resume is.
            check_run_folder_free(config.trainer.default_root_dir)
            raise SetupError(
                f"{last} is an earlier run's: continue it with --ckpt_path last, or start a new run in another "
                "--trainer.default_root_dir"
            )
        strategy = config.trainer.strategy
        if "deepspeed" in str(strategy.get("class_path", "") if isinstance(strategy, Namespace) else strategy).lower():
            require_deepspeed()  # before jsonargparse folds the strategy's own error into a Union message
        ckpt = config.get("ckpt_path")
        if self.subcommand in EVALUATE and ckpt is not None and is_pretrained_folder(Path(ckpt)):
            self.pretrained_from = config.model.init_from = ckpt  # its weights, architecture and tokenizer
            config.ckpt_path = None
        if config.model.get("init_from") is not None:  # a hub id resolved once: the model and the data read its folder
            config.model.init_from = str(init_path(config.model.init_from))
            if config.data.init_args.tokenizer_path is None:  # the model reads its tokenizer's ids
                config.data.init_args.tokenizer_path = init_tokenizer_path(config.model.init_from)
        # evaluation logs to a new tracker run
        configure_trackers(config, resume=self.subcommand == "fit" and config.get("ckpt_path") is not None)
        if self.subcommand not in EVALUATE:
            self._use_checkpoint_tokenizer(config)
            return
        self.exported = config.ckpt_path if is_exported(config.ckpt_path or "") else None
        if self.exported is not None:  # an exported model: weights are loaded in before_test/before_predict
            configure_from_exported(config, self.exported)
            config.ckpt_path = None
            return
        self._use_checkpoint_tokenizer(config)

    def _use_checkpoint_tokenizer(self, config: Namespace) -> None:
        """The run's ``tokenizer.json`` beside the checkpoint; if it is gone, the copy the checkpoint holds."""
        if config.get("ckpt_path") in (None, *RESUME_KEYWORDS) or is_exported(config.ckpt_path):
            return
        if config.data.init_args.tokenizer_path is not None:
            return
        tokenizer = Path(config.ckpt_path).parent / TOKENIZER_FILE  # checked in parse_arguments
        if tokenizer.is_file():
            config.data.init_args.tokenizer_path = str(tokenizer)
        elif self.checkpoint_tokenizer is not None:
            saved = temporary_folder() / TOKENIZER_FILE
            saved.write_text(self.checkpoint_tokenizer, encoding="utf-8")
            config.data.init_args.tokenizer_path = str(saved)
            rank_zero_warn(f"{tokenizer} is missing: using the tokenizer saved in {config.ckpt_path}")
        elif getattr(self, "checkpoint_vocab_size", None) is not None:
            raise CheckpointError(
                f"{tokenizer} is missing and {config.ckpt_path} holds no tokenizer: pass the run's tokenizer.json "
                "with --data.tokenizer_path"
            )

    @override
    def after_instantiate_classes(self) -> None:
        """The data's length limits follow the model's context, and a checkpoint's vocabulary must be the data's."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        trained = bool(config.get("ckpt_path") or config.get("model.init_from"))  # tables the weights fix
        self.datamodule.fit_context(self.model.config.context_length, self.model.config.target_length, trained)
        vocab_size = getattr(self, "checkpoint_vocab_size", None)
        if vocab_size is not None and vocab_size != self.model.hparams.vocab_size:
            raise CheckpointError(
                f"the checkpoint was trained with vocab_size={vocab_size}, the data's tokenizer has "
                f"{self.model.hparams.vocab_size}: pass the checkpoint's tokenizer.json with --data.tokenizer_path"
            )

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Lightning's default logger (TensorBoard in ``default_root_dir``) without its placeholder ``hp_metric = -1``,
        for ``fit``, and beside the trackers ``--trainer.logger`` names (``--config mlflow``, ``--config wandb``);
        evaluation logs nothing unless ``--trainer.logger`` asks (its results are printed), so it leaves no new
        ``version_N`` folder (nor a ``config.yaml``). Predictions written to ``-`` keep standard output to
        themselves: no progress bar."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        logger = config.trainer.logger
        root = config.trainer.default_root_dir
        if logger is True or (logger is None and self.subcommand in (None, "fit")):
            kwargs["logger"] = TensorBoardLogger(root, version=SLURMEnvironment.job_id(), default_hp_metric=False)
        elif any(is_tracker(item) for item in self._loggers()):  # TensorBoard's version_N holds config.yaml
            tensorboard = TensorBoardLogger(root, version=SLURMEnvironment.job_id(), default_hp_metric=False)
            kwargs["logger"] = [tensorboard, *self._loggers()]
        elif logger is None:
            kwargs["logger"] = False
        if self.subcommand in EVALUATE and not kwargs.get("logger", logger):
            self.save_config_callback = None  # its config.yaml would land in the run folder, over the last one
        if self.subcommand == "predict" and config.prediction_writer.output == STDOUT:
            kwargs["enable_progress_bar"] = False
        trainer = super().instantiate_trainer(**kwargs)
        self.model.check_launch(trainer, fitting=self.subcommand in (None, "fit"))  # before any process starts
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, Checkpoint):
                callback.in_a_command = True
        return trainer

    def _loggers(self) -> list[Any]:
        """The loggers ``--trainer.logger`` instantiated."""
        logger = (self.config_init[self.subcommand] if self.subcommand else self.config_init).trainer.logger
        return logger if isinstance(logger, list) else [logger]

    def before_fit(self) -> None:
        """One run per folder: a second run started in it stops with one line instead of sharing its files. A
        folder of shards resumes under the strategy that wrote it only (ZeRO: of its stage), and ZeRO resumes no full
        ``.ckpt`` (:mod:`torch_handle.layouts`)."""
        folder = self._unreadable_folder()
        if folder is not None:
            raise CheckpointError(
                f"{folder} is a checkpoint folder of {READS_FOLDERS[folder_kind(folder)].__name__}, which "
                f"{type(self.trainer.strategy).__name__} cannot resume: resume it with the strategy config that wrote "
                "it (test, predict and export read it with any)"
            )
        path = self.config_init[self.subcommand].get("ckpt_path")
        refusal = (
            None if path is None or not Path(path).exists() else deepspeed_refusal(Path(path), self.trainer.strategy)
        )
        if refusal is not None:
            raise CheckpointError(refusal)
        if rank_zero_only.rank == 0:
            lock_run_folder(self.trainer.default_root_dir)
            record_run_ids(self.trainer)

    def after_fit(self) -> None:
        if self.trainer.is_global_zero:
            log_checkpoint_paths(self.trainer)

    def before_validate(self) -> None:
        self._load_exported()
        self._merge_folder()

    def before_test(self) -> None:
        self._load_exported()
        self._merge_folder()

    def after_test(self) -> None:
        """A few lines after Lightning's table: the headline scores, how they were computed, and the weights used."""
        if self.trainer.is_global_zero:
            lines = self.model.summary(self.trainer.callback_metrics, "test")
            weights = self.exported or self.merged_from or self.pretrained_from or self.trainer.ckpt_path
            weights = weights or "none: the model's initial weights"
            print("\n".join(["", *lines, f"checkpoint: {weights}"]), flush=True)

    def before_predict(self) -> None:
        self._load_exported()
        self._merge_folder()

    def _load_exported(self) -> None:
        if self.exported is not None:
            self.model.model.load_state_dict(exported_weights(self.exported), strict=True)

    def _unreadable_folder(self) -> Path | None:
        """``--ckpt_path`` when it is a folder of shards that this run's strategy does not read."""
        path = self.config_init[self.subcommand].get("ckpt_path")
        if path is None or not Path(path).is_dir():
            return None
        return None if isinstance(self.trainer.strategy, READS_FOLDERS[folder_kind(Path(path))]) else Path(path)

    def _merge_folder(self) -> None:
        """Evaluates a folder of shards that this run's strategy does not read (a ZeRO, FSDP or tensor-parallel run
        tested on one device, or with DDP) from one file of its full weights, merged into a temporary folder."""
        folder = self._unreadable_folder()
        if folder is None:
            return
        merged = temporary_folder() / "merged.ckpt"
        torch.save(merged_checkpoint(folder, self.model), merged)
        self.config_init[self.subcommand]["ckpt_path"] = str(merged)
        self.merged_from = str(folder)
        strategy = type(self.trainer.strategy).__name__
        rank_zero_info(f"{folder}: {strategy} reads the full weights merged from its shards")


def configure_from_exported(config: Any, path: str | Path) -> None:
    """Points a parsed ``cli.py test/predict`` config at an exported model: its model config, and its
    tokenizer (written to a temporary file, as the data module reads tokenizers from files).

    Args:
        config: The subcommand's jsonargparse namespace, before the classes are instantiated.
        path: A file written by :func:`~torch_handle.export.export`; the CLI loads its weights into the model.
    """
    transformer, tokenizer = exported_metadata(path)
    for name, value in transformer.to_dict().items():
        # The CLI links the vocabulary sizes from the tokenizer; the attention backend is this machine's choice.
        if name not in ("src_vocab_size", "tgt_vocab_size", "attention_backend"):
            config.model.transformer[name] = value
    tokenizer_file = temporary_folder() / TOKENIZER_FILE
    tokenizer.save(tokenizer_file)
    config.data.init_args.tokenizer_path = str(tokenizer_file)
