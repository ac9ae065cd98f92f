"""Parity with PyTorch's reference modules: weights copied over, outputs and gradients compared."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config
from torch import Tensor, nn

from torch_handle.model import Transformer
from torch_handle.model.attention import MultiHeadAttention
from torch_handle.model.masks import MaskSpec

PAD = 0
VOCAB = 37
D_MODEL, HEADS, D_FF = 32, 4, 64

pytestmark = pytest.mark.usefixtures("single_thread")


def _paper_pe(length: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...), written out independently of the model."""
    pos = torch.arange(length, dtype=torch.float64)[:, None]
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)
    angle = pos / 10000.0 ** (two_i / d_model)
    pe = torch.zeros(length, d_model, dtype=torch.float64)
    pe[:, 0::2], pe[:, 1::2] = angle.sin(), angle.cos()
    return pe.float()


def _tokens(lengths: list[int], width: int) -> Tensor:
    """Right-padded ``(B, width)`` ids in ``[3, VOCAB)`` with the given real lengths."""
    ids = torch.randint(3, VOCAB, (len(lengths), width))
    for row, n in enumerate(lengths):
        ids[row, n:] = PAD
    return ids


def _copy_mha(ours: MultiHeadAttention, ref: nn.MultiheadAttention) -> list[tuple[Tensor, Tensor]]:
    """Copy our weights into ``ref``; returns (ours, ref) parameter pairs for gradient checks."""
    pairs = [
        (ours.in_proj.weight, ref.in_proj_weight),
        (ours.in_proj.bias, ref.in_proj_bias),
        (ours.out_proj.weight, ref.out_proj.weight),
        (ours.out_proj.bias, ref.out_proj.bias),
    ]
    with torch.no_grad():
        for mine, theirs in pairs:
            theirs.copy_(mine)
    return pairs


def _assert_grads_close(pairs: list[tuple[Tensor, Tensor]]) -> None:
    for mine, theirs in pairs:
        assert mine.grad is not None and theirs.grad is not None
        assert mine.grad.abs().sum() > 0, "a gradient is all zero: the comparison would prove nothing"
        torch.testing.assert_close(mine.grad, theirs.grad)


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_multihead_attention_matches_torch(backend: str, cross: bool) -> None:
    ours = MultiHeadAttention(D_MODEL, HEADS, dropout=0.0, backend=backend)
    nn.init.normal_(ours.in_proj.bias)  # non-zero biases, so that a misplaced bias would show
    nn.init.normal_(ours.out_proj.bias)
    ref = nn.MultiheadAttention(D_MODEL, HEADS, dropout=0.0, batch_first=True)
    pairs = _copy_mha(ours, ref)

    x = torch.randn(3, 7, D_MODEL, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    kv_len = 9 if cross else 7
    memory = torch.randn(3, kv_len, D_MODEL, requires_grad=True) if cross else None
    padding = torch.zeros(3, kv_len, dtype=torch.bool)
    padding[1, 5:] = True
    padding[2, 2:] = True

    out = ours(x, MaskSpec(key_padding=padding), memory=memory)
    kv_ref = memory.detach().clone().requires_grad_() if memory is not None else x_ref
    expected, _ = ref(x_ref, kv_ref, kv_ref, key_padding_mask=padding, need_weights=False)
    torch.testing.assert_close(out, expected)

    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    if memory is not None:
        torch.testing.assert_close(memory.grad, kv_ref.grad)
    _assert_grads_close(pairs)


class _Reference(nn.Module):
    """``torch.nn.Transformer`` with our embeddings, the paper's positions and our output projection."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        c = model.config
        self.d_model = c.d_model
        self.core = nn.Transformer(
            d_model=c.d_model,
            nhead=c.num_heads,
            num_encoder_layers=c.num_encoder_layers,
            num_decoder_layers=c.num_decoder_layers,
            dim_feedforward=c.d_ff,
            dropout=0.0,
            activation=c.activation,
            layer_norm_eps=c.layer_norm_eps,
            batch_first=True,
            norm_first=c.norm_first,
        )
        self.src_embed = nn.Embedding(c.src_vocab_size, c.d_model)
        self.tgt_embed = nn.Embedding(c.tgt_vocab_size, c.d_model)
        self.lm_head = nn.Linear(c.d_model, c.tgt_vocab_size, bias=False)
        self.register_buffer("pe", _paper_pe(c.max_len, c.d_model))

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        scale = math.sqrt(self.d_model)
        x = self.src_embed(src) * scale + self.pe[: src.shape[1]]
        y = self.tgt_embed(tgt) * scale + self.pe[: tgt.shape[1]]
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        pad = src == PAD
        out = self.core(
            x, y, tgt_mask=causal, src_key_padding_mask=pad, memory_key_padding_mask=pad, tgt_is_causal=True
        )
        return self.lm_head(out)


def _copy_into_reference(model: Transformer, ref: _Reference) -> list[tuple[Tensor, Tensor]]:
    """Copy every weight of ``model`` into ``ref``; returns the (ours, ref) parameter pairs."""
    pairs: list[tuple[nn.Module, nn.Module]] = [
        (model.src_embed, ref.src_embed),
        (model.tgt_embed, ref.tgt_embed),
        (model.lm_head, ref.lm_head),
        (model.encoder_norm, ref.core.encoder.norm),
        (model.decoder_norm, ref.core.decoder.norm),
    ]
    for ours, theirs in zip(model.encoder_layers, ref.core.encoder.layers, strict=True):
        pairs += [
            (ours.ff.linear1, theirs.linear1),
            (ours.ff.linear2, theirs.linear2),
            (ours.attn_block.norm, theirs.norm1),
            (ours.ff_block.norm, theirs.norm2),
        ]
    for ours, theirs in zip(model.decoder_layers, ref.core.decoder.layers, strict=True):
        pairs += [
            (ours.ff.linear1, theirs.linear1),
            (ours.ff.linear2, theirs.linear2),
            (ours.self_block.norm, theirs.norm1),
            (ours.cross_block.norm, theirs.norm2),
            (ours.ff_block.norm, theirs.norm3),
        ]
    params: list[tuple[Tensor, Tensor]] = []
    for ours, theirs in pairs:
        params += zip(ours.parameters(), theirs.parameters(), strict=True)
    with torch.no_grad():
        for mine, other in params:
            other.copy_(mine)
    for ours, theirs in zip(model.encoder_layers, ref.core.encoder.layers, strict=True):
        params += _copy_mha(ours.self_attn, theirs.self_attn)
    for ours, theirs in zip(model.decoder_layers, ref.core.decoder.layers, strict=True):
        params += _copy_mha(ours.self_attn, theirs.self_attn)
        params += _copy_mha(ours.cross_attn, theirs.multihead_attn)
    assert len(params) == len(list(model.parameters())), "some weight of ours has no counterpart"
    return params


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")  # nn.Transformer's pre-LN notice
@pytest.mark.parametrize(
    ("backend", "norm_first", "activation"),
    [("naive", False, "relu"), ("sdpa", False, "relu"), ("sdpa", True, "relu"), ("sdpa", False, "gelu")],
    ids=["post-ln-naive", "post-ln-sdpa", "pre-ln", "gelu"],
)
def test_transformer_matches_torch(backend: str, norm_first: bool, activation: str) -> None:
    config = tiny_config(
        src_vocab_size=VOCAB,
        tgt_vocab_size=VOCAB + 4,
        d_model=D_MODEL,
        num_heads=HEADS,
        num_encoder_layers=2,
        num_decoder_layers=2,
        d_ff=D_FF,
        activation=activation,
        norm_first=norm_first,
        position="sinusoidal",
        attention_backend=backend,
        max_len=32,
        pad_id=PAD,
    )
    model = Transformer(config).train()
    for module in model.modules():  # non-zero biases and LayerNorm affines, so that each one matters
        if isinstance(module, nn.Linear | nn.LayerNorm) and module.bias is not None:
            nn.init.normal_(module.bias, std=0.1)
        if isinstance(module, nn.LayerNorm):
            nn.init.normal_(module.weight, mean=1.0, std=0.1)
    ref = _Reference(model).train()
    pairs = _copy_into_reference(model, ref)

    src = _tokens([11, 6, 9], 11)
    tgt = _tokens([8, 8, 3], 8)
    labels = _tokens([8, 8, 3], 8)
    real = tgt != PAD  # the decoder masks causally only: compare where the target is real

    logits = model(src, tgt)
    expected = ref(src, tgt)
    torch.testing.assert_close(logits[real], expected[real])

    F.cross_entropy(logits[real], labels[real]).backward()
    F.cross_entropy(expected[real], labels[real]).backward()
    _assert_grads_close(pairs)
