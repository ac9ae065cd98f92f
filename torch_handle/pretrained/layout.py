"""The tensor layout that BART, mBART, Marian, PEGASUS and LED share in ``transformers``, mapped onto ours (T5's is
:mod:`torch_handle.pretrained.t5`, which :func:`target` and :func:`hf_names` defer to). LED's names start ``led.``
where the others' start ``model.``, and its encoder's self-attention holds Longformer's projections.

Each Hugging Face tensor lands in one of our parameters (query, key and value in rows of the packed ``in_proj``),
one tensor at a time; a shape that does not fit is one line naming the tensor, and so is a parameter left unfilled.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from torch_handle.checkpoints import CheckpointError
from torch_handle.model import Transformer
from torch_handle.model.config import ConfigError, TransformerConfig
from torch_handle.pretrained import t5

_ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "swish": "silu", "silu": "silu"}
_LAYER = re.compile(r"(encoder|decoder)\.layers\.(\d+)\.(.+)\.(weight|bias)")
_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_LONGFORMER = "self_attn.longformer_self_attn."  # LED's encoder self-attention: the local and the global projections
_LONGFORMER_QKV = {"query": 0, "key": 1, "value": 2}
_BLOCKS = {
    "encoder": {
        "self_attn_layer_norm": "attn_block.norm",
        "self_attn.out_proj": "self_attn.out_proj",
        "self_attn.output": "self_attn.out_proj",  # LED's
    },
    "decoder": {
        "self_attn_layer_norm": "self_block.norm",
        "self_attn.out_proj": "self_attn.out_proj",
        "encoder_attn_layer_norm": "cross_block.norm",
        "encoder_attn.out_proj": "cross_attn.out_proj",
    },
}
_FF = {"fc1": "ff.linear1", "fc2": "ff.linear2", "final_layer_norm": "ff_block.norm"}
_SIDE = {"encoder": "src", "decoder": "tgt"}


def seq2seq_fields(hf: dict[str, Any], generation: dict[str, Any]) -> dict[str, Any]:
    """The ``TransformerConfig`` fields every family of this layout reads the same way from ``config.json`` (``hf``)
    and ``generation_config.json``: sizes, dropouts, the activation and the special and decoding tokens."""
    for a, b in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if hf.get(a) != hf.get(b):
            raise ConfigError(f"{a}={hf.get(a)} and {b}={hf.get(b)} differ: one model has one value for both")
    activation = hf.get("activation_function", "gelu")
    if activation not in _ACTIVATIONS:
        raise ConfigError(f"activation_function={activation!r} is not supported: one of {sorted(_ACTIVATIONS)}")

    def setting(name: str) -> Any:
        return generation.get(name, hf.get(name))

    bad = setting("bad_words_ids") or []
    return {
        "src_vocab_size": hf["vocab_size"],
        "tgt_vocab_size": hf.get("decoder_vocab_size") or hf["vocab_size"],
        "d_model": hf["d_model"],
        "num_heads": hf["encoder_attention_heads"],
        "num_encoder_layers": hf["encoder_layers"],
        "num_decoder_layers": hf["decoder_layers"],
        "d_ff": hf["encoder_ffn_dim"],
        "dropout": hf.get("dropout", 0.1),
        "attention_dropout": hf.get("attention_dropout", 0.0),
        "activation_dropout": hf.get("activation_dropout", 0.0),
        "activation": _ACTIVATIONS[activation],
        "max_len": hf["max_position_embeddings"],
        "tie_embeddings": hf.get("tie_word_embeddings", True),
        "final_logits_bias": True,
        "pad_id": hf["pad_token_id"],
        "bos_id": setting("decoder_start_token_id"),
        "eos_id": setting("eos_token_id"),
        "suppress_ids": [ids[0] for ids in bad if len(ids) == 1],
        "forced_bos_id": setting("forced_bos_token_id"),
        "forced_eos_id": setting("forced_eos_token_id"),
    }


def target(name: str, model: Transformer) -> tuple[str, slice | None] | None:
    """Our parameter (and its rows) for the Hugging Face tensor ``name``; None for one we compute (a sinusoid)."""
    if model.config.position == "relative":
        return t5.target(name, model)
    name = name.removeprefix("led." if model.config.encoder_attention == "longformer" else "model.")
    d = model.config.d_model
    match = _LAYER.fullmatch(name)
    if match:
        stack, index, module, kind = match.groups()
        ours = f"{stack}_layers.{index}."
        if stack == "encoder" and module.startswith(_LONGFORMER):
            proj = module.removeprefix(_LONGFORMER)
            packed = "global_proj" if proj.endswith("_global") else "in_proj"
            i = _LONGFORMER_QKV.get(proj.removesuffix("_global"))
            return (name, None) if i is None else (f"{ours}self_attn.{packed}.{kind}", slice(i * d, i * d + d))
        attn, _, proj = module.rpartition(".")
        if proj in _QKV and attn in ("self_attn", "encoder_attn"):
            i = _QKV[proj]
            return f"{ours}{'self_attn' if attn == 'self_attn' else 'cross_attn'}.in_proj.{kind}", slice(
                i * d, i * d + d
            )
        sub = _BLOCKS[stack].get(module) or _FF.get(module)
        return (f"{ours}{sub}.{kind}", None) if sub else (name, None)
    stack, _, rest = name.partition(".")
    if stack in _SIDE:
        side = _SIDE[stack]
        if rest == "embed_positions.weight":
            return (f"{side}_pos.weight", None) if model.config.position == "learned" else None
        if rest == "embed_tokens.weight":
            return f"{side}_embed.weight", None
        for hf_module, ours in (("layernorm_embedding", f"{side}_embed_norm"), ("layer_norm", f"{stack}_norm")):
            if rest.startswith(hf_module + "."):
                return f"{ours}.{rest.removeprefix(hf_module + '.')}", None
    tops = {"shared.weight": "tgt_embed.weight", "lm_head.weight": "lm_head.weight", "final_logits_bias": "logits_bias"}
    return tops.get(name, name), None


def hf_names(config: TransformerConfig) -> list[str]:
    """The names of the tensors ``save_pretrained`` writes for a model of ``config`` (tied ones once)."""
    if config.position == "relative":
        return t5.hf_names(config)
    pairs = ("weight", "bias")
    top = "led" if config.encoder_attention == "longformer" else "model"
    names = ["final_logits_bias", *([] if config.tie_embeddings else ["lm_head.weight"])]
    one_table = [f"{top}.shared.weight"]
    names += one_table if config.shares_source_embedding else [f"{top}.{side}.embed_tokens.weight" for side in _SIDE]
    attention = [f"{p}_proj.{k}" for p in ("q", "k", "v", "out") for k in pairs]
    longformer = [f"{_LONGFORMER}{p}{g}.{k}" for g in ("", "_global") for p in _LONGFORMER_QKV for k in pairs]
    longformer += [f"self_attn.output.{k}" for k in pairs]
    for stack, layers in (("encoder", config.num_encoder_layers), ("decoder", config.num_decoder_layers)):
        prefix = f"{top}.{stack}."
        names += [prefix + "embed_positions.weight"] if config.position == "learned" else []
        names += [f"{prefix}layernorm_embedding.{k}" for k in pairs] if config.layernorm_embedding else []
        names += [f"{prefix}layer_norm.{k}" for k in pairs] if config.final_norm else []
        local = top == "led" and stack == "encoder"
        modules = longformer if local else [f"self_attn.{a}" for a in attention]
        modules += [f"{m}.{k}" for m in _FF for k in pairs]
        modules += [f"self_attn_layer_norm.{k}" for k in pairs]
        if stack == "decoder":
            modules += [f"encoder_attn.{a}" for a in attention] + [f"encoder_attn_layer_norm.{k}" for k in pairs]
        names += [f"{prefix}layers.{i}.{m}" for i in range(layers) for m in modules]
    return names


# What fine-tuning adds to a pretrained model, left as initialized: the copy attention (``copy_attention``).
FRESH = ("copy.",)


def fill(model: Transformer, tensors: Iterable[tuple[str, Tensor]], where: str) -> None:
    """Copy the Hugging Face ``tensors`` into ``model``'s parameters, checking each shape and that all are filled
    (but :data:`FRESH`'s)."""
    state = model.state_dict(keep_vars=True)
    packed = (".in_proj.", ".global_proj.")  # query, key and value: three tensors each
    parts = {id(t): 3 if any(p in n for p in packed) else 1 for n, t in state.items()}  # tied ones counted once
    filled: dict[int, set[int]] = {}
    with torch.no_grad():
        for name, tensor in tensors:
            place = target(name, model)
            if place is None:
                continue
            ours, rows = place
            if ours not in state:
                raise CheckpointError(f"{where}: tensor {name} has no place in the model that config.json describes")
            dest = state[ours] if rows is None else state[ours][rows]
            if tensor.dim() == dest.dim() + 1 and tensor.shape[0] == 1:  # final_logits_bias is (1, V)
                tensor = tensor[0]
            if tensor.shape != dest.shape:
                raise CheckpointError(
                    f"{where}: tensor {name} has shape {tuple(tensor.shape)}, config.json gives {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            filled.setdefault(id(state[ours]), set()).add(0 if rows is None else rows.start)
    for ours, tensor in state.items():
        if ours.startswith(FRESH):
            continue
        if len(filled.get(id(tensor), ())) < parts[id(tensor)]:
            raise CheckpointError(f"{where}: no tensor fills {ours}: pass the whole folder of a supported model")
