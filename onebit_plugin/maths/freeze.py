"""``freeze_step="auto"``: freeze the variance once it has settled (docs/design.md, "When to
freeze").

At steps 16, 23, 32, 45, 64, 91, ... (a factor sqrt(2) apart) the bias-corrected ``sqrt(v_hat)``
of every trainable coordinate is compared with its value two checks earlier, at about half the
step: ``change = sum|r_t - r_(t/2)| / sum r_t``. The ratio is scale-free: while ``v_hat`` is a
running mean of a gradient scale that keeps shrinking, it stays put however long the run (0.26-0.42
at every check up to step 256 on the char-level model of ``examples/`` under torch's Adam, one
process), and it falls once the gradients' scale
stops drifting. The variance is frozen at the first check where ``change <= SETTLED`` and at most
``NEW_COORDINATES`` of the coordinates became non-negligible since (rows of rare tokens seen for the
first time: they would stay masked), or at ``CEILING`` of ``total_steps``, whichever comes first.
``v`` comes from averaged gradients, so every rank computes the same numbers and freezes at the same
step.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable

import torch

from onebit_plugin.maths.update import corrected_root

__all__ = ["AutoFreeze", "CEILING", "NEW_COORDINATES", "SETTLED", "current_roots",
           "is_check_step"]

FIRST_CHECK = 16
# The step sizes (1/sqrt(v)) drifted by at most 10% (L1, weighted by sqrt(v)) over the second
# half of the steps so far: the paper's premise that the variance has become stable.
SETTLED = 0.10
NEW_COORDINATES = 1e-3
# 20% of the run at most: then the whole run sends about 0.2 + 0.8/30 of Adam's bytes (4.4x
# fewer), inside the paper's 15-25% (docs/benchmarks.md measures the loss at this point). A
# member may set its own (``Policy.auto_ceiling``: 1-bit LAMB's is 15%).
CEILING = 0.20
log = logging.getLogger("onebit_plugin")
_CHECK_STEPS = frozenset(round(FIRST_CHECK * 2 ** (k / 2)) for k in range(80))


def current_roots(param_groups: list[dict], state) -> list[Callable[[], torch.Tensor]]:
    """This step's bias-corrected sqrt(v) per trainable parameter, flat (0 without state), each
    computed when called: a check holds one parameter's at a time on the device, not all."""
    def root(p, beta2):
        if not state[p]:
            return torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        return corrected_root(state[p]["exp_avg_sq"].reshape(-1), float(state[p]["step"]),
                              beta2=beta2)

    return [functools.partial(root, p, group["betas"][1])
            for group in param_groups for p in group["params"] if p.requires_grad]


def _to_host(root: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
    """A snapshot of ``root`` in host memory, into ``into`` when given (the oldest snapshot's
    memory); else a GPU's root is copied to pinned memory, a CPU tensor kept as it is. GPU
    copies do not wait: the stream orders them, a host sync completes them."""
    if into is None and not root.is_cuda:
        return root
    if into is None:
        into = torch.empty(root.shape, dtype=root.dtype, pin_memory=True)
    return into.copy_(root, non_blocking=root.is_cuda)


def is_check_step(step: int) -> bool:
    return step in _CHECK_STEPS


class AutoFreeze:
    """The decision state: the two latest snapshots of ``sqrt(v_hat)`` (fp32, one tensor per
    trainable parameter, warm-up only, in host memory: pinned for a GPU's parameters) and what
    the last check measured."""

    def __init__(self, total_steps: int | None, fraction: float = CEILING):
        self.total_steps = total_steps
        self.fraction = fraction  # of total_steps: the ceiling
        self.snapshots: list[tuple[int, list[torch.Tensor]]] = []  # oldest first, at most 2
        self.last: dict | None = None
        self._said_no_ceiling = False

    @property
    def ceiling(self) -> int | None:
        if self.total_steps is None:
            return None
        return max(1, math.floor(self.fraction * self.total_steps))

    def due(self, applied: int, roots, negligible, rank: int) -> bool:
        """After applied warm-up step ``applied``: freeze now? Rank 0 says why when it does
        (every rank decides the same: ``v`` comes from averaged gradients), and once that
        there is no ceiling without ``total_steps``."""
        if self.total_steps is None and not self._said_no_ceiling:
            self._said_no_ceiling = True
            if rank == 0:  # said once per job, like the freeze itself
                log.warning("onebit: freeze_step='auto' without total_steps: the variance freezes "
                            "only once it has settled, which on a short run may be never (all of "
                            "it the uncompressed warm-up); pass total_steps=... "
                            "(ONEBIT_TOTAL_STEPS for the Accelerate flag) to freeze at %.0f%% of "
                            "the run at the latest", 100 * self.fraction)
        reason = self.observe(applied, roots, negligible)
        if reason is not None:
            self.snapshots = []  # warm-up only: 8 bytes per parameter, freed at the freeze
            if rank == 0:
                log.warning("onebit: freeze_step='auto' froze the variance after step %d: %s",
                            applied, reason)
        return reason is not None

    def observe(self, step: int, roots, negligible: float) -> str | None:
        """After applied warm-up step ``step``: the reason to freeze now, or None. ``roots``:
        a callable returning, per parameter, a callable that computes this step's
        ``sqrt(v_hat)`` (only called at checks, :func:`current_roots`); ``negligible``:
        callable, the masking threshold of an iterable of roots."""
        ceiling = self.ceiling
        if ceiling is not None and step >= ceiling:
            last = self.last
            return (f"the ceiling, {self.fraction:.0%} of total_steps={self.total_steps}" +
                    (f" (at step {last['step']} sqrt(v) had changed {last['change']:.1%} since "
                     f"step {last['since']})" if last else ""))
        if not is_check_step(step):
            return None
        now = roots()
        reason = None
        if len(self.snapshots) < 2:
            kept = [_to_host(r(), None) for r in now]
            if any(r.is_pinned() for r in kept):  # read by state_dict() before the next sync
                torch.cuda.synchronize()
            self.snapshots.append((step, kept))
            return None
        # The two snapshots live in host memory (8 bytes per parameter; the oldest's is reused
        # for the new one), and a check holds one parameter's roots at a time on the device,
        # computed twice (for the threshold, then for the comparison): it held every
        # parameter's, beside both snapshots, on the device (+12 bytes per parameter).
        then_step, then = self.snapshots[0]
        below = negligible(r() for r in now)
        sums, kept = ([], [], []), []
        for r, o in zip(now, then, strict=True):
            r = r()
            o_here = o.to(r.device, non_blocking=True)
            sums[0].append(r.sum(dtype=torch.float64))
            sums[1].append((r - o_here).abs().sum(dtype=torch.float64))
            sums[2].append(((o_here < below) & (r >= below)).sum(dtype=torch.float64))
            kept.append(_to_host(r, o))  # the oldest snapshot's memory, reused
        # The check's one host sync; it also completes the copies into ``kept``.
        total, moved, new = torch.stack([torch.stack(x).sum() for x in sums]).tolist()
        count = sum(o.numel() for o in then)
        change = moved / total if total > 0 else 0.0
        fresh = new / max(count, 1)
        self.last = {"step": step, "since": then_step, "change": change, "new": fresh}
        if change <= SETTLED and fresh <= NEW_COORDINATES:
            reason = (f"sqrt(v) changed {change:.1%} since step {then_step} and "
                      f"{fresh:.2%} of the coordinates were first seen since")
        self.snapshots = [self.snapshots[1], (step, kept)]
        return reason

    def state_dict(self) -> dict:
        return {"total_steps": self.total_steps, "last": self.last,
                "snapshots": [(s, [t.clone() for t in ts]) for s, ts in self.snapshots]}

    def load_state_dict(self, state: dict, devices: list[torch.device]) -> None:
        self.last = state["last"]
        self.snapshots = [(s, [t.to("cpu").pin_memory() if d.type == "cuda" else
                               t.to(d, copy=True) for t, d in zip(ts, devices, strict=True)])
                          for s, ts in state["snapshots"]]
