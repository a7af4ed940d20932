"""Each rank's own OneBitAdam error buffers beside a framework's checkpoint.

Accelerate's ``save_state`` and ``transformers.Trainer`` write the optimizer state from the main
process only, and the error buffers differ per rank; so every rank writes its own
``onebit_rank<R>.pt`` into the checkpoint folder and loads it back. A missing, unreadable or
other-run file is a ``ValueError`` naming the file, never silently zeroed errors. A checkpoint
written in warm-up (no error buffers yet) resumes on any number of processes; one written in the
compression stage too, its error feedback restarted from zero and said (the optimizer's load).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import zipfile
from pathlib import Path

import torch

from onebit_plugin import OneBitOptimizer, uses_nccl

log = logging.getLogger("onebit_plugin")


def _say_other_world(saved: int, world: int) -> None:
    log.info("onebit: resuming a warm-up checkpoint of %d ranks on %d: warm-up state holds no "
             "per-rank error buffers, so the world size may change", saved, world)


def rank_file(folder, rank: int) -> Path:
    return Path(folder) / f"onebit_rank{rank}.pt"


def _ranks_in(folder: Path) -> dict[int, Path]:
    found = {}
    for path in folder.glob("onebit_rank*.pt"):
        digits = path.stem.removeprefix("onebit_rank")
        if digits.isdigit():
            found[int(digits)] = path
    return found


def save_rank_states(folder, rank: int, world: int, optimizers: list[OneBitOptimizer]) -> Path:
    path = rank_file(folder, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save([o.onebit_state_dict() for o in optimizers], path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)  # never a half-written file under the real name
    if rank == 0:
        # An earlier run with more processes may have saved into this folder (an elastic
        # restart that saves where it loaded): its higher ranks' files are not this
        # checkpoint's. No rank of this run writes them.
        for other, stale in _ranks_in(path.parent).items():
            if other >= world:
                stale.unlink(missing_ok=True)
    return path


def load_rank_states(folder, rank: int, world: int, optimizers: list[OneBitOptimizer]) -> None:
    """Load this rank's file into ``optimizers``, whose regular state (step, switch step) the
    framework has already loaded from the same checkpoint."""
    folder = Path(folder)
    files = _ranks_in(folder)
    if not files:
        if all(o.switch_step is None for o in optimizers):
            _say_other_world(0, world)
            return
        raise ValueError(
            f"{folder} holds no OneBitAdam error buffers (onebit_rank<R>.pt) and this run "
            "resumes the compression stage: resume from a checkpoint written with the 1-bit "
            "optimizer on"
        )
    saved_world = len(files)
    if saved_world != world or sorted(files) != list(range(saved_world)):
        # Another world size, a file missing, or files an earlier run left: rank 0's file
        # says how many ranks wrote this checkpoint (and is checked to belong to it).
        if 0 not in files:
            raise ValueError(f"{folder} holds the OneBitAdam error buffers of ranks "
                             f"{sorted(files)}: rank 0's is missing; resume from a complete "
                             "checkpoint")
        saved_world = _read(files[0], optimizers)[0]["world_size"]
        missing = [r for r in range(saved_world) if r not in files]
        if missing:
            raise ValueError(
                f"{folder} holds the OneBitAdam error buffers of ranks {sorted(files)}, and "
                f"rank 0's file says {saved_world} ranks wrote it: ranks {missing}'s are "
                "missing (every rank writes its own); resume from a complete checkpoint")
        if rank == 0 and any(r >= saved_world for r in files):
            log.info("onebit: %s: the files of ranks %s are left from another run (rank 0's "
                     "file says %d ranks wrote this checkpoint) and are not read", folder,
                     sorted(r for r in files if r >= saved_world), saved_world)
    if saved_world == world:
        for optimizer, state in zip(optimizers, _read(files[rank], optimizers), strict=True):
            optimizer.load_onebit_state_dict(state)
        return
    # Another world size. What the files hold besides each rank's errors (step, counters, the
    # auto freeze's snapshots of the averaged variance) is rank 0's, already loaded with the
    # framework's optimizer state; in the compression stage that load restarted the error
    # feedback (and said so), or refused a 0/1 Adam state saved between syncs.
    if all(o.switch_step is None for o in optimizers):
        _say_other_world(saved_world, world)


def _read(path: Path, optimizers: list[OneBitOptimizer]) -> list[dict]:
    """``path``'s states, one per optimizer, checked to come from the checkpoint whose regular
    state ``optimizers`` hold."""
    try:
        # Data only: a checkpoint folder may come from anywhere, and a full unpickle would run
        # whatever code a crafted file names. What save_rank_states writes is tensors, numbers,
        # strings and plain containers, all of which weights_only reads.
        states = torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same answer
        raise ValueError(f"{path}: cannot read this rank's OneBitAdam error buffers "
                         f"({type(exc).__name__}: {exc}); the file is missing, truncated or "
                         "not written by this package") from exc
    if len(states) != len(optimizers):
        raise ValueError(f"{path} holds {len(states)} optimizers' states, this run has "
                         f"{len(optimizers)}")
    for optimizer, state in zip(optimizers, states, strict=True):
        saved_at = (state["global_step"], state["switch_step"])
        if saved_at != (optimizer.global_step, optimizer.switch_step):
            raise ValueError(
                f"{path} was saved at (step, switch step) {saved_at}, the optimizer state of "
                f"this checkpoint at {(optimizer.global_step, optimizer.switch_step)}: it comes "
                "from another run or checkpoint"
            )
    return states


# ------------------------------------------------- all ranks' states inside one checkpoint
# Lightning and Fabric write a checkpoint from rank 0 only: every rank's own "onebit" entry
# travels to rank 0 and is stored beside rank 0's optimizer state as "onebit_ranks".

def to_cpu(obj):
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_cpu(v) for v in obj)
    return obj.cpu() if isinstance(obj, torch.Tensor) else obj


def with_rank_states(state: dict, rank: int, world: int) -> dict:
    """``state`` (a OneBitAdam ``state_dict()``), on rank 0 with every rank's ``onebit`` entry
    under ``onebit_ranks``. Collective: every rank calls it."""
    import torch.distributed as dist

    if world == 1:
        return state
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(to_cpu(state["onebit"]), gathered, dst=0, group=_host_group())
    return dict(state, onebit_ranks=gathered) if rank == 0 else state


_HOST_GROUPS: dict = {}


def _host_group():
    """The group the error buffers travel on: the default one, unless it is NCCL, whose
    ``gather_object`` pickles into CUDA tensors on rank 0's GPU (world x the largest state at
    once: about 47 GB for 1.3B parameters on 8 GPUs); then a gloo group over the same ranks,
    made once, at the first checkpoint (every rank is here then: this is collective)."""
    import torch.distributed as dist

    if not uses_nccl(dist.get_backend()):
        return None
    key = dist.get_world_size()
    if key not in _HOST_GROUPS:
        _HOST_GROUPS[key] = dist.new_group(backend="gloo")
    return _HOST_GROUPS[key]


def own_rank_state(state: dict, rank: int, world: int) -> dict:
    """``state`` as written by :func:`with_rank_states`, with this rank's own ``onebit``."""
    ranks = state.get("onebit_ranks")
    onebit = state.get("onebit") or {}
    if ranks is None:
        if world > 1 and onebit.get("switch_step") is not None and \
                onebit.get("world_size") == world:
            raise ValueError(
                "this checkpoint holds rank 0's OneBitAdam error buffers only (no "
                "'onebit_ranks'): it was not written with the onebit_adam strategy on "
                f"{world} processes; every rank needs its own to resume the compression stage"
            )
        return state
    state = {k: v for k, v in state.items() if k != "onebit_ranks"}
    if len(ranks) != world:
        # Another world size: rank 0's state. Warm-up holds no error buffers; in the
        # compression stage its load restarts the error feedback (and says so), or refuses a
        # 0/1 Adam state saved between syncs.
        if onebit.get("switch_step") is None:
            _say_other_world(len(ranks), world)
        return state
    return dict(state, onebit=ranks[rank])


# ------------------------------------------- reading one checkpoint, this rank's entry alone
# Every rank reads the whole checkpoint file, which holds every rank's error buffers: W times
# the errors in each rank's memory at once (8 ranks of 1.3B parameters: about 47 GB per rank).
# Mapped instead, a rank touches only its own entry's pages and rank 0's regular state.

class OwnRankReader:
    """Stands for a strategy's default checkpoint IO while it loads: a local checkpoint in
    torch's zip format is mapped and only this rank's error buffers are read from it
    (:func:`read_own_rank`); anything else goes to the framework's own IO (``fallback``)."""

    def __init__(self, fallback, rank: int, world: int):
        self.fallback, self.rank, self.world = fallback, rank, world

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        read = read_own_rank(path, self.rank, self.world, weights_only)
        if read is not None:
            return read
        extra = {} if map_location is None else {"map_location": map_location}
        return self.fallback.load_checkpoint(path, weights_only=weights_only, **extra)


def _is_torch_io(io) -> bool:
    """The framework's default checkpoint IO (made at its first use, or given as such), not a
    subclass or a wrapper of a user's: ``torch.load`` of a path, as the reader does."""
    cls = type(io)
    return cls.__name__ == "TorchCheckpointIO" and cls.__module__.endswith("plugins.io.torch_io")


@contextlib.contextmanager
def reading_own_rank(strategy):
    """While a Lightning or Fabric strategy loads a checkpoint: its default IO, the framework's
    TorchCheckpointIO, reads this rank's entry alone; a user's own IO (a subclass, a wrapper
    such as AsyncCheckpointIO) is left alone and reads what it reads."""
    given = strategy._checkpoint_io
    if given is not None and not _is_torch_io(given):
        yield
        return
    strategy._checkpoint_io = OwnRankReader(strategy.checkpoint_io if given is None else given,
                                            strategy.global_rank, strategy.world_size)
    try:
        yield
    finally:
        strategy._checkpoint_io = given  # None stays None: the framework makes its default


def read_own_rank(path, rank: int, world: int, weights_only: bool | None) -> dict | None:
    """The checkpoint at ``path`` (a local file in torch's zip format; else None) as a
    framework's loader would return it, but every ``onebit_ranks`` list holding only this
    rank's entry (the others None; all None when another number of ranks wrote it, whose load
    takes rank 0's ``onebit``, :func:`own_rank_state`). The file is mapped, and what is kept
    is copied out of the mapping: a framework that later rewrites the file in place (a
    ``last.ckpt``) cannot pull pages from under the run."""
    if not isinstance(path, str | os.PathLike) or "://" in str(path) or \
            not os.path.isfile(path) or not zipfile.is_zipfile(path):
        return None
    checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
    for state in _optimizer_states(checkpoint):
        ranks = state["onebit_ranks"]
        keep = rank if len(ranks) == world else None
        state["onebit_ranks"] = [r if i == keep else None for i, r in enumerate(ranks)]
    return _in_memory(checkpoint)


def _optimizer_states(checkpoint) -> list[dict]:
    """The optimizer states with every rank's entries: Lightning's ``optimizer_states``, the
    values of a Fabric checkpoint, or a Fabric checkpoint that is an optimizer state."""
    if not isinstance(checkpoint, dict):
        return []
    found = [checkpoint] + list(checkpoint.values()) + \
        list(checkpoint.get("optimizer_states") or [])
    return [s for s in found if isinstance(s, dict) and isinstance(s.get("onebit_ranks"), list)]


def _in_memory(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the mapping's type (OrderedDict, AttributeDict)
        for key, value in obj.items():
            out[key] = _in_memory(value)
        return out
    if isinstance(obj, list | tuple) and type(obj) in (list, tuple):
        return type(obj)(_in_memory(v) for v in obj)
    return obj
