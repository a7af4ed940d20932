"""Local steps between syncs (0/1 Adam's phase B, Lu et al., ICLR 2023).

Between syncs each rank folds its *own* gradient into its momentum and moves its parameters by
the frozen-variance update: nothing is sent, and ranks differ by design. Each rank also
accumulates, in its momentum units' fold buffers (which a local step does not otherwise use),

    u = sum over the interval's steps j of  F_j * lr_j * m_j / (1 - b1**j)

(``F_j``: the decoupled decay factors after step j), the paper's ``u``. At a sync every rank sends
``y = u * (1 - b1**t) / L`` (``L = sum F_j * lr_j``, the same on every rank): the lr-weighted
mean of its bias-corrected momenta over the interval, in momentum units, so that at an interval
of 1 it is exactly the momentum 1-bit Adam sends and the units' error buffers carry over from
phase A (DeepSpeed sent the raw sum and restarted its errors at the phase change). The units'
1-bit allreduce averages ``y``; every rank takes the average as its momentum and lands on

    p = D * x - L * clamp(avg(y) / (denom * (1 - b1**t)), -1, 1)

(``x``: the last sync's common point, ``D``: the product of the decay factors since), computed
from values that are the same on every rank, so that ranks are bit-identical after every sync.
The local steps only lead each rank to its gradients; the sync replaces where they went.
Weight decay is not in ``u``: ``D * x`` decays the common point as AdamW decays a parameter (a
parameter whose gradient is zero decays exactly as under AdamW, to the rounding of the product
``D``), where DeepSpeed's sum carried ``lr * wd * p`` into the rebuilt momentum and decayed
several times over. ``u`` holds unclamped momenta: the bound on each step (``bound_update``)
acts on where a rank goes between syncs and on the landing, not on the momentum carried on.
"""

from __future__ import annotations

import logging

import torch

from onebit_plugin.deferred import fold_gradient_

__all__ = ["LocalSteps"]

log = logging.getLogger("onebit_plugin")


class LocalSteps:
    """Phase B's state on one rank: the last sync's common point per momentum unit (one flat
    fp32 buffer each, in the unit's layout: 4 bytes per parameter), the accumulated ``u`` in the
    units' fold buffers, and per parameter group ``decay`` (``D``) and ``lr_sum`` (``L``)
    since the last sync.

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
            unit.local.zero_()  # u
        self.decay = [1.0] * len(groups)
        self.lr_sum = [0.0] * len(groups)
        self.steps = 0  # local steps since the last sync

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

    @torch.no_grad()
    def advance(self, units: list, groups: list[dict], corrections: dict | None) -> None:
        """One local step was taken with each group's ``lr`` and decoupled ``weight_decay``:
        its momenta (bias-corrected by ``corrections``, parameter -> ``1 - b1**t``) into ``u``.
        ``corrections`` None: this rank skipped the step (the others, who took it, do not
        know): its ``u`` only decays, ``D`` and ``L`` advance as everywhere."""
        index = {id(g): i for i, g in enumerate(groups)}
        factors = [1 - g["lr"] * g["weight_decay"]
                   if g["decoupled_weight_decay"] and g["weight_decay"] != 0 else 1.0
                   for g in groups]
        for unit in units:
            for p in unit.params:
                i = index[id(unit.hypers[p])]
                u = unit.view(p, unit.local)
                if factors[i] != 1.0:
                    u.mul_(factors[i])
                if corrections is not None:
                    u.add_(unit.view(p), alpha=groups[i]["lr"] / corrections[p])
        for i, g in enumerate(groups):
            self.decay[i] *= factors[i]
            self.lr_sum[i] = self.lr_sum[i] * factors[i] + g["lr"]
        self.steps += 1

    # ---------------------------------------------------------------------------------- sync
    @torch.no_grad()
    def send_(self, units: list, comm, groups: list[dict], corrections: dict) -> bool:
        """Average every unit's ``y`` (module docstring), made from ``u`` in place, by
        ``comm``; ``corrections``: parameter -> ``1 - b1**t``. False (on every rank) when some
        rank's was not finite."""
        index = {id(g): i for i, g in enumerate(groups)}
        ok = True
        for unit in units:
            for p in unit.params:
                i = index[id(unit.hypers[p])]
                y = unit.view(p, unit.local)
                if self.lr_sum[i] == 0:  # lr 0 throughout: nothing moved
                    y.zero_()
                else:
                    y.mul_(corrections[p] / self.lr_sum[i])
            ok &= comm.reduce_(unit.local, unit.plan, unit.errors)
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
                if ok:
                    average = unit.view(p, unit.local)
                    m.copy_(average)
                    ratio = average.div_(unit.view(p, unit.denom)).div_(corrections[p])
                    if bounded:
                        ratio.clamp_(-1.0, 1.0)
                    x.sub_(ratio.mul_(self.lr_sum[i]))
                else:
                    m.zero_()
                write_back(p, x)
            unit.local.zero_()  # u of the next interval
        self.decay = [1.0] * len(groups)
        self.lr_sum = [0.0] * len(groups)
        self.steps = 0

    # --------------------------------------------------------------------------- checkpoints
    def state_dict(self, units: list) -> dict:
        """This rank's phase-B state, in unit order: the anchors (the same on every rank) and
        ``u`` (this rank's; its parameters and momenta between syncs are its own too: the
        optimizer saves those)."""
        return {"anchors": [self.anchor[u].clone() for u in units],
                "accumulated": [u.local.clone() for u in units], "decay": list(self.decay),
                "lr_sum": list(self.lr_sum), "steps": self.steps}

    def load_state_dict(self, state: dict, units: list) -> None:
        if len(state["anchors"]) != len(units) or len(state["decay"]) != len(self.decay):
            raise ValueError(
                f"saved local-step state ({len(state['anchors'])} units, "
                f"{len(state['decay'])} parameter groups) does not fit this optimizer "
                f"({len(units)} units, {len(self.decay)} groups): resume with the same "
                "parameters, groups and bucket_cap_mb")
        for unit, saved, accumulated in zip(units, state["anchors"], state["accumulated"],
                                            strict=True):
            if saved.shape != self.anchor[unit].shape:
                raise ValueError(f"a saved sync point has {saved.numel()} values, its unit "
                                 f"{self.anchor[unit].numel()}")
            self.anchor[unit].copy_(saved)
            unit.local.copy_(accumulated)
        self.decay, self.lr_sum = list(map(float, state["decay"])), list(
            map(float, state["lr_sum"]))
        self.steps = int(state["steps"])
