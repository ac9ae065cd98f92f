"""Writing an export: any training checkpoint (a Lightning ``.ckpt``, a DeepSpeed or FSDP folder) read into the
Transformer's float32 weights, config, tokenizer and decoding settings, and written as one safetensors file or a
CTranslate2 model folder."""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor
from torch.nn import Module

from torch_handle.atomic import atomic_path
from torch_handle.checkpoints import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    CheckpointError,
    check_checkpoint,
    checkpoint_fields,
    deepspeed_state,
    is_deepspeed_checkpoint,
    with_tied_weights,
)
from torch_handle.commands import typed_command
from torch_handle.ctranslate2 import ExportError, check_free, unsupported, vocabulary, write_model
from torch_handle.data.tokenizer import Tokenizer
from torch_handle.export.exported import (
    FORMAT,
    Decoding,
    empty_model,
    exported_decoding,
    exported_metadata,
    exported_weights,
    is_exported,
    meta_shell,
    mismatches,
    too_many_layers,
)
from torch_handle.model import TransformerConfig
from torch_handle.unpickling import unpickling_only_data

log = logging.getLogger(__name__)

MODEL_PREFIX = "model."  # the Transformer's attribute on Seq2SeqModule


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
    """The model config (with ``attention_backend='auto'``: the loading machine picks its kernel) and tokenizer JSON:
    from the checkpoint, else from the files the checkpoint callback writes beside it (``transformer.json``,
    ``tokenizer.json``)."""
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
    config = dataclasses.replace(config, attention_backend="auto")
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
    weights = {
        k.removeprefix(MODEL_PREFIX): v.detach().float().contiguous()  # cloned below, once tied names are filled
        for k, v in state["state_dict"].items()
        if k.startswith(MODEL_PREFIX)
    }
    problems = too_many_layers(config, len(weights))
    if not problems:
        shell = meta_shell(config)
        weights = {k: v.clone() for k, v in with_tied_weights(weights, shell).items()}  # each its own storage
        problems = mismatches(shell, {name: tuple(weight.shape) for name, weight in weights.items()})
    if problems:  # here, not at load time
        raise CheckpointError(
            f"{path} does not match its model config ({problems}): pass a checkpoint {typed_command('fit')} wrote"
        )
    return weights, config, tokenizer, _decoding(state, config)


def read_metadata(checkpoint: str | Path) -> tuple[TransformerConfig, str]:
    """As :func:`read_checkpoint`'s config and tokenizer, from Lightning's fields alone: the weights stay on disk
    (:func:`~torch_handle.checkpoints.checkpoint_fields`), and are checked against the config when read.

    Args:
        checkpoint: A ``.ckpt`` file, a DeepSpeed checkpoint folder or an FSDP sharded checkpoint folder.
    """
    path = check_checkpoint(checkpoint)
    with unpickling_only_data(path):
        fields = checkpoint_fields(path)
    return _config_and_tokenizer(path, fields)


def export(checkpoint: str | Path, output: str | Path) -> Path:
    """Writes the model of ``checkpoint`` to the safetensors file ``output``.

    Args:
        checkpoint: A ``.ckpt`` file, a DeepSpeed checkpoint folder or an FSDP sharded checkpoint folder.
        output: The file to write; by convention ``*.safetensors``.
    """
    weights, config, tokenizer, decoding = read_model(checkpoint)
    write_exported(weights, config, tokenizer, decoding, output)
    log.info("exported %d tensors from %s to %s", len(weights), checkpoint, output)
    return Path(output)


def write_exported(
    weights: dict[str, Tensor], config: TransformerConfig, tokenizer: str, decoding: Decoding, output: str | Path
) -> None:
    """Writes a model's ``weights`` (no two sharing memory) with its config, tokenizer JSON and decoding defaults as
    the safetensors file ``output``, whole or not at all."""
    metadata = {
        "format": FORMAT,
        "transformer": json.dumps(config.to_dict()),
        "tokenizer": tokenizer,
        "decoding": json.dumps(dataclasses.asdict(decoding)),
    }
    with atomic_path(output) as tmp:  # an interrupted export leaves no file that looks complete
        save_file(weights, tmp, metadata=metadata)


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
        decoding = exported_decoding(checkpoint, config)
    else:
        weights, config, tokenizer, decoding = read_model(checkpoint)
    reason = unsupported(config)  # before building the model: a refusal costs nothing
    if reason is not None:  # an imported family's model goes through CTranslate2's own converter
        from torch_handle.pretrained.ctranslate2 import converted_family, write_converted  # it imports this package
        from torch_handle.pretrained.writer import hf_family

        if converted_family(config)[0] is None:  # an imported family's obstacle, else why ours cannot
            raise ExportError(converted_family(config)[1] if hf_family(config)[0] else reason)
    model = empty_model(config)
    model.load_state_dict(weights, strict=True)
    if reason is not None:
        return write_converted(model.eval(), Tokenizer.from_str(tokenizer), decoding, out_dir)
    return write_model(model.eval(), vocabulary(tokenizer), out_dir, tokenizer=tokenizer)
