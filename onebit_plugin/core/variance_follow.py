"""The frozen variance follows the averaged gradients, block by block, without sending them
(``follow_variance``: 1-bit Adam's default, 0/1 Adam's on request; docs/usage.md, "A variance
that follows").

Why: Adam's variance keeps moving after a freeze, and not by one factor per tensor. On
``char_mlp`` (benchmarks/variance_drift.py, Adam, seed 0), from step 400 to 2,000 the median
coordinate's ``sqrt(v_hat)`` moved by 1.81x in the embedding and by 0.29x in the output layer,
whose tensor-wide mean square moved 0.97x: the frequent classes' rows, which hold the mean,
stayed, the others shrank. A frozen denominator gets those steps wrong by as much (1-bit Adam
+1.45% against Adam there, 3 seeds). One factor per tensor, tried first, ended +1.29%; one per
block of :data:`BLOCK` values leaves a median coordinate within 0.95-1.09x of its move (the
biases of a layer, a single block, excepted) and ends +0.46% at the same bytes
(docs/benchmarks.md, "Wider workloads").

How: per block, ``v_bar`` is the mean square of the averaged gradient under Adam's own average
(``v <- b2**k v + (1 - b2**k) a`` over the ``k`` steps since the last move, bias corrected at
the count), from the first step on. In the exact stage (and on a refresh) every rank holds the
averaged gradient: ``a`` is exact, nothing is sent. In the compression stage no rank holds it:
each rank sketches its local gradient into :data:`WIDTH` values a block (a CountSketch: value
``j`` of a block adds ``s_r * g_j`` to bucket ``j mod WIDTH``, ``r = j // WIDTH``, with random
signs ``s_r`` drawn from the step's number, the same on every rank and for every block of the
step), one allreduce averages the sketches, which is the averaged gradient's sketch (a sketch
is linear), and its squared norm estimates the block's squared norm. The estimate is unbiased
over the signs, which each step draws afresh, so the average takes a block's structure out
with the noise (relative standard deviation about 1 a step at ``WIDTH`` 2). 1-bit momentum
steps sketch every :data:`EVERY`-th step, 0/1 Adam's syncs every one. After each move the
block's frozen denominator ``sqrt(v_hat) + eps`` becomes ``sqrt(v_hat) * sqrt(v_bar / v_bar
when it was made) + eps`` (the freeze, or a refresh); the next step divides by it, and 0/1
Adam's local steps between two syncs share one. Every rank computes the same numbers from the
same bytes: the ranks stay alike. The numbers are optimizer state (``variance_mean``,
``variance_ref``, ``variance_scale``, ``variance_count``); checkpoints hold the denominators as
they are (or the variance and the factors, where the variance is kept): a resume is bit for
bit.

Costs: ``WIDTH * 4`` bytes a block (8: 1/256 byte a value) on a sketching step, in one small
allreduce (its latency), none on other steps; every step a pass over each gradient; 12 bytes
of state a block (0.006 a value) and a step's signs (``BLOCK / WIDTH`` fp32).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from onebit_plugin.comm.byte_counts import ring_bytes
from onebit_plugin.comm.collectives import wait_collectives
from onebit_plugin.comm.hierarchical import two_level_mean_
from onebit_plugin.maths.update import corrected_root
from onebit_plugin.wire.deferred import as_fp32

log = logging.getLogger("onebit_plugin")

__all__ = ["BLOCK", "EVERY", "WIDTH", "VarianceFollow", "block_squares", "block_sums",
           "blocks_of", "drop_numbers", "follow_", "mean_over_ranks_", "reapply_", "samples",
           "start_", "summaries", "times_blocks"]

BLOCK = 2048
WIDTH = 2
# 1-bit momentum steps sketch every EVERY-th step (0/1 Adam's syncs, at least 4 apart from the
# first quarter of phase B on, every one): the average below spans ~1,000 steps, and a small
# model's many small tensors (each at least one block) made every step's sketches 5% of a
# 1-bit step's bytes (transformers' GPT-2 test model; 1.3% at every 4th).
EVERY = 4
_SEED = 0xF011
_MEAN, _REF, _COUNT, _APPLIED = ("variance_mean", "variance_ref", "variance_count",
                                 "variance_scale")


def blocks_of(n: int) -> int:
    return max(1, -(-n // BLOCK))


class VarianceFollow:
    """What the following keeps across steps: the row signs of the current step (drawn from
    the step's number, the same on every rank and for every block of the step)."""

    def __init__(self) -> None:
        self.signs: torch.Tensor | None = None
        self._drawn: tuple | None = None

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        return [] if self.signs is None else [("variance follow", self.signs)]

    def _signs(self, t: int, device) -> torch.Tensor:
        if self._drawn != (t, device):
            gen = torch.Generator().manual_seed(_SEED * 1_000_003 + t)
            bits = torch.randint(0, 2, (BLOCK // WIDTH,), generator=gen, dtype=torch.int8)
            self.signs = bits.mul_(2).sub_(1).to(device=device, dtype=torch.float32)
            self._drawn = (t, device)
        return self.signs

    def summary(self, grad: torch.Tensor, t: int) -> torch.Tensor:
        """The sketches of one tensor's gradient ``grad`` at step ``t``, block by block
        (``WIDTH`` fp32 values per block of ``BLOCK`` values, flat)."""
        flat = as_fp32(grad).reshape(-1)
        signs = self._signs(t, flat.device)
        whole = flat.numel() // BLOCK
        parts = []
        if whole:
            parts.append(torch.einsum("brw,r->bw", flat[: whole * BLOCK].view(
                whole, BLOCK // WIDTH, WIDTH), signs))
        if flat.numel() % BLOCK or not whole:
            tail = torch.zeros(BLOCK, dtype=torch.float32, device=flat.device)
            tail[: flat.numel() - whole * BLOCK] = flat[whole * BLOCK:]
            parts.append(torch.einsum("rw,r->w", tail.view(BLOCK // WIDTH, WIDTH), signs)[None])
        return torch.cat(parts).reshape(-1)


def block_squares(grad: torch.Tensor) -> torch.Tensor:
    """Each block's exact sum of squares (a gradient every rank holds averaged)."""
    return block_sums(as_fp32(grad).reshape(-1).square())


def block_sums(flat: torch.Tensor) -> torch.Tensor:
    """Each block's sum of the flat ``flat``."""
    whole = flat.numel() // BLOCK
    parts = []
    if whole:
        parts.append(flat[: whole * BLOCK].view(whole, BLOCK).sum(1))
    if flat.numel() % BLOCK or not whole:
        parts.append(flat[whole * BLOCK:].sum().reshape(1))
    return torch.cat(parts)


def mean_over_ranks_(opt, flat: torch.Tensor, what: str, quantized=None) -> None:
    """``flat`` (fp32) averaged over ``opt``'s ranks in place, as the full-precision steps
    average (in two levels on hosts of several ranks: a host's ranks sum first and a quarter
    crosses per rank, not each rank's whole; through ``quantized``,
    ``comm.quantized.QuantizedAverage``, where given), its bytes counted; ``what`` names the
    collective in a timeout's error."""
    levels = opt.topology.levels(opt.comm_timeout, opt._device())
    if levels is not None:
        opt.counts.add_exact(two_level_mean_(flat, levels, opt.comm_timeout, quantized)[0], 0)
        return
    if quantized is not None:
        opt.counts.add_exact(quantized.average_(flat, opt.comm_group, opt.world_size,
                                                opt.comm_timeout), 0)
        return
    work = dist.all_reduce(flat, group=opt.comm_group, async_op=True)
    wait_collectives([work], opt.comm_timeout, what, opt.comm_group)
    opt.counts.add_exact(ring_bytes(flat.nbytes, opt.world_size), 0)
    flat.div_(opt.world_size)


def samples(opt, t: int) -> bool:
    """Whether 1-bit momentum step ``t`` sketches (1-bit Adam's, 0/1 Adam's phase A)."""
    return opt.policy.follow is not None and t % EVERY == 0


def summaries(opt, noted: dict | None = None, *, exact: bool = False) -> list[torch.Tensor]:
    """Every trainable tensor's part, in order, of the gradient this rank holds: the sketches
    of step ``opt.global_step`` (the DDP hook's, ``noted``, taken before ``p.grad`` came to
    hold the averaged momentum, or ``p.grad``'s), or with ``exact`` (a gradient every rank
    holds averaged) each block's sum of squares; zeros for no gradient. Taken before the
    step's exchange."""
    follow, noted, t = opt.policy.follow, noted or {}, opt.global_step
    out = []
    for p in opt.trainable():
        part = None if exact else noted.get(p)
        if part is None and p.grad is not None:
            part = block_squares(p.grad) if exact else follow.summary(p.grad, t)
        if part is None:
            part = torch.zeros(blocks_of(p.numel()) * (1 if exact else WIDTH),
                               dtype=torch.float32, device=p.device)
        out.append(part)
    return out


def follow_(opt, parts: list[torch.Tensor], coef: float | None = None, *,
            local: bool = True, rescale: bool = True) -> None:
    """After a step: move each block's ``v_bar`` by the steps since its tensor's last move
    (its step count less ``variance_count``) with the estimate from ``parts``
    (:func:`summaries`): each rank's sketches of its local gradient (``local``: averaged here,
    one allreduce, the square of the average's norm the estimate), or each block's sum of
    squares of the averaged gradient every rank holds (nothing sent); then the frozen
    denominators follow, where the units are built (``rescale``; not on a refresh, which
    makes them again). ``coef``: the clipping coefficient the averaged gradient was scaled
    by after the local gradients were sketched."""
    if not parts:
        return
    flat = torch.cat(parts)
    world = opt.world_size
    if local and world > 1:
        mean_over_ranks_(opt, flat, "the variance follow's allreduce")
    if coef is not None and coef < 1.0:
        flat.mul_(coef)
    # An exact part comes from a step whose averaged gradients were found finite; a sync's
    # sketches may hold a rank's non-finite local gradient (the same average on every rank).
    if local and not bool(torch.isfinite(flat).all()):
        return  # the variance moves with the next
    built = rescale and opt.layout is not None and bool(opt.layout.units)
    beta2_of = {p: g["betas"][1] for g in opt.param_groups for p in g["params"]}
    offset = 0
    width = WIDTH if local else 1
    for p in opt.trainable():
        n, blocks = p.numel(), blocks_of(p.numel())
        squares = flat[offset: offset + blocks * width]
        squares = squares.view(blocks, WIDTH).square().sum(1) if local else squares.clone()
        offset += blocks * width
        state = opt.state[p]
        if "step" not in state:
            continue  # no gradient yet
        done, t = state.get(_COUNT, 0.0), float(state["step"])
        if t <= done:
            continue
        sizes = torch.full((blocks,), float(BLOCK), device=squares.device)
        sizes[-1] = n - (blocks - 1) * BLOCK
        beta2 = beta2_of[p]
        kept = beta2 ** (t - done)
        mean = state.get(_MEAN)
        moved = squares.div_(sizes).mul_(1.0 - kept)
        if mean is not None:
            moved.add_(mean, alpha=kept * (1.0 - beta2 ** done))
        state[_MEAN], state[_COUNT] = moved.div_(1.0 - beta2 ** t), t

        if built and _REF in state:
            _rescale(opt, p, state)


def _rescale(opt, p: torch.Tensor, state: dict) -> None:
    """The frozen denominator ``sqrt(v_hat) + eps`` of ``p``, block by block, with its root
    times ``sqrt(v_bar / v_bar when it was made)`` (a block that had no gradient then keeps
    its own). ``eps`` is not scaled: a coordinate of zero variance keeps ``eps`` exactly, so
    that the masks a resume makes from the denominators (``maths.masks.keep_mask``) are the
    uninterrupted run's. Where the variance is kept (0/1 Adam's phase A, ``refresh_interval``)
    the denominator is made again from it and scaled once, as a resume makes it
    (:func:`reapply_`); else its root is scaled by the change, and checkpoints hold it."""
    ref = state[_REF]
    target = torch.where(ref > 0, (state[_MEAN] / ref.clamp(min=1e-38)).sqrt(),
                         torch.ones_like(ref))
    unit = opt.unit_of(p)
    d, eps = unit.view(p, unit.denom).reshape(-1), unit.hypers[p]["eps"]
    if "exp_avg_sq" in state:
        _made_again(p, state, unit, d, target)
    else:
        times_blocks(d.sub_(eps), target / state[_APPLIED]).add_(eps)
    state[_APPLIED] = target


def _made_again(p, state, unit, d, factor) -> None:
    """``sqrt(v_hat) * factor + eps`` of the kept variance into ``d``, block by block."""
    hypers = unit.hypers[p]
    corrected_root(state["exp_avg_sq"].reshape(-1), state["frozen_step"],
                   beta2=hypers["betas"][1], out=d)
    times_blocks(d, factor).add_(hypers["eps"])


def times_blocks(d: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    whole = d.numel() // BLOCK
    if whole:
        d[: whole * BLOCK].view(whole, BLOCK).mul_(factor[:whole, None])
    if d.numel() % BLOCK:
        d[whole * BLOCK:].mul_(factor[-1])
    return d


def reapply_(opt) -> None:
    """The units were just made again (a resume, say) from a kept variance, whose
    denominators are not in checkpoints: each is made with the factor it had, as
    :func:`_rescale` makes it."""
    for unit in opt.units:
        for p in unit.params:
            state = opt.state[p]
            if "exp_avg_sq" in state and _APPLIED in state:
                _made_again(p, state, unit, unit.view(p, unit.denom).reshape(-1),
                            state[_APPLIED])


def start_(opt, params=None) -> None:
    """The denominators of ``params`` (None: every trainable one that has not started, as at
    the freeze; a resumed state's numbers are kept) were just made from the variance: they
    follow from here, ``v_bar`` as it is now their reference."""
    unfollowed = 0
    for p in opt.trainable():
        state = opt.state[p]
        if params is None and _REF in state or params is not None and p not in params:
            continue
        mean = state.get(_MEAN)
        if mean is None:
            unfollowed += "step" in state and float(state["step"]) > 0
            mean = torch.zeros(blocks_of(p.numel()), dtype=torch.float32, device=p.device)
        state[_REF] = mean.clone()
        state[_APPLIED] = torch.ones_like(mean)
    if unfollowed and opt._rank == 0:
        # Stepped with no numbers: a state saved with follow_variance=False (or before it).
        log.warning("onebit: follow_variance=True on a state saved without it: %d parameter "
                    "tensors have no following numbers, so their denominators do not follow "
                    "in this run: they stay as saved, or as a refresh makes them (as with "
                    "follow_variance=False). A run started with follow_variance=True follows "
                    "from its first step", unfollowed)


def drop_numbers(opt) -> None:
    """``follow_variance=False`` on a state saved with it: its numbers are dropped, said once
    (they would otherwise be saved again with every checkpoint, unused)."""
    dropped = 0
    for state in opt.state.values():
        keys = [k for k in (_MEAN, _REF, _COUNT, _APPLIED) if k in state]
        for k in keys:
            del state[k]
        dropped += bool(keys)
    if dropped and opt._rank == 0:
        log.warning("onebit: follow_variance=False on a state saved with it: the following "
                    "numbers of %d parameter tensors are dropped; their denominators follow no "
                    "more (frozen ones stay as saved, a refresh makes them from the "
                    "variance)", dropped)
