"""HSDP + torch Adam against HSDP + the family on emulated hosts (issue 47; root: namespaces).

    sudo .venv/bin/python benchmarks/hsdp_cluster.py [--rate 1gbit] [--dim 1024] [--layers 4]

Two hosts, each a network namespace holding a torchrun node of 2 ranks (benchmarks/emulated.py;
the host's link limited with ``tc tbf``). Every run trains the same MLP (``--layers`` square
layers of ``--dim``), each layer and the root sharded by FSDP2:

    hsdp_adam       native HSDP: fully_shard over a 2-D mesh ("replicate", "shard"), torch Adam
    onebit_adam     fully_shard over mesh["shard"], OneBitAdam over mesh["replicate"]'s group
                    (frozen after --warmup steps); onebit_adam_bf16_errors: its error
                    buffers in bf16 (error_dtype="bfloat16")
    zero_one_adam   the same with ZeroOneAdam, on a schedule that reaches every kind of step
                    in 18 steps (refreshes at 1, 2, 4; 1-bit momenta at 3, 5, 6; then local steps
                    and syncs, the interval reaching 4)
    onebit_lamb     the same with OneBitLamb (frozen after --warmup steps)

Each step is taken between barriers and labelled by what it exchanges (``exact``, ``momentum``,
``local``, ``sync``; torch Adam's all ``exact``); per label: the bytes that left the host's
interface per step (``tx_bytes`` in the namespace's sysfs, read by the host's local rank 0),
the mean step time, and each rank's peak resident memory in the step (``VmHWM`` after a reset
through ``/proc/self/clear_refs``, less the resident size before the model was built), in bytes
per parameter of the whole model; the first step of each label is left out of the time and bytes
(groups made, buffers built). At the end, each host's local rank 0 adds up what its optimizer
holds (``onebit_plugin.core.memory.buffer_bytes``; torch Adam's state tensors), per parameter
of the whole model. A markdown table on stdout, one record appended to
``benchmarks/results/hsdp_cluster.jsonl``. The namespaces are removed afterwards, also on
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

CONFIGS = ("hsdp_adam", "onebit_adam", "onebit_adam_bf16_errors", "zero_one_adam",
           "onebit_lamb")
ZERO_ONE = {"var_freeze_step": 6, "var_update_scaler": 1, "local_step_scaler": 2,
            "local_step_clipper": 4, "total_steps": 18}


def _tx_bytes() -> int | None:
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    path = Path(f"/sys/class/net/{ifname}/statistics/tx_bytes")
    return int(path.read_text()) if ifname and path.exists() else None


def _resident(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from onebit_plugin import OneBitAdam, OneBitLamb, ZeroOneAdam

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, local = dist.get_rank(), int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (dist.get_world_size() // local, local),
                            mesh_dim_names=("replicate", "shard"))
    base = _resident("VmRSS")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.dim, args.dim)
                                  for _ in range(args.layers)])
    params = sum(p.numel() for p in model.parameters())
    on = mesh if args.config == "hsdp_adam" else mesh["shard"]
    for layer in model:
        fully_shard(layer, mesh=on)
    fully_shard(model, mesh=on)
    group = mesh["replicate"].get_group()
    if args.config == "hsdp_adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    elif args.config.startswith("onebit_adam"):
        opt = OneBitAdam(model.parameters(), lr=1e-4, freeze_step=args.warmup,
                         process_group=group, error_dtype="bfloat16"
                         if args.config.endswith("bf16_errors") else "float32")
    elif args.config == "onebit_lamb":
        opt = OneBitLamb(model.parameters(), lr=1e-4, freeze_step=args.warmup,
                         process_group=group)
    else:
        opt = ZeroOneAdam(model.parameters(), lr=1e-4, process_group=group, **ZERO_ONE)
    gen = torch.Generator().manual_seed(1 + rank)
    x, y = torch.randn(16, args.dim, generator=gen), torch.randn(16, args.dim, generator=gen)
    steps = ZERO_ONE["total_steps"] if args.config == "zero_one_adam" else args.warmup + \
        args.steps
    rows = []
    for _ in range(steps):
        kind = getattr(opt, "coming_exchange", "exact")
        Path("/proc/self/clear_refs").write_text("5")
        dist.barrier()
        tx, began = _tx_bytes(), time.perf_counter()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        seconds, after = time.perf_counter() - began, _tx_bytes()
        peak = torch.tensor([float(_resident("VmHWM") - base)])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        rows.append({"kind": kind, "seconds": seconds,
                     "tx": None if tx is None else after - tx,
                     "peak_bytes_per_param": float(peak) / params})
    if hasattr(opt, "shards"):  # the family's own account, each storage once
        from onebit_plugin.core.memory import buffer_bytes
        held = buffer_bytes(opt)
    else:
        tensors = [getattr(v, "_local_tensor", v) for values in opt.state.values()
                 for v in values.values() if torch.is_tensor(v) and v.dim() > 0]
        storages = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
                    for v in tensors}
        held = {"moments": sum(storages.values())}
    if rank % local == 0:
        print("RESULT " + json.dumps({
            "host": rank // local, "rows": rows, "params": params,
            "state_bytes_per_param": sum(held.values()) / params,
            "held_bytes_per_param": {k: v / params for k, v in held.items()}}), flush=True)
    dist.destroy_process_group()


def summarize(hosts: list[dict]) -> dict:
    """Per kind of step: the mean step time, the largest host's tx per step and the largest
    peak, the first step of each kind left out of time and bytes."""
    out = {}
    for kind in dict.fromkeys(r["kind"] for r in hosts[0]["rows"]):
        steps = [i for i, r in enumerate(hosts[0]["rows"]) if r["kind"] == kind]
        measured = steps[1:] or steps
        tx = [max(h["rows"][i]["tx"] for h in hosts) if hosts[0]["rows"][i]["tx"] is not None
              else None for i in measured]
        out[kind] = {
            "steps": len(steps),
            "ms": 1000 * sum(max(h["rows"][i]["seconds"] for h in hosts) for i in measured)
            / len(measured),
            "host_tx_bytes_per_step": None if None in tx else sum(tx) / len(tx),
            "peak_bytes_per_param": max(h["rows"][i]["peak_bytes_per_param"] for h in hosts
                                        for i in steps)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--port", type=int, default=29631)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    from emulated import run_ranks
    from record import append_run, shown

    configs = args.configs.split(",")
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        p.error(f"--configs: unknown {sorted(unknown)}; of {list(CONFIGS)}")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed blocks leave the resident size
    runs = {}
    for config in configs:
        argv = [__file__, "--worker", "--config", config, "--dim", str(args.dim),
                "--layers", str(args.layers), "--warmup", str(args.warmup),
                "--steps", str(args.steps)]
        network, outputs = run_ranks(argv, 2, args.rate, args.port, per_host=2)
        hosts = [json.loads(line[len("RESULT "):]) for out in outputs
                 for line in out.splitlines() if line.startswith("RESULT ")]
        runs[config] = {"network": network, "hosts": hosts, "kinds": summarize(hosts),
                        "state_bytes_per_param": max(h["state_bytes_per_param"] for h in hosts),
                        "params": hosts[0]["params"]}
        print(config, json.dumps(runs[config]["kinds"]),
              json.dumps(hosts[0]["held_bytes_per_param"]), flush=True)
    adam = runs.get("hsdp_adam", {}).get("kinds", {}).get("exact", {})
    lines = [f"{network}; {runs[configs[0]]['params']:,} parameters, 2 hosts x 2 ranks", "",
             "| config | step | steps | host tx per step | vs HSDP + Adam | ms per step | peak "
             "B/param per rank | optimizer's buffers B/param per rank, at the end |",
             "|---|---|---|---|---|---|---|---|"]
    for config, run in runs.items():
        for kind, k in run["kinds"].items():
            tx = k["host_tx_bytes_per_step"]
            ratio = (f"1/{adam['host_tx_bytes_per_step'] / tx:.1f}" if tx and
                     adam.get("host_tx_bytes_per_step") else "-")
            lines.append(f"| {config} | {kind} | {k['steps']} | "
                         f"{'-' if tx is None else f'{tx / 2**20:.3f} MiB'} | {ratio} | "
                         f"{k['ms']:.0f} | {k['peak_bytes_per_param']:.2f} | "
                         f"{run['state_bytes_per_param']:.2f} |")
    table = "\n".join(lines)
    print(table)
    path = append_run("hsdp_cluster", None, {"args": vars(args), "runs": runs, "table": table})
    print(f"appended the run to {shown(path)}")


if __name__ == "__main__":
    main()
