"""What one optimizer step costs on the CPU, side by side: torch's Adam (foreach) and OneBitAdam
in the compression stage, on the communication-bound cluster workload's GPT. One process, whose
OneBitAdam is given the 1-bit communicator of rank 0 of W ranks (a single process otherwise
averages exactly): its step folds the gradients inside the worker pass, runs the server pass
and the decode, and updates the parameters, everything a rank does but the collectives, whose
all-to-alls are replaced by a local copy (the rows it would receive from the others are its
own: other numbers, the same work). W = 1 is an upper bound: its server pass keeps an error for
every value; with W ranks a rank decodes as many values (1/W of them from each of W senders)
but keeps the error of 1/W.

    .venv/bin/python benchmarks/step_cost.py [--dim 256] [--layers 8] [--threads 1] [--world 4]

Issue 10 asks that the compression-stage step cost no more than torch Adam's. The same
gradients every step (random, fixed); ``--repeat`` steps each, the three optimizers taking
turns. Run it once as is and
once with ``ONEBIT_CPU_KERNEL=0`` to see the torch passes (the update's and the compression's).
Each run appends one record to ``benchmarks/results/step_cost.jsonl`` (benchmarks/record.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from charlm import CharGPT  # noqa: E402
from record import append_run, shown  # noqa: E402 - benchmarks/record.py

from onebit_plugin import OneBitAdam  # noqa: E402
from onebit_plugin.comm.allreduce import OneBitAllreduce  # noqa: E402
from onebit_plugin.kernels import cpu  # noqa: E402


class RankOf(OneBitAllreduce):
    """Rank 0 of ``world`` ranks, alone: its passes at their sizes, each all-to-all a copy."""

    def __init__(self, world: int):
        super().__init__(None)
        self.world_size, self.rank = world, 0

    def _exchange(self, w, what: str) -> None:
        w.recv_rows.copy_(w.send_rows)


def interleaved_ms(fns: dict, repeat: int) -> dict:
    """Each function timed ``repeat`` times, taking turns (this VM's speed drifts by a quarter
    within a minute: timed one after the other, Adam's step alone measured 19-26 ms in three
    runs of 2026-12-01); per function the best and the median, in ms."""
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: (min(t), sorted(t)[len(t) // 2]) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--world", type=int, default=4, help="W of the 1-bit rows besides W = 1")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    params = list(CharGPT(dim=args.dim, layers=args.layers, context=32).parameters())
    gen = torch.Generator().manual_seed(1)
    for q in params:
        q.grad = torch.randn(q.shape, generator=gen) * 1e-3
    # Three optimizers over the same parameters (lr 1e-6: they barely move), each with its
    # own state, each past its first step.
    adam = torch.optim.Adam(params, lr=1e-6)
    exact = OneBitAdam(params, lr=1e-6, freeze_step=2)
    onebit = OneBitAdam(params, lr=1e-6, freeze_step=2)
    onebit._comm = OneBitAllreduce(None)  # what W ranks would run; nothing to send with one
    rank = OneBitAdam(params, lr=1e-6, freeze_step=2)
    rank._comm = RankOf(args.world)
    opts = {"adam": adam, "exact": exact, "onebit": onebit, "rank": rank}
    for opt in opts.values():
        for _ in range(4):
            opt.step()
    assert exact.stage == onebit.stage == rank.stage == "compression"
    ms = interleaved_ms({name: opt.step for name, opt in opts.items()}, args.repeat)
    n = sum(q.numel() for q in params)
    print(f"{n:,} parameters in {len(params)} tensors, {args.threads} thread(s), C passes "
          f"{'on' if cpu.library() is not None else 'off'}, {args.repeat} steps each, taking "
          "turns; best / median")
    (a_best, a_med), (e_best, e_med) = ms["adam"], ms["exact"]
    print(f"torch Adam step (foreach):                     {a_best:6.1f} / {a_med:6.1f} ms")
    print(f"OneBitAdam, compression stage, exact average:  {e_best:6.1f} / {e_med:6.1f} ms "
          "(fold, update)")
    keys = {"adam": "adam", "exact": "exact", "onebit": "onebit_w1", "rank": f"rank_w{args.world}"}
    vs_adam = {}
    for name, world in (("onebit", 1), ("rank", args.world)):
        best, med = ms[name]
        vs_adam[keys[name]] = {"best": best / a_best, "median": med / a_med}
        print(f"OneBitAdam, compression stage, 1-bit (W = {world}):  {best:6.1f} / {med:6.1f} ms "
              f"({best / a_best:.2f}x / {med / a_med:.2f}x Adam's; fold in the worker pass, "
              "server pass, decode in the update)")
    out = append_run("step_cost", None, {
        "parameters": n, "tensors": len(params), "threads": args.threads,
        "c_passes": cpu.library() is not None, "repeat": args.repeat, "world": args.world,
        "dim": args.dim, "layers": args.layers,
        "ms": {keys[name]: {"best": best, "median": med} for name, (best, med) in ms.items()},
        "vs_adam": vs_adam})
    print(f"appended the run to {shown(out)}")


if __name__ == "__main__":
    main()
