"""T5 v1.0 and v1.1, Flan-T5 and mT5: RMSNorm, relative position buckets, no biases, a ReLU or gated-GELU
feed-forward block, and their own tensor names (``encoder.block.0.layer.1.DenseReluDense.wi``), mapped onto ours.

v1.0 ties its output projection to the embedding and scales the last decoder states by d_model**-0.5; v1.1, Flan-T5
and mT5 keep an output projection of their own (``lm_head.weight`` in the folder) and do not scale.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from torch_handle.model import Transformer
from torch_handle.model.config import ConfigError, TransformerConfig

LM_HEAD = "lm_head.weight"
# feed_forward_proj -> (gated, our activation); transformers' "gated-gelu" is the tanh approximation ("gelu_new").
_PROJECTIONS = {
    "relu": (False, "relu"),
    "gelu": (False, "gelu"),
    "gelu_new": (False, "gelu_tanh"),
    "silu": (False, "silu"),
    "gated-gelu": (True, "gelu_tanh"),
    "gated-relu": (True, "relu"),
    "gated-silu": (True, "silu"),
}
_LAYER = re.compile(r"(encoder|decoder)\.block\.(\d+)\.layer\.(\d)\.(\w+)(?:\.(\w+))?\.weight")
_SUBLAYERS = {  # the index of a sub-layer in a T5 block -> our attention (or feed-forward) and its residual block
    "encoder": (("self_attn", "attn_block"), ("ff", "ff_block")),
    "decoder": (("self_attn", "self_block"), ("cross_attn", "cross_block"), ("ff", "ff_block")),
}
_QKV = {"q": 0, "k": 1, "v": 2}
_FF = {"wi": "linear1", "wi_0": "linear1", "wi_1": "gate", "wo": "linear2"}
_SIDE = {"encoder": "src", "decoder": "tgt"}
# What a model needs for transformers' T5 to express it (the output scaling is checked against the head's tying).
FIXED: dict[str, Any] = {
    "position": "relative",
    "norm": "rms",
    "bias": False,
    "scale_attention": False,
    "norm_first": True,
    "final_norm": True,
    "scale_embeddings": False,
    "layernorm_embedding": False,
    "final_logits_bias": False,
    "encoder_attention": "full",
    "cross_downsample": 1,
}


def config(hf: dict[str, Any], generation: dict[str, Any]) -> TransformerConfig:
    """Our config of the T5 or mT5 model that ``config.json`` (``hf``) describes; the head is tied until
    :func:`untie` sees the folder's own ``lm_head.weight``."""
    projection = hf.get("feed_forward_proj", "relu")
    if projection not in _PROJECTIONS:
        raise ConfigError(f"feed_forward_proj={projection!r} is not supported: one of {sorted(_PROJECTIONS)}")
    gated, activation = _PROJECTIONS[projection]

    def setting(name: str, default: Any = None) -> Any:
        return generation.get(name, hf.get(name, default))

    dropout = hf.get("dropout_rate", 0.1)
    pad = hf.get("pad_token_id", 0)
    return TransformerConfig(
        **FIXED,
        src_vocab_size=hf["vocab_size"],
        tgt_vocab_size=hf["vocab_size"],
        d_model=hf["d_model"],
        num_heads=hf["num_heads"],
        attention_head_dim=hf["d_kv"],
        num_encoder_layers=hf["num_layers"],
        num_decoder_layers=hf.get("num_decoder_layers") or hf["num_layers"],
        d_ff=hf["d_ff"],
        dropout=dropout,
        attention_dropout=dropout,
        activation_dropout=dropout,
        activation=activation,
        gated_ff=gated,
        relative_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_max_distance=hf.get("relative_attention_max_distance", 128),
        max_len=hf.get("n_positions", 512),  # the length T5 was trained at; relative positions go beyond it
        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-6),
        tie_embeddings=True,
        share_source_embedding=True,
        # transformers 5 scales T5's decoder output unless tie_word_embeddings was false; mT5's never.
        scale_decoder_output=hf["model_type"] == "t5"
        and bool(hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True) is not False)),
        pad_id=pad,
        bos_id=setting("decoder_start_token_id", pad),  # T5 starts decoding from padding
        eos_id=setting("eos_token_id", 1),
        suppress_ids=[ids[0] for ids in setting("bad_words_ids") or [] if len(ids) == 1],
        forced_bos_id=setting("forced_bos_token_id"),
        forced_eos_id=setting("forced_eos_token_id"),
    )


def untie(config: TransformerConfig, names: set[str]) -> TransformerConfig:
    """``config`` with its own output projection when the weights hold one: transformers 5 writes
    ``tie_word_embeddings: true`` beside v1.1's ``lm_head.weight``, so the weights, not config.json, tell."""
    if LM_HEAD not in names:
        return config
    return dataclasses.replace(config, tie_embeddings=False)


def target(name: str, model: Transformer) -> tuple[str, slice | None] | None:
    """Our parameter (and its rows) for the T5 tensor ``name``; None for one transformers ignores too."""
    match = _LAYER.fullmatch(name)
    if match is None:
        tops = {
            "shared.weight": "tgt_embed.weight",
            "encoder.embed_tokens.weight": "src_embed.weight",
            "decoder.embed_tokens.weight": "tgt_embed.weight",
            "encoder.final_layer_norm.weight": "encoder_norm.weight",
            "decoder.final_layer_norm.weight": "decoder_norm.weight",
        }
        return tops.get(name, name), None
    stack, block, index, module, part = match.groups()
    sublayers = _SUBLAYERS[stack]
    if int(index) >= len(sublayers):
        return name, None  # no place: fill names it
    ours, residual = sublayers[int(index)]
    prefix = f"{stack}_layers.{block}."
    if module == "layer_norm" and part is None:
        return f"{prefix}{residual}.norm.weight", None
    if module == "DenseReluDense" and ours == "ff" and part in _FF:
        return f"{prefix}ff.{_FF[part]}.weight", None
    if module in ("SelfAttention", "EncDecAttention") and ours != "ff":
        if part == "relative_attention_bias":
            if ours == "cross_attn":
                return None  # old checkpoints keep an unused one: transformers ignores it
            return (f"{_SIDE[stack]}_relative.weight", None) if block == "0" else (name, None)
        if part == "o":
            return f"{prefix}{ours}.out_proj.weight", None
        if part in _QKV:
            inner = model.config.num_heads * model.config.head_dim
            i = _QKV[part]
            return f"{prefix}{ours}.in_proj.weight", slice(i * inner, i * inner + inner)
    return name, None


def hf_names(config: TransformerConfig) -> list[str]:
    """The names of the tensors ``save_pretrained`` writes for a T5 of ``config`` (tied ones once)."""
    names = ["shared.weight", *([] if config.tie_embeddings else [LM_HEAD])]
    ff = ["wi_0", "wi_1", "wo"] if config.gated_ff else ["wi", "wo"]
    for stack, layers in (("encoder", config.num_encoder_layers), ("decoder", config.num_decoder_layers)):
        attentions = ["SelfAttention"] + (["EncDecAttention"] if stack == "decoder" else [])
        for i in range(layers):
            block = f"{stack}.block.{i}.layer"
            for j, attention in enumerate(attentions):
                names += [f"{block}.{j}.{attention}.{p}.weight" for p in ("q", "k", "v", "o")]
                names.append(f"{block}.{j}.layer_norm.weight")
            names += [f"{block}.{len(attentions)}.DenseReluDense.{p}.weight" for p in ff]
            names.append(f"{block}.{len(attentions)}.layer_norm.weight")
        names += [f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] if layers else []
        names.append(f"{stack}.final_layer_norm.weight")
    return names


def obstacle(config: TransformerConfig) -> str | None:
    """Why transformers' T5 cannot express ``config`` (a model with ``position='relative'``), naming the field."""
    for name, value in FIXED.items():
        if getattr(config, name) != value:
            return f"{name}={getattr(config, name)!r}: no Hugging Face family expresses it (T5 needs {name}={value!r})"
    if not config.shares_source_embedding:
        return "share_source_embedding=False: T5 shares one source and target embedding"
    if config.scale_decoder_output and not config.tie_embeddings:
        return (
            "scale_decoder_output=True with tie_embeddings=False: transformers' T5 scales the decoder output only "
            "when its output projection is the embedding"
        )
    if (config.gated_ff, config.activation) not in _PROJECTIONS.values():
        return f"activation={config.activation!r} with gated_ff=True: T5's gated block is gelu_tanh, relu or silu"
    return None


def config_json(config: TransformerConfig) -> dict[str, Any]:
    """The ``config.json`` of transformers' T5 for ``config`` (one :func:`obstacle` passes)."""
    projection = next(k for k, v in _PROJECTIONS.items() if v == (config.gated_ff, config.activation))
    return {
        "model_type": "t5",
        "architectures": ["T5ForConditionalGeneration"],
        "vocab_size": config.tgt_vocab_size,
        "d_model": config.d_model,
        "d_kv": config.head_dim,
        "d_ff": config.d_ff,
        "num_layers": config.num_encoder_layers,
        "num_decoder_layers": config.num_decoder_layers,
        "num_heads": config.num_heads,
        "relative_attention_num_buckets": config.relative_buckets,
        "relative_attention_max_distance": config.relative_max_distance,
        "dropout_rate": config.dropout,
        "layer_norm_epsilon": config.layer_norm_eps,
        "feed_forward_proj": projection,
        "n_positions": config.max_len,
        "tie_word_embeddings": config.tie_embeddings,
        "scale_decoder_outputs": config.scale_decoder_output,  # transformers 5 reads it; mT5 tied and unscaled
        "pad_token_id": config.pad_id,
        "eos_token_id": config.eos_id,
        "decoder_start_token_id": config.bos_id,
        "is_encoder_decoder": True,
    }
