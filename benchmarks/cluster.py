"""Side-by-side training on an emulated bandwidth-limited cluster (root: network namespaces).

    sudo .venv/bin/python benchmarks/cluster.py [--hosts 4] [--rate 1gbit] [--workload comm]

Builds N hosts as network namespaces on one bridge, each link limited with ``tc tbf`` (and
optionally delayed with ``netem``), starts one torchrun node per host (multi-node rendezvous
over the hosts' addresses) and trains the same GPT, data, seed and steps with each
configuration in turn:

    adam              DDP + torch.optim.Adam (the baseline)
    fp16              DDP + fp16_compress_hook + Adam
    powersgd1/4       DDP + PowerSGD (rank 1 / 4, warm-up of the same length) + Adam
    onebit_hook       DDP + OneBitAdam's comm hook (what the Lightning strategy registers)
    onebit_hook_sync  the same with overlap=False (compression in optimizer.step())
    onebit_lightning  Trainer(strategy="onebit_adam", num_nodes=N)
    onebit_plain      OneBitAdam on plain torch.distributed, no DDP
    zero_one_hook     DDP + ZeroOneAdam's hook (0/1 Adam; refreshes to step 48, then local
                      steps, the interval doubling every 10 steps up to 16; only with --configs)
    lightning_adam    Trainer(strategy="ddp") + torch.optim.Adam: the Lightning strategy's own
                      baseline, Lightning's loop included (only with --configs)
    onebit_hook_w8,   onebit_hook and zero_one_hook with warmup_bits=8: their full-precision
    zero_one_hook_w8  steps sent as blockwise int8 (only with --configs)

Without root (or without ``ip``) it says so and runs all ranks over loopback instead. Results:
a markdown table on stdout, one record appended to ``benchmarks/results/cluster.jsonl``
(benchmarks/record.py: date, commit, machine, versions, command; every configuration's record,
the table) and plots ``docs/cluster_<workload>_loss.png`` / ``_bytes.png`` (docs/benchmarks.md
shows them; a run with ``--tag``, an experiment, leaves them alone and puts its plots in the
temporary folder). The namespaces are removed afterwards, also on failure.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from record import append_run, shown  # noqa: E402 - benchmarks/record.py

from tests import netns  # noqa: E402

WORKER = ROOT / "benchmarks" / "cluster_worker.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
ALL = ("adam", "fp16", "powersgd1", "powersgd4", "onebit_hook", "onebit_hook_sync",
       "onebit_lightning", "onebit_plain")
EXTRA = ("lightning_adam", "zero_one_hook", "onebit_hook_w8", "zero_one_hook_w8")
# comm: ~6.5M parameters and a small per-rank batch, so that an fp32 allreduce at 1 Gbit/s
# costs several times the compute; compute: a 137K-parameter model where it does not.
WORKLOADS = {
    "comm": ["--dim", "256", "--layers", "8", "--batch", "2", "--context", "32"],
    "compute": ["--dim", "64", "--layers", "2", "--batch", "16", "--context", "64"],
}


def run_config(config, hosts, args, out: Path) -> dict:
    common = [str(WORKER), "--config", config, "--steps", str(args.steps),
              "--freeze-step", str(args.freeze_step), "--eval-every", str(args.eval_every),
              "--out", str(out), *WORKLOADS[args.workload]]
    port = str(29600 + (ALL + EXTRA).index(config))
    if hosts is None:
        cmd = [str(TORCHRUN), "--nproc_per_node", str(args.hosts), "--master_port", port,
               *common, "--iface", "lo"]
        procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)]
    else:
        procs = []
        for rank, host in enumerate(hosts):
            cmd = ["env", f"GLOO_SOCKET_IFNAME={host.ifname}", "OMP_NUM_THREADS=1",
                   str(TORCHRUN), "--nnodes", str(len(hosts)), "--nproc_per_node", "1",
                   "--node_rank", str(rank), "--master_addr", hosts[0].address,
                   "--master_port", port, *common, "--iface", host.ifname]
            procs.append(subprocess.Popen(host.command(cmd), cwd=ROOT, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{config} failed:\n" + "\n".join(log[-3000:] for log in logs))
    record = json.loads(out.read_text())
    if hosts is None:  # loopback carries every rank's traffic: per rank, divide
        record["bytes_per_step"] = {k: v / args.hosts for k, v in
                                    record["bytes_per_step"].items()}
        record["total_bytes"] /= args.hosts
    return record


STAGES = {"to_servers": "first all-to-all (signs to the servers)",
          "from_servers": "second all-to-all (the servers' chunks back)"}


def merge_rounds(runs: list[dict]) -> dict:
    """One record from the rounds of one configuration: the first round's record (its losses
    and bytes; every round trains the same numbers), with each stage's step time, the phases
    the calibration C and M and the compression work and waiting as medians over the rounds,
    and every round's step times, C and M kept in ``rounds_step_s``,
    ``rounds_compute_only_step_s`` and ``rounds_fp32_allreduce_s``."""
    def median(values):
        values = sorted(values)
        return values[len(values) // 2] if len(values) % 2 else sum(
            values[len(values) // 2 - 1:len(values) // 2 + 1]) / 2

    merged = dict(runs[0])
    merged["rounds_step_s"] = [r["mean_step_s"] for r in runs]
    merged["rounds_compute_only_step_s"] = [r["compute_only_step_s"] for r in runs]
    merged["rounds_fp32_allreduce_s"] = [r["fp32_allreduce_s"] for r in runs]
    for key in ("mean_step_s", "median_step_s", "first_step_s"):
        if key in runs[0]:
            merged[key] = {stage: median([r[key][stage] for r in runs]) for stage in runs[0][key]}
    merged["mean_phase_s"] = {
        stage: {name: median([r["mean_phase_s"][stage][name] for r in runs]) for name in phases}
        for stage, phases in runs[0].get("mean_phase_s", {}).items()}
    for key in ("compute_only_step_s", "fp32_allreduce_s", "compression_busy_s",
                "compression_wait_s"):
        merged[key] = median([r[key] for r in runs])
    if runs[0].get("all_to_all_arrival_spread_ms"):
        merged["all_to_all_arrival_spread_ms"] = {
            stage: {key: median([r["all_to_all_arrival_spread_ms"][stage][key] for r in runs])
                    for key in figures}
            for stage, figures in runs[0]["all_to_all_arrival_spread_ms"].items()}
    return merged


def time_to_target(curve, target: float) -> float | None:
    for _, seconds, loss in curve:
        if loss <= target:
            return seconds
    return None


def calibration(records: dict) -> tuple[float, float, list[float], list[float]]:
    """C and M as the medians over every run's calibration (each configuration's run, each
    round, measures both the same way before it trains), with all the values: one run's alone
    moved the bound by 0.3x (C 151-233 ms, M 325-465 ms in runs of 2026-11-30/12-01)."""
    cs = sorted(v for r in records.values()
                for v in r.get("rounds_compute_only_step_s", [r["compute_only_step_s"]]))
    ms = sorted(v for r in records.values()
                for v in r.get("rounds_fp32_allreduce_s", [r["fp32_allreduce_s"]]))

    def median(values):
        n = len(values)
        return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2

    return median(cs), median(ms), cs, ms


def report(records: dict, args, network: str) -> str:
    base = records["adam"]
    target = base["final_val_loss"] * 1.01
    c, m, cs, ms = calibration(records)
    bound = (c + m) / (c + m / 32)
    lines = [
        f"workload `{args.workload}`: {base['parameters']:,} parameters, {args.hosts} hosts, "
        f"{network}; {args.steps} steps, warm-up {args.freeze_step}; compute-only step "
        f"C = {c * 1e3:.1f} ms ({cs[0] * 1e3:.0f}-{cs[-1] * 1e3:.0f}), fp32 allreduce of all "
        f"gradients M = {m * 1e3:.1f} ms ({ms[0] * 1e3:.0f}-{ms[-1] * 1e3:.0f}): medians "
        f"(and ranges) over the {len(cs)} runs' calibrations; "
        f"1-bit bound (C+M)/(C+M/32) = {(c + m) / (c + m / 32):.2f}x; target validation "
        f"loss {target:.4f} (Adam's final + 1%)",
        "",
        "| run | step ms warm-up | step ms compression | speed-up (Adam's compression-stage "
        "step / this one) | of the bound | "
        "bytes/step warm-up | bytes/step compression | Adam's total bytes / run's | "
        "time to target s (- : not reached) | final val loss | vs Adam |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    # Adam's steps of the same window as the compression stage: its warm-up holds its first
    # step (state made, DDP's buckets rebuilt: 570 against 950 ms in one run of 2026-12-01).
    base_step = base["mean_step_s"]["compression"]
    for name, r in records.items():
        steps = r["mean_step_s"]
        warm = steps.get("warmup")
        comp = steps.get("compression")
        speed = base_step / comp if comp else None
        bps = r["bytes_per_step"]
        ttt = time_to_target(r["curve"], target)

        def fmt(value, spec):
            return "-" if value is None else format(value, spec)

        lines.append(
            f"| {name} | {fmt(warm and warm * 1e3, '.0f')} | {fmt(comp and comp * 1e3, '.0f')} "
            f"| {fmt(speed, '.2f')}x | "
            f"{'-' if name == 'adam' else fmt(speed and speed / bound * 100, '.0f') + '%'} | "
            f"{fmt(bps.get('warmup'), ',.0f')} | "
            f"{fmt(bps.get('compression'), ',.0f')} | "
            f"{base['total_bytes'] / r['total_bytes']:.2f}x | {fmt(ttt, '.1f')} | "
            f"{r['final_val_loss']:.4f} | "
            f"{(r['final_val_loss'] / base['final_val_loss'] - 1) * 100:+.2f}% |"
        )
    # The whole run against the compute-only bound: every step at C, nothing on the wire (the
    # training time alone, evaluations off the clock, as each run's own `train_time_s`).
    lines += ["", f"Whole run (training time, evaluations off the clock) against the "
                  f"compute-only bound, {args.steps} steps x C = {args.steps * c:.1f} s:", ""]
    lines += [f"- {name}: {r['train_time_s']:.1f} s, {r['train_time_s'] / (args.steps * c):.2f}x "
              "the bound" for name, r in records.items()]
    if "lightning_adam" in records and "onebit_lightning" in records:
        own, mine = (records[k]["mean_step_s"] for k in ("lightning_adam", "onebit_lightning"))
        lines += ["", "The Lightning strategy against Lightning's own DDP + Adam "
                      "(`strategy=\"ddp\"`: the same loop; its DDP without "
                      "gradient_as_bucket_view, the strategy's with): warm-up "
                      f"{(mine['warmup'] / own['warmup'] - 1) * 100:+.1f}%, compression-stage "
                      f"step {own['compression'] / mine['compression']:.2f}x faster (separate "
                      "runs, mean steps: a few per cent is within their drift; "
                      "benchmarks/paired_steps.py interleaves the other paths)"]
    if len(base.get("rounds_step_s", [])) > 1:
        lines += ["", f"Step times are medians over {len(base['rounds_step_s'])} rounds "
                      "(configurations round-robin); each round's warm-up / compression ms:", ""]
        for name, r in records.items():
            lines.append(f"- {name}: " + ", ".join(
                " / ".join(f"{s[k] * 1e3:.0f}" for k in ("warmup", "compression") if k in s)
                for s in r["rounds_step_s"]))
    if all("median_step_s" in r for r in records.values()):
        lines += ["", "Compression-stage step, rank 0, ms: mean (as above) / median / the first "
                      "(the freeze builds the momentum units in it):", ""]
        lines += [f"- {name}: " + " / ".join(
                      f"{r[key]['compression'] * 1e3:.0f}"
                      for key in ("mean_step_s", "median_step_s", "first_step_s"))
                  for name, r in records.items() if "compression" in r["mean_step_s"]]
    for name, r in records.items():
        if r.get("kinds"):
            lines += ["", f"{name}, per kind of step (rank 0): median step ms / bytes per step "
                          "on the link / steps", ""]
            lines += [f"- {kind}: {k['median_step_s'] * 1e3:.0f} / {k['bytes_per_step']:,.0f} / "
                      f"{k['steps']}" for kind, k in r["kinds"].items()]
    lines += ["", "Where a compression-stage step goes (rank 0, ms): forward+backward (DDP's own "
              "allreduce included) / optimizer step / per compressed allreduce: compression "
              "work / waiting on its collectives (calls per step)", ""]
    for name, r in records.items():
        phases = r.get("mean_phase_s", {}).get("compression")
        calls = r.get("compression_calls") or 0
        if not phases:
            continue
        per_call = (f"{r['compression_busy_s'] / calls * 1e3:.1f} / "
                    f"{r['compression_wait_s'] / calls * 1e3:.1f}") if calls else "-"
        spread = r.get("all_to_all_arrival_spread_ms")
        lines.append(f"- {name}: {phases['forward_backward'] * 1e3:.1f} / "
                     f"{phases['optimizer_step'] * 1e3:.1f} / {per_call}"
                     + (f" ({calls / (r['steps'] - r['freeze_step']):.0f} per step)"
                        if calls else "")
                     + ("".join(
                         f"; the ranks entered the {STAGES[stage]} "
                         f"{s['median']:.1f} ms apart (median; p90 {s['p90']:.1f}), rank 0 "
                         f"waited {s['rank0_mean_wait_for_last']:.1f} ms for the last"
                         for stage, s in spread.items()) if spread else ""))
    return "\n".join(lines)


def plot(records: dict, workload: str, out_dir: Path, tag: str = "") -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install -e '.[bench]')")
        return []
    out_dir.mkdir(exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in records.items():
        ax.plot([t for _, t, _ in r["curve"]], [loss for _, _, loss in r["curve"]], label=name)
    ax.set_xlabel("training wall-clock (s)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{workload}: validation loss against training time")
    ax.legend()
    loss_path = out_dir / f"cluster_{workload}{tag}_loss.png"
    fig.tight_layout()
    fig.savefig(loss_path, dpi=110)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(records)
    for i, stage in enumerate(("warmup", "compression")):
        values = [records[n]["bytes_per_step"].get(stage, 0) / 2**20 for n in names]
        ax.bar([x + 0.4 * i for x in range(len(names))], values, width=0.4, label=stage)
    ax.set_xticks([x + 0.2 for x in range(len(names))], names, rotation=30, ha="right")
    ax.set_ylabel("MiB sent per host per step (interface counters)")
    ax.set_yscale("log")
    ax.set_title(f"{workload}: bytes on the wire per step")
    ax.legend()
    bytes_path = out_dir / f"cluster_{workload}{tag}_bytes.png"
    fig.tight_layout()
    fig.savefig(bytes_path, dpi=110)
    return [loss_path, bytes_path]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of each host's link")
    p.add_argument("--delay", default=None, help="netem delay per link, e.g. 1ms")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="comm")
    p.add_argument("--configs", default=",".join(ALL))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--freeze-step", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--tag", default="",
                   help="a label for the run, kept in its record (benchmarks/results/"
                        "cluster.jsonl); a tagged run leaves docs/'s plots alone")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the configurations round-robin this many times; step times are "
                        "the median over the rounds (this VM's speed drifts by 10-20%% between "
                        "runs of identical code)")
    args = p.parse_args()
    configs = args.configs.split(",")
    unknown = set(configs) - set(ALL) - set(EXTRA)
    if unknown:
        p.error(f"--configs: unknown {sorted(unknown)}; known: {', '.join(ALL + EXTRA)}")
    if configs[0] != "adam":
        configs.insert(0, "adam") if "adam" not in configs else None
    # Each configuration's rank 0 writes its record here; they are merged into one run record.
    scratch = Path(tempfile.mkdtemp(prefix=f"onebit-cluster-{args.workload}-"))
    try:
        run_and_record(args, configs, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_and_record(args, configs: list[str], scratch: Path) -> None:
    reason = netns.available()
    started = time.time()
    rounds: dict[str, list[dict]] = {config: [] for config in configs}

    def run_all(hosts) -> None:
        for round_ in range(args.repeats):
            for config in configs:
                rounds[config].append(run_config(
                    config, hosts, args, scratch / f"_{args.workload}_{config}.json"))
                print(f"{config} (round {round_ + 1}): done after {time.time() - started:.0f} s",
                      flush=True)

    if reason is None:
        network = f"{args.rate} per host link (tc tbf)" + (
            f", {args.delay} netem delay" if args.delay else "")
        with netns.emulated_hosts(args.hosts, rate=args.rate, delay=args.delay) as hosts:
            run_all(hosts)
    else:
        print(f"no emulated cluster ({reason}): all ranks run over loopback, unlimited")
        network = "loopback (no bandwidth limit: not root)"
        run_all(None)
    records = {config: merge_rounds(runs) for config, runs in rounds.items()}
    table = report(records, args, network)
    print(table)
    path = append_run("cluster", None, {"args": vars(args), "network": network,
                                        "records": records, "table": table})
    print(f"appended the run to {shown(path)}")
    plot_dir = Path(tempfile.gettempdir()) if args.tag else ROOT / "docs"
    for written in plot(records, args.workload, plot_dir, args.tag):
        print(f"wrote {shown(written)}")
    print(f"total {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
