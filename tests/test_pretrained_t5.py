"""Hugging Face T5 v1.0, v1.1 (Flan-T5's architecture) and mT5 folders as our Transformer, against transformers."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.test_pretrained import (
    TEXTS,
    WORDS,
    assert_bf16_as_close_as_transformers,
    assert_first_loss_matches,
    assert_generate_matches,
    assert_logits_match,
    assert_round_trip,
)
from torch_handle.ctranslate2 import ExportError
from torch_handle.model import ConfigError, Transformer, TransformerConfig
from torch_handle.pretrained import load_pretrained, pretrained_tokenizer
from torch_handle.pretrained.writer import write_hf

# d_kv * num_heads is not d_model (as in t5-v1_1-small and mT5), and few buckets over a short distance put the
# tokens of these texts in the logarithmic buckets too.
SIZE = {"d_model": 32, "d_kv": 16, "num_heads": 4, "d_ff": 64, "num_layers": 2}
SIZE |= {"relative_attention_num_buckets": 8, "relative_attention_max_distance": 12, "decoder_start_token_id": 0}
KINDS = {  # model class, config class, feed-forward, whether the folder keeps its own lm_head.weight
    "t5-v1.0": (transformers.T5ForConditionalGeneration, transformers.T5Config, "relu", False),
    "t5-v1.1": (transformers.T5ForConditionalGeneration, transformers.T5Config, "gated-gelu", True),
    "mt5": (transformers.MT5ForConditionalGeneration, transformers.MT5Config, "gated-gelu", True),
    # as transformers 5 saves an mT5 it built: tied, and never scaled
    "mt5-tied": (transformers.MT5ForConditionalGeneration, transformers.MT5Config, "gated-gelu", False),
}


def t5_tokenizer(words: list[str] = WORDS) -> transformers.PreTrainedTokenizerBase:
    """T5's tokenizer over a tiny sentencepiece model of one piece per word of ``words`` (trained here, in
    milliseconds): the tokenizer.json that ``save_pretrained`` writes for a real T5 (Unigram pieces, Metaspace,
    ``text </s>``)."""
    model = io.BytesIO()
    sentences = [" ".join(words[i : i + 7]) for i in range(0, len(words), 3)]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, vocab_size=len(words) + 3, model_type="word",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2,
    )  # fmt: skip
    pieces = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = [(pieces.id_to_piece(i), pieces.get_score(i)) for i in range(pieces.get_piece_size())]
    return transformers.T5Tokenizer(vocab=vocab, extra_ids=0)


def _save(kind: str, path: Path) -> tuple[Path, object, object]:
    """A random model of ``kind`` saved as the hub's folders are: v1.1 and mT5 with ``lm_head.weight`` beside
    ``tie_word_embeddings: false`` (transformers 5 itself would tie them when saving). The reference is transformers'
    model loaded from that folder."""
    torch.manual_seed(0)
    model_class, config_class, projection, own_head = KINDS[kind]
    tok = t5_tokenizer()
    config = config_class(vocab_size=len(tok), feed_forward_proj=projection, dropout_rate=0.0, **SIZE)
    model = model_class(config)
    with torch.no_grad():  # weights larger than transformers' initialisation: outputs then follow their sources
        for name, parameter in model.named_parameters():
            parameter.normal_(std=0.5 if "relative_attention_bias" in name else 0.2 if parameter.dim() == 2 else 1.0)
        # The last states and EOS's output row made alike: outputs then end at different lengths.
        model.decoder.final_layer_norm.weight.abs_()
        model.shared.weight[1] = 2 * model.shared.weight[1].abs()
        head = torch.randn(len(tok), SIZE["d_model"]) * 0.2
        head[1] = 2 * head[1].abs()
    model.generation_config.update(max_length=12, num_beams=4, early_stopping=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    if own_head:
        untie_head(path, head)
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    assert (hf.lm_head.weight is hf.shared.weight) != own_head
    return path, hf, tok


def untie_head(path: Path, head: torch.Tensor) -> None:
    """Writes ``head`` as the folder's own ``lm_head.weight`` beside ``tie_word_embeddings: false``, as the hub's
    v1.1 and mT5 folders are (transformers 5 ties them when saving)."""
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"] = head
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    hf_config = json.loads((path / "config.json").read_text())
    hf_config.pop("scale_decoder_outputs", None)
    (path / "config.json").write_text(json.dumps(hf_config | {"tie_word_embeddings": False}))


@pytest.fixture(scope="module", params=list(KINDS))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, object]:
    return _save(request.param, tmp_path_factory.mktemp(request.param))


def test_encoder_output_and_logits_match_transformers(folder: tuple[Path, object, object]) -> None:
    path, hf, tok = folder
    ours, _, _ = load_pretrained(path)
    c = ours.eval().config
    tied = hf.lm_head.weight is hf.shared.weight
    assert (c.tie_embeddings, c.scale_decoder_output) == (tied, getattr(hf.config, "scale_decoder_outputs", False))
    assert (tied, c.scale_decoder_output) == {"t5-v1.0": (True, True), "mt5-tied": (True, False)}.get(
        path.name[:-1], (False, False)
    )
    assert_logits_match(path, hf, tok, length=14)


@pytest.mark.parametrize("num_beams", [1, 4])
def test_generate_matches_transformers(folder: tuple[Path, object, object], num_beams: int) -> None:
    path, hf, tok = folder
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    expected = hf.generate(**batch, num_beams=num_beams)[:, 1:]  # without the decoder's start token
    expected[(expected == 1).cumsum(dim=1) - (expected == 1).long() > 0] = 0  # beam search pads T5's with EOS, not 0
    if num_beams == 1:  # these tiny models' beams all reach the length limit (BART's tests cover beams that end apart)
        assert len({int((row != 0).sum()) for row in expected}) > 1, "outputs of one length test less"
    assert_generate_matches(path, tok, expected, num_beams)


def test_static_cache_decodes_as_the_dynamic_one(folder: tuple[Path, object, object]) -> None:
    """The relative bias of a static cache (CUDA graphs, compiled CPU steps) is read at the cache's position."""
    path, _, tok = folder
    ours = load_pretrained(path)[0].eval()
    src = tok(TEXTS, return_tensors="pt", padding=True)["input_ids"]
    tokens = torch.randint(3, 100, (len(TEXTS), 9))
    with torch.no_grad():
        memory, padding = ours.encode(src), ours.memory_padding(src)
        dynamic, static, written = ours.new_cache(9), ours.new_cache(9, padding), ours.new_cache(9, padding)
        for step in range(tokens.shape[1]):
            token = tokens[:, step : step + 1]
            expected = ours.decode(token, memory, padding, dynamic)
            torch.testing.assert_close(ours.decode(token, memory, padding, static), expected, atol=1e-5, rtol=0)
            written.attend_written(step)  # a compiled CPU step attends over the positions written only
            torch.testing.assert_close(ours.decode(token, memory, padding, written), expected, atol=1e-5, rtol=0)


def test_the_t5_tokenizer_json_is_the_run_s(folder: tuple[Path, object, object]) -> None:
    path, _, tok = folder
    tokenizer = pretrained_tokenizer(path)
    assert (tokenizer.specials.pad_id, tokenizer.specials.bos_id, tokenizer.specials.eos_id) == (0, 0, 1)
    assert tokenizer.encode_batch(TEXTS) == [ids[:-1] for ids in tok(TEXTS)["input_ids"]]  # the collator adds EOS


def test_init_from_trains_on_transformers_loss(tmp_path: Path) -> None:
    """The first step's loss of a module started from a v1.1 folder is transformers' on the same batch."""
    assert_first_loss_matches(*_save("t5-v1.1", tmp_path))


@pytest.mark.parametrize("kind", ["t5-v1.0", "t5-v1.1", "mt5-tied"])
def test_hf_export_round_trips_through_transformers(kind: str, tmp_path: Path) -> None:
    """--format hf: transformers loads what we write, its tokenizer encodes as the original's, and its generate
    equals the original's (so ours too)."""
    assert_round_trip(*_save(kind, tmp_path / "in"), tmp_path / "out")


def test_hf_export_keeps_a_source_length_beyond_n_positions(tmp_path: Path) -> None:
    """Relative positions read past ``n_positions``: a run's longer source length travels and comes back."""
    path, _, _ = _save("t5-v1.1", tmp_path / "in")
    model, tokenizer, decoding = load_pretrained(path)
    decoding = dataclasses.replace(decoding, max_source_tokens=2 * model.config.max_len)
    write_hf(model, tokenizer, decoding, tmp_path / "out")
    assert load_pretrained(tmp_path / "out")[2].max_source_tokens == 2 * model.config.max_len


def test_hf_export_names_the_t5_obstacle(tmp_path: Path) -> None:
    """A scaled decoder output beside an output layer of its own: transformers' T5 has no such model."""
    path, _, _ = _save("t5-v1.0", tmp_path / "in")
    model, tokenizer, decoding = load_pretrained(path)
    model = Transformer(dataclasses.replace(model.config, tie_embeddings=False))
    with pytest.raises(ExportError) as error:
        write_hf(model, tokenizer, decoding, tmp_path / "out")
    assert str(error.value) == (
        "scale_decoder_output=True with tie_embeddings=False: transformers' T5 scales the decoder output only when "
        "its output projection is the embedding"
    )


def test_a_bucket_distance_inside_the_exact_buckets_is_refused() -> None:
    """max_distance 8 with 32 buckets would give negative buckets (an index error on a CPU, a device assert on a
    GPU); T5's own 32 and 128 pass."""
    TransformerConfig(position="relative", relative_buckets=32, relative_max_distance=128)
    with pytest.raises(ConfigError, match=r"relative_max_distance > relative_buckets // 2, got 32 and 8$"):
        TransformerConfig(position="relative", relative_buckets=32, relative_max_distance=8)


def test_bf16_autocast_logits_are_as_close_as_transformers(folder: tuple[Path, object, object]) -> None:
    assert_bf16_as_close_as_transformers(*folder)
