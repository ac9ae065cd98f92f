"""The process's random states (torch, CUDA, Python, NumPy) as a checkpoint can hold them.

Lightning's ``_collect_rng_states`` returns NumPy's state with an ``ndarray`` in it, which
``torch.load(weights_only=True)`` refuses; here that array travels as a tensor, so checkpoints stay loadable
without running code.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states


def get_rng_states() -> dict[str, Any]:
    """This process's random states, made of tensors and plain Python values only."""
    states = _collect_rng_states()
    kind, keys, pos, has_gauss, cached_gaussian = states["numpy"]
    states["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached_gaussian)
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restores what :func:`get_rng_states` returned."""
    kind, keys, pos, has_gauss, cached_gaussian = states["numpy"]
    _set_rng_states({**states, "numpy": (kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached_gaussian)})
