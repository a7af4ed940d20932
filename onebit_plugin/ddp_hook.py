"""DDP communication hook: OneBitAdam's averaging inside backward, one bucket at a time.

DDP allows one comm hook per model, so one hook serves both stages and switches on the
optimizer's stage, the way torch's ``PowerSGDState.start_powerSGD_iter`` switches PowerSGD on:

* warm-up: a mean allreduce of the bucket, the same numbers as DDP's default
  (``buffer / W``, then a sum allreduce);
* compression stage: the bucket's *local* gradients are folded into the momentum
  (``m = b1*m + (1-b1)*g``). Momenta live in fixed *momentum groups* (the optimizer's
  ``state['exp_avg']`` are views of their flat buffers), cut once from the parameters in reverse
  order up to DDP's bucket size; as soon as every gradient of a group has arrived, its compressed
  allreduce starts on a background thread and overlaps the rest of backward. The averaged
  momentum comes back as the bucket's "gradient"; ``OneBitAdam.step()`` takes it from
  ``p.grad`` and applies the frozen variance. The groups, not DDP's buckets, fix the compression
  layout because DDP rebuilds its buckets after the first iteration of every run: a resumed
  run compresses in the same layout as the uninterrupted one and gets its own error buffers
  back, bit for bit.

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


class _MomentumGroup:
    """A fixed set of parameters whose momenta are compressed together.

    The groups are cut once from the optimizer's parameters (reverse order, as gradients
    usually become ready, up to ``cap_bytes`` of fp32 each) and do not follow DDP's buckets:
    DDP rebuilds its buckets after the first iteration of every run, so a run resumed from a
    checkpoint would otherwise compress its first step in another layout than the uninterrupted
    run (other chunks, other block scales) and leave the saved error buffers without a home.
    """

    __slots__ = (
        "index", "params", "momentum", "local", "offsets", "comm", "remaining", "pending",
        "skipped",
    )

    def __init__(self, index: int, params: list, state: "OneBitHookState"):
        opt = state.optimizer
        self.index = index
        self.params = params
        numel = sum(p.numel() for p in params)
        device = params[0].device
        self.momentum = torch.empty(numel, dtype=torch.float32, device=device)
        keep = torch.empty(numel, dtype=torch.bool, device=device)
        self.offsets = {}
        offset = 0
        for p in params:
            view = self.momentum[offset : offset + p.numel()]
            view.copy_(opt.state[p]["exp_avg"].reshape(-1))
            opt.state[p]["exp_avg"] = view.view_as(p)  # one momentum, owned here
            keep[offset : offset + p.numel()] = opt.momentum_keep_mask(p)
            self.offsets[p] = offset
            offset += p.numel()
        self.momentum.masked_fill_(keep.logical_not(), 0.0)
        # Gradients are folded into this copy; the average lands in momentum only if no rank
        # had a non-finite gradient (else the step of these parameters is skipped everywhere).
        self.local = torch.empty_like(self.momentum)
        self.skipped = state.optimizer._skipped_by_hook
        self.comm = CompressedAllreduce(
            numel, state.comm_group, max_block=opt.max_block, scale=opt.scale, mask=keep,
            device=device, executor=state.executor, timeout=opt.comm_timeout,
        )
        opt.attach_comm(index, self.comm)  # loads this group's saved errors, if any
        self.remaining = len(params)
        self.pending: torch.futures.Future | None = None

    def view(self, p: torch.Tensor, buffer: torch.Tensor | None = None) -> torch.Tensor:
        start = self.offsets[p]
        buffer = self.momentum if buffer is None else buffer
        return buffer[start : start + p.numel()].view_as(p)

    def arrived(self) -> torch.futures.Future:
        """One more of this group's gradients was folded; once all have, start the compressed
        allreduce. Returns the future of this iteration's allreduce."""
        if self.pending is None:
            self.pending = torch.futures.Future()
        pending = self.pending
        self.remaining -= 1
        if self.remaining == 0:
            self.remaining, self.pending = len(self.params), None

            def done(fut: torch.futures.Future) -> None:
                try:
                    fut.value()
                    if self.comm.last_call_skipped:  # read before the next call can start
                        self.skipped.update(self.params)
                    pending.set_result(None)
                except BaseException as exc:  # noqa: BLE001 - raised where DDP waits
                    pending.set_exception(exc)

            self.comm(self.local, async_op=True, out=self.momentum).add_done_callback(done)
        return pending


class OneBitHookState:
    """State of :func:`onebit_hook` for one DDP model.

    Args:
        optimizer: the ``OneBitAdam`` that steps the DDP model's parameters; the hook follows its
            stage and keeps its momentum.
        process_group: the DDP model's group (warm-up allreduces run on it).
        overlap: compress inside backward (True) or leave it to ``OneBitAdam.step()`` (False).
        record_timeline: keep ``(bucket index, hook called, allreduce done)`` perf-counter
            times of compression-stage buckets in ``timeline`` (for overlap checks).
        bucket_cap_mb: size of a momentum group (fp32); ``register_onebit_hook`` passes the
            DDP model's bucket size.

    The compressed allreduces run on their own process group (made here, so every rank must
    construct this state at the same point, as DDP itself requires) and on one background
    thread shared by all groups: collectives keep one order across ranks and never interleave
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
        # The momentum groups and, per parameter, its group
        "bucket_cap_bytes",
        "groups",
        "group_of",
        "hyper_of",
        "groups_version",
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
        bucket_cap_mb: float = 25.0,
    ):
        self.optimizer = optimizer
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
        timeout = optimizer.comm_timeout
        self.comm_group = (
            dist.new_group(ranks=ranks, timeout=timeout) if overlap else process_group
        )
        self.executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="onebit-hook") if overlap
            else None
        )
        self.overlap = overlap
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self.groups: list[_MomentumGroup] = []
        self.group_of: dict[torch.Tensor, _MomentumGroup] = {}
        self.hyper_of: dict[torch.Tensor, dict] = {}  # parameter -> its optimizer param group
        self.groups_version = -1
        self.record_timeline = record_timeline
        self.timeline: list[tuple[int, float, float]] = []

    def momentum_groups(self) -> dict[torch.Tensor, _MomentumGroup]:
        """Parameter -> its momentum group; (re)built at the first compression step and after
        ``load_state_dict`` replaced the momentum tensors."""
        opt = self.optimizer
        if self.groups_version != opt.state_version:
            self.groups, self.group_of = [], {}
            current, size = [], 0
            for p in reversed(opt._trainable()):
                if current and size + 4 * p.numel() > self.bucket_cap_bytes:
                    self.groups.append(_MomentumGroup(len(self.groups), current, self))
                    current, size = [], 0
                current.append(p)
                size += 4 * p.numel()
            self.groups.append(_MomentumGroup(len(self.groups), current, self))
            self.group_of = {p: g for g in self.groups for p in g.params}
            self.hyper_of = {p: g for g in opt.param_groups for p in g["params"]}
            self.groups_version = opt.state_version
        return self.group_of

    def __getstate__(self):
        state = {slot: getattr(self, slot) for slot in self.__slots__}
        state.update(process_group=None, comm_group=None, executor=None)
        for group in state["groups"]:
            group.pending = None
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
    group_of = state.momentum_groups()
    waits, parts = [], []
    for p, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
        group = group_of[p]
        hyper = state.hyper_of[p]
        momentum = group.view(p)
        _fold_gradient_(
            momentum, grad, p, beta1=hyper["betas"][0], weight_decay=hyper["weight_decay"],
            decoupled=hyper["decoupled_weight_decay"], out=group.view(p, group.local),
        )
        parts.append((grad, momentum))
        pending = group.arrived()
        if all(pending is not w for w in waits):
            waits.append(pending)

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        for each in fut.value():
            each.value()  # re-raises a failed allreduce here, where DDP waits
        for grad, momentum in parts:
            grad.copy_(momentum)  # the bucket's gradient views: DDP hands them to step()
        if state.record_timeline:
            state.timeline.append((bucket.index(), started, time.perf_counter()))
        return buffer

    return torch.futures.collect_all(waits).then(finish)


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
    state = OneBitHookState(
        optimizer, model.process_group, overlap, record_timeline,
        bucket_cap_mb=model.bucket_bytes_cap / 2**20,
    )
    optimizer.average_grads = False
    optimizer.momentum_from_hook = overlap
    if overlap and optimizer.comm is not None:
        # Resumed into the compression stage before the hook existed: the groups take over.
        optimizer.comm, optimizer._flat_momentum = None, None
    elif not overlap and optimizer.stage != WARMUP and optimizer.comm is None:
        optimizer._build_flat_state(optimizer._trainable())
    model.register_comm_hook(state, onebit_hook)
    return state
