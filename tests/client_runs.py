"""What the client example scripts leave in their output folder (2 ranks): each rank's final
parameters (``params.rank<R>.pt``) and the bytes it wrote per step, counted by the kernel
(``wire.rank<R>.json``, examples/wire.py); and the launch command they share."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from tests.dist_helpers import free_port


def rank_params(out: Path, world: int = 2) -> list[list[torch.Tensor]]:
    return [torch.load(out / f"params.rank{r}.pt") for r in range(world)]


def median_bytes_per_step(out: Path, steps: range, world: int = 2) -> float:
    """Median over ``steps`` and ranks of the bytes a rank wrote in one step."""
    per_rank = [json.loads((out / f"wire.rank{r}.json").read_text()) for r in range(world)]
    return statistics.median(per_step[str(s)] for per_step in per_rank for s in steps)


def accelerate_launch(bin_dir: Path, processes: int = 2) -> list[str]:
    """``accelerate launch`` of ``processes`` CPU processes on a port of their own (its default,
    29500, would be shared by launches that run at the same time)."""
    return [str(bin_dir / "accelerate"), "launch", "--multi_gpu", "--num_processes",
            str(processes),
            "--num_machines", "1", "--main_process_port", str(free_port()),
            "--mixed_precision", "no", "--dynamo_backend", "no"]
