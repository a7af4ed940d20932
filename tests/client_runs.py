"""What the client example scripts leave in their output folder (2 ranks): each rank's final
parameters (``params.rank<R>.pt``) and the bytes it wrote per step, counted by the kernel
(``wire.rank<R>.json``, examples/wire.py)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch


def rank_params(out: Path, world: int = 2) -> list[list[torch.Tensor]]:
    return [torch.load(out / f"params.rank{r}.pt") for r in range(world)]


def median_bytes_per_step(out: Path, steps: range, world: int = 2) -> float:
    """Median over ``steps`` and ranks of the bytes a rank wrote in one step."""
    per_rank = [json.loads((out / f"wire.rank{r}.json").read_text()) for r in range(world)]
    return statistics.median(per_step[str(s)] for per_step in per_rank for s in steps)
