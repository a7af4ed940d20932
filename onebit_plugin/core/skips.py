"""Steps skipped for a non-finite gradient: every one is said, and a streak of
``max_skipped_steps`` is an error, never a silent stall. A step skipped on every rank alike
(after averaging, or a communicator's all-rank skip) counts in :attr:`Skips.total`, which
checkpoints carry; a local step (0/1 Adam's phase B) skipped on this rank alone counts in its
own streak, since the other ranks, which send nothing then, do not know.
"""

from __future__ import annotations

import logging

__all__ = ["Skips"]

log = logging.getLogger("onebit_plugin")


class Skips:
    """The optimizer's skipped steps (``OneBitOptimizer.skips``)."""

    def __init__(self) -> None:
        self.total = 0  # skipped on every rank (``OneBitOptimizer.skipped_steps``)
        self.streak = 0  # of those, in a row
        self.local_streak = 0  # local steps skipped on this rank, in a row

    def everywhere(self, step: int, limit: int) -> None:
        """Step ``step`` is skipped on every rank; a ``RuntimeError`` at ``limit`` in a row."""
        self.total += 1
        self.streak += 1
        log.warning("onebit: step %d skipped on every rank: a gradient was inf or NaN on some "
                    "rank (%d in a row, %d in all)", step, self.streak, self.total)
        if self.streak >= limit:
            raise RuntimeError(
                f"onebit: {self.streak} steps in a row were skipped for inf/NaN gradients "
                "(the loss has diverged, or the data holds NaN): lower the learning rate, clip "
                "gradients or check the data; max_skipped_steps sets this limit"
            )

    def stepped(self) -> None:
        """A step was applied on every rank: the streak ends."""
        self.streak = 0

    def locally(self, step: int, rank: int, limit: int, group_rank: int | None = None) -> None:
        """Local step ``step`` is skipped on global rank ``rank`` alone (its gradient was inf
        or NaN: this rank does not move); a ``RuntimeError`` at ``limit`` in a row.
        ``group_rank``: its rank in the optimizer's group, said where it differs (HSDP's
        replicate group)."""
        self.local_streak += 1
        where = f"rank {rank}" if group_rank in (None, rank) else \
            f"rank {rank} (rank {group_rank} of the optimizer's process group)"
        log.warning("onebit: local step %d skipped on %s: its gradient was inf or NaN "
                    "(%d in a row)", step, where, self.local_streak)
        if self.local_streak >= limit:
            raise RuntimeError(
                f"onebit: {self.local_streak} local steps in a row were skipped on {where} "
                "for inf/NaN gradients: lower the learning rate, clip gradients or check the "
                "data; max_skipped_steps sets this limit")

    def stepped_locally(self) -> None:
        self.local_streak = 0
