"""A diagnostic, not a setting (issue 44; ``fidelity.py --variants zero_one_od1,zero_one_od3``):
0/1 Adam sending each rank's ``m / denom``, clamped at ``bound`` (1-bit LAMB's wire), in phase A
and at the syncs; the local steps keep their sqrt(W) bound, the landing takes the decoded
average unclamped. Reaches into the package on purpose (as ``fidelity.py``'s other
diagnostics), so that it runs on each rank's process only."""

from __future__ import annotations


def over_denominator(opt, bound: float) -> None:
    from onebit_plugin.core import compression_stage
    from onebit_plugin.core.policy import OneBitMomentum, OverDenominator
    from onebit_plugin.members import local_steps
    from onebit_plugin.members.local_variance import LocalVarianceStep
    from onebit_plugin.settings.step_kinds import MOMENTUM, REFRESH

    od = OverDenominator(OneBitMomentum())
    od.send_bound = bound
    opt.policy.exchange = od
    opt.policy.exchanges[MOMENTUM] = LocalVarianceStep(od, refresh=False)
    opt.policy.exchanges[REFRESH] = LocalVarianceStep(od, refresh=True)

    def frozen_update(opt, counts, *, averaged, local_bound=None):
        for group, params, index, units, exp_avgs, denoms in \
                compression_stage.update_rows(opt)[0]:
            opt.policy.compression_update_(
                group, params, exp_avgs, denoms, [counts[i] for i in index], bound=local_bound,
                masters=None,
                averaged=([u.averaged(p) for u, p in zip(units, params, strict=True)]
                          if averaged else None),
                states=[opt.state[p] for p in params])
    compression_stage.frozen_update = frozen_update

    _syncs_over_denominator(bound, lambda unit: True)
    land = local_steps.LocalSteps.land_
    local_steps.LocalSteps.land_ = (lambda self, units, groups, write_back, corrections, *, ok,
                                    bounded: land(self, units, groups, write_back, corrections,
                                                  ok=ok, bounded=False))


def over_denominator_for_embeddings(opt, model, bound: float) -> None:
    """The ``m / denom`` wire (clamped at ``bound``) for the momentum units that hold an
    ``nn.Embedding``'s or ``nn.EmbeddingBag``'s weight (rows sparse in their gradients), the
    paper's ``m`` for the others; phase B's syncs likewise; the bounds otherwise as they are."""
    from torch import nn

    from onebit_plugin.core import compression_stage

    rows = {m.weight for m in model.modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag)}
    build = compression_stage.build_units

    def build_units(opt):
        layout = build(opt)
        for unit in layout.units:
            if any(p in rows for p in unit.params):
                unit.send_bound = bound
        return layout
    compression_stage.build_units = build_units
    _syncs_over_denominator(bound, lambda unit: unit.send_bound is not None)


class _OverDenominator:
    """A communicator sending ``buffer / denom`` clamped at ``bound``, the average times
    ``denom`` back (phase B's syncs)."""

    def __init__(self, comm, unit, bound: float):
        self.comm, self.unit, self.bound = comm, unit, bound

    def reduce_(self, buffer, plan, errors):
        buffer.div_(self.unit.denom).clamp_(-self.bound, self.bound)
        ok = self.comm.reduce_(buffer, plan, errors)
        buffer.mul_(self.unit.denom)
        return ok


def _syncs_over_denominator(bound: float, chosen) -> None:
    """Phase B's syncs send ``m / denom`` for the units ``chosen(unit)`` says."""
    from onebit_plugin.members import local_steps

    send = local_steps.LocalSteps.send_

    def send_(self, units, comm, groups, fp32_of, corrections):
        ok = True
        for unit in units:
            wire = _OverDenominator(comm, unit, bound) if chosen(unit) else comm
            ok &= send(self, [unit], wire, groups, fp32_of, corrections)
        return ok
    local_steps.LocalSteps.send_ = send_
