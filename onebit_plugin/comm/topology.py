"""Which ranks exchange with which, and over which process groups: the optimizer's collectives
take their group from its topology object and from nowhere else.

:class:`FlatTopology` is today's only one: every rank of one group (the world, or the
data-parallel group given as ``process_group``) in one flat exchange, over a group of the
optimizer's own once ``comm_timeout`` or the DDP hook asks for one (``new_group``). A topology
of two levels (a host group, a cross-host group per local rank) is one more class with the same
methods (docs/family.md, "A topology").
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from onebit_plugin.comm.collectives import group_size_and_rank, new_group

__all__ = ["FlatTopology"]


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

    def __getstate__(self) -> dict:
        # Process groups do not pickle: an unpickled optimizer runs on the default group.
        return {"process_group": None, "_group": None, "_ready": False}
