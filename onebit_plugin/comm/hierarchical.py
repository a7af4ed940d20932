"""Two levels: exact inside a host, the wrapped communicator across hosts (issue 46).

Ranks are numbered host by host, ``L`` per host, ``H`` hosts (``topology.HierarchicalTopology``).
A tensor of ``n`` values is cut into ``L`` slices of ``n / L`` values, as equal as can be
(:func:`cut`; slice ``k`` has ``s`` values):

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
on every rank of that local rank, on every host, and a one-value allreduce of the flag inside
the host tells its other ranks: the call is skipped everywhere, the output untouched. The other
local ranks' inner calls have run by then, and their error buffers keep that call's residuals
(a flat 1-bit allreduce's finite ranks keep their worker residual too).

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


def cut(n: int, parts: int) -> list[int]:
    """``n`` values in ``parts`` slices as equal as can be, the larger first."""
    return [n // parts + (k < n % parts) for k in range(parts)]


def _exchange(out: torch.Tensor, inp: torch.Tensor, out_sizes, in_sizes, group, timeout,
              what: str) -> int:
    """One all-to-all of ``inp`` cut as ``in_sizes`` into ``out`` cut as ``out_sizes``, in the
    group's rank order; the bytes this rank sent to the others."""
    work = dist.all_to_all_single(out, inp, out_sizes, in_sizes, group=group, async_op=True)
    wait_collectives([work], timeout, what, group)
    me = dist.get_rank(group)
    return (sum(in_sizes) - in_sizes[me]) * inp.element_size()


def scatter_sum(x: torch.Tensor, sizes: list[int], me: int, group, scratch: torch.Tensor,
                timeout, what: str) -> tuple[torch.Tensor, int]:
    """Slice ``k`` of ``x`` (cut as ``sizes``) to rank ``k`` of ``group``; the slices this
    rank receives (``len(sizes)`` of ``sizes[me]`` values, in ``scratch``) summed in rank order
    into the first. Returns that sum and the bytes sent."""
    size, mine = len(sizes), sizes[me]
    rows = scratch[: size * mine].view(size, mine)
    sent = _exchange(rows.view(-1), x, [mine] * size, sizes, group, timeout, what)
    own = rows[0]
    for k in range(1, size):
        own.add_(rows[k])
    return own, sent


def gather(own: torch.Tensor, sizes: list[int], me: int, group, out: torch.Tensor,
           scratch: torch.Tensor, timeout, what: str) -> int:
    """Every rank's ``own`` (``sizes[k]`` values on rank ``k``) into ``out`` in rank order, as
    an all-to-all sending ``own`` to each (gloo's all-gather is a ring of ``W - 1`` dependent
    steps, ``allreduce._WireBuffers``); ``scratch`` holds the copies sent. The bytes sent."""
    size = len(sizes)
    rows = scratch[: size * sizes[me]].view(size, -1)
    rows.copy_(own.expand(size, -1))
    return _exchange(out, rows.view(-1), sizes, [sizes[me]] * size, group, timeout, what)


def two_level_mean_(x: torch.Tensor, levels, timeout, quantized=None) -> tuple[int, int]:
    """``x`` (flat fp32) replaced by its mean over every rank of the two levels
    (``topology.HierarchicalTopology.levels``): summed inside each host, then across hosts
    (exactly, or through ``quantized``, ``comm.quantized.QuantizedAverage``), divided by the
    world's size, gathered back. Two scratch buffers of about ``x``'s size and ``1/L`` of it
    live for the call. Returns (bytes sent in all, bytes sent across hosts)."""
    host_group, cross_group, local, hosts = levels
    me_local, me_host = dist.get_rank(host_group), dist.get_rank(cross_group)
    sizes = cut(x.numel(), local)
    scratch = torch.empty(local * sizes[me_local], dtype=x.dtype, device=x.device)
    own, sent = scatter_sum(x, sizes, me_local, host_group, scratch, timeout,
                            "the full-precision step's reduce-scatter inside the host")
    if quantized is None:
        parts = cut(own.numel(), hosts)
        scratch2 = torch.empty(hosts * parts[me_host], dtype=x.dtype, device=x.device)
        part, across = scatter_sum(own, parts, me_host, cross_group, scratch2, timeout,
                                   "the full-precision step's reduce-scatter across hosts")
        part.div_(local * hosts)
        mean = part.clone()
        across += gather(mean, parts, me_host, cross_group, own, scratch2, timeout,
                         "the full-precision step's all-gather across hosts")
    else:
        own.div_(local)
        across = quantized.average_(own, cross_group, hosts, timeout)
    mine = own.clone()
    sent += across + gather(mine, sizes, me_local, host_group, x, scratch, timeout,
                            "the full-precision step's all-gather inside the host")
    return sent, across


class HierarchicalPlan:
    """A tensor of ``numel`` values over two levels: this rank's slice (``lo`` on, ``size``
    values; ``sizes`` every local rank's) and the inner communicator's plan for it. Answers what
    a momentum unit asks of a plan (``allreduce.Plan``); the average always comes back decoded.
    The exchanges inside the host use the communicator's scratch, shared by every plan."""

    def __init__(self, numel: int, keep, device, local_rank: int, local: int, inner,
                 world: int):
        self.numel, self.sizes = numel, cut(numel, local)
        if not self.sizes[-1]:
            raise ValueError(f"a momentum unit of {numel} values cannot be cut over hosts of "
                             f"{local} ranks (fewer values than ranks): topology='flat'")
        self.lo, self.size = sum(self.sizes[:local_rank]), self.sizes[local_rank]
        self.inner: Plan = inner.plan(self.size, self._own_keep(keep), device)
        self.device = self.inner.device
        self.layout = ChunkLayout.create(numel, world, 8)  # the dense bytes' count
        self.encoded = False  # never left encoded

    def _own_keep(self, keep):
        return None if keep is None else keep[self.lo : self.lo + self.size]

    def remask_(self, keep) -> None:
        self.inner.remask_(self._own_keep(keep))

    def unmask_(self, index: torch.Tensor) -> None:
        mine = index[(index >= self.lo) & (index < self.lo + self.size)]
        if mine.numel():
            self.inner.unmask_(mine - self.lo)

    def keeps(self, keep: torch.Tensor) -> bool:
        """Whether this rank's slice of ``keep`` is its mask already: the rest is other
        ranks' (a remask touches nothing shared)."""
        return self.inner.keeps(self._own_keep(keep))

    def new_errors(self) -> dict[str, torch.Tensor]:
        return self.inner.new_errors()

    def error_dtype_of(self, errors: dict):
        return self.inner.error_dtype_of(errors)

    def clear_masked_(self, errors) -> None:
        self.inner.clear_masked_(errors)

    def decode_into_(self, out) -> None:
        """Nothing is ever left encoded."""

    def buffers(self, errors: dict) -> list[tuple[str, torch.Tensor]]:
        return self.inner.buffers(errors)


class HierarchicalAllreduce(_Communicator):
    """``inner`` (a communicator over the cross-host group of this rank's local rank) between an
    exact reduce-scatter and an all-gather inside the host (module docstring). ``group``: the
    optimizer's group of every rank (its background thread and checks); ``host_group``: this
    rank's host, ``local`` ranks. ``cross_bytes`` counts what crossed hosts (the inner's).
    One scratch of ``L`` times the largest slice (about the largest tensor) and one of the
    largest slice serve every call (calls hold the lock, one at a time)."""

    def __init__(self, inner: _Communicator, group, host_group, local: int, timeout=None):
        super().__init__(group, timeout)
        self.inner, self.host_group, self.local = inner, host_group, local
        self.compressed = inner.compressed
        self.local_rank = self.rank % local
        self.cross_bytes = 0
        self._scratch: torch.Tensor | None = None
        self._decoded: torch.Tensor | None = None

    def plan(self, numel: int, keep: torch.Tensor | None = None, device=None):
        return HierarchicalPlan(numel, keep, device or "cpu", self.local_rank, self.local,
                                self.inner, self.world_size)

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        own = [("hierarchical scratch", t) for t in (self._scratch, self._decoded)
               if t is not None]
        return self.inner.buffers() + own

    def _scratches(self, plan: HierarchicalPlan) -> tuple[torch.Tensor, torch.Tensor]:
        need = self.local * plan.size
        if self._scratch is None or self._scratch.numel() < need or \
                self._scratch.device != plan.device:
            self._scratch = torch.empty(need, dtype=torch.float32, device=plan.device)
            self._decoded = torch.empty(plan.size, dtype=torch.float32, device=plan.device)
        return self._scratch, self._decoded[: plan.size]

    def _reduce(self, tensor, out, plan: HierarchicalPlan, errors, decode) -> bool:
        if isinstance(tensor, Fold):
            tensor = tensor.materialize()
        out = tensor if out is None else out
        scratch, decoded = self._scratches(plan)
        x = tensor.reshape(-1).to(torch.float32)
        own, sent = scatter_sum(x, plan.sizes, self.local_rank, self.host_group, scratch,
                                self.timeout, "the momentum's reduce-scatter inside the host")
        own.div_(self.local)
        before = self.inner.bytes_sent
        ok = self.inner.reduce_(own, plan.inner, errors, out=decoded)
        crossed = self.inner.bytes_sent - before
        # Whether every local rank's slice came through: the same on every host (the ranks of
        # a local rank decided alike), so on every rank; ``out`` is untouched where not.
        flag = torch.tensor([float(ok)], device=plan.device)
        work = dist.all_reduce(flag, dist.ReduceOp.MIN, group=self.host_group, async_op=True)
        wait_collectives([work], self.timeout, "the host's flag of finite slices",
                         self.host_group)
        sent += crossed + 4 * (self.local - 1)
        self.cross_bytes += crossed
        if not bool(flag.item()):
            self.bytes_sent += sent
            return False
        flat_out = out.reshape(-1)
        target = flat_out if flat_out.dtype == torch.float32 else torch.empty_like(x)
        sent += gather(decoded, plan.sizes, self.local_rank, self.host_group, target, scratch,
                       self.timeout, "the momentum's all-gather inside the host")
        if target is not flat_out:
            flat_out.copy_(target)
        self.bytes_sent += sent
        return True
