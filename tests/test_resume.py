"""Resuming mid-epoch, from a checkpoint or after SIGKILL, continues exactly as an uninterrupted run."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest.mock import Mock, PropertyMock

import pytest
import torch
from conftest import tiny_config
from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeedStrategy
from lightning.pytorch.strategies import FSDPStrategy as LightningFSDPStrategy
from lightning.pytorch.strategies import Strategy

from tests.helpers import (
    ROOT,
    RUN_TIMEOUT,
    SHARES_REFERENCE_RUNS,
    STEPS,
    STRATEGY_CONFIGS,
    check,
    cli,
    csv_logger,
    env,
    fit_args,
    logged,
    reference_args,
    reference_run,
    train_losses,
    wait_for,
)
from torch_handle.data.resume import finish_saved_epoch
from torch_handle.export import read_checkpoint
from torch_handle.module import Seq2SeqModule
from torch_handle.strategies import DeepSpeedStrategy, FSDPStrategy

RESUME_STEP = 2  # of 15 batches per rank and epoch: mid-epoch
TOLERANCE = 1e-6  # a resumed run repeats the same float operations; only the restored state could differ


def assert_same_run(resumed: Path, reference: Path, first_step: int) -> None:
    """Losses from optimizer step ``first_step`` on and the final weights of two runs agree."""
    expected, actual = train_losses(reference), train_losses(resumed)
    assert list(actual) == list(range(2 * first_step, 2 * STEPS))  # two ranks, a batch each per step
    for index, loss in actual.items():
        assert loss == pytest.approx(expected[index], abs=TOLERANCE), f"batch {index}"
    want, _, _ = read_checkpoint(reference / "checkpoints" / "last.ckpt")
    got, _, _ = read_checkpoint(resumed / "checkpoints" / "last.ckpt")
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=TOLERANCE, rtol=0, msg=name)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", list(STRATEGY_CONFIGS))
@SHARES_REFERENCE_RUNS
def test_resume_mid_epoch_matches_the_uninterrupted_run(strategy: str, base: Path, tmp_path: Path) -> None:
    reference = reference_run(strategy, base)
    checkpoint = reference / "checkpoints" / f"epoch=0-step={RESUME_STEP}.ckpt"
    check(cli(reference_args(strategy, tmp_path, "--ckpt_path", str(checkpoint))))
    assert_same_run(tmp_path, reference, RESUME_STEP)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp"])  # a file; DeepSpeed's and FSDP's folders
@SHARES_REFERENCE_RUNS
def test_a_moved_run_folder_resumes_into_its_own_last_checkpoint(strategy: str, base: Path, tmp_path: Path) -> None:
    """A run folder renamed or copied elsewhere, resumed from one of its own checkpoints, goes on writing its
    ``last.ckpt``, which ``test`` and ``predict`` read: Lightning dropped the paths it had recorded under the old
    name and wrote ``last-v1.ckpt`` beside the finished run's."""
    reference = reference_run(strategy, base)
    moved = tmp_path / "moved"
    shutil.copytree(reference, moved)
    last = moved / "checkpoints" / "last.ckpt"
    copied = max(path.stat().st_mtime_ns for path in [last, *last.rglob("*")])
    checkpoint = moved / "checkpoints" / f"epoch=0-step={RESUME_STEP}.ckpt"
    check(cli(reference_args(strategy, moved, "--ckpt_path", str(checkpoint))))
    assert sorted(path.name for path in last.parent.glob("last*")) == ["last.ckpt"]
    assert min(path.stat().st_mtime_ns for path in [last, *last.rglob("*")]) > copied  # rewritten, file by file
    want, _, _ = read_checkpoint(reference / "checkpoints" / "last.ckpt")
    got, _, _ = read_checkpoint(last)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=TOLERANCE, rtol=0, msg=name)


@pytest.mark.slow
@pytest.mark.distributed
@SHARES_REFERENCE_RUNS
def test_sigkill_then_ckpt_path_last_ends_with_the_uninterrupted_weights(base: Path, tmp_path: Path) -> None:
    # SlowDown makes every step after step 2 last a second, so the kill lands mid-epoch, after a checkpoint.
    command = [
        sys.executable,
        "cli.py",
        *reference_args("ddp", tmp_path, "--trainer.callbacks+=tests.helpers.SlowDown"),
    ]
    with (tmp_path / "killed.log").open("w") as log:
        run = subprocess.Popen(command, cwd=ROOT, env=env(), start_new_session=True, stdout=log, stderr=log)
    try:
        wait_for(tmp_path / "checkpoints" / "last.ckpt", run, timeout=RUN_TIMEOUT)
    finally:
        os.killpg(run.pid, signal.SIGKILL)  # both ranks: rank 1 is a child of rank 0
        run.wait(timeout=30)
    assert run.returncode == -signal.SIGKILL
    resumed = subprocess.run(
        [*command, "--ckpt_path", "last"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=RUN_TIMEOUT
    )
    check(resumed)
    want, _, _ = read_checkpoint(reference_run("ddp", base) / "checkpoints" / "last.ckpt")
    got, _, _ = read_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=TOLERANCE, rtol=0, msg=name)


@pytest.mark.parametrize(
    ("strategy", "lightning_strategy"),
    [(DeepSpeedStrategy(stage=2), LightningDeepSpeedStrategy), (FSDPStrategy(), LightningFSDPStrategy)],
    ids=["deepspeed", "fsdp"],
)
def test_an_interrupted_sharded_save_leaves_no_checkpoint(
    strategy: Strategy, lightning_strategy: type[Strategy], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed and FSDP write a folder file by file; a save that dies half-way must not look like a checkpoint."""

    def write_half_then_die(self: Strategy, checkpoint: dict, filepath: Path, *args: object) -> None:
        Path(filepath, "checkpoint").mkdir(parents=True)
        Path(filepath, "latest").write_text("checkpoint")
        Path(filepath, ".metadata").write_text("")
        raise KeyboardInterrupt

    monkeypatch.setattr(lightning_strategy, "save_checkpoint", write_half_then_die)
    monkeypatch.setattr(strategy, "broadcast", lambda obj, src=0: obj)
    monkeypatch.setattr(strategy, "barrier", lambda name=None: None)
    final = tmp_path / "last.ckpt"
    with pytest.raises(KeyboardInterrupt):
        strategy.save_checkpoint({}, final)
    assert not final.exists()
    assert [p.name for p in tmp_path.iterdir()] == [".last.ckpt.partial"]


# --- the shipped demo config, with dropout, max_epochs and validation: killed or preempted mid-epoch -------------

SAVE_EVERY = 5  # optimizer steps; the demo's first validation (and val/loss) comes at the end of epoch 0
DEMO_DEVICES = {1: ["--trainer.accelerator", "cpu", "--trainer.devices", "1"], 2: ["--config", "configs/ddp.yaml"]}


def demo_args(devices: int, root: Path) -> list[str]:
    """The command a user would rerun unchanged: demo config, dropout on, two epochs, validation each epoch."""
    return [
        "fit", "--config", "configs/demo.yaml", *DEMO_DEVICES[devices], "--trainer.accelerator", "cpu",
        *fit_args(root)[1:],
        "--trainer.logger", "true",  # the demo config's LearningRateMonitor needs one
        "--model.transformer.dropout", "0.1",
        "--trainer.max_epochs", "2",
        "--trainer.limit_val_batches", "2",
        "--checkpoint.every_n_train_steps", str(SAVE_EVERY),
        "--trainer.callbacks+=tests.fault_injection.InjectSignal",
    ]  # fmt: skip


def interrupted(args: list[str], **fault: str) -> subprocess.CompletedProcess:
    """Runs ``cli.py ARGS`` in its own process group (the injected SIGKILL takes the whole group)."""
    return subprocess.run(
        [sys.executable, "cli.py", *args],
        cwd=ROOT,
        env=env(**fault),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        start_new_session=True,
    )


def weights(root: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(root / "checkpoints" / "last.ckpt")[0]


def logging_step(root: Path) -> int:
    """The step TensorBoard's curves are drawn against, as the run ended (Lightning's ``_batches_that_stepped``)."""
    state = torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    return state["loops"]["fit_loop"]["epoch_loop.state_dict"]["_batches_that_stepped"]


def batches_run(root: Path) -> int:
    return sum(len(path.read_text().splitlines()) for path in root.glob("losses.rank*.txt"))


DEVICES = [1, pytest.param(2, marks=pytest.mark.distributed)]
_demo_references: dict[int, Path] = {}


def demo_reference(devices: int, base: Path) -> Path:
    """The uninterrupted run of :func:`demo_args` on ``devices`` processes, trained once per test session."""
    if devices not in _demo_references:
        root = base / f"demo-reference-{devices}"
        check(cli(demo_args(devices, root)))
        _demo_references[devices] = root
    return _demo_references[devices]


@pytest.mark.slow
@pytest.mark.parametrize("devices", DEVICES)
def test_sigkill_mid_epoch_resumes_bit_identically_with_dropout(devices: int, base: Path, tmp_path: Path) -> None:
    reference = demo_reference(devices, base)
    want, total = weights(reference), batches_run(reference)
    assert total > 4 * SAVE_EVERY * devices  # two epochs, so the kill lands mid-epoch 0

    # SIGKILL at step 7: the job dies with no chance to save; step 5's save is the one to continue from. The killed
    # run collates in two loader workers (as configs/multi30k_gpu.yaml does), which prefetch past what was trained.
    killed, workers = tmp_path / "killed", ["--data.init_args.num_workers", "2"]
    run = interrupted([*demo_args(devices, killed), *workers], TORCH_HANDLE_TEST_SIGKILL_AT_STEP="7")
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
    before = batches_run(killed)
    check(cli([*demo_args(devices, killed), *workers, "--ckpt_path", "last"]))
    assert batches_run(killed) - before == total - SAVE_EVERY * devices  # resumed at step 5, not from scratch
    for name, tensor in want.items():
        assert torch.equal(weights(killed)[name], tensor), name
    assert logging_step(killed) == logging_step(reference)


@pytest.mark.slow
@pytest.mark.parametrize("devices", DEVICES)
@pytest.mark.parametrize(("stop", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_sigterm_and_ctrl_c_mid_epoch_save_then_resume_bit_identically_with_dropout(
    stop: signal.Signals, status: int, devices: int, base: Path, tmp_path: Path
) -> None:
    """SIGTERM (preemption: to rank 0 alone) or SIGINT (Ctrl-C: to the whole process group) at step 8: every process
    saves at the end of that step, then the job exits with the signal's shell status and one line."""
    reference = demo_reference(devices, base)
    want, total = weights(reference), batches_run(reference)
    stopped = tmp_path / "stopped"
    run = interrupted(demo_args(devices, stopped), **{f"TORCH_HANDLE_TEST_{stop.name}_AT_STEP": "8"})
    assert run.returncode == status, run.stderr[-3000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith("stopped by")]
    assert lines == [f"stopped by {stop.name} at step 8: saved {stopped}/checkpoints/last.ckpt; rerun the same "
                     "command with --ckpt_path last to continue"]  # fmt: skip
    assert torch.load(stopped / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 8
    check(cli([*demo_args(devices, stopped), "--ckpt_path", "last"]))
    assert batches_run(stopped) == total  # steps 1-8 once, then 9 on: nothing repeated, nothing skipped
    for name, tensor in want.items():
        assert torch.equal(weights(stopped)[name], tensor), name
    assert logging_step(stopped) == logging_step(reference)


@pytest.mark.slow
def test_the_step_a_sigterm_stops_at_is_logged(tmp_path: Path) -> None:
    """Lightning logs a step's metrics after its batch-end hooks, where the stop is taken: the last trained step
    reached the checkpoint but not the loggers."""
    run = interrupted([*demo_args(1, tmp_path), *csv_logger(tmp_path)], TORCH_HANDLE_TEST_SIGTERM_AT_STEP="4")
    assert run.returncode == 143, run.stderr[-3000:]
    assert len(logged(tmp_path, "train/loss")) == 4


@pytest.mark.slow
@pytest.mark.parametrize("devices", DEVICES)
def test_a_second_ctrl_c_stops_every_process_at_once(devices: int, tmp_path: Path) -> None:
    """The first Ctrl-C waits for the end of the step (a minute here); the second ends the job without waiting."""
    slow = '{"class_path": "tests.helpers.SlowDown", "init_args": {"after_step": 1, "seconds": 60}}'
    log_path = tmp_path / "run.log"
    with log_path.open("w") as log:
        run = subprocess.Popen(
            [sys.executable, "cli.py", *demo_args(devices, tmp_path), f"--trainer.callbacks+={slow}"],
            cwd=ROOT,
            env=env(),
            start_new_session=True,
            stdout=log,
            stderr=log,
        )
    try:
        wait_for(tmp_path / "losses.rank0.txt", run, timeout=RUN_TIMEOUT)  # in step 1's sleep, every process
        os.killpg(run.pid, signal.SIGINT)
        wait_for_line(
            log_path, "Ctrl-C: saving at the end of this step, then stopping; Ctrl-C again stops at once", run
        )
        time.sleep(1)
        assert run.poll() is None, log_path.read_text()[-3000:]  # waiting for the end of the step
        os.killpg(run.pid, signal.SIGINT)
        assert run.wait(timeout=10) == -signal.SIGINT
        deadline = time.monotonic() + 10
        while group_members(run.pid):  # the other process too
            assert time.monotonic() < deadline, f"still running: {group_members(run.pid)}"
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()


def wait_for_line(path: Path, line: str, process: subprocess.Popen, timeout: float = 30) -> None:
    """Polls until the file ``path`` holds ``line``; fails if ``process`` ends first or time runs out."""
    deadline = time.monotonic() + timeout
    while line not in path.read_text().splitlines():
        assert process.poll() is None, f"run ended (exit {process.returncode})\n{path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, path.read_text()[-3000:]
        time.sleep(0.1)


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
            if fields[0] != "Z" and int(fields[2]) == pgid:
                members.append(int(stat.parent.name))
    return members


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("until", [["--trainer.max_steps", "20"], []], ids=["max_steps", "max_epochs"])
def test_resume_from_an_epoch_end_checkpoint_trains_the_next_epoch_exactly(until: list[str], tmp_path: Path) -> None:
    """The demo saves its checkpoints at validation's end, after an epoch's last batch. Lightning resumed a run
    with ``max_steps`` from one as if that epoch were still running (its issue #19617): it counted an extra epoch,
    so with ``max_epochs`` 2 it trained nothing, and the sampler dealt the wrong epoch's order; and with the epoch
    marked complete, Lightning counted the saved step once more for the loggers."""

    def args(root: Path) -> list[str]:
        epochly = ["--checkpoint.every_n_train_steps", "0", "--checkpoint.every_n_epochs", "1"]
        return [*demo_args(2, root), *epochly, "--checkpoint.save_top_k", "-1", *until]

    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    check(cli(args(reference)))
    (epoch_end,) = (reference / "checkpoints").glob("epoch=0-*.ckpt")
    check(cli([*args(resumed), "--ckpt_path", str(epoch_end)]))
    # Batch indices restart each epoch: the reference's epoch-1 losses overwrote its epoch-0 ones in the record.
    want, got = train_losses(reference), train_losses(resumed)
    assert batches_run(resumed) == batches_run(reference) - 30  # epoch 0 is 15 steps of two batches
    assert got == {index: want[index] for index in got}
    for name, tensor in weights(reference).items():
        assert torch.equal(weights(resumed)[name], tensor), name
    names = [{path.name for path in (run / "checkpoints").glob("epoch=*.ckpt")} for run in (reference, resumed)]
    assert names[1] <= names[0]  # "epoch=1-step=30.ckpt", not "epoch=2-...": the epoch count is the reference's
    assert logging_step(resumed) == logging_step(reference)  # TensorBoard's x-axis too

    # Resumed in its own folder from that checkpoint (saved before the run's first last.ckpt), the run rewrites
    # last.ckpt: Lightning saved it as last-v1.ckpt beside the finished run's.
    last = reference / "checkpoints" / "last.ckpt"
    before = last.stat().st_mtime_ns
    check(cli([*args(reference), "--ckpt_path", str(epoch_end)]))
    assert sorted(path.name for path in last.parent.glob("last*.ckpt")) == ["last.ckpt"]
    assert last.stat().st_mtime_ns > before
    for name, tensor in weights(resumed).items():
        assert torch.equal(weights(reference)[name], tensor), name


EVERY_EPOCH = [
    "--checkpoint.every_n_train_steps",
    "0",
    "--checkpoint.every_n_epochs",
    "1",
    "--checkpoint.save_top_k",
    "-1",
]
SHORT_EPOCHS = ["--trainer.limit_train_batches", "20", "--trainer.max_epochs", "5"]
EXTENDED = {  # processes, options, the steps of an epoch, of the stopped run and of the extended one
    "mid_epoch": (1, [], 30, 42, 52),  # last.ckpt written at the end of training, between saves every 5 steps
    "mid_epoch_saving_every_epoch": (1, EVERY_EPOCH, 30, 42, 52),  # written by the epoch-end hook the stop calls
    "at_an_epoch_end": (1, [], 30, 30, 47),  # written after the epoch's end; under max_epochs 2 nothing more trained
    "at_an_epoch_end_ddp": (2, [], 15, 15, 22),
    # written at the last batch's end by the every-5-steps save, which the end of training does not repeat
    "at_an_epoch_end_saved_at_its_last_batch": (1, SHORT_EPOCHS, 20, 40, 60),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.distributed) if c.endswith("ddp") else c for c in EXTENDED]
)
def test_a_run_that_max_steps_stopped_extends_as_one_run(case: str, tmp_path: Path) -> None:
    """Stopped by ``max_steps``, then resumed with a larger ``max_steps``: Lightning counted the stopped epoch as
    processed, and then complete, at the stop, so the run went on one epoch ahead (the next epoch's order, the epoch
    count, the checkpoint names), or, stopped on an epoch's last batch, trained nothing more."""
    devices, options, epoch_steps, stop, end = EXTENDED[case]
    flat = ["--model.warmup_steps", "1", "--model.min_lr_ratio", "1.0"]  # a schedule max_steps does not shape

    def args(root: Path, steps: int) -> list[str]:
        return [*demo_args(devices, root), *flat, *options, "--trainer.max_steps", str(steps)]

    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    run = check(cli(args(reference, end)))
    assert "sync_dist=True" not in run.stderr  # torchmetrics already reduced the logged values over the processes
    check(cli(args(resumed, stop)))
    check(cli([*args(resumed, end), "--ckpt_path", "last"]))
    states = [torch.load(run / "checkpoints" / "last.ckpt", weights_only=True) for run in (reference, resumed)]
    epoch = (end - 1) // epoch_steps  # the epoch the last step trained in
    assert states[1]["epoch"] == states[0]["epoch"] == epoch
    loaders = [state["loops"]["fit_loop"]["state_dict"]["combined_loader"] for state in states]
    assert loaders[1] == loaders[0] == [{"epoch": epoch, "batches_done": end - epoch * epoch_steps}]
    assert batches_run(resumed) == batches_run(reference)
    for name, tensor in weights(reference).items():
        assert torch.equal(weights(resumed)[name], tensor), name
    for state in states:  # as a further extension reads them (one may be saved at the last batch's end, before it)
        finish_saved_epoch(state, iteration_based=True)
    loops = [state["loops"]["fit_loop"] for state in states]
    for counts in ("epoch_progress", "epoch_loop.batch_progress", "epoch_loop.state_dict"):
        assert loops[1][counts] == loops[0][counts], counts


def next_logging_step(fit_loop: dict) -> int:
    """The logging step a run resumed from this state goes on from: Lightning counts a step saved at its batch's end
    (before the count) once it restarts."""
    batches = fit_loop["epoch_loop.batch_progress"]["total"]
    at_batch_end = batches["completed"] == batches["processed"] - 1
    return fit_loop["epoch_loop.state_dict"]["_batches_that_stepped"] + at_batch_end


@pytest.mark.slow
def test_sigterm_on_an_epochs_last_batch_of_a_max_steps_run_resumes_as_one_run(tmp_path: Path) -> None:
    """SIGTERM at step 30, the demo's first epoch's last batch: saved at that batch's end, before the epoch ended.
    Lightning resumed it in the next epoch without counting that epoch started, and the run, stopped by ``max_steps``
    mid-epoch, ended one epoch ahead."""
    flat = ["--model.warmup_steps", "1", "--model.min_lr_ratio", "1.0", "--trainer.max_steps", "45"]
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    check(cli([*demo_args(1, reference), *flat]))
    run = interrupted([*demo_args(1, stopped), *flat], TORCH_HANDLE_TEST_SIGTERM_AT_STEP="30")
    assert run.returncode == 143, run.stderr[-3000:]
    check(cli([*demo_args(1, stopped), *flat, "--ckpt_path", "last"]))
    states = [torch.load(root / "checkpoints" / "last.ckpt", weights_only=True) for root in (reference, stopped)]
    assert states[1]["epoch"] == states[0]["epoch"] == 1
    loops = [state["loops"]["fit_loop"] for state in states]
    for counts in ("epoch_progress", "state_dict"):
        assert loops[1][counts] == loops[0][counts], counts
    assert next_logging_step(loops[1]) == next_logging_step(loops[0]) == 45
    assert batches_run(stopped) == batches_run(reference)
    for name, tensor in weights(reference).items():
        assert torch.equal(weights(stopped)[name], tensor), name


def test_configure_optimizers_leaves_the_train_loader_to_the_fit_loop() -> None:
    """``estimated_stepping_batches`` builds the train loader; built before the checkpoint is restored, Lightning
    never repositions it, and a resumed epoch restarts at batch 0. The schedule reads it at the first step."""
    module = Seq2SeqModule(tiny_config())
    trainer = Mock()
    type(trainer).estimated_stepping_batches = PropertyMock(side_effect=AssertionError("train loader built early"))
    module.trainer = trainer
    module.configure_optimizers()
