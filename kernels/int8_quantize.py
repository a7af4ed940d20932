"""Triton kernels of the int8 two-phase allreduce (``warmup_bits=8``): one program per block.

The torch reference in ``onebit_plugin.wire.quantize`` defines the semantics and these match it
bit for bit: ``tl.div_rn`` for the two divisions (Triton's ``/`` compiles to the approximate
``div.full.f32``), no fused multiply-add (the reference rounds ``q * scale`` before adding
it), and the integer by adding and subtracting 1.5 * 2**23. ``TILE``: the block rounded up to
a power of two (``tl.arange`` needs one), the lanes past the block masked.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .sign_compress import _on_device, num_warps

__all__ = ["average_quantize", "dequantize", "quantize"]


@triton.jit
def _quantize_store(x, inside, q_ptr, scale_ptr):
    """Quantize ``x`` (one block, ``inside`` its lanes) to ``q_ptr`` and its scale to
    ``scale_ptr``."""
    finite = (x == x) & (tl.abs(x) <= 3.4028234663852886e38)
    bad = tl.max(tl.where(inside & ~finite, 1, 0), axis=0) > 0
    absmax = tl.max(tl.where(inside & finite, tl.abs(x), 0.0), axis=0)
    # 127 / 0 (or / a max so small that it overflows) is 0, as the reference's: the max of an
    # all-zero block is replaced by 1 before dividing, so that no lane divides by zero.
    inv = tl.div_rn(tl.full((), 127.0, tl.float32), tl.where(absmax > 0, absmax, 1.0))
    inv = tl.where((absmax > 0) & (inv <= 3.4028234663852886e38), inv, 0.0)
    y = tl.where(bad, 0.0, x * inv)
    r = (y + 12582912.0) - 12582912.0
    r = tl.minimum(tl.maximum(r, -127.0), 127.0)
    tl.store(q_ptr, r.to(tl.int8), mask=inside)
    scale = tl.div_rn(absmax, tl.full((), 127.0, tl.float32))
    tl.store(scale_ptr, tl.where(bad, float("nan"), scale))


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scales_ptr, block, TILE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, TILE)
    inside = lane < block
    x = tl.load(x_ptr + pid * block + lane, mask=inside, other=0.0)
    _quantize_store(x, inside, q_ptr + pid * block + lane, scales_ptr + pid)


@triton.jit
def _average_quantize_kernel(recv_q_ptr, recv_scales_ptr, q_ptr, scales_ptr, world, per, block,
                             TILE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, TILE)
    inside = lane < block
    chunk = per * block
    total = tl.zeros((TILE,), dtype=tl.float32)
    for k in range(world):  # senders in rank order, as the reference sums them
        row = tl.load(recv_q_ptr + tl.cast(k, tl.int64) * chunk + pid * block + lane,
                      mask=inside, other=0)
        total += row.to(tl.float32) * tl.load(recv_scales_ptr + k * per + pid)
    total = tl.div_rn(total, world.to(tl.float32))
    _quantize_store(total, inside, q_ptr + pid * block + lane, scales_ptr + pid)


@triton.jit
def _dequantize_kernel(q_ptr, scales_ptr, out_ptr, block, TILE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, TILE)
    inside = lane < block
    q = tl.load(q_ptr + pid * block + lane, mask=inside, other=0)
    tl.store(out_ptr + pid * block + lane, q.to(tl.float32) * tl.load(scales_ptr + pid),
             mask=inside)


def _config(block: int) -> dict:
    tile = 1 << max(3, (block - 1).bit_length())
    return {"TILE": tile, "num_warps": num_warps(tile // 8), "enable_fp_fusion": False}


def quantize(x, block: int, q, scales) -> None:
    """Launcher of :func:`onebit_plugin.wire.quantize.quantize`'s pass."""
    with _on_device(x):
        _quantize_kernel[(scales.numel(),)](x, q, scales, block, **_config(block))


def average_quantize(recv_q, recv_scales, world: int, block: int, q, scales) -> None:
    """Launcher of :func:`onebit_plugin.wire.quantize.average_quantize`'s pass."""
    with _on_device(q):
        _average_quantize_kernel[(scales.numel(),)](recv_q, recv_scales, q, scales, world,
                                                    scales.numel(), block, **_config(block))


def dequantize(q, scales, block: int, out) -> None:
    """Launcher of :func:`onebit_plugin.wire.quantize.dequantize`'s pass."""
    with _on_device(out):
        _dequantize_kernel[(scales.numel(),)](q, scales, out, block, **_config(block))
