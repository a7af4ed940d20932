"""Rows first seen after the freeze: an embedding row whose variance was zero when it froze
(no batch had drawn it) wakes at its first gradient, and from then on trains as the others do.

Why: the mask (``onebit_plugin.maths.masks``) holds a coordinate of zero frozen variance at a
zero momentum, since its ``1/eps`` would amplify the ``+-scale`` sent for it. On a recommender
whose ids are drawn from Zipf laws (``benchmarks/workloads.py``'s ``recsys_zipf``, 40,000
users, frozen at step 400 of 2,000) that left a third of the user rows that got gradients
after the freeze at their initial values for the whole run, and the validation loss 9% above
Adam's (issue 59; the figures now: docs/benchmarks.md, "Long-tailed embeddings").

The class of coordinates: the rows of a tensor of two or more dimensions (rows: its first
dimension, an embedding's ids) all of whose coordinates the freeze masked for a zero variance
(not a user's ``masks=``), that get a gradient later on some rank. A 1-D tensor's masked
coordinates stay masked, as before (the key bias of attention, whose gradient is zero up to
rounding, is the case the mask is for).

How, each 1-bit step, for the units that hold such rows:

1. every rank notes which of its asleep rows its local gradient touches (the fold reads them,
   in ``step()`` or in the DDP hook's backward: :meth:`LateRows.note`); after the step's
   update (``core.compression_stage.wake_late_rows``):
2. one all-gather of those bits, a bit per asleep row (``(W - 1) / 8`` bytes a row a step
   received, fewer as rows wake): every rank takes the same union;
3. where the union is not empty, one fp32 allreduce of the touched rows' local gradients
   (their exact average; a few rows a step);
4. each woken row takes Adam's own numbers after its first gradient ``g`` at step ``t``: the
   variance ``(1 - b2) g**2``, bias corrected at ``t`` (its denominator ``sqrt((1 - b2) g**2 /
   (1 - b2**t)) + eps``; a block's following factors, where the denominators follow, move it
   from here on, ``core.variance_follow``) and the momentum ``(1 - b1) g`` (the gradient
   clipped as the step's was; coupled weight decay added), the same on every rank; it leaves
   the mask and joins the 1-bit exchange at the next step, where the update bounds its steps
   as every coordinate's (``bound_update``). A coordinate whose seeded root is still below the
   freeze's negligible root stays masked;
5. under the Adam members each woken row takes its first step now, where Adam takes it:
   ``-lr * m_hat / denom`` from those numbers, bounded as the step's update is
   (``Policy.first_step_``; a local step's bound in 0/1 Adam's phase B). 1-bit LAMB's update
   scales a whole tensor by its trust ratio, which a few rows do not have alone: its woken rows
   move from the next step on.

Every rank holds the same bits and the same average, so the ranks stay alike, and both paths
(the hook, ``step()``) wake the same rows with the same numbers. A step skipped for a
non-finite gradient wakes nothing. A resume finds the asleep rows again from the saved
denominators and the freeze's negligible root (``mask_floor`` in the ``onebit`` entry), as
the uninterrupted run holds them. Before the first step at the wake (5.), a row woken at a
run's last step ended where it began: 1-3 users a seed on ``recsys_zipf``.

0/1 Adam (its default ``local_variance``) remakes the mask from the ranks' averaged variance
at every refresh and at phase B's variance averages (every 128 steps): the rows masked whole
there are found again (``core.compression_stage.remask``) and wake between averages as above,
at its phase-A steps and at every local step of phase B (a local step otherwise sends nothing:
while some row is asleep it sends the bits, after a sync's landing, which rebuilds the momenta
from the average, so a row woken there keeps its own). A woken row's variance is in every
rank's own from its first gradient on, so the next average keeps it awake. Before, a row
first drawn after the last average (on ``recsys_zipf``, the users first drawn after step
1,920 of 2,000) never moved, and one drawn once between averages had lost its gradient by the
time the average woke it. Not for members that refresh from exactly averaged gradients alone
(0/1 Adam's ``local_variance=False``, 1-bit Adam's ``refresh_interval``): a row woken between
refreshes would hold no variance at the next one, which would mask it again; their rows wake
at their refreshes.

Costs: 8 bytes per asleep row of the row index (none once awake), and on a step that wakes
rows their gradient rows in fp32 (a few KB); under 0/1 Adam one collective more on a local
step while rows sleep.
"""

from __future__ import annotations

import math

import torch

from onebit_plugin.maths.masks import above_floor, keep_mask
from onebit_plugin.wire.deferred import as_fp32

__all__ = ["LateRows", "seed_rows_"]


class LateRows:
    """One unit's asleep rows, per parameter of two or more dimensions that has any (row
    indices, int64, sorted), and what this step's fold noted of them."""

    __slots__ = ("rows", "noted")

    def __init__(self, rows: dict) -> None:
        self.rows = rows  # {param: LongTensor of its asleep rows}
        self.noted: dict = {}  # {param: (touched bools over its asleep rows, their rows)}

    @classmethod
    def of(cls, unit, negligible: float, masks: dict) -> LateRows | None:
        """The asleep rows of ``unit`` just built (its frozen denominators, the freeze's
        ``negligible`` root, the user's ``masks``), or None where it has none."""
        rows = {}
        seen = keep_mask(unit.params, unit.denom, [unit.hypers[p]["eps"] for p in unit.params],
                         negligible, True, {})
        for p in unit.params:
            if p.dim() < 2 or p.shape[0] == 0 or p.numel() == 0:
                continue
            by_row = unit.view(p, seen).reshape(p.shape[0], -1)
            asleep = by_row.any(1).logical_not_()
            if p in masks:  # a row the user masks whole stays masked
                asleep &= masks[p].reshape(p.shape[0], -1).any(1)
            index = asleep.nonzero().reshape(-1)
            if index.numel():
                rows[p] = index
        return cls(rows) if rows else None

    def asleep(self) -> int:
        return sum(r.numel() for r in self.rows.values())

    def note(self, grads: dict) -> None:
        """This step's local gradients (``grads[p]``, None: none): which asleep rows they
        touch, and those rows' values (fp32 copies: the gradients may be DDP's buckets, which
        hold the average by ``step()``)."""
        self.noted = {}
        for p, index in self.rows.items():
            g = grads.get(p)
            if g is None:
                continue
            picked = g.reshape(g.shape[0], -1).index_select(0, index.to(g.device))
            touched = picked.ne(0).any(1)
            self.noted[p] = (touched, as_fp32(picked[touched]).clone())

    def forget(self) -> None:
        self.noted = {}

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        return [("late rows", r) for r in self.rows.values()]


def seed_rows_(unit, p, rows, g, step: float, negligible: float,
               masks: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``rows`` of ``p`` take Adam's variance and momentum after their first averaged
    gradient ``g`` (k x width, fp32) at step ``step``: the denominator and the momentum, in
    the unit's buffers. Returns the unit's flat indices of the coordinates that join the
    exchange (those whose root is not negligible, ``maths.masks.above_floor``, the rule a
    resume masks by, and that the user's ``masks`` keep; the rest keep a zero momentum), and
    which of ``rows`` any joined."""
    hyper = unit.hypers[p]
    beta1, beta2 = hyper["betas"]
    if hyper["weight_decay"] != 0 and not hyper["decoupled_weight_decay"]:
        g = g + hyper["weight_decay"] * as_fp32(p).reshape(p.shape[0], -1)[rows]
    d = g.abs().mul_(math.sqrt((1 - beta2) / (1 - beta2**step))).add_(hyper["eps"])
    unit.view(p, unit.denom).reshape(p.shape[0], -1)[rows] = d
    joins = above_floor(d, hyper["eps"], negligible)
    if p in masks:
        joins &= masks[p].reshape(p.shape[0], -1)[rows]
    unit.view(p).reshape(p.shape[0], -1)[rows] = g.mul(1 - beta1).masked_fill_(~joins, 0.0)
    width = joins.shape[1]
    flat = (rows[:, None] * width + torch.arange(width, device=rows.device)).add_(
        unit.offsets[p])
    return flat[joins], joins.any(1)
