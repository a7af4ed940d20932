"""Soak run: thousands of compression-stage steps, watching memory and cross-rank drift.

    .venv/bin/torchrun --nproc_per_node 2 benchmarks/soak.py --steps 3000 [--path hook|optimizer]

The character-level GPT of examples/charlm.py under DDP with OneBitAdam's comm hook (or without
DDP, ``--path optimizer``). Every ``--check-every`` steps: ``check_lockstep`` (bit fingerprints
of every parameter and the optimizer stage, compared across ranks; raises on any difference)
and each rank's resident memory. Prints a table and the RSS growth after the first check, and
appends one record to ``benchmarks/results/soak.jsonl`` (benchmarks/record.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from onebit_plugin import OneBitAdam, check_lockstep, register_onebit_hook

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from charlm import CharGPT, load_corpus, loss_fn, sample_batch  # noqa: E402
from record import append_run, shown  # noqa: E402 - benchmarks/record.py


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--freeze-step", type=int, default=100)
    p.add_argument("--check-every", type=int, default=250)
    p.add_argument("--path", choices=["hook", "optimizer"], default="hook")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = CharGPT()
    opt_model = DDP(model) if args.path == "hook" else model
    opt = OneBitAdam(opt_model.parameters(), lr=1e-3, freeze_step=args.freeze_step)
    if args.path == "hook":
        register_onebit_hook(opt_model, opt)
    train, _ = load_corpus()
    gen = torch.Generator().manual_seed(rank)
    rows = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = sample_batch(train, 16, 64, gen)
        opt.zero_grad()
        loss = loss_fn(opt_model, x, y)
        loss.backward()
        opt.step()
        if step % args.check_every == 0 or step == args.steps:
            check_lockstep(model.parameters(), opt)  # raises if any rank drifted by one bit
            rss = torch.tensor([rss_mib()])
            every = [torch.zeros(1) for _ in range(world)]
            dist.all_gather(every, rss)
            rows.append((step, opt.stage, loss.item(), [float(r) for r in every],
                         time.perf_counter() - start))
    if rank == 0:
        print(f"path={args.path} world={world} steps={args.steps} freeze={args.freeze_step} "
              f"torch={torch.__version__} pid={os.getpid()}")
        print(f"{'step':>6} {'stage':>12} {'loss':>7}  rss MiB per rank   elapsed s")
        for step, stage, loss, rss, elapsed in rows:
            print(f"{step:6d} {stage:>12} {loss:7.3f}  "
                  f"{' '.join(f'{r:7.1f}' for r in rss)}   {elapsed:8.1f}")
        first = [r for r in rows if r[1] == "compression"][0]
        growth = [b - a for a, b in zip(first[3], rows[-1][3], strict=True)]
        print(f"lockstep checks passed: {len(rows)}; RSS growth from step {first[0]} to "
              f"{rows[-1][0]}: {' '.join(f'{g:+.1f}' for g in growth)} MiB; "
              f"skipped steps {opt.skipped_steps}")
        out = append_run("soak", None, {
            "path": args.path, "world": world, "steps": args.steps,
            "freeze_step": args.freeze_step, "check_every": args.check_every,
            "lockstep_checks_passed": len(rows),
            "checks": [{"step": step, "stage": stage, "loss": loss, "rss_mib": rss,
                        "elapsed_s": elapsed} for step, stage, loss, rss, elapsed in rows],
            "rss_growth_mib": {"from_step": first[0], "to_step": rows[-1][0],
                               "per_rank": growth},
            "skipped_steps": opt.skipped_steps})
        print(f"appended the run to {shown(out)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
