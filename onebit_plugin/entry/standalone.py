"""The 1-bit allreduce on its own, outside the optimizers: :class:`CompressedAllreduce` (one
tensor size with its own error feedback, in the manner of torch's ``PowerSGDState``) and
:func:`compressed_allreduce`. Built on ``onebit_plugin.comm.allreduce``'s ``OneBitAllreduce``, whose
plan and error buffers it keeps.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from onebit_plugin.comm.allreduce import OneBitAllreduce
from onebit_plugin.comm.collectives import comm_executor, resolve_device
from onebit_plugin.comm.topology import make_topology
from onebit_plugin.settings.config import check_settings
from onebit_plugin.wire.compression import ChunkLayout

__all__ = ["CompressedAllreduce", "compressed_allreduce"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CompressedAllreduce:
    """The 1-bit allreduce of one tensor size with its own error feedback, for use outside
    OneBitAdam (in the manner of torch's ``PowerSGDState``).

    Create one per tensor that is reduced repeatedly and call it on every step: the error
    feedback only works if the same object sees every call. Every rank of ``group`` must create
    it with the same ``numel``, ``max_block``, ``scale`` and ``mask`` and call it in the same
    order. ``mask`` (bool, ``numel`` values): False coordinates come out exactly 0 and never
    collect error. Other arguments as :class:`OneBitAllreduce`; ``device``: where the buffers
    live (default: CPU); ``topology`` and ``local_world_size`` as the optimizers'
    (``onebit_plugin.comm.topology``: hierarchical, exact inside each host and 1-bit across).

    Attributes: ``worker_error``, ``server_error``, ``last_call_skipped``, and the
    communicator's counters (``bytes_sent``, ``dense_bytes``, ``calls``, ``skipped_calls``).
    """

    def __init__(self, numel: int, group: dist.ProcessGroup | None = None, *,
                 max_block: int = 2048, scale: str = "rms", mask: torch.Tensor | None = None,
                 device: torch.device | str | None = None,
                 timeout: float | timedelta | None = None, error_dtype: str = "float32",
                 topology: str = "auto", local_world_size: int | None = None):
        check_settings({"topology": topology, "local_world_size": local_world_size})
        self.device = resolve_device(device)
        self.topology = make_topology(group, topology, local_world_size)
        if isinstance(timeout, int | float):
            timeout = timedelta(seconds=timeout)
        self.comm = self.topology.communicator(_OneBit, timeout, self.device,
                                               max_block=max_block, scale=scale,
                                               error_dtype=error_dtype)
        self.plan = self.comm.plan(numel, mask, self.device)
        self.errors = self.plan.new_errors()
        self.last_call_skipped = False

    def __getattr__(self, name):  # the communicator's counters and group
        comm = self.__dict__.get("comm")
        if comm is None or name not in ("bytes_sent", "dense_bytes", "calls", "skipped_calls",
                                        "wait_seconds", "busy_seconds", "group"):
            raise AttributeError(name)
        return getattr(comm, name)

    @property
    def layout(self) -> ChunkLayout:
        return self.plan.layout

    @property
    def numel(self) -> int:
        return self.plan.layout.numel

    @property
    def worker_error(self) -> torch.Tensor:
        return self.errors["worker"]

    @property
    def server_error(self) -> torch.Tensor:
        return self.errors["server"]

    def _check(self, t: torch.Tensor) -> None:
        if t.numel() != self.numel:
            raise ValueError(f"CompressedAllreduce was built for {self.numel} values, got a "
                             f"tensor of {t.numel()} (shape {tuple(t.shape)})")
        if t.dtype not in _FLOAT_DTYPES or not t.is_contiguous() or t.device != self.device:
            raise ValueError(
                f"compressed allreduce needs a contiguous fp32, bf16 or fp16 tensor on "
                f"{self.device}; got {t.dtype} on {t.device}, contiguous={t.is_contiguous()}"
            )

    def __call__(self, tensor: torch.Tensor, async_op: bool = False,
                 out: torch.Tensor | None = None):
        """Write the compressed average of ``tensor`` into ``out`` (default: ``tensor``).
        Returns ``out``, or with ``async_op=True`` a future that completes with ``out``.
        A call skipped for non-finite input (see :class:`OneBitAllreduce`) leaves ``out`` as it
        was and sets ``last_call_skipped``."""
        self._check(tensor)
        out = tensor if out is None else out
        if out is not tensor:
            self._check(out)
        if not async_op:
            self.last_call_skipped = not self.comm.reduce_(tensor, self.plan, self.errors, out)
            return out

        def done(fut):
            self.last_call_skipped = not fut.value()
            return out

        return self.comm.submit(tensor, self.plan, self.errors, out).then(done)

    def close(self) -> None:
        """Wait for the pending asynchronous calls of this object's process group."""
        comm_executor(self.comm.group).submit(lambda: None).result()

    def state_dict(self) -> dict:
        """This rank's errors (each rank saves its own; the errors differ)."""
        inner = getattr(self.comm, "inner", self.comm)
        return {"numel": self.numel, "world_size": self.comm.world_size,
                "max_block": inner.max_block, "scale": inner.scale,
                "topology": self.topology.describe(),
                **{f"{k}_error": v.clone() for k, v in self.errors.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Load this rank's errors; those of masked coordinates are cleared."""
        mine = self.state_dict()
        for key in ("numel", "world_size", "max_block", "scale", "topology"):
            if state.get(key, "flat") != mine[key]:  # no topology: saved before it, flat
                raise ValueError(f"compressed allreduce state was saved with {key}="
                                 f"{state[key]!r}; this one has {mine[key]!r}")
        for k, v in self.errors.items():
            v.copy_(state[f"{k}_error"])
        self.plan.clear_masked_(self.errors)


class _OneBit:
    """The exchange the topology wraps (``policy.Exchange``'s one method)."""

    @staticmethod
    def communicator(group, world: int, *, timeout, **options) -> OneBitAllreduce:
        return OneBitAllreduce(group, timeout=timeout, **options)


def compressed_allreduce(tensor: torch.Tensor, state: CompressedAllreduce,
                         async_op: bool = False):
    """Average ``tensor`` in place across ``state``'s group with 1-bit compression; returns
    ``tensor``, or a future with ``async_op=True``.

    Example::

        state = CompressedAllreduce(momentum.numel())
        for step in range(steps):
            ...
            compressed_allreduce(momentum, state)  # identical on every rank afterwards
    """
    return state(tensor, async_op=async_op)
