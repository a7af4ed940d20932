"""The exact stage's step on the base: the member's own update (``Policy.warmup_update_``) on
gradients every rank holds averaged (``gradient_average.GradientAverage``, whose ``then`` this
is), and at its end the question whether the compression stage starts now
(``Policy.stage_changes``). A friend function on ``OneBitOptimizer``, as
``onebit_plugin.compression_stage``'s are.
"""

from __future__ import annotations

from onebit_plugin.allreduce import all_finite

__all__ = ["warmup_step"]


def warmup_step(opt) -> None:
    """One step of the exact stage, then the stage change if the policy says so."""
    stepped = [p for p in opt.trainable() if p.grad is not None]
    # After averaging every rank holds the same gradients, hence the same decision.
    if not all_finite([p.grad for p in stepped]):
        opt._skip()
    else:
        opt._skip_streak = 0
        opt._init_states([p for p in stepped if not opt.state[p]])
        for g in opt.param_groups:
            params = [p for p in g["params"] if p.requires_grad and p.grad is not None]
            if params:
                states = [opt.state[p] or opt._init_state(p) for p in params]
                opt.policy.warmup_update_(g, params, states, [
                    opt._master(p, s) for p, s in zip(params, states, strict=True)])
    if opt.policy.stage_changes(opt.global_step - opt.skipped_steps,  # applied steps
                                opt._freeze_due):
        opt._freeze()
