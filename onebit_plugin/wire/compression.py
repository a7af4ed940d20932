"""Sign compression with error feedback: the chunk layout, the pure-torch reference, one dispatch.

Every pass here has two compiled twins that give the same bits: Triton kernels for CUDA
tensors (``onebit_plugin.kernels.sign_compress``) and fused C passes for the CPU
(``onebit_plugin.kernels.cpu``, the default there when a C compiler is found); these torch
versions are the reference the kernel tests compare against, and the CPU fallback. The three
stages are the three passes of the compressed allreduce (docs/design.md, "The algorithm"):

* :func:`worker_compress` -- ``c = (x + error) * mask``, one fp32 scale per block, signs packed
  8 per byte, ``error = c - scale * sign(c) * mask``;
* :func:`server_compress` -- decode every sender's copy of this rank's chunk, average, add the
  server error, and compress again with the same rule;
* :func:`decompress` -- ``out = scale * sign * mask``.

Conventions, shared bit for bit with the kernels (docs/design.md, "The algorithm"): bit ``i`` of
byte ``k`` holds element ``8k + i``, set for ``value >= 0`` (zero is sent as ``+1``); a block's
scale is the root mean square of its unmasked values, ``sqrt(sum(c**2) / count)``, or with
``scale="mean"`` their mean ``|c|`` (``benchmarks/scale_rule.py`` measures why RMS is the
default); masked coordinates (the padding tail included) decode to exactly 0 and keep no error.

Every backend computes a scale with the same operations in the same order, so that all agree
bit for bit: the terms ``c*c`` (or ``|c|``) are rounded to fp32, the block is padded with zeros
to ``block_tile(block)`` values (a power of two) and the upper half is added onto the lower half
until one value is left (:func:`block_sums_`); that sum is divided by ``count`` in fp32, and the
RMS rule's square root is correctly rounded (taken in fp64: exact for fp32 inputs). CPU
``torch.sqrt`` on fp32 is not (1 ulp off on about 20% of inputs), nor is a reduction whose
order is the library's choice.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from onebit_plugin.settings.config import MAX_BLOCK, SCALE_RULES
from onebit_plugin.wire.deferred import Fold
from onebit_plugin.wire.dispatch import BACKENDS, backend_for, block_tile, cpu_kernel, triton_kernel

__all__ = [
    "BACKENDS",
    "ChunkLayout",
    "CompressionBuffers",
    "backend_for",
    "CoordinateMask",
    "block_sums_",
    "block_tile",
    "decompress",
    "round_to_bf16_",
    "server_compress",
    "worker_compress",
]

# 0x0102040810204080 moves byte i of an int64 (each byte 0 or 1) to bit 56 + i with no carries,
# so one multiply and one shift pack 8 bools into a byte: about 10x faster than a weighted sum
# over a (n/8, 8) view.
_PACK_MAGIC = 0x0102040810204080
# Decoding is one gather from a 256 x 8 table of +-1: about 10x faster than shifting and
# masking each bit.
_SIGN_TABLES: dict[torch.device, torch.Tensor] = {}


def _sign_table(device: torch.device) -> torch.Tensor:
    table = _SIGN_TABLES.get(device)
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = (bits * 2 - 1).to(dtype=torch.float32, device=device)
        _SIGN_TABLES[device] = table
    return table


@dataclass(frozen=True)
class ChunkLayout:
    """How a flat tensor of ``numel`` values is split across ``world_size`` ranks.

    The flat tensor is padded to ``padded_numel = world_size * chunk``; rank ``j`` is the server
    of chunk ``j``. A chunk is ``blocks_per_chunk`` blocks of ``block`` values, each with its own
    fp32 scale. ``block`` is a multiple of 8 (whole bytes) no larger than ``max_block``, chosen so
    the blocks split a chunk evenly: padding is below ``8 * blocks_per_chunk`` values per chunk.
    """

    numel: int
    world_size: int
    block: int
    blocks_per_chunk: int
    scale: str = "rms"

    @classmethod
    def create(
        cls, numel: int, world_size: int, max_block: int = 2048, scale: str = "rms"
    ) -> ChunkLayout:
        if scale not in SCALE_RULES:
            raise ValueError(f"scale must be one of {SCALE_RULES}, got {scale!r}")
        if numel < 1:
            raise ValueError(f"numel must be >= 1, got {numel}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if max_block < 8 or max_block % 8 or max_block > MAX_BLOCK:
            raise ValueError(f"max_block must be a positive multiple of 8 up to {MAX_BLOCK}, "
                             f"got {max_block}")
        per_rank = -(-numel // world_size)
        blocks = -(-per_rank // max_block)
        block = -(-per_rank // blocks)
        block = -(-block // 8) * 8
        return cls(numel, world_size, block, blocks, scale)

    @property
    def chunk(self) -> int:
        return self.block * self.blocks_per_chunk

    @property
    def padded_numel(self) -> int:
        return self.chunk * self.world_size

    @property
    def num_blocks(self) -> int:
        return self.blocks_per_chunk * self.world_size

    def wire_bytes(self) -> int:
        """Bytes this rank sends per compressed allreduce: (W-1) chunks of bits and scales out in
        the first all-to-all, and its own server chunk to W-1 peers in the second."""
        per_chunk = self.chunk // 8 + 4 * self.blocks_per_chunk
        return 2 * (self.world_size - 1) * per_chunk

    def dense_wire_bytes(self, element_size: int = 4) -> int:
        """Bytes per rank of a bandwidth-optimal (ring) allreduce of the unpadded tensor."""
        return math.ceil(2 * (self.world_size - 1) / self.world_size * element_size * self.numel)


class CoordinateMask:
    """Which coordinates of a layout take part; the rest (the padding tail always) stay 0.

    Holds ``keep`` (bool, what the Triton kernels read) and ``counts`` (kept values per block,
    fp32, clamped to >= 1, the divisor of the block scale). ``dropped``, the int64 indices of
    the False entries, is what the CPU torch passes zero (in time proportional to how few they
    are, where a masked pass reads and writes every value); at 8 bytes per masked coordinate it
    is built on the first CPU pass only, never on the GPU path.
    """

    def __init__(self, keep: torch.Tensor, block: int):
        if keep.dtype != torch.bool or keep.dim() != 1 or keep.numel() % block:
            raise ValueError("keep must be a 1-D bool tensor of whole blocks")
        self.keep = keep
        # Summed as bytes into int32 (exact), then fp32: a bool tensor summed into fp32 directly
        # took 3-4x as long on CPU (6.5M values: 12 ms against 3, torch 2.13).
        self.counts = (keep.view(torch.uint8).view(-1, block).sum(dim=1, dtype=torch.int32)
                       .to(torch.float32).clamp_(min=1.0))
        self.block = block

    @functools.cached_property
    def dropped(self) -> torch.Tensor:
        return self.keep.logical_not().nonzero().view(-1)

    @classmethod
    def build(
        cls, layout: ChunkLayout, user_mask: torch.Tensor | None = None, device=None
    ) -> CoordinateMask:
        """True on the first ``numel`` values (and'ed with ``user_mask``), False on padding."""
        keep = torch.zeros(layout.padded_numel, dtype=torch.bool, device=device)
        if user_mask is None:
            keep[: layout.numel] = True
        else:
            if user_mask.numel() != layout.numel:
                raise ValueError(
                    f"mask has {user_mask.numel()} values, the tensor it masks has {layout.numel}"
                )
            keep[: layout.numel] = user_mask.reshape(-1).to(device=keep.device, dtype=torch.bool)
        return cls(keep, layout.block)

    def chunk(self, layout: ChunkLayout, rank: int) -> CoordinateMask:
        """The mask of server chunk ``rank``, indexed from the start of the chunk."""
        chunk = layout.chunk
        return CoordinateMask(self.keep[rank * chunk : (rank + 1) * chunk], self.block)

    def unmask_(self, index: torch.Tensor) -> None:
        """Coordinates ``index`` (int64, into ``keep``) take part from now on: only their
        blocks' counts and the index list change (a rebuild reads every value)."""
        self.keep[index] = True
        blocks = torch.unique(index // self.block)
        self.counts[blocks] = (self.keep.view(-1, self.block)[blocks].view(torch.uint8)
                               .sum(dim=1, dtype=torch.int32).to(torch.float32).clamp_(min=1.0))
        if "dropped" in vars(self):
            self.dropped = self.dropped[self.keep[self.dropped].logical_not()]

    def zero_(self, values: torch.Tensor) -> torch.Tensor:
        """Set the dropped coordinates of the 1-D ``values`` to 0; ``values`` may be shorter
        than the mask (a tensor without its padding tail)."""
        n = values.numel()
        if values.is_cuda:  # the GPU reads ``keep``: one pass, no index list
            return values.masked_fill_(self.keep[:n].logical_not(), 0.0)
        dropped = self.dropped
        if n < self.keep.numel():  # ascending: the ones below n come first
            dropped = dropped[: int(torch.searchsorted(dropped, n))]
        if dropped.numel():
            values.index_fill_(0, dropped, 0.0)
        return values


class CompressionBuffers:
    """Scratch for the CPU passes over up to ``num_values`` values, allocated once and reused.

    One set serves all three stages of a compressed allreduce: the worker pass and the final
    decode work on ``padded_numel`` values, the server pass decodes ``W * chunk``, the same
    number. The errors themselves are updated in place, so no copy of the input is made.

    Each buffer is made at its first use: the CPU kernel needs none of them (about 6 bytes
    per value that a unit would otherwise hold for nothing), the torch passes all.
    """

    def __init__(self, num_values: int, block: int, device: torch.device | str = "cpu"):
        self.num_values, self.block, self.device = num_values, block, device

    @functools.cached_property
    def values(self) -> torch.Tensor:
        return torch.empty(self.num_values, dtype=torch.float32, device=self.device)

    @functools.cached_property
    def bits(self) -> torch.Tensor:
        return torch.empty(self.num_values, dtype=torch.bool, device=self.device)

    @functools.cached_property
    def packed64(self) -> torch.Tensor:
        return torch.empty(self.num_values // 8, dtype=torch.int64, device=self.device)

    @functools.cached_property
    def block_sums(self) -> torch.Tensor:
        return torch.empty(self.num_values // self.block, dtype=torch.float32,
                           device=self.device)


# round_to_bf16_'s piece: its noise (4 bytes per value) stays at 1 MiB whatever the buffer.
ROUND_PIECE = 1 << 18


def round_to_bf16_(src: torch.Tensor, out: torch.Tensor, seed: int) -> None:
    """``src`` (fp32, overwritten) into ``out`` (bf16, as many values), rounded
    stochastically: up with probability equal to the fraction of a bf16 ulp that truncation
    would drop, so the rounding is unbiased (E[out] = src) and an error buffer kept in bf16
    loses nothing on average across the steps it carries a value (Gupta et al., 2015; MicroAdam
    keeps its error feedback compact for the same reason). The noise is 16 uniform bits per
    value from a generator seeded with ``seed``: the same bits on every backend and after a
    resume. Finite values only (an error buffer is cleared where it is not finite). In pieces
    of ``ROUND_PIECE`` values, so that the noise is never as large as the buffer."""
    gen = torch.Generator(device=src.device).manual_seed(seed)
    bits, dst = src.view(-1).view(torch.int32), out.view(-1).view(torch.int16)
    for start in range(0, bits.numel(), ROUND_PIECE):
        piece = bits[start : start + ROUND_PIECE]
        noise = torch.randint(0, 1 << 16, piece.shape, generator=gen, dtype=torch.int32,
                              device=src.device)
        # A float's bit pattern read as an integer is sign and magnitude: adding below the 16
        # bits bf16 keeps carries into the magnitude (up, either sign), and the arithmetic
        # shift keeps the sign bits, so the high half is the rounded bf16 pattern.
        dst[start : start + ROUND_PIECE].copy_(piece.add_(noise).bitwise_right_shift_(16))


def block_sums_(terms: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The sum of each row of ``terms`` (``(blocks, block)``, fp32, overwritten) in the order
    every backend uses: zero-padded to ``block_tile(block)`` columns, the upper half added onto
    the lower half until one column is left. Padding is never stored: the first halving adds
    only the columns that exist."""
    block = terms.shape[1]
    half = block_tile(block) // 2  # <= block
    if block > half:
        terms[:, : block - half].add_(terms[:, half:block])
    while half > 1:
        half //= 2
        terms[:, :half].add_(terms[:, half : 2 * half])
    return out.copy_(terms[:, 0])


def _scales_(sums: torch.Tensor, counts: torch.Tensor, rms: bool, out: torch.Tensor) -> None:
    torch.div(sums, counts, out=out)
    if rms:  # correctly rounded: fp64 holds every fp32 square root's rounding boundary
        out.copy_(out.double().sqrt_())


def _compress_(
    c: torch.Tensor,
    mask: CoordinateMask,
    layout: ChunkLayout,
    packed: torch.Tensor,
    scales: torch.Tensor,
    buf: CompressionBuffers,
) -> None:
    """Compress ``c`` in place (masked, fp32, whole blocks): write ``packed`` and ``scales``, and
    leave the new error ``c - decode(packed, scales)`` in ``c``."""
    size, block = c.numel(), layout.block
    blocks = size // block
    tmp = buf.values[:size]
    if layout.scale == "rms":
        torch.mul(c, c, out=tmp)
    else:
        torch.abs(c, out=tmp)
    block_sums_(tmp.view(blocks, block), buf.block_sums[:blocks])
    _scales_(buf.block_sums[:blocks], mask.counts, layout.scale == "rms", scales)
    bits = buf.bits[:size]
    torch.ge(c, 0, out=bits)
    packed64 = buf.packed64[: size // 8]
    torch.mul(bits.view(torch.uint8).view(torch.int64), _PACK_MAGIC, out=packed64)
    packed64.bitwise_right_shift_(56)
    packed.copy_(packed64)
    c.sub_(_decode_into(packed, scales, mask, block, tmp))


def _decode_into(
    packed: torch.Tensor, scales: torch.Tensor, mask: CoordinateMask, block: int,
    out: torch.Tensor,
) -> torch.Tensor:
    torch.index_select(
        _sign_table(packed.device), 0, packed.view(-1).to(torch.int32), out=out.view(-1, 8)
    )
    out.view(-1, block).mul_(scales.view(-1, 1))
    return mask.zero_(out)


def worker_compress(
    x: torch.Tensor,
    error: torch.Tensor,
    mask: CoordinateMask,
    layout: ChunkLayout,
    packed: torch.Tensor,
    scales: torch.Tensor,
    buf: CompressionBuffers | None = None,
    backend: str | None = None,
) -> None:
    """Worker side: compress ``x + error`` into ``packed``/``scales`` and update ``error``.

    Args:
        x: contiguous input of ``layout.numel`` values (fp32, bf16 or fp16), or a
            :class:`~onebit_plugin.wire.deferred.Fold` of that many: the CPU kernel folds it inside
            the pass, other backends fold it into its ``out`` first.
        error: fp32 worker error, ``layout.padded_numel`` values, updated in place.
        mask: the layout's :class:`CoordinateMask`.
        packed: uint8 output, ``padded_numel // 8`` bytes.
        scales: fp32 output, ``layout.num_blocks`` values.
        buf: scratch for ``padded_numel`` values (torch path); allocated when omitted.
        backend: see :func:`onebit_plugin.wire.dispatch.backend_for`.
    """
    fold = None
    if isinstance(x, Fold):
        chosen = backend_for(x.exp_avg, backend, x.exp_avg, error, packed, scales)
        table = x.cpu_table() if chosen == "cpu" else None
        if table is None:
            x = x.materialize()
        else:
            fold = (x.exp_avg, table)
    else:
        chosen = backend_for(x, backend, x, error, packed, scales)
    if chosen == "triton":
        triton_kernel("worker_compress")(x, error, mask, layout, packed, scales)
        return
    if chosen == "cpu":
        cpu_kernel().worker_compress(x, error, mask, layout, packed, scales,
                                     block_tile(layout.block), fold)
        return
    buf = _check_buffers(buf, layout.padded_numel, layout.block, x.device)
    # c = x + error, built in the error buffer (its padding is always 0).
    error[: layout.numel].add_(x.view(-1))
    _compress_(mask.zero_(error), mask, layout, packed, scales, buf)


def server_compress(
    recv_packed: torch.Tensor,
    recv_scales: torch.Tensor,
    error: torch.Tensor,
    mask: CoordinateMask,
    layout: ChunkLayout,
    packed: torch.Tensor,
    scales: torch.Tensor,
    buf: CompressionBuffers | None = None,
    backend: str | None = None,
) -> None:
    """Server side for this rank's chunk: average the W senders, add the error, recompress.

    Args:
        recv_packed: uint8 ``(W, chunk // 8)``: row ``k`` holds sender ``k``'s bits of the chunk.
        recv_scales: fp32 ``(W, blocks_per_chunk)``.
        error: fp32 server error, ``chunk`` values, updated in place.
        mask: this chunk's :class:`CoordinateMask` (``CoordinateMask.chunk``).
        packed, scales: outputs, ``chunk // 8`` bytes and ``blocks_per_chunk`` values.
        buf: scratch for ``W * chunk`` values (torch path); allocated when omitted.
        backend: see :func:`onebit_plugin.wire.dispatch.backend_for`.
    """
    chosen = backend_for(recv_packed, backend, recv_packed, recv_scales, error, packed, scales)
    if chosen == "triton":
        triton_kernel("server_compress")(recv_packed, recv_scales, error, mask, layout, packed,
                                         scales)
        return
    if chosen == "cpu":
        cpu_kernel().server_compress(recv_packed, recv_scales, error, mask, layout, packed, scales,
                            block_tile(layout.block))
        return
    world, chunk, block = layout.world_size, layout.chunk, layout.block
    buf = _check_buffers(buf, world * chunk, block, recv_packed.device)
    decoded = buf.values[: world * chunk]
    torch.index_select(
        _sign_table(recv_packed.device), 0, recv_packed.view(-1).to(torch.int32),
        out=decoded.view(-1, 8),
    )
    decoded.view(world, -1, block).mul_(recv_scales.view(world, -1, 1))
    # Senders summed in rank order, then divided by W: the kernel's loop, bit for bit.
    rows = decoded.view(world, chunk)
    total = rows[0]
    for k in range(1, world):
        total.add_(rows[k])
    total.div_(world)
    error.add_(mask.zero_(total))
    _compress_(error, mask, layout, packed, scales, buf)


def decompress(
    packed: torch.Tensor,
    scales: torch.Tensor,
    mask: CoordinateMask,
    layout: ChunkLayout,
    out: torch.Tensor,
    buf: CompressionBuffers | None = None,
    backend: str | None = None,
) -> None:
    """Decode every chunk into ``out``: contiguous, ``layout.numel`` values, any float dtype.
    ``backend``: see :func:`backend_for`."""
    chosen = backend_for(packed, backend, packed, scales, out)
    if chosen == "triton":
        triton_kernel("decompress")(packed, scales, mask, layout, out)
        return
    total = layout.padded_numel
    buf = _check_buffers(buf, total, layout.block, packed.device)
    if chosen == "cpu":
        # fp32 straight into out; other dtypes through fp32 scratch and one rounding copy.
        target = out if out.dtype == torch.float32 else buf.values[: layout.numel]
        cpu_kernel().decompress(packed, scales, mask, layout, target)
        if target is not out:
            out.view(-1).copy_(target)
        return
    decoded = _decode_into(packed, scales, mask, layout.block, buf.values[:total])
    out.view(-1).copy_(decoded[: layout.numel])


def _check_buffers(
    buf: CompressionBuffers | None, size: int, block: int, device
) -> CompressionBuffers:
    if buf is None:
        return CompressionBuffers(size, block, device)
    if buf.num_values < size:
        raise ValueError(
            f"CompressionBuffers hold {buf.num_values} values, the pass needs {size}"
        )
    return buf
