"""Copy attention (``copy_attention``): a distribution over the vocabulary, mass copied from the source's tokens, and
the same outputs decoded alone or in a batch whose rows leave at different steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_export import _good
from test_model_invariances import BOS, EOS, PAD, VOCAB, _batch, _model
from test_pretrained import TEXTS, _save

from torch_handle.errors import SetupError
from torch_handle.export import load_exported
from torch_handle.model import CompiledDecode, ConfigError, TransformerConfig
from torch_handle.model.generation import generate
from torch_handle.module import Seq2SeqModule
from torch_handle.parallel.parallelize import check_sizes
from torch_handle.pretrained import pretrained_tokenizer
from torch_handle.pretrained.writer import hf_family

pytestmark = pytest.mark.usefixtures("single_thread")


def _copying(**overrides: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return _model(copy_attention=True, tie_embeddings=True, **overrides)


def test_copy_attention_gives_log_probabilities_that_train() -> None:
    model = _copying().train()
    src, tgt = _batch()
    log_probs = model(src, tgt)
    torch.testing.assert_close(log_probs.logsumexp(dim=-1), torch.zeros(tgt.shape))
    log_probs[tgt != PAD].mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert model.copy.query.weight.grad.abs().sum() > 0 and model.copy.gate.weight.grad.abs().sum() > 0


@torch.no_grad()
def test_a_gate_that_always_copies_puts_the_mass_on_the_source_tokens() -> None:
    model = _copying()
    model.copy.gate.bias.fill_(40.0)  # sigmoid(40): the vocabulary keeps e**-40 of the mass
    src, tgt = _batch()
    probs = model(src, tgt).exp()  # (B, T, V)
    for row in range(src.shape[0]):
        present = torch.zeros(VOCAB, dtype=torch.bool)
        present[src[row][src[row] != PAD]] = True
        torch.testing.assert_close(probs[row][:, present].sum(dim=-1), torch.ones(tgt.shape[1]))
        assert probs[row][:, ~present].max() < 1e-15


@torch.no_grad()
def test_padding_a_source_changes_nothing() -> None:
    model = _copying()
    src, tgt = _batch()
    padded_row = 2  # two tokens, then padding
    torch.testing.assert_close(model(src, tgt)[padded_row], model(src[padded_row : padded_row + 1, :2], tgt[2:])[0])


@torch.no_grad()
@pytest.mark.parametrize("num_beams", [1, 3])
def test_decoding_with_copy_gives_each_source_what_it_gets_alone(num_beams: int) -> None:
    # Rows and sources leave the batch as they finish: their source ids must leave with their memory rows.
    model = _copying()
    model.copy.gate.bias.fill_(40.0)  # every token copied: a source's EOS ends its row
    torch.manual_seed(3)
    src = torch.randint(3, VOCAB, (4, 9))
    src[0] = EOS
    src[2, ::2] = EOS
    src[1, 6:] = PAD
    batch = generate(model, src, 12, num_beams=num_beams)
    for row in range(src.shape[0]):
        alone = generate(model, src[row : row + 1], 12, num_beams=num_beams)[0]
        width = min(len(alone), batch.shape[1])
        assert torch.equal(batch[row, :width], alone[:width])
        assert (batch[row, width:] == PAD).all()
    ended = (batch == EOS).any(dim=1)
    assert ended.any() and not ended.all(), "some rows should end before the others"


@torch.no_grad()
def test_greedy_decoding_with_copy_is_the_argmax_of_full_passes() -> None:
    model = _copying()
    src, _ = _batch()
    out = generate(model, src, 8)
    tgt = torch.cat([torch.full((src.shape[0], 1), BOS), out], dim=1)
    log_probs = model(src, tgt[:, :-1])
    log_probs[..., [PAD, BOS]] = float("-inf")
    expected = log_probs.argmax(dim=-1)
    written = (out == EOS).long().cumsum(dim=1) - (out == EOS).long() == 0  # up to the first EOS
    assert torch.equal(out[written], expected[written])


def test_copy_attention_needs_one_vocabulary() -> None:
    with pytest.raises(ConfigError, match="one vocabulary for both and cross_downsample 1"):
        TransformerConfig(src_vocab_size=30, tgt_vocab_size=40, copy_attention=True)
    with pytest.raises(ConfigError, match="one vocabulary for both and cross_downsample 1"):
        TransformerConfig(copy_attention=True, cross_downsample=2)


@torch.no_grad()
@pytest.mark.parametrize("num_beams", [1, 3])
def test_static_cache_steps_with_copy_decode_as_the_eager_ones(num_beams: int) -> None:
    # cuda_graph=True on a CPU steps the static cache eagerly: the path a CUDA graph and the compiled CPU step take.
    model = _copying()
    model.copy.gate.bias.fill_(1.0)
    src, _ = _batch()
    assert torch.equal(generate(model, src, 10, num_beams, cuda_graph=True), generate(model, src, 10, num_beams))


def test_what_cannot_hold_a_copy_distribution_refuses_it_in_one_line() -> None:
    config = _copying().config
    assert hf_family(config) == (
        None, "copy_attention=True: no Hugging Face family has a copy distribution; export --format safetensors"
    )  # fmt: skip
    for pipeline_size, tensor_parallel_size in ((1, 2), (2, 1)):
        with pytest.raises(SetupError, match="^--model.transformer.copy_attention mixes .* not tensor or pipeline"):
            check_sizes(config, pipeline_size, tensor_parallel_size, None)


def test_a_pretrained_model_gains_copy_attention_and_starts_as_it_was(tmp_path: Path) -> None:
    # --model.init_from with copy_attention: the folder fills every weight but the copy head's, which starts fresh;
    # with its gate shut, the model is transformers' again.
    path, hf, tok = _save("bart", "safetensors", tmp_path)
    vocab = pretrained_tokenizer(path).vocab_size
    copying = TransformerConfig(copy_attention=True)
    module = Seq2SeqModule(vocab_size=vocab, init_from=str(path), transformer=copying, max_new_tokens=8)
    model = module.model.eval()
    assert model.config.copy_attention and module.hparams["transformer"].copy_attention
    model.copy.gate.bias.data.fill_(-60.0)
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    tgt = torch.full((len(TEXTS), 1), hf.config.decoder_start_token_id)
    with torch.no_grad():
        expected = hf(**batch, decoder_input_ids=tgt).logits.log_softmax(dim=-1)
        torch.testing.assert_close(model(batch["input_ids"], tgt), expected, atol=1e-4, rtol=0)


@pytest.mark.slow
@torch.no_grad()
@pytest.mark.parametrize("num_beams", [1, 3])
def test_compiled_decoding_with_copy_equals_eager(num_beams: int) -> None:
    # CompiledDecode (torch_handle.load(..., compile=True)) steps the static cache with the source ids in it, and hands
    # the rows still running over to the eager cache, the source ids with them; a second source length compiles
    # nothing more.
    model = _copying(attention_backend="sdpa")
    model.copy.gate.bias.fill_(40.0)
    torch.manual_seed(3)
    src = torch.randint(3, VOCAB, (4, 9))
    src[0, 1:] = EOS
    src[2, ::2] = EOS
    src[1, 6:] = PAD
    compiled = CompiledDecode(model)
    for batch in (src, src[:, :7]):
        expected = generate(model, batch, 12, num_beams)
        assert torch.equal(generate(model, batch, 12, num_beams, decode=compiled), expected)


@pytest.mark.parametrize("kind", ["checkpoint", "export"])
def test_init_from_our_model_fills_all_but_the_fresh_copy_head(kind: str, tmp_path: Path) -> None:
    exported = _good(tmp_path / "model.safetensors")
    source = exported if kind == "export" else exported.parent / "model.ckpt"
    trained, tokenizer = load_exported(exported)
    copying = TransformerConfig(copy_attention=True)
    vocab = tokenizer.vocab_size
    module = Seq2SeqModule(vocab_size=vocab, init_from=str(source), transformer=copying, max_new_tokens=8)
    state = module.model.state_dict()
    assert module.config.copy_attention and any(name.startswith("copy.") for name in state)
    for name, tensor in trained.state_dict().items():
        assert torch.equal(state[name], tensor), name
