"""An exponential moving average of the weights (``--config ema``): Lightning's ``WeightAveraging`` with torch's
``foreach`` EMA, saved in and resumed from the run's checkpoints."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from torch.optim.swa_utils import get_ema_multi_avg_fn
from typing_extensions import override

from torch_handle.errors import SetupError

UNSUPPORTED = (DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy)
"""Strategies whose weights ``WeightAveraging`` cannot average or save: it keeps a full, unsharded copy of the
module (FSDP, tensor/pipeline parallelism shard it), and swaps the average into ``checkpoint["state_dict"]``, which
DeepSpeed's checkpoints do not save (they write the engine's own weights)."""


class EMA(WeightAveraging):
    """Keeps ``average = decay * average + (1 - decay) * weights`` after every ``every_n_steps``-th optimizer step
    from ``start_step`` on. Validation runs on the average; every checkpoint holds it as its ``state_dict`` (what
    test, predict, export and ``load`` read) and the raw weights as ``current_model_state`` (what ``--ckpt_path``
    resumes training from, restoring the average too). Single device and DDP; other strategies stop before training.

    Args:
        decay: Weight of the old average at each update.
        start_step: First optimizer step (counted from 0) that updates the average.
        every_n_steps: Update the average every this many optimizer steps.
    """

    def __init__(self, decay: float = 0.999, start_step: int = 0, every_n_steps: int = 1) -> None:
        if not 0.0 <= decay <= 1.0 or every_n_steps < 1 or start_step < 0:
            raise SetupError(
                f"EMA(decay={decay}, start_step={start_step}, every_n_steps={every_n_steps}): decay must lie in "
                "[0, 1], every_n_steps be at least 1 and start_step at least 0"
            )
        super().__init__(multi_avg_fn=get_ema_multi_avg_fn(decay))
        self.start_step = start_step
        self.every_n_steps = every_n_steps

    @override
    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        return step_idx is not None and step_idx >= self.start_step and step_idx % self.every_n_steps == 0

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and isinstance(trainer.strategy, UNSUPPORTED):
            raise SetupError(
                f"--config ema cannot average under {trainer.strategy.__class__.__name__} (Lightning's WeightAveraging "
                "averages an unsharded copy of the model, which sharded and DeepSpeed checkpoints do not save): train "
                "with one device or ddp"
            )
        super().setup(trainer, pl_module, stage)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Keeps the raw weights in the model: ``last.ckpt``, saved after this hook when training stops between
        scheduled saves, must hold them as ``current_model_state`` to resume exactly (its ``state_dict`` is the
        average either way)."""
