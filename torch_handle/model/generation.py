"""Greedy and beam-search decoding over a cached encoder output and a key/value cache.

Decoding takes the model as an argument and uses only its public ``encode``/``decode``/``new_cache``: the
import points one way, generation -> transformer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor, nn

from torch_handle.model.config import TransformerConfig
from torch_handle.model.kernels import decoding_kernels
from torch_handle.model.logits import DecodingControls, StepControls
from torch_handle.model.transformer import DecoderCache, Transformer


def cpu_decoding_layout(model: nn.Module) -> None:
    """Stores every linear weight ``W (out, in)`` column-major, same values and shape, for decoding on a CPU.

    ``F.linear`` multiplies by ``W.t()``; at a decoding step's few rows MKL runs that product faster when ``W.t()``
    is contiguous than when it is a transposed view (at a training batch's thousands of rows both take the same
    time; see benchmarks/RESULTS.md, section "Levers at bench_peers' sizes", and
    ``benchmarks/bench_cpu_layout.py``). It pays only as a
    layout kept between calls, for a model that no longer trains: ``torch_handle.load`` sets it once, unless it
    compiles. A weight shared by several modules (tied embeddings) moves once, for all of them. Saving such a weight
    with safetensors needs ``.contiguous()`` first.
    """
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.is_contiguous():
            module.weight.data = module.weight.data.t().contiguous().t()


def next_token_logits(logits: Tensor, config: TransformerConfig) -> Tensor:
    """Last-position logits ``(B, V)``, the tokens never generated ruled out (by default padding and BOS), as
    ``bad_words_ids`` rules them out in ``transformers``, before the decoding controls."""
    logits = logits[:, -1].float()
    if config.suppressed:
        logits[:, config.suppressed] = float("-inf")
    return logits


def force_token(scores: Tensor, config: TransformerConfig, step: int, steps: int) -> Tensor:
    """``scores (B, V)`` of output position ``step`` of ``steps`` with ``forced_bos_id`` first or ``forced_eos_id``
    last the only token left, scored 0, as ``transformers``' forcing processors do after the decoding controls:
    a minimum length that rules EOS out at the last step leaves the forced EOS."""
    forced = config.forced_bos_id if step == 0 else config.forced_eos_id if step == steps - 1 else None
    if forced is None:
        return scores
    scores = torch.full_like(scores, float("-inf"))
    scores[:, forced] = 0
    return scores


class CompiledDecode:
    """``model.decode`` compiled by Inductor with the weights frozen into it, for decoding on a CPU.

    Freezing folds the weights into the compiled code as constants, packed once for MKL's matrix products: at
    decoding's few rows per step those products are most of the time. Inductor's C++ wrapper calls the step's kernels
    without Python in between. The step attends over the positions written only
    (:meth:`DecoderCache.attend_written`, a dynamic length), but it keeps finished rows, so greedy decoding and beam
    search hand a batch over to the eager cache once half its rows (or sources) have finished. What it gains: see
    benchmarks/RESULTS.md, sections "bench_peers: ours vs Hugging Face BART / Marian and CTranslate2" and
    "`compile=True` on real sentences".

    What it costs: each batch size compiles two steps (the first, which fills the cache, and the rest; seconds each);
    source lengths are dynamic from the first call, so a new one compiles nothing. Up to 32 compiled steps are
    kept (torch's default keeps 8, then decodes eagerly). Frozen weights cannot follow the model's: a call after a
    parameter or buffer changed in place raises instead of decoding with the old ones (a change made through
    ``.data`` escapes the check). It changes Inductor's settings for the duration of each call: one thread at a time.
    Only :class:`StaticDecoder`'s fixed-shape step uses it (greedy decoding and beam search).
    """

    def __init__(self, model: Transformer) -> None:
        import torch._dynamo.config
        import torch._inductor.config

        if any(p.device.type != "cpu" for p in model.parameters()):
            raise ValueError("CompiledDecode compiles decoding on a CPU: on a GPU, decode with cuda_graph=True")
        self._settings = (
            torch._inductor.config.patch(freezing=True, cpp_wrapper=True),
            torch._dynamo.config.patch(recompile_limit=32),
        )
        self.model = model
        self._parameters = [*model.parameters(), *model.buffers()]
        self._versions = self._current()
        self._decode = torch.compile(model.decode)

    def _current(self) -> list[tuple[int, int]]:
        return [(p.data_ptr(), p._version) for p in self._parameters]

    def __call__(self, token: Tensor, memory: Tensor, memory_padding: Tensor, cache: DecoderCache) -> Tensor:
        if self._current() != self._versions:
            raise RuntimeError(
                "the model's weights changed after its decoding was compiled with them frozen in: compile it again "
                "(a new CompiledDecode, or torch_handle.load(..., compile=True) again), or decode without compile"
            )
        # One compiled step per batch size: a batch dimension left to turn dynamic (as a second size would) cost
        # most of the gain, measured. Source lengths are dynamic from the first call, at no cost to the step: a job's
        # second length would otherwise compile every step again.
        for tensor in (token, memory, memory_padding, *cache.batched()):
            torch._dynamo.mark_static(tensor, 0)
        lengths = [(memory, 1), (memory_padding, 1)] + [(t, 2) for _, cross in cache.layers for t in (cross.k, cross.v)]
        if cache.cross_spec is not None:
            if cache.cross_spec.key_padding is None:  # a batch without padding: the same step, not one of its own
                cache.cross_spec = dataclasses.replace(cache.cross_spec, key_padding=memory_padding)
            lengths.append((cache.cross_spec.key_padding, 1))
        assert cache.position is not None
        window = cache.attend_written(int(cache.position))  # a host read, on a CPU: attend over those positions only
        if len(window) > 1:  # dynamic from the second step (the first, which fills the cache, compiles its own)
            torch._dynamo.mark_dynamic(window, 0)
        for tensor, dim in lengths:
            if tensor is not None:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        with torch.no_grad(), self._settings[0], self._settings[1]:
            return self._decode(token, memory, memory_padding, cache)


class StaticDecoder:
    """The decoder's one-token step over a static cache (:meth:`Transformer.new_cache`), replayed as a CUDA graph.

    A step of a small model is a few hundred kernels of microseconds each, so eagerly the GPU waits on Python
    most of the time; a graph launches the whole step at once. Capture needs fixed shapes and buffers, so rows
    never leave the batch. Off CUDA (or with ``graph=False``) the same static step runs eagerly. The model's
    weights must not change while a decoder is in use, and nothing in its forward pass may communicate.
    ``decode`` replaces ``model.decode`` in the step: a :class:`CompiledDecode` on a CPU. ``rows``: the decoder's
    rows, a multiple of ``memory``'s when groups of them share a memory row (beam search); ``memory``'s by default.
    """

    def __init__(
        self,
        model: Transformer,
        memory: Tensor,
        memory_padding: Tensor,
        capacity: int,
        graph: bool,
        decode: Callable[..., Tensor] | None = None,
        rows: int | None = None,
    ) -> None:
        self.cache = model.new_cache(capacity, memory_padding)
        rows = memory.shape[0] if rows is None else rows
        assert rows % memory.shape[0] == 0, "each memory row serves a group of consecutive decoder rows"
        self.token = torch.full((rows, 1), model.config.bos_id, dtype=torch.long, device=memory.device)
        decode = model.decode if decode is None else decode

        def step() -> Tensor:
            return decode(self.token, memory, memory_padding, self.cache)

        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None  # the graph's output buffer
        self.step = step
        if not (graph and memory.is_cuda):
            return
        # Autocast's cache of cast weights would be freed when the caller's autocast region ends, under a graph
        # that still reads it: the casts go into the graph instead.
        autocast = torch.autocast(
            "cuda", torch.get_autocast_dtype("cuda"), enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False
        )
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        assert self.cache.position is not None
        with torch.cuda.stream(stream), autocast:  # fills the cross-attention cache; cuBLAS warms up off the graph
            for _ in range(2):
                step()
                self.cache.position.zero_()  # within the capacity, even a capacity of one
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), autocast:
            self.logits = step()
        self.cache.position.zero_()  # capture ran no kernel; the warm-up's keys are masked, then overwritten

    def __call__(self, token: Tensor) -> Tensor:
        """Logits ``(B, 1, V)`` after ``token (B, 1)``, the next position."""
        if self.graph is None:
            self.token = token
            return self.step()
        self.token.copy_(token)
        self.graph.replay()
        assert self.logits is not None
        return self.logits


def _check_owner(decode: CompiledDecode, model: Transformer) -> None:
    if decode.model is not model:
        raise ValueError("decode is a CompiledDecode of another model: make one of the model that decodes")


def greedy_search(
    model: Transformer,
    src: Tensor,
    max_new_tokens: int,
    all_done: Callable[[bool], bool] = bool,
    memory: Tensor | None = None,
    cuda_graph: bool = False,
    decode: CompiledDecode | None = None,
    controls: StepControls | None = None,
) -> Tensor:
    """Pick the most likely token at every step (or draw one, see ``controls``); stop once every row produced EOS.

    A row that has produced EOS leaves the batch: the decoder computes only the rows still running.
    ``all_done`` turns this process's "finished" into everyone's (see :func:`generate`); a process done
    before the others keeps stepping its last rows, writing nothing. ``cuda_graph``: decode with a
    :class:`StaticDecoder` instead, where finished rows keep stepping and write nothing; ``decode``: the same, its
    step compiled (:class:`CompiledDecode`). ``controls`` process each step's logits outside the step, compiled or not.
    """
    c = model.config
    memory = model.encode(src) if memory is None else memory
    memory_padding = model.memory_padding(src)
    if decode is not None:
        _check_owner(decode, model)
    if cuda_graph or decode is not None:
        step = StaticDecoder(model, memory, memory_padding, max_new_tokens, graph=cuda_graph, decode=decode)
        handover = None if decode is None else (model, memory, memory_padding)
        return _static_greedy(step, model.config, max_new_tokens, all_done, handover, controls)
    cache = model.new_cache(max_new_tokens)
    out = torch.full((src.shape[0], max_new_tokens), c.pad_id, dtype=torch.long, device=src.device)
    rows = torch.arange(src.shape[0], device=src.device)  # the batch rows still decoding
    token = torch.full((src.shape[0], 1), c.bos_id, dtype=torch.long, device=src.device)
    return _dynamic_greedy(model, memory, memory_padding, cache, token, rows, out, 0, all_done, controls)


def _dynamic_greedy(
    model: Transformer,
    memory: Tensor,
    memory_padding: Tensor,
    cache: DecoderCache,
    token: Tensor,
    rows: Tensor,
    out: Tensor,
    start: int,
    all_done: Callable[[bool], bool],
    controls: StepControls | None,
) -> Tensor:
    """Greedy steps ``start`` onwards over a dynamic cache, writing the ``rows`` of ``out``: finished rows leave."""
    c = model.config
    done = False
    for step in range(start, out.shape[1]):
        logits = next_token_logits(model.decode(token, memory, memory_padding, cache), c)
        if controls is not None:
            logits = controls.greedy(logits, out, rows, step)
        logits = force_token(logits, c, step, out.shape[1])
        token = logits.max(dim=-1, keepdim=True).indices  # (b, 1); faster than argmax on CPU, same ties
        if not done:
            out[rows, step] = token[:, 0]
            running = token[:, 0] != c.eos_id
            done = not bool(running.any())
        if all_done(done):
            return out[:, : step + 1]
        if not done and not bool(running.all()):
            keep = running.nonzero().squeeze(1)
            rows, token, memory, memory_padding = rows[keep], token[keep], memory[keep], memory_padding[keep]
            cache.select(keep)
    return out


def _static_greedy(
    step: StaticDecoder,
    c: TransformerConfig,
    max_new_tokens: int,
    all_done: Callable[[bool], bool],
    handover: tuple[Transformer, Tensor, Tensor] | None = None,
    controls: StepControls | None = None,
) -> Tensor:
    """Greedy steps over ``step``'s static cache. With ``handover`` (the model, memory and its padding), once half
    the rows have finished the rest go on eagerly over a dynamic cache, where finished rows leave: the compiled step
    runs only while the batch is mostly running."""
    token = step.token  # (B, 1) BOS
    out = torch.full((token.shape[0], max_new_tokens), c.pad_id, dtype=torch.long, device=token.device)
    finished = torch.zeros(token.shape[0], dtype=torch.bool, device=token.device)
    for i in range(max_new_tokens):
        logits = next_token_logits(step(token), c)
        if controls is not None:
            logits = controls.greedy(logits, out, None, i)
        logits = force_token(logits, c, i, max_new_tokens)
        token = logits.max(dim=-1, keepdim=True).indices
        out[:, i] = token[:, 0].masked_fill(finished, c.pad_id)
        finished |= token[:, 0] == c.eos_id
        if all_done(bool(finished.all())):
            return out[:, : i + 1]
        if handover is not None and i + 1 < max_new_tokens and 2 * int(finished.sum()) >= len(finished):
            model, memory, memory_padding = handover
            rows = (~finished).nonzero().squeeze(1)
            cache = step.cache.dynamic(rows, filled=i + 1)
            return _dynamic_greedy(
                model, memory[rows], memory_padding[rows], cache, token[rows], rows, out, i + 1, all_done, controls
            )
    return out


def beam_search(
    model: Transformer,
    src: Tensor,
    max_new_tokens: int,
    num_beams: int,
    length_penalty: float,
    all_done: Callable[[bool], bool] = bool,
    memory: Tensor | None = None,
    decode: CompiledDecode | None = None,
    cuda_graph: bool = False,
    controls: StepControls | None = None,
) -> Tensor:
    """Keep the ``num_beams`` best prefixes per source; a hypothesis scores ``log p / length ** length_penalty``.

    A source is done once it holds ``num_beams`` finished hypotheses (early stopping), and its beams leave
    the batch; at ``max_new_tokens``, or where ``all_done`` stops a process whose sources still search (a lockstep
    call that only mirrors the others'), the open beams are finished as they stand. ``decode``, or ``cuda_graph`` on a
    GPU: steps run that compiled step (:class:`CompiledDecode`), or replay each as a CUDA graph, over a static
    cache reordered in place, where the beams of finished sources keep stepping and are ignored, until half the
    sources have finished; the rest then go on eagerly over a dynamic cache (:meth:`DecoderCache.dynamic`), as
    greedy decoding does. ``controls`` process each step's log-probabilities and draw its candidates when sampling.
    """
    c = model.config
    b, k = src.shape[0], num_beams
    # One memory row per source, shared by its K beams (rows b*K .. b*K+K-1): cross-attention reads it once.
    memory = model.encode(src) if memory is None else memory
    memory_padding = model.memory_padding(src)
    static = None
    if decode is not None:
        _check_owner(decode, model)
    if decode is not None or cuda_graph:
        static = StaticDecoder(
            model, memory, memory_padding, max_new_tokens, graph=cuda_graph, decode=decode, rows=b * k
        )
    cache = model.new_cache(max_new_tokens) if static is None else static.cache
    tokens = torch.full((b * k, 1), c.bos_id, dtype=torch.long, device=src.device)
    scores = torch.zeros(b, k, device=src.device)
    scores[:, 1:] = float("-inf")  # all beams start equal: expand only the first
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(b)]
    active = list(range(b))  # the sources still searching, in batch order; theirs are the batch's rows

    def finish(row: int, beam_tokens: list[int], score: float) -> None:
        # A candidate scored -inf is no hypothesis: a tie of topk's (a forced token leaves one finite candidate) or an
        # unfilled slot. Every source keeps a finite one (the best candidate of a step is), so none ends empty.
        if score == float("-inf"):
            return
        finished[row].append((score / len(beam_tokens) ** length_penalty, beam_tokens))

    for step in range(max_new_tokens):
        n = len(active)
        if static is None:
            logits = model.decode(tokens[:, -1:], memory, memory_padding, cache)
        else:
            logits = static(tokens[:, -1:].contiguous())  # a fixed stride, or the compiled step recompiles
        logp = torch.log_softmax(next_token_logits(logits, c), dim=-1)  # (n*K, V)
        if controls is not None:
            logp = controls.beam(logp, tokens)
        logp = force_token(logp, c, step, max_new_tokens)
        vocab = logp.shape[-1]
        total = (logp.view(n, k, vocab) + scores[..., None]).view(n, k * vocab)
        if controls is None:
            top_scores, top_ids = total.topk(2 * k, dim=-1)  # (n, 2K)
        else:
            top_scores, top_ids = controls.candidates(total, 2 * k, step, active)
        top_beams, top_tokens = (top_ids // vocab).tolist(), (top_ids % vocab).tolist()
        top_scores_list = top_scores.tolist()
        # Python lists while choosing: a tensor element write per candidate costs more than the step's attention.
        # A source done before this step keeps its beams where they are: nothing of its cache moves.
        next_beam, next_token = [list(range(k)) for _ in range(n)], [[c.pad_id] * k for _ in range(n)]
        next_score = [[float("-inf")] * k for _ in range(n)]
        prefixes: list[list[int]] | None = None  # read from the tensor only when a hypothesis finishes
        searching = []  # positions in ``active`` of the sources that go on
        for i, row in enumerate(active):
            if len(finished[row]) >= k:  # done before this step: a process in lockstep keeps stepping it
                continue
            kept = 0
            for rank, (beam, token, score) in enumerate(zip(top_beams[i], top_tokens[i], top_scores_list[i])):
                if token == c.eos_id:
                    if rank < k:
                        prefixes = tokens[:, 1:].tolist() if prefixes is None else prefixes
                        finish(row, prefixes[i * k + beam] + [token], score)
                    continue
                next_beam[i][kept], next_token[i][kept], next_score[i][kept] = beam, token, score
                kept += 1
                if kept == k:
                    break
            if len(finished[row]) < k:
                searching.append(i)
        if all_done(not searching):
            if searching:  # stopped by the other processes (a lockstep call that mirrors theirs): finish what is open
                prefixes = tokens[:, 1:].tolist() if prefixes is None else prefixes
                for i in searching:
                    for beam, token, score in zip(next_beam[i], next_token[i], next_score[i], strict=True):
                        finish(active[i], prefixes[i * k + beam] + [token], score)
            break
        # Once half the sources have finished, the rest go on eagerly: the static step pays only while most run.
        handover = static is not None and step < max_new_tokens - 1 and 2 * len(searching) <= n
        if (static is None or handover) and searching and len(searching) < n:  # finished sources leave the batch
            active = [active[i] for i in searching]
            kept_rows = torch.tensor(searching)
            next_beam, next_token, next_score = (
                [chosen[i] for i in searching] for chosen in (next_beam, next_token, next_score)
            )
            memory_rows = kept_rows.to(src.device)
            memory, memory_padding = memory[memory_rows], memory_padding[memory_rows]
        else:
            kept_rows = torch.arange(n)
        index = (kept_rows[:, None] * k + torch.tensor(next_beam)).view(-1).to(src.device)
        if handover:
            cache, static = cache.dynamic(index, step + 1), None
        elif step < max_new_tokens - 1:  # no step reads the cache after the last
            cache.select(index, step + 1)
        tokens = torch.cat([tokens.index_select(0, index), torch.tensor(next_token).view(-1, 1).to(src.device)], dim=1)
        scores = torch.tensor(next_score).to(src.device)
        if step == max_new_tokens - 1:
            prefixes, final = tokens[:, 1:].tolist(), scores.tolist()
            for i, row in enumerate(active):
                if len(finished[row]) < k:
                    for beam in range(k):
                        finish(row, prefixes[i * k + beam], final[i][beam])
    best = _best(finished)
    out = torch.full((b, max(map(len, best))), c.pad_id, dtype=torch.long)
    for row, hyp in enumerate(best):
        out[row, : len(hyp)] = torch.tensor(hyp)
    return out.to(src.device)


def _best(finished: list[list[tuple[float, list[int]]]]) -> list[list[int]]:
    """Each source's best finished hypothesis, from its ``(score, tokens)`` pairs."""
    return [max(hyps, key=lambda h: h[0])[1] for hyps in finished]


@torch.no_grad()
def generate(
    model: Transformer,
    src: Tensor,
    max_new_tokens: int,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    all_done: Callable[[bool], bool] = bool,
    memory: Tensor | None = None,
    cuda_graph: bool = False,
    decode: CompiledDecode | None = None,
    controls: DecodingControls | None = None,
) -> Tensor:
    """Generated ids ``(B, L)`` without BOS, ``pad_id`` after EOS.

    The encoder runs once, or not at all when the caller passes its output for ``src`` as ``memory``
    (evaluation has it from the loss); the decoder uses a key/value cache. ``num_beams > 1`` runs beam search.
    ``all_done`` maps "this process is done" to "every process is done": where forward passes communicate
    (ZeRO-3 and FSDP gather parameters in them), processes that finish early must keep stepping in
    lockstep until all have finished, so the caller passes a reduction over processes here.
    ``cuda_graph``: greedy decoding and beam search replay each step as a CUDA graph (:class:`StaticDecoder`); only
    where the model is a plain module (no sharded parameters gathered in its forward pass). ``decode``:
    greedy decoding and beam search run that compiled step instead (a :class:`CompiledDecode` of ``model``, for CPU
    inference). ``controls``: n-gram blocking, repetition penalty, a minimum length and sampling, as ``transformers``
    applies them (:mod:`torch_handle.model.logits`), on every path; none set costs a step nothing.
    Attention runs on SDPA's kernels other than cuDNN's (:func:`~torch_handle.model.kernels.decoding_kernels`).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if num_beams < 1:
        raise ValueError(f"num_beams must be >= 1, got {num_beams}")
    c = model.config
    step = None if controls is None else controls.bind(src, c.pad_id, c.bos_id, c.eos_id)
    with decoding_kernels():
        if num_beams == 1:
            return greedy_search(model, src, max_new_tokens, all_done, memory, cuda_graph, decode, step)
        return beam_search(
            model, src, max_new_tokens, num_beams, length_penalty, all_done, memory, decode, cuda_graph, step
        )
