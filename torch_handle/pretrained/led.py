"""LED (Longformer encoder-decoder, ``allenai/led-base-16384``): BART's post-LN layout with learned positions from 0
(no offset), a decoder table shorter than the encoder's, and Longformer self-attention in the encoder: a window of
``attention_window / 2`` positions on each side, plus global tokens with projections of their own.

transformers takes the global tokens at each call (``global_attention_mask``); our config fixes them as the first
``global_tokens`` source positions, the first (``<s>``) by default, as LED summarizes.
"""

from __future__ import annotations

from typing import Any

from torch_handle.model.config import ConfigError, TransformerConfig
from torch_handle.pretrained.layout import seq2seq_fields

# What a model needs for transformers' LED to express it.
FIXED: dict[str, Any] = {
    "position": "learned",
    "position_offset": 0,
    "layernorm_embedding": True,
    "scale_embeddings": False,
    "norm_first": False,
    "final_norm": False,
    "encoder_attention": "longformer",
}


def config(hf: dict[str, Any], generation: dict[str, Any]) -> TransformerConfig:
    """Our config of the LED model that ``config.json`` (``hf``) describes."""
    windows = hf.get("attention_window", 512)
    windows = [windows] * max(hf["encoder_layers"], 1) if isinstance(windows, int) else list(windows)
    if len(set(windows)) != 1:
        raise ConfigError(
            f"attention_window={windows} differs between layers: our encoder has one window; pass a model with one"
        )
    window = windows[0]
    if not isinstance(window, int) or window < 2 or window % 2:
        raise ConfigError(f"attention_window={window} must be an even number >= 2, as transformers' LED asks")
    fields = seq2seq_fields({**hf, "max_position_embeddings": hf["max_encoder_position_embeddings"]}, generation)
    return TransformerConfig(
        **fields,
        **FIXED,
        max_target_len=hf["max_decoder_position_embeddings"],
        window=window // 2,
        share_source_embedding=True,
    )


def config_json(fields: dict[str, Any], config: TransformerConfig) -> dict[str, Any]:
    """transformers' LED ``config.json`` for ``config``, from the ``fields`` that BART's shares."""
    bart_only = ("max_position_embeddings", "scale_embedding", "normalize_before", "share_encoder_decoder_embeddings")
    return {name: value for name, value in fields.items() if name not in bart_only} | {
        "max_encoder_position_embeddings": config.max_len,
        "max_decoder_position_embeddings": config.target_length,
        "attention_window": [2 * config.window] * config.num_encoder_layers,
    }
