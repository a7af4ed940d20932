"""0/1 Adam's schedule (Lu et al., ICLR 2023): which steps refresh the variance, which sync.

Pure functions of the step number ``t`` (counted from 1 over every ``step()`` call, skipped
ones included, so that every rank computes the same answer with nothing saved):

* phase A, ``t <= var_freeze_step + 1``: the variance is refreshed by a full-precision step
  at ``t`` when ``t % interval == 0``, the interval starting at 1 and doubling after every
  ``var_update_scaler`` refreshes (16: steps 1-16, then every 2nd step to 48, every 4th to 112,
  every 8th to 240, ...); the other steps exchange the momentum as 1-bit signs;
* phase B, ``t > var_freeze_step + 1``: the variance is fixed and ranks step locally; they
  sync at ``t`` when ``t % interval == 0``, the interval starting at 1 and doubling every
  ``local_step_scaler`` steps of phase B, up to ``local_step_clipper``.

DeepSpeed's ``ZeroOneAdam`` counted the same way (its ``var_interval``, ``local_step_interval``),
phase A's end included: it freezes the variance after the first step past
``var_freeze_step``, so that step still follows phase A's rule and phase B's interval starts
counting at the step after it (``tests/test_zero_one.py`` replays DeepSpeed's counters against
this schedule). Here nothing of it is state, so a resumed run follows the uninterrupted one's
schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

from onebit_plugin.settings.step_kinds import EXACT, LOCAL, MOMENTUM, SYNC

__all__ = ["ZeroOneSchedule", "auto_var_freeze_step", "exact_steps", "local_interval",
           "refreshes_until", "refreshes_variance"]


def exact_steps(var_freeze_step: int | str, var_update_scaler: int) -> int:
    """The steps 0/1 Adam is plain Adam for (every step refreshes the variance): until the
    refresh interval first doubles, or phase A ends sooner (at ``var_freeze_step + 1``;
    ``"auto"``: not sooner)."""
    if var_freeze_step == "auto":
        return var_update_scaler
    return min(var_update_scaler, var_freeze_step + 1)


def refreshes_variance(t: int, scaler: int) -> bool:
    """Whether phase A's step ``t`` (>= 1) refreshes the variance (module docstring)."""
    interval, last = 1, 0  # ``last``: the step of the previous interval's last refresh
    while True:
        end = (last // interval + scaler) * interval  # this interval's last refresh
        if t <= end:
            return t % interval == 0
        last, interval = end, interval * 2


def refreshes_until(t: int, scaler: int) -> int:
    """How many of steps ``1..t`` refresh the variance (in phase A)."""
    count, interval, last = 0, 1, 0
    while True:
        end = (last // interval + scaler) * interval
        if t <= end:
            return count + (t // interval - last // interval)
        count, last, interval = count + scaler, end, interval * 2


def local_interval(t: int, var_freeze_step: int, scaler: int, clipper: int) -> int:
    """Phase B's interval between syncs at step ``t`` (> ``var_freeze_step + 1``, phase A's
    last step)."""
    doublings = (t - var_freeze_step - 2) // scaler
    # min() before the power: 2**doublings of a long run would be a huge int for nothing.
    return min(clipper, 2 ** min(doublings, clipper.bit_length()))


def auto_var_freeze_step(total_steps: int, scaler: int) -> int:
    """``var_freeze_step="auto"``: the end of the first refresh interval of 8 steps or more at
    which phase A has taken at least 10% of the run (docs/usage.md, "0/1 Adam", says what it
    was measured on): full-precision steps are then about 1 in 8 at the end of phase A."""
    interval, last = 1, 0
    while True:
        end = (last // interval + scaler) * interval
        if interval >= 8 and end >= total_steps // 10:
            return min(end, total_steps)
        last, interval = end, interval * 2


@dataclass(frozen=True)
class ZeroOneSchedule:
    """0/1 Adam's schedule, settled (``var_freeze_step`` a number)."""

    var_freeze_step: int
    var_update_scaler: int
    local_step_scaler: int
    local_step_clipper: int
    total_steps: int | None = None

    @property
    def last_a(self) -> int:
        """Phase A's last step: ``var_freeze_step + 1``, as DeepSpeed counted it (module
        docstring)."""
        return self.var_freeze_step + 1

    def kind(self, t: int) -> str:
        """What step ``t`` exchanges: EXACT, MOMENTUM, LOCAL or SYNC. The run's last step
        (``total_steps``) always syncs, so that it ends with every rank on the same point."""
        if t <= self.last_a:
            return EXACT if refreshes_variance(t, self.var_update_scaler) else MOMENTUM
        if t == self.total_steps:
            return SYNC
        interval = local_interval(t, self.var_freeze_step, self.local_step_scaler,
                                  self.local_step_clipper)
        return SYNC if t % interval == 0 else LOCAL

    def phase(self, t: int) -> str:
        """``"A"`` (refreshes and 1-bit momentum) or ``"B"`` (local steps) at step ``t``."""
        return "A" if t <= self.last_a else "B"

    def interval(self, t: int) -> int:
        """The refresh interval (phase A) or the local interval (phase B) at step ``t``."""
        if t > self.last_a:
            return local_interval(t, self.var_freeze_step, self.local_step_scaler,
                                  self.local_step_clipper)
        interval, last = 1, 0
        while True:
            end = (last // interval + self.var_update_scaler) * interval
            if t <= end:
                return interval
            last, interval = end, interval * 2
