"""Decoding's properties whatever the weights: greedy and beam search against plain references, the dynamic and
static key/value caches, compiled and CUDA-graph steps and their hand-over, and decoding in lockstep across processes.
The tiny models and batches come from ``test_model_invariances.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_model_invariances import BOS, EOS, PAD, POSITIONS, VOCAB, _batch, _config, _model
from torch import Tensor

from torch_handle.model import CompiledDecode, Transformer
from torch_handle.model.beam import beam_search
from torch_handle.model.generation import generate, greedy_search
from torch_handle.model.steps import Head, StaticDecoder, beam_scores, cpu_decoding_layout, greedy_token, rule_out
from torch_handle.model.transformer import DecoderCache

pytestmark = pytest.mark.usefixtures("single_thread")


def _next(logits: Tensor) -> Tensor:
    """Last-position logits with PAD and BOS ruled out, as the searches do: neither is a next token."""
    logits = logits[..., -1, :].clone()
    logits[..., [PAD, BOS]] = float("-inf")
    return logits


def _uncached_greedy(model: Transformer, src: Tensor, steps: int) -> Tensor:
    """Argmax over full forward passes, ``pad_id`` after the first EOS, as ``generate`` returns it."""
    tgt = torch.full((src.shape[0], 1), BOS)
    for _ in range(steps):
        tgt = torch.cat([tgt, _next(model(src, tgt)).argmax(dim=-1, keepdim=True)], dim=1)
    out = tgt[:, 1:]
    after_eos = (out == EOS).long().cumsum(dim=1) - (out == EOS).long() > 0
    return out.masked_fill(after_eos, PAD)


def _sequence_log_prob(model: Transformer, src: Tensor, out: Tensor) -> Tensor:
    """Model log-probability ``(B,)`` of generated rows, up to and including their first EOS."""
    tgt = torch.cat([torch.full((src.shape[0], 1), BOS), out[:, :-1]], dim=1)
    logits = model(src, tgt)
    logits[..., [PAD, BOS]] = float("-inf")  # as the searches score
    logp = torch.log_softmax(logits, dim=-1).gather(-1, out[..., None])[..., 0]  # (B, L)
    is_eos = (out == EOS).long()
    counted = is_eos.cumsum(dim=1) - is_eos == 0  # every position up to the first EOS
    return torch.where(counted, logp, 0.0).sum(dim=1)  # PAD after EOS has log p = -inf: leave it out


@pytest.mark.parametrize("position", POSITIONS)
@torch.no_grad()
def test_cached_greedy_equals_uncached_argmax(position: str) -> None:
    model = _model(position=position, attention_backend="sdpa")
    src, _ = _batch()
    steps = 10
    out = generate(model, src, steps)
    expected = _uncached_greedy(model, src, steps)
    assert out.shape[1] == steps or (out == EOS).any(dim=1).all()
    assert torch.equal(out, expected[:, : out.shape[1]])


@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@torch.no_grad()
def test_a_static_cache_step_gives_the_dynamic_cache_logits(position: str, backend: str, window: bool) -> None:
    # The static cache attends over its whole capacity with the unwritten keys masked, and reads its position
    # from a tensor (what a CUDA graph replays), or, with a window (what CompiledDecode sets), over the positions
    # written and its own: the logits must be the sliced cache's at every step.
    model = _model(position=position, attention_backend=backend)
    src, _ = _batch()
    memory, padding = model.encode(src), model.memory_padding(src)
    steps = 9
    static = StaticDecoder(model, memory, padding, steps + 3, graph=False)  # room to spare: a window reads less
    cache = model.new_cache(steps + 3)
    tokens = torch.randint(3, VOCAB, (src.shape[0], steps))
    for i in range(steps):
        expected = model.decode(tokens[:, i : i + 1], memory, padding, cache)
        if window:
            static.cache.attend_written(i)
            for self_cache, _ in static.cache.layers:  # past the window: read, they would poison the logits
                for kv in (self_cache.k, self_cache.v):
                    if kv is not None:
                        kv[:, :, i + 1 :] = float("nan")
        torch.testing.assert_close(static(tokens[:, i : i + 1]), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "naive", "flex"])
@torch.no_grad()
def test_beams_sharing_their_source_memory_row_give_the_logits_of_a_repeated_memory(backend: str) -> None:
    # Beam search hands cross-attention one memory row per source for its K consecutive beams: the keys and values
    # are computed and read once, and every beam's logits must be those of a memory repeated K times.
    model = _model(attention_backend=backend)
    src, _ = _batch()
    memory, padding = model.encode(src), model.memory_padding(src)
    k, steps = 3, 5
    shared, repeated = model.new_cache(steps), model.new_cache(steps)
    tokens = torch.randint(3, VOCAB, (src.shape[0] * k, steps))
    for i in range(steps):
        expected = model.decode(
            tokens[:, i : i + 1], memory.repeat_interleave(k, 0), padding.repeat_interleave(k, 0), repeated
        )
        torch.testing.assert_close(model.decode(tokens[:, i : i + 1], memory, padding, shared), expected)
    assert shared.layers[0][1].k.shape[0] == src.shape[0] and shared.rows == src.shape[0] * k
    # The second source's beams drop out: its memory row goes with them, the others keep theirs.
    index = torch.tensor([0, 1, 2, 6, 7, 8])
    shared.select(index)
    repeated.select(index)
    keep = torch.tensor([0, 2])
    torch.testing.assert_close(
        model.decode(tokens[index, :1], memory[keep], padding[keep], shared),
        model.decode(
            tokens[index, :1], memory[keep].repeat_interleave(k, 0), padding[keep].repeat_interleave(k, 0), repeated
        ),
    )


@pytest.mark.parametrize("position", POSITIONS)
@torch.no_grad()
def test_static_greedy_equals_greedy_where_rows_finish_at_different_steps(position: str) -> None:
    # Off CUDA ``cuda_graph=True`` runs the graph's static step eagerly: finished rows keep stepping, write nothing.
    model = _model(position=position, attention_backend="sdpa", tie_embeddings=False)
    src = _sources_ending_apart(model, 1, 12)
    out = generate(model, src, 12)
    assert torch.equal(generate(model, src, 12, cuda_graph=True), out)


@pytest.mark.slow
@torch.no_grad()
def test_compiled_greedy_equals_greedy_for_new_source_lengths_and_batch_sizes() -> None:
    # CompiledDecode (torch_handle.load(..., compile=True)): AOTInductor with the weights frozen in; source lengths
    # are dynamic and a batch without padding takes the same step (neither compiles anything), a new batch size
    # compiles a step of its own, which runs every position. Rows end at different steps.
    model = _model(attention_backend="sdpa", tie_embeddings=False)
    src = _sources_ending_apart(model, 1, 12)
    compiled = CompiledDecode(model)
    unpadded = torch.randint(3, VOCAB, (src.shape[0], 7))
    for batch, steps in ((src, 1), (src[:, :9], 1), (src[:, :4], 1), (unpadded, 1), (src[:5], 2), (src, 2)):
        assert torch.equal(generate(model, batch, 12, decode=compiled), generate(model, batch, 12)), batch.shape
        assert compiled.compiled == steps, batch.shape
    # The compiled code reads its inputs with the strides it was exported with: a memory laid out otherwise is copied.
    memory = model.encode(src).transpose(0, 1).contiguous().transpose(0, 1)
    assert torch.equal(generate(model, src, 12, memory=memory, decode=compiled), generate(model, src, 12))


@pytest.mark.slow
@torch.no_grad()
def test_compiled_decoding_of_one_or_two_tokens_equals_eager_decoding() -> None:
    # One token runs a step whose window (1 position) cannot vary; two run one whose window is 1, then 2.
    model = _model(attention_backend="sdpa")
    src, _ = _batch()
    compiled = CompiledDecode(model)
    for steps, beams in ((1, 1), (2, 1), (2, 3)):
        expected = generate(model, src, steps, beams)
        assert torch.equal(generate(model, src, steps, beams, decode=compiled), expected), (steps, beams)


@pytest.mark.slow
@torch.no_grad()
def test_past_its_limit_of_compiled_steps_decoding_goes_on_eagerly() -> None:
    # LIMIT 1: the first batch size's step compiled; a second batch size decodes eagerly, greedy and beam search, over
    # the cache filled for a compiled step.
    model = _model(attention_backend="sdpa", tie_embeddings=False)
    src = _sources_ending_apart(model, 1, 12)
    compiled = CompiledDecode(model)
    compiled.LIMIT = 1
    assert torch.equal(generate(model, src, 12, decode=compiled), generate(model, src, 12))
    for beams in (1, 3):
        assert torch.equal(generate(model, src[:5], 12, beams, decode=compiled), generate(model, src[:5], 12, beams))
    assert compiled.compiled == 1


@pytest.mark.slow
@pytest.mark.parametrize("position", [p for p in POSITIONS if p != "sinusoidal"])
@torch.no_grad()
def test_compiled_decoding_equals_eager_decoding_for_every_position_scheme(position: str) -> None:
    # Each scheme puts tensors of its own in the static cache (RoPE angles, the relative bias) or in the model (ALiBi
    # slopes, learned positions): the exported step takes the first as inputs and freezes the second in.
    model = _model(position=position, attention_backend="sdpa", tie_embeddings=False)
    src = _sources_ending_apart(model, 1, 12)
    compiled = CompiledDecode(model)
    for beams in (1, 3):
        assert torch.equal(generate(model, src, 12, beams, decode=compiled), generate(model, src, 12, beams)), beams


@pytest.mark.slow
@torch.no_grad()
def test_a_compiled_step_reads_only_the_positions_written() -> None:
    # CompiledDecode sets the static cache's window: the step attends over the positions written and its own, not
    # the whole capacity. Past them the buffers hold NaN, which a read would carry into the logits.
    model = _model(attention_backend="sdpa")
    src, _ = _batch()
    memory, padding = model.encode(src), model.memory_padding(src)
    steps = 6
    static = StaticDecoder(model, memory, padding, steps, graph=False, decode=CompiledDecode(model))
    cache = model.new_cache(steps)
    tokens = torch.randint(3, VOCAB, (src.shape[0], steps))
    for i in range(steps):
        expected = model.decode(tokens[:, i : i + 1], memory, padding, cache)
        for self_cache, _ in static.cache.layers:
            for kv in (self_cache.k, self_cache.v):
                if kv is not None:
                    kv[:, :, i + 1 :] = float("nan")
        torch.testing.assert_close(static(tokens[:, i : i + 1]), expected, atol=1e-5, rtol=1e-5)


def test_compiled_decoding_refuses_weights_changed_after_it_was_made() -> None:
    model = _model()
    compiled = CompiledDecode(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(2)  # what an optimizer step does: in place
    with pytest.raises(RuntimeError, match=r"^the model's weights changed after its decoding was compiled"):
        generate(model, _batch()[0], 4, decode=compiled)
    with pytest.raises(ValueError, match=r"^decode is a CompiledDecode of another model: make one of the model"):
        generate(_model(), _batch()[0], 4, decode=compiled)
    with pytest.raises(
        ValueError, match=r"^CompiledDecode compiles decoding on a CPU: on a GPU, decode with cuda_graph"
    ):
        CompiledDecode(_model().to("meta"))
    with pytest.raises(ValueError, match=r"^CompiledDecode does not compile flex attention: load the model with"):
        CompiledDecode(_model(attention_backend="flex"))


class _EagerStep:
    """:class:`CompiledDecode`'s interface, its step run eagerly: the static-cache search without compiling."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.calls = 0
        self.heads: list[Head | None] = []

    def check(self, model: Transformer) -> None:
        assert model is self.model

    def __call__(
        self,
        token: Tensor,
        memory: Tensor,
        memory_padding: Tensor,
        cache: Any,
        head: Head | None = None,
        head_args: tuple[Tensor, ...] = (),
    ) -> Tensor:
        assert cache.position is not None, "the step runs over a static cache"
        self.calls += 1
        self.heads.append(head)
        logits = self.model.decode(token, memory, memory_padding, cache)
        return logits if head is None else head(logits, self.model.config, *head_args)


class _CountingDecode(CompiledDecode):
    def __init__(self, model: Transformer) -> None:
        super().__init__(model)
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        self.calls += 1
        return super().__call__(*args, **kwargs)


def _sources_ending_apart(model: Transformer, num_beams: int, steps: int, handover: bool = False) -> Tensor:
    """Sources (two of them padded) that ``model``, its EOS made likelier, ends at more than two different steps.
    With ``handover``: sources whose beam search has half of them finished before its last step, and more finishing
    after, so that a static search hands over midway and the dynamic one still drops sources."""
    src = torch.randint(3, VOCAB, (8, 11))
    src[1, 7:] = PAD
    src[5, 3:] = PAD
    eos = model.lm_head.weight[EOS].clone()
    for scale in (1, 1.25, 1.5, 2, 2.5, 3, 4, 6, 8):
        model.lm_head.weight[EOS] = eos * scale
        if handover:
            _, rows = _decoded_rows(model, src, steps, num_beams)
            if len(set(rows[_handover_step(rows, len(src), num_beams) :])) > 1:
                return src
        elif len(set((generate(model, src, steps, num_beams) != PAD).sum(dim=1).tolist())) > 2:
            return src
    pytest.fail(f"no EOS scale makes sources end at different steps with {num_beams} beams")


@torch.no_grad()
def test_static_greedy_hands_over_to_the_dynamic_cache_once_half_the_rows_finished(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With ``decode`` (a CompiledDecode) greedy decoding steps the static cache while most rows run, then goes on
    # eagerly over a dynamic cache holding the running rows: the outputs must be the eager ones.
    model = _model(attention_backend="sdpa", tie_embeddings=False)
    src = _sources_ending_apart(model, 1, 12)
    handovers: list[tuple[int, int]] = []  # (rows kept, positions filled)
    dynamic = DecoderCache.dynamic
    monkeypatch.setattr(
        DecoderCache,
        "dynamic",
        lambda self, rows, filled: handovers.append((len(rows), filled)) or dynamic(self, rows, filled),
    )
    step = _EagerStep(model)
    out = generate(model, src, 12, decode=step)
    assert torch.equal(out, generate(model, src, 12))
    lengths = (out != PAD).sum(dim=1).tolist()  # EOS included
    assert len(handovers) == 1, handovers
    rows, filled = handovers[0]  # at the first step after which half the rows had finished
    finished, finished_before = (sum(length <= n for length in lengths) for n in (filled, filled - 1))
    assert rows == len(lengths) - finished and 2 * finished >= len(lengths) > 2 * finished_before
    assert step.calls == filled and max(lengths) > filled, (handovers, lengths, step.calls)


@pytest.mark.parametrize("num_beams", [2, 4])
@torch.no_grad()
def test_static_beam_search_equals_beam_search_and_hands_over_once_half_the_sources_finished(
    num_beams: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With ``decode`` (a CompiledDecode) beam search runs over a static cache reordered in place, the beams of
    # finished sources stepping, until half the sources have finished; then the rest go on over a dynamic cache,
    # where finished sources leave: the outputs must be the dynamic cache's all along.
    model = _model(attention_backend="sdpa", tie_embeddings=False)
    src = _sources_ending_apart(model, num_beams, 12, handover=True)
    for length_penalty in (0.0, 1.0):
        expected, eager_rows = _decoded_rows(model, src, 12, num_beams, length_penalty)
        step = _EagerStep(model)
        out, rows = _decoded_rows(model, src, 12, num_beams, length_penalty, decode=step)
        assert torch.equal(out, expected)
        handover = _handover_step(eager_rows, len(src), num_beams)
        assert step.calls == handover < len(eager_rows), (eager_rows, handover)
        assert rows == [len(src) * num_beams] * handover + eager_rows[handover:]


@pytest.mark.parametrize("num_beams", [1, 3])
@torch.no_grad()
def test_a_compiled_step_picks_what_the_search_picks_from_logits_forced_tokens_included(num_beams: int) -> None:
    # Without decoding controls the compiled step computes greedy's token (greedy_token) or beam search's candidate
    # scores (beam_scores) itself; the search forces BOS first and EOS last over them as it does over logits.
    torch.manual_seed(0)
    for forced in ({}, {"forced_bos_id": 5, "forced_eos_id": EOS}):
        model = _model(attention_backend="sdpa", tie_embeddings=False, **forced)
        src, _ = _batch()
        step = _EagerStep(model)
        out = generate(model, src, 9, num_beams, decode=step)
        assert torch.equal(out, generate(model, src, 9, num_beams)), forced
        assert set(step.heads) == {greedy_token if num_beams == 1 else beam_scores}, step.heads
        # Off CUDA a CUDA graph is not captured: the compiled step runs, head included.
        assert torch.equal(generate(model, src, 9, num_beams, decode=step, cuda_graph=True), out)
        if forced:
            assert (out[:, 0] == 5).all() and out.shape[1] == 9 and (out[:, -1] == EOS).all(), out


def test_ruling_tokens_out_by_mask_equals_the_indexed_write(monkeypatch: pytest.MonkeyPatch) -> None:
    # Compiled, a few valid ids become an elementwise mask; others (negative, too many) take the indexed write.
    scores = torch.randn(3, 11)
    expected = {}
    for ids in ([0, 1], [4, 4, 10], [-1], list(range(9))):
        expected[tuple(ids)] = rule_out(scores.clone(), ids)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for ids, out in expected.items():
        assert torch.equal(rule_out(scores.clone(), list(ids)), out), ids
        assert torch.isinf(out[:, list(ids)]).all() and torch.isfinite(out).sum() == 3 * (
            11 - len(set(i % 11 for i in ids))
        )


def _decoded_rows(model: Transformer, *args: Any, **kwargs: Any) -> tuple[Tensor, list[int]]:
    """``generate(model, *args, **kwargs)``, and the decoder rows of each of its steps."""
    rows: list[int] = []
    decode = model.decode
    model.decode = lambda token, *args: rows.append(token.shape[0]) or decode(token, *args)  # type: ignore[method-assign]
    try:
        return generate(model, *args, **kwargs), rows
    finally:
        del model.decode


def _handover_step(eager_rows: list[int], sources: int, num_beams: int) -> int:
    """The steps a static beam search takes before it hands over: until half the sources have finished, as the eager
    search's shrinking batch (``eager_rows``, a step's rows) shows; all of them where it does not hand over."""
    return next((i for i, rows in enumerate(eager_rows) if 2 * rows <= sources * num_beams), len(eager_rows))


@pytest.mark.slow
@torch.no_grad()
def test_compiled_beam_search_equals_beam_search_for_new_source_lengths_and_batch_sizes() -> None:
    model = _model(attention_backend="sdpa", tie_embeddings=False)
    src = _sources_ending_apart(model, 3, 12, handover=True)
    compiled = _CountingDecode(model)
    for batch in (src, src[:, :9], src[:5]):
        expected, eager_rows = _decoded_rows(model, batch, 12, 3)
        calls = compiled.calls
        assert torch.equal(generate(model, batch, 12, 3, decode=compiled), expected), batch.shape
        assert compiled.calls - calls == _handover_step(eager_rows, len(batch), 3), batch.shape


@torch.no_grad()
def test_the_cpu_decoding_layout_keeps_values_tied_weights_and_outputs() -> None:
    # Every linear weight column-major (its transpose, which F.linear multiplies by, contiguous), the same values,
    # the tied table still one parameter shared by the embeddings and the output layer, the same greedy and beams.
    model = _model(attention_backend="sdpa", tie_embeddings=True)
    src, _ = _batch()
    expected = {beams: generate(model, src, 10, beams) for beams in (1, 3)}
    before = {name: p.clone() for name, p in model.named_parameters()}
    cpu_decoding_layout(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) > 8 and all(m.weight.t().is_contiguous() and not m.weight.is_contiguous() for m in linears)
    assert model.lm_head.weight is model.tgt_embed.weight is model.src_embed.weight
    assert before.keys() == dict(model.named_parameters()).keys()
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    for beams, out in expected.items():
        assert torch.equal(generate(model, src, 10, beams), out), beams


def _static_steps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """Each :class:`StaticDecoder` step from now on: its rows, and whether it replayed a CUDA graph."""
    steps: list[tuple[int, bool]] = []
    call = StaticDecoder.__call__

    def counted(self: StaticDecoder, token: Tensor) -> Tensor:
        steps.append((token.shape[0], self.graph is not None))
        return call(self, token)

    monkeypatch.setattr(StaticDecoder, "__call__", counted)
    return steps


@torch.no_grad()
def test_beam_search_with_cuda_graph_steps_the_static_cache_then_hands_over(monkeypatch: pytest.MonkeyPatch) -> None:
    # cuda_graph=True: beam search steps a StaticDecoder (on a CPU without a graph, the same static steps run
    # eagerly) over every beam until half the sources have finished, then goes on over the dynamic cache. The
    # beams it keeps must be the eager search's, and it must hand over exactly where the eager batch has halved.
    model = _model(attention_backend="sdpa", tie_embeddings=False)
    src = _sources_ending_apart(model, 3, 12, handover=True)
    expected, eager_rows = _decoded_rows(model, src, 12, 3)
    steps = _static_steps(monkeypatch)
    assert torch.equal(generate(model, src, 12, 3, cuda_graph=True), expected)
    assert 0 < len(steps) == _handover_step(eager_rows, len(src), 3) < 12
    assert set(steps) == {(len(src) * 3, False)}


@torch.no_grad()
def test_a_static_cache_reorders_in_place_and_refuses_to_resize() -> None:
    model = _model()
    src, _ = _batch()
    memory, padding = model.encode(src), model.memory_padding(src)
    static = StaticDecoder(model, memory, padding, 4, graph=False)
    dynamic = model.new_cache(4)
    tokens = torch.randint(3, VOCAB, (src.shape[0], 3))
    for step in range(2):
        static(tokens[:, step : step + 1])
        model.decode(tokens[:, step : step + 1], memory, padding, dynamic)

    def buffers() -> list[int]:
        return [t.data_ptr() for pair in static.cache.layers for kv in pair for t in (kv.k, kv.v) if t is not None]

    before = buffers()
    index = torch.tensor([2, 0, 2])
    static.cache.select(index, filled=2)
    dynamic.select(index)
    assert buffers() == before  # the compiled step's inputs stay put
    torch.testing.assert_close(static(tokens[:, 2:]), model.decode(tokens[:, 2:], memory, padding, dynamic))
    with pytest.raises(ValueError, match=r"^a static cache keeps its rows: reorder them, or decode with a dynamic"):
        static.cache.select(torch.tensor([1, 0]), filled=3)
    with pytest.raises(ValueError, match=r"^a static cache counts its positions on the device: pass the number"):
        static.cache.select(index)
    # Refused before anything moved: the next step is still the dynamic cache's.
    torch.testing.assert_close(static(tokens[:, :1]), model.decode(tokens[:, :1], memory, padding, dynamic))


def test_cross_attention_to_a_memory_whose_rows_do_not_divide_the_batch_is_one_line() -> None:
    model = _model()
    src, tgt = _batch()
    memory, padding = model.encode(src[:2]), model.memory_padding(src[:2])
    with pytest.raises(ValueError, match=r"^cross-attention from 3 rows to a memory of 2: pass one memory row per"):
        model.decode(tgt, memory, padding)


def test_a_static_cache_past_max_len_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^a cache of 65 positions exceeds max_len=64 of position='sinusoidal'"):
        _model().new_cache(65, torch.zeros(1, 4, dtype=torch.bool))


class _PrefixCache:
    """What :class:`_ScriptedDecoder` keeps between steps: each row's tokens so far."""

    def __init__(self) -> None:
        self.prefixes: list[tuple[int, ...]] = []

    def extend(self, tokens: list[int]) -> None:
        self.prefixes = [p + (t,) for p, t in zip(self.prefixes or [()] * len(tokens), tokens, strict=True)]

    def select(self, index: Tensor, filled: int | None = None) -> None:
        self.prefixes = [self.prefixes[i] for i in index.tolist()]


class _ScriptedDecoder:
    """A stand-in for the Transformer in the search functions, whose every outcome is known in advance.

    Next-token logits are a fixed pseudo-random function of (source, prefix); EOS grows likelier with the
    length, so that some hypotheses finish early and others run to the step limit, whatever the model's
    initialisation does.
    """

    def __init__(self) -> None:
        self.config = _config()

    def next_logits(self, source: int, prefix: tuple[int, ...]) -> Tensor:
        generator = torch.Generator().manual_seed(hash((source, prefix)) % 2**31)  # int tuples hash stably
        logits = 2.0 * torch.randn(VOCAB, generator=generator)
        logits[EOS] += 0.8 * len(prefix) - 3.0
        return logits

    # The interface greedy_search and beam_search use.
    def encode(self, src: Tensor) -> Tensor:
        return src[:, :1, None].float()  # (B, 1, 1): the source id travels as the "memory"

    def memory_padding(self, src: Tensor) -> Tensor:
        return torch.zeros(src.shape[0], 1, dtype=torch.bool)

    def new_cache(self, capacity: int, source: Tensor | None = None) -> _PrefixCache:
        return _PrefixCache()

    def decode(self, tokens: Tensor, memory: Tensor, memory_padding: Tensor, cache: _PrefixCache) -> Tensor:
        cache.extend(tokens[:, -1].tolist())
        # A source's beams share its memory row, as the Transformer's cross-attention lets them.
        sources = memory[:, 0, 0].long().repeat_interleave(tokens.shape[0] // memory.shape[0]).tolist()
        return torch.stack([self.next_logits(s, p) for s, p in zip(sources, cache.prefixes, strict=True)])[:, None]


def _search_inputs(kind: str) -> tuple[Transformer | _ScriptedDecoder, Tensor]:
    if kind == "scripted":
        return _ScriptedDecoder(), torch.arange(10, 22)[:, None]  # 12 sources
    src = torch.randint(3, VOCAB, (6, 11))
    src[1, 7:] = PAD
    return _model(), src


def _reference_beam_search(
    next_log_probs: Callable[[list[int]], list[float]], steps: int, k: int, length_penalty: float
) -> list[int]:
    """Beam search for one source written plainly: one call per hypothesis and step, no cache, no batching.

    The rules are the documented ones: the 2k best continuations are ranked; an EOS among the first k
    finishes a hypothesis; the first k others live on; k finished hypotheses stop the search; at the last
    step the open beams finish as they stand; a hypothesis scores ``log p / length ** length_penalty``.
    """
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    finished: list[tuple[float, list[int]]] = []
    for step in range(steps):
        candidates = []
        for seq, score in beams:
            candidates += [(score + lp, seq + [token]) for token, lp in enumerate(next_log_probs(seq))]
        candidates.sort(key=lambda c: -c[0])
        beams = []
        for rank, (score, seq) in enumerate(candidates[: 2 * k]):
            if seq[-1] == EOS:
                if rank < k:
                    finished.append((score / len(seq) ** length_penalty, seq))
            elif len(beams) < k:
                beams.append((seq, score))
        if len(finished) >= k:
            break
        if step == steps - 1:
            finished += [(score / len(seq) ** length_penalty, seq) for seq, score in beams]
    return max(finished, key=lambda h: h[0])[1]


def _next_log_probs(model: Transformer | _ScriptedDecoder, src: Tensor) -> Callable[[list[int]], list[float]]:
    """``seq -> log p(next | src, BOS + seq)`` for one source ``src (S,)``, from scratch every time."""
    if isinstance(model, _ScriptedDecoder):
        return lambda seq: torch.log_softmax(_next(model.next_logits(int(src[0]), (BOS, *seq))[None]), -1).tolist()
    return lambda seq: torch.log_softmax(_next(model(src[None], torch.tensor([[BOS, *seq]])))[0], -1).tolist()


@pytest.mark.parametrize("kind", ["transformer", "scripted"])
@torch.no_grad()
def test_beam_search_with_one_beam_is_greedy(kind: str) -> None:
    model, src = _search_inputs(kind)
    greedy = greedy_search(model, src, 10)
    if kind == "scripted":
        assert (greedy == EOS).any(), "some row should end early, so that the padding after EOS is compared too"
    assert torch.equal(beam_search(model, src, 10, 1, 1.0), greedy)


@pytest.mark.parametrize(("kind", "k"), [("transformer", 3), ("scripted", 2), ("scripted", 4)])
@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
@torch.no_grad()
def test_beam_search_matches_a_plain_reference(kind: str, k: int, length_penalty: float) -> None:
    model, src = _search_inputs(kind)
    steps = 7
    out = beam_search(model, src, steps, k, length_penalty)
    ended = []
    for row in range(src.shape[0]):
        expected = _reference_beam_search(_next_log_probs(model, src[row]), steps, k, length_penalty)
        assert out[row, : len(expected)].tolist() == expected, f"row {row}"
        assert (out[row, len(expected) :] == PAD).all()
        ended.append(expected[-1] == EOS)
    if kind == "scripted":
        assert any(ended) and not all(ended), "the batch should hold both finished and cut-off hypotheses"


@pytest.mark.parametrize("num_beams", [1, 3])
@torch.no_grad()
def test_rows_that_finish_leave_the_batch_and_change_no_output(num_beams: int) -> None:
    # Finished rows (greedy) and finished sources (beam) drop out of the batch, their key/value caches and
    # encoder output with them: every other row must decode as if it were alone.
    model = _model(tie_embeddings=False)
    model.lm_head.weight[EOS] *= 4  # a likely EOS, so that rows end at different steps
    src = torch.randint(3, VOCAB, (8, 11))
    src[1, 7:] = PAD
    src[5, 3:] = PAD
    steps = 12
    out = generate(model, src, steps, num_beams)
    lengths = []
    for row in range(src.shape[0]):
        alone = generate(model, src[row : row + 1], steps, num_beams)[0]
        assert out[row, : len(alone)].tolist() == alone.tolist(), f"row {row}"
        assert (out[row, len(alone) :] == PAD).all()
        lengths.append(int((alone != PAD).sum()))
    assert len(set(lengths)) > 2 and max(lengths) == steps, f"rows should end at different steps: {lengths}"


@torch.no_grad()
def test_beam_search_with_a_beam_per_token_is_exact_and_beats_greedy() -> None:
    # Beam search is no better than greedy in general (the greedy prefix can be pruned), but with as many
    # beams as tokens nothing is pruned over two steps: it must find the most likely sequence of length <= 2.
    model = _model()
    src = torch.randint(3, VOCAB, (5, 11))
    src[1, 7:] = PAD
    b = src.shape[0]
    first = torch.log_softmax(_next(model(src, torch.full((b, 1), BOS))), dim=-1)  # (B, V)
    prefixes = torch.stack([torch.full((VOCAB,), BOS), torch.arange(VOCAB)], dim=1)  # (V, 2): BOS, a
    second = torch.log_softmax(_next(model(src.repeat_interleave(VOCAB, 0), prefixes.repeat(b, 1))), dim=-1)
    two_tokens = first[:, :, None] + second.view(b, VOCAB, VOCAB)  # (B, a, b): log p(a) + log p(b | a)
    two_tokens[:, EOS] = float("-inf")  # nothing follows EOS
    best = torch.maximum(two_tokens.flatten(1).max(dim=1).values, first[:, EOS])  # (B,)

    beams = beam_search(model, src, 2, VOCAB, 0.0)
    beam_logp = _sequence_log_prob(model, src, beams)
    torch.testing.assert_close(beam_logp, best)
    assert (beam_logp >= _sequence_log_prob(model, src, generate(model, src, 2)) - 1e-5).all()


@pytest.mark.parametrize("num_beams", [1, 3])
@torch.no_grad()
def test_generation_keeps_stepping_until_every_process_is_done(num_beams: int) -> None:
    # Under ZeRO-3 or FSDP each decoder step gathers parameters collectively, so a process whose rows all
    # finished must keep stepping while another has not: ``all_done`` reports the other processes' state.
    model, sources = _search_inputs("scripted")
    steps, calls = 12, []
    search = greedy_search if num_beams == 1 else lambda *a, **k: beam_search(*a[:3], num_beams, 1.0, **k)
    alone = [search(model, sources[i : i + 1], steps) for i in range(sources.shape[0])]
    row = next(i for i, out in enumerate(alone) if out.shape[1] < steps)  # a source that finishes early
    src, finished_alone = sources[row : row + 1], alone[row]
    synced = search(model, src, steps, all_done=lambda done: calls.append(done) or False)
    assert len(calls) == steps and calls[-1]  # stepped to the limit, though done well before it
    torch.testing.assert_close(synced[:, : finished_alone.shape[1]], finished_alone)
    assert (synced[:, finished_alone.shape[1] :] == PAD).all()


@pytest.mark.parametrize("num_beams", [1, 3])
@torch.no_grad()
def test_generation_runs_attention_without_cudnn_and_restores_the_choice(num_beams: int) -> None:
    """cuDNN's attention builds an execution plan for each new shape and decoding meets a new one every step, so the
    plans cost more than the kernel saves (benchmarks/RESULTS.md, section "GPU suite", fourth H200 session):
    ``generate`` turns it off for its encoder and decoder passes, and leaves the process's choice as it found it."""
    model = Transformer(_config()).eval()
    seen = []
    decode = model.decode

    def recording(*args: Any, **kwargs: Any) -> Tensor:
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()))
        return decode(*args, **kwargs)

    model.decode = recording  # type: ignore[method-assign]
    src = torch.randint(3, VOCAB, (2, 5))
    before = torch.backends.cuda.cudnn_sdp_enabled()
    generate(model, src, 4, num_beams=num_beams)
    assert seen and set(seen) == {(False, True)}
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
