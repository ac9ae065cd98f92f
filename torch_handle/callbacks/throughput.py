"""Lightning's ThroughputMonitor, fed with encoder-decoder FLOPs so that tokens/s and MFU are logged."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ThroughputMonitor
from typing_extensions import override

from torch_handle.data.tokenizer import PAD_ID
from torch_handle.flops import forward_flops, training_flops
from torch_handle.parallel import DATA_PARALLEL


def _lengths(batch: dict[str, Any], key: str, drop_last: bool = False) -> list[int]:
    """The tokens of each row of ``batch[key]`` (without its last column with ``drop_last``): from the lengths the
    collator counted on the host (:mod:`torch_handle.data.batching`) where there are some, as reading them from
    the device would make each step wait for it."""
    counted = batch.get(f"{key}_lengths")
    if counted is None:
        ids = batch[key][:, :-1] if drop_last else batch[key]
        return (ids != PAD_ID).sum(dim=1).tolist()
    longest = batch[key].shape[1] - 1 if drop_last else batch[key].shape[1]
    return [min(n, longest) for n in counted]


def _tokens(batch: dict[str, Any]) -> int:
    """Source tokens and scored target tokens (all but each target's first)."""
    return sum(_lengths(batch, "src")) + sum(n - 1 for n in _lengths(batch, "tgt"))


class Throughput(ThroughputMonitor):
    """Logs samples/s, tokens/s (source + target: Lightning's ``items_per_sec``), FLOPs/s and MFU per device.

    On in every ``torch-handle`` run (``--throughput.*`` sets it), for training and validation; decoding in
    ``test`` and ``predict`` is not measured. Processes that compute one batch together (tensor, pipeline or
    context parallelism) are counted as one replica that sees the whole batch: global figures count each batch
    once, ``device/`` figures are one replica's, and MFU divides by the replica's devices' peak, so it is each
    device's. Values are averages over ``window_size`` batches, logged every ``--trainer.log_every_n_steps``.
    Batches are built to a token budget, so their size varies: FLOPs are counted for every batch from its real
    lengths (:mod:`torch_handle.flops`) rather than measured once.

    Args:
        peak_flops: Peak FLOP/s of one device for the run's dtype, e.g. ``989e12`` for an H100/H200 in bf16
            dense. Lightning looks it up from the device name but does not know every name (H200 among
            them); without it no MFU is logged there.
        window_size: Batches averaged over.
    """

    def __init__(self, peak_flops: float | None = None, window_size: int = 50) -> None:
        super().__init__(batch_size_fn=self._rows, length_fn=_tokens, window_size=window_size)
        self.peak_flops = peak_flops

    @staticmethod
    def _rows(batch: dict[str, Any]) -> int:
        return batch["src"].shape[0]

    def _count_replicas(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Lightning multiplies one process's figures by its ``world_size`` for the global ones, and checks that a
        process sees at least one sample per batch: with one document split over two processes, a per-process share
        (half a row) failed that check. So each process reports its replica's whole batch and the monitor's
        ``world_size`` is the number of replicas. The mesh of context parallelism exists only once the model is
        configured, hence per batch."""
        mesh = pl_module.device_mesh
        replicas = trainer.world_size if mesh is None else mesh[DATA_PARALLEL].size()
        for throughput in self._throughputs.values():
            throughput.world_size = replicas
            if self.available_flops is not None:
                throughput.available_flops = self.available_flops * (trainer.world_size // replicas)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.peak_flops is not None:
            self.available_flops = self.peak_flops

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._count_replicas(trainer, pl_module)
        pl_module.flops_per_batch = training_flops(
            pl_module.config, _lengths(batch, "src"), _lengths(batch, "tgt", drop_last=True)
        )

    @override
    def on_validation_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._count_replicas(trainer, pl_module)
        pl_module.flops_per_batch = forward_flops(
            pl_module.config, _lengths(batch, "src"), _lengths(batch, "tgt", drop_last=True)
        )

    @override
    def on_test_batch_end(self, *args: Any, **kwargs: Any) -> None:
        """Not measured: test time is decoding, which neither FLOPs nor target tokens describe."""

    @override
    def on_predict_batch_end(self, *args: Any, **kwargs: Any) -> None:
        """Not measured: predict batches have no targets to count."""
