"""Reading an exported model: one safetensors file whose metadata holds the model config, the tokenizer and the
decoding settings (:class:`Decoding`), checked against its tensors before anything is allocated; no Lightning,
DeepSpeed or process group is needed to load it."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor

from torch_handle.checkpoints import CheckpointError
from torch_handle.commands import typed_command
from torch_handle.data.tokenizer import Tokenizer
from torch_handle.model import ConfigError, Transformer, TransformerConfig
from torch_handle.model.logits import DecodingControls

FORMAT = "torch-handle/1"

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
        target = config.target_length  # the decoder's positions (LED's are fewer)
        if "max_new_tokens" not in fields and target is not None:
            fields["max_new_tokens"] = min(cls.max_new_tokens, target - 1)  # <bos> takes a position
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


def exported_metadata(path: str | Path) -> tuple[TransformerConfig, Tokenizer]:
    """The model config and tokenizer stored in an exported file, checked against its tensors' names and shapes
    without reading their data.

    Args:
        path: A file written by :func:`export`.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"exported model {path} does not exist: run {typed_command('export')} first")
    metadata, shapes = safetensors_header(path, "export the model again")
    redo = f"export it again with {typed_command('export')}"
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path} was not written by torch_handle.export (no {FORMAT} metadata): {redo}")
    config = _exported_config(path, metadata.get("transformer"), redo)
    try:
        tokenizer = Tokenizer.from_str(metadata["tokenizer"])
    except Exception as err:  # KeyError, or whatever the tokenizers library raises on bad JSON
        raise CheckpointError(f"{path} holds no valid tokenizer ({_one_line(err)}): {redo}") from err
    problems = too_many_layers(config, len(shapes)) or mismatches(meta_shell(config), shapes)
    if problems:
        raise CheckpointError(f"{path} does not match its model config ({problems}): {redo}")
    return config, tokenizer


def safetensors_header(path: Path, fix: str) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """The metadata and the tensors' shapes of the safetensors file ``path``, from its header alone.

    Raises:
        CheckpointError: safetensors cannot read the file (truncated, or another format under this name); the
            message ends with ``fix``.
    """
    try:
        with safe_open(path, framework="pt") as f:
            return f.metadata() or {}, {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointError(f"{path} is not a safetensors file ({_one_line(err)}): {fix}") from err


def too_many_layers(config: TransformerConfig, tensors: int) -> str:
    """A config claiming more layers than a file has tensors (each layer has some): refused before
    :func:`meta_shell` spends time on every claimed layer ("" if it does not)."""
    layers = config.num_encoder_layers + config.num_decoder_layers
    return f"its config claims {layers} layers, more than its {tensors} tensors hold" if layers > tensors else ""


def meta_shell(config: TransformerConfig) -> Transformer:
    """The Transformer of ``config`` on the meta device: its names and shapes, with no memory behind them, so that a
    file is checked against the sizes its config claims before anything of those sizes is allocated."""
    with torch.device("meta"):
        return Transformer(config)


def empty_model(config: TransformerConfig) -> Transformer:
    """The Transformer of ``config`` with its memory allocated but never written (no initialization): pages become
    resident only as weights are copied in, so filling it from a file never holds a second, random copy."""
    model = meta_shell(config)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_buffers()
    return model


def mismatches(shell: Transformer, shapes: dict[str, tuple[int, ...]], fresh: tuple[str, ...] = ()) -> str:
    """How the tensor ``shapes`` of a file differ from the ``state_dict`` of ``shell`` ("" if they do not); tensors
    whose names start with one of ``fresh`` may be missing."""
    expected = {name: tuple(t.shape) for name, t in shell.state_dict().items()}
    problems = [f"missing {name}" for name in expected.keys() - shapes.keys() if not name.startswith(fresh)]
    problems += [f"unexpected {name}" for name in shapes.keys() - expected.keys()]
    problems += [
        f"{name} has shape {list(shapes[name])}, the config needs {list(shape)}"
        for name, shape in expected.items()
        if name in shapes and shapes[name] != shape
    ]
    return "; ".join(sorted(problems))


# Fields of TransformerConfig newer than the first exports, with the value an export without them means.
ADDED_FIELDS: dict[str, object] = {"copy_attention": False}


def _exported_config(path: Path, text: str | None, redo: str) -> TransformerConfig:
    """The ``transformer`` metadata: a JSON object with every field of :class:`TransformerConfig` (but
    :data:`ADDED_FIELDS`, which an older export lacks), each typed."""
    try:
        fields = json.loads(text) if text is not None else None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: its transformer metadata is not JSON ({err}): {redo}") from err
    if not isinstance(fields, dict):
        raise CheckpointError(f"{path} holds no transformer config object in its metadata: {redo}")
    fields = ADDED_FIELDS | fields
    hints = get_type_hints(TransformerConfig)
    unknown, missing = sorted(fields.keys() - hints.keys()), sorted(hints.keys() - fields.keys())
    if unknown or missing:
        raise CheckpointError(f"{path}: transformer config has unknown fields {unknown}, missing {missing}: {redo}")
    wrong = [name for name, value in fields.items() if not has_type(value, hints[name])]
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
    wrong = sorted(name for name, hint in hints.items() if name in values and not has_type(values[name], hint))
    if wrong:
        raise CheckpointError(f"{path}: decoding settings {wrong} have the wrong type: {redo}")
    return Decoding.read(values, config)


def has_type(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a config field's annotation (``int``, ``float``, ``bool``, ``Literal``, ``list[X]``,
    ``| None``)."""
    if get_origin(hint) is Literal:
        return value in get_args(hint)
    if get_origin(hint) is list:  # suppress_ids: an imported model's tokens never generated
        return isinstance(value, list) and all(has_type(item, get_args(hint)[0]) for item in value)
    if get_args(hint):  # X | None
        return any(has_type(value, option) for option in get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:  # numbers' classes: numpy's scalars too, for a value given from Python
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
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
    model = empty_model(dataclasses.replace(config, attention_backend=attention_backend))
    fill_exported(model, path)
    return model.eval(), tokenizer


def fill_exported(model: Transformer, path: str | Path, fresh: tuple[str, ...] = ()) -> None:
    """Copy the export's tensors into ``model`` one tensor at a time, so the model plus one tensor is the peak; those
    whose names start with one of ``fresh`` may be absent, and keep their values.

    Raises:
        CheckpointError: the file's tensor names or shapes are not the model's; the message names them.
    """
    shapes = safetensors_header(Path(path), "export the model again")[1]
    problems = mismatches(model, shapes, fresh)
    if problems:
        raise CheckpointError(f"{path} does not fit the model ({problems}): pass an export of this architecture")
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in safetensors_tensors(Path(path)):
            state[name].copy_(tensor)


def safetensors_tensors(file: Path) -> Iterator[tuple[str, Tensor]]:
    """Every tensor of the safetensors ``file`` as ``(name, tensor)``, the largest first, each read through a mapping
    of its own (the pages read stay resident while their mapping lives), so a model filled in this order holds at
    most one tensor's pages beside what it has filled."""
    with safe_open(file, framework="pt") as f:
        keys = sorted(f.keys(), key=lambda key: -math.prod(f.get_slice(key).get_shape()))
    for key in keys:
        with safe_open(file, framework="pt") as f:
            tensor = f.get_tensor(key)
        yield key, tensor
        del tensor
