"""CUDA-only checks: bf16 kernels against the naive reference, flex and xformers, a bf16 training step.

Skipped without a CUDA device; run them on a GPU machine with ``python -m pytest -m gpu``.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from conftest import requires_cuda

from torch_handle.model import Transformer, TransformerConfig, generate
from torch_handle.model.kernels import xformers_available
from torch_handle.model.steps import StaticDecoder

pytestmark = [pytest.mark.gpu, requires_cuda]

CONFIG = TransformerConfig(
    src_vocab_size=512,
    tgt_vocab_size=512,
    d_model=128,
    num_heads=4,
    num_encoder_layers=2,
    num_decoder_layers=2,
    d_ff=256,
    dropout=0.0,
    position="alibi",
    window=32,
)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.randint(3, 512, (4, 300), device="cuda")
    tgt = torch.randint(3, 512, (4, 40), device="cuda")
    src[1, 200:] = 0
    tgt[2, 25:] = 0
    return src, tgt


def _pair(backend: str, attention: str) -> tuple[Transformer, Transformer]:
    config = dataclasses.replace(CONFIG, encoder_attention=attention)
    naive = Transformer(dataclasses.replace(config, attention_backend="naive")).cuda()
    other = Transformer(dataclasses.replace(config, attention_backend=backend)).cuda()
    other.load_state_dict(naive.state_dict())
    return naive, other


@pytest.mark.parametrize("attention", ["full", "local"])
@pytest.mark.parametrize("backend", ["sdpa", "flex", "auto"])
def test_bf16_backends_match_naive(backend: str, attention: str) -> None:
    naive, other = _pair(backend, attention)
    src, tgt = _batch()
    keep = tgt != 0
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected, actual = naive(src, tgt), other(src, tgt)
    torch.testing.assert_close(actual[keep].float(), expected[keep].float(), atol=5e-2, rtol=5e-2)


@pytest.mark.skipif(not xformers_available(), reason="xformers is not installed (pip install 'torch-handle[gpu]')")
def test_xformers_matches_naive() -> None:
    naive, other = _pair("xformers", "full")
    src, tgt = _batch()
    keep = tgt != 0
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected, actual = naive(src, tgt), other(src, tgt)
    torch.testing.assert_close(actual[keep].float(), expected[keep].float(), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_bf16_training_step_gradients_match_naive(backend: str) -> None:
    naive, other = _pair(backend, "local")
    src, tgt = _batch()
    for model in (naive, other):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(src, tgt[:, :-1])
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=0).backward()
    for (name, a), b in zip(naive.named_parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=5e-2, rtol=5e-2, msg=name)


def test_unpadded_batches_train_on_the_flash_kernel() -> None:
    """No padding, no mask: with SDPA held to the flash kernel, a bf16 training step of full and causal attention
    runs (a mask, even all True, would leave no kernel to run), and its gradients match the naive reference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    config = dataclasses.replace(CONFIG, position="rope")  # ALiBi would be an additive mask
    naive = Transformer(dataclasses.replace(config, attention_backend="naive")).cuda()
    other = Transformer(dataclasses.replace(config, attention_backend="sdpa")).cuda()
    other.load_state_dict(naive.state_dict())
    src = torch.randint(3, 512, (4, 256), device="cuda")
    tgt = torch.randint(3, 512, (4, 41), device="cuda")
    for model, kernel in ((naive, contextlib.nullcontext()), (other, sdpa_kernel(SDPBackend.FLASH_ATTENTION))):
        with kernel, torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(src, tgt[:, :-1])
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tgt[:, 1:].flatten()).backward()
    for (name, a), b in zip(naive.named_parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=5e-2, rtol=5e-2, msg=name)


@pytest.mark.parametrize(("position", "new_tokens"), [("sinusoidal", 48), ("rope", 48), ("alibi", 48), ("rope", 1)])
@torch.no_grad()
def test_cuda_graph_greedy_equals_eager_greedy(position: str, new_tokens: int) -> None:
    """fp32: the replayed static step decodes the tokens eager greedy search does, rows finishing at any step; a
    capacity of one token holds the warm-up steps too."""
    model = Transformer(dataclasses.replace(CONFIG, position=position, attention_backend="sdpa")).cuda().eval()
    src, _ = _batch()
    expected = generate(model, src, new_tokens)
    assert torch.equal(generate(model, src, new_tokens, cuda_graph=True), expected)


@torch.no_grad()
def test_cuda_graph_replays_the_eager_static_step_in_bf16() -> None:
    """Under bf16 autocast (weights cast inside the graph) a replay gives the eager static step's logits exactly."""
    model = Transformer(dataclasses.replace(CONFIG, attention_backend="sdpa")).cuda().eval()
    src, _ = _batch()
    tokens = torch.randint(3, 512, (src.shape[0], 20), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        memory, padding = model.encode(src), model.memory_padding(src)
        graphed = StaticDecoder(model, memory, padding, 20, graph=True)
        eager = StaticDecoder(model, memory, padding, 20, graph=False)
        assert graphed.graph is not None
        for i in range(20):
            token = tokens[:, i : i + 1]
            assert torch.equal(graphed(token), eager(token)), f"step {i}"


@torch.no_grad()
def test_cuda_graph_beam_search_equals_eager_beam_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32: beam steps replayed as CUDA graphs over a static cache reordered in place, handed over to the eager
    cache once half the sources have finished, keep the beams eager beam search keeps."""
    from test_generation import _decoded_rows, _handover_step, _model, _sources_ending_apart, _static_steps

    model = _model(attention_backend="sdpa", tie_embeddings=False)
    src = _sources_ending_apart(model, 3, 12, handover=True).cuda()  # found on the CPU: its EOS made likelier
    model.cuda()
    expected, eager_rows = _decoded_rows(model, src, 12, 3)
    steps = _static_steps(monkeypatch)
    assert torch.equal(generate(model, src, 12, 3, cuda_graph=True), expected)
    assert 0 < len(steps) == _handover_step(eager_rows, len(src), 3) < 12
    assert set(steps) == {(len(src) * 3, True)}
