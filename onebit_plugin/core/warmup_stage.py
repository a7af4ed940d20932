"""The exact stage's step on the base: the member's own update (``Policy.warmup_update_``) on
gradients every rank holds averaged (``gradient_average.GradientAverage``, whose ``then`` this
is), and at its end the question whether the compression stage starts now
(``Policy.stage_changes``) and the freeze. Friend functions on ``OneBitOptimizer``, as
``onebit_plugin.core.compression_stage``'s are.
"""

from __future__ import annotations

import logging

from onebit_plugin.comm.collectives import all_finite
from onebit_plugin.core import variance_follow
from onebit_plugin.maths.freeze import current_roots
from onebit_plugin.maths.masks import negligible_root
from onebit_plugin.maths.sparse_rows import SHARE, row_counts, shares

__all__ = ["freeze", "freeze_due", "warmup_step"]

log = logging.getLogger("onebit_plugin")


def warmup_step(opt) -> None:
    """One step of the exact stage, then the stage change if the policy says so."""
    stepped = [p for p in opt.trainable() if p.grad is not None]
    # After averaging every rank holds the same gradients, hence the same decision.
    if not all_finite([p.grad for p in stepped]):
        opt.skips.everywhere(opt.global_step, opt.config.max_skipped_steps)
    else:
        opt.skips.stepped()
        opt._init_states([p for p in stepped if not opt.state[p]])
        for g in opt.param_groups:
            params = [p for p in g["params"] if p.requires_grad and p.grad is not None]
            if params:
                states = [opt.state[p] or opt._init_state(p) for p in params]
                opt.policy.warmup_update_(g, params, states, [
                    opt._master(p, s) for p, s in zip(params, states, strict=True)])
        if opt.policy.follow is not None:  # the averaged gradients' scale, sending nothing
            variance_follow.follow_(opt, variance_follow.summaries(opt, exact=True), local=False)
    if opt.shards is not None and opt.shards.alone:
        return  # nothing to compress: FSDP2 shards over every rank (comm.shards)
    if opt.policy.stage_changes(opt.global_step - opt.skipped_steps,  # applied steps
                                lambda applied: freeze_due(opt, applied)):
        freeze(opt)


def freeze_due(opt, applied: int) -> bool:
    """The ``freeze_step`` rule: that step, or ``"auto"`` (``onebit_plugin.maths.freeze``)."""
    if opt.auto_freeze is None:
        return applied >= opt.config.freeze_step
    return opt.auto_freeze.due(applied, lambda: current_roots(opt.param_groups, opt.state),
                               negligible_root, opt._rank)


def freeze(opt) -> None:
    """The end of the exact stage: fix the variance (the units are built at first use)."""
    for p in opt.trainable():
        state = opt.state[p] or opt._init_state(p)  # no gradient yet: v == 0, all masked
        # v's bias correction 1 - b2**0 would be 0 (0/0 = NaN) where v never moved.
        # A Python number, not a tensor: Lightning moves every optimizer state tensor but
        # "step" to the GPU on resume, and reading it per step would then sync the host.
        state["frozen_step"] = max(float(state["step"]), 1.0)
        opt.policy.freeze_(state)
    if opt.policy.sparse_rows_bound is not None:
        _read_sparse_rows(opt)
    opt.switch_step = opt.global_step
    if opt._rank == 0:  # once per job, like the freeze
        log.info("%s", opt.switch_message())


def _read_sparse_rows(opt) -> None:
    """Each tensor's share of zero rows (``maths.sparse_rows``) in the last exact step's
    averaged gradient, the same on every rank (FSDP2's shards summed over the host), kept in
    its state: the units are cut and sent by it (``compression_stage.build_units``), and a
    resume reads it back from the checkpoint."""
    tensors = [p for p in opt.trainable() if p.dim() >= 2 and "exp_avg_sq" in opt.state[p]]
    counts = [row_counts(p.grad, opt.state[p]["exp_avg_sq"]) for p in tensors]
    total = opt.shards.sum_over_host_ if opt.shards is not None else None
    for p, share in zip(tensors, shares(counts, total), strict=True):
        opt.state[p][SHARE] = share
