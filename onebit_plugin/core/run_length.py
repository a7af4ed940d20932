"""The run's length in optimizer steps, when someone knows it, and the two things said about it:
a fixed ``freeze_step`` at or past it (the run would never compress) when it becomes known, and a
run that ended without compressing, at its end. Each once per job, on rank 0."""

from __future__ import annotations

import logging

__all__ = ["RunLength", "say_ended_apart"]

log = logging.getLogger("onebit_plugin")


class RunLength:
    def __init__(self, total_steps: int | None):
        self.total = total_steps
        self._said_never = self._said_ended = False

    def learn(self, total_steps: int) -> None:
        """The run's length from whoever knows it; the first value given stays."""
        if self.total is None:
            self.total = int(total_steps)

    def reaches(self, freeze_step: int | str, switched: bool) -> bool | None:
        """Whether the compression stage begins before the run ends: None while the length is
        unknown; with ``"auto"`` True once it is known (its ceiling at the latest)."""
        if switched:
            return True
        if self.total is None:
            return None
        return freeze_step == "auto" or freeze_step < self.total

    def say_if_never(self, freeze_step: int | str, switched: bool, rank: int) -> None:
        if self.reaches(freeze_step, switched) is not False or self._said_never:
            return
        self._said_never = True
        if rank == 0:
            total = self.total
            low, high = max(1, round(0.15 * total)), max(1, round(0.25 * total))
            log.warning(
                "onebit: freeze_step=%d is at or past the end of the run (%d optimizer steps): "
                "the variance never freezes, the whole run is the uncompressed warm-up and nothing "
                "compressed. Pass a freeze_step below %d (the paper uses 15-25%% of the run: "
                "%s here), or freeze_step='auto'", freeze_step, total, total,
                f"{low}-{high}" if high > low else f"about {low}")

    def say_ended(self, steps: int, freeze_step: int | str, switched: bool, rank: int) -> None:
        if switched or steps == 0 or self._said_ended:
            return
        self._said_ended = True
        if rank == 0:
            log.warning("onebit: training ended after %d optimizer steps, all of them in the "
                        "uncompressed warm-up (freeze_step=%s): nothing was compressed. A "
                        "freeze_step of 15-25%% of the run's steps (or 'auto' with the run's "
                        "length) compresses the rest", steps, freeze_step)


def say_ended_apart(apart: int, total_steps: int | None) -> None:
    """Training ended ``apart`` local steps after the last sync (every rank's parameters its
    own): said on every rank, with what would have synced them."""
    log.warning(
        "onebit: training ended %d local steps after the last sync: every rank holds "
        "parameters of its own, and what rank 0 saves or evaluates is rank 0's alone. "
        "%s, or call optimizer.sync_local_steps() on every rank before saving", apart,
        "Give the optimizer the run's length (total_steps=, ONEBIT_TOTAL_STEPS or "
        "onebit-run --total-steps) so that the last step syncs" if total_steps
        is None else f"The run stopped before the total_steps={total_steps} "
        "the optimizer was given, whose last step syncs")
