"""``torch-handle average``: the element-wise mean of the weights of several checkpoints, as one checkpoint.

fairseq's checkpoint averaging (``scripts/average_checkpoints.py``), which published translation recipes apply to
their last few checkpoints: ``torch-handle average RUN --last 5 --out RUN/checkpoints/averaged.ckpt``, or
``torch-handle average A.ckpt B.ckpt ... --out FILE``. Every input is checked (:func:`check_checkpoint`: loading it
runs no code) and must hold the same tensors with the same shapes; the output is the newest input's Lightning
checkpoint with its ``state_dict`` averaged and without resume state (like ``save_weights_only``), so ``test``,
``predict``, ``export`` and ``torch_handle.load`` take it.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from torch_handle.atomic import atomic_path
from torch_handle.checkpoints import CONFIG_FILE, TOKENIZER_FILE, CheckpointError, check_checkpoint
from torch_handle.commands import typed_command

log = logging.getLogger(__name__)
# Resume state of the newest input (its optimizer, callbacks, loops, and an EMA run's raw weights and counters), not of
# the mean.
RESUME_FIELDS = (
    "optimizer_states", "lr_schedulers", "callbacks", "loops", "rng_states", "current_model_state", "averaging_state"
)  # fmt: skip
TRAINED = "current_model_state"  # where an EMA run's checkpoints keep the trained weights (Lightning's WeightAveraging)


def _load(path: Path) -> dict[str, Any]:
    """A checked single-file Lightning checkpoint, its tensors memory-mapped (read as they are averaged)."""
    if check_checkpoint(path).is_dir():
        raise CheckpointError(
            f"{path} is a checkpoint folder (DeepSpeed or FSDP shards): average reads single .ckpt files; "
            "test the run once on one device to write one, or pass .ckpt files"
        )
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _check_same_tensors(first: dict[str, Tensor], other: dict[str, Tensor], names: tuple[Path, Path]) -> None:
    """One line naming the first tensor whose name, shape or kind differs: the checkpoints are of two models."""
    fix = "average checkpoints of one run (one architecture)"
    for name in first.keys() ^ other.keys():
        holder, lacking = names if name in first else names[::-1]
        raise CheckpointError(f"{holder} holds the tensor {name}, which {lacking} lacks: {fix}")
    for name, tensor in first.items():
        if tensor.shape != other[name].shape:
            raise CheckpointError(
                f"{name} is {tuple(tensor.shape)} in {names[0]} but {tuple(other[name].shape)} in {names[1]}: {fix}"
            )
        if tensor.is_floating_point() != other[name].is_floating_point():
            raise CheckpointError(
                f"{name} is {tensor.dtype} in {names[0]} but {other[name].dtype} in {names[1]}: {fix}"
            )


def average_checkpoints(paths: Sequence[str | Path], weights: str = "state_dict") -> dict[str, Any]:
    """The last of ``paths``' checkpoints with every floating-point tensor of its ``state_dict`` replaced by the mean
    over all ``paths`` of their ``weights`` (``state_dict``, or :data:`TRAINED` for an EMA run's trained weights),
    summed in float64 and stored in its own dtype; other tensors (counters) must be equal.

    Raises:
        CheckpointError: A path is missing, not a checkpoint, could run code, or holds other tensors than the first.
    """
    paths = [Path(p) for p in paths]
    if not paths:
        raise CheckpointError("average needs at least one checkpoint")
    sums: dict[str, Tensor] = {}
    first: dict[str, Tensor] = {}
    newest: dict[str, Any] = {}
    for path in paths:
        newest = _load(path)
        if weights not in newest:
            raise CheckpointError(
                f"{path} holds no trained weights apart from its average ({weights}): it is not from a run with "
                "--config ema; average it without --trained"
            )
        state = newest[weights]
        if not first:
            first = state
            sums = {name: t.double() if t.is_floating_point() else t.clone() for name, t in state.items()}
            continue
        _check_same_tensors(first, state, (paths[0], path))
        for name, tensor in state.items():
            if tensor.is_floating_point():
                sums[name] += tensor.double()
            elif not torch.equal(sums[name], tensor):
                raise CheckpointError(
                    f"{name} (a {tensor.dtype} tensor, not averaged) differs between {paths[0]} and {path}: "
                    "average checkpoints of one run (one architecture)"
                )
    averaged = {
        name: (total / len(paths)).to(first[name].dtype) if first[name].is_floating_point() else total
        for name, total in sums.items()
    }
    fields = {key: value for key, value in newest.items() if key not in RESUME_FIELDS}
    return {**fields, "state_dict": averaged, "averaged_from": [str(p) for p in paths]}


def last_checkpoints(run: str | Path, n: int) -> list[Path]:
    """The ``n`` single-file checkpoints of a run folder (or its ``checkpoints/``) at the highest training steps, oldest
    first; ``last.ckpt`` counts as the step it holds, once (a named checkpoint of the same step is taken instead), and
    an earlier average written there (it holds ``averaged_from``) is no input."""
    run = Path(run)
    folder = run / "checkpoints" if (run / "checkpoints").is_dir() else run
    if not folder.is_dir():
        raise CheckpointError(f"--last {n}: {run} is not a run folder or a checkpoints folder: pass one")
    by_step: dict[int, Path] = {}
    for path in sorted(folder.glob("*.ckpt"), key=lambda p: (p.name.startswith("last"), p.name)):
        if path.name.startswith(".") or not path.is_file():
            continue
        state = _load(path)
        if "averaged_from" not in state:
            by_step.setdefault(int(state.get("global_step", -1)), path)
    if len(by_step) < n:
        raise CheckpointError(
            f"--last {n}: {folder} holds {len(by_step)} checkpoints of distinct steps: keep more while training "
            "(--checkpoint.save_top_k -1 --checkpoint.every_n_epochs 1) or pass a smaller --last"
        )
    return [by_step[step] for step in sorted(by_step)[-n:]]


def write_average(paths: Sequence[str | Path], output: str | Path, weights: str = "state_dict") -> Path:
    """Averages ``paths`` into the checkpoint ``output`` (written whole or not at all), with the tokenizer and model
    config files of the newest input's folder beside it where ``output``'s folder has none, so that ``test`` and
    ``predict`` decode as training encoded."""
    output = Path(output)
    state = average_checkpoints(paths, weights)
    with atomic_path(output) as tmp:
        torch.save(state, tmp)
    source = Path(paths[-1]).parent
    for name in (TOKENIZER_FILE, CONFIG_FILE):
        if (source / name).is_file() and not (output.parent / name).exists():
            shutil.copyfile(source / name, output.parent / name)
    log.info("averaged %d checkpoints (%s) into %s", len(paths), ", ".join(map(str, paths)), output)
    return output


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=typed_command("average"), description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+", help=".ckpt files to average, or with --last one run folder")
    parser.add_argument("--out", required=True, help="the averaged checkpoint to write (a .ckpt file)")
    parser.add_argument("--last", type=int, help="average the N checkpoints at the highest steps of the run folder")
    parser.add_argument(
        "--trained", action="store_true", help="of a run with --config ema: its trained weights, not their EMA"
    )
    options = parser.parse_args(args)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if options.last is not None:
            if len(options.checkpoints) != 1 or options.last < 1:
                raise CheckpointError(
                    "--last N takes N >= 1 and one run folder: torch-handle average RUN --last N --out F"
                )
            paths = last_checkpoints(options.checkpoints[0], options.last)
        else:
            paths = [Path(p) for p in options.checkpoints]
        write_average(paths, options.out, TRAINED if options.trained else "state_dict")
    except CheckpointError as err:
        raise SystemExit(f"error: {err}") from err


if __name__ == "__main__":
    main()
