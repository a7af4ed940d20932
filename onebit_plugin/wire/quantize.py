"""Blockwise int8 quantization of the full-precision steps: the layout, the torch reference, one
dispatch.

The warm-up's average (and 0/1 Adam's Adam steps and variance refreshes) at ``warmup_bits=8``
sends every value as an int8 with one fp32 scale per block of ``block`` values, symmetric and
round-to-nearest (DeepSpeed ZeRO++'s qwZ/qgZ rule): ``scale = max|x| / 127``,
``q = rint(x * (127 / max|x|))``, decoded as ``q * scale``. The three passes of its two-phase
allreduce (``onebit_plugin.comm.quantized``) are

* :func:`quantize` -- a rank's values to int8 and scales;
* :func:`average_quantize` -- the chunk's owner: every sender's int8 copy of it decoded and
  summed in rank order in fp32, divided by W, and quantized again;
* :func:`dequantize` -- the gathered chunks decoded.

Every pass has two compiled twins that give the same bits (``kernels/cpu_quantize.c`` on the
CPU, ``kernels/int8_quantize.py`` in Triton for CUDA tensors); these torch versions are the
reference and the fallback. The same bits everywhere because every operation is one correctly
rounded fp32 operation in a fixed order: the maximum (exact in any order), the two divisions,
the product, and rounding to an integer by adding and subtracting 1.5 * 2**23 (round half to
even for |y| < 2**22; here |y| <= 127). A block holding a value that is not finite gets a NaN
scale and zeros, so its NaN reaches every rank's decoded average, and the step that reads it is
skipped on every rank as at 32 bits.

Round-to-nearest, not stochastic rounding, and no error feedback: Adam's variance is built from
the averaged gradient squared, and stochastic rounding is unbiased for g but not for g**2, while
error feedback would add last step's residual to this step's g**2. The relative error of a
value at its block's maximum is at most 1/254; ``benchmarks/quantized_warmup.py`` measures what
the variance sees, by block size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from onebit_plugin.wire.dispatch import backend_for, cpu_kernel, triton_kernel

__all__ = ["QuantLayout", "average_quantize", "dequantize", "quantize"]

QMAX = 127.0
# Adding then subtracting 1.5 * 2**23 rounds an fp32 |y| < 2**22 to the nearest integer, ties
# to even: the sum lies in [2**23, 2**24), where fp32's spacing is 1.
_ROUNDER = 12582912.0


@dataclass(frozen=True)
class QuantLayout:
    """How a flat tensor of ``numel`` values is cut for ``world_size`` ranks: padded with zeros
    to ``world_size`` chunks, each ``blocks_per_chunk`` blocks of ``block`` values with one fp32
    scale each. The block is the largest multiple of 8 up to the ``max_block`` asked for that
    cuts a rank's share into equal blocks with the least padding (under 8 values per block),
    so a small tensor is not padded to a whole block per rank."""

    numel: int
    world_size: int
    block: int
    blocks_per_chunk: int

    @classmethod
    def create(cls, numel: int, world_size: int, max_block: int) -> QuantLayout:
        share = max(1, -(-numel // world_size))
        per = -(-share // max_block)
        values = -(-share // per)  # per block, before rounding up to 8
        block = -(-values // 8) * 8
        return cls(numel, world_size, block, per)

    @property
    def chunk(self) -> int:
        return self.blocks_per_chunk * self.block

    @property
    def padded_numel(self) -> int:
        return self.chunk * self.world_size

    @property
    def num_blocks(self) -> int:
        return self.blocks_per_chunk * self.world_size

    @property
    def row_bytes(self) -> int:
        """Bytes of one chunk on the wire: its int8 values, then its scales."""
        return self.chunk + 4 * self.blocks_per_chunk


# ----------------------------------------------------------------------------- the reference
def _quantize_torch(x: torch.Tensor, block: int, q: torch.Tensor, scales: torch.Tensor) -> None:
    v = x.view(-1, block)
    finite = torch.isfinite(v)
    absmax = torch.where(finite, v.abs(), 0.0).amax(dim=1)
    bad = ~finite.all(dim=1)
    # 127 / 0 is inf, and 0 * inf NaN: a block of zeros (or of values below 127 / FLT_MAX,
    # 3.7e-37, whose inverse overflows) gets the inverse 0, so q = 0.
    # A true division, as the C and Triton passes do: torch's `scalar / tensor` is
    # `tensor.reciprocal() * scalar` (torch/_tensor.py, __rdiv__), two roundings that differ
    # from 127 / m in 1,053,880 of 4,194,304 random m; 8 of 8M randn values then fell on the
    # other side of a .5 tie (benchmarks/compression_throughput.py's same-bits check).
    inv = torch.full_like(absmax, QMAX).div_(absmax)
    inv = torch.where(torch.isfinite(inv), inv, 0.0)
    y = torch.where(bad[:, None], 0.0, v * inv[:, None])
    r = (y + _ROUNDER) - _ROUNDER
    q.view(-1, block).copy_(r.clamp_(-QMAX, QMAX))
    torch.div(absmax, QMAX, out=scales)
    scales.masked_fill_(bad, float("nan"))


def _average_torch(recv_q: torch.Tensor, recv_scales: torch.Tensor, world: int, block: int,
                   q: torch.Tensor, scales: torch.Tensor) -> None:
    rows = recv_q.view(world, -1, block)
    total = torch.zeros(rows.shape[1:], dtype=torch.float32, device=recv_q.device)
    for k in range(world):  # senders in rank order, each product rounded before the sum
        total += rows[k].to(torch.float32) * recv_scales.view(world, -1)[k][:, None]
    total /= world
    _quantize_torch(total.view(-1), block, q, scales)


def _dequantize_torch(q: torch.Tensor, scales: torch.Tensor, block: int,
                      out: torch.Tensor) -> None:
    torch.mul(q.view(-1, block).to(torch.float32), scales[:, None], out=out.view(-1, block))


# ------------------------------------------------------------------------------- dispatch
def _check(*pairs) -> None:
    for t, dtype, numel, what in pairs:
        if t.dtype != dtype or t.numel() != numel or not t.is_contiguous():
            raise ValueError(f"{what} must be a contiguous {dtype} tensor of {numel} values, got "
                             f"{t.dtype} of {t.numel()}{'' if t.is_contiguous() else ', strided'}")


def quantize(x: torch.Tensor, layout: QuantLayout, q: torch.Tensor, scales: torch.Tensor,
             backend: str | None = None) -> None:
    """``x`` (fp32, ``layout.padded_numel`` values) into ``q`` (int8, as many) and ``scales``
    (fp32, one per block)."""
    n = layout.padded_numel
    _check((x, torch.float32, n, "x"), (q, torch.int8, n, "q"),
           (scales, torch.float32, layout.num_blocks, "scales"))
    which = backend_for(x, backend, x, q, scales)
    if which == "triton":
        triton_kernel("quantize")(x, layout.block, q, scales)
    elif which == "cpu":
        cpu_kernel().quantize(x, layout.block, q, scales)
    else:
        _quantize_torch(x, layout.block, q, scales)


def average_quantize(recv_q: torch.Tensor, recv_scales: torch.Tensor, layout: QuantLayout,
                     q: torch.Tensor, scales: torch.Tensor, backend: str | None = None) -> None:
    """The owner's pass: ``recv_q`` (int8, W rows of a chunk) and ``recv_scales`` (fp32, W rows
    of the chunk's scales) decoded, summed in rank order, divided by W and quantized into ``q``
    (one chunk) and ``scales``."""
    world, chunk, per = layout.world_size, layout.chunk, layout.blocks_per_chunk
    _check((recv_q, torch.int8, world * chunk, "recv_q"),
           (recv_scales, torch.float32, world * per, "recv_scales"),
           (q, torch.int8, chunk, "q"), (scales, torch.float32, per, "scales"))
    which = backend_for(recv_scales, backend, recv_q, recv_scales, q, scales)
    if which == "triton":
        triton_kernel("average_quantize")(recv_q, recv_scales, world, layout.block, q, scales)
    elif which == "cpu":
        cpu_kernel().average_quantize(recv_q, recv_scales, world, layout.block, q, scales)
    else:
        _average_torch(recv_q, recv_scales, world, layout.block, q, scales)


def dequantize(q: torch.Tensor, scales: torch.Tensor, layout: QuantLayout, out: torch.Tensor,
               backend: str | None = None) -> None:
    """``out`` (fp32, ``layout.padded_numel`` values) = ``q * scale`` of its block."""
    n = layout.padded_numel
    _check((q, torch.int8, n, "q"), (scales, torch.float32, layout.num_blocks, "scales"),
           (out, torch.float32, n, "out"))
    which = backend_for(out, backend, q, scales, out)
    if which == "triton":
        triton_kernel("dequantize")(q, scales, layout.block, out)
    elif which == "cpu":
        cpu_kernel().dequantize(q, scales, layout.block, out)
    else:
        _dequantize_torch(q, scales, layout.block, out)
