"""Soak under faults: a long compression stage with ranks SIGKILLed at random steps, torchrun
restarting the job each time from the newest checkpoint every rank wrote.

    .venv/bin/python benchmarks/fault_soak.py --steps 3000 --faults 6 [--seed 0]

Runs examples/train_torchrun.py twice on 2 local gloo ranks: uninterrupted, then with
``--faults`` kills (random steps after the freeze, random rank) under ``--max-restarts``.
Counts the restarts, the steps redone (kill step minus the checkpoint resumed from) and the
lockstep checks that passed, and compares the final parameters of the two runs bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def run(out: Path, args, kills: list[int], ranks: list[int]) -> tuple[str, float]:
    argv = [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", "--max-restarts",
            str(len(kills)), str(ROOT / "examples" / "train_torchrun.py"),
            "--steps", str(args.steps), "--freeze-step", str(args.freeze_step),
            "--eval-every", str(args.steps), "--ckpt-dir", str(out / "ckpt"),
            "--ckpt-every", str(args.ckpt_every), "--check-lockstep", str(args.check_every),
            "--params-out", str(out / "params"), "--json", str(out / "summary.json"),
            "--comm-timeout", "10", "--kill-at", ",".join(map(str, kills)),
            "--kill-rank", ",".join(map(str, ranks)) or "1"]
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, start_new_session=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1",
                                   # restarts need the workers' own store: pytorch#135712
                                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"), timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    return proc.stdout + proc.stderr, time.monotonic() - started


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--freeze-step", type=int, default=100)
    p.add_argument("--faults", type=int, default=6)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--check-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    # One kill per attempt, at increasing steps of the compression stage, on a random rank.
    kills = sorted(rng.sample(range(args.freeze_step + 2, args.steps), args.faults))
    ranks = [rng.randrange(2) for _ in kills]
    with tempfile.TemporaryDirectory() as tmp:
        straight_log, straight_s = run(Path(tmp) / "straight", args, [], [])
        faulty_log, faulty_s = run(Path(tmp) / "faulty", args, kills, ranks)
        resumed = [int(s) for s in re.findall(r"rank 0: resumed from \S+ at step (\d+)",
                                              faulty_log)]
        equal = all(
            torch.equal(a, b)
            for r in (0, 1)
            for a, b in zip(torch.load(Path(tmp) / "straight" / f"params.rank{r}.pt"),
                            torch.load(Path(tmp) / "faulty" / f"params.rank{r}.pt"), strict=True)
        )
        checks = json.loads((Path(tmp) / "faulty" / "summary.json").read_text())[
            "lockstep_checks"]
    result = {
        "steps": args.steps, "kills (step, rank)": list(zip(kills, ranks, strict=True)),
        "restarts": len(resumed), "resumed at": resumed,
        "steps redone": sum(k - 1 - r for k, r in zip(kills, resumed, strict=True)),
        "lockstep checks passed in the last attempt": checks,
        "final parameters bitwise equal to the uninterrupted run": equal,
        "wall s (uninterrupted, with faults)": (round(straight_s, 1), round(faulty_s, 1)),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
