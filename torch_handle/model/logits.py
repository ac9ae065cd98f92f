"""Decoding controls: n-gram blocking, repetition penalty, a minimum length and sampling, as ``transformers`` has them.

:func:`process_scores` applies the set controls to one step's scores in the order ``generate`` of ``transformers``
applies its logits processors (repetition penalty, n-gram blocking, minimum new tokens, then, when sampling,
temperature, top-k and top-p), with the same semantics; greedy decoding applies them to the logits, beam search to the
log-probabilities. The decoding loops force a BOS or EOS (:func:`~torch_handle.model.steps.force_token`) after
them all, where ``transformers`` forces after the first three: the forced token is the only one left either way,
sampling or not. Sampling draws with Gumbel noise (the argmax of ``scores + Gumbel`` is a draw from
``softmax(scores)``; the top ``n`` a draw of ``n`` without replacement, as ``torch.multinomial`` draws beam search's
candidates there) made by a counter-based hash of the seed, the source's tokens, the step and the candidate: a source
gets the same output whatever batch, process or device decodes it, with no generator state to carry.
"""

from __future__ import annotations

import dataclasses
import secrets

import torch
from torch import Tensor

_MASK = 0xFFFFFFFF


@dataclasses.dataclass(frozen=True)
class DecodingControls:
    """What shapes each decoding step beyond the model's scores; the defaults change nothing.

    Args:
        no_repeat_ngram_size: No n-gram of this many tokens appears twice in an output (0 = off).
        repetition_penalty: Scores of tokens already in the output are divided by it when positive, multiplied when
            negative (CTRL's penalty; 1 = off, above 1 discourages repeats).
        min_new_tokens: EOS is ruled out until the output holds this many tokens.
        do_sample: Draw each token (greedy decoding), or each step's candidates (beam search), from the scores
            instead of taking the best.
        temperature: Sampling divides the scores by it (1 = off).
        top_k: Sampling keeps the ``top_k`` best tokens only (0 = off).
        top_p: Sampling keeps the fewest best tokens whose probabilities add up to ``top_p`` (1 = off).
        seed: Seeds the draws; the same seed and source give the same output on any batch, process count or
            device. None draws a fresh seed from the operating system at each sampling call (``secrets``), never
            from torch's global generator, so that decoding during training leaves its random stream as it was.
    """

    no_repeat_ngram_size: int = 0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name, valid, rule in (
            ("no_repeat_ngram_size", self.no_repeat_ngram_size >= 0, ">= 0 (0 = off)"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0 (1 = off)"),
            ("min_new_tokens", self.min_new_tokens >= 0, ">= 0"),
            ("temperature", self.temperature > 0, "> 0 (1 = off; greedy decoding is do_sample=False)"),
            ("top_k", self.top_k >= 0, ">= 0 (0 = off)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1] (1 = off)"),
        ):
            if not valid:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)}")
        if not self.do_sample:
            for name, off in (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0)):
                if getattr(self, name) != off:
                    raise ValueError(f"{name}={getattr(self, name)} acts only when sampling: pass do_sample=True too")

    @property
    def active(self) -> bool:
        """Whether any control changes decoding."""
        c = self
        return c.do_sample or c.no_repeat_ngram_size > 0 or c.repetition_penalty != 1 or c.min_new_tokens > 0

    def bind(self, src: Tensor, pad_id: int, bos_id: int, eos_id: int) -> StepControls | None:
        """The controls for one call decoding ``src (B, S)``; None when none is set, so that a step checks one None."""
        if not self.active:
            return None
        if not self.do_sample:
            return StepControls(self, None, bos_id, eos_id)
        seed = self.seed if self.seed is not None else secrets.randbits(62)
        return StepControls(self, _row_keys(src, pad_id, seed), bos_id, eos_id)


def process_scores(controls: DecodingControls, tokens: Tensor, scores: Tensor, eos_id: int, beams: bool) -> Tensor:
    """``scores (R, V)`` of each row's next token after the decoder inputs ``tokens (R, L)`` (``<bos>`` first, as
    ``input_ids`` of an encoder-decoder model in ``transformers``), with the set controls applied in its order.

    ``beams``: the scores are beam search's log-probabilities, where sampling keeps at least two tokens (EOS and
    another), as ``transformers`` keeps for beam search."""
    c = controls
    if c.repetition_penalty != 1:
        seen = scores.gather(1, tokens)
        seen = torch.where(seen < 0, seen * c.repetition_penalty, seen / c.repetition_penalty)
        scores = scores.scatter(1, tokens, seen)  # a token seen twice gets the same value twice
    n = c.no_repeat_ngram_size
    if n > 0 and tokens.shape[1] >= n:
        grams = tokens.unfold(1, n, 1)  # (R, L - n + 1, n): every n-gram so far
        last = tokens[:, tokens.shape[1] - n + 1 :]  # (R, n - 1): the next token ends an n-gram starting with these
        completes = (grams[..., :-1] == last[:, None]).all(dim=-1)  # (R, L - n + 1): n-grams it would repeat
        hits = torch.zeros_like(scores, dtype=torch.int32).scatter_add_(1, grams[..., -1], completes.int())
        scores = scores.masked_fill(hits > 0, float("-inf"))
    if tokens.shape[1] - 1 < c.min_new_tokens:
        scores = scores.clone()
        scores[:, eos_id] = float("-inf")
    if not c.do_sample:
        return scores
    keep = 2 if beams else 1
    if c.temperature != 1:
        scores = scores / c.temperature
    if c.top_k > 0:
        kth = scores.topk(min(max(c.top_k, keep), scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if c.top_p < 1:
        ascending, order = scores.sort(dim=-1)
        below = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - c.top_p  # the least likely tokens, mass <= 1 - p
        below[:, -keep:] = False
        scores = scores.masked_fill(below.scatter(1, order, below), float("-inf"))
    return scores


class StepControls:
    """:class:`DecodingControls` bound to one call's sources (see :meth:`DecodingControls.bind`): what the decoding
    loops call on each step's scores."""

    def __init__(self, controls: DecodingControls, keys: Tensor | None, bos_id: int, eos_id: int) -> None:
        self.controls = controls
        self.keys = keys  # (B,) one hash per source, sampling only
        self.bos_id, self.eos_id = bos_id, eos_id
        self.history = controls.no_repeat_ngram_size > 0 or controls.repetition_penalty != 1

    def greedy(self, logits: Tensor, out: Tensor, rows: Tensor | None, step: int) -> Tensor:
        """Greedy decoding's ``logits (b, V)`` at ``step`` made such that their argmax is the next token: processed,
        plus Gumbel noise when sampling. ``out (B, T)``: the tokens so far; ``rows``: the batch rows in ``logits``,
        all when None."""
        tokens = out[:, :step] if rows is None else out[rows, :step]
        if self.history:  # what the processors read: <bos> first, whose score is -inf already
            tokens = torch.cat([tokens.new_full((tokens.shape[0], 1), self.bos_id), tokens], dim=1)
        else:  # only its length counts
            tokens = tokens.new_empty(tokens.shape[0], step + 1)
        logits = process_scores(self.controls, tokens, logits, self.eos_id, beams=False)
        if self.keys is None:
            return logits
        keys = self.keys if rows is None else self.keys[rows]
        return logits + _gumbel(keys, step, logits.shape[-1]).to(logits.dtype)

    def beam(self, log_probs: Tensor, tokens: Tensor) -> Tensor:
        """Beam search's ``log_probs (n*K, V)`` after the decoder inputs ``tokens (n*K, L)`` (``<bos>`` first),
        processed."""
        return process_scores(self.controls, tokens, log_probs, self.eos_id, beams=True)

    def candidates(self, total: Tensor, count: int, step: int, sources: list[int]) -> tuple[Tensor, Tensor]:
        """``count`` candidates of each source's ``total (n, K*V)`` scores at ``step``, as ``topk`` returns them: the
        best, or when sampling a draw without replacement, best first. ``sources``: the batch rows of ``total``."""
        if self.keys is None:
            return total.topk(count, dim=-1)
        keys = self.keys[torch.tensor(sources, device=self.keys.device)]
        ids = (total + _gumbel(keys, step, total.shape[-1]).to(total.dtype)).topk(count, dim=-1).indices
        scores, order = total.gather(1, ids).sort(dim=-1, descending=True)
        return scores, ids.gather(1, order)


def _mix(x: Tensor) -> Tensor:
    """A 32-bit integer hash of int64 values: each product stays below 2**59, so none overflows."""
    x = x & _MASK
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK
    return (x >> 16) ^ x


def _row_keys(src: Tensor, pad_id: int, seed: int) -> Tensor:
    """``(B,)``: a hash of the seed and each row's tokens and their positions, padding left out: a source's key does
    not depend on the batch it is padded into."""
    positions = torch.arange(src.shape[1], device=src.device)
    tokens = (_mix(_mix(src + 1) + positions) * (src != pad_id)).sum(dim=1) & _MASK  # (B,)
    halves = torch.tensor([seed & _MASK, (seed >> 32) & _MASK], device=src.device)
    return _mix(tokens ^ _mix(halves[0] ^ _mix(halves[1])))


def _gumbel(keys: Tensor, step: int, candidates: int) -> Tensor:
    """``(len(keys), candidates)`` standard Gumbel noise, a function of each key, the step and the candidate."""
    base = _mix(keys ^ _mix(torch.tensor(step + 0x9E3779B9, device=keys.device)))  # (b,)
    bits = _mix(base[:, None] + torch.arange(candidates, device=keys.device)) >> 8  # (b, C), below 2**24
    uniform = (bits.float() + 0.5) / 2.0**24  # in (0, 1), exact in float32
    return -torch.log(-torch.log(uniform))
