"""AdamW's parameter groups and the learning-rate schedule: linear warmup, then cosine decay."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import nn


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on the matrices of linear layers only; embeddings (also when tied to the output layer), norms
    and biases keep theirs.

    Chosen by module, not by ``dim()``, because FSDP hands ``configure_optimizers`` flattened 1-D views. The groups'
    names name their learning rates in the logs (``lr/decay``, ``lr/no_decay``).
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    matrices = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)} - embeddings
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if id(p) in matrices], "weight_decay": weight_decay, "name": "decay"},
        {"params": [p for p in params if id(p) not in matrices], "weight_decay": 0.0, "name": "no_decay"},
    ]


def warmup_cosine(
    step: int, warmup_steps: int, total_steps: Callable[[], int], min_lr_ratio: float, start: float = 1e-3
) -> float:
    """The learning rate at ``step`` as a fraction of the peak: from ``start`` linearly up to 1 over the warmup (at
    most ``total_steps() - 1`` steps), then down a half cosine to ``min_lr_ratio`` at ``total_steps()``.

    ``total_steps`` is called only past step 0: LambdaLR asks for step 0 when it is built, in
    ``configure_optimizers``, and counting the steps there (``estimated_stepping_batches``) would build the train
    loader before a checkpoint is restored, so a resumed epoch would restart at its first batch.
    """
    if step == 0:
        return start
    total = total_steps()
    warmup = max(min(warmup_steps, total - 1), 1)
    if step < warmup:
        return start + (1 - start) * step / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return min_lr_ratio + (1 - min_lr_ratio) * (1 + math.cos(math.pi * progress)) / 2
