"""What a member of the 1-bit family decides, as a small policy over the shared base
(``onebit_plugin.core.base.OneBitOptimizer``), in the manner of torchao's optimizers (thin classes
over a base, pure update functions in ``onebit_plugin.maths.update``). docs/family.md shows how a
member
is written.

A policy answers three questions, and the base does everything else (parameter groups and
state, the exact warm-up's averaging, momentum units, communicators, the DDP hook's hand-off,
clipping, rank checks, checkpoints):

* what is exchanged in the compression stage: its :class:`Exchange` (the 1-bit allreduce, or an
  exact one for the ablation ``compress_momentum=False``);
* how the update is made: :meth:`Policy.warmup_update_` on averaged gradients and
  :meth:`Policy.compression_update_` from the averaged momentum and the frozen denominator;
* when the stage changes: :meth:`Policy.stage_changes` (by default the member's
  ``freeze_step``, or ``"auto"``);
* what each compression-stage step exchanges (:meth:`Policy.exchange_at`): the momentum (1-bit
  Adam, every step), or, for 0/1 Adam, averaged gradients that refresh the variance, nothing
  (a local step) or the local steps' accumulated update (a sync).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from onebit_plugin.comm.allreduce import ExactAllreduce, OneBitAllreduce
from onebit_plugin.core import compression_stage
from onebit_plugin.core.exchanges import MomentumStep, StepExchange
from onebit_plugin.core.gradient_average import GradientAverage
from onebit_plugin.core.variance_follow import VarianceFollow
from onebit_plugin.core.warmup_stage import warmup_step
from onebit_plugin.maths.freeze import CEILING
from onebit_plugin.maths.update import adam_update_, frozen_update_
from onebit_plugin.settings.step_kinds import EXACT, MOMENTUM
from onebit_plugin.wire.deferred import as_fp32

log = logging.getLogger("onebit_plugin")

__all__ = ["AdamPolicy", "ExactMomentum", "Exchange", "OneBitMomentum", "OverDenominator",
           "Policy"]


class Exchange:
    """What the compression stage sends for each momentum unit: the wire of the momentum
    step (``exchanges.MomentumStep``), which makes its communicator."""

    #: what the error buffers are residuals of; a checkpoint's errors of another kind are not
    #: loaded (``checkpoint.load_unit_errors``)
    sent = "momentum"
    #: each rank's ``m / denom`` is sent (clamped to +-this where the bound is on) instead of
    #: its momentum ``m``; None: ``m`` (:class:`OverDenominator`)
    send_bound: float | None = None

    #: the stage switch's line says the momentum is "{describe}" from then on
    def describe(self, world: int) -> str:
        raise NotImplementedError

    def communicator(self, group, world: int, *, max_block: int, scale: str, timeout,
                     error_dtype: str = "float32"):
        """The communicator that averages the units (``onebit_plugin.comm.allreduce``);
        ``error_dtype``: its error buffers' (``OneBitAllreduce``)."""
        raise NotImplementedError


class OneBitMomentum(Exchange):
    """The momentum as 1-bit signs with worker and server error feedback (Tang et al., 2021).
    A single process has nothing to send: exact, so it is the member with a frozen variance."""

    def describe(self, world: int) -> str:
        if world > 1:
            return "exchanged as 1-bit signs"
        return ExactMomentum().describe(world)

    def communicator(self, group, world: int, *, max_block: int, scale: str, timeout,
                     error_dtype: str = "float32"):
        if world > 1:
            return OneBitAllreduce(group, max_block=max_block, scale=scale, timeout=timeout,
                                   error_dtype=error_dtype)
        return ExactMomentum().communicator(group, world, max_block=max_block, scale=scale,
                                            timeout=timeout)


class ExactMomentum(Exchange):
    """The momentum averaged by an exact fp32 allreduce: the ablation that separates freezing
    the variance from compressing (``compress_momentum=False``)."""

    def describe(self, world: int) -> str:
        return "averaged exactly in fp32 (compress_momentum=False or one process)"

    def communicator(self, group, world: int, *, max_block: int, scale: str, timeout,
                     error_dtype: str = "float32"):
        return ExactAllreduce(group, timeout=timeout)


class OverDenominator(Exchange):
    """``inner``'s exchange of each rank's momentum over the frozen denominator, ``m / (sqrt(v_hat)
    + eps)`` (Adam's update direction), clamped to +-:attr:`BOUND` before it is sent; the average
    comes back times the denominator (``MomentumUnit.reduce_``). 1-bit LAMB's.

    Why: a block's 1-bit scale is the RMS of its values. Sent as ``m``, a coordinate whose frozen
    variance is tiny (a rare embedding row) decodes to its block's ``+-scale`` over its tiny
    denominator, a huge step; bounding the decoded step instead (1-bit Adam's ``bound_update``)
    also clips the many frequent coordinates whose decoded ``+-scale`` exceeds their own
    denominator. Sent as ``m / denom`` every coordinate is on the scale of its own step. The
    clamp bounds each rank's input (what it cuts off is dropped, not fed back), so the error
    feedback works on what is sent and the decoded average is not clipped again; and it bounds
    the momentum itself (the average times the denominator becomes ``exp_avg``), also where
    nothing is compressed (``compress_momentum=False``, one process): a rare row's gradients
    outgrow its frozen variance with or without compression (a new user's 60-step run without
    the clamp, uncompressed: an embedding value of 573 against LAMB's 6.4). On the large-batch
    workload (docs/benchmarks.md, "1-bit LAMB, large batch"; 3 seeds, 240 steps, lr 0.005,
    frozen at 20% of the run) the final validation loss against LAMB's: ``m`` with the decoded
    step bounded at 1, +5.40%; ``m / denom`` clamped at 1, +2.61%; at 2, +0.89%; at 3, +0.69%;
    not clamped, +0.77% with the embedding's largest value 3.7 times LAMB's (1.2 times when
    clamped). Frozen at 15% (the default now), clamped at 3: -0.23%. 3 is near
    ``(1 - b1) / sqrt(1 - b2)`` = 3.16, Adam's own step on a coordinate's first gradient after
    a long quiet, at the default betas.

    Costs, in the compression stage: the fold is written to the unit's fold buffer (4 bytes
    per value that the CPU kernel's fused fold otherwise saves) and read by six passes more
    (divide, finiteness, clamp, the NaN fill, decode, multiply), the first four on the thread
    that hands the unit over (inside backward under the DDP hook). The bytes sent are the
    same."""

    BOUND = 3.0
    sent = "momentum/denominator"

    def __init__(self, inner: Exchange, bound: bool = True):
        self.inner = inner
        self.send_bound = self.BOUND if bound else math.inf

    def describe(self, world: int) -> str:
        return f"{self.inner.describe(world)}, divided by the frozen denominator"

    def communicator(self, group, world: int, *, max_block: int, scale: str, timeout,
                     error_dtype: str = "float32"):
        return self.inner.communicator(group, world, max_block=max_block, scale=scale,
                                       timeout=timeout, error_dtype=error_dtype)


class Policy:
    """A member's decisions; subclass it and give the base an instance."""

    #: ``freeze_step="auto"``'s latest freeze, as a fraction of ``total_steps``
    auto_ceiling = CEILING
    #: Whether the compression stage still updates the variance (:meth:`refresh_moments_`):
    #: else its memory becomes the frozen denominator, and checkpoints hold that instead.
    keeps_variance = False
    #: :class:`~onebit_plugin.core.variance_follow.VarianceFollow` where the frozen
    #: denominators follow the averaged gradients' scale (``follow_variance``); None: frozen
    follow: VarianceFollow | None = None
    #: where set, a tensor whose gradient is sparse in rows (``maths.sparse_rows``, read at
    #: the freeze) gets momentum units of its own that send ``m / denom`` clamped at
    #: +-:meth:`sparse_bound` (:class:`OverDenominator`'s wire), the other units what
    #: :attr:`exchange` sends (0/1 Adam's ``sparse_rows``); None: every unit alike
    sparse_rows_bound: float | None = None
    #: what the DDP hook notes of each local gradient it folds, for a variance each rank feeds
    #: with its own gradients (0/1 Adam's ``local_variance``: its ``note(grad, t)``); None
    local_variance = None

    def __init__(self, exchange: Exchange):
        self.exchange = exchange
        #: the exact stage's exchange: the fp32 gradient average, then the warm-up's update
        self.warmup: StepExchange = GradientAverage(warmup_step)
        #: the compression stage's exchanges, by the word :meth:`exchange_at` says
        self.exchanges: dict[str, StepExchange] = {MOMENTUM: MomentumStep(exchange)}

    def sparse_bound(self, group: dict) -> float | None:
        """The clamp of a row-sparse tensor's ``m / denom`` in parameter group ``group``
        (:attr:`sparse_rows_bound`), also its steps' bound (``MomentumUnit.step_bound``)."""
        return self.sparse_rows_bound

    def step_exchange(self, t: int, total_steps: int | None, compressing: bool
                      ) -> StepExchange:
        """The exchange of step ``t`` (``onebit_plugin.core.exchanges``): :attr:`warmup` in the
        exact stage, else the one :meth:`exchange_at` names."""
        if not compressing:
            return self.warmup
        return self.exchanges[self.exchange_at(t, total_steps)]

    def step_exchanges(self) -> list[StepExchange]:
        """Every exchange this policy may choose (their buffers: ``onebit_plugin.core.memory``)."""
        return [self.warmup, *self.exchanges.values()]

    def warmup_update_(self, group: dict, params: list[torch.Tensor], states: list[dict],
                       masters: list[torch.Tensor | None]) -> None:
        """The exact stage's update of ``params`` (one parameter group's, each with a finite
        averaged ``p.grad``): advances each ``state["step"]``, updates ``exp_avg`` and
        ``exp_avg_sq`` and the parameters (through ``masters`` where given)."""
        raise NotImplementedError

    def compression_update_(self, group: dict, params: list[torch.Tensor], exp_avgs, denoms,
                            counts: list[float], *, bound: float | None, masters, averaged,
                            states) -> None:
        """The compression stage's update of ``params``: ``averaged`` (the averaged momenta,
        or their parts still encoded) becomes ``exp_avgs``, and the parameters move by it over
        the frozen ``denoms`` (sqrt(v_hat) + eps); ``counts``: their step counts; ``states``:
        their optimizer state dicts (a member's own entries)."""
        raise NotImplementedError

    def first_step_(self, group: dict, x: torch.Tensor, m: torch.Tensor, denom: torch.Tensor,
                    count: float, bound: float | None) -> bool:
        """A woken row's own step at its wake (``maths.late_rows``), on copies of its rows:
        ``x`` its fp32 values (moved in place), ``m`` its seeded momentum, ``denom`` its seeded
        denominator, ``count`` its step count, ``bound`` the step's clamp. False where the
        member takes none (the row moves from the next step on): by default."""
        return False

    def freeze_(self, state: dict) -> None:
        """At the end of the exact stage, per trainable parameter (its optimizer state, whose
        variance becomes the frozen denominator when the compression stage starts): what the
        member keeps of it. Nothing by default."""

    def stage_changes(self, applied: int, freeze_due: Callable[[int], bool]) -> bool:
        """After applied step ``applied`` of the exact stage: whether the compression stage
        starts now. ``freeze_due``: the member's ``freeze_step`` rule (a fixed step or
        ``"auto"``)."""
        return freeze_due(applied)

    def exchange_at(self, t: int, total_steps: int | None) -> str:
        """What compression-stage step ``t`` (``global_step`` once it is taken) of a run of
        ``total_steps`` (None: not known) exchanges, a word of ``onebit_plugin.settings.step_kinds``
        and a key of :attr:`exchanges`: ``"momentum"`` here; a member with refreshes or local
        steps says ``"exact"``, ``"local"`` or ``"sync"`` where it has them."""
        return MOMENTUM

    def after_freeze(self, config) -> str:
        """What the stage switch's line adds about the variance after the freeze ("" none)."""
        return ""

    def rank_state(self, opt) -> dict | None:
        """This rank's own state of the member beyond the parameters' state dicts, which a
        checkpoint carries per rank (0/1 Adam's between syncs); None: nothing."""
        return None

    def own_variances(self, opt) -> list | None:
        """This rank's own variances, where they differ from the other ranks' (0/1 Adam's
        ``local_variance``), which a checkpoint carries per rank; None: they do not."""
        return None

    def load_own_variances(self, opt, saved: list | None) -> None:
        """Take a checkpoint's :meth:`own_variances` back (after the parameters' state)."""
        if saved is not None:
            raise ValueError(f"this checkpoint holds each rank's own variance (ZeroOneAdam's "
                             f"local_variance), which {type(self).__name__} has no use for: "
                             "resume it with ZeroOneAdam")

    def load_rank_state(self, opt, saved: dict | None) -> None:
        """Take a checkpoint's :meth:`rank_state` back (after the parameters' state)."""
        if saved is not None:
            raise ValueError(f"this checkpoint holds local-step state (0/1 Adam's, saved "
                             f"between syncs), which {type(self).__name__} has no use for: "
                             "resume it with ZeroOneAdam")

    def apart(self, opt) -> int:
        """Local steps taken since the ranks were last on one point (0: they are; a member
        without local steps is always there)."""
        return 0

    def sync_now(self, opt) -> None:
        """Bring every rank to one point now, between steps (``sync_local_steps``); a
        collective. Nothing by default."""

    def sync_point(self, opt) -> list | None:
        """What every rank must hold alike while :meth:`apart` (the first step's rank check
        compares it instead of the parameters); None at a common point."""
        return None

    def buffers(self) -> list:
        """``(name, tensor)`` of every buffer the policy and its exchanges hold
        (``onebit_plugin.core.memory``)."""
        return [*(b for exchange in self.step_exchanges() for b in exchange.buffers()),
                *(self.follow.buffers() if self.follow is not None else []),
                *(self.local_variance.buffers() if self.local_variance is not None else [])]

    def units_built(self, opt) -> None:
        """The momentum units were just built (at the first compression-stage step, or after
        a resume): a member's own state over them is made here."""

    def agreement(self, total_steps: int | None) -> dict[str, int]:
        """The member's own settings every rank must share, as integers."""
        return {}

    def use_shards(self, shards) -> None:
        """The optimizer steps FSDP2 shards (``onebit_plugin.comm.shards.Shards``): a member
        whose update reads a whole tensor at once (a norm) sums it over the host through them.
        The Adam members' updates are elementwise: nothing to do."""

    def refresh_moments_(self, group: dict, params: list[torch.Tensor], grads, states,
                         exp_avgs) -> None:
        """An :data:`EXACT` compression-stage step: fold the averaged ``grads`` into the
        momenta ``exp_avgs`` and the variances (``states``' ``exp_avg_sq``, whose
        ``frozen_step`` counts the variance's updates); the base then refreshes the
        denominators and applies :meth:`compression_update_`."""
        raise NotImplementedError(f"{type(self).__name__} has no variance refreshes")


class AdamPolicy(Policy):
    """1-bit Adam: Adam (or AdamW) during the warm-up, then Adam with a frozen variance.

    ``refresh_interval=N``: the variance does not stay frozen; every compression-stage step
    ``t`` with ``t % N == 0`` is a refresh instead of a 1-bit step (the gradients averaged in
    ``warmup_bits``, the momentum and the variance updated from them, the refresh weighing the
    steps since the variance last changed, ``N`` or fewer for the first after the freeze:
    :meth:`refresh_moments_`). Why: Adam's variance keeps moving after the freeze, coordinate by
    coordinate (``char_mlp``: the median coordinate's ``sqrt(v_hat)`` 1.81x in one layer, 0.29x
    in another, from step 400 to 2,000), and a frozen denominator gets the steps wrong by as
    much (docs/benchmarks.md, "Wider workloads (issue 44)").

    ``follow_variance`` (the default): between refreshes, or with none, each block's
    denominator follows the averaged gradients' scale, for 1/128 bit per value a step
    (``onebit_plugin.core.variance_follow``)."""

    def __init__(self, exchange: Exchange, refresh_interval: int | None = None,
                 follow_variance: bool = False):
        super().__init__(exchange)
        self.refresh_interval = refresh_interval
        self.follow = VarianceFollow() if follow_variance else None
        if refresh_interval is not None:
            self.keeps_variance = True
            self.exchanges[EXACT] = GradientAverage(compression_stage.refresh_step)

    def exchange_at(self, t: int, total_steps: int | None) -> str:
        # A pure function of t: a resumed run refreshes where the uninterrupted one did.
        if self.refresh_interval is not None and t % self.refresh_interval == 0:
            return EXACT
        return MOMENTUM

    _said_rebuilt = False

    def _rebuild_variance(self, state: dict, beta2: float, eps: float) -> None:
        """A checkpoint saved without refreshes holds the frozen denominator, not the
        variance: the variance is rebuilt from it, ``v = (denom - eps)**2 * (1 - b2**n)``
        (to rounding), said once."""
        denom = state.pop("frozen_denominator")
        state["exp_avg_sq"] = (denom - eps).clamp_(min=0.0).square_().mul_(
            1 - beta2 ** state["frozen_step"])
        if not self._said_rebuilt:
            self._said_rebuilt = True
            log.warning("onebit: refresh_interval on a state saved without it: the variance "
                        "is rebuilt from the saved frozen denominator (to rounding) at the "
                        "first refresh; the run goes on from there, not bit for bit as one "
                        "that refreshed from the start")

    def after_freeze(self, config) -> str:
        if self.refresh_interval is None:
            return ""
        return (f" (the variance refreshed on every step that is a multiple of "
                f"{self.refresh_interval}, in {config.warmup_bits}-bit like the warm-up)")

    def warmup_update_(self, group, params, states, masters) -> None:
        counts = [state["step"] for state in states]
        torch._foreach_add_(counts, 1.0)
        adam_update_(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                     [s["exp_avg_sq"] for s in states], [c.item() for c in counts],
                     lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                     eps=group["eps"], weight_decay=group["weight_decay"],
                     decoupled=group["decoupled_weight_decay"], masters=masters)

    def compression_update_(self, group, params, exp_avgs, denoms, counts, *, bound, masters,
                            averaged, states) -> None:
        frozen_update_(params, exp_avgs, denoms, counts, lr=group["lr"],
                       beta1=group["betas"][0], weight_decay=group["weight_decay"],
                       decoupled=group["decoupled_weight_decay"], bound=bound,
                       masters=masters, averaged=averaged)

    def first_step_(self, group, x, m, denom, count, bound) -> bool:
        # Adam's own first step on a row whose moments were zero: the seeded momentum and
        # denominator are Adam's after that gradient, so this is the step Adam takes there
        # (bounded as the others'); the group's decay already moved the row this step.
        frozen_update_([x], [m], [denom], [count], lr=group["lr"], beta1=group["betas"][0],
                       weight_decay=0.0, decoupled=True,
                       bound=None if bound is None else [bound])
        return True

    def refresh_moments_(self, group, params, grads, states, exp_avgs) -> None:
        beta1, beta2 = group["betas"]
        for s in states:
            if "exp_avg_sq" not in s:
                self._rebuild_variance(s, beta2, group["eps"])
        g = [as_fp32(x) for x in grads]
        if group["weight_decay"] != 0 and not group["decoupled_weight_decay"]:
            g = torch._foreach_add(g, [as_fp32(p) for p in params], alpha=group["weight_decay"])
        torch._foreach_lerp_(exp_avgs, g, 1 - beta1)
        # A refresh stands for every step since the previous one, as if each of them had
        # brought this gradient: v <- b2**gap * v + (1 - b2**gap) * g*g, and the bias
        # correction's count (frozen_step) advances by the gap, to this step. Counted one step
        # each (0/1 Adam's paper, DeepSpeed's), its 16 refreshes of steps 1-16 held 24% of the
        # variance's weight at step 240 (var_update_scaler=16), against 6% in Adam's.
        by_gap: dict[float, tuple[list, list]] = {}
        for s, x in zip(states, g, strict=True):
            gap = max(float(s["step"]) + 1.0 - s["frozen_step"], 1.0)
            s["frozen_step"] += gap
            by_gap.setdefault(gap, ([], []))
            by_gap[gap][0].append(s["exp_avg_sq"])
            by_gap[gap][1].append(x)
        for gap, (variances, xs) in by_gap.items():
            keep = beta2 ** gap
            torch._foreach_mul_(variances, keep)
            torch._foreach_addcmul_(variances, xs, xs, value=1 - keep)
