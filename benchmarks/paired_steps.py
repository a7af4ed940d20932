"""Step times of DDP + Adam and of OneBitAdam's paths, interleaved step by step in one job, so
that the machine's drift between runs hits every path alike.

    sudo .venv/bin/python benchmarks/paired_steps.py [--workload comm] [--hosts 4] [--rate 1gbit]

benchmarks/cluster.py runs one configuration after another; on this 2-core VM the same code's
warm-up step moved from -12% to +16% against DDP + Adam across its runs (docs/benchmarks.md),
so one run there cannot show whether a path is within 3% of Adam. Here every rank of the
emulated hosts (cluster.py's network namespaces, each link limited with ``tc tbf``; over
loopback without root) holds one copy of cluster.py's GPT per path, the same weights:

    adam              DDP + torch.optim.Adam (the baseline)
    onebit_hook       DDP(gradient_as_bucket_view=True) + OneBitAdam's comm hook (what the
                      Lightning and Fabric strategies and the Accelerate integration register)
    onebit_hook_sync  the same with overlap=False
    onebit_plain      OneBitAdam on plain torch.distributed, no DDP

and each iteration takes one training step (zero_grad, forward, backward, step) of every path
on the same batch, in an order drawn afresh each iteration (the same on every rank), with a
barrier before each step. Rank 0 times each step (a rank late into a
collective is waited for inside it). The first ``--freeze-step`` iterations are the warm-up,
the rest the compression stage. For each stage and path: the median step, and the median and
quartiles of the ratio of the step to Adam's in the same iteration, with an interval of that
median (see ``median_interval``: within one job; jobs differ by more, so run it more than once);
left out are the first two iterations (Adam's state made, DDP's buckets rebuilt) and the
first of the compression stage (the units built). The Lightning strategy runs the hook inside
Lightning's loop and cannot be interleaved this way; cluster.py measures it against
``Trainer(strategy="ddp")`` with ``--configs adam,lightning_adam,onebit_lightning``.

Results: a table on stdout and one record appended to ``benchmarks/results/paired_steps.jsonl``
(benchmarks/record.py: date, commit, machine, versions, command; the summary, the table and every
iteration's step times).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from cluster import WORKLOADS  # noqa: E402 - cluster.py's two workloads, one definition
from record import append_run, shown  # noqa: E402 - benchmarks/record.py

PATHS = ("adam", "onebit_hook", "onebit_hook_sync", "onebit_plain")
# For taking a gap apart (--paths): DDP + Adam with the hook paths' gradient_as_bucket_view,
# with torch's own Python allreduce hook (a hook written in Python, as onebit's is), and with
# that hook on bucket views sending on a process group of its own (as onebit's warm-up does:
# its group carries OneBitAdam's comm_timeout).
DIAGNOSTIC = ("adam_views", "adam_pyhook", "adam_pyhook_group")


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    pos = (len(values) - 1) * q
    low = int(pos)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (pos - low)


MIN_ITERATIONS = 40  # per stage: below that the interval below is not a 95% one


def median_interval(values: list[float]) -> tuple[float, float]:
    """The order statistics n/2 -+ 1.96 sqrt(n)/2: a 95% interval of the median (the
    binomial's normal approximation, close for n >= 40) if the iterations were independent.
    They are not quite (the machine's speed drifts within a job too), so it says how well one
    job pins its own median, not how far another job's may lie: compare jobs for that."""
    values = sorted(values)
    n = len(values)
    half = 0.98 * n ** 0.5
    return values[max(0, int(n / 2 - half))], values[min(n - 1, int(n / 2 + half + 0.5))]


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from onebit_plugin import OneBitAdam, register_onebit_hook

    sys.path.insert(0, str(ROOT / "examples"))
    from charlm import CharGPT, load_corpus, loss_fn, sample_batch

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    flags = WORKLOADS[args.workload]
    shape = {flag.lstrip("-"): int(value) for flag, value in zip(flags[::2], flags[1::2],
                                                                 strict=True)}
    train, _ = load_corpus()
    paths = {}
    for name in args.paths:
        torch.manual_seed(0)
        model = CharGPT(dim=shape["dim"], layers=shape["layers"], context=shape["context"])
        if name.startswith("adam"):
            net = DDP(model, gradient_as_bucket_view=name in ("adam_views", "adam_pyhook_group"))
            opt = torch.optim.Adam(net.parameters(), lr=1e-3)
            if name == "adam_pyhook":
                net.register_comm_hook(None, default_hooks.allreduce_hook)
            elif name == "adam_pyhook_group":
                net.register_comm_hook(dist.new_group(), default_hooks.allreduce_hook)
        elif name == "onebit_plain":
            net = model
            opt = OneBitAdam(net.parameters(), lr=1e-3, freeze_step=args.freeze_step)
        else:
            net = DDP(model, gradient_as_bucket_view=True)
            opt = OneBitAdam(net.parameters(), lr=1e-3, freeze_step=args.freeze_step)
            register_onebit_hook(net, opt, overlap=name == "onebit_hook")
        paths[name] = (net, opt)
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    times: dict[str, list[float]] = {name: [] for name in args.paths}
    optimizer_s: dict[str, list[float]] = {name: [] for name in args.paths}  # of those, step()
    # Of those, the interpreter's garbage collections: a collection runs in whichever step
    # crosses its threshold, whoever made the garbage, so it is shown apart.
    gc_s: dict[str, list[float]] = {name: [] for name in args.paths}
    collecting = {"started": 0.0, "seconds": 0.0}

    def on_gc(phase, info):
        if phase == "start":
            collecting["started"] = time.perf_counter()
        else:
            collecting["seconds"] += time.perf_counter() - collecting["started"]

    gc.callbacks.append(on_gc)
    for it in range(args.iterations):
        x, y = sample_batch(train, shape["batch"], shape["context"], gen)
        # A fresh order each iteration, the same on every rank: no path keeps the same
        # predecessor (a rotation would keep it in all but one of every len(paths) iterations).
        order = random.Random(it).sample(args.paths, len(args.paths))
        for name in order:
            net, opt = paths[name]
            dist.barrier()
            collecting["seconds"] = 0.0
            start = time.perf_counter()
            opt.zero_grad()
            loss_fn(net, x, y).backward()
            backward_done = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
            optimizer_s[name].append(time.perf_counter() - backward_done)
            gc_s[name].append(collecting["seconds"])
    gc.callbacks.remove(on_gc)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"step_s": times, "optimizer_step_s": optimizer_s,
                                      "gc_s": gc_s}))
    dist.barrier()
    dist.destroy_process_group()


def summarize(times: dict[str, list[float]], optimizer_s: dict[str, list[float]],
              gc_s: dict[str, list[float]], freeze_step: int) -> dict:
    out = {}
    # Left out: the first two iterations (the first makes Adam's state, DDP rebuilds its
    # buckets in the second) and the first of the compression stage (the units are built).
    stages = {"warmup": range(2, freeze_step),
              "compression": range(freeze_step + 1, len(times["adam"]))}
    for stage, index in stages.items():
        if len(index) < MIN_ITERATIONS:
            continue
        base = [times["adam"][i] for i in index]
        out[stage] = {}
        for name in times:
            mine = [times[name][i] for i in index]
            ratios = [m / b for m, b in zip(mine, base, strict=True)]
            out[stage][name] = {
                "iterations": len(mine),
                "median_step_ms": quantile(mine, 0.5) * 1e3,
                "median_optimizer_step_ms": quantile([optimizer_s[name][i] for i in index],
                                                     0.5) * 1e3,
                "mean_gc_ms": sum(gc_s[name][i] for i in index) / len(index) * 1e3,
                "ratio_to_adam_median": quantile(ratios, 0.5),
                "ratio_to_adam_q1": quantile(ratios, 0.25),
                "ratio_to_adam_q3": quantile(ratios, 0.75),
                "ratio_to_adam_median_95ci": median_interval(ratios),
                "ratio_of_means": sum(mine) / sum(base),
            }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="comm")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of each host's link")
    p.add_argument("--freeze-step", type=int, default=None,
                   help="warm-up iterations, each one step of every path (default: 150 for "
                        "comm, 300 for compute)")
    p.add_argument("--compression-iterations", type=int, default=None,
                   help="iterations after the freeze (default: 50 for comm, 300 for compute)")
    p.add_argument("--paths", default=",".join(PATHS),
                   help=f"comma-separated, adam first; also {', '.join(DIAGNOSTIC)}")
    p.add_argument("--tag", default="",
                   help="a label for the run, kept in its record (benchmarks/results/"
                        "paired_steps.jsonl)")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    comm = args.workload == "comm"
    if args.freeze_step is None:
        args.freeze_step = 150 if comm else 300
    if args.compression_iterations is None:
        args.compression_iterations = 50 if comm else 300
    args.iterations = args.freeze_step + args.compression_iterations
    args.paths = args.paths.split(",")
    unknown = set(args.paths) - set(PATHS) - set(DIAGNOSTIC)
    if unknown or args.paths[0] != "adam" or len(set(args.paths)) != len(args.paths):
        p.error(f"--paths: adam first, then some of {PATHS[1:] + DIAGNOSTIC}, each once; got "
                f"{args.paths}")
    if args.freeze_step < MIN_ITERATIONS + 2 or args.compression_iterations < MIN_ITERATIONS + 1:
        p.error(f"--freeze-step must be at least {MIN_ITERATIONS + 2} and "
                f"--compression-iterations at least {MIN_ITERATIONS + 1}: each stage's "
                f"statistics need {MIN_ITERATIONS} iterations besides its first")
    if args.hosts < 2:
        p.error("--hosts must be at least 2")
    if args.rank:
        return rank_main(args)
    from emulated import run_ranks

    me = [str(Path(__file__).resolve()), "--rank", "--workload", args.workload, "--freeze-step",
          str(args.freeze_step), "--compression-iterations", str(args.compression_iterations),
          "--paths", ",".join(args.paths)]
    started = time.time()
    network, outputs = run_ranks(me, args.hosts, args.rate, port=29650, timeout=1800)
    line = next(x for out in outputs for x in out.splitlines() if x.startswith("RESULT "))
    measured = json.loads(line[len("RESULT "):])
    summary = summarize(measured["step_s"], measured["optimizer_step_s"], measured["gc_s"],
                        args.freeze_step)
    lines = [f"workload `{args.workload}`, {args.hosts} hosts, {network}; {args.iterations} "
             f"iterations, warm-up {args.freeze_step}; every path one step per iteration, "
             "interleaved; rank 0", "",
             "| stage | path | median step ms | of it optimizer.step() | of it garbage "
             "collection (mean) | step / Adam's in the "
             "same iteration: median [its 95% interval within this job] (quartiles) | sum / Adam's "
             "sum |", "|---|---|---|---|---|---|---|"]
    for stage, rows in summary.items():
        for name, r in rows.items():
            lines.append(f"| {stage} | {name} | {r['median_step_ms']:.1f} | "
                         f"{r['median_optimizer_step_ms']:.1f} | {r['mean_gc_ms']:.2f} | "
                         f"{r['ratio_to_adam_median']:.3f} "
                         f"[{r['ratio_to_adam_median_95ci'][0]:.3f}-"
                         f"{r['ratio_to_adam_median_95ci'][1]:.3f}] ({r['ratio_to_adam_q1']:.3f}-"
                         f"{r['ratio_to_adam_q3']:.3f}) | {r['ratio_of_means']:.3f} |")
    table = "\n".join(lines)
    print(table)
    out = append_run("paired_steps", None, {
        "args": {k: v for k, v in vars(args).items() if k != "rank"}, "network": network,
        "summary": summary, "table": table, **measured})
    print(f"appended the run to {shown(out)}; total {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
