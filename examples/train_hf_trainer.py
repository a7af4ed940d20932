"""``transformers.Trainer`` on a small GPT-2, randomly initialised from its config (no
download), over Python's own documentation text as bytes. Nothing of onebit_plugin is imported:

    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 \\
        examples/train_hf_trainer.py --out hf_adamw                       # AdamW + DDP
    ACCELERATE_USE_CPU=true onebit-run --freeze-step 20 \\
        accelerate launch --multi_gpu --num_processes 2 \\
        examples/train_hf_trainer.py --out hf_onebit                      # 1-bit Adam

(`torchrun --nproc_per_node 2` works in place of `accelerate launch` too.) The Trainer's own
AdamW, linear warm-up schedule from lr 0, gradient clipping at 1.0 and checkpoints
(``--save-steps``, ``--resume``) are used as they are. Each rank writes its final parameters,
the per-step bytes it wrote (``examples/wire.py``) and rank 0 a summary to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
from charlm import load_corpus  # noqa: E402
from teardown import leave_process_group  # noqa: E402
from wire import WireLog  # noqa: E402


class Windows(torch.utils.data.Dataset):
    """Fixed random windows of the byte corpus (the same on every run with the same seed)."""

    def __init__(self, data: torch.Tensor, context: int, count: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.data, self.context = data, context
        self.starts = torch.randint(0, len(data) - context, (count,), generator=gen)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict:
        ids = self.data[self.starts[i]:self.starts[i] + self.context].long()
        return {"input_ids": ids, "labels": ids}


class MarkWire(TrainerCallback):
    def __init__(self, log: WireLog):
        self.log = log
        self.first_step = None  # the first optimizer step this run took (61 resumed from 60)

    def on_step_end(self, args, state, control, **kwargs):
        if self.first_step is None:
            self.first_step = state.global_step
        self.log.mark(state.global_step)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps")
    p.add_argument("--resume", help="resume_from_checkpoint: a checkpoint folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="hf_out")
    args = p.parse_args(argv)
    out = Path(args.out)
    train, val = load_corpus()
    config = GPT2Config(vocab_size=256, n_positions=args.context, n_embd=64, n_layer=2,
                        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=None, eos_token_id=None)
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=str(out / "checkpoints"), max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="linear", warmup_steps=args.warmup_steps,
        per_device_train_batch_size=args.batch, per_device_eval_batch_size=32,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        logging_steps=10_000, report_to="none", use_cpu=True, seed=args.seed,
        disable_tqdm=True, dataloader_num_workers=0,
    )
    wire = WireLog()
    marker = MarkWire(wire)
    trainer = Trainer(
        model=model, args=training, callbacks=[marker],
        train_dataset=Windows(train, args.context, args.steps * args.batch * 8, args.seed),
        eval_dataset=Windows(val, args.context, 256, 1234),
    )
    trainer.train(resume_from_checkpoint=args.resume)
    val_loss = trainer.evaluate()["eval_loss"]
    opt = trainer.optimizer.optimizer  # inside Accelerate's wrapper
    rank = trainer.args.process_index
    out.mkdir(parents=True, exist_ok=True)
    wire.save(out / f"wire.rank{rank}.json")
    torch.save([q.detach().cpu() for q in trainer.model.parameters()],
               out / f"params.rank{rank}.pt")
    if rank == 0:
        summary = {"optimizer": type(opt).__name__, "val_loss": val_loss,
                   "steps": trainer.state.global_step, "first_step": marker.first_step,
                   "switch_step": getattr(opt, "switch_step", None),
                   "world_size": trainer.args.world_size,
                   "largest_abs_param": max(q.abs().max().item()
                                            for q in trainer.model.parameters())}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
    leave_process_group()  # gloo's exit race: teardown.py
