"""DDP communication hook: OneBitAdam's averaging inside backward, one bucket at a time.

DDP allows one comm hook per model, so one hook serves both stages and switches on the
optimizer's stage, the way torch's ``PowerSGDState.start_powerSGD_iter`` switches PowerSGD on:

* warm-up: a mean allreduce of the bucket, the same numbers as DDP's default
  (``buffer * (1 / W)``, then a sum allreduce);
* compression stage: as soon as every *local* gradient of one of the optimizer's momentum units
  is in, the unit's fold of them is computed and averaged on the process group's background
  thread while backward goes on. The averaged momentum comes back as the bucket's "gradient"
  and ``OneBitAdam.step()`` takes it from ``p.grad``. Gradient clipping must therefore go through
  ``OneBitAdam.clip_grad_norm_``, which clips the gradient inside the momentum using the
  norms and sketches of the local gradients the hook noted; torch's ``clip_grad_norm_`` on
  ``p.grad`` would clip the momentum itself (``step()`` says so once).

  A unit completed only by the last bucket has no backward left to overlap with: averaged in
  the background, it would still be waited for before backward returns, and cost a hand-off
  and one more pass (the average copied into the bucket). When the DDP model keeps its
  gradients as views of its buckets (``gradient_as_bucket_view=True``, which the strategies
  set), such units -- those that completed with the last bucket in the previous iteration, or
  do in this one -- are left to ``step()``: their local gradients stay in ``p.grad``,
  ``step()`` folds and averages them (the ``overlap=False`` path, the same numbers). Either
  way the views' version counts tell ``step()``, at no cost, whether anything changed
  ``p.grad`` in between. For a model below one bucket, that is all of it. Without bucket
  views, DDP copies every gradient into its buckets and back and a change could only be seen
  by comparing values: every unit is then averaged in backward, and ``step()`` compares each
  averaged momentum with ``p.grad``.

With ``overlap=False`` the compression-stage hook passes the local gradients through and
``step()`` folds and averages the same units itself: the same numbers, without the overlap.
The DDP model and the optimizer must hold the same trainable parameters, at registration and at
every step (a parameter unfrozen later is not in DDP's reducer): else a clear error.
"""

# No "from __future__ import annotations": DDP checks the hook's annotations as objects.
import contextlib
import logging
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from onebit_plugin.comm.collectives import comm_executor
from onebit_plugin.core.base import OneBitOptimizer
from onebit_plugin.core.momentum import MomentumUnit

__all__ = ["OneBitHookState", "onebit_hook", "register_onebit_hook"]

log = logging.getLogger(__name__)


class OneBitHookState:
    """State of :func:`onebit_hook` for one DDP model.

    Args:
        optimizer: the ``OneBitAdam`` that steps the DDP model's parameters; the hook follows its
            stage and folds into its momentum units.
        process_group: the DDP model's group.
        overlap: average the momentum units inside backward (True) or leave it to
            ``OneBitAdam.step()`` (False).
        record_timeline: keep ``(bucket index, hook called, allreduce done)`` perf-counter
            times of compression-stage buckets in ``timeline`` (for overlap checks).
        bucket_bytes: DDP's bucket size, the momentum units' size unless the optimizer's
            ``bucket_cap_mb`` says otherwise.
        bucket_views: the DDP model's ``gradient_as_bucket_view``: the gradients DDP hands
            the hook are then ``p.grad`` itself, and units completed by the last bucket are
            left to ``step()`` (module docstring).

    The hook's collectives (warm-up and units) run on the optimizer's ``comm_group``, a group of
    their own made here (so every rank must construct this state at the same point, as DDP
    itself requires) with the optimizer's ``comm_timeout``; its one background thread keeps the
    units' collectives in one order and apart from what DDP sends on its own group. Pickling
    drops the process groups and the pending iteration.
    """

    __slots__ = (
        "process_group", "comm_group", "world_size",  # communication
        "optimizer", "overlap",  # the optimizer whose stage and units the hook follows
        "remaining", "pending",  # this iteration: gradients to come per unit, its pending average
        "grads",  # this iteration: the gradients in so far per unit
        "bucket_views", "deferred", "to_defer",  # units left to step(): this iteration, the next
        "submitted",  # this iteration: a unit went to the background thread
        "record_timeline", "timeline",  # diagnostics
    )

    def __init__(
        self,
        optimizer: OneBitOptimizer,
        process_group: dist.ProcessGroup | None = None,
        overlap: bool = True,
        record_timeline: bool = False,
        bucket_bytes: int = 25 * 2**20,
        bucket_views: bool = False,
        comm_timeout: float | None = None,
    ):
        self.optimizer = optimizer
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.overlap = overlap
        self.comm_group = optimizer.use_ddp_hook(process_group, overlap, bucket_bytes,
                                                 comm_timeout)
        self.remaining: dict[MomentumUnit, int] = {}
        self.pending: dict[MomentumUnit, torch.futures.Future] = {}
        self.grads: dict[MomentumUnit, dict] = {}
        self.bucket_views = bucket_views
        # Units left to step() in this iteration, and those to leave to step() in the next
        # (they completed with the last bucket in this one).
        self.deferred: set[MomentumUnit] = set()
        self.to_defer: set[MomentumUnit] = set()
        self.submitted = False
        self.record_timeline = record_timeline
        self.timeline: list[tuple[int, float, float]] = []

    def arrived(self, unit: MomentumUnit, p: torch.Tensor, grad: torch.Tensor, last: bool
                ) -> torch.futures.Future:
        """``p``'s local gradient ``grad`` is in (``last``: in DDP's last bucket); once all of
        ``unit``'s are, start folding and averaging it, or leave it to ``step()``. Returns the
        future of this iteration's average of ``unit`` (done at once for a unit left to
        ``step()``)."""
        if unit not in self.pending:
            self.pending[unit] = torch.futures.Future()
            self.remaining[unit] = len(unit.params)
            self.grads[unit] = {}
        pending = self.pending[unit]
        self.remaining[unit] -= 1
        self.grads[unit][p] = grad
        if self.remaining[unit] == 0:
            del self.pending[unit], self.remaining[unit]
            grads = self.grads.pop(unit)
            if self.bucket_views and (last or unit in self.to_defer):
                self.deferred.add(unit)
                pending.set_result(None)
                return pending
            opt, handoff = self.optimizer, self.optimizer.handoff

            def done(fut: torch.futures.Future) -> None:
                try:
                    handoff.mark_averaged(unit, fut.value())
                    pending.set_result(None)
                except BaseException as exc:  # noqa: BLE001 - raised where DDP waits
                    pending.set_exception(exc)

            # The gradients are views of DDP's buckets, left alone until the futures complete.
            unit.submit(opt.communicator, grads).add_done_callback(done)
            self.submitted = True
        return pending

    def average_units(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """The compression stage's bucket: its local gradients folded into the momentum
        units, each unit averaged once all of its gradients are in (module docstring)."""
        opt = self.optimizer
        handoff = opt.handoff  # what this backward leaves for step()
        buffer = bucket.buffer()
        if not self.overlap:
            if self.bucket_views:  # p.grad itself: step() can tell whether it changed
                for p, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
                    handoff.hand_over(p, grad)
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(buffer)  # local gradients: OneBitAdam.step() folds and averages them
            return done
        started = time.perf_counter()
        # A parameter DDP still reduces but that was frozen when the variance froze is in no unit:
        # nothing of it is averaged (OneBitAdam.step() refuses it should it be trainable again).
        parts = [(p, grad, unit) for p, grad in zip(bucket.parameters(), bucket.gradients(),
                                                     strict=True)
                 if (unit := opt.unit_of(p)) is not None]
        last = bucket.is_last()
        deferred = self.deferred  # this iteration's set (the last bucket starts the next one's)
        waits = []
        for p, grad, unit in parts:
            if unit not in self.to_defer:  # else step() folds it
                # For clip_grad_norm_: p.grad will hold the average.
                handoff.note_local_gradient(p, grad, opt)
            pending = self.arrived(unit, p, grad, last)
            if all(pending is not w for w in waits):
                waits.append(pending)

        # The copy back into the bucket is issued on the stream backward produced the bucket on,
        # which DDP reads it on next: the callback itself may run on any thread and stream (a
        # future with devices runs its callbacks on a pool stream). The averaged momentum is
        # complete by then (its side stream was synchronized before the future was set).
        stream = torch.cuda.current_stream(buffer.device) if buffer.is_cuda else None

        def finish(fut: torch.futures.Future) -> torch.Tensor:
            for each in fut.value():
                each.value()  # re-raises a failed allreduce here, where DDP waits
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for p, grad, unit in parts:
                    if unit not in deferred:  # DDP hands the bucket's views to step()
                        unit.average_into(p, grad)
            # After the copies above, which count as writes to the bucket's every view.
            if self.bucket_views:
                for p, grad, _ in parts:
                    handoff.hand_over(p, grad)
            if self.record_timeline:
                self.timeline.append((bucket.index(), started, time.perf_counter()))
            return buffer

        if bucket.is_last():
            # DDP issues its own collectives on its group right after the last bucket's hook
            # returns (the used-parameter map with find_unused_parameters, then the next
            # forward's buffer broadcast). Two NCCL communicators driven from two threads on one
            # GPU may hang, and their order must match on every rank: so every unit's average is
            # finished first. Backward is over by then and DDP waits on these futures next, so
            # nothing overlaps less. Only the hook sends on that thread between steps (step()
            # waits for what it starts): when no unit went there in this iteration (all left to
            # step(), as for a model of one bucket) there is nothing to wait for, and the
            # hand-off to the thread and back, which on an oversubscribed CPU can wait for a
            # time slice, is skipped.
            if self.submitted:
                comm_executor(self.comm_group).submit(lambda: None).result()
            self.submitted = False
            if self.bucket_views:  # the units completed with the last bucket
                self.to_defer = {unit for _, _, unit in parts}
                self.deferred = set()
        return torch.futures.collect_all(waits).then(finish)

    def __getstate__(self):
        state = {slot: getattr(self, slot) for slot in self.__slots__}
        state.update(process_group=None, comm_group=None, remaining={}, pending={}, grads={},
                     deferred=set(), to_defer=set(), submitted=False)
        return state

    def __setstate__(self, state):
        for slot, value in state.items():
            setattr(self, slot, value)


def onebit_hook(
    state: OneBitHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The comm hook (``ddp_model.register_comm_hook(state, onebit_hook)``); see the module
    docstring. Use :func:`register_onebit_hook`, which also configures the optimizer. What the
    bucket's gradients become is the coming step's exchange's to say
    (``onebit_plugin.core.exchanges``): averaged exactly as DDP would (warm-up, a variance refresh),
    folded into the momentum units (:meth:`OneBitHookState.average_units`), or passed through
    (a local step)."""
    opt = state.optimizer
    opt.prepare_stage()
    return opt.exchange_for(opt.global_step + 1).in_backward(opt, state, bucket)


def register_onebit_hook(
    model: DistributedDataParallel,
    optimizer: OneBitOptimizer,
    *,
    overlap: bool = True,
    record_timeline: bool = False,
    comm_timeout: float | None = None,
) -> OneBitHookState:
    """Register :func:`onebit_hook` on a DDP model and hand the averaging to it.

    Call it once, on every rank, after wrapping the model in DDP and creating the optimizer.
    The optimizer stops averaging gradients itself (the hook does it in warm-up) and, with
    ``overlap``, its momentum units are averaged inside backward, in units of DDP's bucket size
    unless the optimizer's ``bucket_cap_mb`` says otherwise.

    ``comm_timeout`` (seconds) replaces the optimizer's: what an integration that did not
    construct the optimizer passes (a ``CommunicationError`` after that long).

    Returns the hook state (its ``overlap`` says which path runs).
    """
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(f"register_onebit_hook needs a DistributedDataParallel model, got "
                         f"{type(model).__name__}")
    if not isinstance(optimizer, OneBitOptimizer):
        raise ValueError(f"register_onebit_hook needs an optimizer of the 1-bit family "
                         f"(onebit_plugin.OneBitAdam), got {type(optimizer).__name__}")
    ddp_params = {p for p in model.parameters() if p.requires_grad}
    opt_params = {p for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
    if ddp_params != opt_params:
        # Either way some gradients would go un-averaged and the ranks drift apart.
        raise ValueError(
            f"onebit: the DDP model and OneBitAdam must hold the same trainable parameters; "
            f"{len(ddp_params - opt_params)} of the model's are not in OneBitAdam (the hook "
            f"would leave their gradients un-averaged in the compression stage) and "
            f"{len(opt_params - ddp_params)} of OneBitAdam's are not trainable in the model "
            "(DDP would never average them). Give OneBitAdam exactly the model's trainable "
            "parameters"
        )
    if not model.gradient_as_bucket_view:
        log.info("onebit: this DDP model was made without gradient_as_bucket_view=True: "
                 "DDP copies every gradient into its buckets and back at each step, and the "
                 "hook averages every momentum unit inside backward. "
                 "DistributedDataParallel(model, gradient_as_bucket_view=True) saves the copies "
                 "and lets the units the last bucket completes go to optimizer.step()")
    state = OneBitHookState(optimizer, model.process_group, overlap, record_timeline,
                            model.bucket_bytes_cap, model.gradient_as_bucket_view, comm_timeout)
    model.register_comm_hook(state, onebit_hook)
    return state
