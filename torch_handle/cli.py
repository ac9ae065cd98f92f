"""torch-handle's command line: ``torch-handle {fit,validate,test,predict} --config NAME`` (``python cli.py`` in
a checkout), plus ``prepare`` (download a corpus, or tokenize a training split to disk), ``export`` (a checkpoint to
one safetensors file, a CTranslate2 or a Hugging Face folder), ``average`` (checkpoints' weights into one
checkpoint) and ``serve`` (a model behind HTTP).

Here: the entry point, which runs the plain tools, resolves ``--config`` names and reports user errors in one line;
the thin LightningCLI (:class:`~torch_handle.lightning_cli.TorchHandleCLI`) reads the LightningModule's and
DataModules' typed signatures as the options (see ``--help``), the strategy as plain Trainer configuration.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from torch_handle import __version__
from torch_handle.checkpoints import CheckpointError
from torch_handle.commands import TOOLS, config_path, shipped_configs, typed_command
from torch_handle.data.base import Seq2SeqDataModule
from torch_handle.data.pretokenized import refuse_existing
from torch_handle.errors import DataError, SetupError
from torch_handle.lightning_cli import TorchHandleCLI
from torch_handle.model import BackendUnavailableError, ConfigError
from torch_handle.module import Seq2SeqModule
from torch_handle.pretrained.trained import init_tokenizer_path
from torch_handle.tracking import SaveConfig

# Lightning's MisconfigurationException: the Trainer's and callbacks' own checks of their settings.
USER_ERRORS = (CheckpointError, ConfigError, DataError, SetupError, BackendUnavailableError, MisconfigurationException)


class OneLineErrorParser(LightningArgumentParser):
    """Reports a bad option or config key as one ``error: ...`` line, without argparse's usage wall."""

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:  # jsonargparse's inner parsers raise, to be caught and retried
            super().error(message, ex)
        text, prog = " ".join(message.split()), self.prog.replace(" [options]", "")
        see = f"{prog} --help"
        if match := _CLASS_OPTION.fullmatch(text):  # a bad key under --data (a class or None): the class's complaint
            key, class_path, problem = match.groups()
            text, see = f"--{key} ({class_path}): {problem}", f"{prog} --{key}.help {class_path}"
        sys.stderr.write(f"error: {text} (see {see})\n")
        self.exit(2)


_CLASS_OPTION = re.compile(
    r'Parser key "([\w.]+)": Does not validate against any of the Union subtypes .*? Errors: - Problem with given '
    r"class_path '([\w.]+)': (.*) - Expected a <class 'NoneType'> Given value type: .*"
)


def user_error(err: BaseException | None) -> BaseException | None:
    """The user error behind ``err``: jsonargparse wraps what a constructor raises in its own errors."""
    while err is not None and not isinstance(err, USER_ERRORS):
        err = err.__cause__ or err.__context__
    return err


def with_config_paths(args: list[str]) -> list[str]:
    resolved = list(args)
    for i, arg in enumerate(resolved):
        if arg.startswith("--config="):
            resolved[i] = "--config=" + config_path(arg.removeprefix("--config="))
        elif arg in ("--config", "-c") and i + 1 < len(resolved):
            resolved[i + 1] = config_path(resolved[i + 1])
    return resolved


DESCRIPTION = (
    "Train, evaluate and use a handwritten Transformer. Subcommands: fit, validate, test, predict (below), and "
    "prepare (download a corpus, or tokenize a config's training split to disk: {prepare} --help), export (a "
    "checkpoint to one safetensors file, a CTranslate2 or a Hugging Face folder: {export} --help), average "
    "(checkpoints' weights into one checkpoint: {average} --help), serve (a model behind HTTP: {serve} --help). "
    "--config takes a path or a shipped config's name: {names}."
)


def cli_options(prog: str) -> dict[str, Any]:
    """What :class:`TorchHandleCLI` is built with: the classes whose signatures are the options, and one-line errors
    under the command ``prog``."""
    names = ", ".join(sorted(path.stem for path in shipped_configs().glob("*.yaml")))
    return {
        "model_class": Seq2SeqModule,
        "datamodule_class": Seq2SeqDataModule,
        "subclass_mode_data": True,
        "parser_class": OneLineErrorParser,
        "parser_kwargs": {
            "prog": prog,
            "description": DESCRIPTION.format(names=names, **{tool: typed_command(tool) for tool in TOOLS}),
            "allow_abbrev": False,
        },
    }


class FitData(TorchHandleCLI):
    """``fit``'s options (configs stacked, ``--data.NAME`` shorthands, ``--model.init_from``'s tokenizer), parsed as
    ``fit`` parses them, with the DataModule alone instantiated: what ``prepare tokens`` writes is what ``fit``
    would read."""

    @override
    def _set_seed(self) -> None:
        """Nothing is trained."""

    @override
    def before_instantiate_classes(self) -> None:
        data = self.config.data.init_args
        init_from = self.config.model.get("init_from")
        if init_from is not None and data.tokenizer_path is None:
            data.tokenizer_path = init_tokenizer_path(init_from)
        if data.get("pretokenized") is not None:
            data.pretokenized = None  # the folder being written, in a config that already reads it

    @override
    def instantiate_classes(self) -> None:
        module, _, name = self.config.data.class_path.rpartition(".")
        init_args = {k: v for k, v in self.config.data.init_args.as_dict().items() if not k.startswith("__")}
        self.datamodule = getattr(importlib.import_module(module), name)(**init_args)

    @override
    def after_instantiate_classes(self) -> None:
        """No model, no trainer."""


def fit_data(args: list[str], prog: str) -> Seq2SeqDataModule:
    """The DataModule ``fit`` with ``args`` would train on, not set up.

    Args:
        args: ``fit``'s options, without the subcommand.
        prog: The command that takes them, for its error lines.
    """
    return FitData(**cli_options(prog), args=with_config_paths(args), run=False).datamodule


def prepare_tokens(argv: list[str]) -> None:
    """``torch-handle prepare tokens --out DIR`` and ``fit``'s options (``--config CONFIG``, ``--data.NAME VALUE``,
    ...): the training split that ``fit`` with those options would read, parsed by ``fit``'s own parser."""
    prog = f"{typed_command('prepare')} tokens"
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Tokenizes the training split that fit with the same options would read, once, a part at a time "
        "(memory does not grow with the corpus), into a folder that fit reads with --data.init_args.pretokenized DIR. "
        "Every option but --out is fit's: --config (several stack), --data.NAME VALUE, --model.init_from (its "
        "tokenizer), ...",
    )
    parser.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    options, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with one_line_errors():
        refuse_existing(options.out)  # before any tokenizing
        written = fit_data(rest, prog).write_pretokenized(options.out)
    logging.getLogger(__name__).info(
        "%s: %d training examples tokenized; fit with --data.init_args.pretokenized %s",
        options.out,
        written,
        options.out,
    )


@contextmanager
def one_line_errors() -> Iterator[None]:
    """A user error raised inside (:data:`USER_ERRORS`, also as the cause of jsonargparse's) ends the process with
    one ``error:`` line; anything else is a bug, and keeps its traceback."""
    try:
        yield
    except Exception as err:
        cause = user_error(err)
        if cause is None:
            raise
        sys.exit(f"error: {cause}")


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] in (["--version"], ["-V"]):
        print(f"torch-handle {__version__}")
        return
    if argv[:2] == ["prepare", "tokens"]:
        prepare_tokens(argv[2:])
        return
    if argv[:1] and argv[0] in TOOLS:
        importlib.import_module(TOOLS[argv[0]]).main(argv[1:])
        return
    with one_line_errors():
        if args is None:  # LightningCLI reads sys.argv itself (and warns when given both)
            sys.argv[1:] = with_config_paths(argv)
        try:
            TorchHandleCLI(
                **cli_options(typed_command()),
                save_config_callback=SaveConfig,
                save_config_kwargs={"overwrite": True},
                args=with_config_paths(argv) if args is not None else None,
            )
        except KeyboardInterrupt:  # Lightning's trainer handles Ctrl-C in its calls: this one came before them
            sys.stderr.write("stopped by SIGINT (Ctrl-C) in setup (the options, the tokenizer): nothing was saved\n")
            sys.exit(130)


def command() -> None:
    """The ``torch-handle`` process: :func:`main`, its ``error:`` line written in one piece. Every process of a
    launch says it, and Python's own report of ``SystemExit`` writes the message and its newline apart, so two
    processes' lines could interleave."""
    try:
        main()
    except SystemExit as exit_:
        if not isinstance(exit_.code, str):
            raise
        sys.stderr.write(exit_.code + "\n")  # stderr is line-buffered: one write
        sys.stderr.flush()
        _leave_process_group()
        sys.exit(1)
    _leave_process_group()


def _leave_process_group() -> None:
    """Destroys the process group that a launch leaves behind, finished or failing in setup: torn down at
    interpreter exit instead, its threads could end the process with C++'s "terminate called without an active
    exception" (seen after an error line refusing context parallelism under ModelParallelStrategy, and after a
    finished ZeRO-3 fit on 2 processes, each once)."""
    import torch.distributed as dist  # only a launch that got this far has one

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    command()
