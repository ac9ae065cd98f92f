"""Attention backends agree with the naive reference; positions and local attention match their definitions."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch
from conftest import tiny_config
from torch import Tensor

from torch_handle.model import Transformer, TransformerConfig, alibi_slopes, kernels, masks, sinusoidal_table
from torch_handle.model.kernels import BackendUnavailableError, attend
from torch_handle.model.masks import MaskSpec
from torch_handle.model.positions import apply_rope, rope_angles, rope_inv_freq

pytestmark = pytest.mark.usefixtures("single_thread")

PAD = 0
VOCAB = 29
POSITIONS = ["sinusoidal", "learned", "rope", "alibi"]


def _config(position: str, attention: str, backend: str) -> TransformerConfig:
    return tiny_config(
        src_vocab_size=VOCAB,
        tgt_vocab_size=VOCAB,
        num_heads=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        position=position,
        encoder_attention=attention,
        window=3,
        attention_backend=backend,
        max_len=32,
        pad_id=PAD,
    )


def _models(position: str, attention: str, backend: str) -> tuple[Transformer, Transformer]:
    """The naive reference and a model with the same weights on ``backend``."""
    reference = Transformer(_config(position, attention, "naive"))
    other = Transformer(_config(position, attention, backend))
    other.load_state_dict(reference.state_dict())
    return reference, other


def _batch() -> tuple[Tensor, Tensor]:
    """Source and target with padding: 13 source positions (not a multiple of the window), 9 target."""
    src = torch.randint(3, VOCAB, (3, 13))
    src[1, 8:] = PAD
    src[2, 2:] = PAD  # padding far wider than the window: some local windows hold padding only
    tgt = torch.randint(3, VOCAB, (3, 9))
    tgt[1, 6:] = PAD
    return src, tgt


@pytest.mark.parametrize("attention", ["full", "local"])
@pytest.mark.parametrize("position", POSITIONS)
def test_sdpa_matches_naive(position: str, attention: str) -> None:
    reference, sdpa = _models(position, attention, "sdpa")
    src, tgt = _batch()
    expected, logits = reference(src, tgt), sdpa(src, tgt)
    torch.testing.assert_close(logits, expected)
    upstream = torch.randn_like(expected)
    (expected * upstream).sum().backward()
    (logits * upstream).sum().backward()
    # Gradients sum many products computed in a different order by each kernel: fp32 noise reaches ~2e-5 on
    # embedding rows, so they get a looser bound (a masking error is off by orders of magnitude more).
    for (name, mine), theirs in zip(sdpa.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(
            mine.grad, theirs.grad, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.fixture
def no_recompile_limit() -> Iterator[None]:
    """Lift torch.compile's recompile limit (8), past which flex would silently fall back to eager attention."""
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


@pytest.mark.usefixtures("no_recompile_limit")
@pytest.mark.parametrize("attention", ["full", "local"])
@pytest.mark.parametrize("position", POSITIONS)
@torch.no_grad()
def test_flex_matches_naive(position: str, attention: str) -> None:
    # Compiled flex on CPU has no backward pass, so the forward is compared alone.
    reference, flex = _models(position, attention, "flex")
    src, tgt = _batch()
    torch.testing.assert_close(flex.eval()(src, tgt), reference.eval()(src, tgt))


T5 = {"norm": "rms", "bias": False, "scale_attention": False, "gated_ff": True, "attention_head_dim": 16}


@pytest.mark.usefixtures("no_recompile_limit")
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@torch.no_grad()
def test_t5_relative_bias_matches_naive(backend: str) -> None:
    """T5's options (a relative position bias added to unscaled scores, heads wider than d_model / num_heads) give
    every backend the naive kernel's logits."""
    reference, other = (
        Transformer(dataclasses.replace(_config("relative", "full", b), **T5)) for b in ("naive", backend)
    )
    other.load_state_dict(reference.state_dict())
    src, tgt = _batch()
    torch.testing.assert_close(other.eval()(src, tgt), reference.eval()(src, tgt))


@torch.no_grad()
def test_t5_mask_is_built_once_per_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """T5's bias with the padding and causality folded in, ``(B, H, Tq, Tk)``, is built once per encoder and decoder
    pass and per decoding step (dynamic and static caches), as transformers builds it, not once per layer."""
    model = Transformer(dataclasses.replace(_config("relative", "full", "sdpa"), **T5)).eval()
    built: list[str] = []
    build = masks.dense_mask

    def counted(spec: MaskSpec, *args: object) -> Tensor | None:
        if spec.bias is not None and spec.dense is None:
            built.append("built")
        return build(spec, *args)

    monkeypatch.setattr(masks, "dense_mask", counted)  # the model's, once per stack
    monkeypatch.setattr(kernels, "dense_mask", counted)  # the layers'
    src, tgt = _batch()
    model(src, tgt)
    assert len(built) == 2  # the encoder's and the decoder's, over two layers each
    memory, padding = model.encode(src), model.memory_padding(src)
    for cache in (model.new_cache(4), model.new_cache(4, padding)):
        built.clear()
        model.decode(tgt[:, :1], memory, padding, cache)
        assert len(built) == 1


FLEX_LENGTHS = sorted({*range(1, 130, 9), 24, 40, 104, 120})  # the four where compiled CPU flex was wrong


@torch.no_grad()
def test_flex_on_cpu_is_exact_at_every_length() -> None:
    """Inductor's CPU flex kernel (torch 2.13) returned wrong numbers at some lengths; flex must never be silently
    wrong, so every mask kind is compared with the naive kernel at many lengths."""
    b, h, d = 2, 4, 8
    worst: dict[str, float] = {}
    for s in FLEX_LENGTHS:
        padding = torch.zeros(b, s, dtype=torch.bool)
        padding[1, max(s - s // 3, 1) :] = True
        specs = {
            "padded": (s, MaskSpec(key_padding=padding)),
            "causal": (s, MaskSpec(causal=True)),
            "local_alibi": (s, MaskSpec(key_padding=padding, window=3, alibi=alibi_slopes(h))),
            "cross": (9, MaskSpec(key_padding=padding)),
            "decode": (1, MaskSpec(causal=True, q_offset=s - 1)),
        }
        for name, (tq, spec) in specs.items():
            q, k, v = torch.randn(b, h, tq, d), torch.randn(b, h, s, d), torch.randn(b, h, s, d)
            error = (attend(q, k, v, spec, "flex") - attend(q, k, v, spec, "naive")).abs().max().item()
            worst[f"{name}@{s}"] = error
    assert max(worst.values()) < 1e-5, {key: f"{e:.1e}" for key, e in worst.items() if e >= 1e-5}


def test_flex_on_cpu_refuses_inputs_too_long_for_eager_attention() -> None:
    """Eager flex writes out the score matrix: at 16k tokens it would need GiBs, so CPU refuses it in one line."""
    q = torch.randn(1, 1, 16384, 8)
    with pytest.raises(BackendUnavailableError, match="^attention_backend='flex' runs eagerly on CPU.*'sdpa'"):
        attend(q, q, q, MaskSpec(window=64), "flex")


# --- local attention against a dense reference built from an explicit S x S mask ------------------------


def _explicit_local_reference(
    q: Tensor, k: Tensor, v: Tensor, window: int, padding: Tensor, slopes: Tensor | None
) -> Tensor:
    """Softmax attention in float64 where query i sees key j iff |i - j| <= window and key j is real.

    A query also sees itself when it is padding (the kernels' documented rule, which keeps a window of
    padding only from dividing by zero); real queries are never affected by that rule.
    """
    b, h, s, d = q.shape
    visible = torch.zeros(b, s, s, dtype=torch.bool)
    for row in range(b):
        for i in range(s):
            for j in range(s):
                visible[row, i, j] = abs(i - j) <= window and (not padding[row, j] or i == j)
    scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(d)  # (B, H, S, S)
    if slopes is not None:
        distance = torch.tensor([[abs(i - j) for j in range(s)] for i in range(s)], dtype=torch.float64)
        scores = scores - slopes.double()[:, None, None] * distance
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.double()).float()


@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize("window", [1, 2, 5, 22, 40])
@pytest.mark.parametrize("backend", ["naive", "sdpa"])
def test_local_kernel_matches_explicit_mask(backend: str, window: int, alibi: bool) -> None:
    b, h, s, d = 2, 3, 23, 8
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    padding = torch.zeros(b, s, dtype=torch.bool)
    padding[1, 15:] = True
    slopes = alibi_slopes(h) if alibi else None
    out = attend(q, k, v, MaskSpec(key_padding=padding, window=window, alibi=slopes), backend)
    expected = _explicit_local_reference(q, k, v, window, padding, slopes)
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
    torch.testing.assert_close(grads, expected_grads)


@pytest.mark.usefixtures("no_recompile_limit")
@torch.no_grad()
def test_flex_local_kernel_matches_explicit_mask() -> None:
    b, h, s, d, window = 2, 2, 23, 8, 4
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    padding = torch.zeros(b, s, dtype=torch.bool)
    padding[1, 15:] = True
    slopes = alibi_slopes(h)
    out = attend(q, k, v, MaskSpec(key_padding=padding, window=window, alibi=slopes), "flex")
    torch.testing.assert_close(out, _explicit_local_reference(q, k, v, window, padding, slopes))


_MEMORY_PROBE = textwrap.dedent(
    """
    import re, sys
    import torch
    from torch_handle.model.kernels import BackendUnavailableError, attend
    from torch_handle.model.masks import MaskSpec

    def status_kib(field):
        with open("/proc/self/status") as f:
            return int(re.search(field + r":\\s+(\\d+)", f.read()).group(1))

    torch.set_num_threads(1)
    backend, s, window = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    window = None if window == "none" else int(window)
    q, k, v = (torch.randn(1, 1, s, 16) for _ in range(3))
    padding = torch.zeros(1, s, dtype=torch.bool)
    padding[:, -100:] = True
    with torch.no_grad():  # warm up on a slice, so that one-off allocations do not count
        attend(q[:, :, :512], k[:, :, :512], v[:, :, :512], MaskSpec(key_padding=padding[:, :512], window=window),
               backend)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the current RSS
        rss_before = status_kib("VmRSS")
        attend(q, k, v, MaskSpec(key_padding=padding, window=window), backend)
    # VmHWM is this process's own peak RSS (unlike ru_maxrss, which a child inherits from its parent).
    print((status_kib("VmHWM") - rss_before) * 1024)
    """
)


needs_proc = pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"), reason="measures peak RSS through Linux's /proc/self"
)


def _attention_growth(backend: str, s: int, window: int | None) -> int:
    """Bytes by which attention over ``s`` tokens raised the peak RSS of a fresh process (Linux only)."""
    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, backend, str(s), "none" if window is None else str(window)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return int(result.stdout.split()[-1])


@pytest.mark.slow
@needs_proc
@pytest.mark.parametrize(
    ("backend", "window"),
    [("naive", 64), ("sdpa", 64), ("sdpa", None)],
    ids=["local-naive", "local-sdpa", "full-sdpa"],
)
def test_attention_never_builds_s_by_s(backend: str, window: int | None) -> None:
    # Local attention runs block by block; full attention with key padding only goes to SDPA's fused kernel
    # with a (B, 1, 1, S) mask. Neither may allocate anything of S x S.
    s = 16384
    growth = _attention_growth(backend, s, window)
    # One S x S float tensor is 1 GiB and even a boolean S x S mask is 256 MiB; the blocked kernel needs ~40 MiB.
    assert growth < s * s * 4 // 8, f"attention raised peak memory by {growth / 2**20:.0f} MiB"


@pytest.mark.slow
@needs_proc
def test_memory_probe_sees_an_s_by_s_tensor() -> None:
    """The probe above would catch a dense score matrix: full naive attention shows at least S x S floats."""
    s = 8192
    growth = _attention_growth("naive", s, window=None)
    assert growth >= s * s * 4, f"full attention raised peak memory by only {growth / 2**20:.0f} MiB"


# --- positions -----------------------------------------------------------------------------------------


def test_alibi_slopes_power_of_two() -> None:
    expected = torch.tensor([1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256])
    torch.testing.assert_close(alibi_slopes(8), expected, rtol=0, atol=0)


def test_alibi_slopes_not_power_of_two() -> None:
    # 6 heads: the 4-head slopes 2^-2, 2^-4, 2^-6, 2^-8, then every other 8-head slope (2^-1, 2^-3, ...) for the
    # remaining two heads.
    expected = torch.tensor([1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8])
    torch.testing.assert_close(alibi_slopes(6), expected, rtol=0, atol=0)


@pytest.mark.parametrize("d_model", [16, 15])
def test_sinusoidal_table_matches_the_formula(d_model: int) -> None:
    length = 50
    table = sinusoidal_table(length, d_model)
    expected = torch.zeros(length, d_model, dtype=torch.float64)
    for pos in range(length):
        for dim in range(d_model):
            angle = pos / 10000 ** ((dim - dim % 2) / d_model)
            expected[pos, dim] = math.sin(angle) if dim % 2 == 0 else math.cos(angle)
    assert table.shape == (length, d_model)
    torch.testing.assert_close(table, expected.float())


def test_rope_linear_scaling_at_scaled_position_equals_unscaled() -> None:
    head_dim, factor = 16, 4.0
    inv_freq = rope_inv_freq(head_dim, 10000.0, "linear", factor)
    assert torch.equal(inv_freq, rope_inv_freq(head_dim, 10000.0, None, 1.0))  # linear leaves frequencies alone
    positions = torch.arange(0, 40)
    scaled = rope_angles(positions * int(factor), inv_freq, "linear", factor)
    unscaled = rope_angles(positions, inv_freq, None, 1.0)
    torch.testing.assert_close(scaled, unscaled)
    with pytest.raises(AssertionError):  # and it does scale: the same position is rotated differently
        torch.testing.assert_close(rope_angles(positions, inv_freq, "linear", factor), unscaled)


def test_rope_ntk_scaling_raises_the_base() -> None:
    head_dim, base, factor = 16, 10000.0, 8.0
    ntk = rope_inv_freq(head_dim, base, "ntk", factor)
    new_base = base * factor ** (head_dim / (head_dim - 2))
    expected = torch.tensor([new_base ** (-2 * i / head_dim) for i in range(head_dim // 2)])
    torch.testing.assert_close(ntk, expected)
    plain = rope_inv_freq(head_dim, base, None, 1.0)
    # The highest frequency is untouched and the lowest is stretched by exactly the factor.
    torch.testing.assert_close(ntk[0], plain[0])
    torch.testing.assert_close(ntk[-1], plain[-1] / factor)


def test_rope_scores_depend_only_on_relative_position() -> None:
    head_dim = 16
    inv_freq = rope_inv_freq(head_dim, 10000.0, None, 1.0)
    q, k = torch.randn(2, head_dim, dtype=torch.float64)

    def score(i: int, j: int) -> Tensor:
        cos, sin = rope_angles(torch.tensor([i, j]), inv_freq.double(), None, 1.0)
        rotated = apply_rope(torch.stack([q, k])[None, None], cos, sin)[0, 0]  # q at position i, k at j
        return rotated[0] @ rotated[1]

    for shift in (1, 7, 100):
        torch.testing.assert_close(score(10 + shift, 5 + shift), score(10, 5))
        torch.testing.assert_close(score(2 + shift, 9 + shift), score(2, 9))
    assert not torch.isclose(score(10, 5), score(10, 6)), "RoPE ignored the distance"


def test_auto_gives_local_attention_on_cuda_to_flex_only_for_heads_flex_compiles() -> None:
    """Inductor's flex kernel takes heads of 16 dimensions or more; smaller ones (tiny test models) go to SDPA."""
    from torch_handle.model.kernels import resolve_backend

    local, cuda = MaskSpec(window=3), torch.device("cuda")
    assert resolve_backend("auto", cuda, local, 0.0, head_dim=16) == "flex"
    assert resolve_backend("auto", cuda, local, 0.0, head_dim=8) == "sdpa"
    assert resolve_backend("auto", cuda, local, 0.1, head_dim=64) == "sdpa"  # flex has no attention dropout
    assert resolve_backend("auto", torch.device("cpu"), local, 0.0, head_dim=64) == "sdpa"
