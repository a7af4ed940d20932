"""What one optimizer step costs on the CPU, side by side: torch's Adam (foreach) and OneBitAdam
in the compression stage, on the communication-bound cluster workload's GPT. One process, whose
OneBitAdam is given the 1-bit communicator it would have with W ranks (a single process
otherwise averages exactly): its step folds the gradients inside the worker pass, runs the
server pass and the decode, and updates the parameters, everything a rank does but the
collectives. That is W = 1, where the server pass keeps an error for every value; with W ranks
it decodes as many values (1/W of them from each of W senders) but keeps the error of 1/W: an
upper bound on a rank's passes.

    .venv/bin/python benchmarks/step_cost.py [--dim 256] [--layers 8] [--threads 1]

Issue 10 asks that the compression-stage step cost no more than torch Adam's. The same
gradients every step (random, fixed); best of ``--repeat`` steps each. Run it once as is and
once with ``ONEBIT_CPU_KERNEL=0`` to see the torch passes (the update's and the compression's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from charlm import CharGPT  # noqa: E402
from compression_throughput import bench  # noqa: E402  (its best-of timing)

from onebit_plugin import OneBitAdam  # noqa: E402
from onebit_plugin.allreduce import OneBitAllreduce  # noqa: E402
from onebit_plugin.kernels import cpu  # noqa: E402


def best_ms(fn, repeat: int) -> float:
    return bench(fn, repeat) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    params = list(CharGPT(dim=args.dim, layers=args.layers, context=32).parameters())
    gen = torch.Generator().manual_seed(1)
    for q in params:
        q.grad = torch.randn(q.shape, generator=gen) * 1e-3
    adam = torch.optim.Adam(params, lr=1e-6)
    adam_ms = best_ms(adam.step, args.repeat)
    opt = OneBitAdam(params, lr=1e-6, freeze_step=2)
    for _ in range(3):
        opt.step()
    assert opt.stage == "compression"
    exact_ms = best_ms(opt.step, args.repeat)
    opt._comm = OneBitAllreduce(None)  # what W ranks would run; nothing to send with one
    opt._units = None  # rebuilt for it at the next step (its plan and error buffers)
    opt.step()
    onebit_ms = best_ms(opt.step, args.repeat)
    n = sum(q.numel() for q in params)
    print(f"{n:,} parameters in {len(params)} tensors, {args.threads} thread(s), C passes "
          f"{'on' if cpu.library() is not None else 'off'}, best of {args.repeat}")
    print(f"torch Adam step (foreach):                        {adam_ms:6.1f} ms")
    print(f"OneBitAdam, compression stage, exact average:     {exact_ms:6.1f} ms (fold, update)")
    print(f"OneBitAdam, compression stage, 1-bit (W = 1):     {onebit_ms:6.1f} ms "
          f"({onebit_ms / adam_ms:.2f}x Adam's; fold in the worker pass, server pass, decode, "
          "update)")


if __name__ == "__main__":
    main()
