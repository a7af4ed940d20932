"""The frozen variance follows, tensor by tensor, the second moment of the averaged gradients,
without sending them (``follow_variance``, the Adam members' default; docs/usage.md, "A
variance that follows").

Why: under a constant learning rate the gradients keep growing after the freeze (``char_mlp``
of benchmarks/workloads.py: per tensor, the mean of Adam's ``sqrt(v)`` 1.36-2.81x larger at step
2,000 than at the freeze, step 400), so a frozen denominator lets every step grow, up to the
bound; refreshing the variance in full precision fixed it but cost a quarter of the bytes
(``refresh_interval=16``: 3.65x fewer instead of 4.43x; docs/benchmarks.md, "Wider workloads").
What moved was mostly each tensor's scale, which one number per tensor follows.

How, on each step that exchanges (1-bit Adam's momentum steps, 0/1 Adam's syncs and phase-A
steps): each rank sketches its local gradient of every trainable tensor into :data:`WIDTH`
values (a CountSketch, as ``maths.norm_sketch``'s: random signs that are the same on every
rank), one allreduce of ``WIDTH`` fp32 values per tensor averages the sketches, and the squared
norm of the average estimates the averaged gradient's squared norm without bias (relative
standard deviation about ``sqrt(2 / WIDTH)`` = 35% per step, which the average below takes over
some 1,000 steps). Its mean over the tensor, ``a``, feeds ``v_bar``, the tensor's mean of
Adam's bias-corrected variance, with Adam's own rule (``v <- b2**k v + (1 - b2**k) g*g`` over the
``k`` steps since the last, bias corrected at the count), started at the mean of the frozen
``v_hat`` itself; the update then divides by ``denom * sqrt(v_bar / v_bar at the freeze)``.
Each coordinate keeps its place relative to its tensor's; only the tensor's scale moves, as
fast as Adam's variance moves and no faster. One process: ``a`` is the gradient's own mean
square. Every rank computes the same numbers from the same allreduce: the ranks stay alike.
The numbers live in each parameter's optimizer state (``variance_mean``, ``variance_ref``,
``variance_count``), so a checkpoint resumes them bit for bit.

Costs: ``WIDTH * 4`` bytes per tensor per exchanging step (64; a 1-bit step sends ``n / 8``
bytes for a tensor of ``n`` values), one small allreduce on such steps (latency), a pass over
each local gradient; the signs, ``4 / WIDTH`` bytes per value of the largest tensor (at most
:data:`SIGN_ROWS` rows, 1 MiB; a larger tensor reuses them every ``SIGN_ROWS * WIDTH``
values, whose coordinates' cross terms then keep their signs).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from onebit_plugin.comm.byte_counts import ring_bytes
from onebit_plugin.comm.collectives import wait_collectives

__all__ = ["SIGN_ROWS", "WIDTH", "VarianceFollow", "follow_", "scale", "start_"]

WIDTH = 16
SIGN_ROWS = 1 << 18
_SEED = 0xF011
_MEAN, _REF, _COUNT = "variance_mean", "variance_ref", "variance_count"


class VarianceFollow:
    """What the following keeps across steps: the signs, drawn at the first sketch from the
    trainable tensors' largest (the same on every rank)."""

    def __init__(self) -> None:
        self.signs: torch.Tensor | None = None

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        return [] if self.signs is None else [("variance-follow signs", self.signs)]

    def _signs(self, trainable: list[torch.Tensor], device) -> torch.Tensor:
        if self.signs is None or self.signs.device != device:
            rows = min(SIGN_ROWS, max([p.numel() // WIDTH for p in trainable] + [1]))
            gen = torch.Generator().manual_seed(_SEED)
            bits = torch.randint(0, 2, (rows,), generator=gen, dtype=torch.int8)
            self.signs = bits.mul_(2).sub_(1).to(device=device, dtype=torch.float32)
        return self.signs

    def summary(self, grad: torch.Tensor, world: int, trainable: list[torch.Tensor]
                ) -> torch.Tensor:
        """This rank's part of ``a`` for one tensor: its sketch (``WIDTH`` values), or on one
        process the squared norm itself (one value, padded)."""
        flat = grad.reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.float()
        out = torch.zeros(WIDTH, dtype=torch.float32, device=flat.device)
        if world == 1:
            out[0] = torch.linalg.vector_norm(flat).square()
            return out
        signs = self._signs(trainable, flat.device)
        rows, reuse = flat.numel() // WIDTH, signs.numel()
        for start in range(0, rows, reuse):
            take = min(reuse, rows - start)
            out.addmv_(flat[start * WIDTH:(start + take) * WIDTH].view(take, WIDTH).t(),
                       signs[:take])
        tail = flat[rows * WIDTH:]
        if tail.numel():
            out[: tail.numel()].addcmul_(tail, signs[rows % reuse].expand(tail.numel()))
        return out


def start_(opt, params: list[torch.Tensor] | None = None) -> None:
    """The following starts over from the denominators as they are now (at the freeze, and
    after each full-precision refresh), for ``params`` (None: every unit's parameters that
    have not started yet, as after a resume that holds them)."""
    for unit in opt.units:
        for p in unit.params:
            state = opt.state[p]
            if params is None and _REF in state or params is not None and p not in params:
                continue
            eps = unit.hypers[p]["eps"]
            root = (unit.view(p, unit.denom) - eps).clamp_(min=0.0)
            mean = float(torch.sum(root.square_(), dtype=torch.float64)) / max(p.numel(), 1)
            state[_MEAN] = state[_REF] = mean
            state[_COUNT] = float(state.get("frozen_step", float(state["step"])))


def scale(state: dict) -> float:
    """The factor on a parameter's denominator: ``sqrt(v_bar / v_bar at the freeze)``; 1
    before the following starts, or for a tensor whose frozen variance is zero."""
    ref = state.get(_REF)
    if not ref or ref <= 0.0:
        return 1.0
    return math.sqrt(state[_MEAN] / ref)


def local_summaries(opt, noted: dict) -> list[torch.Tensor]:
    """Every trainable tensor's summary of this rank's local gradient, in order: the DDP hook's
    (``noted``, taken before ``p.grad`` came to hold the averaged momentum) or ``p.grad``'s
    (zeros for none). Taken before the step's exchange."""
    trainable = opt.trainable()
    follow = opt.policy.follow
    out = []
    for p in trainable:
        summary = noted.get(p)
        if summary is None:
            summary = (follow.summary(p.grad, opt.world_size, trainable)
                       if p.grad is not None else
                       torch.zeros(WIDTH, dtype=torch.float32, device=p.device))
        out.append(summary)
    return out


def follow_(opt, summaries: list[torch.Tensor], coef: float | None = None) -> None:
    """After a step that exchanged: average the ranks' ``summaries``, and move each tensor's
    ``v_bar`` by the steps since its last move (its step count less ``variance_count``).
    ``coef``: the clipping coefficient this step's averaged gradient was scaled by."""
    if not summaries:
        return
    trainable = opt.trainable()
    stacked = torch.stack(summaries)
    world = opt.world_size
    if world > 1:
        work = dist.all_reduce(stacked, group=opt.comm_group, async_op=True)
        wait_collectives([work], opt.comm_timeout, "the variance follow's allreduce",
                         opt.comm_group)
        opt.counts.clip_sent += ring_bytes(stacked.nbytes, world)
        squares = stacked.div_(world).square_().sum(dim=1)
    else:
        squares = stacked[:, 0]
    squares = squares.tolist()
    if coef is not None and coef < 1.0:
        squares = [s * coef * coef for s in squares]
    if not all(math.isfinite(s) for s in squares):
        return  # a skipped step (the same on every rank): the variance moves with the next
    for p, square in zip(trainable, squares, strict=True):
        state = opt.state[p]
        if _REF not in state:
            continue
        beta2 = opt.unit_of(p).hypers[p]["betas"][1]
        n, t = state[_COUNT], float(state["step"])
        k = t - n
        if k <= 0:
            continue
        kept = beta2 ** k
        moved = kept * (1.0 - beta2 ** n) * state[_MEAN] + (1.0 - kept) * square / p.numel()
        state[_MEAN] = moved / (1.0 - beta2 ** t)
        state[_COUNT] = t
