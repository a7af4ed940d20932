"""One level against two on emulated hosts of several ranks (issue 46; root: network namespaces).

    sudo .venv/bin/python benchmarks/topology_cluster.py [--rates 1gbit,100mbit] [--dim 1024]

Two hosts, each a network namespace holding a torchrun node of ``L`` ranks (their traffic to
each other stays inside the namespace; what leaves it crosses the host's veth link, limited with
``tc tbf``; benchmarks/emulated.py). Every run trains the same MLP (``--layers`` square layers
of ``--dim``) with ``OneBitAdam`` under DDP and the 1-bit hook, ``--warmup`` warm-up steps and
``--steps`` compression-stage steps, for each layout and topology:

    2x2 flat, 2x2 hierarchical   two hosts of two ranks: every rank across the network, or
                                 exact inside the host and 1-bit across by local rank
    2x1 flat, 2x1 auto           two hosts of one rank: ``"auto"`` must choose flat, at no cost

Bytes are counted at each host's interface (its ``tx_bytes`` in the namespace's sysfs, read by
the host's local rank 0 between barriers), not by the package: per step of each stage, the
first step of each stage (groups made, buffers built) left out. Step times are the mean over
the stage's measured steps, between barriers. A markdown table on stdout, one record appended to
``benchmarks/results/topology_cluster.jsonl``. The namespaces are removed afterwards, also on
failure. Without root it says so and runs over loopback, where nothing is limited or counted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

LAYOUTS = {"2x2_flat": (2, "flat"), "2x2_hierarchical": (2, "hierarchical"),
           "2x1_flat": (1, "flat"), "2x1_auto": (1, "auto")}


def _tx_bytes() -> int | None:
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    path = Path(f"/sys/class/net/{ifname}/statistics/tx_bytes")
    return int(path.read_text()) if ifname and path.exists() else None


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from onebit_plugin import OneBitAdam, register_onebit_hook

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.dim, args.dim)
                                  for _ in range(args.layers)])
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    opt = OneBitAdam(ddp.parameters(), lr=1e-4, freeze_step=args.warmup,
                     topology=args.topology, warmup_bits=args.bits)
    register_onebit_hook(ddp, opt)
    gen = torch.Generator().manual_seed(1 + rank)
    x, y = torch.randn(16, args.dim, generator=gen), torch.randn(16, args.dim, generator=gen)

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()

    stages = {}
    for stage, count in (("warmup", args.warmup), ("compression", args.steps + 1)):
        step()  # the stage's first step (groups made, buffers built) is not measured
        dist.barrier()
        tx, began = _tx_bytes(), time.perf_counter()
        for _ in range(count - 1):
            step()
        dist.barrier()
        seconds = (time.perf_counter() - began) / (count - 1)
        after = _tx_bytes()
        stages[stage] = {"seconds_per_step": seconds,
                         "host_tx_bytes_per_step": None if tx is None else
                         (after - tx) / (count - 1)}
    if local_rank == 0:
        print("RESULT " + json.dumps({"host": rank // int(os.environ["LOCAL_WORLD_SIZE"]),
                                      "topology": opt.topology.describe(),
                                      "stages": stages, "params": sum(
                                          p.numel() for p in model.parameters())}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="1gbit,100mbit")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--bits", type=int, default=32, help="warmup_bits")
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--topology", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    from emulated import run_ranks
    from record import append_run, shown

    unknown = set(args.layouts.split(",")) - set(LAYOUTS)
    if unknown:
        p.error(f"--layouts: unknown {sorted(unknown)}; one of {sorted(LAYOUTS)}")
    rows = []
    for rate in args.rates.split(","):
        for name in args.layouts.split(","):
            per_host, topology = LAYOUTS[name]
            argv = [__file__, "--worker", "--topology", topology, "--dim", str(args.dim),
                    "--layers", str(args.layers), "--warmup", str(args.warmup),
                    "--steps", str(args.steps), "--bits", str(args.bits)]
            network, outputs = run_ranks(argv, 2, rate, args.port, per_host=per_host)
            hosts = [json.loads(line[len("RESULT "):]) for out in outputs
                     for line in out.splitlines() if line.startswith("RESULT ")]
            row = {"rate": rate, "layout": name, "network": network, "hosts": hosts}
            rows.append(row)
            for stage in ("warmup", "compression"):
                tx = [h["stages"][stage]["host_tx_bytes_per_step"] for h in hosts]
                secs = max(h["stages"][stage]["seconds_per_step"] for h in hosts)
                row[stage] = {"host_tx_bytes_per_step": tx, "seconds_per_step": secs}
            said = []
            for stage in ("warmup", "compression"):
                mib = [None if t is None else round(t / 2**20, 3)
                       for t in row[stage]["host_tx_bytes_per_step"]]
                said.append(f"{stage} {row[stage]['seconds_per_step'] * 1000:.0f} ms/step, "
                            f"host tx {mib} MiB/step")
            print(f"{rate} {name} ({hosts[0]['topology']}): " + ", ".join(said), flush=True)
    lines = ["| rate | layout | chosen | warm-up: host tx per step | ms | compression: host tx "
             "per step | ms |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = []
        for stage in ("warmup", "compression"):
            tx = row[stage]["host_tx_bytes_per_step"]
            cells += ["-" if None in tx else f"{max(tx) / 2**20:.3f} MiB",
                      f"{row[stage]['seconds_per_step'] * 1000:.0f}"]
        lines.append(f"| {row['rate']} | {row['layout']} | {row['hosts'][0]['topology']} | "
                     + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    path = append_run("topology_cluster", None, {"args": vars(args), "rows": rows,
                                                 "table": table})
    print(f"appended the run to {shown(path)}")


if __name__ == "__main__":
    main()
