"""Train the character-level GPT with OneBitAdam on plain torch.distributed (no DDP).

    torchrun --nproc_per_node 2 examples/train_torchrun.py --steps 300 --freeze-step 60

OneBitAdam averages the gradients itself during warm-up and exchanges the 1-bit momentum
afterwards. ``--baseline`` trains the same model with the same data order with uncompressed Adam
(OneBitAdam that never freezes, which equals torch.optim.Adam on the averaged gradient).
Runs on CPU (gloo) or GPU (NCCL) unchanged.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from onebit_plugin import OneBitAdam, ZeroOneAdam, check_lockstep

try:
    from charlm import CharGPT, evaluate, freeze_step_arg, load_corpus, loss_fn, sample_batch
    from teardown import leave_process_group
except ImportError:  # imported as examples.train_torchrun
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
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--freeze-step", type=freeze_step_arg, default=60, help="an int, or auto")
    p.add_argument("--zero-one", action="store_true",
                   help="ZeroOneAdam (0/1 Adam, its schedule from --steps) instead of OneBitAdam")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--max-block", type=int, default=2048)
    p.add_argument("--scale", default="rms", choices=["rms", "mean"])
    p.add_argument("--no-mask", action="store_true", help="disable the zero-variance mask")
    p.add_argument("--baseline", action="store_true", help="uncompressed Adam instead")
    p.add_argument("--no-bound", action="store_true",
                   help="ablation: OneBitAdam(bound_update=False), compression-stage steps "
                        "not bounded")
    p.add_argument("--exact-momentum", action="store_true",
                   help="ablation: freeze the variance but average the momentum exactly")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--comm-timeout", type=float, default=None,
                   help="seconds a collective may take before the step raises")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the summary to this file (rank 0)")
    p.add_argument("--ckpt-dir", help="save every rank's state here and, on start, resume from "
                   "the newest step every rank saved (torchrun --max-restarts restarts)")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--ckpt-keep", type=int, default=3, help="checkpoints kept (>= 2)")
    p.add_argument("--kill-at", default="",
                   help="fault injection, comma-separated steps: on attempt i (torchrun's "
                   "TORCHELASTIC_RESTART_COUNT) rank --kill-rank[i] SIGKILLs itself before "
                   "step i of this list")
    p.add_argument("--kill-rank", default="1", help="comma-separated, one per --kill-at step")
    p.add_argument("--check-lockstep", type=int, default=0,
                   help="every N steps check that all ranks hold bit-identical parameters")
    p.add_argument("--params-out", help="each rank saves its final parameters to "
                   "<this>.rank<R>.pt")
    return p.parse_args(argv)


def save(folder: str, step: int, rank: int, world: int, model, opt, gen, keep: int,
         every: int) -> None:
    """This rank's whole state after ``step`` (its own error buffers are in ``opt``'s), written
    to a temporary name first so that a kill never leaves a half-written file behind. Each rank
    then deletes its own file of ``keep`` checkpoints ago (the newer ones stay complete)."""
    path = Path(folder) / f"step{step:08d}" / f"rank{rank}of{world}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict(),
                "gen": gen.get_state()}, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)
    old = Path(folder) / f"step{step - keep * every:08d}"
    (old / path.name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        old.rmdir()  # the last rank to delete its file removes the folder


def resume(folder: str, world: int, rank: int, model, opt, gen) -> int:
    """Load the newest step that every rank of its run saved (the same choice on every rank: no
    writer is alive when a restarted job starts); returns that step, 0 when there is none.

    A checkpoint of another number of ranks (an elastic restart) resumes too: a rank that had
    no file of its own loads rank 0's (parameters and momenta are every rank's alike) and keeps
    its own data stream; the optimizer restarts its error feedback and says so."""
    for d in sorted(Path(folder).glob("step*"), reverse=True):
        files = {f.name for f in d.glob("rank*of*.pt")}
        saved = {int(name.split("of")[1][:-3]) for name in files}
        if len(saved) == 1 and \
                files == {f"rank{r}of{n}.pt" for n in saved for r in range(n)}:
            n = saved.pop()
            break
    else:
        return 0
    own = rank if rank < n else 0
    state = torch.load(d / f"rank{own}of{n}.pt", weights_only=True)  # data, never code
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    if rank < n:
        gen.set_state(state["gen"])
    return state["step"]


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.ckpt_keep < 2:
        raise SystemExit("--ckpt-keep must be >= 2: the newest checkpoint may be incomplete")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    owns_group = "RANK" in os.environ and not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
                          if backend == "nccl" else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    else:
        torch.cuda.set_device(device)  # else every rank's NCCL context would open on GPU 0
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = CharGPT(dim=args.dim, layers=args.layers, context=args.context).to(device)
    train, val = load_corpus()
    shared = dict(total_steps=args.steps, max_block=args.max_block, scale=args.scale,
                  mask_zero_variance=not args.no_mask, comm_timeout=args.comm_timeout,
                  bound_update=not args.no_bound)
    if args.zero_one:
        opt = ZeroOneAdam(model.parameters(), lr=args.lr, decoupled_weight_decay=False, **shared)
    else:
        opt = OneBitAdam(model.parameters(), lr=args.lr,
                         freeze_step=10**12 if args.baseline else args.freeze_step,
                         compress_momentum=not args.exact_momentum, **shared)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches
    name = "Adam" if args.baseline else type(opt).__name__
    say = print if rank == 0 else (lambda *a, **k: None)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"{name}: {n_params} parameters, {world} rank(s), {backend}, {args.steps} steps")
    history = []
    step_times = {"warmup": [], "compression": []}
    first = 1
    if args.ckpt_dir:
        first = 1 + resume(args.ckpt_dir, world, rank, model, opt, gen)
        if first > 1:
            print(f"rank {rank}: resumed from {args.ckpt_dir} at step {first - 1} (attempt "
                  f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')})", flush=True)
        if first > args.steps:
            print(f"rank {rank}: the checkpoint is at step {first - 1}, past --steps "
                  f"{args.steps}: nothing to train", flush=True)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kills = [int(k) for k in args.kill_at.split(",") if k]
    kill_ranks = [int(r) for r in args.kill_rank.split(",")] * len(kills)
    checks = 0
    for step in range(first, args.steps + 1):
        if attempt < len(kills) and step == kills[attempt] and rank == kill_ranks[attempt]:
            print(f"rank {rank}: killing itself before step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = (t.to(device) for t in sample_batch(train, args.batch, args.context, gen))
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, x, y)
        loss.backward()
        stage = opt.stage
        opt.step()
        step_times[stage].append(time.perf_counter() - start)
        if opt.switch_step == step:
            say(f"step {step}: {opt.switch_message()}", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            val_loss = evaluate(model, val.to(device), args.context)
            history.append((step, loss.item(), val_loss))
            # 0/1 Adam between syncs: rank 0's own point, not the common one the next sync
            # lands on (docs/limits.md); the last step is a sync.
            own = "  (rank 0's own point, between syncs)" if opt.between_syncs else ""
            say(f"step {step:5d}  stage {opt.stage:11s}  train {loss.item():.3f}  "
                f"val {val_loss:.3f}  sent {opt.bytes_sent / 2**20:8.2f} MiB  "
                f"(fp32 allreduce: {opt.dense_bytes / 2**20:8.2f} MiB){own}")
        if args.check_lockstep and step % args.check_lockstep == 0 and not opt.between_syncs:
            check_lockstep(model.parameters(), opt)  # raises LockstepError on any difference
            checks += 1
        if args.ckpt_dir and step % args.ckpt_every == 0:
            save(args.ckpt_dir, step, rank, world, model, opt, gen, args.ckpt_keep,
                 args.ckpt_every)
            say(f"step {step}: checkpoint written", flush=True)
    if not history:  # resumed at or past --steps
        history.append((first - 1, float("nan"), evaluate(model, val.to(device), args.context)))
    # The compression stage's own traffic: its communicator counts every call.
    comm = opt.communicator if getattr(opt, "stage", None) == "compression" else None
    summary = {
        "optimizer": name,
        "world_size": world,
        "parameters": n_params,
        "steps": args.steps,
        "freeze_step": None if args.baseline else args.freeze_step,
        "switch_step": opt.switch_step,
        "final_val_loss": history[-1][2],
        "bytes_sent": opt.bytes_sent,
        "dense_bytes": opt.dense_bytes,
        "compression_stage_bytes": comm.bytes_sent if comm else 0,
        "compression_stage_dense_bytes": comm.dense_bytes if comm else 0,
        "mean_step_s": {k: sum(v) / len(v) for k, v in step_times.items() if v},
        "history": history,
        "lockstep_checks": checks,
        # Largest |value| per parameter tensor: a frozen variance shows as runaway rows.
        "max_abs": {n: float(p.detach().abs().max()) for n, p in model.named_parameters()},
    }
    if comm is not None and comm.bytes_sent:
        say(f"compression stage: {comm.bytes_sent} bytes sent against "
            f"{comm.dense_bytes} for fp32 allreduce "
            f"({1 - comm.bytes_sent / comm.dense_bytes:.2%} less)")
    if opt.bytes_sent:
        say(f"whole run: {opt.bytes_sent / 2**20:.2f} MiB sent, Adam would have sent "
            f"{opt.dense_bytes / 2**20:.2f} MiB ({opt.compression_ratio:.2f}x less)")
    if args.params_out:
        torch.save([p.detach().cpu() for p in model.parameters()],
                   f"{args.params_out}.rank{rank}.pt")
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    if owns_group:
        leave_process_group()  # gloo's exit race: teardown.py
    return summary


if __name__ == "__main__":
    main()
