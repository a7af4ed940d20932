"""Local steps between syncs (0/1 Adam's phase B, Lu et al., ICLR 2023).

Between syncs each rank folds its *own* gradient into its momentum and moves its parameters by
the frozen-variance update: nothing is sent, and ranks differ by design. At a sync every rank
sends what it moved since the last sync, as a momentum: with ``x`` the common point of the last
sync, ``p`` this rank's parameters now, ``D`` the product of the decoupled decay factors since
and ``L`` the learning rates summed with the same decay (both the same on every rank),

    y = (D * x - p) * denom * (1 - b1**t) / L

is what this rank moved over the interval, less the decay, as a momentum: the lr-weighted mean
of the steps it applied, ``m_hat / denom`` each (clamped to +-sqrt(W) with ``bound_update``,
:func:`local_bound`), times
``denom * (1 - b1**t)``. At an interval of 1 without the bound it is exactly the momentum 1-bit
Adam sends, so the units' error buffers carry over from phase A (the paper's ``u`` in momentum
units; DeepSpeed sent the raw sum and restarted its errors at the phase change). With the bound
the momentum carried on is the one applied: a coordinate whose step was clamped (a rare
embedding row over a stale variance) does not carry the excess into the next interval. On the
word-embedding workload of ``benchmarks/fidelity.py`` (2,000 steps, seeds 0 and 1, rank 0's
own point at step 1,998, between syncs) the unclamped mean momentum (the paper's ``u``,
accumulated separately) ended 3.0% and 3.4% above Adam where this ended within 1%
(docs/benchmarks.md, "0/1 Adam, long runs"). Taken from the parameters, it needs no buffer
and no pass per local step: one pass at the sync, whose rounding (an ulp of ``p`` against the
interval's movement) is far below the 1-bit compression's error. The units' 1-bit allreduce
averages ``y``; every rank then takes it as the momentum and lands on

    p = D * x - L * clamp(avg(y) / (denom * (1 - b1**t)), -b, b)

(``b``: 1, or a unit of row-sparse tensors' Adam's own largest step, ``MomentumUnit.step_bound``)

computed from values that are the same on every rank, so that ranks are bit-identical after
every sync. Weight decay is not in ``y``: ``D * x`` decays the common point as AdamW decays a
parameter, and each local step's own decay is undone by ``D`` (a parameter whose gradient is
zero decays exactly as under AdamW, to the rounding of the product ``D``), where DeepSpeed's
sum carried ``lr * wd * p`` into the rebuilt momentum and decayed several times over.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from onebit_plugin.comm.byte_counts import ring_bytes
from onebit_plugin.comm.collectives import all_finite
from onebit_plugin.core import compression_stage, variance_follow
from onebit_plugin.core.clipping import exact_clip_
from onebit_plugin.core.exchanges import StepExchange
from onebit_plugin.members import local_variance
from onebit_plugin.settings.step_kinds import LOCAL, SYNC
from onebit_plugin.wire.deferred import fold_gradient_

__all__ = ["LocalStep", "LocalSteps", "SyncStep", "corrections", "freeze_variances",
           "load_saved_state", "local_bound", "restore", "saved_state", "sync_ranks",
           "take_step"]

log = logging.getLogger("onebit_plugin")


class LocalSteps:
    """Phase B's state on one rank: the last sync's common point per momentum unit (one flat
    fp32 buffer each, in the unit's layout: 4 bytes per parameter) and, per parameter group,
    ``decay`` (``D``) and ``lr_sum`` (``L``) since then.

    Args:
        units: the momentum units.
        fp32_of: parameter -> its fp32 values (the parameter, its master copy, or a copy).
        groups: the optimizer's param groups (their order is the checkpoint's).
    """

    def __init__(self, units: list, fp32_of, groups: list[dict]):
        self.anchor = {}
        for unit in units:
            anchor = torch.empty_like(unit.momentum)
            for p in unit.params:
                unit.view(p, anchor).copy_(fp32_of(p))
            self.anchor[unit] = anchor
        self.decay = [1.0] * len(groups)
        self.lr_sum = [0.0] * len(groups)
        self.steps = 0  # local steps since the last sync

    def buffers(self) -> list:
        """``(name, tensor)`` of what it holds (``onebit_plugin.core.memory``)."""
        return [("local-step anchors", a) for a in self.anchor.values()]

    # ------------------------------------------------------------------------- between syncs
    @staticmethod
    @torch.no_grad()
    def fold_(units: list, grads: dict) -> None:
        """This rank's gradients into its momenta (a missing one counts as zero); masked
        coordinates keep a zero momentum, as the allreduce keeps them in phase A."""
        for unit in units:
            for p in unit.params:
                hyper = unit.hypers[p]
                m = unit.view(p)
                fold_gradient_(m, grads.get(p), p, beta1=hyper["betas"][0],
                               weight_decay=hyper["weight_decay"],
                               decoupled=hyper["decoupled_weight_decay"], out=m)
            if unit.masked is not None:
                unit.momentum.masked_fill_(unit.masked, 0.0)
            if unit.late is not None:  # which asleep rows this gradient touches
                unit.late.note({p: grads.get(p) for p in unit.params})

    def advance(self, groups: list[dict]) -> None:
        """One local step was taken (or skipped on this rank: the others took it) with each
        group's ``lr`` and decoupled ``weight_decay``."""
        for i, g in enumerate(groups):
            factor = (1 - g["lr"] * g["weight_decay"]
                      if g["decoupled_weight_decay"] and g["weight_decay"] != 0 else 1.0)
            self.decay[i] *= factor
            self.lr_sum[i] = self.lr_sum[i] * factor + g["lr"]
        self.steps += 1

    # ---------------------------------------------------------------------------------- sync
    @torch.no_grad()
    def send_(self, units: list, comm, groups: list[dict], fp32_of, corrections: dict) -> bool:
        """Average every unit's ``y`` (module docstring) by ``comm``, in the unit's momentum
        buffer (the momentum is rebuilt from the average, so its memory is free: no fold buffer
        is needed); ``corrections``: parameter -> ``1 - b1**t``. False (on every rank) when
        some rank's was not finite. A unit that sends ``m / denom`` (its ``send_bound``, 0/1
        Adam's ``sparse_rows``) sends ``y / denom`` clamped, as phase A sent it, and takes
        the average back times ``denom``."""
        index = {id(g): i for i, g in enumerate(groups)}
        ok = True
        for unit in units:
            anchor = self.anchor[unit]
            for p in unit.params:
                i = index[id(unit.hypers[p])]
                y = unit.view(p)
                if self.lr_sum[i] == 0:  # lr 0 throughout: nothing moved
                    y.zero_()
                    continue
                torch.mul(unit.view(p, anchor), self.decay[i], out=y)
                y.sub_(fp32_of(p))
                if unit.send_bound is None:
                    y.mul_(unit.view(p, unit.denom))
                y.mul_(corrections[p] / self.lr_sum[i])
            if unit.send_bound is None:
                ok &= comm.reduce_(unit.momentum, unit.plan, unit.errors)
            elif comm.reduce_(unit.bound_(unit.momentum), unit.plan, unit.errors):
                unit.momentum.mul_(unit.denom)
            else:
                ok = False
        return ok

    @torch.no_grad()
    def land_(self, units: list, groups: list[dict], write_back, corrections: dict,
              *, ok: bool, bounded: bool) -> None:
        """Every rank to the same point: the common point, decayed, plus the averaged update
        (``ok``), or only decayed (the sync's average was not finite on some rank: the
        interval's local steps are dropped and the momentum restarts from zero)."""
        index = {id(g): i for i, g in enumerate(groups)}
        for unit in units:
            anchor = self.anchor[unit]
            for p in unit.params:
                i = index[id(unit.hypers[p])]
                x, m = unit.view(p, anchor), unit.view(p)
                x.mul_(self.decay[i])
                if ok:  # m holds the average: the new momentum
                    ratio = torch.div(m, unit.view(p, unit.denom)).div_(corrections[p])
                    if bounded:
                        ratio.clamp_(-unit.step_bound(), unit.step_bound())
                    x.sub_(ratio.mul_(self.lr_sum[i]))
                else:
                    m.zero_()
                write_back(p, x)
        self.decay = [1.0] * len(groups)
        self.lr_sum = [0.0] * len(groups)
        self.steps = 0

    # --------------------------------------------------------------------------- checkpoints
    def state_dict(self, units: list) -> dict:
        """This rank's phase-B state, in unit order (the anchors are the same on every rank,
        the parameters and momenta between syncs are not: :class:`ZeroOneAdam` saves those)."""
        return {"anchors": [self.anchor[u].clone() for u in units], "decay": list(self.decay),
                "lr_sum": list(self.lr_sum), "steps": self.steps}

    def load_state_dict(self, state: dict, units: list) -> None:
        anchors = state["anchors"]
        saved, ours = sum(a.numel() for a in anchors), sum(u.momentum.numel() for u in units)
        if saved != ours or len(state["decay"]) != len(self.decay):
            raise ValueError(
                f"saved local-step state ({len(anchors)} units of {saved} values, "
                f"{len(state['decay'])} parameter groups) does not fit this optimizer "
                f"({len(units)} units of {ours} values, {len(self.decay)} groups): resume "
                "with the same parameters and groups")
        if [a.numel() for a in anchors] != [u.momentum.numel() for u in units]:
            # Cut otherwise (sparse_rows off on a state saved with it): the units lay the
            # same parameters out in the same order whatever the cuts (momentum.partition).
            anchors = torch.cat([a.reshape(-1) for a in anchors]).split(
                [u.momentum.numel() for u in units])
        for unit, point in zip(units, anchors, strict=True):
            self.anchor[unit].copy_(point.view_as(self.anchor[unit]))
        self.decay, self.lr_sum = list(map(float, state["decay"])), list(
            map(float, state["lr_sum"]))
        self.steps = int(state["steps"])


class LocalStep(StepExchange):
    """A local step: nothing is sent, in backward or in ``step()``; each rank clips its own
    gradient by its own norm, as local SGD clips (docs/usage.md, "0/1 Adam")."""

    kind = LOCAL
    sync = False

    def in_backward(self, opt, hook, bucket) -> torch.futures.Future:
        local: torch.futures.Future = torch.futures.Future()
        local.set_result(bucket.buffer())
        return local

    def clip_grad_norm_(self, opt, trainable, max_norm, norm_type) -> torch.Tensor:
        return exact_clip_(trainable, max_norm, opt.shards)  # this rank's own gradient

    def step(self, opt) -> None:
        take_step(opt, sync=self.sync)


class SyncStep(LocalStep):
    """A local step, then the sync: the average of every rank's update since the last sync
    through the policy's communicator, after which every rank holds the same point."""

    kind = SYNC
    sync = True


# ---------------------------------------------------------------------------------------------
# The base's local steps: friend functions on OneBitOptimizer's privates (as checkpoint.py's),
# which the exchanges above call.
def take_step(opt, sync: bool) -> None:
    """A step on this rank's own gradients, sending nothing; with ``sync``, then the average
    of every rank's update since the last sync, after which every rank holds the same
    parameters and momenta."""
    units = opt.units
    sketches = None
    if sync and opt.policy.follow is not None:
        sketches = variance_follow.summaries(opt)
    if opt.layout.local is None:  # the first local step: the ranks are on one point now
        freeze_variances(opt)
        opt.layout.local = LocalSteps(units, opt._fp32_of, opt.param_groups)
    trainable = opt.trainable()
    grads = {p: p.grad for p in trainable}
    counts = compression_stage.count_step(opt)  # every rank counts it: the counts agree
    own = opt.policy.local_variance
    notes = {}
    if all_finite([g for g in grads.values() if g is not None]):
        opt.skips.stepped_locally()
        LocalSteps.fold_(units, grads)
        compression_stage.frozen_update(opt, counts, averaged=False,
                                        local_bound=local_bound(opt.world_size))
        if own is not None:
            # A local step's sample would not be sent: only a sync's is taken.
            notes = {p: own.note(g, opt.global_step, sample=sync)
                     for p, g in grads.items() if g is not None}
    else:
        opt.skips.locally(opt.global_step, dist.get_rank() if dist.is_initialized() else 0,
                          opt.config.max_skipped_steps, group_rank=opt.topology.rank)
        for unit in units:  # this rank's gradient wakes nothing: the others' may
            unit.late is not None and unit.late.forget()
    if own is not None:  # a step this rank skipped folds a zero gradient: the counts agree
        local_variance.fold_(opt, notes)
    opt.layout.local.advance(opt.param_groups)
    # What DDP with Adam would have sent for this step, for compression_ratio.
    opt.counts.add_exact(0, ring_bytes(4 * sum(p.numel() for p in trainable),
                                       opt.world_size) if not sync else 0)
    refresh = sync and own is not None and local_variance.due_at_sync(opt.global_step,
                                                                      opt.layout.local.steps)
    if sync:
        if own is not None:
            local_variance.sample_(opt, notes)
        sync_ranks(opt, corrections(opt, counts))
    if opt.layout.mask_floor is not None:
        # Every rank, at every local step while some unit has asleep rows (a collective); at
        # a sync after the landing, which rebuilds the momenta: a woken row keeps its own.
        compression_stage.wake_late_rows(opt, None, local_bound(opt.world_size))
    if sync:
        if refresh:  # after the landing: the next interval's steps divide by the average
            local_variance.average_(opt)
        if sketches is not None:  # after the landing: the interval's steps used one scale
            variance_follow.follow_(opt, sketches)


def local_bound(world: int) -> float:
    """``bound_update``'s clamp of a local step's ``m_hat / denom`` (``lr`` per step times
    this): sqrt(W). A local momentum averages 1/W of the batch, so its noise is sqrt(W) times
    the averaged momentum's, which the bound of 1 was set for; clamped at 1, every coordinate
    where the ranks' momenta disagreed past it was pulled toward zero before the sync averaged it
    (clamp, then average). The common point stays bounded at 1: the landing clamps the average.
    On benchmarks/fidelity.py's GPT, 2,000 steps with syncs every step (seed 0), it ended
    +1.04% above Adam where a local bound of 1 gave +2.80%; at the default intervals (up to 16,
    3 seeds, rank 0's own point at step 1,998) +4.69% against +5.50%, within the seeds' spread
    (docs/benchmarks.md)."""
    return world ** 0.5


def freeze_variances(opt) -> None:
    """Phase B refreshes the variance no more: it is dropped, and checkpoints hold the units'
    denominators instead (``state[p]["frozen_denominator"]``), as 1-bit Adam's do after its
    freeze: 4 bytes per parameter less from here on (docs/memory.md). With ``local_variance``
    every rank still feeds its own and phase B averages them: it is kept."""
    if opt.policy.local_variance is not None:
        return
    for unit in opt.units:
        for p in unit.params:
            opt.state[p].pop("exp_avg_sq", None)
            opt.state[p]["frozen_denominator"] = unit.view(p, unit.denom)


def corrections(opt, counts: list[float]) -> dict:
    """m's bias correction ``1 - b1**t`` of every unit's parameter at its count."""
    return {p: 1 - unit.hypers[p]["betas"][0] ** counts[opt.layout.step_index[p]]
            for unit in opt.units for p in unit.params}


def sync_ranks(opt, corrections: dict) -> None:
    """Every rank sends what it moved since the last sync, and lands on the common point."""
    local = opt.layout.local
    opt.syncs += 1
    ok = local.send_(opt.units, opt.communicator, opt.param_groups, opt._fp32_of, corrections)
    if not ok:
        log.warning("onebit: the sync at step %d was not finite on some rank: every rank "
                    "goes back to the last sync's point (decayed), the %d local steps "
                    "since are dropped and the momentum restarts from zero",
                    opt.global_step, local.steps)
        opt.skips.total += 1
    local.land_(opt.units, opt.param_groups, opt._land, corrections, ok=ok,
                bounded=opt.config.bound_update)


def saved_state(opt) -> dict | None:
    """Between syncs, what this rank needs to go on (``checkpoint.onebit_state``): the
    local-step state, and this rank's own parameters and momenta, which differ from the other
    ranks' (Lightning and Fabric save rank 0's weights only). None at a sync point: every rank
    is on the same point, which the model's weights hold."""
    local = opt.layout.local if opt.layout is not None else None
    if local is None or local.steps == 0:
        return None
    trainable = opt.trainable()
    return {**local.state_dict(opt.units),
            "params": [opt._fp32_of(p).detach().clone() for p in trainable],
            "momenta": [opt.state[p]["exp_avg"].clone() for p in trainable]}


def restore(opt) -> None:
    """The units were just built: a checkpoint's local-step state, if it left one, onto them
    (``ZeroOnePolicy.units_built``)."""
    local, opt.resumed.local_steps = opt.resumed.local_steps, None
    if local is not None:
        opt.layout.local = LocalSteps(opt.units, opt._fp32_of, opt.param_groups)
        opt.layout.local.load_state_dict(local, opt.units)


def load_saved_state(opt, saved: dict | None) -> None:
    """This rank's parameters and momenta between syncs, now (after the model's weights); the
    rest when the units are built."""
    opt.resumed.local_steps = saved
    if saved is None:
        return
    trainable = opt.trainable()
    if len(saved["params"]) != len(trainable):
        raise ValueError(f"the checkpoint's local steps hold {len(saved['params'])} "
                         f"parameters, this optimizer has {len(trainable)} trainable")
    with torch.no_grad():
        for p, values, momentum in zip(trainable, saved["params"], saved["momenta"],
                                       strict=True):
            opt._land(p, values.to(p.device))
            opt.state[p]["exp_avg"].copy_(momentum)
