"""What a frozen variance costs, without compression, and what keeps it fresh: a one-process
simulation for issue 44 (no onebit_plugin optimizer runs; only 0/1 Adam's refresh schedule is
imported).

Adam's update on the averaged gradient of ``--ranks`` batches a step (the momentum exact), with
the variance handled by ``--mode``:

* ``adam``: Adam (the reference);
* ``frozen``: frozen at ``--freeze``, each coordinate's ``m_hat / denom`` clamped to +-1 (the
  package's step bound; ``frozen_unbounded`` without it);
* ``zero_one``: built only on 0/1 Adam's refresh steps to ``--freeze`` (each refresh weighted
  by the steps since the previous, ``ZeroOnePolicy.refresh_moments_``), then frozen, bounded;
* ``refreshN``: frozen at ``--freeze``, then refreshed every N steps with that step's averaged
  gradient, weighted by N, bounded (a refresh is one full-precision exchange of the gradient);
* ``rescale``: frozen, each tensor's denominator scaled by the square root of the ratio of its
  gradients' mean square now (an EMA over about 100 steps) to at the freeze, within [1/4, 4].

No zero-variance mask: a coordinate with no gradient at any refresh keeps ``denom = eps``
(``zero_one`` diverged that way on ``char_mlp`` seed 0). Prints the final validation loss and
appends one record to ``benchmarks/results/frozen_variance.jsonl``.

    .venv/bin/python benchmarks/frozen_variance.py --workload char_mlp --mode refresh8 --seed 0
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from fidelity import WORKLOADS  # noqa: E402
from record import append_run, shown  # noqa: E402

from onebit_plugin.settings.schedule import refreshes_variance  # noqa: E402

B1, B2, EPS = 0.9, 0.999, 1e-8


def simulate(workload: str, mode: str, freeze: int, seed: int, steps: int, ranks: int) -> float:
    torch.set_num_threads(1)
    work = WORKLOADS[workload]()
    torch.manual_seed(seed)
    model = work.model()
    params = list(model.parameters())
    m = [torch.zeros_like(q) for q in params]
    v = [torch.zeros_like(q) for q in params]
    gens = [torch.Generator().manual_seed(1000 * seed + r) for r in range(ranks)]
    denoms = None
    last_refresh = 0
    square = [0.0] * len(params)
    square_at_freeze = None
    every = int(mode[len("refresh"):]) if mode.startswith("refresh") else None
    for t in range(1, steps + 1):
        lr = work.lr * (work.schedule(t - 1, steps) if hasattr(work, "schedule") else 1.0)
        model.zero_grad()
        (sum(work.loss(model, work.batch_of(g)) for g in gens) / ranks).backward()
        with torch.no_grad():
            grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in params]
            for i, g in enumerate(grads):
                m[i].lerp_(g, 1 - B1)
                square[i] = 0.99 * square[i] + 0.01 * float(g.pow(2).mean())
            refresh = False
            if mode == "adam" or (denoms is None and mode != "zero_one"):
                gap = 1
                refresh = True
            elif mode == "zero_one" and denoms is None and refreshes_variance(t, 16):
                gap, refresh = t - last_refresh, True
            elif every and denoms is not None and t % every == 0:
                gap, refresh = every, True
            if refresh:
                keep = B2**gap
                for vi, g in zip(v, grads, strict=True):
                    vi.mul_(keep).addcmul_(g, g, value=1 - keep)
                last_refresh = t
            if mode != "adam" and (t == freeze or (refresh and denoms is not None)):
                denoms = [(vi / (1 - B2**last_refresh)).sqrt().add_(EPS) for vi in v]
                if square_at_freeze is None:
                    square_at_freeze = list(square)
            for i, q in enumerate(params):
                m_hat = m[i] / (1 - B1**t)
                if denoms is None:
                    q.add_(m_hat / (v[i] / (1 - B2**t)).sqrt().add_(EPS), alpha=-lr)
                    continue
                scale = 1.0
                if mode == "rescale" and square_at_freeze[i] > 0:
                    scale = min(4.0, max(0.25, math.sqrt(square[i] / square_at_freeze[i])))
                r = m_hat / (denoms[i] * scale)
                if mode != "frozen_unbounded":
                    r.clamp_(-1, 1)
                q.add_(r, alpha=-lr)
    return work.val_loss(model)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="char_mlp", choices=sorted(WORKLOADS))
    p.add_argument("--mode", default="frozen")
    p.add_argument("--freeze", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--ranks", type=int, default=2)
    args = p.parse_args()
    known = ("adam", "frozen", "frozen_unbounded", "zero_one", "rescale")
    if args.mode not in known and not (args.mode.startswith("refresh")
                                       and args.mode[len("refresh"):].isdigit()):
        p.error(f"--mode: one of {', '.join(known)} or refreshN, got {args.mode!r}")
    loss = simulate(args.workload, args.mode, args.freeze, args.seed, args.steps, args.ranks)
    print(f"{args.workload} {args.mode} freeze {args.freeze} seed {args.seed}: val {loss:.4f}")
    path = append_run("frozen_variance", None, {**vars(args), "val_loss": loss})
    print(f"appended the run to {shown(path)}")


if __name__ == "__main__":
    main()
