"""Train the character-level GPT with Lightning and ``strategy="onebit_adam"``.

    python examples/train_lightning.py --devices 2 --steps 300 --freeze-step 60
    python examples/train_lightning.py --devices 2 --optimizer zero_one  # 0/1 Adam
    python examples/train_lightning.py --devices 2 --optimizer lamb      # 1-bit LAMB
    python examples/train_lightning.py --devices 2 --optimizer adam     # DDP + torch Adam

Runs on CPU (gloo) by default and on GPUs unchanged (``--accelerator gpu``). Lightning starts
the other processes itself. Writes ``summary.json`` (rank 0) and ``rank<R>.pt`` (each rank's
final parameters) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

import onebit_plugin  # noqa: F401 -- registers strategy="onebit_adam"
from onebit_plugin import OneBitAdam, OneBitLamb, ZeroOneAdam
from onebit_plugin.integrations.lightning import OneBitAdamCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
from charlm import CharGPT, freeze_step_arg, load_corpus, loss_fn, sample_batch  # noqa: E402
from teardown import leave_process_group  # noqa: E402


class Windows(Dataset):
    """Fixed random windows of the corpus (deterministic for a seed). Training uses it only for
    the epoch's length; its batches come from ``sample_batch`` (see ``training_step``)."""

    def __init__(self, data: torch.Tensor, context: int, count: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.data, self.context = data, context
        self.starts = torch.randint(0, len(data) - context - 1, (count,), generator=gen)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i):
        chunk = self.data[self.starts[i] : self.starts[i] + self.context + 1].long()
        return chunk[:-1], chunk[1:]


class CharModule(pl.LightningModule):
    def __init__(self, args, train_data):
        super().__init__()
        self.args = args
        self.train_data = train_data
        self.model = CharGPT(dim=args.dim, layers=args.layers, context=args.context)
        self.step_times = {"warmup": [], "compression": []}
        self._t0 = None
        self.started_at = None  # the optimizer step the fit started from (a resume's)

    def training_step(self, batch, batch_idx):
        # The batch is a function of (seed, rank, step, micro-batch), not of the loader's
        # position, so a run resumed from a checkpoint sees the batches of the uninterrupted run.
        a = self.args
        if a.hang_at and self.global_step + 1 == a.hang_at and self.global_rank == 1:
            print("FAULT", flush=True)
            time.sleep(3600)
        micro = batch_idx % a.accumulate
        gen = torch.Generator().manual_seed(
            ((a.seed * 1009 + self.global_rank) * 1_000_003 + self.global_step) * 64 + micro)
        x, y = (t.to(self.device) for t in sample_batch(self.train_data, a.batch, a.context, gen))
        loss = loss_fn(self.model, x, y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", loss_fn(self.model, *batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", loss_fn(self.model, *batch), sync_dist=True)

    def on_train_start(self):
        self.started_at = self.trainer.global_step  # after a checkpoint was restored

    def on_train_batch_start(self, batch, batch_idx):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        opt = self.optimizers().optimizer
        stage = getattr(opt, "stage", "warmup")
        self.step_times[stage].append(time.perf_counter() - self._t0)

    def on_fit_end(self):
        # Written by every rank, also under "onebit_adam_spawn"/"_fork", whose workers end here.
        opt = self.trainer.optimizers[0]
        callback = next((c for c in self.trainer.callbacks if hasattr(c, "lockstep_checks")),
                        None)
        torch.save({"params": [p.detach().cpu() for p in self.parameters()],
                    "stage": getattr(opt, "stage", None),
                    "switch_step": getattr(opt, "switch_step", None),
                    "global_step": self.trainer.global_step,
                    "started_at": self.started_at,
                    "lockstep_checks": getattr(callback, "lockstep_checks", None)},
                   Path(self.args.out) / f"rank{self.global_rank}.pt")

    def configure_optimizers(self):
        a = self.args
        if a.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=a.lr)
        if a.optimizer == "zero_one":  # the strategy hands it the run's length
            return ZeroOneAdam(self.parameters(), lr=a.lr, var_freeze_step=a.var_freeze_step,
                               local_step_scaler=a.local_step_scaler,
                               comm_timeout=a.comm_timeout, warmup_bits=a.warmup_bits)
        if a.optimizer == "lamb":
            return OneBitLamb(self.parameters(), lr=a.lr, weight_decay=0.01,
                              freeze_step=a.freeze_step, comm_timeout=a.comm_timeout,
                              warmup_bits=a.warmup_bits)
        return OneBitAdam(self.parameters(), lr=a.lr, freeze_step=a.freeze_step,
                          comm_timeout=a.comm_timeout, warmup_bits=a.warmup_bits)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--optimizer", choices=["onebit", "zero_one", "lamb", "adam"],
                   default="onebit",
                   help="onebit: OneBitAdam; zero_one: ZeroOneAdam (0/1 Adam); lamb: OneBitLamb "
                        "(1-bit LAMB); adam: DDP + Adam")
    p.add_argument("--strategy", default="onebit_adam",
                   choices=["onebit_adam", "onebit_adam_spawn", "onebit_adam_fork"],
                   help="how Lightning starts the processes (with --optimizer onebit)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--freeze-step", type=freeze_step_arg, default="auto",
                   help="warm-up steps, or auto (the strategy gives OneBitAdam the run's length)")
    p.add_argument("--var-freeze-step", type=freeze_step_arg, default="auto",
                   help="ZeroOneAdam's last step of variance refreshes (int or auto)")
    p.add_argument("--local-step-scaler", type=freeze_step_arg, default="auto",
                   help="ZeroOneAdam's steps before the local interval doubles (int or auto)")
    p.add_argument("--warmup-bits", type=int, default=32, choices=[32, 16, 8],
                   help="bits per value of the full-precision steps (warmup_bits)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per micro-batch")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--clip", type=float, default=None, help="gradient_clip_val")
    p.add_argument("--val-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, default=0, help="ModelCheckpoint every N steps")
    p.add_argument("--resume", help="fit(ckpt_path=...): a checkpoint path, or 'last'")
    p.add_argument("--test", action="store_true", help="run trainer.test after fit")
    p.add_argument("--check-lockstep", type=int, default=0,
                   help="verify every N steps that all ranks hold identical parameters")
    p.add_argument("--out", default="lightning_out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--comm-timeout", type=float, default=None,
                   help="seconds a collective may take before the step raises")
    p.add_argument("--hang-at", type=int, default=0,
                   help="fault injection: rank 1 hangs before this optimizer step")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    pl.seed_everything(args.seed, workers=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, val = load_corpus()
    samples = args.steps * args.batch * args.accumulate * args.devices * args.num_nodes
    train_loader = DataLoader(Windows(train, args.context, samples, args.seed), args.batch)
    val_loader = DataLoader(Windows(val, args.context, 256, 1234), 32)
    callbacks = []
    if args.optimizer != "adam":
        callbacks.append(OneBitAdamCallback(check_lockstep_every_n_steps=args.check_lockstep))
    if args.ckpt_every:
        callbacks.append(pl.callbacks.ModelCheckpoint(
            dirpath=out / "ckpt", every_n_train_steps=args.ckpt_every, save_top_k=-1,
            filename="{step}", save_last=True,  # for fit(ckpt_path="last"): --resume last
        ))
    strategy = args.strategy if args.optimizer != "adam" else "ddp"
    trainer = pl.Trainer(
        strategy=strategy, accelerator=args.accelerator, devices=args.devices,
        num_nodes=args.num_nodes, precision=args.precision, max_steps=args.steps,
        accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip,
        val_check_interval=args.val_every, check_val_every_n_epoch=None,
        log_every_n_steps=args.log_every, callbacks=callbacks,
        logger=[pl.loggers.CSVLogger(out, name="csv"),
                pl.loggers.TensorBoardLogger(out, name="tb")],
        enable_model_summary=False, default_root_dir=out,
    )
    module = CharModule(args, train)
    trainer.fit(module, train_loader, val_loader, ckpt_path=args.resume)
    if strategy != "onebit_adam" and strategy != "ddp":
        return  # spawn/fork: the workers have ended; each wrote its rank file in on_fit_end
    val_loss = trainer.validate(module, val_loader, verbose=False)[0]["val_loss"]
    test_loss = trainer.test(module, val_loader, verbose=False)[0]["test_loss"] if args.test \
        else None
    opt = trainer.optimizers[0]
    rank = trainer.global_rank
    n_params = sum(p.numel() for p in module.parameters())
    world = trainer.world_size
    # Uncompressed DDP: every step allreduces every gradient in fp32 (ring: 2 (W-1)/W bytes).
    ddp_bytes = round(2 * (world - 1) / world * 4 * n_params) * trainer.global_step
    comm = opt.communicator if getattr(opt, "stage", None) == "compression" else None
    summary = {
        "optimizer": type(opt).__name__,
        "strategy": strategy, "world_size": world, "parameters": n_params,
        "steps": trainer.global_step, "precision": args.precision,
        "final_val_loss": val_loss, "test_loss": test_loss,
        "bytes_sent": getattr(opt, "bytes_sent", ddp_bytes),
        "dense_bytes": getattr(opt, "dense_bytes", ddp_bytes),
        "compression_stage_bytes": comm.bytes_sent if comm else 0,
        "compression_stage_dense_bytes": comm.dense_bytes if comm else 0,
        "switch_step": getattr(opt, "switch_step", None),
        "warmup_bits": opt.config.warmup_bits if hasattr(opt, "config") else 32,
        "mean_step_s": {k: sum(v) / len(v) for k, v in module.step_times.items() if v},
        "overlap": getattr(trainer.strategy, "hook_state", None) is not None
        and trainer.strategy.hook_state.overlap,
    }
    if rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps({k: v for k, v in summary.items() if k != "mean_step_s"}))


if __name__ == "__main__":
    main()
    leave_process_group()  # gloo's exit race: teardown.py
