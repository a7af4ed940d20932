"""Each rank's own OneBitAdam error buffers beside a framework's checkpoint.

Accelerate's ``save_state`` and ``transformers.Trainer`` write the optimizer state from the main
process only, and the error buffers differ per rank; so every rank writes its own
``onebit_rank<R>.pt`` into the checkpoint folder and loads it back. A missing, unreadable or
other-run file is a ``ValueError`` naming the file, never silently zeroed errors.
"""

from __future__ import annotations

from pathlib import Path

import torch

from onebit_plugin.optimizer import OneBitAdam


def rank_file(folder, rank: int) -> Path:
    return Path(folder) / f"onebit_rank{rank}.pt"


def save_rank_states(folder, rank: int, optimizers: list[OneBitAdam]) -> Path:
    path = rank_file(folder, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save([o.onebit_state_dict() for o in optimizers], path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)  # never a half-written file under the real name
    return path


def load_rank_states(folder, rank: int, world: int, optimizers: list[OneBitAdam]) -> None:
    """Load this rank's file into ``optimizers``, whose regular state (step, switch step) the
    framework has already loaded from the same checkpoint."""
    folder = Path(folder)
    saved = sorted(p.name for p in folder.glob("onebit_rank*.pt"))
    if len(saved) != world:
        raise ValueError(
            f"{folder} holds OneBitAdam error buffers of {len(saved)} ranks ({saved}) and this "
            f"run has {world} processes: they are sharded per rank; resume with the same "
            "number of processes from a checkpoint written with 1-bit Adam on"
        )
    path = rank_file(folder, rank)
    try:
        states = torch.load(path, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same answer
        raise ValueError(f"{path}: cannot read this rank's OneBitAdam error buffers "
                         f"({type(exc).__name__}: {exc}); the file is missing, truncated or "
                         "not written by this package") from exc
    for optimizer, state in zip(optimizers, states, strict=True):
        saved_at = (state["global_step"], state["switch_step"])
        if saved_at != (optimizer.global_step, optimizer.switch_step):
            raise ValueError(
                f"{path} was saved at (step, switch step) {saved_at}, the optimizer state of "
                f"this checkpoint at {(optimizer.global_step, optimizer.switch_step)}: it comes "
                "from another run or checkpoint"
            )
        optimizer.load_onebit_state_dict(state)
