"""Exact resume of training: the token-budget loader mid-epoch, and Lightning's epoch count at an epoch's end.

Lightning saves and restores a training DataLoader that has ``state_dict``/``load_state_dict``
(``fit_loop.py``'s ``_combined_loader``), but counting on the loader's own side over-counts: Lightning's
fetcher holds one batch ahead and DataLoader workers prefetch more, so the batch sampler has handed out
more batches than were trained on when the checkpoint is written. The count saved here is Lightning's
own: batches the training loop has processed in the current epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
from torch.utils.data import DataLoader

from torch_handle.data.batching import TokenBudgetBatchSampler


def finish_saved_epoch(checkpoint: dict[str, Any], iteration_based: bool) -> None:
    """Marks an epoch that a checkpoint saw end as complete, so that resuming trains the next one.

    Lightning (2.6; its issue #19617) resumes an iteration-based run (``max_steps`` set) from a checkpoint
    written after an epoch's last batch (at validation's end, or at ``max_steps`` on that batch) as if the
    epoch were still running: it ends that epoch a second time and counts one epoch too many, so the next
    epoch is shuffled as the one after it and ``current_epoch`` and ``max_epochs`` are off by one. A run
    without ``max_steps`` takes Lightning's own path for such a checkpoint, which this state leaves unchanged.

    Args:
        checkpoint: The loaded checkpoint, before Lightning restores its loops from it.
        iteration_based: The resuming trainer has ``max_steps``: Lightning then restarts the finished epoch's loop.
    """
    fit = checkpoint.get("loops", {}).get("fit_loop")
    if fit is None or not fit.get("epoch_loop.batch_progress", {}).get("is_last_batch"):
        return
    _end_epoch_saved_at_its_last_batch_end(fit)
    epochs = fit["epoch_progress"]
    total = epochs["total"]
    if not total["ready"] == total["started"] == total["processed"] == total["completed"] + 1:
        return
    for progress in (epochs["total"], epochs["current"]):
        progress["completed"] = progress["processed"]
    batches = fit["epoch_loop.batch_progress"]
    batches["current"] = dict.fromkeys(batches["current"], 0)
    batches["is_last_batch"] = False
    # Restarting that loop, Lightning adds the logging step it takes a checkpoint saved mid-epoch not to have counted
    # yet; one saved at an epoch's end counted it (TensorBoard's x-axis would run one step ahead).
    loop = fit.get("epoch_loop.state_dict", {})
    if iteration_based and loop.get("_batches_that_stepped"):
        loop["_batches_that_stepped"] -= 1


def _end_epoch_saved_at_its_last_batch_end(fit: dict[str, Any]) -> None:
    """Counts an epoch saved at its last batch's ``on_train_batch_end`` (every N steps, or SIGTERM there) ended.

    Lightning resumes such a checkpoint by skipping that epoch's end, and leaves the next epoch uncounted as started:
    saved again, its count misleads both Lightning and :func:`record_stopped_epoch` (a run extended from it ended one
    epoch ahead). Counted as after the epoch loop, it takes the epoch-end path of :func:`finish_saved_epoch`.
    """
    epochs, batches = fit["epoch_progress"], fit["epoch_loop.batch_progress"]
    total = epochs["total"]
    in_the_epoch = total["ready"] == total["started"] == total["processed"] + 1 == total["completed"] + 1
    if not in_the_epoch or batches["total"]["completed"] != batches["total"]["processed"] - 1:
        return
    for counts in (epochs["total"], epochs["current"]):
        counts["processed"] = counts["ready"]
    for counts in (batches["total"], batches["current"]):
        counts["completed"] = counts["processed"]
    loop = fit.setdefault("epoch_loop.state_dict", {})
    loop["_batches_that_stepped"] = loop.get("_batches_that_stepped", 0) + 1  # counted after on_train_batch_end


def record_stopped_epoch(checkpoint: dict[str, Any], trainer: L.Trainer) -> None:
    """Saves the epoch that ``max_steps`` stopped training in as resuming needs it.

    At the stop Lightning ends the epoch loop: it counts the epoch processed, calls ``on_train_epoch_end`` (where
    ``ModelCheckpoint`` saves when it validates once an epoch), then counts it complete (``last.ckpt`` at the end of
    training is saved after that). Resumed with a larger ``max_steps``, such a checkpoint went on one epoch ahead
    (the next epoch shuffled as the one after it, ``current_epoch`` and the checkpoint names one too high), or, for
    an epoch stopped on its last batch, trained nothing more under ``max_epochs``. An epoch stopped mid-way is saved
    still running, as a mid-epoch checkpoint is; one stopped on its last batch, as at its validation's end, which
    :func:`finish_saved_epoch` and Lightning resume in the next epoch.

    Args:
        checkpoint: The checkpoint being saved, its loops' state in it.
        trainer: The trainer saving it.
    """
    loop = trainer.fit_loop
    epochs, batches = loop.epoch_progress.current, loop.epoch_loop.batch_progress
    ended = epochs.ready == epochs.processed > 0  # the epoch loop has ended (on_train_epoch_end, or after it)
    fit = checkpoint.get("loops", {}).get("fit_loop")
    if fit is None or not ended or batches.current.ready == 0:
        return
    if batches.is_last_batch or batches.current.ready >= trainer.num_training_batches:  # the epoch ran to its end
        if epochs.completed == epochs.ready:  # and was counted complete: saved as at its validation's end
            for counts in (fit["epoch_progress"]["total"], fit["epoch_progress"]["current"]):
                counts["completed"] -= 1
            fit["epoch_loop.batch_progress"]["is_last_batch"] = True
            checkpoint["epoch"] -= 1
        return
    if epochs.completed == epochs.ready:  # saved after the epoch was counted complete: at the end of training
        checkpoint["epoch"] -= 1
    for counts in (fit["epoch_progress"]["total"], fit["epoch_progress"]["current"]):
        counts["processed"] = counts["completed"] = counts["ready"] - 1


def batches_processed(trainer: L.Trainer) -> int:
    """Training batches run to the end of their step in the current epoch (``on_train_batch_end`` included).

    Args:
        trainer: The fitting trainer.
    """
    return trainer.fit_loop.epoch_loop.batch_progress.current.processed


class ResumableDataLoader(DataLoader):
    """A DataLoader over a :class:`TokenBudgetBatchSampler` whose checkpointed position is exact.

    Args:
        *args: DataLoader's arguments; ``batch_sampler`` must be a :class:`TokenBudgetBatchSampler`.
        processed: Returns how many batches of the current epoch training has consumed; usually
            ``lambda: batches_processed(trainer)``.
        **kwargs: DataLoader's keyword arguments.
    """

    def __init__(self, *args: Any, processed: Callable[[], int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.batch_sampler, TokenBudgetBatchSampler):
            raise TypeError(f"ResumableDataLoader needs a TokenBudgetBatchSampler, got {type(self.batch_sampler)}")
        self._processed = processed

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "batches_done"}`` with the batches training consumed, not those prefetched."""
        return {"epoch": self.batch_sampler.epoch, "batches_done": self._processed()}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """The next iteration of the saved epoch skips the batches already trained on.

        Args:
            state_dict: As returned by :meth:`state_dict`.
        """
        self.batch_sampler.load_state_dict(state_dict)
