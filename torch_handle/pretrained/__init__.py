"""Hugging Face encoder-decoders as our one :class:`~torch_handle.model.Transformer`: a folder that
``save_pretrained`` wrote becomes a model, its tokenizer and its decoding defaults, without ``transformers`` (but
to convert Marian's sentencepiece files, :mod:`torch_handle.data.marian`); a hub id is fetched by
:mod:`torch_handle.pretrained.hub`.

Each family is a function from ``config.json`` and ``generation_config.json`` to a ``TransformerConfig``; the tensors
of BART, Marian, PEGASUS and LED share one layout (:mod:`torch_handle.pretrained.layout`), T5's have their own
(:mod:`torch_handle.pretrained.t5`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch_handle.checkpoints import CheckpointError
from torch_handle.data.tokenizer import Specials, Tokenizer, pretrained_tokenizer, read_tokenizer
from torch_handle.export import Decoding, empty_model, has_type, meta_shell
from torch_handle.model import Transformer
from torch_handle.model.config import ConfigError, TransformerConfig
from torch_handle.pretrained import bart, led, marian, t5
from torch_handle.pretrained.layout import fill
from torch_handle.pretrained.reader import (
    CONFIG,
    GENERATION,
    is_pretrained_folder,
    read_json,
    read_weights,
    weight_files,
    weight_names,
)

__all__ = ["FAMILIES", "fill", "is_pretrained_folder", "load_pretrained", "pretrained_config", "pretrained_tokenizer"]


FAMILIES: dict[str, Callable[[dict[str, Any], dict[str, Any]], TransformerConfig]] = {
    "bart": bart.config,
    "mbart": bart.config,
    "led": led.config,
    "marian": marian.config,
    "pegasus": marian.config,
    "t5": t5.config,
    "mt5": t5.config,
}
_DECODING: dict[str, Any] = {  # the decoding defaults read (from generation_config.json, else config.json), typed
    "num_beams": int, "max_length": int, "length_penalty": float, "no_repeat_ngram_size": int,
    "repetition_penalty": float, "min_length": int, "min_new_tokens": int, "do_sample": bool, "temperature": float,
    "top_k": int, "top_p": float, "max_new_tokens": int,
}  # fmt: skip
_LEAST = {"num_beams": 1, "max_length": 2, "max_new_tokens": 1, "no_repeat_ngram_size": 0, "min_length": 0, "top_k": 0}
_UNSET = 2**31  # a tokenizer without a length says so with a sentinel (transformers': about 1e30)
log = logging.getLogger(__name__)

_TASKS = {"marian": "translation"}  # what ``Model.summarize``'s long-document path and ``test`` assume


def pretrained_config(folder: Path) -> tuple[TransformerConfig, Decoding, dict[str, Any]]:
    """The folder's model config, its decoding defaults, and its generation config as read."""
    hf = read_json(folder / CONFIG)
    generation = read_json(folder / GENERATION, required=False)
    model_type = hf.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise CheckpointError(
            f"{folder}: model_type {hf.get('model_type')!r} is not supported; supported: {', '.join(sorted(FAMILIES))}"
        )
    try:
        config = family(hf, generation)
        if config.position == "relative":  # T5: the weights tell whether the head is tied (see t5.untie)
            config = t5.untie(config, weight_names(folder))
    except KeyError as err:
        raise CheckpointError(f"{folder}: config.json lacks {err}") from None
    except TypeError as err:  # a value of another JSON type than the family reads
        reason = f"config.json holds a value of the wrong type ({err})"
        raise CheckpointError(f"{folder}: {reason}: pass a folder written by save_pretrained") from None
    except ConfigError as err:
        raise CheckpointError(f"{folder}: {err}") from None
    _check_size(folder, config)
    return config, _decoding(folder, hf, generation, config), generation


def _decoding(folder: Path, hf: dict[str, Any], generation: dict[str, Any], config: TransformerConfig) -> Decoding:
    """The folder's decoding defaults, as transformers' ``generate`` reads them, each checked."""
    given = {name: hf[name] for name in _DECODING if name in hf} | generation  # older folders keep them in config.json
    given = {name: value for name, value in given.items() if name in _DECODING and value is not None}  # null: unset
    wrong = sorted(name for name, hint in _DECODING.items() if name in given and not has_type(given[name], hint))
    if not wrong:
        wrong = sorted(f"{name}={given[name]}" for name, least in _LEAST.items() if given.get(name, least) < least)
    if wrong:
        raise CheckpointError(
            f"{folder}: the decoding settings {wrong} have the wrong type or value: pass a folder written by "
            "save_pretrained"
        )
    # max_new_tokens first; max_length counts the decoder's start token; neither: 20 new tokens
    new_tokens = given.get("max_new_tokens", given["max_length"] - 1 if "max_length" in given else 20)
    limit = read_json(folder / "tokenizer_config.json", required=False).get("model_max_length")  # its truncation
    limited = isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < (config.context_length or _UNSET)
    if limited and limit < config.max_len:
        log.info("%s: sources are read up to tokenizer_config.json's model_max_length=%d", folder, limit)
    return Decoding(
        task=_TASKS.get(hf["model_type"], "summarization"),
        max_source_tokens=limit if limited else config.max_len,
        num_beams=given.get("num_beams", 1),
        max_new_tokens=min(new_tokens, (config.target_length or config.max_len) - 1),
        length_penalty=given.get("length_penalty", 1.0),
        **generation_controls(given),
    )


def _check_size(folder: Path, config: TransformerConfig) -> None:
    """Refuses a ``config.json`` that describes more parameters than the weight files have bytes (a forged
    ``d_model`` would otherwise allocate without bound): counted on the meta device, before anything is allocated."""
    held = sum(file.stat().st_size for file in weight_files(folder))
    # Each layer holds at least a norm of d_model: a bound that needs no shell, whose time grows with the layers.
    layers = config.num_encoder_layers + config.num_decoder_layers
    parameters = layers * config.d_model
    if parameters <= held:
        parameters = sum(p.numel() for p in meta_shell(config).parameters())
    if parameters > held:
        raise CheckpointError(
            f"{folder}: config.json describes {parameters} parameters, more than its weight files' {held} bytes "
            "hold: refused; pass the config.json save_pretrained wrote with these weights"
        )


def generation_controls(generation: dict[str, Any]) -> dict[str, Any]:
    """The decoding controls a ``generation_config.json`` sets, with transformers' defaults where it is silent
    (``top_k`` 50 when sampling); ``min_length`` counts the decoder's start token, ``min_new_tokens`` does not."""
    controls = {
        "no_repeat_ngram_size": generation.get("no_repeat_ngram_size") or 0,
        "repetition_penalty": generation.get("repetition_penalty") or 1.0,
        "min_new_tokens": generation.get("min_new_tokens") or max(0, (generation.get("min_length") or 0) - 1),
    }
    if generation.get("do_sample"):
        controls |= {
            "do_sample": True,
            "temperature": generation.get("temperature") or 1.0,
            "top_k": generation.get("top_k", 50) or 0,
            "top_p": generation.get("top_p") or 1.0,
        }
    return controls


def load_pretrained(folder: str | Path, attention_backend: str = "auto") -> tuple[Transformer, Tokenizer, Decoding]:
    """The model of a Hugging Face folder with its weights, its tokenizer and its decoding defaults.

    Raises:
        CheckpointError: an unsupported ``model_type``, a tensor whose shape does not fit, a missing file; the
            message names it.
    """
    folder = Path(folder)
    config, decoding, _ = pretrained_config(folder)
    tokenizer = read_tokenizer(folder, Specials(config.pad_id, config.bos_id, config.eos_id))
    model = empty_model(dataclasses.replace(config, attention_backend=attention_backend))
    fill(model, read_weights(folder), str(folder))
    return model, tokenizer, decoding
