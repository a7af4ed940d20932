"""Clipping by the averaged gradient's 2-norm in the compression stage, where no rank holds that
gradient (docs/design.md, "Clipping"): the norm is estimated without bias from a sketch of each
rank's local gradient (``onebit_plugin.maths.norm_sketch``: one allreduce of 256-4096 values, a few
percent of error), the same on every rank, and ``step()`` scales the gradient inside the averaged
momentum by ``max_norm / norm``.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from onebit_plugin.comm.byte_counts import ring_bytes
from onebit_plugin.comm.collectives import wait_collectives
from onebit_plugin.core.handoff import HandOff
from onebit_plugin.maths.norm_sketch import squared_norm

log = logging.getLogger("onebit_plugin")

__all__ = ["check_clip_args", "clip_coefficient", "compression_stage_norm", "exact_clip_",
           "say_late_clip", "value_clipping_error"]


def exact_clip_(params: list[torch.Tensor], max_norm: float, shards=None) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` of ``params``' gradients (each rank holds the gradient it
    clips); with FSDP2 shards (``comm.shards``) over the whole parameters: each shard's squared
    norm summed over the host's ranks first. Returns the total norm."""
    if shards is None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    grads = [p.grad for p in params if p.grad is not None]
    device = params[0].device if params else torch.device("cpu")
    squares = torch.zeros((), device=device)
    if grads:
        squares = torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])).square()
    total = shards.sum_over_host_(squares).sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def compression_stage_norm(trainable: list[torch.Tensor], handoff: HandOff, world: int, group,
                           timeout, device, shards=None) -> tuple[torch.Tensor, int]:
    """The averaged gradient's 2-norm (exact on one rank, estimated from the ranks' sketches
    on several) and the bytes this rank sent for it. The local gradients are those the DDP hook
    noted in ``handoff``, else ``p.grad``. With FSDP2 ``shards`` each rank's estimate is its
    shard's; the squares are summed over the host's ranks (an unbiased sum of unbiased
    estimates: summing the shards' sketches instead would not be, their signs being alike)."""
    # Per parameter, in the same order on every path: the same bits whoever folded.
    local = [p for p in trainable if p in handoff.local_norms or p.grad is not None]
    if world == 1:  # the local gradient is the gradient: its norm is exact
        norms = [handoff.local_norms.get(p, None) for p in local]
        norms = [n if n is not None else torch.linalg.vector_norm(p.grad, dtype=torch.float32)
                 for n, p in zip(norms, local, strict=True)]
        squares = (torch.linalg.vector_norm(torch.stack(norms)).square() if norms
                   else torch.zeros((), device=device))
        return (squares if shards is None else shards.sum_over_host_(squares)).sqrt(), 0
    sketch = torch.zeros(handoff.sketch.width, device=device)
    if local:
        sketch = torch.stack([handoff.sketches[p] if p in handoff.sketches
                              else handoff.sketch.of(p, p.grad) for p in local]).sum(0)
    work = dist.all_reduce(sketch, group=group, async_op=True)
    wait_collectives([work], timeout, "the clipping norm's allreduce", group)
    squares = squared_norm(sketch.div_(world))
    if shards is not None:
        squares = shards.sum_over_host_(squares.reshape(()).clone())
    return squares.sqrt(), ring_bytes(sketch.nbytes, world)


def clip_coefficient(max_norm: float, norm: float) -> float | None:
    """torch's coefficient ``min(1, max_norm / (norm + 1e-6))``; None for a non-finite norm
    (``step()`` skips that step on every rank anyway)."""
    return min(1.0, max_norm / (norm + 1e-6)) if math.isfinite(norm) else None


def check_clip_args(max_norm: float, norm_type: float, params, trainable: list) -> None:
    """``clip_grad_norm_``'s arguments: the 2-norm, ``max_norm > 0``, and ``params`` (when
    given) the optimizer's trainable parameters (a clip over a subset has no
    compression-stage counterpart)."""
    if norm_type != 2.0:
        raise ValueError(f"OneBitAdam.clip_grad_norm_ clips by the 2-norm; got norm_type="
                         f"{norm_type!r}")
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
    if params is not None:
        given = {p for p in params if p.requires_grad}
        if given != set(trainable):
            raise ValueError(
                f"OneBitAdam.clip_grad_norm_ clips all of the optimizer's {len(trainable)} "
                f"trainable parameters together; {len(given)} were given, "
                f"{len(given - set(trainable))} of them not the optimizer's: in the "
                "compression stage only the whole gradient's norm can be clipped")


def say_late_clip() -> None:
    log.warning("onebit: clip_grad_norm_ was first called in the compression stage, after the "
                "DDP hook had folded this step's gradients unsketched: this step is not clipped "
                "(nan returned); the next ones are")


def value_clipping_error(clip_value: float) -> ValueError:
    return ValueError(
        f"gradient clipping by value ({clip_value!r}) has no 1-bit Adam counterpart: in the "
        "compression stage no rank holds the averaged gradient whose coordinates it would "
        "clamp. Clip by norm instead (Lightning: gradient_clip_algorithm='norm'; Fabric: "
        "clip_gradients(max_norm=...); Accelerate: accelerator.clip_grad_norm_; your own "
        "loop: optimizer.clip_grad_norm_)")

