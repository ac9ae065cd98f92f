"""The training objective: label-smoothed cross entropy summed over the target tokens that are not padding.

Sums, not means: the module divides by the tokens of whatever it averages over (an optimizer step across
processes and accumulated batches, a whole evaluation set), so every token weighs the same.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def token_sums(logits: Tensor, labels: Tensor, pad: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Label-smoothed loss and NLL, both summed over the targets that are not ``pad``, and their count.

    One log-softmax serves both: smoothed loss = (1 - eps) * NLL + eps * mean over the vocabulary of -log p, as
    ``F.cross_entropy(label_smoothing=eps)``.
    """
    labels = labels.reshape(-1)
    log_probs = F.log_softmax(logits.float(), dim=-1).view(-1, logits.shape[-1])
    keep = labels != pad
    nll = F.nll_loss(log_probs, labels, ignore_index=pad, reduction="sum")
    smooth = -(log_probs.mean(dim=-1) * keep).sum()
    return (1 - eps) * nll + eps * smooth, nll, keep.sum()


@functools.cache
def compiled_token_sums() -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """:func:`token_sums` compiled (``--model.compile true``): its passes over the ``(tokens, vocabulary)`` logits fuse,
    which saves time and memory at a large vocabulary (see benchmarks/RESULTS.md, section "GPU suite", "What each
    lever gains")."""
    return torch.compile(token_sums)
