"""Our Transformer as a CTranslate2 model folder: ``torch-handle export --format ctranslate2 CKPT OUT_DIR``
(:func:`torch_handle.export.export_ctranslate2` reads the checkpoint and calls :func:`write_model`).

CTranslate2 is the inference engine OpenNMT exports to (fast CPU decoding, int8 for free with
``Translator(folder, compute_type="int8")``). The folder holds ``model.bin``, the vocabulary and ``config.json``
written by CTranslate2's own ``TransformerSpec`` (which validates every weight), and ``tokenizer.json``, so that
``translate_batch`` reproduces ``torch_handle.load(...).translate``: greedy and beam search give the same tokens
(pass ``return_end_token=True`` to beam search: we count ``<eos>`` in the length that ``length_penalty``
divides by, CTranslate2 does so only then). ``<pad>`` and ``<bos>`` are never predicted, as in our decoding: the
output projection's bias rules them out. The source gets its ``<eos>`` from the config (``add_source_eos``), as
our collator appends it, so users pass the tokenizer's tokens as they are (an empty source is the exception:
CTranslate2 returns an empty output without decoding, where we decode from ``<eos>`` alone).

Configurations CTranslate2's spec cannot express are refused with one line naming the field (:class:`ExportError`).
``ctranslate2`` is an optional dependency (``pip install 'torch-handle[bench]'``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.imports import RequirementCache
from torch import Tensor, nn

from torch_handle.atomic import atomic_folder
from torch_handle.data.tokenizer import UNK_ID
from torch_handle.model import Transformer, TransformerConfig
from torch_handle.model.attention import MultiHeadAttention
from torch_handle.model.config import WITHOUT_T5
from torch_handle.model.layers import FeedForward

if TYPE_CHECKING:
    from ctranslate2.specs import TransformerSpec

log = logging.getLogger(__name__)

CTRANSLATE2 = "ctranslate2>=4.0"  # as the bench and test extras in setup.cfg
CTRANSLATE2_AVAILABLE = RequirementCache(CTRANSLATE2)
TOKENIZER_FILE = "tokenizer.json"


class ExportError(ValueError):
    """A model CTranslate2 cannot hold, or a folder we cannot write; one line that names the field and the fix."""


def unsupported(config: TransformerConfig) -> str | None:
    """Why CTranslate2's ``TransformerSpec`` cannot express ``config``, naming the field; None when it can."""
    if config.encoder_attention == "longformer":
        return (
            "encoder_attention='longformer' (LED's): CTranslate2 has no LED converter and no Longformer attention; "
            "export --format hf and decode with transformers"
        )
    if not config.norm_first:
        return (
            "norm_first=False (post-LN): CTranslate2's post-norm Transformer has no final LayerNorm, ours does; "
            "train with norm_first: true"
        )
    for name in ("num_encoder_layers", "num_decoder_layers"):
        if getattr(config, name) == 0:
            return (
                f"{name}=0: CTranslate2 counts layers from the weights and needs one at least; train with {name} >= 1"
            )
    if config.position not in ("sinusoidal", "learned"):
        return (
            f"position={config.position!r}: the CTranslate2 export holds additive position tables only; "
            "train with position: sinusoidal or learned"
        )
    if config.encoder_attention != "full":
        return (
            f"encoder_attention={config.encoder_attention!r} (window={config.window}): CTranslate2's encoder "
            "attends to every position; train with encoder_attention: full"
        )
    if config.cross_downsample != 1:
        return (
            f"cross_downsample={config.cross_downsample}: CTranslate2's decoder attends to every encoder position; "
            "train with cross_downsample: 1"
        )
    if config.copy_attention:
        return (
            "copy_attention=True: CTranslate2's decoder has no copy distribution; decode with torch_handle.load, or "
            "export --format safetensors"
        )
    imported = {name: getattr(config, name) for name, ours in _OURS.items() if getattr(config, name) != ours}
    if config.activation == "silu":
        imported["activation"] = "silu"
    if imported:  # options of imported Hugging Face models (torch_handle.pretrained)
        name, value = next(iter(imported.items()))
        return (
            f"{name}={value!r}: torch-handle's own CTranslate2 layout lacks it, and no Hugging Face family that "
            "CTranslate2 converts (BART, mBART, Marian, PEGASUS, T5) expresses it"
        )
    return None


# The values of the options that only imported models change; the spec written here assumes them.
_OURS: dict[str, object] = {
    "sinusoid_layout": "interleaved",
    "position_offset": 0,
    "scale_embeddings": True,
    "layernorm_embedding": False,
    "final_logits_bias": False,
    "share_source_embedding": None,
    "suppress_ids": None,
    "forced_bos_id": None,
    "forced_eos_id": None,
    **WITHOUT_T5,
}


def _ctranslate2_specs() -> Any:
    if not CTRANSLATE2_AVAILABLE:
        raise ExportError(f"{CTRANSLATE2} is not installed: pip install 'torch-handle[bench]'")
    from ctranslate2 import specs

    return specs


def _tensor(t: Tensor) -> Tensor:
    """A float32 copy: the spec's int8 quantization scales its arrays in place, never the model's weights."""
    return t.detach().float().contiguous().clone()


def _set_linear(spec: Any, weight: Tensor, bias: Tensor | None) -> None:
    spec.weight = _tensor(weight)
    if bias is not None:
        spec.bias = _tensor(bias)


def _set_norm(spec: Any, norm: nn.LayerNorm) -> None:
    spec.gamma, spec.beta = _tensor(norm.weight), _tensor(norm.bias)


def _set_attention(spec: Any, attention: MultiHeadAttention, cross: bool) -> None:
    """Self-attention: one fused (q, k, v) projection, as ours. Cross-attention: q, then the fused (k, v) rows."""
    w, b = attention.in_proj.weight, attention.in_proj.bias
    if cross:
        c = w.shape[1]
        _set_linear(spec.linear[0], w[:c], b[:c])
        _set_linear(spec.linear[1], w[c:], b[c:])
    else:
        _set_linear(spec.linear[0], w, b)
    _set_linear(spec.linear[-1], attention.out_proj.weight, attention.out_proj.bias)


def _set_ffn(spec: Any, ff: FeedForward, norm: nn.LayerNorm) -> None:
    _set_norm(spec.layer_norm, norm)
    _set_linear(spec.linear_0, ff.linear1.weight, ff.linear1.bias)
    _set_linear(spec.linear_1, ff.linear2.weight, ff.linear2.bias)


def _positions(model: Transformer, table: str) -> Tensor:
    """The additive position table ``(max_len, d_model)``, written out so that no layout can disagree with ours."""
    return model.pe if model.config.position == "sinusoidal" else getattr(model, table).weight


def transformer_spec(model: Transformer) -> TransformerSpec:
    """The weights of ``model`` in CTranslate2's pre-norm ``TransformerSpec`` (no vocabulary registered yet).

    Embeddings are scaled by sqrt(d_model) on both sides (the spec's ``scale_embeddings``), then the position
    table is added; each sub-layer normalises its input and both stacks end in a LayerNorm with our epsilon.

    Raises:
        ExportError: ``model``'s config is one CTranslate2 cannot express (:func:`unsupported`), or
            ``ctranslate2`` is not installed.
    """
    c = model.config
    reason = unsupported(c)
    if reason is not None:
        raise ExportError(reason)
    specs = _ctranslate2_specs()
    activation = specs.Activation.GELU if c.activation == "gelu" else specs.Activation.RELU  # GELU is erf's
    encoder = specs.TransformerEncoderSpec(c.num_encoder_layers, c.num_heads, pre_norm=True, activation=activation)
    decoder = specs.TransformerDecoderSpec(c.num_decoder_layers, c.num_heads, pre_norm=True, activation=activation)
    spec = specs.TransformerSpec(encoder, decoder)
    spec.config.layer_norm_epsilon = c.layer_norm_eps

    encoder.embeddings[0].weight = _tensor(model.src_embed.weight)
    encoder.position_encodings.encodings = _tensor(_positions(model, "src_pos"))
    _set_norm(encoder.layer_norm, model.encoder_norm)
    for layer_spec, layer in zip(encoder.layer, model.encoder_layers, strict=True):
        _set_norm(layer_spec.self_attention.layer_norm, layer.attn_block.norm)
        _set_attention(layer_spec.self_attention, layer.self_attn, cross=False)
        _set_ffn(layer_spec.ffn, layer.ff, layer.ff_block.norm)

    decoder.embeddings.weight = _tensor(model.tgt_embed.weight)
    decoder.position_encodings.encodings = _tensor(_positions(model, "tgt_pos"))
    _set_norm(decoder.layer_norm, model.decoder_norm)
    for layer_spec, layer in zip(decoder.layer, model.decoder_layers, strict=True):
        _set_norm(layer_spec.self_attention.layer_norm, layer.self_block.norm)
        _set_attention(layer_spec.self_attention, layer.self_attn, cross=False)
        _set_norm(layer_spec.attention.layer_norm, layer.cross_block.norm)
        _set_attention(layer_spec.attention, layer.cross_attn, cross=True)
        _set_ffn(layer_spec.ffn, layer.ff, layer.ff_block.norm)
    # Our decoding never predicts padding or <bos> (steps.next_token_logits); a bias of -inf on their rows
    # makes CTranslate2 do the same with no option passed. Biases are not quantized: int8 keeps it.
    bias = torch.zeros(c.tgt_vocab_size)
    bias[[c.pad_id, c.bos_id]] = -math.inf
    _set_linear(decoder.projection, model.lm_head.weight, bias)
    return spec


def check_free(out_dir: Path) -> None:
    """Refuses a folder that holds files: a rename never replaces it, and nothing a user has is overwritten."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir} already exists and is not an empty folder: remove it or pass a new folder")


def write_model(model: Transformer, tokens: Sequence[str], out_dir: str | Path, tokenizer: str | None = None) -> Path:
    """Writes ``model`` as a CTranslate2 model folder ``out_dir``, whole or not at all.

    Args:
        model: The Transformer.
        tokens: The vocabulary in id order (source and target share it; a smaller vocabulary takes its first ids).
        out_dir: The folder to create; it must not exist, or be empty.
        tokenizer: The tokenizer's JSON, written as ``tokenizer.json`` when given.

    Raises:
        ExportError: The model or the vocabulary cannot be exported, or ``out_dir`` holds files.
    """
    c, out_dir = model.config, Path(out_dir)
    check_free(out_dir)
    spec = transformer_spec(model)
    if len(tokens) < max(c.src_vocab_size, c.tgt_vocab_size):
        raise ExportError(
            f"{len(tokens)} tokens for a model with src_vocab_size={c.src_vocab_size} and "
            f"tgt_vocab_size={c.tgt_vocab_size}: pass the tokenizer the model was trained with"
        )
    spec.register_source_vocabulary(list(tokens[: c.src_vocab_size]))
    spec.register_target_vocabulary(list(tokens[: c.tgt_vocab_size]))
    spec.config.bos_token = spec.config.decoder_start_token = tokens[c.bos_id]
    spec.config.eos_token = tokens[c.eos_id]
    spec.config.unk_token = tokens[UNK_ID]
    spec.config.add_source_bos, spec.config.add_source_eos = False, True  # as our collator: tokens, then <eos>
    spec.validate()
    spec.optimize()  # aliases the tied and shared matrices: stored once
    with atomic_folder(out_dir) as tmp:
        spec.save(str(tmp))
        if tokenizer is not None:
            (tmp / TOKENIZER_FILE).write_text(tokenizer, encoding="utf-8")
    log.info("wrote a CTranslate2 model to %s", out_dir)
    return out_dir


def vocabulary(tokenizer: str) -> list[str]:
    """The tokens of a tokenizer's JSON in id order."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_str(tokenizer).get_vocab(with_added_tokens=True)
    tokens = sorted(ids, key=ids.__getitem__)
    if [ids[t] for t in tokens] != list(range(len(tokens))):
        raise ExportError("the tokenizer's ids are not 0..n-1 without gaps: export needs one token per id")
    return tokens
