"""Greedy and beam-search decoding over a cached encoder output and a key/value cache.

Decoding takes the model as an argument and uses only its public ``encode``/``decode``/``new_cache``: the
import points one way, generation -> transformer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from torch_handle.model.transformer import Transformer


def next_token_logits(logits: Tensor, pad_id: int, bos_id: int) -> Tensor:
    """Last-position logits ``(B, V)`` with padding and BOS ruled out: neither is ever a next token."""
    logits = logits[:, -1].float()
    logits[:, [pad_id, bos_id]] = float("-inf")
    return logits


def greedy_search(
    model: Transformer, src: Tensor, max_new_tokens: int, all_done: Callable[[bool], bool] = bool
) -> Tensor:
    """Pick the most likely token at every step; stop once every row has produced EOS.

    ``all_done`` turns this process's "finished" into everyone's (see :meth:`Transformer.generate`).
    """
    c = model.config
    memory, memory_padding = model.encode(src), model.memory_padding(src)
    cache = model.new_cache(max_new_tokens)
    token = torch.full((src.shape[0], 1), c.bos_id, dtype=torch.long, device=src.device)
    finished = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
    out = []
    for _ in range(max_new_tokens):
        logits = next_token_logits(model.decode(token, memory, memory_padding, cache), c.pad_id, c.bos_id)
        token = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        out.append(token.masked_fill(finished[:, None], c.pad_id))
        finished |= token[:, 0] == c.eos_id
        if all_done(bool(finished.all())):
            break
    return torch.cat(out, dim=1)


def beam_search(
    model: Transformer,
    src: Tensor,
    max_new_tokens: int,
    num_beams: int,
    length_penalty: float,
    all_done: Callable[[bool], bool] = bool,
) -> Tensor:
    """Keep the ``num_beams`` best prefixes per source; a hypothesis scores ``log p / length ** length_penalty``.

    A source is done once it holds ``num_beams`` finished hypotheses (early stopping); at
    ``max_new_tokens`` the open beams are finished as they stand.
    """
    c = model.config
    b, k = src.shape[0], num_beams
    memory = model.encode(src).repeat_interleave(k, dim=0)  # (B*K, S', C)
    memory_padding = model.memory_padding(src).repeat_interleave(k, dim=0)
    cache = model.new_cache(max_new_tokens)
    tokens = torch.full((b * k, 1), c.bos_id, dtype=torch.long, device=src.device)
    scores = torch.zeros(b, k, device=src.device)
    scores[:, 1:] = float("-inf")  # all beams start equal: expand only the first
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(b)]
    done = [False] * b

    def finish(row: int, beam_tokens: list[int], score: float) -> None:
        finished[row].append((score / len(beam_tokens) ** length_penalty, beam_tokens))

    for step in range(max_new_tokens):
        logits = model.decode(tokens[:, -1:], memory, memory_padding, cache)
        logp = torch.log_softmax(next_token_logits(logits, c.pad_id, c.bos_id), dim=-1)  # (B*K, V)
        vocab = logp.shape[-1]
        total = (logp.view(b, k, vocab) + scores[..., None]).view(b, k * vocab)
        top_scores, top_ids = total.topk(2 * k, dim=-1)  # (B, 2K)
        top_beams, top_tokens = (top_ids // vocab).tolist(), (top_ids % vocab).tolist()
        top_scores_list = top_scores.tolist()
        next_beam = torch.zeros(b, k, dtype=torch.long)
        next_token = torch.full((b, k), c.pad_id, dtype=torch.long)
        next_score = torch.full((b, k), float("-inf"))
        prefixes = tokens[:, 1:].tolist()
        for row in range(b):
            if done[row]:
                continue
            kept = 0
            for rank, (beam, token, score) in enumerate(zip(top_beams[row], top_tokens[row], top_scores_list[row])):
                if token == c.eos_id:
                    if rank < k:
                        finish(row, prefixes[row * k + beam] + [token], score)
                    continue
                next_beam[row, kept], next_token[row, kept], next_score[row, kept] = beam, token, score
                kept += 1
                if kept == k:
                    break
            done[row] = len(finished[row]) >= k
        if all_done(all(done)):
            break
        index = (torch.arange(b)[:, None] * k + next_beam).view(-1).to(src.device)
        cache.reorder(index)
        tokens = torch.cat([tokens.index_select(0, index), next_token.view(-1, 1).to(src.device)], dim=1)
        scores = next_score.to(src.device)
        if step == max_new_tokens - 1:
            prefixes, final = tokens[:, 1:].tolist(), scores.tolist()
            for row in range(b):
                if not done[row]:
                    for beam in range(k):
                        finish(row, prefixes[row * k + beam], final[row][beam])
    best = [max(hyps, key=lambda h: h[0])[1] for hyps in finished]
    out = torch.full((b, max(map(len, best))), c.pad_id, dtype=torch.long)
    for row, hyp in enumerate(best):
        out[row, : len(hyp)] = torch.tensor(hyp)
    return out.to(src.device)


@torch.no_grad()
def generate(
    model: Transformer,
    src: Tensor,
    max_new_tokens: int,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    all_done: Callable[[bool], bool] = bool,
) -> Tensor:
    """Generated ids ``(B, L)`` without BOS, ``pad_id`` after EOS.

    The encoder runs once; the decoder uses a key/value cache. ``num_beams > 1`` runs beam search.
    ``all_done`` maps "this process is done" to "every process is done": where forward passes communicate
    (ZeRO-3 and FSDP gather parameters in them), processes that finish early must keep stepping in
    lockstep until all have finished, so the caller passes a reduction over processes here.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if num_beams < 1:
        raise ValueError(f"num_beams must be >= 1, got {num_beams}")
    if num_beams == 1:
        return greedy_search(model, src, max_new_tokens, all_done)
    return beam_search(model, src, max_new_tokens, num_beams, length_penalty, all_done)
