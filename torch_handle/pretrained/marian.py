"""Marian (opus-mt) and PEGASUS: sinusoidal positions in halves, scaled embeddings; Marian post-LN, PEGASUS pre-LN."""

from __future__ import annotations

from typing import Any

from torch_handle.model.config import TransformerConfig
from torch_handle.pretrained.layout import seq2seq_fields


def config(hf: dict[str, Any], generation: dict[str, Any]) -> TransformerConfig:
    """Our config of the Marian or PEGASUS model that ``config.json`` (``hf``) describes."""
    pre_ln = hf["model_type"] == "pegasus"  # PEGASUS normalizes first and ends each stack in a LayerNorm
    fields = seq2seq_fields(hf, generation)
    return TransformerConfig(
        **fields,
        position="sinusoidal",
        sinusoid_layout="halves",
        scale_embeddings=bool(hf.get("scale_embedding", False)),
        norm_first=pre_ln,
        final_norm=pre_ln,
        share_source_embedding=bool(hf.get("share_encoder_decoder_embeddings", True))
        and fields["src_vocab_size"] == fields["tgt_vocab_size"],
    )
