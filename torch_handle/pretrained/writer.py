"""Our Transformer back as a Hugging Face folder, for the models whose options a family of
:mod:`torch_handle.pretrained` expresses: ``transformers.AutoModelForSeq2SeqLM.from_pretrained`` reads it.

The tensor names are the reader's, inverted through the same mapping (:func:`torch_handle.pretrained.layout.hf_names`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from torch_handle import export
from torch_handle.ctranslate2 import ExportError, check_free
from torch_handle.data.marian import PieceTokenizer
from torch_handle.data.tokenizer import Tokenizer
from torch_handle.export import Decoding
from torch_handle.export.write import write_exported
from torch_handle.model import Transformer, TransformerConfig
from torch_handle.model.config import WITHOUT_T5
from torch_handle.pretrained import led, t5
from torch_handle.pretrained.layout import hf_names, target

log = logging.getLogger(__name__)

# What each family fixes; a model that differs from every family gets the nearest one's first difference named.
_FULL = {"encoder_attention": "full", "max_target_len": None}  # every family but LED
_FAMILIES: dict[str, dict[str, Any]] = {
    "bart": {**_FULL, "position": "learned", "position_offset": 2, "layernorm_embedding": True, "norm_first": False},
    "mbart": {**_FULL, "position": "learned", "position_offset": 2, "layernorm_embedding": True, "norm_first": True},
    "marian": {
        **_FULL,
        "position": "sinusoidal",
        "sinusoid_layout": "halves",
        "layernorm_embedding": False,
        "norm_first": False,
    },
    "pegasus": {
        **_FULL,
        "position": "sinusoidal",
        "sinusoid_layout": "halves",
        "layernorm_embedding": False,
        "norm_first": True,
    },
    "led": led.FIXED,
}
_COMMON = {
    "final_logits_bias": True,
    "cross_downsample": 1,
    "layer_norm_eps": 1e-5,
    **WITHOUT_T5,
}
_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "swish"}
_ARCHITECTURES = {
    "bart": "BartForConditionalGeneration",
    "mbart": "MBartForConditionalGeneration",
    "marian": "MarianMTModel",
    "pegasus": "PegasusForConditionalGeneration",
    "led": "LEDForConditionalGeneration",
}


def hf_family(config: TransformerConfig) -> tuple[str | None, str]:
    """The Hugging Face ``model_type`` that expresses ``config``; else None and one line naming the obstacle."""
    if config.copy_attention:
        return None, "copy_attention=True: no Hugging Face family has a copy distribution; export --format safetensors"
    if config.position == "relative":
        reason = t5.obstacle(config)
        return (None, reason) if reason else ("t5", "")
    family, reason = _nearest_family(config)
    if family is not None and family != "marian" and not config.shares_source_embedding:
        return None, "share_source_embedding=False: of the families written here, only Marian has two embeddings"
    return family, reason


def _nearest_family(config: TransformerConfig) -> tuple[str | None, str]:
    nearest: tuple[int, str, str, Any] | None = None
    for family, fixed in _FAMILIES.items():
        wanted = {**fixed, **_COMMON, "final_norm": fixed["norm_first"]}
        wrong = [(name, value) for name, value in wanted.items() if getattr(config, name) != value]
        if not wrong:
            return family, ""
        if nearest is None or len(wrong) < nearest[0]:
            nearest = (len(wrong), family, *wrong[0])
    assert nearest is not None
    _, family, name, value = nearest
    return None, (
        f"{name}={getattr(config, name)!r}: no Hugging Face family expresses it (the nearest, {family}, needs "
        f"{name}={value!r})"
    )


def _config_json(config: TransformerConfig, family: str) -> dict[str, Any]:
    if family == "t5":
        return t5.config_json(config)
    learned = config.position == "learned"
    fields = {
        "model_type": family,
        "architectures": [_ARCHITECTURES[family]],
        "vocab_size": config.src_vocab_size,
        **({"decoder_vocab_size": config.tgt_vocab_size} if family == "marian" else {}),
        "d_model": config.d_model,
        "encoder_attention_heads": config.num_heads,
        "decoder_attention_heads": config.num_heads,
        "encoder_layers": config.num_encoder_layers,
        "decoder_layers": config.num_decoder_layers,
        "encoder_ffn_dim": config.d_ff,
        "decoder_ffn_dim": config.d_ff,
        "dropout": config.dropout,
        "attention_dropout": config.attention_p,
        "activation_dropout": config.activation_p,
        "activation_function": _ACTIVATIONS[config.activation],
        "max_position_embeddings": config.max_len,
        "scale_embedding": config.scale_embeddings,
        "tie_word_embeddings": config.tie_embeddings,
        "share_encoder_decoder_embeddings": config.shares_source_embedding,
        "normalize_before": config.norm_first,
        "normalize_embedding": config.layernorm_embedding,  # CTranslate2 reads both; transformers does not
        "pad_token_id": config.pad_id,
        "eos_token_id": config.eos_id,
        "decoder_start_token_id": config.bos_id,
        "forced_eos_token_id": config.forced_eos_id,
        "is_encoder_decoder": True,
        **({"bos_token_id": config.forced_bos_id} if learned and config.forced_bos_id is not None else {}),
    }
    return led.config_json(fields, config) if family == "led" else fields


def _generation_json(config: TransformerConfig, decoding: Decoding) -> dict[str, Any]:
    generation = {
        "decoder_start_token_id": config.bos_id,
        "eos_token_id": config.eos_id,
        "pad_token_id": config.pad_id,
        "forced_bos_token_id": config.forced_bos_id,
        "forced_eos_token_id": config.forced_eos_id,
        "num_beams": decoding.num_beams,
        "max_length": decoding.max_new_tokens + 1,  # transformers counts the decoder's start token
        "length_penalty": decoding.length_penalty,
        "early_stopping": True,  # our beam search: a source is done once it holds num_beams hypotheses
        "no_repeat_ngram_size": decoding.no_repeat_ngram_size,
        "repetition_penalty": decoding.repetition_penalty,
        "min_length": decoding.min_new_tokens + 1 if decoding.min_new_tokens else None,  # counts the start token
    }
    if decoding.do_sample:
        generation |= {"do_sample": True, "temperature": decoding.temperature, "top_k": decoding.top_k}
        generation["top_p"] = decoding.top_p
    if config.suppressed:
        generation["bad_words_ids"] = [[token] for token in config.suppressed]
    return {k: v for k, v in generation.items() if v is not None}


def write_hf(model: Transformer, tokenizer: Tokenizer, decoding: Decoding, out_dir: str | Path) -> Path:
    """Write ``model`` with its tokenizer and decoding defaults as the Hugging Face folder ``out_dir``.

    Raises:
        ExportError: no family expresses the model; the message names the option.
    """
    config = model.config
    family, reason = hf_family(config)
    if family is None:
        raise ExportError(reason)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    tensors = {}
    for name in hf_names(config):
        ours, rows = target(name, model)  # type: ignore[misc] - every name written has a place
        tensor = state[ours] if rows is None else state[ours][rows]
        tensors[name] = (tensor[None] if name == "final_logits_bias" else tensor).contiguous().clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_config_json(config, family), indent=2))
    (out / "generation_config.json").write_text(json.dumps(_generation_json(config, decoding), indent=2))
    if isinstance(tokenizer, PieceTokenizer):  # Marian's sentencepiece files, as the folder it came from held them
        tokenizer.write_folder(out)
    else:
        _write_tokenizer(tokenizer, config, out)
    # The run's source length: transformers' tokenizers truncate there, and an import reads it back.
    path = out / "tokenizer_config.json"
    path.write_text(
        json.dumps(json.loads(path.read_text()) | {"model_max_length": decoding.max_source_tokens}, indent=2)
    )
    return out


def _write_tokenizer(tokenizer: Tokenizer, config: TransformerConfig, out: Path) -> None:
    """``tokenizer.json`` and the ``tokenizer_config.json`` that names its special tokens."""
    tokenizer.backend.save(str(out / "tokenizer.json"))
    backend = tokenizer.backend
    names = {"pad_token": backend.id_to_token(config.pad_id), "eos_token": backend.id_to_token(config.eos_id)}
    if tokenizer.specials.source_prefix:
        names["bos_token"] = backend.id_to_token(tokenizer.specials.source_prefix[0])
    unk = getattr(backend.model, "unk_token", None)  # BPE and WordPiece name it; a Unigram model numbers it
    unk_id = json.loads(backend.to_str())["model"].get("unk_id") if unk is None else None
    unk = backend.id_to_token(unk_id) if unk_id is not None else unk
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **names, **({"unk_token": unk} if unk else {})}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def export_hf(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write the model of ``checkpoint`` (a ``.ckpt`` file, a checkpoint folder or a ``.safetensors`` export) as the
    Hugging Face folder ``out_dir``; a model that no family expresses is refused before any weight is read."""
    check_free(Path(out_dir))
    if export.is_exported(checkpoint):
        config, tokenizer = export.exported_metadata(checkpoint)
        weights, decoding = export.exported_weights(checkpoint), export.exported_decoding(checkpoint, config)
    else:
        weights, config, text, decoding = export.read_model(checkpoint)
        tokenizer = Tokenizer.from_str(text)
    family, reason = hf_family(config)
    if family is None:
        raise ExportError(reason)
    model = export.empty_model(config)
    model.load_state_dict(weights, strict=True)
    return write_hf(model, tokenizer, decoding, out_dir)


def export_folder(folder: str | Path, output: str | Path, form: str = "safetensors") -> Path:
    """Write the Hugging Face folder ``folder``, read as :func:`~torch_handle.pretrained.load_pretrained` reads it, as
    ``form``: one safetensors file for :func:`torch_handle.load`, a CTranslate2 folder (CTranslate2's converter on
    the folder :func:`write_hf` writes) or that Hugging Face folder itself."""
    from torch_handle.pretrained import load_pretrained, pretrained_config
    from torch_handle.pretrained.ctranslate2 import converted_family, write_converted  # it imports this module

    if form != "safetensors":
        check_free(Path(output))  # before reading weights that may be large
        config = pretrained_config(Path(folder))[0]
        family, reason = converted_family(config) if form == "ctranslate2" else hf_family(config)
        if family is None:
            raise ExportError(reason)
    model, tokenizer, decoding = load_pretrained(folder)
    if form == "ctranslate2":
        return write_converted(model, tokenizer, decoding, output)
    if form == "hf":
        return write_hf(model, tokenizer, decoding, output)
    weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}  # tied ones apart
    write_exported(weights, model.config, tokenizer.to_str(), decoding, output)
    log.info("exported %d tensors from %s to %s", len(weights), folder, output)
    return Path(output)
