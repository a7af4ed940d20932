"""The exact stage's exchange: the gradients averaged across ranks, by the DDP hook (one bucket
at a time) or, for a member that averages by itself, here in ``step()``. 1-bit Adam's and 1-bit
LAMB's warm-up and 0/1 Adam's Adam steps and variance refreshes exchange this way
(``exchanges.StepExchange``).

At ``warmup_bits=32`` (the paper's algorithm) the average is fp32 and the same numbers as DDP's:
the hook runs DDP's own reduction of each bucket, ``step()`` fp32 allreduces of
``WARMUP_CHUNK_BYTES`` all started before the first is waited on. At 16 or 8 it is the two-phase
allreduce of ``onebit_plugin.comm.quantized`` (bf16, or blockwise int8): every rank decodes the
same bytes, so the ranks still hold the same gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from onebit_plugin.comm.byte_counts import ring_bytes
from onebit_plugin.comm.collectives import comm_executor, wait_collectives
from onebit_plugin.comm.hierarchical import two_level_mean_
from onebit_plugin.comm.quantized import QuantizedAverage
from onebit_plugin.core import rank_checks
from onebit_plugin.core.clipping import exact_clip_
from onebit_plugin.core.exchanges import StepExchange
from onebit_plugin.settings.step_kinds import EXACT

__all__ = ["WARMUP_CHUNK_BYTES", "WARMUP_CHUNK_BYTES_CUDA", "GradientAverage",
           "average_gradients"]

# Without DDP the warm-up allreduce goes in chunks of this many fp32 bytes, all started at once:
# the copy of the next chunk's gradients and the division of the last one's means overlap the
# transfer; in one piece those two passes came on top of it. A warm-up step on the 6.5M values
# of benchmarks/cluster.py's GPT, 4 emulated hosts at 1 Gbit/s: 422-430 ms in one allreduce,
# 408 in 4 MiB chunks, 409-413 in 8, 417-420 in 2, 490-503 in 1 (why 1 MiB is slower was not
# looked into); medians of 40 steps, benchmarks/collective_patterns.py, 2026-12-01.
WARMUP_CHUNK_BYTES = 4 * 2**20
# On a GPU, NCCL's allreduce and the copies run on streams of their own, so the CPU's reason
# does not hold; chunks as large as DDP's buckets (25 MiB) keep the launches few, 32 MiB here
# (not measured on a GPU yet: benchmarks/gpu_check.py times the warm-up step).
WARMUP_CHUNK_BYTES_CUDA = 32 * 2**20


# The int8 average's block: 4 bytes of scale per 512 values (+0.8% on the int8 bytes). A value
# below half a step of its block's largest (1/254 of it) is sent as 0, and blocks are cut from
# the flat gradients, across tensors: the larger the block, the more small coordinates (rare
# embedding rows, rare classes' biases) share one with a large value. Averaged on one trajectory
# over 48 steps (benchmarks/quantized_warmup.py, 4 ranks, docs/benchmarks.md), blocks of 512
# against 2048 decoded 2.9-4.7% of the non-zero averaged gradients as 0 against 6.1-10.9%, and
# halved the worst tensor's median error of the variance on two of three workloads (word_embed
# 1.2% against 2.7%), for 0.6% more bytes on these steps (4/512 against 4/2048 of a value's
# byte; with each layout's padding 0.3-1.6% there).
QUANT_BLOCK = 512


def average_gradients(params: list[torch.Tensor], flat: torch.Tensor | None, group,
                      timeout, world: int, quantized: QuantizedAverage | None = None,
                      levels=None) -> tuple[torch.Tensor, int]:
    """Replace each ``p.grad`` of ``params`` by its mean over the ranks (zeros where a rank has
    none), with a has-gradient flag per parameter so that all ranks agree on which params step.
    ``flat``: the buffer of the last call, reused when it fits. ``quantized``: the values go
    through it (``warmup_bits`` 16 or 8), the flags still in fp32. ``levels``: a hierarchical
    topology's (``two_level_mean_``). Returns the buffer and the bytes this rank sent."""
    if quantized is not None or levels is not None:
        return _average_quantized(params, flat, group, timeout, world, quantized, levels)
    sizes = [p.numel() for p in params]
    total, head = sum(sizes), len(params)
    device = params[0].device
    if flat is None or flat.numel() != head + total:
        flat = torch.empty(head + total, dtype=torch.float32, device=device)
    # The flags: on a GPU from pinned memory, so that the copy does not wait for the device.
    flags = torch.tensor([float(p.grad is not None) for p in params],
                         pin_memory=device.type == "cuda")
    flat[:head].copy_(flags, non_blocking=device.type == "cuda")
    views = flat[head:].split(sizes)
    cap = WARMUP_CHUNK_BYTES_CUDA if device.type == "cuda" else WARMUP_CHUNK_BYTES
    chunks = _chunks(sizes, head, cap // 4)
    # Every rank's flags are read (a host sync on a GPU) only where this rank lacks a gradient.
    missing = any(p.grad is None for p in params)
    works = []
    for start, end, lo, hi in chunks:
        for p, view in zip(params[lo:hi], views[lo:hi], strict=True):
            view.copy_(p.grad.reshape(-1)) if p.grad is not None else view.zero_()
        works.append(dist.all_reduce(flat[start:end], group=group, async_op=True))
    sent, present = 0, None
    for work, (start, end, lo, hi) in zip(works, chunks, strict=True):
        wait_collectives([work], timeout, "the warm-up gradient allreduce", group)
        sent += ring_bytes(4 * (end - start), world)
        if present is None:  # the flags travel in the first chunk
            present = flat[:head].tolist() if missing else [1.0] * head
        for p, view, there in zip(params[lo:hi], views[lo:hi], present[lo:hi], strict=True):
            if p.grad is not None and p.grad.dtype == torch.float32:
                # The mean straight into p.grad: one pass fewer over the gradients than
                # dividing in place and copying (the same division, the same bits).
                torch.div(view.view_as(p), world, out=p.grad)
            elif p.grad is not None:
                p.grad.copy_(view.div_(world).view_as(p))
            elif there:  # another rank had one
                p.grad = view.div_(world).view_as(p).to(p.dtype, copy=True)
    return flat, sent


def _average_quantized(params, flat, group, timeout, world: int,
                       quantized: QuantizedAverage | None, levels) -> tuple[torch.Tensor, int]:
    """:func:`average_gradients` through ``quantized`` and/or over a hierarchical topology's
    ``levels``: the flags in a small fp32 allreduce (exact: which parameters step must not be
    rounded), started first and waited on after the values' average; the values' mean straight
    from it."""
    sizes = [p.numel() for p in params]
    total, head = sum(sizes), len(params)
    device = params[0].device
    if flat is None or flat.numel() != head + total:
        flat = torch.empty(head + total, dtype=torch.float32, device=device)
    flat[:head].copy_(torch.tensor([float(p.grad is not None) for p in params]))
    flags = dist.all_reduce(flat[:head], group=group, async_op=True)
    views = flat[head:].split(sizes)
    for p, view in zip(params, views, strict=True):
        view.copy_(p.grad.reshape(-1)) if p.grad is not None else view.zero_()
    if levels is not None:
        sent = two_level_mean_(flat[head:], levels, timeout, quantized)[0]
    else:
        sent = quantized.average_(flat[head:], group, world, timeout)
    wait_collectives([flags], timeout, "the warm-up's gradient flags allreduce", group)
    sent += ring_bytes(4 * head, world)
    present = flat[:head].tolist() if any(p.grad is None for p in params) else [1.0] * head
    for p, view, there in zip(params, views, present, strict=True):
        if p.grad is not None:
            p.grad.copy_(view.view_as(p))
        elif there:  # another rank had one
            p.grad = view.view_as(p).to(p.dtype, copy=True)
    return flat, sent


def _chunks(sizes: list[int], head: int, cap: int) -> list[tuple[int, int, int, int]]:
    """``(start, end, lo, hi)`` per chunk of a flat buffer holding ``head`` values, then tensors
    of ``sizes`` values back to back: values ``start:end``, tensors ``lo:hi``. Cut between
    tensors after about ``cap`` values (a larger tensor is a chunk of its own); the first chunk
    holds the head."""
    out, start, end, lo = [], 0, head, 0
    for i, n in enumerate(sizes):
        if i > lo and end - start + n > cap:
            out.append((start, end, lo, i))
            start, lo = end, i
        end += n
    out.append((start, end, lo, len(sizes)))
    return out


class GradientAverage(StepExchange):
    """The gradients averaged in ``warmup_bits`` bits per value, then ``then(opt)``: the step's
    update on them (the warm-up's, ``warmup_stage.warmup_step``, or a variance refresh's).
    Holds the flat buffer of the optimizer's own average (4 bytes per parameter, reused every
    step) and, below 32 bits, the quantized average's buffers."""

    kind = EXACT

    def __init__(self, then: Callable) -> None:
        self.then = then
        self.flat: torch.Tensor | None = None
        self.quantized: QuantizedAverage | None = None

    def quantizer(self, opt) -> QuantizedAverage | None:
        """The quantized average of ``opt.config.warmup_bits`` (None at 32)."""
        bits = opt.config.warmup_bits
        if bits == 32:
            return None
        if self.quantized is None or self.quantized.bits != bits:
            self.quantized = QuantizedAverage(bits, QUANT_BLOCK)
        return self.quantized

    def in_backward(self, opt, hook, bucket) -> torch.futures.Future:
        opt.handoff.note_reduced(bucket.parameters())  # step() refuses gradients no bucket averaged
        buffer = bucket.buffer()
        quantized = self.quantizer(opt)
        levels = opt.topology.levels(opt.comm_timeout, opt._device())
        if quantized is not None or levels is not None:
            return _quantized_bucket(opt, hook, buffer, quantized, levels)
        # DDP's default reduction, bits included: multiply by 1/W, then sum. Its reducer
        # multiplies each gradient by double(1) / W as it copies it into the bucket; dividing
        # by W instead rounds differently for a W that is not a power of two (at 3 ranks about
        # 40% of the values differed, by up to 3.7e-9).
        buffer.mul_(1.0 / hook.world_size)
        opt.counts.count_exact(buffer.nbytes, hook.world_size)
        work = dist.all_reduce(buffer, group=hook.comm_group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    def average_(self, opt) -> None:
        """Every trainable ``p.grad`` replaced by its mean over the ranks, here, unless the DDP
        hook or an earlier call of this step did it."""
        handoff = opt.handoff
        if not opt.config.average_grads or opt.world_size == 1 or handoff.grads_averaged:
            return
        params = opt.trainable()
        self.flat, sent = average_gradients(
            params, self.flat, opt.comm_group, opt.comm_timeout, opt.world_size,
            self.quantizer(opt), opt.topology.levels(opt.comm_timeout, opt._device()))
        opt.counts.add_exact(sent, ring_bytes(4 * sum(p.numel() for p in params),
                                              opt.world_size))
        handoff.grads_averaged = True

    def clip_grad_norm_(self, opt, trainable, max_norm, norm_type) -> torch.Tensor:
        opt.handoff.start_sketching(trainable)  # from now on the hook sketches what it folds
        self.average_(opt)
        if not any(p.grad is not None for p in trainable):
            return torch.zeros((), device=trainable[0].device if trainable else "cpu")
        return exact_clip_(trainable, max_norm, opt.shards)

    def step(self, opt) -> None:
        self.average_(opt)
        if opt.hooked_params is not None:
            rank_checks.check_reduced(opt.param_groups, opt.trainable(), opt.handoff.reduced)
        self.then(opt)

    def release_buffer(self) -> torch.Tensor | None:
        """The flat buffer, no longer this exchange's (the momentum units' fold buffers are
        cut from it at the freeze rather than from new memory)."""
        flat, self.flat = self.flat, None
        self.quantized = None  # its buffers too (made again if a refresh needs them)
        return flat

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        out = [("warm-up gradient buffer", self.flat)] if self.flat is not None else []
        return out + (self.quantized.buffers() if self.quantized is not None else [])


def _quantized_bucket(opt, hook, buffer: torch.Tensor, quantized: QuantizedAverage | None,
                      levels) -> torch.futures.Future:
    """The DDP hook's bucket averaged through ``quantized`` and/or over a hierarchical
    topology's ``levels``: on the CPU on the group's background thread (backward goes on
    meanwhile, as beside DDP's own allreduce), on a GPU here, on the current stream (the
    collectives are asynchronous there already)."""
    world, group, timeout = hook.world_size, hook.comm_group, opt.comm_timeout
    dense = ring_bytes(4 * buffer.numel(), world)

    def run() -> torch.Tensor:
        flat = buffer if buffer.dtype == torch.float32 else buffer.to(torch.float32)
        if levels is not None:
            sent = two_level_mean_(flat, levels, timeout, quantized)[0]
        else:
            sent = quantized.average_(flat, group, world, timeout)
        if flat is not buffer:
            buffer.copy_(flat)
        opt.counts.add_exact(sent, dense)
        return buffer

    future = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
    if buffer.is_cuda:
        future.set_result(run())
        return future

    def job() -> None:
        try:
            future.set_result(run())
        except BaseException as exc:  # noqa: BLE001 - handed to DDP, which raises it
            future.set_exception(exc)

    comm_executor(group).submit(job)
    return future
