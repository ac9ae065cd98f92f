"""Beam search over a cached encoder output and a key/value cache, eager or over a static cache (compiled step or CUDA
graph) until half the sources have finished."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from torch_handle.model.logits import StepControls
from torch_handle.model.steps import (
    CompiledDecode,
    StaticDecoder,
    beam_scores,
    force_token,
    forced_id,
    next_token_log_probs,
)
from torch_handle.model.transformer import Transformer


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
    source = src if c.copy_attention else None
    static = None
    if decode is not None:
        decode.check(model)
    if decode is not None or cuda_graph:
        head = beam_scores if decode is not None and controls is None else None  # computed in the compiled step
        static = StaticDecoder(
            model,
            memory,
            memory_padding,
            max_new_tokens,
            graph=cuda_graph,
            decode=decode,
            rows=b * k,
            source=source,
            head=head,
        )
    cache = model.new_cache(max_new_tokens, source=source) if static is None else static.cache
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
        if static is not None and static.head is not None:  # beam_scores, then the forced token where one is
            total = static(tokens[:, -1:], scores)
            vocab, forced = total.shape[-1] // k, forced_id(c, step, max_new_tokens)
            if forced is not None:
                total = torch.full_like(total, float("-inf"))
                total.view(n, k, vocab)[:, :, forced] = scores
        else:
            if static is None:
                logits = model.decode(tokens[:, -1:], memory, memory_padding, cache)
            else:
                logits = static(tokens[:, -1:].contiguous())
            logp = next_token_log_probs(logits, c)  # (n*K, V)
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
