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
on the same batch, in an order that rotates by one each iteration (no path always runs after
the same other), with a barrier before each step. Rank 0 times each step. The first
``--freeze-step`` iterations are the warm-up, the rest the compression stage. For each stage
and path: the median step, and the median and quartiles of the ratio of the step to Adam's in
the same iteration; the first iteration of each stage (DDP's bucket rebuild, the freeze's unit
build) is left out. The Lightning strategy runs the hook inside Lightning's loop and cannot be
interleaved this way; cluster.py measures it.

Results: a table on stdout and ``benchmarks/results/paired_<workload><tag>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from cluster import WORKLOADS  # noqa: E402 - cluster.py's two workloads, one definition

PATHS = ("adam", "onebit_hook", "onebit_hook_sync", "onebit_plain")
# For taking a gap apart (--paths): DDP + Adam with the hook paths' gradient_as_bucket_view,
# and with torch's own Python allreduce hook (a hook written in Python, as onebit's is).
DIAGNOSTIC = ("adam_views", "adam_pyhook")


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    pos = (len(values) - 1) * q
    low = int(pos)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (pos - low)


def median_interval(values: list[float]) -> tuple[float, float]:
    """A distribution-free 95% confidence interval of the median: the order statistics
    n/2 -+ 1.96 sqrt(n)/2 (the binomial's normal approximation)."""
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
            net = DDP(model, gradient_as_bucket_view=name == "adam_views")
            opt = torch.optim.Adam(net.parameters(), lr=1e-3)
            if name == "adam_pyhook":
                net.register_comm_hook(None, default_hooks.allreduce_hook)
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
    for it in range(args.iterations):
        x, y = sample_batch(train, shape["batch"], shape["context"], gen)
        turn = it % len(args.paths)
        order = args.paths[turn:] + args.paths[:turn]
        for name in order:
            net, opt = paths[name]
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            loss_fn(net, x, y).backward()
            backward_done = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
            optimizer_s[name].append(time.perf_counter() - backward_done)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"step_s": times, "optimizer_step_s": optimizer_s}))
    dist.barrier()
    dist.destroy_process_group()


def summarize(times: dict[str, list[float]], optimizer_s: dict[str, list[float]],
              freeze_step: int) -> dict:
    out = {}
    stages = {"warmup": range(1, freeze_step),
              "compression": range(freeze_step + 1, len(times["adam"]))}
    for stage, index in stages.items():
        if len(index) < 2:
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
                        "comm, 300 for compute: with the steps' spread here, about 1%% "
                        "standard error of the median ratio)")
    p.add_argument("--compression-iterations", type=int, default=None,
                   help="iterations after the freeze (default: 50 for comm, 300 for compute)")
    p.add_argument("--paths", default=",".join(PATHS),
                   help=f"comma-separated, adam first; also {', '.join(DIAGNOSTIC)}")
    p.add_argument("--tag", default="", help="suffix of the result file name")
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
    if unknown or args.paths[0] != "adam":
        p.error(f"--paths: adam first, then some of {PATHS[1:] + DIAGNOSTIC}; got {args.paths}")
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
    summary = summarize(measured["step_s"], measured["optimizer_step_s"], args.freeze_step)
    lines = [f"workload `{args.workload}`, {args.hosts} hosts, {network}; {args.iterations} "
             f"iterations, warm-up {args.freeze_step}; every path one step per iteration, "
             "interleaved; rank 0", "",
             "| stage | path | median step ms | of it optimizer.step() | step / Adam's in the "
             "same iteration: median [95% interval of the median] (quartiles) | sum / Adam's "
             "sum |", "|---|---|---|---|---|---|"]
    for stage, rows in summary.items():
        for name, r in rows.items():
            lines.append(f"| {stage} | {name} | {r['median_step_ms']:.1f} | "
                         f"{r['median_optimizer_step_ms']:.1f} | "
                         f"{r['ratio_to_adam_median']:.3f} "
                         f"[{r['ratio_to_adam_median_95ci'][0]:.3f}-"
                         f"{r['ratio_to_adam_median_95ci'][1]:.3f}] ({r['ratio_to_adam_q1']:.3f}-"
                         f"{r['ratio_to_adam_q3']:.3f}) | {r['ratio_of_means']:.3f} |")
    table = "\n".join(lines)
    print(table)
    out = ROOT / "benchmarks" / "results" / f"paired_{args.workload}{args.tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "rank"},
                               "network": network, "summary": summary, "table": table,
                               **measured}, indent=1))
    print(f"wrote {out.relative_to(ROOT)}; total {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
