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
    opt.policy.sparse_rows_bound = None  # every unit alike, this wire
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

    _syncs_over_denominator(bound)
    land = local_steps.LocalSteps.land_
    local_steps.LocalSteps.land_ = (lambda self, units, groups, write_back, corrections, *, ok,
                                    bounded: land(self, units, groups, write_back, corrections,
                                                  ok=ok, bounded=False))


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


def _syncs_over_denominator(bound: float) -> None:
    """Phase B's syncs send ``m / denom``."""
    from onebit_plugin.members import local_steps

    send = local_steps.LocalSteps.send_

    def send_(self, units, comm, groups, fp32_of, corrections):
        ok = True
        for unit in units:
            ok &= send(self, [unit], _OverDenominator(comm, unit, bound), groups, fp32_of,
                       corrections)
        return ok
    local_steps.LocalSteps.send_ = send_
