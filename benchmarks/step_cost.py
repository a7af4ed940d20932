"""What one optimizer step costs on the CPU, side by side: torch's Adam (foreach) and OneBitAdam
in the compression stage (one process: the fold, the compressed allreduce's passes with W = 1,
the momentum copy and the update), on the communication-bound cluster workload's GPT.

    .venv/bin/python benchmarks/step_cost.py [--dim 256] [--layers 8] [--threads 1]

Issue 10 asks that the compression-stage step cost no more than torch Adam's. The same
gradients every step (random, fixed); best of ``--repeat`` steps each. Run it once as is and
once with ``ONEBIT_CPU_KERNEL=0`` to see the torch passes (the update's and the compression's).
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

from onebit_plugin import OneBitAdam  # noqa: E402
from onebit_plugin.kernels import cpu  # noqa: E402


def best_ms(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


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
    onebit_ms = best_ms(opt.step, args.repeat)
    unit = opt.units[0]
    fold_ms = best_ms(lambda: [unit.fold_(q, q.grad) for q in unit.params], args.repeat)
    reduce_ms = best_ms(lambda: unit.reduce_(opt.communicator), args.repeat)
    n = sum(q.numel() for q in params)
    print(f"{n:,} parameters in {len(params)} tensors, {args.threads} thread(s), C passes "
          f"{'on' if cpu.library() is not None else 'off'}, best of {args.repeat}")
    print(f"torch Adam step (foreach):        {adam_ms:6.1f} ms")
    print(f"OneBitAdam compression-stage step: {onebit_ms:6.1f} ms "
          f"({onebit_ms / adam_ms:.2f}x Adam's), of which the fold {fold_ms:.1f} ms and the "
          f"compressed allreduce's passes {reduce_ms:.1f} ms ({len(opt.units)} unit(s))")


if __name__ == "__main__":
    main()
