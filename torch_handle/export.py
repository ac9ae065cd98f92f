"""Any training checkpoint to one portable safetensors file: ``python -m torch_handle.export CKPT OUTPUT``.

Accepts a Lightning ``.ckpt`` file (single device, DDP), a DeepSpeed ZeRO-1/2/3 checkpoint folder or an
FSDP sharded checkpoint folder. The output holds the Transformer's weights in float32 and, in the
safetensors metadata, the model config (special ids included), the tokenizer and the decoding settings
(:class:`Decoding`) as JSON, so that :func:`load_exported` rebuilds a model that decodes exactly as it was
trained, on one CPU, with no Lightning, DeepSpeed or process group. Exports written before the decoding
settings were stored still load, with :class:`Decoding`'s defaults.
The attention backend is not part of an export (it is written as ``auto``): the loading machine picks its own,
so a model trained with xformers on a GPU loads on a CPU. A damaged or foreign file is refused in one line.
``--format ctranslate2`` writes a CTranslate2 model folder instead (:func:`export_ctranslate2`).
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor
from torch.nn import Module

from torch_handle.atomic import atomic_path
from torch_handle.checkpoints import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    CheckpointError,
    check_checkpoint,
    deepspeed_state,
    is_deepspeed_checkpoint,
    with_tied_weights,
)
from torch_handle.commands import typed_command
from torch_handle.ctranslate2 import ExportError, check_free, unsupported, vocabulary, write_model
from torch_handle.data.tokenizer import Tokenizer
from torch_handle.model import ConfigError, Transformer, TransformerConfig
from torch_handle.model.logits import DecodingControls
from torch_handle.unpickling import unpickling_only_data

log = logging.getLogger(__name__)

FORMAT = "torch-handle/1"
MODEL_PREFIX = "model."  # the Transformer's attribute on Seq2SeqModule


# The data modules' default source lengths, for checkpoints and exports that do not record theirs.
DEFAULT_MAX_SOURCE_TOKENS = {"translation": 256, "summarization": 32768}


@dataclass(frozen=True)
class Decoding(DecodingControls):
    """How the model decodes by default: ``Seq2SeqModule``'s decoding options and the data's source length.

    Defaults are ``Seq2SeqModule``'s, used for what a checkpoint or an older export does not record.

    Args:
        task: ``translation`` or ``summarization``: what the model was trained for.
        max_source_tokens: Longest source the model reads, ``<eos>`` included (``--data.max_source_tokens``,
            lowered to the model's context); longer summarization documents go hierarchical.
        num_beams: Beam width (1 = greedy).
        max_new_tokens: Longest output, in tokens.
        length_penalty: Beam-search length normalisation exponent.
        chunk_overlap: Tokens shared by neighbouring windows of a hierarchically summarized document.
        lead_words: Words of the Lead baseline that summarization ``test`` scores beside the model.

    It holds the decoding controls too (``no_repeat_ngram_size``, ..., ``seed``: the fields of
    :class:`~torch_handle.model.logits.DecodingControls`, which it extends).
    """

    task: Literal["translation", "summarization"] = "translation"
    max_source_tokens: int = 256
    num_beams: int = 4
    max_new_tokens: int = 128
    length_penalty: float = 1.0
    chunk_overlap: int = 256
    lead_words: int = 100

    @classmethod
    def read(cls, values: dict[str, Any], config: TransformerConfig) -> Decoding:
        """The settings in ``values`` (a checkpoint's hyper-parameters, an export's metadata); defaults for the
        rest: the data module's source length for the task, and outputs that fit the model's context."""
        fields = {f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values}
        task = fields.setdefault("task", cls.task)
        context = config.context_length
        if "max_source_tokens" not in fields:
            default = DEFAULT_MAX_SOURCE_TOKENS[task]
            fields["max_source_tokens"] = default if context is None else min(default, context)
        if "max_new_tokens" not in fields and context is not None:
            fields["max_new_tokens"] = min(cls.max_new_tokens, context - 1)  # <bos> takes a position
        return cls(**fields)

    def controls(self) -> DecodingControls:
        """The decoding controls among these settings."""
        return DecodingControls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(DecodingControls)})

    def summarize_options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`torch_handle.summarize` for this model:
        ``summarize(model, tokenizer, document, **decoding.summarize_options())``."""
        return {
            "max_source_tokens": self.max_source_tokens,
            "overlap": self.chunk_overlap,
            "max_new_tokens": self.max_new_tokens,
            "num_beams": self.num_beams,
            "length_penalty": self.length_penalty,
            "controls": self.controls(),
        }


def is_exported(path: str | Path) -> bool:
    """Whether ``path`` names an exported model (by its ``.safetensors`` suffix)."""
    return str(path).endswith(".safetensors")


def _lightning_state(path: Path) -> dict[str, Any]:
    """The LightningModule's full-precision ``state_dict`` and Lightning's checkpoint fields, per layout."""
    with unpickling_only_data(path):
        if path.is_file():
            return torch.load(path, map_location="cpu", weights_only=True)
        if is_deepspeed_checkpoint(path):
            return deepspeed_state(path)
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        from torch_handle.parallel.layout import from_heads_layout

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(path, Path(tmp) / "full.pt")
            checkpoint = torch.load(Path(tmp) / "full.pt", map_location="cpu", weights_only=True)
        meta = path / "meta.pt"  # Lightning's FSDP strategy keeps the non-tensor fields beside the shards
        extra = torch.load(meta, map_location="cpu", weights_only=True) if meta.is_file() else {}
    state_dict = from_heads_layout(checkpoint.get("model", checkpoint.get("state_dict", {})))
    return {**extra, **checkpoint, "state_dict": state_dict}


def merged_checkpoint(path: Path, module: Module) -> dict[str, Any]:
    """A checked checkpoint folder as one Lightning checkpoint of full weights, for evaluation by a strategy that does
    not read the folder (a ZeRO, FSDP or tensor-parallel run tested on one device): Lightning's fields, without the
    optimizer's, and every tied name of ``module``'s weights."""
    state = _lightning_state(path)
    optimizer = {"optimizer_states", "lr_schedulers", *(key for key in state if key.startswith("optimizer_"))}
    fields = {key: value for key, value in state.items() if key not in optimizer}
    return {**fields, "state_dict": with_tied_weights(state["state_dict"], module)}


def _config_and_tokenizer(path: Path, state: dict[str, Any]) -> tuple[TransformerConfig, str]:
    """The model config and tokenizer JSON: from the checkpoint, else from the files the checkpoint callback
    writes beside it (``transformer.json``, ``tokenizer.json``)."""
    hparams = state.get("hyper_parameters", {})
    if "transformer" in hparams:
        transformer = hparams["transformer"]  # a TransformerConfig, or its fields when built by the CLI
        fields = transformer.to_dict() if isinstance(transformer, TransformerConfig) else dict(transformer)
        vocab = hparams["vocab_size"]
        config = TransformerConfig(**{**fields, "src_vocab_size": vocab, "tgt_vocab_size": vocab})
    elif (path.parent / CONFIG_FILE).is_file():
        config = TransformerConfig(**json.loads((path.parent / CONFIG_FILE).read_text()))
    else:
        raise CheckpointError(f"{path} holds no model config and has no {CONFIG_FILE} beside it")
    tokenizers = [v["tokenizer"] for v in state.values() if isinstance(v, dict) and "tokenizer" in v]
    if tokenizers:
        return config, tokenizers[0]
    if (path.parent / TOKENIZER_FILE).is_file():
        return config, (path.parent / TOKENIZER_FILE).read_text()
    raise CheckpointError(f"{path} holds no tokenizer and has no {TOKENIZER_FILE} beside it")


def _decoding(state: dict[str, Any], config: TransformerConfig) -> Decoding:
    """The module's decoding options and the data module's source length (saved in its ``state_dict``)."""
    values = dict(state.get("hyper_parameters", {}))
    for value in state.values():
        if isinstance(value, dict) and "max_source_tokens" in value:
            values["max_source_tokens"] = value["max_source_tokens"]
    return Decoding.read(values, config)


def read_checkpoint(checkpoint: str | Path) -> tuple[dict[str, Tensor], TransformerConfig, str]:
    """The Transformer's float32 weights, its config (with ``attention_backend='auto'``) and the tokenizer JSON of
    any training checkpoint.

    Args:
        checkpoint: A ``.ckpt`` file, a DeepSpeed checkpoint folder or an FSDP sharded checkpoint folder.
    """
    weights, config, tokenizer, _ = read_model(checkpoint)
    return weights, config, tokenizer


def read_model(checkpoint: str | Path) -> tuple[dict[str, Tensor], TransformerConfig, str, Decoding]:
    """As :func:`read_checkpoint`, and the checkpoint's :class:`Decoding` settings.

    Args:
        checkpoint: A ``.ckpt`` file, a DeepSpeed checkpoint folder or an FSDP sharded checkpoint folder.
    """
    path = check_checkpoint(checkpoint)
    state = _lightning_state(path)
    config, tokenizer = _config_and_tokenizer(path, state)
    config = dataclasses.replace(config, attention_backend="auto")  # the loading machine picks its kernel
    weights = {
        k.removeprefix(MODEL_PREFIX): v.detach().float().contiguous().clone()  # clone: tied weights share storage
        for k, v in state["state_dict"].items()
        if k.startswith(MODEL_PREFIX)
    }
    shell = meta_shell(config)
    weights = {k: v.clone() for k, v in with_tied_weights(weights, shell).items()}  # DeepSpeed keeps one name
    problems = _mismatches(shell, {name: tuple(weight.shape) for name, weight in weights.items()})
    if problems:  # here, not at load time
        raise CheckpointError(
            f"{path} does not match its model config ({problems}): pass a checkpoint cli.py fit wrote"
        )
    return weights, config, tokenizer, _decoding(state, config)


def export(checkpoint: str | Path, output: str | Path) -> Path:
    """Writes the model of ``checkpoint`` to the safetensors file ``output``.

    Args:
        checkpoint: A ``.ckpt`` file, a DeepSpeed checkpoint folder or an FSDP sharded checkpoint folder.
        output: The file to write; by convention ``*.safetensors``.
    """
    weights, config, tokenizer, decoding = read_model(checkpoint)
    path = Path(checkpoint)
    output = Path(output)
    metadata = {
        "format": FORMAT,
        "transformer": json.dumps(config.to_dict()),
        "tokenizer": tokenizer,
        "decoding": json.dumps(dataclasses.asdict(decoding)),
    }
    with atomic_path(output) as tmp:  # an interrupted export leaves no file that looks complete
        save_file(weights, tmp, metadata=metadata)
    log.info("exported %d tensors from %s to %s", len(weights), path, output)
    return output


def exported_metadata(path: str | Path) -> tuple[TransformerConfig, Tokenizer]:
    """The model config and tokenizer stored in an exported file, checked against its tensors' names and shapes
    without reading their data.

    Args:
        path: A file written by :func:`export`.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"exported model {path} does not exist: run {typed_command('export')} first")
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    except Exception as err:  # safetensors raises its own error types for a non-safetensors or truncated file
        raise CheckpointError(f"{path} is not a safetensors file ({_one_line(err)}): export the model again") from err
    redo = f"export it again with {typed_command('export')}"
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path} was not written by torch_handle.export (no {FORMAT} metadata): {redo}")
    config = _exported_config(path, metadata.get("transformer"), redo)
    try:
        tokenizer = Tokenizer.from_str(metadata["tokenizer"])
    except Exception as err:  # KeyError, or whatever the tokenizers library raises on bad JSON
        raise CheckpointError(f"{path} holds no valid tokenizer ({_one_line(err)}): {redo}") from err
    problems = _mismatches(meta_shell(config), shapes)
    if problems:
        raise CheckpointError(f"{path} does not match its model config ({problems}): {redo}")
    return config, tokenizer


def meta_shell(config: TransformerConfig) -> Transformer:
    """The Transformer of ``config`` on the meta device: its names and shapes, with no memory behind them, so that a
    file is checked against the sizes its config claims before anything of those sizes is allocated."""
    with torch.device("meta"):
        return Transformer(config)


def _mismatches(shell: Transformer, shapes: dict[str, tuple[int, ...]]) -> str:
    """How the tensor ``shapes`` of a file differ from the ``state_dict`` of ``shell`` ("" if they do not)."""
    expected = {name: tuple(t.shape) for name, t in shell.state_dict().items()}
    problems = [f"missing {name}" for name in expected.keys() - shapes.keys()]
    problems += [f"unexpected {name}" for name in shapes.keys() - expected.keys()]
    problems += [
        f"{name} has shape {list(shapes[name])}, the config needs {list(shape)}"
        for name, shape in expected.items()
        if name in shapes and shapes[name] != shape
    ]
    return "; ".join(sorted(problems))


def _exported_config(path: Path, text: str | None, redo: str) -> TransformerConfig:
    """The ``transformer`` metadata: a JSON object with every field of :class:`TransformerConfig`, each typed."""
    try:
        fields = json.loads(text) if text is not None else None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: its transformer metadata is not JSON ({err}): {redo}") from err
    if not isinstance(fields, dict):
        raise CheckpointError(f"{path} holds no transformer config object in its metadata: {redo}")
    hints = get_type_hints(TransformerConfig)
    unknown, missing = sorted(fields.keys() - hints.keys()), sorted(hints.keys() - fields.keys())
    if unknown or missing:
        raise CheckpointError(f"{path}: transformer config has unknown fields {unknown}, missing {missing}: {redo}")
    wrong = [name for name, value in fields.items() if not _has_type(value, hints[name])]
    if wrong:
        raise CheckpointError(f"{path}: transformer config fields {wrong} have the wrong type: {redo}")
    try:
        return TransformerConfig(**fields)
    except ConfigError as err:
        raise CheckpointError(f"{path}: {err}: {redo}") from err


def exported_decoding(path: str | Path, config: TransformerConfig) -> Decoding:
    """The decoding settings stored in an exported file already checked by :func:`exported_metadata`;
    :class:`Decoding`'s defaults for what an export written before they were stored lacks.

    Args:
        path: A file written by :func:`export`.
        config: Its model config, which bounds the default lengths.
    """
    with safe_open(path, framework="pt") as f:
        text = (f.metadata() or {}).get("decoding")
    redo = f"export it again with {typed_command('export')}"
    try:
        values = {} if text is None else json.loads(text)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: its decoding metadata is not JSON ({err}): {redo}") from err
    if not isinstance(values, dict):
        raise CheckpointError(f"{path} holds no decoding settings object in its metadata: {redo}")
    hints = get_type_hints(Decoding)
    wrong = sorted(name for name, hint in hints.items() if name in values and not _has_type(values[name], hint))
    if wrong:
        raise CheckpointError(f"{path}: decoding settings {wrong} have the wrong type: {redo}")
    return Decoding.read(values, config)


def _has_type(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a config field's annotation (``int``, ``float``, ``bool``, ``Literal``, ``| None``)."""
    if get_origin(hint) is Literal:
        return value in get_args(hint)
    if get_args(hint):  # X | None
        return any(_has_type(value, option) for option in get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def exported_weights(path: str | Path) -> dict[str, Tensor]:
    """The Transformer's ``state_dict`` stored in an exported file.

    Args:
        path: A file written by :func:`export`.
    """
    try:
        return load_file(Path(path), device="cpu")
    except Exception as err:  # safetensors' own error types
        raise CheckpointError(f"{path} is not a readable safetensors file ({_one_line(err)})") from err


def load_exported(path: str | Path, attention_backend: str = "auto") -> tuple[Transformer, Tokenizer]:
    """The exported Transformer (in eval mode, on CPU) and its tokenizer, e.g. for a notebook.

    Args:
        path: A file written by :func:`export`.
        attention_backend: The attention kernel on this machine.
    """
    config, tokenizer = exported_metadata(path)
    model = Transformer(dataclasses.replace(config, attention_backend=attention_backend))
    model.load_state_dict(exported_weights(path), strict=True)
    return model.eval(), tokenizer


def configure_from_exported(config: Any, path: str | Path) -> None:
    """Points a parsed ``cli.py test/predict`` config at an exported model: its model config, and its
    tokenizer (written to a temporary file, as the data module reads tokenizers from files).

    Args:
        config: The subcommand's jsonargparse namespace, before the classes are instantiated.
        path: A file written by :func:`export`; the CLI loads its weights into the model.
    """
    transformer, tokenizer = exported_metadata(path)
    for name, value in transformer.to_dict().items():
        # The CLI links the vocabulary sizes from the tokenizer; the attention backend is this machine's choice.
        if name not in ("src_vocab_size", "tgt_vocab_size", "attention_backend"):
            config.model.transformer[name] = value
    fd, tokenizer_file = tempfile.mkstemp(prefix="torch-handle-tokenizer-", suffix=".json")
    os.close(fd)
    atexit.register(os.unlink, tokenizer_file)
    tokenizer.save(tokenizer_file)
    config.data.init_args.tokenizer_path = tokenizer_file


def export_ctranslate2(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Writes the model of ``checkpoint`` and its tokenizer as the CTranslate2 model folder ``out_dir``.

    Args:
        checkpoint: A ``.ckpt`` file, a DeepSpeed or FSDP checkpoint folder, or a ``.safetensors`` export.
        out_dir: The folder to create; it must not exist, or be empty.
    """
    check_free(Path(out_dir))  # before reading a checkpoint that may be large
    if is_exported(checkpoint):
        config, tok = exported_metadata(checkpoint)
        weights, tokenizer = exported_weights(checkpoint), tok.to_str()
    else:
        weights, config, tokenizer, _ = read_model(checkpoint)
    reason = unsupported(config)  # before building the model: a refusal costs nothing
    if reason is not None:
        raise ExportError(reason)
    model = Transformer(config)
    model.load_state_dict(weights, strict=True)
    return write_model(model.eval(), vocabulary(tokenizer), out_dir, tokenizer=tokenizer)


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=typed_command("export"), description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a .ckpt file, a DeepSpeed checkpoint folder or an FSDP sharded folder")
    parser.add_argument("output", help="the safetensors file to write, or the CTranslate2 model folder to create")
    parser.add_argument(
        "--format",
        choices=("safetensors", "ctranslate2", "hf"),
        default="safetensors",
        help="safetensors: one file for torch_handle.load; ctranslate2: a model folder for ctranslate2.Translator "
        "(needs pip install 'torch-handle[bench]'; the checkpoint may also be a .safetensors export); hf: a Hugging "
        "Face folder for transformers' from_pretrained (models imported from BART, mBART, Marian or PEGASUS)",
    )
    options = parser.parse_args(args)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from torch_handle.pretrained.writer import export_hf  # it builds on this module

    write = {"ctranslate2": export_ctranslate2, "hf": export_hf}.get(options.format, export)
    try:
        write(options.checkpoint, options.output)
    except (CheckpointError, ExportError) as err:
        raise SystemExit(f"error: {err}") from err


if __name__ == "__main__":
    main()
