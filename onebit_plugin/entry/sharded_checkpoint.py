"""Checkpoints of an FSDP2-sharded model and its optimizer of the family through
``torch.distributed.checkpoint`` (DCP): :func:`save` and :func:`load`, collectives on every rank.

What is written:

* ``model``: the model's own sharded state dict (DTensors);
* ``optim``: every per-parameter state tensor shaped like the parameter's shard (Adam's moments,
  the frozen denominator, fp32 master copies), as a DTensor of the parameter's placements, under
  the parameter's name: DCP reshards these onto another mesh;
* ``onebit_rank<r>``: the rest, per rank, as bytes of ``torch.save`` in a uint8 tensor (read back
  with ``weights_only=True``): the param groups, the step counters, the ``onebit`` entry (stage,
  counters, this rank's error buffers, 0/1 Adam's local-step state) and the mesh it was saved on.

A load on the same mesh resumes every rank bit for bit, in the warm-up, the compression stage and
between 0/1 Adam's syncs. On another mesh the model and the moments are resharded by DCP and the
error buffers, which belong to one rank's shard and one replicate group's chunks, restart from
zero, said once (as a change of world size does, docs/limits.md); a state saved between syncs of
local steps is refused there (every rank holds its own parameters).

A checkpoint folder is data: DCP's own reader unpickles its ``.metadata`` file, and its default
load planner reads byte entries with a full (not weights-only) ``torch.load``; either runs code
a crafted file names.
Here the metadata is unpickled by an allow-list of DCP's own record classes and torch's sizes and
dtypes, and byte entries are refused.
"""

from __future__ import annotations

import enum
import io
import logging
import pickle

import torch
import torch.distributed as dist

__all__ = ["load", "save"]

log = logging.getLogger("onebit_plugin")


def _names(model, optimizer) -> dict:
    """Each of the optimizer's proxies (``comm.shards``) -> its parameter's name in ``model``."""
    shards = getattr(optimizer, "shards", None)
    if shards is None:
        raise ValueError(f"{type(optimizer).__name__} holds no FSDP2-sharded parameters: "
                         "save_sharded/load_sharded are for models sharded by fully_shard; "
                         "save this one's state_dict() on each rank")
    by_id = {id(p): name for name, p in model.named_parameters()}
    names = {}
    for proxy, p in shards.dtensor_of.items():
        if id(p) not in by_id:
            raise ValueError("the optimizer steps a parameter the model does not hold: give "
                             "save/load the model whose parameters the optimizer was made with")
        names[proxy] = by_id[id(p)]
    return names


def _mesh_record(optimizer) -> dict:
    shards = optimizer.shards
    ranks = shards.shard_ranks()
    return {"world": dist.get_world_size(), "shard_size": len(ranks),
            "shard_index": ranks.index(dist.get_rank()), "replicas": optimizer.world_size}


def _as_dtensor(t: torch.Tensor, like) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(t, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def _split(optimizer, names: dict) -> tuple[dict, dict]:
    """The optimizer's state dict as ``(tensors, rest)``: per parameter name, its state tensors
    shaped like its shard as DTensors, and everything else (plain values) for the rank's
    bytes."""
    sd = optimizer.state_dict()
    order = [p for g in optimizer.param_groups for p in g["params"]]
    tensors, state = {}, {}
    for index, entries in sd["state"].items():
        proxy = order[index]
        name, like = names[proxy], optimizer.shards.dtensor_of[proxy]
        for key, value in entries.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape == proxy.shape:
                tensors.setdefault(name, {})[key] = _as_dtensor(value, like)
            else:
                state.setdefault(name, {})[key] = value
    groups = [{**g, "params": [names[order[i]] for i in g["params"]]}
              for g in sd["param_groups"]]
    rest = {"param_groups": groups, "state": state, "onebit": sd["onebit"],
            "tensor_keys": {name: sorted(keys) for name, keys in tensors.items()},
            "mesh": _mesh_record(optimizer)}
    return tensors, rest


def _bytes_tensor(obj) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def save(checkpoint_id, model, optimizer) -> None:
    """Write ``model`` and ``optimizer`` (a member of the family over ``model``'s FSDP2 shards)
    to the DCP checkpoint ``checkpoint_id`` (a folder). Every rank calls it."""
    import torch.distributed.checkpoint as dcp
    names = _names(model, optimizer)
    tensors, rest = _split(optimizer, names)
    dcp.save({"model": model.state_dict(), "optim": tensors,
              f"onebit_rank{dist.get_rank()}": _bytes_tensor(rest)},
             checkpoint_id=checkpoint_id)


# ------------------------------------------------------------------------------------- load
_ALLOWED_MODULES = ("torch.distributed.checkpoint.",)
_ALLOWED = {("torch", "Size"), ("collections", "OrderedDict"), ("builtins", "set"),
            ("builtins", "frozenset"), ("builtins", "slice"), ("torch", "device"),
            # A layout by its name (torch.strided): a dictionary lookup, nothing called.
            ("torch.serialization", "_get_layout"),
            # The checkpoint's folder, as saved: a path built from strings.
            ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata records and torch's sizes, dtypes and memory formats; nothing else."""

    def find_class(self, module: str, name: str):
        obj = None
        if module.startswith(_ALLOWED_MODULES) or (module, name) in _ALLOWED:
            obj = super().find_class(module, name)
        elif module == "torch":
            obj = getattr(torch, name, None)
            if not isinstance(obj, torch.dtype | torch.memory_format):
                obj = None
        if obj is None or (module.startswith(_ALLOWED_MODULES) and not isinstance(obj, type)
                           and not isinstance(obj, enum.Enum)):
            raise pickle.UnpicklingError(
                f"the checkpoint's metadata names {module}.{name}, which a DCP checkpoint's "
                "metadata does not hold: refused (a checkpoint is data, never code)")
        return obj


def _reader(checkpoint_id):
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")
            with self.fs.create_stream(self._get_metadata_path(rank), "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
            if not isinstance(metadata, Metadata):
                raise ValueError(f"{checkpoint_id}: its metadata is not a DCP Metadata record")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(checkpoint_id)


def _planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class TensorsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            raise ValueError(f"the checkpoint holds {read_item.dest_index.fqn} as pickled "
                             "bytes, which onebit-plugin's checkpoints never write: refused "
                             "(a checkpoint is data, never code)")

    return TensorsOnly()


def _load_tensors(checkpoint_id, state: dict) -> None:
    import torch.distributed.checkpoint as dcp
    dcp.load(state, storage_reader=_reader(checkpoint_id), planner=_planner())


def _rest_of(checkpoint_id, metadata, rank: int | None) -> dict | None:
    """Rank ``rank``'s bytes entry as saved (None: none, or the checkpoint has no such rank).
    A collective: every rank calls it, each for the rank it wants."""
    key = f"onebit_rank{rank}"
    entry = metadata.state_dict_metadata.get(key) if rank is not None else None
    template = {key: torch.empty(tuple(entry.size), dtype=torch.uint8)} if entry else {}
    _load_tensors(checkpoint_id, template)
    if not template:
        return None
    return torch.load(io.BytesIO(template[key].numpy().tobytes()), weights_only=True)


def load(checkpoint_id, model, optimizer) -> None:
    """Read a checkpoint :func:`save` wrote into ``model`` and ``optimizer`` (made as for the
    run that saved it, on this mesh or another). Every rank calls it."""
    from torch.distributed.tensor import DTensor
    names = _names(model, optimizer)
    metadata = _reader(checkpoint_id).read_metadata()
    rank = dist.get_rank()
    mine = _rest_of(checkpoint_id, metadata, rank)
    here = _mesh_record(optimizer)
    moved = mine is None or mine["mesh"] != here
    # On another mesh every rank takes rank 0's entry (the loads are collectives: all or none).
    if _any(moved):
        rest, moved = _rest_of(checkpoint_id, metadata, 0), True
    else:
        rest = mine
    if rest is None:
        raise ValueError(f"{checkpoint_id} holds no onebit_rank0 entry: not a checkpoint of "
                         "onebit_plugin.entry.sharded_checkpoint.save")
    by_name = {name: proxy for proxy, name in names.items()}
    unknown = sorted(set(rest["tensor_keys"]) - set(by_name))
    if unknown:
        raise ValueError(f"{checkpoint_id} holds optimizer state of parameters this model does "
                         f"not have: {unknown[:5]}")
    optim = {}
    for name, keys in rest["tensor_keys"].items():
        like = optimizer.shards.dtensor_of[by_name[name]]
        optim[name] = {k: DTensor.from_local(
            torch.zeros(like._local_tensor.shape, dtype=torch.float32, device=like.device),
            like.device_mesh, like.placements, run_check=False, shape=like.shape,
            stride=like.stride()) for k in keys}
    _load_tensors(checkpoint_id, {"model": model.state_dict(), "optim": optim})
    order = [p for g in optimizer.param_groups for p in g["params"]]
    index = {names[p]: i for i, p in enumerate(order)}
    state = {}
    for name in set(rest["state"]) | set(optim):
        state[index[name]] = {**rest["state"].get(name, {}),
                              **{k: v._local_tensor for k, v in optim.get(name, {}).items()}}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in rest["param_groups"]]
    onebit = rest["onebit"]
    if moved and onebit["switch_step"] is not None:
        onebit = _restart_on_new_mesh(optimizer, onebit, rest["mesh"], here)
    optimizer.load_state_dict({"state": state, "param_groups": groups, "onebit": onebit})


def _any(flag: bool) -> bool:
    """Whether ``flag`` holds on some rank (every rank must read the same entries)."""
    t = torch.tensor([float(flag)])
    dist.all_reduce(t)
    return bool(t.item())


def _restart_on_new_mesh(optimizer, onebit: dict, saved: dict, here: dict) -> dict:
    """A compression-stage state on another mesh (or a rank the saving run did not have):
    the error buffers restart from zero, said once; a state between syncs is refused."""
    if onebit.get("local_steps") is not None:
        raise ValueError(
            f"this checkpoint was saved between two syncs of local steps on a mesh of "
            f"{saved['replicas']} x {saved['shard_size']} and is loaded on {here['replicas']} x "
            f"{here['shard_size']}: between syncs every rank holds parameters of its own, which "
            "do not map onto another mesh; resume on the same mesh, or save at a sync "
            "(optimizer.sync_local_steps() before save)")
    if dist.get_rank() == 0:
        log.warning(
            "onebit: resuming a compressed stage saved on a mesh of %d hosts x %d ranks on one "
            "of %d x %d: the model and the optimizer's moments are resharded, the error "
            "buffers (each rank's, over its shard) do not map and restart from zero. The run "
            "goes on from there, not bit for bit as the uninterrupted one (docs/limits.md, "
            "\"Another world size\")", saved["replicas"], saved["shard_size"], here["replicas"],
            here["shard_size"])
    # The world-size check of the load would say it again: this is the replicate group's now.
    return dict(onebit, units=None, world_size=optimizer.world_size)
