"""How often a 2-rank gloo job aborts after its last line ("terminate called without an active
exception", SIGABRT), per variant of one small training script (issue 32, item 4).

    .venv/bin/python benchmarks/exit_abort.py --runs 20 [--variants onebit,plain_sync,...]

Each run is ``torchrun --nproc_per_node 2`` of this file as a worker: a 33K-parameter MLP, 20
steps, ``destroy_process_group()`` at the end. A run counts as aborted when torchrun exits
non-zero or a rank printed "terminate called". Variants:

    onebit          OneBitAdam averaging its own gradients (freeze_step=5: compresses)
    onebit_warmup   the same, freeze_step=1000 (warm-up only)
    onebit_sleep    onebit_warmup, a 50 ms sleep before destroy_process_group()
    onebit_gc       onebit_warmup, gc.collect() before destroy_process_group()
    onebit_noavg    OneBitAdam(average_grads=False), the script averaging with dist.all_reduce
    plain_sync      torch.optim.Adam, gradients averaged with dist.all_reduce
    plain_async     the same with async_op=True per parameter

Entry points (``--variants lightning,fabric,accelerate,trainer,torchrun``): the examples under
each of them with 1-bit Adam on, 2 CPU processes, 6 steps frozen after step 2 (so that the run
ends in the compression stage), each ending as its framework ends it:

    lightning       examples/train_lightning.py (Trainer(strategy="onebit_adam"))
    fabric          examples/train_fabric.py (Fabric(strategy="onebit_adam"))
    accelerate      onebit-run accelerate launch examples/train_accelerate.py
    trainer         onebit-run accelerate launch examples/train_hf_trainer.py
    torchrun        torchrun examples/train_torchrun.py (OneBitAdam without DDP)

Results: a table on stdout and a record appended to benchmarks/results/exit_abort.jsonl.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("onebit", "onebit_warmup", "onebit_sleep", "onebit_gc", "onebit_noavg",
            "plain_sync", "plain_async")
ENTRY_POINTS = ("lightning", "fabric", "accelerate", "trainer", "torchrun")


def entry_point(name: str, out: str, port: int) -> tuple[list[str], dict]:
    """The command line and environment of one run of an entry point's example."""
    bin_dir, ex = Path(sys.executable).parent, ROOT / "examples"
    short = ["--steps", "6", "--out", out]
    accelerate = [str(bin_dir / "onebit-run"), "--freeze-step", "2", str(bin_dir / "accelerate"),
                  "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                  "--main_process_port", str(port), "--mixed_precision", "no",
                  "--dynamo_backend", "no"]
    env = {"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "ONEBIT_ADAM": "1"}
    commands = {
        "lightning": [sys.executable, str(ex / "train_lightning.py"), "--devices", "2",
                      "--freeze-step", "2", *short],
        "fabric": [sys.executable, str(ex / "train_fabric.py"), "--devices", "2",
                   "--freeze-step", "2", *short],
        "accelerate": [*accelerate, str(ex / "train_accelerate.py"), *short],
        "trainer": [*accelerate, str(ex / "train_hf_trainer.py"), *short],
        "torchrun": [str(bin_dir / "torchrun"), "--nproc_per_node", "2", "--master_port",
                     str(port), str(ex / "train_torchrun.py"), "--steps", "6",
                     "--freeze-step", "2"],
    }
    return commands[name], env


def worker(variant: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 64))
    params = list(model.parameters())
    if variant.startswith("onebit"):
        from onebit_plugin import OneBitAdam

        opt = OneBitAdam(params, lr=1e-3, freeze_step=5 if variant == "onebit" else 1000,
                         average_grads=variant != "onebit_noavg")
    else:
        opt = torch.optim.Adam(params, lr=1e-3)
    averages = variant in ("onebit_noavg", "plain_sync", "plain_async")
    gen = torch.Generator().manual_seed(rank)
    for _ in range(20):
        x = torch.randn(32, 64, generator=gen)
        opt.zero_grad()
        (model(x) - x).square().mean().backward()
        if averages:
            works = [dist.all_reduce(p.grad, async_op=variant == "plain_async") for p in params]
            for work in works if variant == "plain_async" else ():
                work.wait()
            for p in params:
                p.grad.div_(world)
        opt.step()
    if variant == "onebit_sleep":
        time.sleep(0.05)
    if variant == "onebit_gc":
        import gc

        gc.collect()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from record import append_run

    torchrun = str(Path(sys.executable).with_name("torchrun"))
    counts = {}
    for variant in args.variants.split(","):
        if variant not in VARIANTS + ENTRY_POINTS:
            parser.error(f"unknown variant {variant!r}; one of "
                         f"{', '.join(VARIANTS + ENTRY_POINTS)}")
        aborted = 0
        for i in range(args.runs):
            with tempfile.TemporaryDirectory() as out:
                if variant in ENTRY_POINTS:
                    cmd, env = entry_point(variant, out, 29600 + i % 50)
                else:
                    cmd, env = [torchrun, "--nproc_per_node", "2", "--master_port",
                                str(29600 + i % 50), __file__, "--worker", variant], {}
                # Not this script's ONEBIT_RESULTS_DIR: onebit-run refuses ONEBIT_ names it
                # does not know.
                base = {k: v for k, v in os.environ.items() if not k.startswith("ONEBIT_")}
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                                      cwd=ROOT, env={**base, "PYTHONPATH": str(ROOT), **env})
            failed = proc.returncode != 0 or "terminate called" in proc.stdout + proc.stderr
            if failed:
                print(f"{variant} run {i}: exit {proc.returncode}\n{proc.stderr[-2000:]}",
                      flush=True)
            aborted += failed
        counts[variant] = aborted
        print(f"| {variant} | {aborted} of {args.runs} aborted |", flush=True)
    path = append_run("exit_abort", None, {"runs": args.runs, "aborted": counts})
    print(f"appended the run to {path}")


if __name__ == "__main__":
    main()
