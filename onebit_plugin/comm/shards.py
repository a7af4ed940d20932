"""Parameters sharded by FSDP2 (``fully_shard``, DTensors): each rank steps its own shard.

Under HSDP a host's ``L`` ranks shard every parameter among themselves and the hosts replicate
it: rank ``i`` of every host holds the same shard. FSDP2 reduce-scatters the gradient inside the
host (the mean over its ranks, each rank receiving its shard's), and the cross-host exchange of
that shard is what the family compresses, over the *replicate* group of the ranks holding the
same shard (``process_group=mesh["replicate"].get_group()``). Shard the model over the host's
dimension alone (``fully_shard(m, mesh=mesh["shard"])``): FSDP2's native HSDP (a 2-D mesh)
all-reduces every step's gradient across hosts in full precision inside backward, the very
traffic the compression stage replaces, and has no public switch that keeps the reduce-scattered
gradient and skips only that all-reduce (``set_requires_all_reduce(False)`` holds the gradient
back for accumulation instead). With the 1-D mesh the optimizer averages the shard's gradients
across hosts itself in the full-precision steps (the same numbers as native HSDP's, checked in
tests/test_hsdp.py), and sends its 1-bit momentum in the compression stage.

The optimizer keeps, for each sharded parameter, a plain ``nn.Parameter`` over the same memory
as the DTensor's local shard (a *proxy*): its ``param_groups`` and state hold the proxies, every
part of the family runs on them unchanged, and each step first points the proxies' gradients at
the DTensors' local gradient shards (:meth:`Shards.pull_grads`). Writing a proxy writes the
shard FSDP2 all-gathers. ``onebit_plugin.entry.sharded_checkpoint`` maps the proxies back to
the model's names for ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Shards", "exchange_group", "is_dtensor", "localize"]

log = logging.getLogger("onebit_plugin")


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor (without importing DTensor where torch has none)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor  # DTensor.to_local() without the autograd function


def _shard_group(p) -> dist.ProcessGroup:
    """The process group a DTensor parameter is sharded over, checked to be FSDP2's 1-D shard
    mesh (else a ValueError that says what to do)."""
    from torch.distributed.tensor import Shard
    mesh = p.device_mesh
    if mesh.ndim != 1 or not isinstance(p.placements[0], Shard):
        raise ValueError(
            f"the optimizer got a DTensor parameter on a {mesh.ndim}-D mesh with placements "
            f"{tuple(p.placements)}. The 1-bit family steps FSDP2 shards on one mesh dimension: "
            "shard over the host's ranks only, fully_shard(module, mesh=mesh['shard']), and "
            "pass process_group=mesh['replicate'].get_group() to the optimizer. FSDP2's "
            "native HSDP (a 2-D mesh) all-reduces every gradient across hosts in full precision "
            "inside backward, which is the traffic the compression stage replaces "
            "(docs/usage.md, 'Sharded models (FSDP2, HSDP)')")
    return mesh.get_group()


def localize(params, shards: Shards | None = None) -> tuple[list, Shards | None]:
    """``params`` as given to an optimizer (tensors, ``(name, tensor)`` pairs or param-group
    dicts), each DTensor replaced by its proxy; the :class:`Shards` that maps them back
    (``shards``, or a new one; None when nothing is sharded). Sharded and unsharded
    parameters together are refused: FSDP2 averages the sharded ones inside the host, nothing
    would average the others there."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params argument given to the optimizer should be an iterable of "
                        f"Tensors or dicts, but got {torch.typename(params)}")
    items = list(params)
    is_groups = bool(items) and isinstance(items[0], dict)
    groups = items if is_groups else [{"params": items}]
    for g in groups:  # lists once, in the caller's dicts (as torch's add_param_group does)
        ps = g["params"]
        g["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
    flat = [p[1] if isinstance(p, tuple) else p for g in groups for p in g["params"]]
    known = shards.dtensor_of if shards is not None else {}
    sharded = [p for p in flat if is_dtensor(p) or p in known]
    if (sharded or shards is not None) and len(sharded) != len(flat):
        raise ValueError(
            f"the optimizer got {len(sharded)} FSDP2-sharded (DTensor) and "
            f"{len(flat) - len(sharded)} plain parameters: shard the whole model with "
            "fully_shard (its root included), or give the plain ones to another optimizer")
    if sharded:
        shards = Shards() if shards is None else shards
        for g in groups:
            g["params"] = [(p[0], shards.proxy_of(p[1])) if isinstance(p, tuple)
                           else shards.proxy_of(p) for p in g["params"]]
    return (groups if is_groups else groups[0]["params"]), shards


def exchange_group(shards: Shards | None, process_group, topology: str, owner: str,
                   policy) -> tuple:
    """The optimizer's ``(process_group, topology)``: as given without shards; with them the
    replicate group (:meth:`Shards.replicate_group`), flat (FSDP2 reduces inside the host
    already); the member's policy is told (``Policy.use_shards``)."""
    if shards is None:
        return process_group, topology
    policy.use_shards(shards)
    if topology == "hierarchical":
        raise ValueError(
            "topology='hierarchical' with FSDP2-sharded parameters: FSDP2 already reduces the "
            "gradient inside each host, and the optimizer exchanges each shard across hosts; "
            "leave topology at 'auto' or 'flat'")
    return shards.replicate_group(process_group, owner), "flat"


class Shards:
    """The optimizer's proxies of FSDP2-sharded parameters (``proxy -> DTensor``)."""

    def __init__(self) -> None:
        self.dtensor_of: dict[nn.Parameter, torch.Tensor] = {}
        self._proxies: dict[int, nn.Parameter] = {}
        self.group: dist.ProcessGroup | None = None  # the shard (host) group
        self.alone = False  # no rank holds a replica of this rank's shard

    def proxy_of(self, p: torch.Tensor) -> nn.Parameter:
        """``p``'s proxy (made at the first call): an ``nn.Parameter`` over its local shard."""
        if p in self.dtensor_of:  # a proxy already
            return p
        proxy = self._proxies.get(id(p))
        if proxy is not None:
            return proxy
        group = _shard_group(p)
        if self.group is None:
            self.group = group
        elif dist.get_process_group_ranks(group) != dist.get_process_group_ranks(self.group):
            raise ValueError("the optimizer's FSDP2 parameters are sharded over different "
                             "meshes: give each mesh's parameters an optimizer of their own")
        proxy = nn.Parameter(_local(p), requires_grad=p.requires_grad)
        self._proxies[id(p)] = proxy
        self.dtensor_of[proxy] = p
        return proxy

    def pull_grads(self) -> None:
        """Every proxy's gradient becomes its DTensor's local gradient shard (the same memory),
        and follows the DTensor's ``requires_grad``. A shard whose memory FSDP2 replaced (a
        ``load_state_dict(assign=True)``, ``to_empty``) is taken again, the proxy kept (the
        optimizer's state is keyed by it)."""
        for proxy, p in self.dtensor_of.items():
            local = _local(p)
            if proxy.data_ptr() != local.data_ptr() or proxy.shape != local.shape:
                proxy.data = local
            if proxy.requires_grad != p.requires_grad:
                proxy.requires_grad_(p.requires_grad)
            proxy.grad = None if p.grad is None else _local(p.grad)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The DTensors' gradients too (``Optimizer.zero_grad`` reaches only the proxies')."""
        for p in self.dtensor_of.values():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()

    def sum_over_host_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks that shard the model with this one (a collective on
        the host's group; ``t`` itself, in place)."""
        if dist.get_world_size(self.group) > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def max_over_host_(self, t: torch.Tensor) -> torch.Tensor:
        """:meth:`sum_over_host_`, the maximum."""
        if dist.get_world_size(self.group) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def shard_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.group)

    def replicate_group(self, process_group: dist.ProcessGroup | None, owner: str
                        ) -> dist.ProcessGroup | None:
        """The group the optimizer exchanges over: ``process_group``, checked to hold no two
        ranks of one shard group (it would average different shards). Where no rank holds a
        replica of this rank's shard (one host: the model sharded over every rank, without a
        group or with a replicate group of one rank), :attr:`alone` is set: nothing crosses
        ranks for the family to compress, so the optimizer stays in its exact stage
        (``warmup_stage``), which is said once (rank 0)."""
        shard_ranks = set(self.shard_ranks())
        world = dist.get_world_size()
        ranks = set(range(world)) if process_group is None else \
            set(dist.get_process_group_ranks(process_group))
        both = shard_ranks & ranks
        if len(both) <= 1 and len(ranks) > 1:
            return process_group
        if len(ranks) == 1 or (process_group is None and len(shard_ranks) == world):
            if dist.get_rank() == 0:
                log.warning(
                    "onebit: %s's parameters are sharded by FSDP2 over %d ranks and no rank "
                    "holds a replica of another's shard (one host): nothing crosses ranks for "
                    "the optimizer to compress, so it stays in its exact stage (Adam's update) "
                    "on each shard whatever its freeze settings say, and sends nothing (FSDP2's "
                    "reduce-scatter is all the traffic). Compression needs replicas: hosts "
                    "along mesh['replicate'], fully_shard(module, mesh=mesh['shard']) and "
                    "process_group=mesh['replicate'].get_group(); under Lightning's "
                    "strategy='onebit_hsdp' on one machine, shard over fewer ranks than the "
                    "devices: strategy=OneBitHSDPStrategy(shard_size=L), L ranks per "
                    "emulated host", owner, len(shard_ranks))
            self.alone = True
            return process_group if process_group is not None else _own_group()
        given = "the world (no process_group given)" if process_group is None else \
            "its process_group"
        raise ValueError(
            f"{owner}'s parameters are sharded by FSDP2 over ranks {sorted(shard_ranks)}, and "
            f"{given} holds {len(both)} of them ({sorted(both)}): it would average different "
            "shards. Pass process_group=mesh['replicate'].get_group(), the ranks that hold "
            "this rank's shard on the other hosts")


def _own_group() -> dist.ProcessGroup:
    """A group of this rank alone (made on every rank: ``new_group`` is collective)."""
    mine = None
    for r in range(dist.get_world_size()):
        g = dist.new_group([r])
        if r == dist.get_rank():
            mine = g
    return mine
