"""Triton kernels of the compressed allreduce: one fused pass per stage, one program per block.

Each program owns one block of ``block`` values (a multiple of 8, at most 2048 by default) and
views it as a ``(BYTES, 8)`` tile, so the 8 signs that share a byte sit in one row: packing is a
shift-and-sum along that row, unpacking a shift-and-and. The torch reference in
``onebit_plugin.compression`` defines the exact semantics; the packed bits match it bit for bit
and scales/errors to fp32 rounding (the block sums are reduced in a different order).

The kernels run on the CPU under ``TRITON_INTERPRET=1`` for testing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onebit_plugin.compression import ChunkLayout, CoordinateMask


@triton.jit
def _block_scale(c, count, RMS: tl.constexpr):
    if RMS:
        # sqrt_rn: correctly rounded, like torch.sqrt (plain sqrt may be approximate on GPUs).
        return tl.sqrt_rn(tl.sum(tl.sum(c * c, axis=1), axis=0) / count)
    return tl.sum(tl.sum(tl.abs(c), axis=1), axis=0) / count


@triton.jit
def _worker_compress_kernel(
    x_ptr,
    err_ptr,
    mask_ptr,
    counts_ptr,
    packed_ptr,
    scales_ptr,
    n,
    block,
    BYTES: tl.constexpr,
    RMS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BYTES)
    cols = tl.arange(0, 8)
    local = rows[:, None] * 8 + cols[None, :]
    in_block = local < block
    offs = pid * block + local
    keep = tl.load(mask_ptr + offs, mask=in_block, other=0) != 0
    x = tl.load(x_ptr + offs, mask=in_block & (offs < n), other=0.0).to(tl.float32)
    err = tl.load(err_ptr + offs, mask=in_block, other=0.0)
    c = tl.where(keep, x + err, 0.0)
    scale = _block_scale(c, tl.load(counts_ptr + pid), RMS)
    positive = c >= 0
    byte = tl.sum(positive.to(tl.int32) << cols[None, :], axis=1)
    tl.store(packed_ptr + pid * (block // 8) + rows, byte.to(tl.uint8), mask=rows < block // 8)
    tl.store(scales_ptr + pid, scale)
    decoded = tl.where(keep, tl.where(positive, scale, -scale), 0.0)
    tl.store(err_ptr + offs, c - decoded, mask=in_block)


@triton.jit
def _server_compress_kernel(
    recv_packed_ptr,
    recv_scales_ptr,
    err_ptr,
    mask_ptr,
    counts_ptr,
    packed_ptr,
    scales_ptr,
    world,
    block,
    blocks_per_chunk,
    BYTES: tl.constexpr,
    RMS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BYTES)
    cols = tl.arange(0, 8)
    local = rows[:, None] * 8 + cols[None, :]
    in_block = local < block
    offs = pid * block + local
    row_ok = rows < block // 8
    byte_offs = pid * (block // 8) + rows
    chunk_bytes = blocks_per_chunk * (block // 8)
    total = tl.zeros((BYTES, 8), dtype=tl.float32)
    # Senders in rank order, as the torch reference sums them.
    for k in range(world):
        byte = tl.load(recv_packed_ptr + k * chunk_bytes + byte_offs, mask=row_ok, other=0)
        bit = (byte.to(tl.int32)[:, None] >> cols[None, :]) & 1
        s = tl.load(recv_scales_ptr + k * blocks_per_chunk + pid)
        total += tl.where(bit != 0, s, -s)
    keep = tl.load(mask_ptr + offs, mask=in_block, other=0) != 0
    err = tl.load(err_ptr + offs, mask=in_block, other=0.0)
    y = tl.where(keep, total / world, 0.0) + err
    scale = _block_scale(y, tl.load(counts_ptr + pid), RMS)
    positive = y >= 0
    out_byte = tl.sum(positive.to(tl.int32) << cols[None, :], axis=1)
    tl.store(packed_ptr + byte_offs, out_byte.to(tl.uint8), mask=row_ok)
    tl.store(scales_ptr + pid, scale)
    decoded = tl.where(keep, tl.where(positive, scale, -scale), 0.0)
    tl.store(err_ptr + offs, y - decoded, mask=in_block)


@triton.jit
def _decompress_kernel(packed_ptr, scales_ptr, mask_ptr, out_ptr, n, block, BYTES: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BYTES)
    cols = tl.arange(0, 8)
    local = rows[:, None] * 8 + cols[None, :]
    in_block = local < block
    offs = pid * block + local
    byte = tl.load(packed_ptr + pid * (block // 8) + rows, mask=rows < block // 8, other=0)
    bit = (byte.to(tl.int32)[:, None] >> cols[None, :]) & 1
    scale = tl.load(scales_ptr + pid)
    keep = tl.load(mask_ptr + offs, mask=in_block, other=0) != 0
    value = tl.where(keep, tl.where(bit != 0, scale, -scale), 0.0)
    tl.store(out_ptr + offs, value.to(out_ptr.dtype.element_ty), mask=in_block & (offs < n))


def _tile_bytes(block: int) -> int:
    return max(2, triton.next_power_of_2(block // 8))


def worker_compress(x, error, mask: CoordinateMask, layout: ChunkLayout, packed, scales) -> None:
    """Launcher of the worker pass; arguments as ``onebit_plugin.compression.worker_compress``."""
    _worker_compress_kernel[(layout.num_blocks,)](
        x.view(-1), error, mask.keep.view(torch.uint8), mask.counts, packed, scales,
        layout.numel, layout.block, BYTES=_tile_bytes(layout.block),
        RMS=layout.scale == "rms",
    )


def server_compress(recv_packed, recv_scales, error, mask: CoordinateMask, layout: ChunkLayout,
                    packed, scales) -> None:
    """Launcher of the server pass; arguments as ``onebit_plugin.compression.server_compress``."""
    _server_compress_kernel[(layout.blocks_per_chunk,)](
        recv_packed, recv_scales, error, mask.keep.view(torch.uint8), mask.counts, packed, scales,
        layout.world_size, layout.block, layout.blocks_per_chunk,
        BYTES=_tile_bytes(layout.block), RMS=layout.scale == "rms",
    )


def decompress(packed, scales, mask: CoordinateMask, layout: ChunkLayout, out) -> None:
    """Launcher of the final decode; arguments as ``onebit_plugin.compression.decompress``."""
    _decompress_kernel[(layout.num_blocks,)](
        packed, scales, mask.keep.view(torch.uint8), out.view(-1), layout.numel, layout.block,
        BYTES=_tile_bytes(layout.block),
    )
