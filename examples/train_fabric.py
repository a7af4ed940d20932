"""Lightning Fabric: the character-level GPT with ``Fabric(strategy="onebit_adam")``.

    python examples/train_fabric.py --devices 2                       # 1-bit Adam
    python examples/train_fabric.py --devices 2 --optimizer adamw     # DDP + AdamW

A Fabric loop as in Fabric's own examples: ``fabric.setup``, ``fabric.backward``,
``no_backward_sync`` for gradient accumulation, ``clip_gradients``, ``fabric.save`` and
``fabric.load`` (``--save-at``/``--resume``). ``import onebit_plugin`` registers the strategy
name. Each rank writes its final parameters and the per-step bytes it wrote
(``examples/wire.py``) to ``--out``, rank 0 a summary.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric

from onebit_plugin import OneBitAdam, OneBitLamb, ZeroOneAdam

sys.path.insert(0, str(Path(__file__).resolve().parent))
from charlm import (  # noqa: E402
    CharGPT,
    evaluate,
    freeze_step_arg,
    load_corpus,
    loss_fn,
    sample_batch,
)
from teardown import leave_process_group  # noqa: E402
from wire import WireLog  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optimizer", choices=["onebit", "zero_one", "lamb", "adamw"],
                   default="onebit",
                   help="onebit: OneBitAdam; zero_one: ZeroOneAdam (0/1 Adam); lamb: OneBitLamb "
                        "(1-bit LAMB); adamw: DDP + AdamW")
    p.add_argument("--var-freeze-step", type=freeze_step_arg, default="auto",
                   help="ZeroOneAdam's last step of variance refreshes (int or auto)")
    p.add_argument("--local-step-scaler", type=freeze_step_arg, default="auto",
                   help="ZeroOneAdam's steps before the local interval doubles (int or auto)")
    p.add_argument("--strategy", help="default: onebit_adam for --optimizer onebit, else ddp")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--freeze-step", type=freeze_step_arg, default=60, help="an int, or auto")
    p.add_argument("--no-bound", action="store_true",
                   help="ablation: OneBitAdam(bound_update=False), compression-stage steps "
                        "not bounded")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--save-at", type=int, default=0, help="fabric.save after this step")
    p.add_argument("--resume", help="fabric.load this checkpoint first")
    p.add_argument("--out", default="fabric_out")
    args = p.parse_args(argv)
    strategy = args.strategy or ("ddp" if args.optimizer == "adamw" else "onebit_adam")
    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, strategy=strategy,
                    precision=args.precision)
    fabric.launch()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = CharGPT(context=args.context)
    if args.optimizer == "onebit":
        optimizer = OneBitAdam(model.parameters(), lr=args.lr, weight_decay=0.01,
                               decoupled_weight_decay=True, freeze_step=args.freeze_step,
                               total_steps=args.steps, bound_update=not args.no_bound)
    elif args.optimizer == "zero_one":
        optimizer = ZeroOneAdam(model.parameters(), lr=args.lr, weight_decay=0.01,
                                var_freeze_step=args.var_freeze_step,
                                local_step_scaler=args.local_step_scaler,
                                total_steps=args.steps, bound_update=not args.no_bound)
    elif args.optimizer == "lamb":
        optimizer = OneBitLamb(model.parameters(), lr=args.lr, weight_decay=0.01,
                               freeze_step=args.freeze_step, total_steps=args.steps)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, val = load_corpus()
    step = 0
    if args.resume:
        step = fabric.load(args.resume, {"model": model, "optimizer": optimizer})["step"]
    wire = WireLog()
    while step < args.steps:
        # Each rank's batches follow from (rank, step): a checkpoint written by rank 0 needs
        # no per-rank generator state for the resumed run to see the same data.
        gen = torch.Generator().manual_seed(fabric.global_rank * 1_000_003 + step)
        for micro in range(args.accumulate):
            x, y = (t.to(fabric.device) for t in
                    sample_batch(train, args.batch, args.context, gen))
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                fabric.backward(loss_fn(model, x, y) / args.accumulate)
        if args.clip:
            fabric.clip_gradients(model, optimizer, max_norm=args.clip)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        wire.mark(step)
        if step == args.save_at:
            fabric.save(out / "checkpoint.ckpt", {"model": model, "optimizer": optimizer,
                                                  "step": step})
    inner = optimizer.optimizer
    val_loss = evaluate(model.module, val.to(fabric.device), args.context)
    wire.save(out / f"wire.rank{fabric.global_rank}.json")
    torch.save([q.detach().cpu() for q in model.parameters()],
               out / f"params.rank{fabric.global_rank}.pt")
    if fabric.global_rank == 0:
        summary = {"optimizer": type(inner).__name__, "strategy": strategy, "steps": step,
                   "val_loss": val_loss, "switch_step": getattr(inner, "switch_step", None),
                   "world_size": fabric.world_size,
                   "compression_ratio": getattr(inner, "compression_ratio", None)}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
    leave_process_group()  # gloo's exit race: teardown.py
