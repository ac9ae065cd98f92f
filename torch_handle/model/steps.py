"""One decoding step over a key/value cache, run eagerly, compiled (:class:`CompiledDecode`) or replayed as a CUDA graph
(:class:`StaticDecoder`), and what greedy decoding and beam search both do to its logits.
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from torch_handle.model.attention import MultiHeadAttention
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
    """``model.decode`` compiled ahead of time by AOTInductor with the weights frozen in, for decoding on a CPU.

    Each step is exported (``torch.export``) and compiled into a shared library that runs it without Python and
    without ``torch.compile``'s per-call work (guards, wrappers). Freezing folds the weights into it as constants,
    packed once for MKL's matrix products: at decoding's few rows per step those products are most of the time.
    Inductor keeps a small elementwise result (an int8 linear's dequantized output, say) in a buffer rather than
    recomputing it inside each loop that reads it. The step attends over the positions written only
    (:meth:`DecoderCache.attend_written`, a dynamic length), but it keeps finished rows, so greedy decoding and beam
    search hand a batch over to the eager cache once half its rows (or sources) have finished. Without decoding
    controls, the step computes what the search reads from its logits too (``head``: greedy's next token, beam
    search's candidate scores). What it gains and costs: see benchmarks/RESULTS.md, sections "Stop 54: the step
    compiled ahead of time by AOTInductor" and "Stop 55: one compiled step per batch size".

    What it costs: each batch size compiles one step (seconds), for each head it runs (decoding controls run none) and
    each number of new tokens; source lengths and the window are dynamic, so neither compiles anything. The step serves
    every position because the cross-attention keys and values are computed eagerly first, once a decoding (and the
    self-attention buffers allocated). Up to :attr:`LIMIT` compiled steps are kept, then new ones decode eagerly. Frozen
    weights cannot follow the model's: a decoding started after a parameter or buffer changed in place raises
    (:meth:`check`) instead of decoding with the old ones (a change made through ``.data`` escapes the check). Only
    :class:`StaticDecoder`'s fixed-shape step uses it (greedy decoding and beam search).
    """

    LIMIT = 32

    def __init__(self, model: Transformer) -> None:
        if any(p.device.type != "cpu" for p in model.parameters()):
            raise ValueError("CompiledDecode compiles decoding on a CPU: on a GPU, decode with cuda_graph=True")
        if any(isinstance(m, MultiHeadAttention) and m.backend == "flex" for m in model.modules()):
            raise ValueError(
                "CompiledDecode does not compile flex attention: load the model with attention_backend='sdpa'"
            )
        self.model = model
        self._parameters = [*model.parameters(), *model.buffers()]
        self._versions = self._current()
        self._steps: dict[tuple[object, ...], Callable[..., Any]] = {}

    @property
    def compiled(self) -> int:
        """How many steps it has compiled."""
        return len(self._steps)

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
        assert cache.position is not None and cache.cross_spec is not None, "the step runs over a static cache"
        if cache.cross_spec.key_padding is None:  # a batch without padding: the same step, not one of its own
            cache.cross_spec = dataclasses.replace(cache.cross_spec, key_padding=memory_padding)
        cache.attend_written(int(cache.position))  # a host read, on a CPU: attend over those positions only
        if cache.layers[0][1].k is None:
            with torch.no_grad():
                _fill(self.model, cache, memory, token.shape[0])
        # The compiled code reads each input with the strides it was exported with (it checks none): those it does not
        # write are made contiguous here, those it writes (the position, keys and values) are so from _fill.
        read = [t.contiguous() for t in (token, memory, memory_padding)]
        inputs: list[Tensor | None] = [*read, *_cache_tensors(cache), *(t.contiguous() for t in head_args)]
        present = tuple(t is not None for t in inputs)
        # A step per batch size: a batch dimension left dynamic cost most of the gain, measured.
        key = (head, token.shape[0], memory.shape[0], memory.shape[1] < 2, memory.dtype, cache.capacity, present)
        step = self._steps.get(key)
        if step is None and len(self._steps) < self.LIMIT:
            step = self._steps[key] = self._compile(inputs, cache, head)
        if step is not None:
            return step([t for t in inputs if t is not None])
        with torch.no_grad():
            logits = self.model.decode(token, memory, memory_padding, cache)
        return logits if head is None else head(logits, self.model.config, *head_args)

    def _compile(self, inputs: list[Tensor | None], cache: DecoderCache, head: Head | None) -> Any:
        """Exports the step over these inputs, the source and window lengths dynamic, and compiles it."""
        import torch._inductor

        step = _Step(self.model, cache, head, [t is not None for t in inputs])
        source = torch.export.Dim("source", min=2)
        # (B, S): memory (B, S, C), its padding, the cross-attention's key padding, the source ids; (B, H, S, D): the
        # cross-attention's keys and values.
        lengths = [(1, 1), (2, 1), (_FIRST + 2, 1), (_FIRST + 6, 1)]
        lengths += [(_FIRST + _STATE + 4 * layer + i, 2) for layer in range(step.layers) for i in (2, 3)]
        dims: list[dict[int, Any] | None] = [None] * len(inputs)
        for i, dim in lengths:
            tensor = inputs[i]
            if tensor is not None and tensor.shape[dim] >= 2:
                dims[i] = {dim: source}
        if cache.capacity > 1:  # the window (W,): 1 to the capacity, never the buffers' spare position
            dims[_FIRST + 1] = {0: torch.export.Dim("window", min=1, max=cache.capacity)}
            inputs = [*inputs]
            inputs[_FIRST + 1] = torch.arange(2)  # an example of length 1 would be specialized on
        tensors = [t for t in inputs if t is not None]
        shapes = [d for t, d in zip(inputs, dims, strict=True) if t is not None]
        with torch.no_grad(), tempfile.TemporaryDirectory(prefix="torch-handle-decode-") as folder:
            program = torch.export.export(step, (tensors,), dynamic_shapes=(shapes,))
            package = torch._inductor.aoti_compile_and_package(
                program,
                package_path=f"{folder}/step.pt2",
                # An opcount threshold under the CPU default (50) stores an int8 linear's dequantized output once
                # instead of recomputing it for every key an attention loop reads (benchmarks/RESULTS.md, section
                # "int8 decoding").
                inductor_configs={"freezing": True, "realize_opcount_threshold": 10},
            )
            return torch._inductor.aoti_load_package(package)


_FIRST = 3  # the step's inputs: token, memory and its padding, then the static cache's tensors, then the head's
_STATE = 7  # the static cache's tensors before its layers' (see _cache_tensors)


def _cache_tensors(cache: DecoderCache) -> list[Tensor | None]:
    """A static cache's tensors in a fixed order: its position, window, cross-attention key padding, RoPE angles,
    relative position bias and source ids (each may be None), then each layer's self and cross keys and values."""
    assert cache.cross_spec is not None
    cos, sin = (None, None) if cache.rope is None else cache.rope
    read = [cache.cross_spec.key_padding, cos, sin, cache.bias, cache.source]  # contiguous: see CompiledDecode
    fixed = [cache.position, cache.window, *(t if t is None else t.contiguous() for t in read)]
    return fixed + [t for self_cache, cross in cache.layers for t in (self_cache.k, self_cache.v, cross.k, cross.v)]


def _fill(model: Transformer, cache: DecoderCache, memory: Tensor, rows: int) -> None:
    """What the first step would do before it attends, done eagerly, so that one compiled step serves every position:
    each layer's cross-attention keys and values of ``memory``, and its self-attention buffers for ``rows`` rows. The
    keys and values are made contiguous: the step reads them faster so, and in the layout it was exported with."""
    for layer, (self_cache, cross) in zip(model.decoder_layers, cache.layers, strict=True):
        k, v = layer.cross_attn.memory_kv(memory)
        cross.k, cross.v, cross.length = k.contiguous(), v.contiguous(), k.shape[-2]
        self_cache.allocate(k, rows, cache.capacity)


def _fours(tensors: Sequence[Tensor | None]) -> list[Sequence[Tensor | None]]:
    """Each layer's self-attention keys and values and cross-attention keys and values, from them all in a row."""
    return [tensors[i : i + 4] for i in range(0, len(tensors), 4)]


class _Step(nn.Module):
    """One step of :class:`CompiledDecode` as a module to export: the cache rebuilt from its tensors, the model held
    unregistered, so that its weights are constants to freeze (and the eager int8 linears' packed weights, which
    export cannot hold, are never traced)."""

    def __init__(self, model: Transformer, cache: DecoderCache, head: Head | None, present: list[bool]) -> None:
        super().__init__()
        self.__dict__["model"] = model
        assert cache.cross_spec is not None
        self.layers, self.capacity = len(cache.layers), cache.capacity
        self.cross_spec = dataclasses.replace(cache.cross_spec, key_padding=None, built={})  # its other fields
        self.head, self.present = head, present
        self.head_args = len(present) - _FIRST - _STATE - 4 * self.layers

    def forward(self, tensors: list[Tensor]) -> Tensor:
        given = iter(tensors)
        inputs = [next(given) if p else None for p in self.present]
        token, memory, memory_padding = inputs[:_FIRST]
        position, window, key_padding, cos, sin, bias, source = inputs[_FIRST : _FIRST + _STATE]
        assert token is not None and memory is not None and memory_padding is not None
        cache = DecoderCache(self.layers, self.capacity, position, source)
        cache.rope = None if cos is None or sin is None else (cos, sin)
        cache.bias, cache.window = bias, window
        cache.cross_spec = dataclasses.replace(self.cross_spec, key_padding=key_padding, built={})
        held = inputs[_FIRST + _STATE : len(inputs) - self.head_args]
        for (self_cache, cross), (k, v, cross_k, cross_v) in zip(cache.layers, _fours(held), strict=True):
            self_cache.k, self_cache.v, self_cache.window, cross.k, cross.v = k, v, window, cross_k, cross_v
            assert cross_k is not None
            cross.length = cross_k.shape[-2]
        model = self.__dict__["model"]
        logits = model.decode(token, memory, memory_padding, cache)
        head_args = [t for t in inputs[len(inputs) - self.head_args :] if t is not None]
        return logits if self.head is None else self.head(logits, model.config, *head_args)


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
