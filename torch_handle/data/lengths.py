"""The truncation policy over one side of a split, which may be tokenized a chunk at a time."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from torch_handle.errors import DataError


@dataclass
class LengthCheck:
    """Counts the rows over ``limit`` tokens of one side of a split, fed in order, and says so once at the end:
    ``warn`` with their count, ``error`` naming the first (:meth:`refuse` stops there sooner). A split whose sources
    are decoded whole (``whole``) only says how many are read whole.

    Args:
        side: ``source`` or ``target``.
        origin: What the rows are read from: a file, or a pre-tokenized folder.
        limit: Tokens a row keeps.
        truncation: The ``--data.truncation`` policy.
        whole: Sources are read whole: said after their count, which is logged instead of warned.
    """

    side: Literal["source", "target"]
    origin: str
    limit: int
    truncation: Literal["warn", "error"]
    whole: str | None = None
    rows: int = 0
    long: int = 0
    first: str | None = None  # the error naming the first long row

    def add(self, counts: Sequence[int] | np.ndarray, lines: Sequence[int] | None) -> None:
        """Counts the next rows.

        Args:
            counts: Each row's token count.
            lines: Each row's line in ``origin``; None for a pre-tokenized folder, whose rows are named by index.
        """
        long = np.flatnonzero(np.asarray(counts) > self.limit)
        if len(long) and self.first is None:
            row = int(long[0])
            where = f"{self.origin}:{lines[row]}" if lines is not None else f"{self.origin} example {self.rows + row}"
            option = f"--data.max_{self.side}_tokens"
            self.first = (
                f"{where}: {self.side} has {counts[row]} tokens, over the {self.limit} that {option} allows; "
                f"raise {option} or set --data.truncation=warn"
            )
        self.rows += len(counts)
        self.long += len(long)

    def refuse(self) -> None:
        """Under ``error``, raises for the first long row counted so far."""
        if self.truncation == "error" and self.first is not None and self.whole is None:
            raise DataError(self.first)

    def finish(self) -> None:
        """Raises (``error``) or says how many rows were long, once all are counted."""
        self.refuse()
        if not self.long:
            return
        if self.whole is not None:
            rank_zero_info(
                f"{self.origin}: {self.long} of {self.rows} sources over {self.limit} tokens are read whole{self.whole}"
            )
            return
        rank_zero_warn(
            f"{self.origin}: truncated {self.long} of {self.rows} {self.side}s to {self.limit} tokens; "
            f"raise --data.max_{self.side}_tokens to keep them whole"
        )
