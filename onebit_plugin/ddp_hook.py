"""DDP communication hook: OneBitAdam's averaging inside backward, one bucket at a time.

DDP allows one comm hook per model, so one hook serves both stages and switches on the
optimizer's stage, the way torch's ``PowerSGDState.start_powerSGD_iter`` switches PowerSGD on:

* warm-up: a mean allreduce of the bucket, the same numbers as DDP's default
  (``buffer / W``, then a sum allreduce);
* compression stage: the bucket's *local* gradients are folded into that bucket's momentum
  (``m = b1*m + (1-b1)*g``, the optimizer's ``state['exp_avg']`` being views of a per-bucket
  flat buffer) and the compressed allreduce of the momentum starts on a background thread, so
  it overlaps the rest of backward. The averaged momentum comes back as the bucket's
  "gradient"; ``OneBitAdam.step()`` takes it from ``p.grad`` and applies the frozen variance.

Gradient clipping between backward and ``step()`` therefore clips the averaged momentum in the
compression stage (the same tensor on every rank, so ranks stay identical); in warm-up it clips
the averaged gradient, as with plain DDP.

When the hook cannot own the momentum (the DDP model and the optimizer do not hold the same
trainable parameters), it falls back to the optimizer-side path and logs it: warm-up is the same,
and in the compression stage the bucket's local gradient is passed through untouched and
``OneBitAdam.step()`` runs one flat compressed allreduce.
"""

# No "from __future__ import annotations": DDP checks the hook's annotations as objects.
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from onebit_plugin.allreduce import CompressedAllreduce
from onebit_plugin.optimizer import WARMUP, OneBitAdam, _fold_gradient_

__all__ = ["OneBitHookState", "onebit_hook", "register_onebit_hook"]

log = logging.getLogger(__name__)


class _BucketState:
    """One DDP bucket's momentum (the optimizer's exp_avg are views of it) and its allreduce."""

    __slots__ = ("params", "version", "momentum", "comm", "folds")

    def __init__(self, state: "OneBitHookState", bucket: dist.GradBucket, previous):
        opt = state.optimizer
        buffer = bucket.buffer()
        self.params = tuple(bucket.parameters())
        self.version = opt.state_version
        self.momentum = torch.zeros(buffer.numel(), dtype=torch.float32, device=buffer.device)
        keep = torch.zeros(buffer.numel(), dtype=torch.bool, device=buffer.device)
        group_of = {p: g for g in opt.param_groups for p in g["params"]}
        self.folds = []
        for p, grad in zip(self.params, bucket.gradients(), strict=True):
            # Offsets from the gradient views themselves: robust to any bucket layout.
            start = (grad.data_ptr() - buffer.data_ptr()) // grad.element_size()
            view = self.momentum[start : start + p.numel()]
            view.copy_(opt.state[p]["exp_avg"].reshape(-1))
            opt.state[p]["exp_avg"] = view.view_as(p)
            keep[start : start + p.numel()] = opt.momentum_keep_mask(p)
            group = group_of[p]
            self.folds.append((view.view_as(p), start, p, group))
        self.momentum.masked_fill_(keep.logical_not(), 0.0)
        self.comm = CompressedAllreduce(
            buffer.numel(), state.comm_group, max_block=opt.max_block, scale=opt.scale,
            mask=keep, device=buffer.device, executor=state.executor,
        )
        opt.attach_comm(self.comm, previous.comm if previous is not None else None)

    def fold(self, buffer: torch.Tensor) -> None:
        for exp_avg, start, p, group in self.folds:
            grad = buffer[start : start + p.numel()].view_as(p)
            _fold_gradient_(
                exp_avg, grad, p, beta1=group["betas"][0], weight_decay=group["weight_decay"],
                decoupled=group["decoupled_weight_decay"],
            )


class OneBitHookState:
    """State of :func:`onebit_hook` for one DDP model.

    Args:
        optimizer: the ``OneBitAdam`` that steps the DDP model's parameters; the hook follows its
            stage and keeps its momentum.
        process_group: the DDP model's group (warm-up allreduces run on it).
        overlap: compress inside backward (True) or leave it to ``OneBitAdam.step()`` (False).
        record_timeline: keep ``(bucket index, hook called, allreduce done)`` perf-counter
            times of compression-stage buckets in ``timeline`` (for overlap checks).

    The compressed allreduces run on their own process group (made here, so every rank must
    construct this state at the same point, as DDP itself requires) and on one background
    thread shared by all buckets: collectives keep one order across ranks and never interleave
    with what the main thread sends on the DDP group. Pickling drops the process groups and the
    thread; an unpickled state runs on the default group.
    """

    __slots__ = (
        # Communication
        "process_group",
        "comm_group",
        "world_size",
        "executor",
        # The optimizer whose stage and momentum the hook follows
        "optimizer",
        "overlap",
        # Per-bucket compression state, keyed by DDP bucket index
        "buckets",
        # Diagnostics
        "record_timeline",
        "timeline",
    )

    def __init__(
        self,
        optimizer: OneBitAdam,
        process_group: dist.ProcessGroup | None = None,
        overlap: bool = True,
        record_timeline: bool = False,
    ):
        self.optimizer = optimizer
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
        self.comm_group = dist.new_group(ranks=ranks) if overlap else process_group
        self.executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="onebit-hook") if overlap
            else None
        )
        self.overlap = overlap
        self.buckets: dict[int, _BucketState] = {}
        self.record_timeline = record_timeline
        self.timeline: list[tuple[int, float, float]] = []

    def bucket_state(self, bucket: dist.GradBucket) -> _BucketState:
        index = bucket.index()
        current = self.buckets.get(index)
        params = tuple(bucket.parameters())
        # DDP rebuilds its buckets after the first iteration, and load_state_dict replaces the
        # momentum tensors: either way, rebuild from the optimizer's exp_avg.
        if (
            current is None
            or current.version != self.optimizer.state_version
            or len(current.params) != len(params)
            or any(a is not b for a, b in zip(current.params, params, strict=True))
        ):
            current = _BucketState(self, bucket, current)
            self.buckets[index] = current
        return current

    def __getstate__(self):
        state = {slot: getattr(self, slot) for slot in self.__slots__}
        state.update(process_group=None, comm_group=None, executor=None)
        return state

    def __setstate__(self, state):
        for slot, value in state.items():
            setattr(self, slot, value)
        if self.overlap:
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="onebit-hook")


def onebit_hook(
    state: OneBitHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The comm hook (``ddp_model.register_comm_hook(state, onebit_hook)``); see the module
    docstring. Use :func:`register_onebit_hook`, which also configures the optimizer."""
    opt = state.optimizer
    buffer = bucket.buffer()
    if opt.stage == WARMUP:
        # DDP's default allreduce_hook, numbers included: divide, then sum.
        buffer.div_(state.world_size)
        opt.count_uncompressed(buffer.nbytes)
        work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    if not state.overlap:
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(buffer)  # local gradient; OneBitAdam.step() averages the momentum
        return done
    started = time.perf_counter()
    bucket_state = state.bucket_state(bucket)
    bucket_state.fold(buffer)
    pending = bucket_state.comm(bucket_state.momentum, async_op=True)

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()  # re-raises a failed allreduce here, where DDP waits
        buffer.copy_(bucket_state.momentum)
        if state.record_timeline:
            state.timeline.append((bucket.index(), started, time.perf_counter()))
        return buffer

    return pending.then(finish)


def register_onebit_hook(
    model: DistributedDataParallel,
    optimizer: OneBitAdam,
    *,
    overlap: bool = True,
    record_timeline: bool = False,
) -> OneBitHookState:
    """Register :func:`onebit_hook` on a DDP model and hand the averaging to it.

    Call it once, on every rank, after wrapping the model in DDP and creating the optimizer.
    The optimizer stops averaging gradients itself (the hook does it in warm-up) and, with
    ``overlap``, takes the averaged momentum from ``p.grad`` in the compression stage.

    Returns the hook state (its ``overlap`` says which path runs).
    """
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(f"register_onebit_hook needs a DistributedDataParallel model, got "
                         f"{type(model).__name__}")
    if not isinstance(optimizer, OneBitAdam):
        raise ValueError(f"register_onebit_hook needs a onebit_plugin.OneBitAdam optimizer, got "
                         f"{type(optimizer).__name__}")
    if overlap:
        ddp_params = {p for p in model.parameters() if p.requires_grad}
        if ddp_params != set(optimizer._trainable()):
            log.warning(
                "onebit: the DDP model and OneBitAdam do not hold the same trainable parameters "
                "(%d vs %d); the compressed allreduce runs in optimizer.step() instead of "
                "overlapping backward", len(ddp_params), len(optimizer._trainable()),
            )
            overlap = False
    state = OneBitHookState(optimizer, model.process_group, overlap, record_timeline)
    optimizer.average_grads = False
    optimizer.momentum_from_hook = overlap
    if overlap and optimizer.comm is not None:
        # Resumed into the compression stage before the hook existed: buckets take over.
        optimizer.comm, optimizer._flat_momentum = None, None
    elif not overlap and optimizer.stage != WARMUP and optimizer.comm is None:
        optimizer._build_flat_state(optimizer._trainable())
    model.register_comm_hook(state, onebit_hook)
    return state
