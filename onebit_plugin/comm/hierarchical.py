"""Two levels: exact inside a host, the wrapped communicator across hosts (issue 46).

Ranks are numbered host by host, ``L`` per host, ``H`` hosts (``topology.HierarchicalTopology``).
A tensor of ``n`` values is cut into ``L`` slices of ``s = ceil(n / L)``:

1. inside the host, slice ``k`` of every local rank goes to local rank ``k`` (one all-to-all),
   which sums them in local-rank order and divides by ``L``: the host's exact mean of its slice;
2. across hosts, the ranks of local rank ``k`` average that slice through the inner
   communicator over their own group (1-bit with worker and server error feedback, or exact),
   so every host's ``k``-th rank decodes the same bytes;
3. inside the host, every local rank's decoded slice goes to every other (an all-gather).

Every rank of the world ends with the same bits. Each rank's NIC carries its ``1/L`` of the
tensor across hosts, so a host sends one share instead of ``L`` (Bagua's hierarchical reduce
sends it from one rank per host; ZeRO++'s hierarchical exchange cuts by local rank as here, but
quantizes inside the host too: here the fast links carry fp32). The error buffers are the inner
communicator's, over the slice: worker ``s`` values, server ``s / H``.

A non-finite input on any rank reaches its host's slice sum; the inner communicator then skips
on every rank of that local rank, whose slice comes back as NaN, and the all-gather carries the
NaN to every rank of every host: the whole step is skipped everywhere, with no extra collective.
The other local ranks' inner calls have run by then, and their error buffers keep that call's
residuals (a flat 1-bit allreduce's finite ranks keep their worker residual too).

:func:`two_level_mean_` is the full-precision steps' average over the same levels (the warm-up,
refreshes): exact, the sums in host then local-rank order whatever the tensor's cut (the DDP
hook's buckets and ``step()``'s flat buffer give the same bits), or through a quantized average
across hosts (``warmup_bits`` 16 or 8).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from onebit_plugin.comm.allreduce import Plan, _Communicator
from onebit_plugin.comm.collectives import wait_collectives
from onebit_plugin.wire.compression import ChunkLayout
from onebit_plugin.wire.deferred import Fold

__all__ = ["HierarchicalAllreduce", "HierarchicalPlan", "two_level_mean_"]


def _scatter_sum(x: torch.Tensor, group, size: int, rows: torch.Tensor, timeout, what: str
                 ) -> tuple[torch.Tensor, int]:
    """Slice ``k`` of ``x`` (``size`` slices, ``x`` padded to ``rows.numel()``) to rank ``k``
    of ``group``; the sum of the slices this rank receives, in rank order, into ``rows[0]``.
    Returns it and the bytes sent."""
    per = rows.shape[1]
    send = torch.zeros(size * per, dtype=x.dtype, device=x.device) if x.numel() != size * per \
        else x
    if send is not x:
        send[: x.numel()].copy_(x)
    work = dist.all_to_all_single(rows.view(-1), send, group=group, async_op=True)
    wait_collectives([work], timeout, what, group)
    own = rows[0]
    for k in range(1, size):
        own.add_(rows[k])
    return own, (size - 1) * per * x.element_size()


def _gather(own: torch.Tensor, group, size: int, out: torch.Tensor, timeout, what: str) -> int:
    """Every rank's ``own`` into ``out`` (``size`` slices, rank order); the bytes sent."""
    work = dist.all_gather_into_tensor(out, own, group=group, async_op=True)
    wait_collectives([work], timeout, what, group)
    return (size - 1) * own.nbytes


def two_level_mean_(x: torch.Tensor, levels, timeout, quantized=None) -> tuple[int, int]:
    """``x`` (flat fp32) replaced by its mean over every rank of the two levels
    (``topology.HierarchicalTopology.levels``): summed inside each host, then across hosts
    (exactly, or through ``quantized``, ``comm.quantized.QuantizedAverage``), divided by the
    world's size, gathered back. Returns (bytes sent in all, bytes sent across hosts)."""
    host_group, cross_group, local, hosts = levels
    world, n = local * hosts, x.numel()
    s = -(-n // local)
    rows = torch.empty(local, s, dtype=x.dtype, device=x.device)
    own, sent = _scatter_sum(x, host_group, local, rows, timeout,
                             "the full-precision step's reduce-scatter inside the host")
    if quantized is None:
        t = -(-s // hosts)
        rows2 = torch.empty(hosts, t, dtype=x.dtype, device=x.device)
        part, across = _scatter_sum(own, cross_group, hosts, rows2, timeout,
                                    "the full-precision step's reduce-scatter across hosts")
        part.div_(world)
        mean = torch.empty(hosts * t, dtype=x.dtype, device=x.device)
        across += _gather(part, cross_group, hosts, mean, timeout,
                          "the full-precision step's all-gather across hosts")
        own.copy_(mean[:s])
    else:
        own.div_(local)
        across = quantized.average_(own, cross_group, hosts, timeout)
    gathered = torch.empty(local * s, dtype=x.dtype, device=x.device)
    sent += across + _gather(own, host_group, local, gathered, timeout,
                             "the full-precision step's all-gather inside the host")
    x.copy_(gathered[:n])
    return sent, across


class HierarchicalPlan:
    """A tensor of ``numel`` values over two levels: this rank's slice (``lo`` on, ``slice``
    values, the tail past ``numel`` masked) and the inner communicator's plan for it, with the
    buffers of the exchanges inside the host (allocated once). Answers what a momentum unit asks
    of a plan (``allreduce.Plan``); the average always comes back decoded."""

    def __init__(self, numel: int, keep, device, local_rank: int, local: int, inner,
                 world: int):
        self.numel, self.local = numel, local
        self.slice = -(-numel // local)
        self.lo = local_rank * self.slice
        self.inner: Plan = inner.plan(self.slice, self._own_keep(keep), device)
        self.device = self.inner.device
        z = dict(dtype=torch.float32, device=self.device)
        self.rows = torch.empty(local, self.slice, **z)
        self.send = torch.empty(local * self.slice, **z)
        self.decoded = torch.empty(self.slice, **z)
        self.gathered = torch.empty(local * self.slice, **z)
        self.layout = ChunkLayout.create(numel, world, 8)  # the dense bytes' count
        self.keep = None if keep is None else keep.clone()
        self.encoded = False  # never left encoded

    def _own_keep(self, keep) -> torch.Tensor:
        own = torch.zeros(self.slice, dtype=torch.bool)
        hi = min(self.lo + self.slice, self.numel)
        if hi > self.lo:
            own[: hi - self.lo] = True if keep is None else keep[self.lo : hi].cpu()
        return own

    def remask_(self, keep) -> None:
        self.keep = None if keep is None else keep.clone()
        self.inner.remask_(self._own_keep(keep).to(self.device))

    def keeps(self, keep: torch.Tensor) -> bool:
        mine = self.keep if self.keep is not None else torch.ones_like(keep)
        return torch.equal(keep, mine[: keep.numel()])

    def new_errors(self) -> dict[str, torch.Tensor]:
        return self.inner.new_errors()

    def error_dtype_of(self, errors: dict):
        return self.inner.error_dtype_of(errors)

    def clear_masked_(self, errors) -> None:
        self.inner.clear_masked_(errors)

    def decode_into_(self, out) -> None:
        """Nothing is ever left encoded."""

    def buffers(self, errors: dict) -> list[tuple[str, torch.Tensor]]:
        own = [("hierarchical buffers", t) for t in (self.rows, self.send, self.decoded,
                                                      self.gathered)]
        if self.keep is not None:
            own.append(("masks", self.keep))
        return self.inner.buffers(errors) + own


class HierarchicalAllreduce(_Communicator):
    """``inner`` (a communicator over the cross-host group of this rank's local rank) between an
    exact reduce-scatter and an all-gather inside the host (module docstring). ``group``: the
    optimizer's group of every rank (its background thread and checks); ``host_group``: this
    rank's host, ``local`` ranks. ``cross_bytes`` counts what crossed hosts (the inner's)."""

    def __init__(self, inner: _Communicator, group, host_group, local: int, timeout=None):
        super().__init__(group, timeout)
        self.inner, self.host_group, self.local = inner, host_group, local
        self.compressed = inner.compressed
        self.local_rank = self.rank % local
        self.cross_bytes = 0

    def plan(self, numel: int, keep: torch.Tensor | None = None, device=None):
        return HierarchicalPlan(numel, keep, device or "cpu", self.local_rank, self.local,
                                self.inner, self.world_size)

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        return self.inner.buffers()

    def _reduce(self, tensor, out, plan: HierarchicalPlan, errors, decode) -> bool:
        if isinstance(tensor, Fold):
            tensor = tensor.materialize()
        out = tensor if out is None else out
        n, s, local = plan.numel, plan.slice, self.local
        x = tensor.reshape(-1)
        plan.send[:n].copy_(x)
        plan.send[n:].zero_()
        own, sent = _scatter_sum(plan.send, self.host_group, local, plan.rows, self.timeout,
                                 "the momentum's reduce-scatter inside the host")
        own.div_(local)
        before = self.inner.bytes_sent
        if not self.inner.reduce_(own, plan.inner, errors, out=plan.decoded):
            plan.decoded.fill_(float("nan"))  # tells the host, and so every rank
        crossed = self.inner.bytes_sent - before
        sent += crossed + _gather(plan.decoded, self.host_group, local, plan.gathered,
                                  self.timeout, "the momentum's all-gather inside the host")
        self.bytes_sent += sent
        self.cross_bytes += crossed
        # A decoded slice is finite (its scales were); a skipped one is NaN from its start.
        if not bool(torch.isfinite(plan.gathered[::s]).all()):
            return False
        out.reshape(-1).copy_(plan.gathered[:n])
        return True
