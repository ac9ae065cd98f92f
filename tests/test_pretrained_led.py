"""Hugging Face LED folders (Longformer encoder-decoder) as our Transformer, against transformers, offline: global
attention on the source's first token or on none, sources longer than a window, padded to no window multiple."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers

import torch_handle
from tests.test_pretrained import (
    TEXTS,
    _tokenizer,
    assert_bf16_as_close_as_transformers,
    assert_first_loss_matches,
    assert_generate_matches,
    assert_round_trip,
)
from torch_handle.checkpoints import CheckpointError
from torch_handle.ctranslate2 import unsupported
from torch_handle.model import Transformer
from torch_handle.pretrained import load_pretrained

# Sources of 3 to 23 tokens over windows of 2 positions on each side (attention_window 4): most span several windows,
# and transformers pads each batch to a multiple of 4, which must change nothing.
LONG_TEXTS = [*TEXTS, " ".join(f"w{i}" for i in range(60, 81))]
SIZE = {"d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4}
SIZE |= {"decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "attention_window": 4}


def save_led(path: Path, encoder_positions: int = 64, decoder_positions: int = 24) -> tuple[Path, object, object]:
    """A random LED with BART's tokenizer saved by ``save_pretrained``: weights larger than transformers'
    initialisation (outputs then follow their sources) and a bias towards EOS (outputs end apart)."""
    torch.manual_seed(0)
    tok = _tokenizer(["<s>", "<pad>", "</s>", "<unk>"], "<s> $A </s>", "<pad>", "</s>", "<s>")
    config = transformers.LEDConfig(
        vocab_size=len(tok),
        max_encoder_position_embeddings=encoder_positions,
        max_decoder_position_embeddings=decoder_positions,
        **SIZE,
    )
    model = transformers.LEDForConditionalGeneration(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(std=0.15)
        model.final_logits_bias.normal_(std=0.5)
        model.final_logits_bias[0, config.eos_token_id] += 0.7
    # bart-large-cnn's forced <s>; outputs then end apart, greedy or beam-4, and the global token changes them.
    model.generation_config.update(max_length=12, num_beams=4, early_stopping=True, forced_bos_token_id=0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model.eval(), tok


def stand_in_led(path: Path) -> Path:
    """A tiny LED where configs/summarization_led.yaml expects allenai/led-base-16384, which cannot be downloaded
    here: its decoder holds the config's max_new_tokens."""
    return save_led(path, encoder_positions=256, decoder_positions=512)[0]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, object]:
    return save_led(tmp_path_factory.mktemp("led"))


def _global(input_ids: torch.Tensor, tokens: int = 1) -> torch.Tensor:
    """transformers' ``global_attention_mask`` for the first ``tokens`` of each source, as ``global_tokens`` says."""
    mask = torch.zeros_like(input_ids)
    mask[:, :tokens] = 1
    return mask


def test_the_config_is_led_s(folder: tuple[Path, object, object]) -> None:
    c = load_pretrained(folder[0])[0].config
    assert (c.encoder_attention, c.window, c.global_tokens) == ("longformer", 2, 1)  # attention_window 4: 2 a side
    assert (c.position, c.position_offset, c.max_len, c.max_target_len) == ("learned", 0, 64, 24)  # no BART offset
    assert (c.norm_first, c.final_norm, c.layernorm_embedding, c.scale_embeddings) == (False, False, True, False)


@pytest.mark.parametrize(
    ("backend", "global_tokens"), [("sdpa", 1), ("sdpa", 0), ("sdpa", 3), ("naive", 1), ("flex", 1)]
)
def test_encoder_output_and_logits_match_transformers(
    folder: tuple[Path, object, object], backend: str, global_tokens: int
) -> None:
    path, hf, tok = folder
    loaded = load_pretrained(path)[0]
    config = dataclasses.replace(loaded.config, attention_backend=backend, global_tokens=global_tokens)
    ours = Transformer(config).eval()
    ours.load_state_dict(loaded.state_dict())
    batch = tok(LONG_TEXTS, return_tensors="pt", padding=True)
    tgt = torch.cat([torch.full((len(LONG_TEXTS), 1), 2), torch.randint(4, 100, (len(LONG_TEXTS), 9))], dim=1)
    with torch.no_grad():
        expected = hf(**batch, global_attention_mask=_global(batch["input_ids"], global_tokens), decoder_input_ids=tgt)
        memory = ours.encode(batch["input_ids"])
        logits = ours(batch["input_ids"], tgt)
    keep = batch["attention_mask"].bool()  # transformers zeroes its padding queries; ours skip the feed-forward
    torch.testing.assert_close(memory[keep], expected.encoder_last_hidden_state[keep], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, expected.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("num_beams", [1, 4])
def test_summarize_matches_generate_with_the_first_token_global(
    folder: tuple[Path, object, object], num_beams: int
) -> None:
    path, hf, tok = folder
    batch = tok(LONG_TEXTS, return_tensors="pt", padding=True)
    mask = _global(batch["input_ids"])
    expected = hf.generate(**batch, global_attention_mask=mask, num_beams=num_beams)[:, 1:]
    assert not torch.equal(expected, hf.generate(**batch, num_beams=num_beams)[:, 1:]), "the global token counts"
    assert len({int((row != 1).sum()) for row in expected}) > 1, "outputs of one length test less"
    assert_generate_matches(path, tok, expected, num_beams, texts=LONG_TEXTS, task="summarize")


def test_init_from_trains_on_transformers_loss(folder: tuple[Path, object, object]) -> None:
    path, hf, tok = folder
    assert_first_loss_matches(
        path, hf, tok, global_attention_mask=_global(tok(TEXTS, padding=True, return_tensors="pt")["input_ids"])
    )


def test_hf_export_round_trips_through_transformers(folder: tuple[Path, object, object], tmp_path: Path) -> None:
    """--format hf writes an ``led`` folder that transformers loads and generates with as the original, and that
    imports back to the same config."""
    path, hf, tok = folder
    assert_round_trip(path, hf, tok, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert (written["model_type"], written["attention_window"]) == ("led", [4, 4])
    assert load_pretrained(tmp_path)[0].config == load_pretrained(path)[0].config


def test_unequal_windows_are_refused_in_one_line(tmp_path: Path) -> None:
    save_led(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"attention_window": [4, 8]}))
    with pytest.raises(CheckpointError) as error:
        load_pretrained(tmp_path)
    assert str(error.value) == (
        f"{tmp_path}: attention_window=[4, 8] differs between layers: our encoder has one window; pass a model with one"
    )


def test_ctranslate2_names_the_missing_converter(folder: tuple[Path, object, object]) -> None:
    assert unsupported(load_pretrained(folder[0])[0].config) == (
        "encoder_attention='longformer' (LED's): CTranslate2 has no LED converter and no Longformer attention; "
        "export --format hf and decode with transformers"
    )


def test_a_document_past_the_encoder_is_summarized_in_windows(folder: tuple[Path, object, object]) -> None:
    """``summarize`` cuts a document longer than the encoder's positions into windows that fit with ``<s>`` and
    ``</s>`` (the windows once left the prefix out, and the encoder refused them)."""
    path, _, tok = folder
    document = " ".join(f"w{i % 120}" for i in range(150))
    model = torch_handle.load(path)
    assert len(tok(document)["input_ids"]) > model.decoding.max_source_tokens
    assert isinstance(model.summarize(document, num_beams=1, max_new_tokens=6, overlap=8), str)


def test_a_long_source_never_scores_every_pair(
    folder: tuple[Path, object, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A source of 2,048 tokens with a global token: the windows with their global column, and the global token's row,
    are the only scores SDPA is given, never 2,048 x 2,048 of them."""
    config = dataclasses.replace(load_pretrained(folder[0])[0].config, max_len=2048, attention_backend="sdpa")
    model = Transformer(config).eval()
    sizes: list[int] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        sizes.append(q.shape[-2] * k.shape[-2])
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    with torch.no_grad():
        model.encode(torch.randint(4, 100, (1, 2048)))
    assert max(sizes) == 2048  # the global token's row; a block of 2 queries sees 3 x 2 keys and 1 global


@pytest.mark.parametrize("global_tokens", [0, 1])
def test_every_trainable_parameter_gets_a_gradient(folder: tuple[Path, object, object], global_tokens: int) -> None:
    """DDP waits for a gradient of every trainable parameter: with no global token, the global projections (kept for
    loading and export) are frozen, else they learn."""
    config = dataclasses.replace(load_pretrained(folder[0])[0].config, global_tokens=global_tokens)
    model = Transformer(config)
    src = torch.randint(4, 100, (2, 12))
    model(src, src[:, :6]).float().sum().backward()
    missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    assert missing == []
    assert all("global_proj" in name for name in frozen) and bool(frozen) == (global_tokens == 0)


def test_bf16_autocast_logits_are_as_close_as_transformers(folder: tuple[Path, object, object]) -> None:
    path, hf, tok = folder
    mask = _global(tok(TEXTS, padding=True, return_tensors="pt")["input_ids"])  # the first token, as global_tokens
    assert_bf16_as_close_as_transformers(path, hf, tok, global_attention_mask=mask)
