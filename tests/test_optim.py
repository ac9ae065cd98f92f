"""The learning-rate schedule at its edge (the module's tests cover the usual case and the parameter groups)."""

from __future__ import annotations

import pytest

from torch_handle.optim import warmup_cosine


def test_a_run_shorter_than_its_warmup_still_reaches_the_peak_and_ends_at_the_floor() -> None:
    warmup, total, floor = 100, 20, 0.02
    values = [warmup_cosine(step, warmup, lambda: total, floor) for step in range(total + 1)]
    assert values[0] == 1e-3 and values[total - 1] == 1.0  # the warmup is cut to total - 1 steps
    assert all(a < b for a, b in zip(values[: total - 1], values[1:total]))
    assert values[total] == pytest.approx(floor)
    assert warmup_cosine(2 * total, warmup, lambda: total, floor) == pytest.approx(floor)  # past the end it stays there
