"""ZeroOneAdam: 0/1 Adam (Lu et al., "Maximizing Communication Efficiency for Large-scale
Training via 0/1 Adam", ICLR 2023), a member of the 1-bit family.

Adam for the first ``var_update_scaler`` steps (the base's exact stage), then, on the shared
momentum units:

* phase A (to ``var_freeze_step``): the momentum is exchanged as 1-bit signs with error
  feedback, as in 1-bit Adam's compression stage, over the variance of the last refresh; the
  refreshes fall on exponentially spaced steps (``onebit_plugin.settings.schedule``). With
  ``local_variance`` (the default) every rank folds its own gradients into its own variance on
  every step and a refresh averages the ranks' variances (``onebit_plugin.members.
  local_variance``); without it (the paper's) a refresh is a full-precision step, its
  gradients averaged exactly and the variance moved by them alone;
* phase B: ranks take local steps and sync the accumulated update with the same 1-bit
  allreduce every ``local_step_interval`` steps (``onebit_plugin.members.local_steps``); the
  variance is fixed, or with ``local_variance`` still fed by every rank and averaged at the
  first sync of every ``PHASE_B_INTERVAL`` steps.

DeepSpeed's ``ZeroOneAdam`` exchanged 1-bit *gradients* in phase A, had no bias correction, and
carried ``lr * wd * p`` into the momentum it rebuilt after a sync; here phase A sends the
momentum (the paper's ``u`` at an interval of 1, which is also what 1-bit Adam sends, so the
error buffers mean one thing throughout), Adam's bias corrections apply, a refresh weighs as
many steps as it stands for (the paper and DeepSpeed weighed each as one step, so the first
16 steps' gradients held a quarter of the variance at step 240, ``ZeroOnePolicy``) and weight
decay is decoupled exactly (docs/usage.md, "0/1 Adam").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Unpack

import torch
import torch.distributed as dist

from onebit_plugin.core import compression_stage
from onebit_plugin.core.base import OneBitOptimizer
from onebit_plugin.core.gradient_average import GradientAverage
from onebit_plugin.core.policy import AdamPolicy, OneBitMomentum
from onebit_plugin.maths.sparse_rows import SHARE
from onebit_plugin.maths.update import adam_step_bound
from onebit_plugin.members import local_steps
from onebit_plugin.members import local_variance as local_variance_module
from onebit_plugin.settings.config import FamilyOptions, check_hparams, member_config
from onebit_plugin.settings.schedule import (
    ZeroOneSchedule,
    auto_var_freeze_step,
    exact_steps,
    refreshes_until,
)
from onebit_plugin.settings.step_kinds import EXACT, LOCAL, MOMENTUM, REFRESH, SYNC

__all__ = ["ZeroOneAdam", "ZeroOnePolicy"]

AUTO = "auto"
log = logging.getLogger("onebit_plugin")


def _check_schedule(var_freeze_step, var_update_scaler, local_step_scaler,
                    local_step_clipper) -> None:
    for name, value, auto in (("var_freeze_step", var_freeze_step, True),
                              ("var_update_scaler", var_update_scaler, False),
                              ("local_step_scaler", local_step_scaler, True),
                              ("local_step_clipper", local_step_clipper, False)):
        if auto and value == AUTO:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            also = " or 'auto'" if auto else ""
            raise ValueError(f"{name} must be an int >= 1{also}, got {value!r}")


def auto_local_step_scaler(total_steps: int, var_freeze_step: int, clipper: int) -> int:
    """``local_step_scaler="auto"``: the local interval reaches ``local_step_clipper`` after a
    quarter of phase B (it doubles every ``scaler`` steps, log2(clipper) times)."""
    doublings = max(1, (clipper - 1).bit_length())
    return max(1, (total_steps - var_freeze_step) // (4 * doublings))


class ZeroOnePolicy(AdamPolicy):
    """0/1 Adam's decisions: Adam's updates, its schedule of refreshes and syncs."""

    keeps_variance = True  # refreshed in phase A

    def __init__(self, var_freeze_step, var_update_scaler: int, local_step_scaler,
                 local_step_clipper: int, follow_variance: bool = False,
                 local_variance: bool = True, sparse_rows: bool = True):
        super().__init__(OneBitMomentum(), follow_variance=follow_variance)
        # sparse_rows: wire_probe's m / denom for the embeddings' units (3 seeds, 2,000 steps,
        # against Adam): bow_topics -4.86% clamped at 1 (the paper's m: +3.21%), word_embed
        # -2.01% (-1.73%); m / denom for every unit cost char_mlp +2.08% at 1 and +1.94% at 3
        # (m: +0.47%). The clamp is Adam's own largest step (sparse_bound), not 1: a rare
        # row's first step after a gap is that size under Adam, and at 1 (in the send, the
        # local steps and the landing) recsys_zipf's rows drawn once moved 0.03 where Adam's
        # moved 0.38 (docs/benchmarks.md, "Long-tailed embeddings").
        self.sparse_rows_bound = 1.0 if sparse_rows else None
        # Refreshes average exactly, as the warm-up does; local steps send nothing, syncs
        # send through the momentum's communicator.
        self.exchanges.update({EXACT: GradientAverage(compression_stage.refresh_step),
                               LOCAL: local_steps.LocalStep(), SYNC: local_steps.SyncStep()})
        if local_variance:  # every step feeds the variance; a refresh averages the ranks'
            self.local_variance = local_variance_module.LocalVariance()
            self.exchanges = {
                MOMENTUM: local_variance_module.LocalVarianceStep(self.exchange, refresh=False),
                REFRESH: local_variance_module.LocalVarianceStep(self.exchange, refresh=True),
                LOCAL: self.exchanges[LOCAL], SYNC: self.exchanges[SYNC]}
        self.var_freeze_step, self.var_update_scaler = var_freeze_step, var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper
        self._schedule: ZeroOneSchedule | None = None

    def schedule(self, total_steps: int | None) -> ZeroOneSchedule:
        """The schedule settled for a run of ``total_steps`` (``"auto"`` settings need it)."""
        if self._schedule is None or self._schedule.total_steps != total_steps:
            freeze, scaler = self.var_freeze_step, self.local_step_scaler
            if AUTO in (freeze, scaler) and total_steps is None:
                raise ValueError(
                    "ZeroOneAdam: var_freeze_step='auto' and local_step_scaler='auto' are "
                    "chosen from the run's length, which is not known: pass total_steps= (the "
                    "optimizer steps of the whole run) or call optimizer.set_total_steps(n); "
                    "under onebit-run, ONEBIT_TOTAL_STEPS=n or onebit-run --total-steps n; or "
                    "give both numbers (DeepSpeed's defaults were 100000 and 32678)")
            if freeze == AUTO:
                freeze = auto_var_freeze_step(total_steps, self.var_update_scaler)
            if scaler == AUTO:
                scaler = auto_local_step_scaler(total_steps, freeze, self.local_step_clipper)
            self._schedule = ZeroOneSchedule(freeze, self.var_update_scaler, scaler,
                                             self.local_step_clipper, total_steps)
        return self._schedule

    def sparse_bound(self, group: dict) -> float | None:
        if self.sparse_rows_bound is None:
            return None
        return adam_step_bound(*group["betas"])

    def exchange_at(self, t: int, total_steps: int | None) -> str:
        kind = self.schedule(total_steps).kind(t)
        return REFRESH if kind == EXACT and self.local_variance is not None else kind

    def rank_state(self, opt) -> dict | None:
        return local_steps.saved_state(opt)

    def apart(self, opt) -> int:
        local = opt.layout.local if opt.layout is not None else None  # phase B's, on this rank
        return local.steps if local is not None else 0

    def sync_now(self, opt) -> None:
        if self.apart(opt):
            # A sync between steps: DDP with Adam would have sent nothing for it, so it counts
            # in bytes_sent alone (compression_ratio went up with each such sync).
            with opt.communicator.beside_dense():
                local_steps.sync_ranks(opt, local_steps.corrections(opt,
                                                                    opt.layout.steps.tolist()))

    def sync_point(self, opt) -> list | None:
        saved = opt.resumed.local_steps  # resumed between syncs, the units not built yet
        if saved:
            return saved["anchors"]
        return list(opt.layout.local.anchor.values()) if self.apart(opt) else None

    def load_rank_state(self, opt, saved: dict | None) -> None:
        local_steps.load_saved_state(opt, saved)

    def own_variances(self, opt) -> list | None:
        return local_variance_module.own(opt) if self.local_variance is not None else None

    def load_own_variances(self, opt, saved: list | None) -> None:
        if self.local_variance is None:
            if saved is not None and opt._rank == 0:
                log.warning("onebit: this checkpoint was saved with local_variance=True and "
                            "is resumed with local_variance=False: each rank carries on from "
                            "the variance its loaded state holds, which the next phase-A "
                            "refresh moves by the averaged gradients; in phase B the "
                            "denominators stay as saved (not bit for bit the run that saved "
                            "it)")
            return
        local_variance_module.load_own(opt, saved)

    def units_built(self, opt) -> None:
        local_steps.restore(opt)
        tensors = [p for p in opt.trainable() if p.dim() >= 2]
        if self.sparse_rows_bound is not None and tensors and opt._rank == 0 and \
                not any(SHARE in opt.state[p] for p in tensors):
            log.warning("onebit: sparse_rows=True on a state saved without it (or before it): "
                        "which tensors are sparse in rows is read at the freeze, which this "
                        "run did not see; every tensor goes on sending m, as the run that "
                        "saved it did")
        rebuilt = 0
        for unit in opt.units:
            for p in unit.params:
                state = opt.state[p]
                if self.local_variance is None:
                    self._paper_state(opt, unit, p, state)
                    continue
                denom, hypers = unit.view(p, unit.denom), unit.hypers[p]
                if "exp_avg_sq" not in state:  # phase B saved without local_variance
                    state["exp_avg_sq"] = (denom - hypers["eps"]).clamp(min=0.0).square_().mul_(
                        1 - hypers["betas"][1] ** state["frozen_step"])
                    rebuilt += 1
                # Checkpoints hold the denominators as they are: between refreshes they are
                # not the ranks' variances' (members.local_variance).
                state["frozen_denominator"] = denom
        if rebuilt and opt._rank == 0:
            log.warning("onebit: local_variance=True on a phase-B state saved without it: the "
                        "variances of %d parameter tensors are rebuilt from their saved "
                        "denominators (to rounding); every rank feeds its own from now on, "
                        "not bit for bit the run that saved it", rebuilt)

    def _paper_state(self, opt, unit, p, state: dict) -> None:
        """A ``local_variance`` state resumed without it: its noise ratios are dropped; in
        phase B its variance too (the denominators, made from the saved ones, stay, as the
        paper's phase B keeps them), in phase A its saved denominators (the variance rules
        from the next refresh on)."""
        state.pop(local_variance_module.NOISE, None)
        if "exp_avg_sq" not in state or "frozen_denominator" not in state:
            return
        if self.schedule(opt.total_steps).phase(max(opt.global_step, 1)) == "B":
            del state["exp_avg_sq"]
            state["frozen_denominator"] = unit.view(p, unit.denom)
        else:
            del state["frozen_denominator"]

    def agreement(self, total_steps: int | None) -> dict[str, int]:
        def number(v):
            return -1 if v == AUTO else v
        return {"var_freeze_step": number(self.var_freeze_step),
                "var_update_scaler": self.var_update_scaler,
                "local_step_scaler": number(self.local_step_scaler),
                "local_step_clipper": self.local_step_clipper,
                "total_steps (0/1 Adam)": total_steps or 0,
                # Both change what is sent (sparse_rows how the units are cut, too).
                "local_variance": int(self.local_variance is not None),
                "sparse_rows": int(self.sparse_rows_bound is not None)}


class ZeroOneAdam(OneBitOptimizer):
    """0/1 Adam as a ``torch.optim.Optimizer``, with DeepSpeed's ``ZeroOneAdam`` argument
    names (module docstring; docs/usage.md, "0/1 Adam").

    Use it like ``OneBitAdam``: in every process of a data-parallel job, with or without DDP
    (:func:`onebit_plugin.register_onebit_hook`; the Lightning and Fabric strategies and
    ``onebit-run --optimizer zero_one_adam`` register it). Between syncs in phase B every rank
    holds its own parameters, by design; they are bit-identical right after every sync, and the
    run's last step (``total_steps``) is a sync.

    Args:
        params, lr, betas, eps: as for ``torch.optim.Adam``.
        weight_decay: decoupled (AdamW) decay by default, as DeepSpeed's ``ZeroOneAdam``
            applied it; ``decoupled_weight_decay=False`` adds it to the gradient (Adam's L2).
        var_freeze_step: phase A (variance refreshes) runs to step ``var_freeze_step + 1``,
            as DeepSpeed's did (it froze the variance after the first step past it); ``"auto"``
            (default): from ``total_steps``
            (``onebit_plugin.settings.schedule.auto_var_freeze_step``).
        var_update_scaler: refreshes per interval before the refresh interval doubles (16).
        local_step_scaler: phase-B steps before the local interval doubles; ``"auto"``
            (default): the interval reaches ``local_step_clipper`` after a quarter of phase B.
        local_step_clipper: the largest local interval (16).
        total_steps: optimizer steps of the whole run (the integrations fill it in); needed by
            the ``"auto"`` settings, and the last step syncs.
        local_variance: every rank folds its own gradients into its own variance on every step,
            and the refreshes (phase A's, and phase B's every ``PHASE_B_INTERVAL`` steps)
            average the ranks' variances instead of one step's gradients (True, the default;
            ``onebit_plugin.members.local_variance``); False: the paper's variance, moved by
            the refresh steps' averaged gradients alone, frozen in phase B.
        sparse_rows: a tensor whose gradient is sparse in rows (an embedding's: half or more
            of the rows seen are zero in the last exact step's averaged gradient,
            ``onebit_plugin.maths.sparse_rows``) gets momentum units of its own that send
            each rank's ``m / denom`` clamped at +-``(1 - b1) / sqrt(1 - b2)`` (Adam's own
            largest step on one gradient, 3.16 at the default betas, which also bounds those
            units' steps) instead of ``m``, in phase A and at the syncs (True, the default);
            False: every tensor sends ``m``, as the paper's.

    The family's options (``OneBitAdam``'s docstring): ``max_block``, ``scale``,
    ``mask_zero_variance``, ``masks``, ``process_group``, ``average_grads``, ``bound_update``
    (a sync moves the common point by at most ``lr`` per step, a local step a rank's by at
    most ``sqrt(W) * lr``: ``onebit_plugin.members.local_steps.local_bound``; ``lr`` times
    ``(1 - b1) / sqrt(1 - b2)`` for the row-sparse tensors of ``sparse_rows``),
    ``comm_timeout``, ``bucket_cap_mb``, ``max_skipped_steps``, ``master_weights``,
    ``follow_variance`` (default **False** here: True makes the denominators follow each
    block's scale from each refresh on, updated at the syncs; not the default, see the
    comment on ``family_defaults``).
    """

    # follow_variance is off unless asked: measured on 2,000-step runs it helped char_mlp
    # (+3.45% against Adam, +5.33% frozen) and cost bow_topics (+11.0%, +4.22% frozen;
    # docs/benchmarks.md, "Wider workloads").
    family_defaults = {"follow_variance": False}

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        var_freeze_step: int | str = AUTO,
        var_update_scaler: int = 16,
        local_step_scaler: int | str = AUTO,
        local_step_clipper: int = 16,
        *,
        decoupled_weight_decay: bool = True,
        local_variance: bool = True,
        sparse_rows: bool = True,
        masks: dict[torch.Tensor, torch.Tensor] | None = None,
        process_group: dist.ProcessGroup | None = None,
        **options: Unpack[FamilyOptions],
    ):
        check_hparams(lr, betas, eps, weight_decay)
        _check_schedule(var_freeze_step, var_update_scaler, local_step_scaler,
                        local_step_clipper)
        for name, value in (("local_variance", local_variance), ("sparse_rows", sparse_rows)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        if local_variance and options.get("follow_variance"):
            raise ValueError("ZeroOneAdam: follow_variance=True follows a variance that the "
                             "refreshes alone move, block by block; local_variance=True (the "
                             "default) feeds every coordinate's from every step instead: pass "
                             "local_variance=False with follow_variance=True")
        for name, value in self.family_defaults.items():
            options.setdefault(name, value)
        # The base's exact stage: Adam until the refresh interval first doubles.
        config = member_config(
            type(self), exact_steps(var_freeze_step, var_update_scaler), options,
            refused={"freeze_step": "that is 1-bit Adam's warm-up; 0/1 Adam's variance is "
                                    "refreshed to var_freeze_step instead (default 'auto')",
                     "refresh_interval": "0/1 Adam refreshes its variance on its own schedule "
                                         "(var_update_scaler, var_freeze_step)",
                     "compress_momentum": "0/1 Adam's syncs and phase-A steps are its 1-bit "
                                          "exchange (OneBitAdam(compress_momentum=False) is "
                                          "the exact ablation)"})
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=decoupled_weight_decay)
        policy = ZeroOnePolicy(var_freeze_step, var_update_scaler, local_step_scaler,
                               local_step_clipper, config.follow_variance, local_variance,
                               sparse_rows)
        super().__init__(params, defaults, config, policy, masks=masks,
                         process_group=process_group)

    def switch_message(self) -> str | None:
        """The end of the exact stage in one line, with the schedule that follows (logged at
        INFO on rank 0, shown by the Lightning callback); None before."""
        if self.switch_step is None:
            return None
        first = (f"onebit: 0/1 Adam was Adam for {self.switch_step} steps; from step "
                 f"{self.switch_step + 1} the momentum is "
                 f"{self.policy.exchange.describe(self.world_size)}{self._sparse_rows()}")
        try:
            s = self.policy.schedule(self.total_steps)
        except ValueError:  # "auto" without the run's length: the next step raises, saying so
            return first
        local = self.policy.local_variance is not None
        # The paper's refreshes count the exact stage's steps (each refreshes the variance in
        # full precision); local_variance's averages come after it.
        skip = self.switch_step if local else 0
        refreshed = (f"every rank's gradients folded into its own variance, the ranks' "
                     f"variances averaged in {'fp32' if self.config.warmup_bits == 32 else 'bf16'}"
                     if local else "the variance refreshed in full precision")
        if s.total_steps is not None and s.last_a >= s.total_steps:
            return (f"{first} and {refreshed} on "
                    f"{refreshes_until(s.total_steps, s.var_update_scaler) - skip} steps to the "
                    f"run's end (var_freeze_step + 1 = {s.last_a} >= total_steps="
                    f"{s.total_steps}: no local steps in this run)")
        then = ""
        if local:
            every = local_variance_module.PHASE_B_INTERVAL
            then = (f", the variances averaged again at the first sync of every {every} steps"
                    if s.total_steps is None or s.total_steps // every > s.last_a // every
                    else f" (phase B's variance averages fall every {every} steps: none in "
                         f"this run)")
        return (f"{first}, {refreshed} on "
                f"{refreshes_until(s.last_a, s.var_update_scaler) - skip} steps to step "
                f"{s.last_a} (var_freeze_step + 1, as DeepSpeed counts), then local steps, the "
                f"interval doubling every "
                f"{s.local_step_scaler} steps up to {s.local_step_clipper}{then}")

    def _sparse_rows(self) -> str:
        """What the switch line says of ``sparse_rows``'s tensors ("" none)."""
        shapes = [tuple(p.shape) for p in compression_stage.sparse_rows(self)]
        if not shapes or self.world_size < 2:
            return ""
        return (f" (the {len(shapes)} tensor(s) whose gradients are sparse in rows, of shapes "
                f"{', '.join(map(str, shapes))}, as m / denom clamped at Adam's own largest "
                f"step, +-{self.policy.sparse_bound(self.param_groups[0]):.2f}: sparse_rows)")

    # ------------------------------------------------------------------------------ progress
    @property
    def phase(self) -> str:
        """``"warmup"`` (Adam), ``"A"`` (refreshes and 1-bit momentum) or ``"B"`` (local
        steps), at the last step taken."""
        if self.switch_step is None:
            return "warmup"
        return self.policy.schedule(self.total_steps).phase(self.global_step)

    @property
    def variance_refreshes(self) -> int:
        """Full-precision steps that updated the variance so far (warm-up's included)."""
        schedule = self.policy.schedule(self.total_steps) if self.switch_step is not None \
            else None
        if schedule is None:
            return self.global_step - self.skipped_steps
        return refreshes_until(min(self.global_step, schedule.last_a),
                               schedule.var_update_scaler)

    def progress(self) -> dict[str, float]:
        """The base's, plus ``phase`` (0 Adam, 1 phase A, 2 phase B), ``variance_refreshes``,
        ``local_interval`` (0 before phase B) and ``syncs``."""
        return {**super().progress(), "phase": float(("warmup", "A", "B").index(self.phase)),
                "variance_refreshes": float(self.variance_refreshes),
                "local_interval": float(self.local_interval or 0), "syncs": float(self.syncs)}

    @property
    def local_interval(self) -> int | None:
        """Phase B's current interval between syncs (None before phase B)."""
        if self.phase != "B":
            return None
        return self.policy.schedule(self.total_steps).interval(self.global_step)
