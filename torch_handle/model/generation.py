"""Greedy decoding over a cached encoder output and a key/value cache, and :func:`generate`, which runs it or beam
search (:mod:`torch_handle.model.beam`).

Decoding takes the model as an argument and uses only its public ``encode``/``decode``/``new_cache``: the
import points one way, generation -> transformer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from torch_handle.model.beam import beam_search
from torch_handle.model.config import TransformerConfig
from torch_handle.model.kernels import decoding_kernels
from torch_handle.model.logits import DecodingControls, StepControls
from torch_handle.model.steps import (
    CompiledDecode,
    StaticDecoder,
    force_token,
    forced_id,
    greedy_token,
    next_token_logits,
)
from torch_handle.model.transformer import DecoderCache, Transformer


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
    source = src if c.copy_attention else None
    if decode is not None:
        decode.check(model)
    if cuda_graph or decode is not None:
        head = greedy_token if decode is not None and controls is None else None  # the compiled step picks it too
        step = StaticDecoder(
            model, memory, memory_padding, max_new_tokens, graph=cuda_graph, decode=decode, source=source, head=head
        )
        handover = None if decode is None else (model, memory, memory_padding)
        return _static_greedy(step, model.config, max_new_tokens, all_done, handover, controls)
    cache = model.new_cache(max_new_tokens, source=source)
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
        if step.head is not None:  # greedy_token's, then the forced token where one is
            token, forced = step(token), forced_id(c, i, max_new_tokens)
            token = token if forced is None else torch.full_like(token, forced)
        else:
            logits = next_token_logits(step(token), c)
            if controls is not None:
                logits = controls.greedy(logits, out, None, i)
            token = force_token(logits, c, i, max_new_tokens).max(dim=-1, keepdim=True).indices
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
