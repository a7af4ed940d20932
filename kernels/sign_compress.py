"""Triton kernels of the compressed allreduce: one fused pass per stage, one program per block.

Each program owns one block of ``block`` values (a multiple of 8) and views it as a ``(BYTES, 8)``
tile, so the 8 signs that share a byte sit in one row: packing is a shift-and-sum along that row,
unpacking a shift-and-and. The shared ``@triton.jit`` helpers below address a block, encode and
decode it; the three kernels only combine them. The torch reference in
``onebit_plugin.wire.compression`` defines the exact semantics, the block sums' order included, and
the kernels match it bit for bit: packed bits, scales and errors.

The kernels run on the CPU under ``TRITON_INTERPRET=1`` for testing.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from . import block_tile


@triton.jit
def _block_tile(block, BYTES: tl.constexpr):
    """This program's block: its index and first value (int64), ``(rows, cols)`` of the byte
    tile, the offsets of its values within the block and which of them lie inside it. The
    offsets are int32, added to pointers that already point at the block: int64 offsets per
    value took 255 registers and spilled at ``max_block=16384`` (sm_90, ptxas;
    tests/test_kernels.py reads the report)."""
    pid = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BYTES)
    cols = tl.arange(0, 8)
    local = rows[:, None] * 8 + cols[None, :]
    return pid, pid * block, rows, cols, local, local < block


@triton.jit
def _decode(byte, cols, scale):
    """``+-scale`` per bit of a column of bytes (bit i of a byte is its value 8k+i)."""
    bit = (byte.to(tl.int32)[:, None] >> cols[None, :]) & 1
    return tl.where(bit != 0, scale, -scale)


@triton.jit
def _tree_sum(terms, BYTES: tl.constexpr, LEVELS: tl.constexpr):
    """The sum of a ``(BYTES, 8)`` tile in the reference's order
    (``onebit_plugin.wire.compression.block_sums_``): flat, row-major, the upper half added onto the
    lower half until one value is left (``LEVELS = log2(8 * BYTES)`` halvings). A sum over an
    axis of 2 is one addition, exact in either order; the reshapes keep the order
    (``can_reorder`` is off)."""
    flat = tl.reshape(terms, (BYTES * 8,))
    for level in tl.static_range(LEVELS):
        flat = tl.sum(tl.reshape(flat, (2, (BYTES * 4) >> level)), axis=0)
    return tl.sum(flat, axis=0)


@triton.jit
def _encode_store(c, keep, count, cols, rows, block, packed, scale_ptr,
                  BYTES: tl.constexpr, LEVELS: tl.constexpr, RMS: tl.constexpr):
    """Store the signs (``c >= 0`` set) at ``packed`` (the block's first byte) and the block
    scale of ``c`` at ``scale_ptr``; return the new error ``c - decode`` (0 on masked
    coordinates)."""
    # div_rn and sqrt_rn: correctly rounded, as the reference's. Triton's "/" compiles to
    # div.full.f32 (approximate, up to 2 ulp) and plain sqrt may be approximate; the interpreter
    # divides exactly, so only the compiled PTX shows it (tests/test_kernels.py reads it).
    if RMS:
        scale = tl.sqrt_rn(tl.div_rn(_tree_sum(c * c, BYTES, LEVELS), count))
    else:
        scale = tl.div_rn(_tree_sum(tl.abs(c), BYTES, LEVELS), count)
    positive = c >= 0
    byte = tl.sum(positive.to(tl.int32) << cols[None, :], axis=1)
    tl.store(packed + rows, byte.to(tl.uint8), mask=rows < block // 8)
    tl.store(scale_ptr, scale)
    return c - tl.where(keep, tl.where(positive, scale, -scale), 0.0)


@triton.jit
def _worker_compress_kernel(x_ptr, err_ptr, mask_ptr, counts_ptr, packed_ptr, scales_ptr, n,
                            block, BYTES: tl.constexpr, LEVELS: tl.constexpr,
                            RMS: tl.constexpr):
    pid, first, rows, cols, local, in_block = _block_tile(block, BYTES)
    err_ptr += first
    keep = tl.load(mask_ptr + first + local, mask=in_block, other=0) != 0
    # The values past n (the last block's padding) read as 0; int32 against an int32 bound.
    present = local < tl.minimum(n - first, block).to(tl.int32)
    x = tl.load(x_ptr + first + local, mask=in_block & present, other=0.0).to(tl.float32)
    err = tl.load(err_ptr + local, mask=in_block, other=0.0)
    c = tl.where(keep, x + err, 0.0)
    new_err = _encode_store(c, keep, tl.load(counts_ptr + pid), cols, rows, block,
                            packed_ptr + pid * (block // 8), scales_ptr + pid, BYTES, LEVELS,
                            RMS)
    tl.store(err_ptr + local, new_err, mask=in_block)


@triton.jit
def _server_compress_kernel(recv_packed_ptr, recv_scales_ptr, err_ptr, mask_ptr, counts_ptr,
                            packed_ptr, scales_ptr, world, block, blocks_per_chunk,
                            BYTES: tl.constexpr, LEVELS: tl.constexpr, RMS: tl.constexpr):
    pid, first, rows, cols, local, in_block = _block_tile(block, BYTES)
    chunk_bytes = blocks_per_chunk * (block // 8)
    received = recv_packed_ptr + pid * (block // 8)
    total = tl.zeros((BYTES, 8), dtype=tl.float32)
    # Senders in rank order, as the torch reference sums them.
    for k in range(world):
        # int64: W * chunk_bytes passes 2**31 for chunks of ~2e9 values (the flat path).
        byte = tl.load(received + tl.cast(k, tl.int64) * chunk_bytes + rows,
                       mask=rows < block // 8, other=0)
        total += _decode(byte, cols, tl.load(recv_scales_ptr + k * blocks_per_chunk + pid))
    err_ptr += first
    keep = tl.load(mask_ptr + first + local, mask=in_block, other=0) != 0
    err = tl.load(err_ptr + local, mask=in_block, other=0.0)
    y = tl.where(keep, tl.div_rn(total, world.to(tl.float32)), 0.0) + err  # exact, as above
    new_err = _encode_store(y, keep, tl.load(counts_ptr + pid), cols, rows, block,
                            packed_ptr + pid * (block // 8), scales_ptr + pid, BYTES, LEVELS,
                            RMS)
    tl.store(err_ptr + local, new_err, mask=in_block)


@triton.jit
def _decompress_kernel(packed_ptr, scales_ptr, mask_ptr, out_ptr, n, block, BYTES: tl.constexpr):
    pid, first, rows, cols, local, in_block = _block_tile(block, BYTES)
    byte = tl.load(packed_ptr + pid * (block // 8) + rows, mask=rows < block // 8, other=0)
    keep = tl.load(mask_ptr + first + local, mask=in_block, other=0) != 0
    value = tl.where(keep, _decode(byte, cols, tl.load(scales_ptr + pid)), 0.0)
    present = local < tl.minimum(n - first, block).to(tl.int32)
    tl.store(out_ptr + first + local, value.to(out_ptr.dtype.element_ty),
             mask=in_block & present)


def _launch_config(layout, *tensors: torch.Tensor) -> dict:
    """``BYTES`` and ``num_warps`` for the layout's block, after checking that every tensor is
    contiguous and on one device (a kernel reads raw pointers: a strided or foreign tensor would
    be read wrongly or fault)."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"kernel arguments on several devices: {sorted(map(str, devices))}")
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"kernel argument of shape {tuple(t.shape)} is not contiguous")
    tile = block_tile(layout.block) // 8
    # No fused multiply-add: the reference rounds c*c before adding it.
    return {"BYTES": tile, "num_warps": num_warps(tile), "enable_fp_fusion": False}


def num_warps(tile: int) -> int:
    """One warp per 256 values of the block (32 lanes x 8 values), 1 to 16 warps: 16 at
    max_block=16384, where 8 left 64 values a thread and 203-255 registers (sm_90)."""
    return min(16, max(1, tile // 32))


def _sum_config(layout) -> dict:
    return {"LEVELS": (block_tile(layout.block)).bit_length() - 1}


def _on_device(tensor: torch.Tensor):
    """Triton launches on the *current* device and its current stream: make that the tensors'
    device (a rank that never called ``torch.cuda.set_device`` would launch on GPU 0)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def worker_compress(x, error, mask, layout, packed, scales) -> None:
    """Launcher of the worker pass; arguments as
    ``onebit_plugin.wire.compression.worker_compress``."""
    config = _launch_config(layout, x, error, mask.keep, packed, scales)
    with _on_device(x):
        _worker_compress_kernel[(layout.num_blocks,)](
            x.view(-1), error, mask.keep.view(torch.uint8), mask.counts, packed, scales,
            layout.numel, layout.block, RMS=layout.scale == "rms", **config,
            **_sum_config(layout),
        )


def server_compress(recv_packed, recv_scales, error, mask, layout,
                    packed, scales) -> None:
    """Launcher of the server pass; arguments as
    ``onebit_plugin.wire.compression.server_compress``."""
    config = _launch_config(layout, recv_packed, recv_scales, error, mask.keep, packed, scales)
    with _on_device(error):
        _server_compress_kernel[(layout.blocks_per_chunk,)](
            recv_packed, recv_scales, error, mask.keep.view(torch.uint8), mask.counts, packed,
            scales, layout.world_size, layout.block, layout.blocks_per_chunk,
            RMS=layout.scale == "rms", **config, **_sum_config(layout),
        )


def decompress(packed, scales, mask, layout, out) -> None:
    """Launcher of the final decode; arguments as ``onebit_plugin.wire.compression.decompress``."""
    config = _launch_config(layout, packed, scales, mask.keep, out)
    with _on_device(out):
        _decompress_kernel[(layout.num_blocks,)](
            packed, scales, mask.keep.view(torch.uint8), out.view(-1), layout.numel,
            layout.block, **config,
        )
