"""The compression stage on the base: its momentum units (built at their first use, with a
checkpoint's errors), a step that averages the momentum units, a step that refreshes the
variance on exactly averaged gradients, and the frozen-variance update both share with the
local steps (``onebit_plugin.members.local_steps``). Friend functions on ``OneBitOptimizer``'s
privates, as ``onebit_plugin.core.checkpoint``'s; ``step()`` calls them as the policy says
(``Policy.exchange_at``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from onebit_plugin.comm.allreduce import OneBitAllreduce
from onebit_plugin.comm.collectives import all_finite, any_over_ranks
from onebit_plugin.core import checkpoint, variance_follow
from onebit_plugin.core.momentum import build_units as build
from onebit_plugin.core.momentum import partition, refresh_denominators
from onebit_plugin.core.momentum import update_rows as rows_of
from onebit_plugin.maths.late_rows import LateRows, seed_rows_
from onebit_plugin.maths.sparse_rows import ROW_SPARSE_SHARE, SHARE
from onebit_plugin.wire.dispatch import cpu_kernel

__all__ = ["UnitLayout", "build_units", "count_step", "frozen_update", "momentum_step", "prepare",
           "refresh_step", "remask", "settle_units", "sparse_rows", "update_rows", "wake_late_rows"]

log = logging.getLogger("onebit_plugin")

ALONE_MIN = 256  # values: the smallest tensor that sparse_rows gives a unit of its own


@dataclass
class UnitLayout:
    """The compression stage's momentum units as built (``OneBitOptimizer.layout``): the units,
    each parameter's unit, the step counters as views of one tensor and each trainable
    parameter's place in it, the unit size they were cut at, the update's rows (made again
    when the trainable parameters change, :func:`update_rows`) and the local steps' state."""

    units: list
    unit_of: dict
    steps: torch.Tensor
    step_index: dict
    cap_bytes: int
    rows: tuple | None = None
    #: the freeze's negligible root where asleep rows wake (``maths.late_rows``), else None
    mask_floor: float | None = None
    #: a member's local-step state over the units (0/1 Adam's ``local_steps.LocalSteps``),
    #: from its first local step; dropped with the layout at a load, made again from the
    #: checkpoint's when the units are
    local: object | None = None


def prepare(opt) -> None:
    """The compression stage's communicator and momentum units, with what a checkpoint left
    for them, where the stage begins: its first step after the freeze or after a load
    (``step()``, or the DDP hook's first bucket of that step), once the hook (whose process
    group the communicator takes) and the parameters are where they run. A no-op in warm-up
    and once built (the communicator is made again after ``use_ddp_hook``)."""
    if opt.switch_step is None:
        return
    if opt.counts.comm is None:
        opt.counts.attach(opt.topology.communicator(
            opt.policy.exchange, opt.comm_timeout, opt._device(), max_block=opt.config.max_block,
            scale=opt.config.scale, error_dtype=opt.config.error_dtype))
    if opt.layout is None:
        opt.layout = build_units(opt)
        settle_units(opt)


def build_units(opt) -> UnitLayout:
    """Move every momentum into its unit (``state['exp_avg']`` become views): the layout,
    which the optimizer takes before :func:`settle_units` gives the units what a checkpoint
    left for them."""
    cap = opt.unit_cap_bytes  # a checkpoint's, when it left units
    # Warm-up's gradient buffer (without DDP) is resident and no longer used: the units'
    # fold buffers are cut from it rather than from new memory (MomentumUnit's note), where a
    # fold buffer is written. The CPU kernel's 1-bit path folds inside its worker pass and
    # decodes as the update reads, writing none: there the buffer is let go, 4 bytes per value
    # (2 per parameter of an HSDP model on hosts of 2, benchmarks/hsdp_cluster.py); a path
    # that needs a fold buffer after all makes it at its first use.
    spare = opt.policy.warmup.release_buffer()
    if spare is not None and not spare.is_cuda and cpu_kernel() is not None and \
            type(opt.communicator) is OneBitAllreduce and opt.policy.exchange.send_bound is None:
        spare = None
    sparse = sparse_rows(opt)
    parts = partition(opt.trainable(), cap, sparse)
    wakes = _wakes(opt)
    groups = {p: g for g in opt.param_groups for p in g["params"]}
    units, negligible = build(
        parts, opt.state, groups, opt._masks, opt.config.mask_zero_variance, opt.communicator,
        spare, opt.policy.keeps_variance,
        [opt.policy.sparse_bound(groups[part[0]]) if part[0] in sparse
         else opt.policy.exchange.send_bound for part in parts],
        opt.resumed.mask_floor if wakes else None)
    if wakes:
        for unit in units:
            unit.late = LateRows.of(unit, negligible, opt._masks)
    # The step counters become views of one tensor: one add and one read a step for all of
    # them (a foreach add, a stack and a read of some 100 scalar tensors cost ~0.7 ms).
    trainable = opt.trainable()
    steps = torch.tensor([float(opt.state[p]["step"]) for p in trainable], dtype=torch.float32)
    for p, count in zip(trainable, steps.unbind(), strict=True):
        opt.state[p]["step"] = count
    return UnitLayout(units, {p: u for u in units for p in u.params}, steps,
                      {p: i for i, p in enumerate(trainable)}, cap,
                      mask_floor=negligible if wakes else None)


def _wakes(opt) -> bool:
    """Whether rows asleep since the freeze (or since a refresh) wake at their first gradient
    (``maths.late_rows``): under the zero-variance mask, for a member whose variance is frozen
    and for one whose every rank folds its own gradients into its own variance between
    refreshes (0/1 Adam's ``local_variance``: a woken row's variance is in every rank's at the
    next average). Not for one that refreshes from exactly averaged gradients alone (0/1 Adam's
    ``local_variance=False``, 1-bit Adam's ``refresh_interval``): a row woken between its
    refreshes would hold no variance at the next one, which masks it again."""
    return opt.config.mask_zero_variance and (
        not opt.policy.keeps_variance or opt.policy.local_variance is not None)


def remask(opt) -> None:
    """After the variances changed (a refresh, a variance average): every unit's denominators
    and mask from them, and where rows wake, each unit's asleep rows found again from the new
    mask, with the new negligible root (the root a checkpoint saves and a resume masks by)."""
    negligible = refresh_denominators(opt.units, opt.state,
                                      {p: g for g in opt.param_groups for p in g["params"]},
                                      opt._masks, opt.config.mask_zero_variance)
    if opt.layout.mask_floor is not None:
        opt.layout.mask_floor = negligible
        for unit in opt.units:
            unit.late = LateRows.of(unit, negligible, opt._masks)


def sparse_rows(opt) -> frozenset:
    """The trainable tensors whose gradients the freeze read as sparse in rows, where the
    policy sends those apart (``Policy.sparse_rows_bound``): each gets a unit of its own. Not
    in one process, where nothing is compressed (its exchange is exact: no clamp there), and
    not a tensor (or FSDP2 shard) of fewer than ``ALONE_MIN`` values, which stays in its
    neighbours' unit (a unit of two levels needs a value per rank of a host, and an empty
    shard none at all)."""
    if opt.policy.sparse_rows_bound is None:
        return frozenset()
    return frozenset(p for p in opt.trainable() if _read_apart(opt, p))


def _read_apart(opt, p) -> bool:
    """Whether the freeze's read of ``p`` sends it apart where the policy does so."""
    return opt.world_size > 1 and p.numel() >= ALONE_MIN and \
        opt.state[p].get(SHARE, 0.0) >= ROW_SPARSE_SHARE


def settle_units(opt) -> None:
    """The units just built take a checkpoint's errors, if it left some, and the member's own
    state over them (``Policy.units_built``)."""
    _say_if_compact_errors_save_nothing(opt)
    saved, opt.resumed.units = opt.resumed.units, None
    opt.resumed.unit_cap_bytes = opt.resumed.mask_floor = None  # the layout holds them now
    if _sparse_rows_dropped(opt) and saved is not None:
        saved = None  # cut otherwise: the errors stay zero
    if saved is not None:
        checkpoint.load_unit_errors(opt, saved)
    if opt.policy.follow is not None:
        # Made again (a resume, a change of the trainable parameters): denominators made from
        # a kept variance take their factors back; a resumed state's numbers are kept.
        variance_follow.reapply_(opt)
        variance_follow.start_(opt)
    opt.policy.units_built(opt)


def _sparse_rows_dropped(opt) -> bool:
    """A state whose tensors were read at the freeze (``sparse_rows``) taken by a policy that
    does not send them apart: the reads are dropped (the next checkpoint is this run's); True
    where some tensor was row-sparse, whose units are now cut and sent otherwise, said once."""
    if opt.policy.sparse_rows_bound is not None:
        return False
    apart = [p for p in opt.trainable() if _read_apart(opt, p)]
    for p in opt.trainable():
        opt.state[p].pop(SHARE, None)
    if apart and opt._rank == 0:
        log.warning("onebit: this checkpoint sends %d tensor(s) whose gradients are sparse in "
                    "rows as m / denom (ZeroOneAdam's sparse_rows=True), and this optimizer "
                    "sends them as m: their units are cut otherwise, so no unit's error "
                    "buffers are loaded and the error feedback restarts from zero; the run "
                    "goes on from the checkpoint, not bit for bit", len(apart))
    return bool(apart)


def _say_if_compact_errors_save_nothing(opt) -> None:
    """bf16 errors halve the errors of every unit, (2 + 2/W) bytes per value saved, but widen
    one unit at a time into fp32 scratch, (4 + 4/W) bytes per value of the largest unit: they
    save memory only when the largest unit holds less than half of the values. Said once, on
    rank 0, at the build."""
    units = opt.layout.units
    if opt.config.error_dtype == "float32" or not units or opt._rank != 0 or \
            not units[0].errors:
        return
    largest = max(u.momentum.numel() for u in units)
    total = sum(u.momentum.numel() for u in units)
    if 2 * largest >= total:
        log.warning(
            "onebit: error_dtype='bfloat16' saves no memory here: the largest momentum unit "
            "holds %d of the %d values, and the fp32 scratch it is widened into each call "
            "outweighs what halving the errors saves (it saves memory when the largest unit is "
            "below half of the values: a smaller bucket_cap_mb, or a larger model); with "
            "error_dtype='float32' this run would hold less", largest, total)


def momentum_step(opt) -> None:
    """Every unit the DDP hook did not average during backward is folded and averaged here,
    now; the step is skipped on every rank if any unit came back non-finite."""
    handoff = opt.handoff
    averaged = handoff.averaged
    follows = variance_follow.samples(opt, opt.global_step)
    sketches = variance_follow.summaries(opt, handoff.summaries) if follows else None
    ok = True
    for unit in opt.units:
        if unit in averaged:
            ok &= averaged[unit]
            continue
        for p in unit.params:
            if p in handoff.handed and handoff.changed(p):
                handoff.say_once("local")
        # Left encoded where the CPU update pass can decode it as it reads it.
        ok &= unit.reduce_(opt.communicator, {p: p.grad for p in unit.params}, decode=False)
    if not ok:
        for unit in opt.units:
            unit.late is not None and unit.late.forget()
        return opt.skips.everywhere(opt.global_step, opt.config.max_skipped_steps)
    opt.skips.stepped()
    handoff.settle(opt.units)
    frozen_update(opt, count_step(opt), averaged=True)
    if follows:
        variance_follow.follow_(opt, sketches, handoff.clip_coef)
    if opt.layout.mask_floor is not None:
        wake_late_rows(opt, handoff.clip_coef)


@torch.no_grad()
def wake_late_rows(opt, clip_coef: float | None, scale: float = 1.0) -> int:
    """After a 1-bit step's update: the asleep rows some rank's gradient touched this step
    wake (``maths.late_rows``): one all-gather of the touched bits, one exact average of the
    woken rows' gradients (scaled by the step's ``clip_coef``), and each woken row's first
    step (``Policy.first_step_``; ``scale``: a local step's bound over the update's,
    ``local_steps.local_bound``); returns how many woke. A collective wherever a unit has
    asleep rows: every rank calls it at the same step."""
    late = [u for u in opt.units if u.late is not None]
    if not late:
        return 0
    entries = []  # (unit, param, its asleep rows, what this rank's fold noted of them)
    for u in late:
        noted, u.late.noted = u.late.noted, {}
        entries += [(u, p, index, noted.get(p)) for p, index in u.late.rows.items()]
    mine = torch.cat([noted[0] if noted is not None else
                      torch.zeros(index.numel(), dtype=torch.bool, device=index.device)
                      for _, _, index, noted in entries])
    union, sent = any_over_ranks(mine, opt.comm_group, opt.world_size, opt.comm_timeout,
                                 "the late rows' bits")
    opt.counts.add_exact(sent, 0)
    if not bool(union.any()):
        return 0
    # Each woken row's local gradient (zero where this rank's did not touch it), every
    # tensor's rows in one flat buffer, averaged exactly.
    pieces, woken, offset = [], [], 0
    for u, p, index, noted in entries:
        here, own = (x[offset : offset + index.numel()] for x in (union, mine))
        offset += index.numel()
        if not bool(here.any()):
            continue
        rows = torch.zeros(int(here.sum()), p.numel() // p.shape[0], dtype=torch.float32,
                           device=p.device)
        if noted is not None and bool(own.any()):
            rows[here.cumsum(0).sub_(1)[own]] = noted[1]
        pieces.append(rows)
        woken.append((u, p, index, here))
    flat = torch.cat([r.reshape(-1) for r in pieces])
    if opt.world_size > 1:
        variance_follow.mean_over_ranks_(opt, flat, "the woken rows' gradients")
    if clip_coef is not None and clip_coef < 1.0:
        flat.mul_(clip_coef)
    floor, joined = opt.layout.mask_floor, {}
    for (u, p, index, here), g in zip(woken, flat.split([r.numel() for r in pieces]),
                                      strict=True):
        woke = index[here]
        coords, awake = seed_rows_(u, p, woke, g.view(woke.numel(), -1),
                                   float(opt.state[p]["step"]), floor, opt._masks)
        joined.setdefault(u, []).append(coords)
        _first_step(opt, u, p, woke[awake], scale)
        # A row none of whose coordinates joined (every root negligible) stays asleep, as a
        # resume finds it from the denominators.
        stays = here.logical_not()
        stays[here.nonzero().reshape(-1)[~awake]] = True
        u.late.rows[p] = index[stays]
        if not u.late.rows[p].numel():
            del u.late.rows[p]
    for u, coords in joined.items():
        u.unmask_(torch.cat(coords))
        if not u.late.rows:
            u.late = None
    return int(union.sum())


def _first_step(opt, unit, p, rows: torch.Tensor, scale: float) -> None:
    """Rows ``rows`` of ``p``, just woken and seeded, take their first step now, where Adam
    takes it, bounded as this step's update is (``Policy.first_step_``; a member that takes
    none leaves them to the next step); the parameter (and its master copy) get the rows."""
    if not rows.numel():
        return
    group = unit.hypers[p]  # its param group
    bounded = opt.config.bound_update and opt.policy.exchange.send_bound is None
    x = opt._fp32_of(p).reshape(p.shape[0], -1)[rows]  # copies: the rows alone
    m = unit.view(p).reshape(p.shape[0], -1)[rows]
    denom = unit.view(p, unit.denom).reshape(p.shape[0], -1)[rows]
    if opt.policy.first_step_(group, x, m, denom, float(opt.state[p]["step"]),
                              scale * unit.step_bound() if bounded else None):
        master = opt._master(p, opt.state[p]) if opt.config.master_weights else None
        if master is not None:
            master.view(p.shape[0], -1)[rows] = x
        p.view(p.shape[0], -1)[rows] = x.to(p.dtype)


def refresh_step(opt) -> None:
    """A full-precision step of the compression stage (a member's variance refresh, on
    gradients averaged exactly): momenta and variances from the averaged gradients, the units'
    denominators and masks from the variances, then the frozen-variance update."""
    trainable = opt.trainable()
    if not all_finite([p.grad for p in trainable if p.grad is not None]):
        # Averaged: the same decision on every rank.
        return opt.skips.everywhere(opt.global_step, opt.config.max_skipped_steps)
    opt.skips.stepped()
    for group, params, _, _, exp_avgs, _ in update_rows(opt)[0]:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        opt.policy.refresh_moments_(group, params, grads, [opt.state[p] for p in params],
                                    exp_avgs)
    remask(opt)
    counts = count_step(opt)
    if opt.policy.follow is not None:  # the refreshed denominators' reference
        variance_follow.follow_(opt, variance_follow.summaries(opt, exact=True), local=False,
                                rescale=False)
        variance_follow.start_(opt, set(trainable))
    frozen_update(opt, counts, averaged=False)


def count_step(opt) -> list[float]:
    """Advance the trainable parameters' step counters; every counter, as numbers."""
    counting = update_rows(opt)[1]
    steps = opt.layout.steps
    if counting is None:
        steps.add_(1.0)
    else:  # some parameters of the units are not trainable now: their counts stay
        steps.index_add_(0, counting, torch.ones(counting.numel()))
    return steps.tolist()


def frozen_update(opt, counts: list[float], *, averaged: bool,
                  local_bound: float | None = None) -> None:
    """The policy's compression-stage update of every group over the units' denominators,
    from the units' averages (``averaged``) or from the momenta as they are; ``local_bound``:
    a local step's bound, on this rank's own momentum (``local_steps.local_bound``). An
    exchange that bounds what it sends (``policy.OverDenominator``) leaves no bound here."""
    bounded = opt.config.bound_update and opt.policy.exchange.send_bound is None
    scale = 1.0 if local_bound is None else local_bound
    for group, params, index, units, exp_avgs, denoms in update_rows(opt)[0]:
        opt.policy.compression_update_(
            group, params, exp_avgs, denoms, [counts[i] for i in index],
            bound=[scale * u.step_bound() for u in units] if bounded else None,
            masters=([opt._master(p, opt.state[p]) for p in params]
                     if opt.config.master_weights else None),
            averaged=([u.averaged(p) for u, p in zip(units, params, strict=True)]
                      if averaged else None),
            states=[opt.state[p] for p in params])


def update_rows(opt) -> tuple[list, torch.Tensor | None]:
    """``momentum.update_rows``, made again when the trainable parameters change (one of them
    frozen since, say). The rows read the units, which ``OneBitOptimizer.prepare_stage`` built
    at the stage's first step since the freeze or a resume, whatever that step exchanges (a
    0/1 Adam refresh may come first: var_update_scaler=1, or a phase-A checkpoint before a
    refresh)."""
    trainable = tuple(map(id, opt.trainable()))
    layout = opt.layout
    if layout.rows is None or layout.rows[0] != trainable:
        layout.rows = (trainable, *rows_of(opt.param_groups, layout.unit_of, layout.step_index,
                                           layout.steps.numel()))
    return layout.rows[1:]
