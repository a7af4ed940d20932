"""Process groups and waits, for every communicator and exchange of the family: groups made
with the optimizer's timeout (``new_group``, ``group_timeout``), waits that turn a failed or
timed-out collective into a :class:`CommunicationError` (``wait_collectives``), the one
background thread per group that keeps asynchronous calls in order (``comm_executor``), and
``all_finite``, the one-sync finiteness check every rank takes the same decision from.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from onebit_plugin.comm.byte_counts import ring_bytes
from onebit_plugin.wire.dispatch import on_comm_thread

__all__ = [
    "WATCHDOG_MARGIN",
    "CommunicationError",
    "all_finite",
    "any_over_ranks",
    "comm_executor",
    "group_size_and_rank",
    "group_timeout",
    "new_group",
    "new_group_of",
    "resolve_device",
    "uses_nccl",
    "wait_collectives",
]

_EXECUTORS: dict = {}
_EXECUTORS_LOCK = threading.Lock()


def _forget_executors() -> None:
    """In a forked child: it has none of its parent's threads, so an executor inherited from
    the parent would queue every job and never run one (a rank forked after its parent had
    used one hung in its first asynchronous call, 2026-12-01); it makes its own."""
    global _EXECUTORS_LOCK
    _EXECUTORS.clear()
    _EXECUTORS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_executors)


class CommunicationError(RuntimeError):
    """A collective failed or timed out: a peer rank stopped, hung or lost its network."""


def all_finite(tensors) -> bool:
    """True unless some value is inf or NaN: one summing pass per tensor and a single sync (an
    inf or NaN makes its sum non-finite; no temporary as large as the input, unlike
    ``isfinite(t).all()``). Finite values summing past ~3e38 also count as non-finite: such a
    step is skipped like an overflowed one, on every rank alike. On a GPU the sums are of
    absolute values, in torch's foreach norm (a few launches for all tensors instead of one
    each); on the CPU the plain sums take about half the foreach norm's time (torch 2.13)."""
    tensors = list(tensors)
    if not tensors:
        return True
    if tensors[0].is_cuda:
        sums = torch._foreach_norm(tensors, 1)
    else:
        sums = [t.sum(dtype=torch.float32) for t in tensors]
    return bool(torch.isfinite(torch.stack([s.float() for s in sums])).all())


def any_over_ranks(bits: torch.Tensor, group, world: int, timeout: timedelta | None,
                   what: str) -> tuple[torch.Tensor, int]:
    """Where any rank of ``group`` (``world`` ranks) has a bit set (``bits``: bool, the same
    length on every rank), the bits packed 8 a byte; and the bytes this rank sent. One
    allreduce with a bitwise OR where the backend has one: gloo's all-gather of 1 byte wrote
    289 bytes per rank at 2 ranks and 578 at 3, its allreduce 145 and 145-242 (torch 2.13,
    counted at /proc/self/io). NCCL has no bitwise reduction: an all-gather there."""
    n = bits.numel()
    if world == 1 or n == 0:
        return bits, 0
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=bits.device)
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=bits.device)
    padded[:n] = bits
    packed = padded.view(-1, 8).mul_(weights).sum(1, dtype=torch.uint8)
    if not _is_nccl(group):
        work = dist.all_reduce(packed, op=dist.ReduceOp.BOR, group=group, async_op=True)
        wait_collectives([work], timeout, what, group)
        merged, sent = packed, ring_bytes(packed.numel(), world)
    else:
        gathered = torch.empty(world * packed.numel(), dtype=torch.uint8, device=bits.device)
        work = dist.all_gather_single(gathered, packed, group=group, async_op=True)
        wait_collectives([work], timeout, what, group)
        rows = gathered.view(world, -1)
        merged = rows[0].clone()
        for other in rows[1:]:
            merged.bitwise_or_(other)
        sent = (world - 1) * packed.numel()
    return merged[:, None].bitwise_and(weights).ne(0).reshape(-1)[:n], sent


def wait_collectives(works: list, timeout: timedelta | None, what: str, group=None) -> None:
    """Wait for collectives, turning a failure or a timeout into a CommunicationError that
    says which rank saw it and what to do."""
    limit = timeout
    try:
        if timeout is not None and _is_nccl(group):
            # NCCL's wait(timeout) sleeps 1 ms between checks of the work's end (WorkNCCL::
            # synchronize in torch 2.13): at least 1 ms per exchange, two per momentum unit,
            # where the exchange itself may take tens of microseconds. Polled here instead, at
            # most 1 ms late only once the wait has lasted about 1 ms already; then wait()
            # without a timeout raises the work's error, if any, and orders the stream after it.
            _poll_until_done(works, timeout)
            limit = None
        for work in works:
            work.wait() if limit is None else work.wait(limit)
    except RuntimeError as exc:
        world, rank = group_size_and_rank(group)
        limit = "" if timeout is None else f" (timeout {timeout.total_seconds():g} s)"
        _abort_if_nccl(group)
        raise CommunicationError(
            f"onebit: {what} failed on rank {rank} of {world}{limit}: "
            f"{str(exc).rstrip('.! ')}. A peer rank has "
            "probably stopped, hung or lost its network; the step cannot complete. Resume "
            "from the last checkpoint."
        ) from exc


def uses_nccl(backend) -> bool:
    """Whether a group of ``backend`` runs CUDA tensors' collectives on NCCL: "nccl", or a
    backend per device ("cpu:gloo,cuda:nccl", what ``init_process_group()`` without a backend
    makes on a machine with GPUs)."""
    return "nccl" in str(backend)


def _is_nccl(group) -> bool:
    return dist.is_available() and dist.is_initialized() and uses_nccl(dist.get_backend(group))


_sleep = time.sleep  # patched by the tests


def _poll_until_done(works: list, timeout: timedelta) -> None:
    """Return once every work reports completion (success or failure); RuntimeError once
    ``timeout`` has passed for one of them. The first pause is a bare yield, the next ones
    double from 10 us (about 60 us asleep on Linux, its timer slack) up to 1 ms."""
    pause = 0.0
    for work in works:  # each its own comm_timeout, as gloo's wait(timeout) gives it
        deadline = time.monotonic() + timeout.total_seconds()
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise RuntimeError(f"not completed after {timeout.total_seconds():g} s")
            _sleep(pause)
            pause = min(max(2 * pause, 1e-5), 1e-3)


def _abort_if_nccl(group) -> None:
    """An NCCL collective that timed out stays enqueued on the GPU, and the process cannot end
    while it is; gloo releases its thread at its own timeout (``comm_timeout`` on OneBitAdam's
    group). So on NCCL the group is aborted, as torch's docs prescribe, before the error is
    raised. Not run on a GPU yet (docs/guarantees.md); NCCL's watchdog, with the same timeout
    and the default ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, may end the process first."""
    if not _is_nccl(group):
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)  # torch >= 2.6
    if abort is not None:
        with contextlib.suppress(Exception):  # already aborted by the watchdog
            abort(group)


def group_size_and_rank(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


WATCHDOG_MARGIN = timedelta(seconds=30)


def group_timeout(timeout: timedelta, backend: str) -> timedelta:
    """The backend timeout of a group whose collectives may take ``timeout`` (``comm_timeout``)
    before the step raises :class:`CommunicationError`. gloo ends a stuck collective at the
    group's timeout, which is then the one to give; NCCL's watchdog instead ends the *process*
    at it (TORCH_NCCL_ASYNC_ERROR_HANDLING's default). Every wait of the optimizer enforces
    ``timeout`` itself (on NCCL by polling the work's completion), so the watchdog gets
    twice that, at least 30 s more: CommunicationError comes first, then the group is aborted
    (wait_collectives). The Lightning strategy gives the default group the same."""
    return timeout + max(timeout, WATCHDOG_MARGIN) if uses_nccl(backend) else timeout


def new_group(group: dist.ProcessGroup | None, timeout: timedelta | None,
              device: torch.device | None = None) -> dist.ProcessGroup:
    """A group of the ranks of ``group`` (the world for None) for the optimizer's collectives,
    with ``timeout`` (``group_timeout``), its NCCL communicator made now on ``device``'s GPU."""
    backend = dist.get_backend(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    if timeout is not None:
        timeout = group_timeout(timeout, backend)
    # NCCL makes a group's communicator at its first collective, unless bound to a device: a
    # run resumed straight into the compression stage would make it on the background thread,
    # in the middle of backward. Made here, on the thread that makes the group.
    eager = {"device_id": device} if uses_nccl(backend) and device is not None and \
        device.type == "cuda" else {}
    if ranks is None or len(ranks) == dist.get_world_size():
        return dist.new_group(ranks=ranks, timeout=timeout, **eager)
    # A subgroup (data parallel beside tensor or pipeline parallelism): only its members reach
    # this, each subgroup's when its optimizer first needs it. Without local synchronization
    # every process of the world must call new_group, in the same order, and wait for all.
    return dist.new_group(ranks=ranks, timeout=timeout, use_local_synchronization=True, **eager)


def new_group_of(ranks: list[int], group: dist.ProcessGroup | None,
                 timeout: timedelta | None, device: torch.device | None = None
                 ) -> dist.ProcessGroup:
    """A group of the world's ``ranks`` on ``group``'s backend, with ``timeout``, made by its
    members only (a topology's host and cross-host groups: each rank makes the two it is in)."""
    backend = dist.get_backend(group)
    if timeout is not None:
        timeout = group_timeout(timeout, backend)
    eager = {"device_id": device} if uses_nccl(backend) and device is not None and \
        device.type == "cuda" else {}
    return dist.new_group(ranks=ranks, timeout=timeout, backend=backend,
                          use_local_synchronization=True, **eager)


def resolve_device(device) -> torch.device:
    """``device`` with its index: "cuda" means the current GPU, so that it compares equal to the
    ``cuda:N`` of the tensors made on it."""
    device = torch.device(device or "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def comm_executor(group) -> ThreadPoolExecutor:
    """The one background thread of ``group`` (None: the default group) that runs every
    asynchronous call of every communicator on it, in submission order."""
    with _EXECUTORS_LOCK:
        executor = _EXECUTORS.get(group)
        if executor is None:
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="onebit-comm",
                                          initializer=on_comm_thread)
            _EXECUTORS[group] = executor
        return executor


