"""The frozen variance follows, tensor by tensor, the scale of the averaged gradients, without
sending them (``follow_variance``, the Adam members' default; docs/usage.md, "A variance that
follows").

Why: under a constant learning rate the gradients keep growing after the freeze (``char_mlp``
of benchmarks/workloads.py: per tensor, the mean of Adam's ``sqrt(v)`` 1.36-2.81x larger at step
2,000 than at the freeze, step 400), so a frozen denominator lets every step grow, up to the
bound; refreshing the variance in full precision fixed it but cost a fifth of the bytes
(``refresh_interval=16``: 3.65x fewer instead of 4.43x; docs/benchmarks.md, "Wider workloads").
What moved was mostly each tensor's scale, which one number per tensor follows.

How: each tensor's averaged gradient is summarized by a sketch of :data:`WIDTH` values (a
CountSketch: coordinate ``i`` of row ``r = i // WIDTH`` adds ``s_r * g_i`` to bucket
``i mod WIDTH``, with random signs ``s_r`` the same on every rank). A sketch is linear: in the
exact stage each rank sketches the averaged gradient it holds (nothing sent); in the
compression stage each rank sketches its local gradient and one allreduce of ``WIDTH`` fp32
values per tensor averages the sketches, which is the averaged gradient's sketch. Its squared
norm estimates the averaged gradient's squared norm (without bias over the signs; relative
standard deviation about ``sqrt(2 / WIDTH)`` = 35% per step, less after the average below); per
tensor, its mean over the values feeds ``v_bar``, an average with Adam's own rule (``v <- b2**k v
+ (1 - b2**k) a`` over the ``k`` steps since the last, bias corrected at the count), from the
first step. The update divides by ``denom * sqrt(v_bar / v_bar when denom was made)``: the same
estimate before and after, so what the sketch makes of a tensor's structure cancels. Each
coordinate keeps its place relative to its tensor's; only the tensor's scale moves, as fast as
Adam's variance would and no faster. Every rank computes the same numbers from the same bytes:
the ranks stay alike. The numbers live in each parameter's optimizer state
(``variance_mean``, ``variance_ref``, ``variance_count``): a checkpoint resumes them bit for bit.

Costs: ``WIDTH * 4`` bytes per tensor per exchanging compression-stage step (64; a 1-bit step
sends about ``n / 8`` bytes for a tensor of ``n`` values) in one small allreduce (its latency),
none on a local step; a pass over each gradient every step; the signs, ``4 / WIDTH`` bytes per
row of the largest tensor (at most :data:`SIGN_ROWS` rows, 1 MiB; a larger tensor reuses them
every ``SIGN_ROWS * WIDTH`` values).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from onebit_plugin.comm.byte_counts import ring_bytes
from onebit_plugin.comm.collectives import wait_collectives

__all__ = ["SIGN_ROWS", "WIDTH", "VarianceFollow", "follow_", "scale", "start_", "summaries"]

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

    def summary(self, grad: torch.Tensor, trainable: list[torch.Tensor]) -> torch.Tensor:
        """The sketch of one tensor's gradient ``grad`` (``WIDTH`` fp32 values)."""
        flat = grad.reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.float()
        out = torch.zeros(WIDTH, dtype=torch.float32, device=flat.device)
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


def summaries(opt, noted: dict | None = None) -> list[torch.Tensor]:
    """Every trainable tensor's sketch, in order, of the gradient this rank holds: the DDP
    hook's (``noted``, taken before ``p.grad`` came to hold the averaged momentum) or
    ``p.grad``'s (zeros for none). Taken before the step's exchange."""
    trainable = opt.trainable()
    follow, noted = opt.policy.follow, noted or {}
    out = []
    for p in trainable:
        sketch = noted.get(p)
        if sketch is None:
            sketch = (follow.summary(p.grad, trainable) if p.grad is not None else
                      torch.zeros(WIDTH, dtype=torch.float32, device=p.device))
        out.append(sketch)
    return out


def follow_(opt, sketches: list[torch.Tensor], coef: float | None = None, *,
            local: bool = True) -> None:
    """After a step: move each tensor's ``v_bar`` by the steps since its last move (its step
    count less ``variance_count``) with the estimate from ``sketches``: each rank's sketch of
    its local gradient (``local``: averaged here, one allreduce) or of the averaged gradient
    it holds (nothing sent). ``coef``: the clipping coefficient the averaged gradient was
    scaled by after it was sketched."""
    if not sketches:
        return
    stacked = torch.stack(sketches)
    world = opt.world_size
    if local and world > 1:
        work = dist.all_reduce(stacked, group=opt.comm_group, async_op=True)
        wait_collectives([work], opt.comm_timeout, "the variance follow's allreduce",
                         opt.comm_group)
        opt.counts.add_exact(ring_bytes(stacked.nbytes, world), 0)
        stacked.div_(world)
    squares = stacked.square_().sum(dim=1).tolist()
    if coef is not None and coef < 1.0:
        squares = [s * coef * coef for s in squares]
    if not all(math.isfinite(s) for s in squares):
        return  # a skipped step (the same on every rank): the variance moves with the next
    for p, square in zip(opt.trainable(), squares, strict=True):
        state = opt.state[p]
        if "step" not in state:
            continue  # no gradient yet
        n, t = state.get(_COUNT, 0.0), float(state["step"])
        if t <= n:
            continue
        beta2 = _beta2(opt, p)
        kept = beta2 ** (t - n)
        moved = kept * (1.0 - beta2 ** n) * state.get(_MEAN, 0.0) + \
            (1.0 - kept) * square / max(p.numel(), 1)
        state[_MEAN], state[_COUNT] = moved / (1.0 - beta2 ** t), t


def _beta2(opt, p: torch.Tensor) -> float:
    for group in opt.param_groups:
        if any(q is p for q in group["params"]):
            return group["betas"][1]
    raise KeyError("not a parameter of this optimizer")


def start_(opt, params=None) -> None:
    """The denominators of ``params`` (None: every trainable one that has not started, as at
    the freeze; a resumed state's numbers are kept) were just made: the scale is 1 from here,
    ``v_bar`` as it is now its reference."""
    for p in opt.trainable():
        state = opt.state[p]
        if params is None and _REF in state or params is not None and p not in params:
            continue
        state[_REF] = state.get(_MEAN, 0.0)


def scale(state: dict) -> float:
    """The factor on a parameter's denominator, ``sqrt(v_bar / v_bar when it was made)``; 1
    before the following starts, or for a tensor that had no gradient then."""
    ref = state.get(_REF)
    if not ref or ref <= 0.0:
        return 1.0
    return math.sqrt(state[_MEAN] / ref)
