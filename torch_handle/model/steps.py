"""One decoding step over a key/value cache, run eagerly, compiled (:class:`CompiledDecode`) or replayed as a CUDA graph
(:class:`StaticDecoder`), and what greedy decoding and beam search both do to its logits.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import Tensor, nn

from torch_handle.model.config import TransformerConfig
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


def rule_out(scores: Tensor, ids: list[int]) -> Tensor:
    """``scores (B, V)`` with the tokens ``ids`` at -inf: in place eagerly. Compiled, a few ids are one elementwise
    mask, which Inductor fuses into the kernel that makes the scores, where an indexed write copies them first."""
    if not ids:
        return scores
    if not torch.compiler.is_compiling() or len(ids) > 8 or not all(0 <= i < scores.shape[-1] for i in ids):
        scores[:, ids] = float("-inf")
        return scores
    vocab = torch.arange(scores.shape[-1], device=scores.device)
    return scores.masked_fill(functools.reduce(torch.logical_or, [vocab == i for i in ids]), float("-inf"))


def next_token_logits(logits: Tensor, config: TransformerConfig) -> Tensor:
    """Last-position logits ``(B, V)``, the tokens never generated ruled out (by default padding and BOS), as
    ``bad_words_ids`` rules them out in ``transformers``' greedy search and sampling, before the decoding controls."""
    return rule_out(logits[:, -1].float(), config.suppressed)


def next_token_log_probs(logits: Tensor, config: TransformerConfig) -> Tensor:
    """Beam search's last-position log-probabilities ``(B, V)``. A Hugging Face model's ``bad_words_ids``
    (``suppress_ids``) are ruled out of the log-probabilities, as ``transformers``' beam search does, so the other
    tokens keep their probabilities; our default (padding and BOS) is ruled out before normalizing, as our CTranslate2
    export's output bias rules them out."""
    if config.suppress_ids is None:
        return torch.log_softmax(next_token_logits(logits, config), dim=-1)
    return rule_out(torch.log_softmax(logits[:, -1].float(), dim=-1), config.suppress_ids)


def forced_id(config: TransformerConfig, step: int, steps: int) -> int | None:
    """The token forced at output position ``step`` of ``steps``: ``forced_bos_id`` first, ``forced_eos_id`` last."""
    return config.forced_bos_id if step == 0 else config.forced_eos_id if step == steps - 1 else None


def force_token(scores: Tensor, config: TransformerConfig, step: int, steps: int) -> Tensor:
    """``scores (B, V)`` of output position ``step`` of ``steps`` with ``forced_bos_id`` first or ``forced_eos_id``
    last the only token left, scored 0, as ``transformers``' forcing processors do after the decoding controls:
    a minimum length that rules EOS out at the last step leaves the forced EOS."""
    forced = forced_id(config, step, steps)
    if forced is None:
        return scores
    scores = torch.full_like(scores, float("-inf"))
    scores[:, forced] = 0
    return scores


def greedy_token(logits: Tensor, config: TransformerConfig) -> Tensor:
    """Greedy's next token ``(B, 1)`` from a step's logits, without decoding controls or forced tokens."""
    return next_token_logits(logits, config).max(dim=-1, keepdim=True).indices  # faster than argmax on CPU, same ties


def beam_scores(logits: Tensor, config: TransformerConfig, scores: Tensor) -> Tensor:
    """Beam search's candidate scores ``(n, K * V)``: each beam's score (``scores (n, K)``) plus its next token's
    log-probability, without decoding controls or forced tokens."""
    n, k = scores.shape
    return (next_token_log_probs(logits, config).view(n, k, -1) + scores[..., None]).view(n, -1)


Head = Callable[..., Tensor]  # greedy_token or beam_scores: (logits, config, *tensors) -> what a search reads


class CompiledDecode:
    """``model.decode`` compiled by Inductor with the weights frozen into it, for decoding on a CPU.

    Freezing folds the weights into the compiled code as constants, packed once for MKL's matrix products: at
    decoding's few rows per step those products are most of the time. Inductor's C++ wrapper calls the step's kernels
    without Python in between, and it keeps a small elementwise result (an int8 linear's dequantized output, say) in
    a buffer rather than recomputing it inside each loop that reads it. The step attends over the positions written
    only (:meth:`DecoderCache.attend_written`, a dynamic length), but it keeps finished rows, so greedy decoding and
    beam search hand a batch over to the eager cache once half its rows (or sources) have finished. Without decoding
    controls, the step computes what the search reads from its logits too (``head``: greedy's next token, beam
    search's candidate scores). What it gains: see benchmarks/RESULTS.md,
    sections "bench_peers: ours vs Hugging Face BART / Marian and CTranslate2", "`compile=True` on real sentences"
    and "int8 decoding".

    What it costs: each batch size compiles two steps (the first, which fills the cache, and the rest; seconds each),
    for each head it runs (decoding controls run none);
    source lengths are dynamic from the first call, so a new one compiles nothing. Up to 32 compiled steps are
    kept (torch's default keeps 8, then decodes eagerly). Frozen weights cannot follow the model's: a decoding started
    after a parameter or buffer changed in place raises (:meth:`check`) instead of decoding with the old ones (a
    change made through ``.data`` escapes the check). It changes Inductor's settings for the duration of each call:
    one thread at a time. Only :class:`StaticDecoder`'s fixed-shape step uses it (greedy decoding and beam search).
    """

    def __init__(self, model: Transformer) -> None:
        import torch._dynamo.config
        import torch._inductor.config

        if any(p.device.type != "cpu" for p in model.parameters()):
            raise ValueError("CompiledDecode compiles decoding on a CPU: on a GPU, decode with cuda_graph=True")
        # Set while Dynamo traces, not as torch.compile's options: freezing reaches Dynamo's tracing only so. An
        # opcount threshold under the CPU default (50) stores an int8 linear's dequantized output once instead of
        # recomputing it for every key an attention loop reads (benchmarks/RESULTS.md, section "int8 decoding").
        self._settings = (
            torch._inductor.config.patch(freezing=True, cpp_wrapper=True, realize_opcount_threshold=10),
            torch._dynamo.config.patch(recompile_limit=32),
        )
        self.model = model
        self._parameters = [*model.parameters(), *model.buffers()]
        self._versions = self._current()
        self._decode = torch.compile(self._step)

    def _current(self) -> list[tuple[int, int]]:
        return [(p.data_ptr(), p._version) for p in self._parameters]

    def check(self, model: Transformer) -> None:
        """Raises unless this step was compiled from ``model`` with its weights as they are now; once a decoding."""
        if self.model is not model:
            raise ValueError("decode is a CompiledDecode of another model: make one of the model that decodes")
        if self._current() != self._versions:
            raise RuntimeError(
                "the model's weights changed after its decoding was compiled with them frozen in: compile it again "
                "(a new CompiledDecode, or torch_handle.load(..., compile=True) again), or decode without compile"
            )

    def _step(
        self,
        token: Tensor,
        memory: Tensor,
        memory_padding: Tensor,
        cache: DecoderCache,
        head: Head | None,
        *args: Tensor,
    ) -> Tensor:
        logits = self.model.decode(token, memory, memory_padding, cache)
        return logits if head is None else head(logits, self.model.config, *args)

    def __call__(
        self,
        token: Tensor,
        memory: Tensor,
        memory_padding: Tensor,
        cache: DecoderCache,
        head: Head | None = None,
        head_args: tuple[Tensor, ...] = (),
    ) -> Tensor:
        """The logits ``(B, 1, V)`` after ``token``; with ``head``, ``head(logits, model.config, *head_args)``
        instead (:func:`greedy_token`, :func:`beam_scores`), computed inside the compiled step."""
        # One compiled step per batch size: a batch dimension left to turn dynamic (as a second size would) cost
        # most of the gain, measured. Source lengths are dynamic from the first call, at no cost to the step: a job's
        # second length would otherwise compile every step again.
        for tensor in (token, memory, memory_padding, *cache.batched(), *head_args):
            torch._dynamo.mark_static(tensor, 0)
        lengths = [(memory, 1), (memory_padding, 1), (cache.source, 1)] + [
            (t, 2) for _, cross in cache.layers for t in (cross.k, cross.v)
        ]
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
            return self._decode(token, memory, memory_padding, cache, head, *head_args)


class StaticDecoder:
    """The decoder's one-token step over a static cache (:meth:`Transformer.new_cache`), replayed as a CUDA graph.

    A step of a small model is a few hundred kernels of microseconds each, so eagerly the GPU waits on Python
    most of the time; a graph launches the whole step at once. Capture needs fixed shapes and buffers, so rows
    never leave the batch. Off CUDA (or with ``graph=False``) the same static step runs eagerly. The model's
    weights must not change while a decoder is in use, and nothing in its forward pass may communicate.
    ``decode`` replaces ``model.decode`` in the step: a :class:`CompiledDecode` on a CPU. ``rows``: the decoder's
    rows, a multiple of ``memory``'s when groups of them share a memory row (beam search); ``memory``'s by default.
    ``source``: the source ids, under ``copy_attention``. ``head``: each step returns what ``decode``, a
    :class:`CompiledDecode` (or a step with its interface), computes from its logits with it instead of them.
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
        source: Tensor | None = None,
        head: Head | None = None,
    ) -> None:
        self.cache = model.new_cache(capacity, memory_padding, source)
        rows = memory.shape[0] if rows is None else rows
        assert rows % memory.shape[0] == 0, "each memory row serves a group of consecutive decoder rows"
        self.token = torch.full((rows, 1), model.config.bos_id, dtype=torch.long, device=memory.device)
        if head is not None and (decode is None or (graph and memory.is_cuda)):
            raise ValueError("StaticDecoder runs a head in a compiled step only: pass decode, not a CUDA graph")
        decode = model.decode if decode is None else decode
        self.head = head

        def step(*args: Tensor) -> Tensor:
            if head is None:
                return decode(self.token, memory, memory_padding, self.cache)
            return decode(self.token, memory, memory_padding, self.cache, head=head, head_args=args)

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

    def __call__(self, token: Tensor, *head_args: Tensor) -> Tensor:
        """Logits ``(B, 1, V)`` after ``token (B, 1)``, the next position; with ``head``, what it computes from them
        and ``head_args``."""
        if self.graph is None:
            self.token = token
            return self.step(*head_args)
        self.token.copy_(token)
        self.graph.replay()
        assert self.logits is not None
        return self.logits
