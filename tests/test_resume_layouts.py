"""A checkpoint resumed under another strategy than the one that wrote it (:mod:`torch_handle.layouts`): the pairs
that work continue the uninterrupted run, the others stop in one line before any step, having written nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import (
    SHARES_REFERENCE_RUNS,
    STEPS,
    assert_weights_close,
    check,
    checkpoint_weights,
    cli,
    reference_args,
    reference_run,
    train_losses,
)

# The timeout: it may train its reference runs.
pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(1200), SHARES_REFERENCE_RUNS]

RESUME_STEP = 2


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp()


def _checkpoint(strategy: str, base: Path) -> Path:
    return reference_run(strategy, base) / "checkpoints" / f"epoch=0-step={RESUME_STEP}.ckpt"


def _refused(strategy: str, checkpoint: Path, root: Path) -> str:
    """The last line of ``fit --ckpt_path CHECKPOINT`` under ``strategy``, which must fail before any step."""
    run = cli(reference_args(strategy, root, "--ckpt_path", str(checkpoint)))
    assert run.returncode != 0, run.stderr[-3000:]
    assert not list(root.glob("losses.rank*.txt")) and not (root / "checkpoints").exists(), "no step, nothing saved"
    return run.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("writer", ["ddp", "zero1"])
def test_a_checkpoint_resumed_under_fsdp_or_zero2_continues_the_run(writer: str, base: Path, tmp_path: Path) -> None:
    """A DDP ``.ckpt`` under FSDP (weights and Adam's moments, sharded on the way); a ZeRO-1 folder under ZeRO-2
    (the same flat partitions): the losses and weights of the uninterrupted run."""
    resumer = {"ddp": "fsdp", "zero1": "zero2"}[writer]
    reference = reference_run(writer, base)
    check(cli(reference_args(resumer, tmp_path, "--ckpt_path", str(_checkpoint(writer, base)))))
    expected, actual = train_losses(reference), train_losses(tmp_path)
    assert list(actual) == list(range(2 * RESUME_STEP, 2 * STEPS))  # two ranks, a batch each per step
    for index, loss in actual.items():
        assert loss == pytest.approx(expected[index], rel=1e-5), f"batch {index}"
    assert_weights_close(checkpoint_weights(reference), checkpoint_weights(tmp_path), f"{writer} -> {resumer}")


@pytest.mark.parametrize("resumer", ["zero1", "zero2", "zero3"])
def test_a_full_checkpoint_under_zero_is_one_line(resumer: str, base: Path, tmp_path: Path) -> None:
    checkpoint = _checkpoint("ddp", base)
    assert _refused(resumer, checkpoint, tmp_path) == (
        f"error: {checkpoint} is a full checkpoint (DDP or one device), which ZeRO-{resumer[-1]} cannot resume: "
        "resume it with the strategy that wrote it, or with fsdp (which takes its weights and optimizer state over)"
    )


@pytest.mark.parametrize(("writer", "resumer"), [("zero2", "zero3"), ("zero3", "zero1")])
def test_a_zero_folder_under_another_partitioning_is_one_line(
    writer: str, resumer: str, base: Path, tmp_path: Path
) -> None:
    checkpoint = _checkpoint(writer, base)
    assert _refused(resumer, checkpoint, tmp_path) == (
        f"error: {checkpoint} is a ZeRO-{writer[-1]} checkpoint folder, which ZeRO-{resumer[-1]} cannot resume: "
        f"resume it with --config {writer} (test, predict and export read it with any strategy)"
    )
