"""Train the character-level GPT sharded by FSDP2 inside each host, with the 1-bit family across
hosts (HSDP), in a plain loop under torchrun or under Lightning's ``strategy="onebit_hsdp"``.

    torchrun --nproc_per_node 4 examples/train_hsdp.py --host-size 2 --steps 200
    python examples/train_hsdp.py --lightning --devices 4 --host-size 2 --steps 200

Hosts of ``--host-size`` ranks (on one machine: the first ``--host-size`` ranks are "host" 0, ...):
each block and the root are ``fully_shard``-ed over the host's ranks (``mesh["shard"]``), and the
optimizer exchanges each shard with the ranks that hold it on the other hosts
(``process_group=mesh["replicate"].get_group()``). ``--baseline``: native HSDP (the 2-D mesh)
with torch's Adam, the same model, data and steps. ``--ckpt-dir`` with ``--save-at N``: a DCP
checkpoint after step N (``onebit_plugin.save_sharded``), which ``--resume`` continues. At the
end the replicas are checked bit-identical (``check_lockstep``), and ``--json`` gets rank 0's
summary and ``--params-out`` each rank's shards.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from onebit_plugin import (
    OneBitAdam,
    ZeroOneAdam,
    check_lockstep,
    load_sharded,
    save_sharded,
)

try:
    from charlm import CharGPT, evaluate, freeze_step_arg, load_corpus, loss_fn, sample_batch
    from teardown import leave_process_group
except ImportError:  # imported as examples.train_hsdp
    from examples.charlm import (
        CharGPT,
        evaluate,
        freeze_step_arg,
        load_corpus,
        loss_fn,
        sample_batch,
    )
    from examples.teardown import leave_process_group


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--host-size", type=int, default=2, help="ranks per host (FSDP2's shard size)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--freeze-step", type=freeze_step_arg, default="auto", help="an int, or auto")
    p.add_argument("--zero-one", action="store_true", help="ZeroOneAdam instead of OneBitAdam")
    p.add_argument("--baseline", action="store_true", help="native HSDP with torch's Adam")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clip", type=float, default=0.0,
                   help="clip the gradient's norm at this (0: no clipping)")
    p.add_argument("--ckpt-dir", help="where --save-at writes and --resume reads")
    p.add_argument("--save-at", type=int, default=0,
                   help="save after this step (0: never); --lightning: at the fit's end")
    p.add_argument("--resume", action="store_true", help="continue from --ckpt-dir")
    p.add_argument("--json", help="rank 0's summary")
    p.add_argument("--params-out", help="each rank's shards to <this>.rank<R>.pt")
    p.add_argument("--lightning", action="store_true", help="Trainer(strategy='onebit_hsdp')")
    p.add_argument("--devices", type=int, default=4, help="with --lightning")
    p.add_argument("--check-resume", type=int, default=0,
                   help="with --lightning and --ckpt-dir: fit again, saved after N steps (in "
                        "<ckpt-dir>/check) and resumed, and compare every rank's shards with "
                        "the uninterrupted fit's")
    return p.parse_args(argv)


def shard(model: CharGPT, mesh) -> None:
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def make_optimizer(args, params, group, total_steps: int):
    if args.baseline:
        return torch.optim.Adam(params, lr=args.lr)
    if args.zero_one:
        return ZeroOneAdam(params, lr=args.lr, total_steps=total_steps, process_group=group)
    return OneBitAdam(params, lr=args.lr, freeze_step=args.freeze_step,
                      total_steps=total_steps, process_group=group)


def local_shards(model) -> list[torch.Tensor]:
    return [getattr(p, "_local_tensor", p).detach().clone() for p in model.parameters()]


def train_loop(args) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.host_size:
        raise SystemExit(f"--host-size {args.host_size} does not divide the {world} ranks")
    mesh = init_device_mesh("cpu", (world // args.host_size, args.host_size),
                            mesh_dim_names=("replicate", "shard"))
    train, val = load_corpus()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = CharGPT(dim=args.dim, layers=args.layers, context=args.context)
    shard(model, mesh if args.baseline else mesh["shard"])
    group = mesh["replicate"].get_group()
    opt = make_optimizer(args, model.parameters(), group, args.steps)
    gen = torch.Generator().manual_seed(1000 * args.seed + rank)  # each rank its own batches
    start = 0
    if args.resume:
        load_sharded(args.ckpt_dir, model, opt)
        state = torch.load(Path(args.ckpt_dir) / f"gen{rank}.pt", weights_only=True)
        gen.set_state(state["gen"])
        start = state["step"]
    began = time.perf_counter()
    for step in range(start + 1, args.steps + 1):
        loss = loss_fn(model, *sample_batch(train, args.batch, args.context, gen))
        loss.backward()
        if args.clip and args.baseline:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        elif args.clip:  # over whole parameters; in the compression stage inside the momentum
            opt.clip_grad_norm_(args.clip)
        opt.step()
        opt.zero_grad()
        if step == args.save_at:
            save_sharded(args.ckpt_dir, model, opt)
            torch.save({"gen": gen.get_state(), "step": step},
                       Path(args.ckpt_dir) / f"gen{rank}.pt")
    val_loss = evaluate(model, val, args.context)  # a collective under FSDP2: every rank
    if not args.baseline:
        check_lockstep(model.parameters(), opt)  # the replicas of every shard
    if args.params_out:
        torch.save(local_shards(model), f"{args.params_out}.rank{rank}.pt")
    if rank == 0:
        summary = {"val_loss": val_loss, "seconds": time.perf_counter() - began,
                   "stage": getattr(opt, "stage", None),
                   "switch_step": getattr(opt, "switch_step", None),
                   "bytes_sent": getattr(opt, "bytes_sent", None)}
        print(json.dumps(summary), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(summary))
    leave_process_group()


def train_lightning(args) -> None:
    import lightning.pytorch as pl

    from onebit_plugin.integrations.lightning import hsdp_strategy_for

    train, val = load_corpus()

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(args.seed)
            self.net = CharGPT(dim=args.dim, layers=args.layers, context=args.context)
            self.gen = None

        def forward(self, idx):  # through the root FSDP2 module, which gathers its shards
            return self.net(idx)

        def configure_model(self):
            for block in self.net.blocks:
                shard_one(block, self.device_mesh["shard"])
            shard_one(self, self.device_mesh["shard"])

        def configure_optimizers(self):
            # The whole run's length (--steps), also in --check-resume's shorter first fit:
            # freeze_step="auto" reads it.
            return make_optimizer(args, self.parameters(),
                                  self.device_mesh["replicate"].get_group(), args.steps)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(range(args.steps), batch_size=None)

        def training_step(self, _, __):
            # Each rank's batch from (seed, rank, step): a resumed fit reads the same ones.
            gen = torch.Generator().manual_seed(
                (1000 * args.seed + self.global_rank) * 100_000 + self.global_step)
            return loss_fn(self, *sample_batch(train, args.batch, args.context, gen))

        def on_train_end(self):
            self.summary = {"val_loss": evaluate(self, val, args.context),
                            "stage": self.trainer.strategy._member().stage}
            check_lockstep(self.parameters(), self.trainer.strategy._member())

    def shard_one(module, mesh):
        from torch.distributed.fsdp import fully_shard
        fully_shard(module, mesh=mesh)

    def fit(steps: int, resume: str | None = None, save: str | None = None):
        model = Model()
        trainer = pl.Trainer(accelerator="cpu", devices=args.devices,
                             strategy=hsdp_strategy_for("lightning.pytorch")(
                                 shard_size=args.host_size),
                             max_steps=steps, logger=False, enable_checkpointing=False,
                             gradient_clip_val=args.clip or None,
                             enable_progress_bar=False, enable_model_summary=False,
                             use_distributed_sampler=False)
        trainer.fit(model, ckpt_path=resume)
        if save:
            trainer.save_checkpoint(save)
        return trainer, model

    trainer, model = fit(args.steps, args.ckpt_dir if args.resume else None,
                         args.ckpt_dir if args.save_at else None)
    summary = dict(model.summary)
    if args.check_resume:  # the same fit, saved after --check-resume steps and resumed
        whole = local_shards(model)
        folder = str(Path(args.ckpt_dir) / "check")
        fit(args.check_resume, save=folder)
        _, resumed = fit(args.steps, resume=folder)
        summary["resumed_bitwise"] = all(
            torch.equal(a, b) for a, b in zip(whole, local_shards(resumed), strict=True))
        flags = torch.tensor([float(summary["resumed_bitwise"])])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # every rank's shards
        summary["resumed_bitwise"] = bool(flags.item())
    if trainer.global_rank == 0:
        print(json.dumps(summary), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(summary))
    if args.params_out:
        torch.save(local_shards(model), f"{args.params_out}.rank{trainer.global_rank}.pt")


def main(argv=None) -> None:
    args = parse_args(argv)
    if (args.save_at or args.resume or args.check_resume) and not args.ckpt_dir:
        raise SystemExit("--save-at, --resume and --check-resume need --ckpt-dir")
    if args.lightning:
        train_lightning(args)
    else:
        train_loop(args)


if __name__ == "__main__":
    main()
