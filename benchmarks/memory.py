"""Peak resident memory per rank, in bytes per parameter: DDP + torch Adam against the 1-bit
family in each of its stages (issue 30), measured from outside the package.

    .venv/bin/python benchmarks/memory.py [--dim 2048] [--layers 6] [--world 2] [--only NAME]
    benchmarks/memory.py --device cuda       # in benchmarks/gpu_check.sh: also the GPU's peak

Each configuration runs in ``--world`` fresh gloo processes: an MLP of ``--layers`` square
layers (6 x 2048: 25.2M parameters), ``DistributedDataParallel(gradient_as_bucket_view=True)``,
the optimizer (the 1-bit members through ``register_onebit_hook``, as the Lightning strategy and
``onebit-run`` use them), a few steps. Before each step a rank resets its peak resident size
(``/proc/self/clear_refs``, 5) and after it reads ``VmHWM`` from ``/proc/self/status``: the peak
of that step (forward, backward, hook, ``step()``) less the resident size before the model was
built (the interpreter, torch and the process group), divided by the parameter count. Steps are
labelled ``warmup``, ``freeze`` (the first compression-stage step, whose ``step()`` builds its
buffers), or what they exchange after it (``optimizer.coming_exchange``: ``momentum``,
``refresh`` for 0/1 Adam's exact steps, ``local``, ``sync``), and each label
keeps its largest figure over the ranks. After the last step of each label the optimizer's own
``onebit_plugin.core.memory.buffer_bytes`` gives the breakdown by buffer (allocated bytes; the peak
is
what was resident). One record per run in ``benchmarks/results/memory.jsonl``.

The ranks run with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then maps every block over 64 KiB
on its own and unmaps it when it is freed, so the resident size is the memory in use. With its
default, each freed block raises the threshold (up to 32 MiB), later blocks come from the heap
and freed memory stays resident: Adam's figure then varied from 28.2 to 32.2 bytes per parameter
between runs of the same script (2026-12-02), against 0.03 with the fixed threshold.
``--default-malloc`` measures without it.

With ``--device cuda`` the model and the optimizer live on the GPU (both gloo ranks share GPU
0) and each step also records ``torch.cuda.max_memory_allocated`` (its peak reset before the
step) per parameter: everything the process allocated on the GPU, the model included.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name: (optimizer, its keyword arguments, steps). Fixed settings that reach every stage within a
# few steps: 1-bit Adam freezes after step 3; 0/1 Adam refreshes the variance at steps 1, 2 and
# 4 (var_update_scaler=1), sends 1-bit momenta at 3, 5 and 6 and takes local steps from step 7,
# its interval reaching 4 (syncs at 8, 10, 14, 18).
# Each 1-bit member also with compact (bf16) error buffers.
_ZERO_ONE = {"lr": 1e-4, "var_freeze_step": 6, "var_update_scaler": 1, "local_step_scaler": 2,
             "local_step_clipper": 4, "total_steps": 18}
CONFIGS = {
    "adam": ("Adam", {"lr": 1e-4}, 8),
    "onebit_adam": ("OneBitAdam", {"lr": 1e-4, "freeze_step": 3}, 8),
    "onebit_adam_bf16_errors": ("OneBitAdam", {"lr": 1e-4, "freeze_step": 3,
                                               "error_dtype": "bfloat16"}, 8),
    "zero_one_adam": ("ZeroOneAdam", _ZERO_ONE, 18),
    "zero_one_adam_bf16_errors": ("ZeroOneAdam", {**_ZERO_ONE, "error_dtype": "bfloat16"}, 18),
    "onebit_lamb": ("OneBitLamb", {"lr": 1e-3, "freeze_step": 3}, 8),
    # Issue 46 (with --world 4 --local-world-size 2: 2 hosts of 2): one level against two.
    "onebit_adam_flat": ("OneBitAdam", {"lr": 1e-4, "freeze_step": 3, "topology": "flat"}, 8),
    "onebit_adam_hierarchical": ("OneBitAdam", {"lr": 1e-4, "freeze_step": 3,
                                                "topology": "hierarchical"}, 8),
}


def _status(field: str) -> int:
    """``field`` of /proc/self/status in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import onebit_plugin
    from onebit_plugin.core.memory import buffer_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    base = _status("VmRSS")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.dim, args.dim)
                                  for _ in range(args.layers)]).to(device)
    numel = sum(p.numel() for p in model.parameters())
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    kind, kwargs, steps = CONFIGS[args.config]
    onebit = kind != "Adam"
    if onebit:
        opt = getattr(onebit_plugin, kind)(ddp.parameters(), **kwargs)
        onebit_plugin.register_onebit_hook(ddp, opt)
    else:
        opt = torch.optim.Adam(ddp.parameters(), **kwargs)
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.batch, args.dim, generator=gen).to(device)
    target = torch.randn(args.batch, args.dim, generator=gen).to(device)
    peaks, breakdown, after, gpu = {}, {}, {}, {}
    for _ in range(steps):
        label = opt.coming_exchange if onebit else "adam"
        if onebit and opt.stage == "warmup":
            label = "warmup"
        elif onebit and not (opt.layout and opt.layout.units):
            label = "freeze"  # this step() builds the compression stage's buffers
        elif label == "exact":
            label = "refresh"  # 0/1 Adam's variance refresh
        _reset_peak()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.mse_loss(ddp(x), target).backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize(device)
            gpu[label] = max(gpu.get(label, 0), torch.cuda.max_memory_allocated(device))
        peaks[label] = max(peaks.get(label, 0), _status("VmHWM") - base)
        after[label] = _status("VmRSS") - base
        if onebit:
            breakdown[label] = buffer_bytes(opt)
    out = {"rank": rank, "numel": numel, "base": base, "peaks": peaks, "after": after,
           "breakdown": breakdown, "gpu": gpu}
    Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(name: str, args, tmp: Path) -> list[dict]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(args.world), "OMP_NUM_THREADS": "1"}
    if args.local_world_size:
        env["LOCAL_WORLD_SIZE"] = str(args.local_world_size)
    if not args.default_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    procs, outs = [], []
    try:
        for rank in range(args.world):
            out = tmp / f"{name}_{rank}.json"
            outs.append(out)
            cmd = [sys.executable, __file__, "--rank-of", name, "--out", str(out),
                   "--dim", str(args.dim), "--layers", str(args.layers),
                   "--batch", str(args.batch), "--device", args.device]
            procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(rank)}))
        codes = [p.wait(timeout=1800) for p in procs]
    finally:
        for p in procs:  # a rank that failed leaves its peers waiting in a collective
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        raise SystemExit(f"{name}: ranks exited {codes}")
    return [json.loads(o.read_text()) for o in outs]


def summarize(name: str, ranks: list[dict]) -> dict:
    numel = ranks[0]["numel"]
    labels = list(ranks[0]["peaks"])
    per_param = {lab: round(max(r["peaks"][lab] for r in ranks) / numel, 2) for lab in labels}
    steady = {lab: round(max(r["after"][lab] for r in ranks) / numel, 2) for lab in labels}
    breakdown = {lab: {k: round(v / numel, 3) for k, v in ranks[0]["breakdown"][lab].items()}
                 for lab in ranks[0]["breakdown"]}
    gpu = {lab: round(max(r["gpu"][lab] for r in ranks) / numel, 2) for lab in ranks[0]["gpu"]}
    return {"numel": numel, "peak_bytes_per_param": per_param,
            **({"cuda_max_allocated_bytes_per_param": gpu} if gpu else {}),
            "after_step_bytes_per_param": steady, "buffers_bytes_per_param": breakdown,
            "base_rss_mb": round(max(r["base"] for r in ranks) / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--only", nargs="*", choices=sorted(CONFIGS))
    parser.add_argument("--local-world-size", type=int, default=None,
                        help="LOCAL_WORLD_SIZE of the ranks (hosts of that many ranks)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--default-malloc", action="store_true",
                        help="glibc's default mmap threshold (module docstring)")
    parser.add_argument("--rank-of", dest="config", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.config:
        return rank_main(args)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or CONFIGS:
            results[name] = summarize(name, run_config(name, args, Path(tmp)))
            res = results[name]
            print(f"{name}: bytes per parameter, peak of a step "
                  f"{json.dumps(res['peak_bytes_per_param'])}, after it "
                  f"{json.dumps(res['after_step_bytes_per_param'])}"
                  + (f", GPU peak {json.dumps(res['cuda_max_allocated_bytes_per_param'])}"
                     if "cuda_max_allocated_bytes_per_param" in res else ""), flush=True)
    if "adam" in results:
        for kind in ("peak", "after_step"):
            adam = results["adam"][f"{kind}_bytes_per_param"]["adam"]
            for name, res in results.items():
                res[f"{kind}_over_adam"] = {lab: round(v - adam, 2) for lab, v in
                                            res[f"{kind}_bytes_per_param"].items()}
                print(f"{name}: {kind.replace('_', ' ')} over Adam's "
                      f"{json.dumps(res[f'{kind}_over_adam'])}")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from record import append_run

    append_run("memory", None, {"world": args.world, "dim": args.dim, "layers": args.layers,
                                "batch": args.batch, "default_malloc": args.default_malloc,
                                "device": args.device, "configs": results})


if __name__ == "__main__":
    main()
