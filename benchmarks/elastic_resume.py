"""What an elastic restart costs: a 1-bit Adam run of 2 gloo ranks, checkpointed in the middle
of its compression stage, resumed on 1 and on 4 ranks (the error feedback restarts from zero:
no rank's error buffers map onto another world size), against the same run uninterrupted.

For each workload of ``benchmarks/fidelity.py`` and seed, OneBitAdam with its defaults
(``freeze_step="auto"``, the DDP hook), 240 steps at the workload's global batch:

* ``uninterrupted``: 2 ranks, start to end; every rank's optimizer and model state saved after
  ``--resume-at`` (default step 120, well after the freeze);
* ``2->1``, ``2->4``: that state loaded on 1 or 4 ranks (per-rank batch scaled so that the
  global batch stays the same), on to the end;
* ``2->2``: each rank's own state on 2 ranks, errors and all: bit for bit the uninterrupted
  run but for the batches (below), so the noise to read the others against;
* ``2->2, errors restarted``: rank 0's state on 2 ranks with the error feedback restarted
  anyway (the saved world size is edited in the state, the only way to ask for it), which
  separates the restart's cost from the change in how the batch is split.

Resumed ranks draw fresh batches (a stream of their own), as a restarted job would. Final
validation loss and the largest |parameter| against the uninterrupted run's. Appends a record to
``benchmarks/results/elastic_resume.jsonl``.

    .venv/bin/python benchmarks/elastic_resume.py   # about 10 minutes on 2 cores, word_embed
"""

from __future__ import annotations

import argparse
import copy
import io
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity import (  # noqa: E402 - benchmarks/fidelity.py
    STEPS,
    WORKLOADS,
    largest_abs,
    report,
    spawn_ranks,
)
from record import append_run, shown  # noqa: E402 - benchmarks/record.py

VARIANTS = {"uninterrupted": 2, "2->2": 2, "2->1": 1, "2->4": 4, "2->2, errors restarted": 2}


def _rank(rank, world, port, workload, seed, resume_at, saved, queue):
    try:
        from onebit_plugin import OneBitAdam, check_lockstep, register_onebit_hook

        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        work = WORKLOADS[workload]()
        global_batch = 2 * work.batch
        work.batch = global_batch // world
        torch.manual_seed(seed)
        model = work.model()
        if isinstance(saved, list):  # every rank its own
            saved = saved[rank]
        if saved is not None:
            model.load_state_dict(saved["model"])
        ddp = DDP(model)
        opt = OneBitAdam(ddp.parameters(), lr=work.lr, total_steps=STEPS,
                         max_skipped_steps=STEPS + 1, freeze_step="auto")
        register_onebit_hook(ddp, opt)
        first = 1
        if saved is not None:
            opt.load_state_dict(copy.deepcopy(saved["opt"]))
            first = resume_at + 1
        # Resumed ranks draw a stream of their own, as a restarted job would.
        gen = torch.Generator().manual_seed(1000 * seed + rank + (500 if saved else 0))
        state = None
        for step in range(first, STEPS + 1):
            opt.zero_grad()
            work.loss(ddp, work.batch_of(gen)).backward()
            opt.step()
            if step == resume_at and saved is None:
                buffer = io.BytesIO()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
                state = buffer.getvalue()
        check_lockstep(model.parameters(), opt)
        report(queue, rank, {"val_loss": work.val_loss(model), "switch_step": opt.switch_step,
                             "max_abs": largest_abs(model), "state": state})
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put((rank, repr(exc).encode()))


def run(workload, seed, world, resume_at, saved=None) -> list[dict]:
    return spawn_ranks(_rank, world, (workload, seed, resume_at, saved),
                       f"{workload}/seed {seed}/{world} ranks", timeout=900)


def summarize(rows: list[dict]) -> str:
    lines = ["| workload | resumed | val loss vs uninterrupted (mean, min..max over seeds) | "
             "largest per-tensor max abs vs uninterrupted |", "|---|---|---|---|"]
    for workload in WORKLOADS:
        whole = {r["seed"]: r for r in rows
                 if r["workload"] == workload and r["variant"] == "uninterrupted"}
        for variant in list(VARIANTS)[1:]:
            mine = [r for r in rows if r["workload"] == workload and r["variant"] == variant]
            if not mine or not whole:
                continue
            rel = [r["val_loss"] / whole[r["seed"]]["val_loss"] - 1 for r in mine]
            mag = max(r["max_abs"][k] / whole[r["seed"]]["max_abs"][k]
                      for r in mine for k in r["max_abs"])
            lines.append(f"| {workload} | {variant} | {statistics.mean(rel):+.2%} "
                         f"({min(rel):+.2%}..{max(rel):+.2%}) | {mag:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--workloads", default="word_embed")
    p.add_argument("--resume-at", type=int, default=120)
    args = p.parse_args()
    rows, began = [], time.perf_counter()
    for workload in args.workloads.split(","):
        for seed in range(args.seeds):
            ranks = run(workload, seed, 2, args.resume_at)
            states = [torch.load(io.BytesIO(r.pop("state")), weights_only=True) for r in ranks]
            whole, saved = ranks[0], states[0]
            if saved["opt"]["onebit"]["switch_step"] is None:
                raise SystemExit(f"step {args.resume_at} is in the warm-up of {workload}: "
                                 "nothing to restart; pass a later --resume-at")
            for variant, world in VARIANTS.items():
                if variant == "uninterrupted":
                    r = whole
                else:
                    state = states if variant == "2->2" else saved
                    if variant.endswith("restarted"):
                        state = copy.deepcopy(saved)
                        state["opt"]["onebit"]["world_size"] = 3  # asks for the restart
                    r = run(workload, seed, world, args.resume_at, state)[0]
                r.pop("state", None)
                r.update(workload=workload, variant=variant, seed=seed, world=world)
                rows.append(r)
                print(f"{workload:10s} {variant:24s} seed {seed}: val {r['val_loss']:.4f} "
                      f"(frozen after {r['switch_step']})", flush=True)
    table = summarize(rows)
    print(table)
    record = shown(append_run("elastic_resume", None, {"rows": rows, "table": table,
                                                       "resume_at": args.resume_at}))
    print(f"{time.perf_counter() - began:.0f} s; {record}")


if __name__ == "__main__":
    main()
