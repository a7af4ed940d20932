"""Communicators: average a flat tensor across a process group, exactly or as 1-bit signs.

Two implementations of one interface, so that ``OneBitAdam(compress_momentum=False)`` means the
same on every path (docs/design.md, "Communicators"):

* :class:`ExactAllreduce` -- an fp32 sum allreduce divided by W;
* :class:`OneBitAllreduce` -- the compressed allreduce of Tang et al. (2021): signs of
  ``tensor + worker_error`` to each chunk's owner (all-to-all), the owner averages, adds its
  server error and compresses again and sends that to every rank (a second all-to-all), and
  every rank decodes the same bytes.

A communicator holds no error feedback: the error buffers belong to whoever owns the tensor (the
optimizer's momentum units, or a ``standalone.CompressedAllreduce``), are made by
:meth:`~Plan.new_errors` and passed to every call. What a communicator keeps per tensor size --
layout, mask, wire buffers -- is a :class:`Plan`. Asynchronous calls of every communicator of a
process group run in order on one background thread of that group (:func:`comm_executor`), so
collectives keep the same order on every rank.
"""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from onebit_plugin.comm.collectives import (
    all_finite,
    comm_executor,
    group_size_and_rank,
    resolve_device,
    wait_collectives,
)
from onebit_plugin.wire.compression import (
    ChunkLayout,
    CompressionBuffers,
    CoordinateMask,
    decompress,
    round_to_bf16_,
    server_compress,
    worker_compress,
)
from onebit_plugin.wire.deferred import Encoded, Fold
from onebit_plugin.wire.dispatch import backend_for

__all__ = ["ExactAllreduce", "OneBitAllreduce", "Plan"]


def _as_timedelta(timeout) -> timedelta | None:
    return timedelta(seconds=timeout) if isinstance(timeout, int | float) else timeout


class Plan:
    """What a communicator keeps for one tensor size: its layout, its mask and (1-bit) its wire
    buffers, allocated once. Made by the communicator's :meth:`plan`."""

    def __init__(self, layout: ChunkLayout, keep: torch.Tensor | None, device, rank: int,
                 wire: bool, error_dtype: torch.dtype = torch.float32, salt: int = 0):
        self.layout, self.device, self.rank = layout, resolve_device(device), rank
        # bf16 errors: their stochastic rounding's noise differs per plan (``salt``: the
        # communicator's count of plans made, the same on every run) and per rank.
        self.error_dtype, self.salt = error_dtype, salt
        self.remask_(keep)
        self.wire = _WireBuffers(layout, self.device) if wire else None
        # The last reduce_ left its average encoded in the wire buffers (decode=False).
        self.encoded = False

    def remask_(self, keep: torch.Tensor | None) -> None:
        """Take ``keep`` (flat bool over the unpadded values, or None: all) as the mask."""
        self.mask = CoordinateMask.build(self.layout, keep, self.device)
        self.chunk_mask = self.mask.chunk(self.layout, self.rank)

    def unmask_(self, index: torch.Tensor) -> None:
        """Coordinates ``index`` (int64, of the unpadded values; masked until now, so their
        errors are zero) take part from now on."""
        self.mask.unmask_(index)
        chunk = self.layout.chunk
        mine = index[(index >= self.rank * chunk) & (index < (self.rank + 1) * chunk)]
        if mine.numel():  # the chunk's ``keep`` is a view of the whole's: already set
            self.chunk_mask.unmask_(mine - self.rank * chunk)

    def new_errors(self) -> dict[str, torch.Tensor]:
        """Zero error buffers for this plan: ``worker`` (padded numel) and ``server`` (one
        chunk) for the 1-bit communicator, in its ``error_dtype``, and with bf16 errors
        ``draws``, the count of their stochastic roundings (so that a resumed run draws the
        same noise); none for the exact one."""
        if self.wire is None:
            return {}
        z = dict(dtype=self.error_dtype, device=self.device)
        errors = {"worker": torch.zeros(self.layout.padded_numel, **z),
                  "server": torch.zeros(self.layout.chunk, **z)}
        if self.error_dtype != torch.float32:
            errors["draws"] = torch.zeros((), dtype=torch.int64)
        return errors

    def keeps(self, keep: torch.Tensor) -> bool:
        """Whether ``keep`` (flat bool over the unpadded values) is the mask already."""
        return torch.equal(keep, self.mask.keep[: keep.numel()])

    def encoded_part(self, offset: int, numel: int, fallback) -> Encoded:
        """Values ``offset`` on (``numel`` of them) of the average the last call left encoded
        (:attr:`encoded`), as the CPU update pass reads them (``deferred.Encoded``)."""
        return Encoded(self.wire.all_packed, self.wire.all_scales, self.mask.keep,
                       self.layout.block, offset, numel, fallback)

    def decode_into_(self, out: torch.Tensor) -> None:
        """The average the last call left encoded, decoded into ``out`` (the unpadded
        values, fp32); nothing is left encoded after."""
        if self.encoded:
            decompress(self.wire.all_packed, self.wire.all_scales, self.mask, self.layout, out,
                       self.wire.scratch)
            self.encoded = False

    def error_dtype_of(self, errors: dict) -> torch.dtype | None:
        """The dtype of error buffers ``errors`` (this plan's, or a checkpoint's); None when
        there are none (an exact exchange's)."""
        worker = errors.get("worker")
        return None if worker is None else worker.dtype

    def buffers(self, errors: dict) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of what this plan and its error buffers ``errors`` hold
        (``onebit_plugin.core.memory``): errors, wire buffers, scratch made so far, masks."""
        out = [("rounding draws" if name == "draws" else f"{name} error", e)
               for name, e in errors.items()]
        if self.wire is not None:
            out += [("wire", t) for t in vars(self.wire).values() if isinstance(t, torch.Tensor)]
            if self.wire.scratch is not None:
                out += [("compression scratch", t) for t in vars(self.wire.scratch).values()
                        if isinstance(t, torch.Tensor)]
        for mask in (self.mask, self.chunk_mask):
            out.append(("masks", mask.keep))
            if "dropped" in vars(mask):  # the CPU torch passes' index list, once made
                out.append(("masks", mask.dropped))
        return out

    def clear_masked_(self, errors: dict[str, torch.Tensor]) -> None:
        """Zero the errors of masked coordinates, so that none ever leaks into a later call."""
        if errors:
            self.mask.zero_(errors["worker"])
            self.chunk_mask.zero_(errors["server"])


class _WireBuffers:
    """What the compression passes read and write, and the rows the two all-to-alls send.

    Each stage of the compressed allreduce is one ``all_to_all_single`` of ``W`` rows, a row
    being one chunk's packed signs followed by its block scales' bytes: the all-to-all sends row
    ``k`` to rank ``k``; the second one sends the rank's own server row to every rank, in place
    of an all-gather. The bytes are those of an all-gather, but gloo's all-gather is a ring of
    ``W - 1`` dependent steps where the all-to-all exchanges with every peer at once, and signs
    and scales in one collective instead of two halve the collectives per call: on 4 emulated
    hosts at 1 Gbit/s one call's collectives took half the time or less for 137,216 values and
    a quarter to a third less for 6,458,112 (``benchmarks/collective_patterns.py``;
    docs/design.md, "Communicators"). The copies into and out of the rows move 1/32 of the
    tensor's bytes each.
    """

    def __init__(self, lay: ChunkLayout, dev: torch.device):
        u8, f32 = dict(dtype=torch.uint8, device=dev), dict(dtype=torch.float32, device=dev)
        world, self.packed_bytes = lay.world_size, lay.chunk // 8
        self.send_packed = torch.empty(lay.padded_numel // 8, **u8)
        self.send_scales = torch.empty(lay.num_blocks, **f32)
        self.recv_packed = torch.empty(world, self.packed_bytes, **u8)
        self.recv_scales = torch.empty(world, lay.blocks_per_chunk, **f32)
        self.own_packed = torch.empty(self.packed_bytes, **u8)
        self.own_scales = torch.empty(lay.blocks_per_chunk, **f32)
        self.all_packed = torch.empty(lay.padded_numel // 8, **u8)
        self.all_scales = torch.empty(lay.num_blocks, **f32)
        row = self.packed_bytes + lay.blocks_per_chunk * 4
        self.send_rows = torch.empty(world, row, **u8)
        self.recv_rows = torch.empty(world, row, **u8)
        self.scratch = None if dev.type == "cuda" else CompressionBuffers(
            lay.padded_numel, lay.block, dev
        )

    def to_rows(self, packed: torch.Tensor, scales: torch.Tensor) -> None:
        """Fill ``send_rows``: row k from chunk k of ``packed``/``scales``, or every row from
        the one chunk given (the server's own)."""
        world, cut = self.send_rows.shape[0], self.packed_bytes
        self.send_rows[:, :cut].copy_(packed.view(-1, cut).expand(world, cut))
        scale_bytes = scales.view(-1, self.own_scales.numel()).view(torch.uint8)
        self.send_rows[:, cut:].copy_(scale_bytes.expand(world, -1))

    def from_rows(self, packed: torch.Tensor, scales: torch.Tensor) -> None:
        """Split ``recv_rows`` into ``packed`` (W chunks of signs) and ``scales``."""
        world, cut = self.recv_rows.shape[0], self.packed_bytes
        packed.view(world, cut).copy_(self.recv_rows[:, :cut])
        scales.view(world, -1).view(torch.uint8).copy_(self.recv_rows[:, cut:])


class _Communicator:
    """The interface: ``plan()`` once per tensor, then ``reduce_()`` (or ``submit()``) per call.

    Counters, summed over calls: ``bytes_sent`` (bytes this rank handed to the collectives for
    other ranks), ``dense_bytes`` (what a bandwidth-optimal fp32 ring allreduce of the same
    tensors would have sent), ``calls``, ``skipped_calls``, ``wait_seconds`` (waiting on the
    collectives) and ``busy_seconds`` (everything else: compression passes, copies).
    """

    compressed = False

    def __init__(self, group: dist.ProcessGroup | None = None,
                 timeout: float | timedelta | None = None):
        self.group, self.timeout = group, _as_timedelta(timeout)
        self.world_size, self.rank = group_size_and_rank(group)
        self.bytes_sent = self.dense_bytes = self.calls = self.skipped_calls = 0
        self.wait_seconds = self.busy_seconds = 0.0
        self._stream = None
        self._lock = threading.Lock()

    def plan(self, numel: int, keep: torch.Tensor | None = None, device=None) -> Plan:
        layout = self._layout(numel)
        return Plan(layout, keep, device or "cpu", self.rank, self.compressed)

    def _layout(self, numel: int) -> ChunkLayout:
        return ChunkLayout.create(numel, self.world_size, 8)

    def reduce_(self, tensor: torch.Tensor, plan: Plan, errors: dict,
                out: torch.Tensor | None = None, decode: bool = True) -> bool:
        """Write the average of ``tensor`` over the group's ranks into ``out`` (default:
        ``tensor``); masked coordinates come out exactly 0. Returns False, on every rank alike
        and with ``out`` untouched, when some rank's input was not finite. ``tensor`` may be
        a :class:`~onebit_plugin.wire.deferred.Fold` (default ``out``: its ``out``), which the 1-bit
        communicator's CPU kernel folds as it compresses. With ``decode=False`` the 1-bit
        communicator may leave the average encoded in ``plan``'s wire buffers (then
        ``plan.encoded``, and ``out`` is not written) where the CPU kernel can read it so
        (``MomentumUnit.averaged``)."""
        if out is None and not isinstance(tensor, Fold):
            out = tensor
        started, waited = time.perf_counter(), self.wait_seconds
        plan.encoded = False
        with self._lock:
            ok = self._reduce(tensor, out, plan, errors, decode)
        self.calls += 1
        self.skipped_calls += not ok
        self.dense_bytes += plan.layout.dense_wire_bytes(4)
        self.busy_seconds += time.perf_counter() - started - (self.wait_seconds - waited)
        return ok

    def submit(self, tensor: torch.Tensor, plan: Plan, errors: dict,
               out: torch.Tensor | None = None, decode: bool = True) -> torch.futures.Future:
        """:meth:`reduce_` on the group's background thread; the future's value is its bool."""
        event = None
        data = tensor.exp_avg if isinstance(tensor, Fold) else tensor
        if data.is_cuda:  # recorded on the tensor's device's stream, not the current device's
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(data.device))
        future = torch.futures.Future(devices=[data.device] if data.is_cuda else None)

        def job():
            try:
                if event is None:
                    future.set_result(self.reduce_(tensor, plan, errors, out, decode))
                    return
                # The thread is bound to the tensor's GPU (else it would use, and open a context
                # on, GPU 0); one side stream per communicator, after the producer's event.
                torch.cuda.set_device(data.device)
                if self._stream is None:
                    self._stream = torch.cuda.Stream(device=data.device)
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(event)
                    ok = self.reduce_(tensor, plan, errors, out, decode)
                self._stream.synchronize()
                future.set_result(ok)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                future.set_exception(exc)

        comm_executor(self.group).submit(job)
        return future

    @contextlib.contextmanager
    def beside_dense(self):
        """Calls made inside count in ``bytes_sent`` alone: exchanges a plain fp32 DDP run
        would not make (0/1 Adam's sync between steps, ``sync_local_steps``), so that
        ``dense_bytes`` stays what DDP would have sent."""
        dense = self.dense_bytes
        try:
            yield
        finally:
            self.dense_bytes = dense

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of the scratch the communicator itself holds (its plans' are
        :meth:`Plan.buffers`)."""
        return []

    def _wait(self, works: list, what: str) -> None:
        started = time.perf_counter()
        try:
            wait_collectives(works, self.timeout, what, self.group)
        finally:
            self.wait_seconds += time.perf_counter() - started

    def __getstate__(self):
        # Like torch's PowerSGDState: a process group, a stream and a lock do not pickle.
        return {**self.__dict__, "group": None, "_stream": None, "_lock": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()


class ExactAllreduce(_Communicator):
    """fp32 sum allreduce, then ``/ W``: frozen-variance Adam without compression."""

    def _reduce(self, tensor, out, plan: Plan, errors, decode) -> bool:
        if isinstance(tensor, Fold):
            tensor = tensor.materialize()
        out = tensor if out is None else out
        if out is not tensor:
            out.copy_(tensor)
        if self.world_size > 1:
            work = dist.all_reduce(out, group=self.group, async_op=True)
            self._wait([work], "the exact momentum allreduce")
            out.div_(self.world_size)
            self.bytes_sent += plan.layout.dense_wire_bytes(out.element_size())
        if not all_finite([out]):  # the same on every rank after the allreduce
            return False
        plan.mask.zero_(out.view(-1))
        return True


class OneBitAllreduce(_Communicator):
    """1-bit signs with error feedback on the worker and the server side, about 1/32 of the
    bytes of an fp32 ring allreduce.

    Args:
        group: the process group (default: the world; without one, W = 1: the tensor is
            still compressed, nothing is sent).
        max_block: largest number of values sharing one fp32 scale (a multiple of 8): each
            block costs 4 bytes beside its ``max_block / 8`` bytes of signs (2048: +1.6%).
        scale: the block scale rule, ``"rms"`` or ``"mean"`` (``onebit_plugin.wire.compression``).
        timeout: seconds each collective may take before the call raises
            :class:`CommunicationError`.
        error_dtype: the error buffers' dtype, ``"float32"`` or ``"bfloat16"`` (half their
            memory: each call widens them into one fp32 scratch of the largest tensor's size,
            runs the passes on it and rounds them back stochastically, ``round_to_bf16_``).

    Non-finite input on any rank skips the call on *every* rank, with no extra collective and
    no extra pass: the worker pass itself finds it (a value that is inf or NaN, or whose square
    overflows, makes its block's scale non-finite). That rank then sends NaN scales and clears
    its worker error, which the pass has overwritten; the servers pass the NaN on instead of
    updating their errors, and every rank sees it in the scales the servers send. Ranks whose
    input was finite keep that compression's (finite) worker residual.
    """

    compressed = True

    def __init__(self, group=None, *, max_block: int = 2048, scale: str = "rms", timeout=None,
                 error_dtype: str = "float32"):
        super().__init__(group, timeout)
        self.max_block, self.scale = max_block, scale
        self.error_dtype = getattr(torch, error_dtype)
        self._plans = 0
        self._wide: torch.Tensor | None = None  # fp32 scratch for bf16 errors

    def _layout(self, numel: int) -> ChunkLayout:
        return ChunkLayout.create(numel, self.world_size, self.max_block, self.scale)

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        return [("bf16 errors' fp32 scratch", self._wide)] if self._wide is not None else []

    def plan(self, numel: int, keep: torch.Tensor | None = None, device=None) -> Plan:
        self._plans += 1
        return Plan(self._layout(numel), keep, device or "cpu", self.rank, True,
                    self.error_dtype, self._plans)

    def _reduce(self, tensor, out, plan: Plan, errors, decode) -> bool:
        if errors["worker"].dtype == torch.float32:
            return self._reduce_fp32(tensor, out, plan, errors, decode)
        # Compact errors: widened exactly into fp32 scratch (one, sized to the largest tensor:
        # calls hold the lock, one at a time), the passes run on it, and rounded back.
        lay = plan.layout
        need = lay.padded_numel + lay.chunk
        if self._wide is None or self._wide.numel() < need or \
                self._wide.device != errors["worker"].device:
            self._wide = torch.empty(need, dtype=torch.float32, device=errors["worker"].device)
        wide = {"worker": self._wide[: lay.padded_numel],
                "server": self._wide[lay.padded_numel : need]}
        for name, w in wide.items():
            w.copy_(errors[name])
        ok = self._reduce_fp32(tensor, out, plan, wide, decode)
        draws = int(errors["draws"])
        for i, (name, w) in enumerate(wide.items()):
            # A seed per plan, rank, buffer and call: no two roundings share their noise.
            seed = ((plan.salt * 65599 + self.rank) * 2 + i) * 2**32 + draws
            round_to_bf16_(w, errors[name], seed % 2**63)
        errors["draws"] += 1
        return ok

    def _reduce_fp32(self, tensor, out, plan: Plan, errors, decode) -> bool:
        lay, w = plan.layout, plan.wire
        worker_compress(tensor, errors["worker"], plan.mask, lay, w.send_packed, w.send_scales,
                        w.scratch)
        if not bool(torch.isfinite(w.send_scales).all()):
            # Tell every server, and through them every rank. The error now holds residuals
            # of a compression that is dropped (inf or NaN where the input was): cleared, it
            # loses at most one step's residual, on a step that is skipped anyway.
            errors["worker"].zero_()
            w.send_packed.zero_()
            w.send_scales.fill_(float("nan"))
        w.to_rows(w.send_packed, w.send_scales)
        self._exchange(w, "signs and scales to each chunk's server")
        w.from_rows(w.recv_packed, w.recv_scales)
        if bool(torch.isfinite(w.recv_scales).all()):
            server_compress(w.recv_packed, w.recv_scales, errors["server"], plan.chunk_mask,
                            lay, w.own_packed, w.own_scales, w.scratch)
            if not bool(torch.isfinite(w.own_scales).all()):  # the sum overflowed
                errors["server"].zero_()
                w.own_scales.fill_(float("nan"))
        else:
            w.own_packed.zero_()
            w.own_scales.fill_(float("nan"))
        w.to_rows(w.own_packed, w.own_scales)
        self._exchange(w, "server chunks to every rank")
        w.from_rows(w.all_packed, w.all_scales)
        # Every rank holds the same server scales, so every rank takes the same decision.
        if not bool(torch.isfinite(w.all_scales).all()):
            return False
        # A Fold's out (fp32) is made only here, if at all: the CPU kernel folds on the fly.
        if not decode and (out is None or out.dtype == torch.float32) and \
                backend_for(w.all_packed, None, tensor.exp_avg if out is None else out) == "cpu":
            plan.encoded = True
            return True
        out = tensor.out if out is None else out
        decompress(w.all_packed, w.all_scales, plan.mask, lay, out, w.scratch)
        return True

    def _exchange(self, w: _WireBuffers, what: str) -> None:
        """Row k of ``w.send_rows`` to rank k, rank k's row for this rank into ``w.recv_rows``:
        one all-to-all; this rank's own row stays home, W - 1 rows go out."""
        if self.world_size == 1:
            w.recv_rows.copy_(w.send_rows)
            return
        work = dist.all_to_all_single(w.recv_rows.view(-1), w.send_rows.view(-1),
                                      group=self.group, async_op=True)
        self._wait([work], f"the compressed allreduce's all-to-all ({what})")
        self.bytes_sent += w.send_rows[0].nbytes * (self.world_size - 1)
