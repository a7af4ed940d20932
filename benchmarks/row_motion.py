"""Where an embedding table's training goes, row by row: each row's distance from its initial
values at the end of a run (the L2 norm of its change), binned by how many steps drew it on
some rank (a hook on the table's weight sees each rank's own gradient), next to the mean of
its denominator (Adam's ``sqrt(v_hat) + eps``; a member's units' ``denom`` once they exist),
for Adam and the members on one workload of ``benchmarks/fidelity.py`` at the same seeds
and batches. Tells a member that trains its rare rows less than Adam from one that takes
smaller steps over a larger variance.

    .venv/bin/python benchmarks/row_motion.py --workload recsys_zipf --steps 2000 \\
        --variants adam,onebit_auto,zero_one

Records go to ``benchmarks/results/row_motion.jsonl``; results in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fidelity  # noqa: E402 - benchmarks/fidelity.py
from record import append_run, shown  # noqa: E402 - benchmarks/record.py
from workloads import WORKLOADS  # noqa: E402 - benchmarks/workloads.py

BINS = (1, 2, 4, 8, 16, 64, 256, 1024)  # lower edges of the draw-count bins


def _denominator(opt, w: torch.Tensor) -> torch.Tensor:
    """``w``'s per-row mean denominator as the optimizer divides by it now."""
    unit_of = getattr(opt, "unit_of", None)
    unit = unit_of(w) if unit_of is not None and opt.switch_step is not None else None
    if unit is not None:
        return unit.view(w, unit.denom).mean(1)
    state, group = opt.state[w], opt.param_groups[0]
    beta2 = group["betas"][1]
    root = (state["exp_avg_sq"] / (1 - beta2 ** float(state["step"]))).sqrt()
    return (root + group["eps"]).mean(1)


def _rank(rank, world, port, workload, variant, seed, queue):
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        work = WORKLOADS[workload]()
        torch.manual_seed(seed)  # the same initial weights on every rank
        model = work.model()
        ddp = DDP(model)
        opt = fidelity._optimizer(variant, ddp, work.lr)
        tables = {}
        for name, module in model.named_modules():
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
                w = module.weight
                drawn = torch.zeros(w.shape[0])

                def note(grad, drawn=drawn):
                    drawn.add_(grad.reshape(grad.shape[0], -1).ne(0).any(1).float())

                w.register_hook(note)
                tables[f"{name}.weight"] = (w, w.detach().clone(), drawn)
        gen = torch.Generator().manual_seed(1000 * seed + rank)  # fidelity.py's batches
        for _ in range(fidelity.STEPS):
            batch = work.batch_of(gen)
            opt.zero_grad()
            work.loss(ddp, batch).backward()
            opt.step()
        result = {name: {"drawn": drawn, "moved": (w.detach() - start).norm(dim=1),
                         "denom": _denominator(opt, w)}
                  for name, (w, start, drawn) in tables.items()}
        result["val_loss"] = work.val_loss(model)
        fidelity.report(queue, rank, result)
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put((rank, repr(exc).encode()))


def binned(results: list[dict]) -> dict:
    """Per table and bin: rows, their mean distance moved and mean denominator (rank 0's
    parameters and denominators, which end alike; draws summed over the ranks)."""
    out = {}
    for name in (k for k in results[0] if k != "val_loss"):
        drawn = sum(r[name]["drawn"] for r in results)
        moved, denom = results[0][name]["moved"], results[0][name]["denom"]
        rows = []
        for lo, hi in zip(BINS, (*BINS[1:], float("inf")), strict=True):
            chosen = (drawn >= lo) & (drawn < hi)
            n = int(chosen.sum())
            if n:
                rows.append({"drawn": [lo, hi], "rows": n,
                             "moved": float(moved[chosen].mean()),
                             "denom": float(denom[chosen].mean())})
        out[name] = rows
    return out


def table(runs: dict[str, dict]) -> str:
    """A markdown table per embedding table: a row per bin, each variant's mean distance."""
    variants = list(runs)
    lines = []
    for name in runs[variants[0]]["tables"]:
        lines += [f"\n{name}", "| drawn | rows | " + " | ".join(
            f"{v} moved (denom)" for v in variants) + " |",
            "|---|---|" + "---|" * len(variants)]
        for i, row in enumerate(runs[variants[0]]["tables"][name]):
            lo, hi = row["drawn"]
            cells = [f"{runs[v]['tables'][name][i]['moved']:.3f} "
                     f"({runs[v]['tables'][name][i]['denom']:.2e})" for v in variants]
            span = f"{lo}+" if hi == float("inf") else f"{lo}-{int(hi) - 1}"
            lines.append(f"| {span} | {row['rows']} | " + " | ".join(cells) + " |")
    lines.append("\nval loss: " + ", ".join(f"{v} {runs[v]['val_loss']:.4f}" for v in variants))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="recsys_zipf", choices=sorted(WORKLOADS))
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default="adam,onebit_auto,zero_one",
                   help="fidelity.py's variant names (default %(default)s)")
    args = p.parse_args()
    fidelity.STEPS = args.steps  # the members' total_steps, as fidelity.py sets it
    runs = {}
    for variant in args.variants.split(","):
        results = fidelity.spawn_ranks(_rank, 2, (args.workload, variant, args.seed),
                                       f"{args.workload}/{variant}/seed {args.seed}")
        runs[variant] = {"val_loss": results[0]["val_loss"], "tables": binned(results)}
    print(table(runs))
    path = append_run("row_motion", None, {"workload": args.workload, "steps": args.steps,
                                           "seed": args.seed, "runs": runs})
    print(shown(path))


if __name__ == "__main__":
    main()
