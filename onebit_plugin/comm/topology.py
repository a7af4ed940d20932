"""Which ranks exchange with which, and over which process groups: the optimizer's collectives
take their group from its topology object and from nowhere else.

* :class:`FlatTopology`: every rank of one group (the world, or the data-parallel group given as
  ``process_group``) in one flat exchange, over a group of the optimizer's own once
  ``comm_timeout`` or the DDP hook asks for one (``new_group``).
* :class:`HierarchicalTopology`: hosts of ``local_world_size`` ranks each, ranks numbered host
  by host (as torchrun numbers them). The momentum is averaged exactly inside each host and
  through the communicator across hosts, each local rank on its own ``1/L`` of every tensor, among
  the ranks of the same local rank (``onebit_plugin.comm.hierarchical``); the full-precision
  steps likewise. Every host's link carries its share once instead of once per rank.

:func:`make_topology` reads ``topology="auto" | "flat" | "hierarchical"``; ``"auto"`` is
hierarchical where there is more than one host and more than one rank per host, which it reads
from ``local_world_size`` or torchrun's ``LOCAL_WORLD_SIZE`` (without either it stays flat, as
before the option). The choice is settled at the first use (the process group exists by then),
said once on rank 0 when it is hierarchical or when a layout given does not fit (``"auto"``
then exchanges flat; ``"hierarchical"`` raises), and agreed between ranks by the first step's
check (:meth:`agreement`).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from onebit_plugin.comm.collectives import group_size_and_rank, new_group, new_group_of

__all__ = ["FlatTopology", "HierarchicalTopology", "make_topology"]

log = logging.getLogger("onebit_plugin")


class FlatTopology:
    """Every rank of ``process_group`` (None: the world, when initialised) in one exchange."""

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self._group, self._ready = process_group, False

    @property
    def world_size(self) -> int:
        return group_size_and_rank(self.process_group)[0]

    @property
    def rank(self) -> int:
        return group_size_and_rank(self.process_group)[1]

    def comm_group(self, timeout: timedelta | None, device: torch.device
                   ) -> dist.ProcessGroup | None:
        """The group of all of the optimizer's collectives: with ``timeout`` one of its own,
        made on every rank at the first use, whose backend timeout is ``timeout``, so that a
        process can exit after a peer fails (docs/design.md); else ``process_group``."""
        if not self._ready and timeout is not None and self.world_size > 1:
            self._group = new_group(self.process_group, timeout, device)
        self._ready = True
        return self._group

    def adopt(self, group: dist.ProcessGroup | None, timeout: timedelta | None,
              device: torch.device, *, again: bool) -> dist.ProcessGroup:
        """The DDP hook's: a group of the optimizer's own over ``group`` (DDP's), made now on
        every rank, unless one was made already and nothing asks for another (``again``: a new
        ``timeout``). Returns it."""
        if not self._ready or self._group is group or again:
            self._group = new_group(group, timeout, device)
            self._ready = True
        return self._group

    def levels(self, timeout, device) -> None:
        """The two levels' groups (:class:`HierarchicalTopology`); None: one level."""
        return None

    def communicator(self, exchange, timeout, device, **options):
        """The momentum's communicator: ``exchange``'s (``policy.Exchange``) over the group."""
        return exchange.communicator(self.comm_group(timeout, device), self.world_size,
                                     timeout=timeout, **options)

    def learn_local_world_size(self, local: int) -> None:
        """An integration's ranks per host (``OneBitOptimizer.set_local_world_size``)."""

    def describe(self, settle: bool = True) -> str:
        """The layout, as checkpoints record it: error buffers of another do not fit.
        ``settle=False``: not settled now for it (a warm-up state holds no errors)."""
        return "flat"

    def agreement(self) -> dict[str, int]:
        """What every rank must agree on (``rank_checks``)."""
        return {"topology (1 flat, 2 hierarchical)": 1, "local_world_size": 0}

    def __getstate__(self) -> dict:
        # Process groups do not pickle: an unpickled optimizer runs on the default group.
        return {**self.__dict__, "process_group": None, "_group": None, "_ready": False}


class HierarchicalTopology(FlatTopology):
    """Hosts of ``local_world_size`` ranks, numbered host by host; ``"auto"``
    (``wanted="auto"``) falls back to one level, said once, where the layout has one host or
    one rank per host, or ``local_world_size`` is not known.

    Groups (made at the first use, by every rank for the two groups it is in, each with the
    optimizer's timeout): its host's ranks, and the ranks of its local rank on every host."""

    def __init__(self, process_group, local_world_size: int | None, wanted: str) -> None:
        super().__init__(process_group)
        self.wanted, self.asked_local = wanted, local_world_size
        self._layout: tuple[int, int] | None = None  # (L, hosts); (0, 0): one level
        self._levels = None

    def layout(self) -> tuple[int, int]:
        """``(local_world_size, hosts)`` settled, ``(0, 0)`` where the exchange is flat."""
        if self._layout is None:
            self._layout = self._settle()
        return self._layout

    def _settle(self) -> tuple[int, int]:
        world, rank = self.world_size, self.rank
        local = self.asked_local
        where = "local_world_size"
        if local is None and os.environ.get("LOCAL_WORLD_SIZE", "").strip():
            where = "LOCAL_WORLD_SIZE"
            try:
                local = int(os.environ["LOCAL_WORLD_SIZE"])
            except ValueError:
                raise ValueError(f"LOCAL_WORLD_SIZE must be an integer, got "
                                 f"{os.environ['LOCAL_WORLD_SIZE']!r}") from None
        if world <= 1:
            if self.wanted == "hierarchical" and rank == 0:
                log.warning("onebit: topology='hierarchical' in a single process: nothing is "
                            "exchanged, so there is nothing to lay out (flat)")
            return 0, 0
        if local is None and self.wanted == "auto":
            # Nothing says where the hosts are (no torchrun): flat, as before the option;
            # docs/usage.md says to give local_world_size= there.
            return 0, 0
        problem = None
        if local is None:
            problem = ("the ranks per host are not known: pass local_world_size= (torchrun "
                       "sets LOCAL_WORLD_SIZE)")
        elif local < 1 or world % local:
            problem = (f"{where}={local} does not divide the {world} ranks into hosts of one "
                       "size")
        elif self.process_group is not None and \
                dist.get_process_group_ranks(self.process_group) != list(range(world)):
            problem = ("the optimizer averages over a process group that is not the world: "
                       "which of its ranks share a host is not known")
        elif os.environ.get("GROUP_RANK", "").strip() and \
                os.environ.get("LOCAL_RANK", "").strip() and \
                rank != int(os.environ["GROUP_RANK"]) * local + int(os.environ["LOCAL_RANK"]):
            problem = (f"rank {rank} is not host-major (GROUP_RANK {os.environ['GROUP_RANK']}, "
                       f"LOCAL_RANK {os.environ['LOCAL_RANK']}, {local} ranks per host)")
        if problem is None and (local == 1 or local == world):
            if self.wanted == "hierarchical":
                problem = (f"{world // local} host(s) of {local} rank(s) ({where}={local}): "
                           "hierarchical needs more than one host and more than one rank "
                           "per host, so 4 ranks or more. To lay one machine out as hosts, "
                           "pass local_world_size=L (L ranks per emulated host, 1 < L < the "
                           "world size, dividing it) to the optimizer: torchrun sets "
                           "LOCAL_WORLD_SIZE to its --nproc_per_node, over any value given "
                           "in the environment")
            else:
                return 0, 0  # auto: one level has nothing to gain, and costs nothing
        if problem is not None:
            if self.wanted == "hierarchical":
                raise ValueError(f"topology='hierarchical': {problem}; or topology='flat'")
            if rank == 0:
                log.warning("onebit: topology='auto' exchanges flat (every rank across the "
                            "network): %s. topology='flat' says so and silences this", problem)
            return 0, 0
        if rank == 0:
            log.info("onebit: topology %s: %d hosts of %d ranks, the momentum averaged "
                     "exactly inside each host and across hosts by local rank",
                     self.wanted, world // local, local)
        return local, world // local

    def levels(self, timeout, device):
        """``(host_group, cross_group, local_world_size, hosts)``, the groups made at the first
        call, by every rank; None where the exchange is flat."""
        local, hosts = self.layout()
        if not local:
            return None
        if self._levels is None:
            rank = self.rank
            host = rank // local
            group = self.comm_group(timeout, device)
            host_group = new_group_of(list(range(host * local, (host + 1) * local)), group,
                                      timeout, device)
            cross_group = new_group_of(list(range(rank % local, self.world_size, local)),
                                       group, timeout, device)
            self._levels = (host_group, cross_group, local, hosts)
        return self._levels

    def learn_local_world_size(self, local: int) -> None:
        if self.asked_local is None and self._layout is None and \
                not os.environ.get("LOCAL_WORLD_SIZE", "").strip():
            self.asked_local = local

    def communicator(self, exchange, timeout, device, **options):
        levels = self.levels(timeout, device)
        if levels is None:
            return super().communicator(exchange, timeout, device, **options)
        from onebit_plugin.comm.hierarchical import HierarchicalAllreduce

        host_group, cross_group, local, hosts = levels
        inner = exchange.communicator(cross_group, hosts, timeout=timeout, **options)
        return HierarchicalAllreduce(inner, self.comm_group(timeout, device), host_group,
                                     local, timeout=timeout)

    def describe(self, settle: bool = True) -> str:
        if not settle and self._layout is None:
            return f"{self.wanted}, not settled"
        local, hosts = self.layout()
        return f"hierarchical {hosts}x{local}" if local else "flat"

    def agreement(self) -> dict[str, int]:
        local = self.layout()[0]
        return {"topology (1 flat, 2 hierarchical)": 2 if local else 1,
                "local_world_size": local}

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_levels": None}


def make_topology(process_group, topology: str = "auto", local_world_size: int | None = None
                  ) -> FlatTopology:
    """The topology object of ``topology`` (``settings.config.TOPOLOGIES``) over
    ``process_group``."""
    if topology == "flat":
        return FlatTopology(process_group)
    return HierarchicalTopology(process_group, local_world_size, topology)
