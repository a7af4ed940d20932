"""Train the character-level GPT with an ordinary Accelerate loop; 1-bit Adam is a launch switch.

    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 \\
        examples/train_accelerate.py                                                # AdamW
    ACCELERATE_USE_CPU=true onebit-run --freeze-step 60 \\
        accelerate launch --multi_gpu --num_processes 2 \\
        examples/train_accelerate.py                                                # 1-bit

A plain Accelerate script in the style of Accelerate's own examples: ``accelerate.Accelerator``,
AdamW with a linear warm-up schedule from lr 0, ``accelerator.accumulate``,
``clip_grad_norm_`` and, with ``--save-at``/``--load-from``, ``save_state``/``load_state``.
Nothing of onebit_plugin is imported: ``onebit-run`` patches Accelerate as it loads.
``--explicit-import`` takes ``Accelerator`` from ``onebit_plugin.integrations.accelerate_flag``
instead (the route that needs ``ONEBIT_ADAM=1`` but no launcher); ``--separate-prepare`` calls
``prepare`` for the model and the optimizer separately and leaves the scheduler unprepared.
``--wire-out`` records each step's bytes written by the process (``examples/wire.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from charlm import CharGPT, evaluate, load_corpus, loss_fn, sample_batch  # noqa: E402
from teardown import leave_process_group  # noqa: E402
from wire import WireLog  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--mixed-precision", default="no")
    p.add_argument("--save-at", type=int, default=0, help="save_state after this step, then "
                   "load_state into a fresh model and optimizer and continue from it")
    p.add_argument("--load-from", help="load_state from this folder first, then train on")
    p.add_argument("--hang-at", type=int, default=0,
                   help="fault injection: process 1 hangs in this optimizer step, after forward")
    p.add_argument("--explicit-import", action="store_true")
    p.add_argument("--separate-prepare", action="store_true")
    p.add_argument("--wire-out", help="per-step bytes written, as JSON (examples/wire.py)")
    p.add_argument("--out", default="accelerate_out")
    return p.parse_args(argv)


def build(args, accelerator_cls):
    accelerator = accelerator_cls(gradient_accumulation_steps=args.accumulate,
                                  mixed_precision=args.mixed_precision)
    torch.manual_seed(0)
    model = CharGPT(context=args.context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    # Linear warm-up from lr 0, like transformers' get_linear_schedule_with_warmup.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, s / 20))
    if args.separate_prepare:  # and the scheduler, built on the original, left unprepared
        model = accelerator.prepare(model)
        optimizer = accelerator.prepare(optimizer)
    else:
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.explicit_import:
        from onebit_plugin.integrations.accelerate_flag import Accelerator
    else:
        from accelerate import Accelerator
    wire = WireLog()
    accelerator, model, optimizer, scheduler = build(args, Accelerator)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, val = load_corpus()
    gen = torch.Generator().manual_seed(accelerator.process_index)
    step = 0
    if args.load_from:
        accelerator.load_state(args.load_from)
        step = getattr(optimizer.optimizer, "global_step", 0)
    while step < args.steps:
        for _ in range(args.accumulate):
            x, y = (t.to(accelerator.device) for t in
                    sample_batch(train, args.batch, args.context, gen))
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    loss = loss_fn(model, x, y)
                # After the forward, whose DDP buffer broadcast runs on DDP's own group.
                if args.hang_at == step + 1 and accelerator.process_index == 1:
                    print("FAULT", flush=True)
                    time.sleep(3600)
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.clip:
                    accelerator.clip_grad_norm_(model.parameters(), args.clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        step += 1
        wire.mark(step)
        if step == args.save_at:
            accelerator.save_state(out / "state")
            accelerator.wait_for_everyone()
            # A fresh model and optimizer resumed from the saved state continue the run.
            accelerator, model, optimizer, scheduler = build(args, Accelerator)
            accelerator.load_state(out / "state")
    inner = optimizer.optimizer
    if args.wire_out:
        wire.save(f"{args.wire_out}.rank{accelerator.process_index}.json")
    val_loss = evaluate(accelerator.unwrap_model(model), val.to(accelerator.device), args.context)
    params = [p.detach().cpu() for p in accelerator.unwrap_model(model).parameters()]
    torch.save({"params": params, "optimizer": type(inner).__name__,
                "stage": getattr(inner, "stage", None)},
               out / f"rank{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        summary = {"optimizer": type(inner).__name__, "val_loss": val_loss, "steps": step,
                   "bytes_sent": getattr(inner, "bytes_sent", None),
                   "dense_bytes": getattr(inner, "dense_bytes", None),
                   "switch_step": getattr(inner, "switch_step", None),
                   "lr_of_optimizer": inner.param_groups[0]["lr"],
                   "lr_of_scheduler": scheduler.get_last_lr()[0],
                   "gradient_as_bucket_view": getattr(model, "gradient_as_bucket_view", None)}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary))
    leave_process_group()  # gloo's exit race (teardown.py); end_training() then finds no group
    accelerator.end_training()


if __name__ == "__main__":
    main()
