"""BART and mBART: learned positions offset by 2, a LayerNorm over the embeddings, post-LN BART and pre-LN mBART."""

from __future__ import annotations

from typing import Any

from torch_handle.model.config import TransformerConfig
from torch_handle.pretrained.layout import seq2seq_fields


def config(hf: dict[str, Any], generation: dict[str, Any]) -> TransformerConfig:
    """Our config of the BART or mBART model that ``config.json`` (``hf``) describes."""
    pre_ln = hf["model_type"] == "mbart"  # mBART normalizes first and ends each stack in a LayerNorm
    return TransformerConfig(
        **seq2seq_fields(hf, generation),
        position="learned",
        position_offset=2,
        scale_embeddings=bool(hf.get("scale_embedding", False)),
        layernorm_embedding=True,
        norm_first=pre_ln,
        final_norm=pre_ln,
        share_source_embedding=True,
    )
