"""Which strategy resumes which checkpoint layout, decided before training, and the one conversion made on the way.

A DDP or one-device run writes one ``.ckpt`` of full tensors, ZeRO a DeepSpeed folder of flat partitions per stage,
FSDP a folder of ``torch.distributed.checkpoint`` shards. FSDP takes a full ``.ckpt`` over, optimizer state included
(:func:`optimizer_state_by_name`); ZeRO cannot (DeepSpeed reads only its own folders, of its own stage), so those
pairs are refused in one line before any process starts, as is a folder under a strategy that does not write it
(ZeRO-1 and ZeRO-2 read each other's folders; ZeRO-3 reads only its own).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy
from torch.distributed.fsdp._common_utils import clean_tensor_name
from torch.nn import Module
from torch.optim import Optimizer

from torch_handle.checkpoints import checkpoint_fields, is_deepspeed_checkpoint


def zero_stage(folder: Path) -> int | None:
    """The ZeRO stage that wrote a DeepSpeed checkpoint folder (its saved DeepSpeed config), None if it says none."""
    stage = checkpoint_fields(folder).get("ds_config", {}).get("zero_optimization", {}).get("stage")
    return None if stage is None else int(stage)


def deepspeed_refusal(path: Path, strategy: Strategy) -> str | None:
    """Why a DeepSpeed ``strategy`` cannot resume the checkpoint at ``path``, as one line, or None when it can.

    DeepSpeed restores its flat partitions from its own files only: a full ``.ckpt`` has none (DeepSpeed looked for
    them and failed with a traceback on each rank), and ZeRO-3 names and cuts them otherwise than ZeRO-1 and 2, which
    read each other's.
    """
    if not isinstance(strategy, DeepSpeedStrategy):
        return None
    stage = strategy.config["zero_optimization"]["stage"]
    if path.is_file():
        return (
            f"{path} is a full checkpoint (DDP or one device), which ZeRO-{stage} cannot resume: resume it with the "
            "strategy that wrote it, or with fsdp (which takes its weights and optimizer state over)"
        )
    # Stages 1 and 2 cut the optimizer state alike; stage 3 cuts the weights too.
    written = zero_stage(path) if is_deepspeed_checkpoint(path) else None
    if written is not None and (written == 3) != (stage == 3):
        return (
            f"{path} is a ZeRO-{written} checkpoint folder, which ZeRO-{stage} cannot resume: resume it with "
            f"--config zero{written} (test, predict and export read it with any strategy)"
        )
    return None


def optimizer_state_by_name(state: dict[str, Any], optimizer: Optimizer, model: Module) -> dict[str, Any]:
    """A full optimizer state (``torch.optim.Optimizer.state_dict``: parameters numbered across ``optimizer``'s
    groups in order) keyed by ``model``'s parameter names instead (without FSDP's wrapper prefixes), as FSDP loads one.

    Lightning's FSDP loader numbers the parameters in ``model.parameters()`` order, but the module's groups put the
    weight-decayed matrices first (:func:`~torch_handle.optim.parameter_groups`): Adam's moments then met parameters
    of other sizes. ``optimizer`` must hold the same groups as the one that saved ``state``.
    """
    names = {id(param): clean_tensor_name(name) for name, param in model.named_parameters()}
    ordered = [names[id(param)] for group in optimizer.param_groups for param in group["params"]]
    return {
        "state": {ordered[index]: values for index, values in state["state"].items()},
        "param_groups": [{**group, "params": [ordered[i] for i in group["params"]]} for group in state["param_groups"]],
    }
