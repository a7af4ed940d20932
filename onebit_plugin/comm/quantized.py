"""The full-precision steps' average in fewer bits (``warmup_bits``): a two-phase allreduce.

``warmup_bits=8`` sends blockwise int8 with one fp32 scale per block
(``onebit_plugin.wire.quantize``), ``16`` bf16. Both run the same two phases, each one
``all_to_all_single`` of ``W`` rows (as the 1-bit communicator's, ``allreduce._WireBuffers``):

1. every rank encodes its values and sends chunk ``k`` to rank ``k``;
2. rank ``k`` decodes the ``W`` copies of its chunk, sums them in fp32 in rank order, divides
   by ``W``, encodes the mean again and sends it to every rank.

Every rank then decodes the same bytes, the owner its own chunk included, so the ranks hold
bit-identical averages (``check_lockstep`` holds) and each value crossed the wire twice at
about 8 (or 16) bits: 2 (W - 1) / W bytes per value at 8 bits plus 4 bytes per block, against
8 (W - 1) / W for the fp32 ring allreduce. No error feedback: what one step rounds is not
carried into the next (onebit_plugin.wire.quantize says why). A value that is not finite on any
rank reaches every rank's average as a NaN or an infinity, and the step is skipped everywhere
as at 32 bits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from onebit_plugin.comm.collectives import wait_collectives
from onebit_plugin.wire.quantize import QuantLayout, average_quantize, dequantize, quantize

__all__ = ["QuantizedAverage"]


class _Rows:
    """One size's buffers: the padded fp32 values, the rows the two all-to-alls send and
    receive, and the int8 (or bf16) values and scales the passes read and write."""

    def __init__(self, lay: QuantLayout, bits: int, device: torch.device) -> None:
        world, u8 = lay.world_size, dict(dtype=torch.uint8, device=device)
        self.layout = lay
        self.values = torch.zeros(lay.padded_numel, dtype=torch.float32, device=device)
        self.row = lay.row_bytes if bits == 8 else 2 * lay.chunk
        self.send = torch.empty(world, self.row, **u8)
        self.recv = torch.empty(world, self.row, **u8)
        if bits == 8:
            i8, f32 = dict(dtype=torch.int8, device=device), dict(dtype=torch.float32,
                                                                  device=device)
            self.q = torch.empty(lay.padded_numel, **i8)
            self.scales = torch.empty(lay.num_blocks, **f32)
            self.own_q = torch.empty(lay.chunk, **i8)
            self.own_scales = torch.empty(lay.blocks_per_chunk, **f32)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in vars(self).values() if isinstance(t, torch.Tensor)]


class QuantizedAverage:
    """Average a flat fp32 tensor across a group in ``bits`` (8 or 16) bits per value, in place
    (:meth:`average_`). Holds one set of buffers per tensor size it has seen (the warm-up's
    flat gradients, or each DDP bucket's size), allocated once.

    Args:
        bits: 8 (blockwise int8) or 16 (bf16).
        max_block: the most values sharing one int8 scale (``QuantLayout``): each block costs
            4 bytes beside its ``max_block`` bytes (4096: +0.1%).
    """

    def __init__(self, bits: int, max_block: int = 4096) -> None:
        if bits not in (8, 16):
            raise ValueError(f"QuantizedAverage sends 8 or 16 bits per value, got {bits!r}")
        self.bits, self.max_block = bits, max_block
        self._rows: dict[tuple, _Rows] = {}

    def wire_bytes(self, numel: int, world: int) -> int:
        """Bytes one rank sends to average ``numel`` values over ``world`` ranks."""
        if world == 1:
            return 0
        lay = QuantLayout.create(numel, world, self.max_block)
        row = lay.row_bytes if self.bits == 8 else 2 * lay.chunk
        return 2 * (world - 1) * row

    def average_(self, flat: torch.Tensor, group, world: int, timeout) -> int:
        """``flat`` (1-D) replaced by its mean over the ``world`` ranks of ``group``; returns
        the bytes this rank sent."""
        if world == 1:
            return 0
        rows = self._rows_for(flat.numel(), world, flat.device)
        lay, n = rows.layout, flat.numel()
        rows.values[:n].copy_(flat)
        # The padding again zero: the last decode wrote NaN there if its block was not finite,
        # which would make every later call's last block non-finite (every step skipped).
        rows.values[n:].zero_()
        if self.bits == 8:
            self._encode_int8(rows)
        else:
            rows.send.view(torch.bfloat16).view(-1).copy_(rows.values)
        self._exchange(rows, group, timeout, "to each chunk's owner")
        if self.bits == 8:
            self._average_int8(rows)
        else:
            total = torch.zeros(lay.chunk, dtype=torch.float32, device=flat.device)
            for k in range(world):  # in rank order, as every rank's copy of the sum
                total += rows.recv[k].view(torch.bfloat16).to(torch.float32)
            total /= world
            rows.send.view(torch.bfloat16).copy_(total.to(torch.bfloat16).expand(world, -1))
        self._exchange(rows, group, timeout, "each owner's mean to every rank")
        if self.bits == 8:
            self._decode_int8(rows)
        else:
            rows.values.copy_(rows.recv.view(torch.bfloat16).view(-1))
        flat.copy_(rows.values[:n])
        return 2 * (world - 1) * rows.row

    def _rows_for(self, numel: int, world: int, device: torch.device) -> _Rows:
        key = (numel, world, device)
        rows = self._rows.get(key)
        if rows is None:
            rows = self._rows[key] = _Rows(QuantLayout.create(numel, world, self.max_block),
                                           self.bits, device)
        return rows

    @staticmethod
    def _encode_int8(rows: _Rows) -> None:
        lay = rows.layout
        quantize(rows.values, lay, rows.q, rows.scales)
        cut = lay.chunk
        rows.send[:, :cut].view(torch.int8).copy_(rows.q.view(lay.world_size, cut))
        rows.send[:, cut:].copy_(rows.scales.view(lay.world_size, -1).view(torch.uint8))

    @staticmethod
    def _average_int8(rows: _Rows) -> None:
        lay, world, cut = rows.layout, rows.layout.world_size, rows.layout.chunk
        # The received rows' values and scales, into the passes' contiguous buffers.
        rows.q.view(world, cut).copy_(rows.recv[:, :cut].view(torch.int8))
        rows.scales.view(world, -1).view(torch.uint8).copy_(rows.recv[:, cut:])
        average_quantize(rows.q, rows.scales, lay, rows.own_q, rows.own_scales)
        rows.send[:, :cut].view(torch.int8).copy_(rows.own_q.expand(world, cut))
        rows.send[:, cut:].copy_(rows.own_scales.view(torch.uint8).expand(world, -1))

    @staticmethod
    def _decode_int8(rows: _Rows) -> None:
        lay, world, cut = rows.layout, rows.layout.world_size, rows.layout.chunk
        rows.q.view(world, cut).copy_(rows.recv[:, :cut].view(torch.int8))
        rows.scales.view(world, -1).view(torch.uint8).copy_(rows.recv[:, cut:])
        dequantize(rows.q, rows.scales, lay, rows.values)

    @staticmethod
    def _exchange(rows: _Rows, group, timeout, what: str) -> None:
        work = dist.all_to_all_single(rows.recv.view(-1), rows.send.view(-1), group=group,
                                      async_op=True)
        wait_collectives([work], timeout, f"the {what} all-to-all of the quantized average",
                         group)

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of the buffers held (``onebit_plugin.core.memory``)."""
        return [("quantized average buffers", t) for rows in self._rows.values()
                for t in rows.tensors()]

    def __getstate__(self) -> dict:
        return {"bits": self.bits, "max_block": self.max_block, "_rows": {}}
