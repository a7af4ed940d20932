"""Check that every rank holds bit-identical parameters and the same optimizer stage.

Data-parallel training is only correct while the ranks stay in lockstep; a desynchronised rank
trains silently on (DeepSpeed's 1-bit optimizers drifted by O(1) within 15 steps after a resume).
``check_lockstep`` compares a fingerprint of every parameter's bits and the optimizer's stage
across ranks: one all-gather of a few numbers per parameter.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from onebit_plugin.comm.shards import is_dtensor
from onebit_plugin.members.onebit_adam import OneBitAdam

__all__ = ["LockstepError", "check_lockstep", "fingerprint"]

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class LockstepError(RuntimeError):
    """Ranks disagree on parameters or optimizer stage."""


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 checksums of the tensor's raw bits (a plain and a position-weighted sum, both
    wrapping): any single flipped bit changes them. A DTensor's: its local shard's."""
    if is_dtensor(tensor):
        tensor = tensor._local_tensor
    bits = tensor.detach().contiguous().view(-1).view(_INT_VIEW[tensor.element_size()]).long()
    weights = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64)
    return torch.stack([bits.sum(), (bits * weights).sum()])


def check_lockstep(
    params: Iterable[torch.Tensor],
    optimizer: OneBitAdam | None = None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Raise :class:`LockstepError` unless every rank of ``group`` holds bit-identical
    ``params`` and (when given) the same OneBitAdam stage, step and switch step. Collective:
    call it on every rank at the same point. A no-op without an initialised process group.

    FSDP2-sharded ``params`` are compared shard by shard over the ranks that replicate them:
    ``group`` defaults to the optimizer's (``mesh["replicate"]``'s); the shards of one host
    differ by design."""
    params = list(params)
    if group is None and optimizer is not None and any(map(is_dtensor, params)):
        group = optimizer.process_group
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    device = params[0].device if params else torch.device("cpu")
    rows = [fingerprint(p) for p in params]
    if optimizer is not None:
        switch = -1 if optimizer.switch_step is None else optimizer.switch_step
        rows.append(torch.tensor([optimizer.global_step, switch], device=device))
    local = torch.stack(rows).to(device) if rows else torch.zeros(0, 2, dtype=torch.int64)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=group)
    for rank, other in enumerate(gathered[1:], start=1):
        if torch.equal(other, gathered[0]):
            continue
        bad = (other != gathered[0]).any(dim=1).nonzero().view(-1).tolist()
        names = [
            "optimizer (global_step, switch_step)" if i == len(params) else f"parameter {i}"
            for i in bad[:5]
        ]
        raise LockstepError(
            f"rank {rank} differs from rank 0 in {', '.join(names)}"
            + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        )
