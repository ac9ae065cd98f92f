"""Test-only callbacks that inject faults into a ``cli.py`` run at a chosen step, named by environment variables.

The command stays the same with or without the fault: rerunning it without the variable is the resume.
"""

from __future__ import annotations

import os
import signal

import lightning as L
from typing_extensions import override

KILL_AT = "TORCH_HANDLE_TEST_SIGKILL_AT_STEP"
TERM_AT = "TORCH_HANDLE_TEST_SIGTERM_AT_STEP"
INT_AT = "TORCH_HANDLE_TEST_SIGINT_AT_STEP"


class InjectSignal(L.Callback):
    """At the end of step ``$TORCH_HANDLE_TEST_SIGKILL_AT_STEP`` rank 0 SIGKILLs the whole job (its process group,
    as a scheduler would); at step ``$TORCH_HANDLE_TEST_SIGTERM_AT_STEP`` it sends itself SIGTERM (preemption); at
    step ``$TORCH_HANDLE_TEST_SIGINT_AT_STEP`` it sends the job's process group SIGINT, as a terminal's Ctrl-C does."""

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_rank != 0:
            return
        if os.environ.get(KILL_AT) == str(trainer.global_step):
            os.killpg(os.getpgrp(), signal.SIGKILL)
        if os.environ.get(TERM_AT) == str(trainer.global_step):
            os.kill(os.getpid(), signal.SIGTERM)
        if os.environ.get(INT_AT) == str(trainer.global_step):
            os.killpg(os.getpgrp(), signal.SIGINT)
