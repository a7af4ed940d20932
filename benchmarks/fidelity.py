"""Accuracy against bytes: Adam, 1-bit Adam (fixed freeze and freeze_step="auto"), fp16
compression and PowerSGD on three workloads of different kinds, 2 gloo ranks, several seeds.

Workloads (offline data only):

* ``gpt_text``: the char-level GPT of ``examples/charlm.py`` on Python's own documentation text;
* ``word_embed``: a word-level next-word model over the same text (4,096-word vocabulary, Zipf
  distributed, so most embedding rows are rare; 85% of the parameters are embeddings);
* ``digits``: an MLP on scikit-learn's bundled ``digits`` images (1,797 8x8 images, 10 classes);
* ``large_batch`` (1-bit LAMB's, ``--workloads large_batch --variants`` from ``LAMB``): the
  word-level model at a global batch of 4,096 (2,048 per rank), LAMB's learning rate scaled
  from the small-batch one by sqrt(4096 / 128), as LAMB's users scale it; compared with LAMB
  (exact, averaged by DDP's allreduce) and with Adam at three learning rates (its best is the
  one to read).
* ``--workloads wider``: ``char_mlp``, ``gpt_cosine`` and ``bow_topics``, kinds the three do not
  cover (an MLP language model at a constant learning rate, a warm-up + cosine schedule, rows
  sparse in a bag of words). The workloads themselves: ``benchmarks/workloads.py``.

Every variant runs the same model, seed, data order and steps under DDP (1-bit Adam through
``register_onebit_hook``, fp16 and PowerSGD through torch's own DDP hooks). Bytes are what each
rank's process wrote during training, from ``/proc/self/io`` (the kernel's count, gloo's socket
writes included), not the package's counters. Appends one record (benchmarks/record.py: date,
commit, machine, versions, command; every run's row and the table) to
``benchmarks/results/fidelity.jsonl``, prints a markdown table and draws
``docs/fidelity_loss_vs_bytes.png``.

    .venv/bin/python benchmarks/fidelity.py            # make fidelity: about 25 minutes, 2 cores
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

from record import append_run, shown  # noqa: E402 - benchmarks/record.py
from wire import written  # noqa: E402
from workloads import NAMED, STANDARD, WORKLOADS  # noqa: E402 - benchmarks/workloads.py

STEPS = 240
LR = None  # --lr: replaces the workloads' own
FIXED_FREEZE = 40  # 17% of the run, inside the paper's 15-25%
CLIP = 1.0  # clip_grad_norm_'s max_norm in the *_clip variants (transformers' default)
VARIANTS = ["adam", "onebit_fixed", "onebit_auto", "onebit_auto_unbounded", "fp16", "powersgd",
            # Clipping: each compared with Adam + the same clipping of the averaged gradient.
            "adam_clip", "onebit_auto_clip", "onebit_auto_clip_momentum",
            # bf16 parameters (autocast for the fp32 inputs), each compared with onebit_auto.
            "onebit_auto_bf16", "onebit_auto_bf16_master",
            # bf16 error buffers (error_dtype="bfloat16"), compared with onebit_auto.
            "onebit_auto_compact_errors"]
# 0/1 Adam (``--steps 2000 --variants adam,onebit_auto,zero_one,...``, docs/benchmarks.md):
# its defaults, local intervals reaching 16 early (local_step_scaler=8), and up to 64.
ZERO_ONE = {"zero_one": {}, "zero_one_local16_early": {"local_step_scaler": 8},
            "zero_one_local64": {"local_step_clipper": 64},
            # What costs what: phase B syncing every step (no local steps), and phase A only
            # (refreshes for the whole run, no phase B).
            "zero_one_sync_every_step": {"local_step_clipper": 1},
            "zero_one_phase_a_only": {"var_freeze_step": 100_000},
            # Where phase B's cost lies (docs/benchmarks.md, "0/1 Adam, long runs"): without
            # the step bound, a later freeze, and syncs averaged exactly (_exact_syncs).
            "zero_one_unbounded": {"bound_update": False},
            "zero_one_sync_unbounded": {"local_step_clipper": 1, "bound_update": False},
            "zero_one_freeze400": {"var_freeze_step": 400},
            "zero_one_freeze400_sync": {"var_freeze_step": 400, "local_step_clipper": 1},
            "zero_one_exact_sync": {},
            # Issue 44's ablations: phase A as plain Adam (every step refreshes the variance
            # to the same freeze, 240 of 2,000), and intervals of at most 4.
            "zero_one_adam_phase_a": {"var_freeze_step": 240, "var_update_scaler": 10**6},
            "zero_one_local4": {"local_step_clipper": 4},
            # Without the zero-variance mask (rows no refresh saw stay masked with it).
            "zero_one_nomask": {"mask_zero_variance": False},
            # A diagnostic (_capped_refreshes): phase A all run, its refresh interval never
            # past 8 or 16 (a variance that keeps following the gradients; no local steps).
            "zero_one_refresh8": {"var_freeze_step": 100_000},
            "zero_one_refresh16": {"var_freeze_step": 100_000},
            # The paper's frozen variance (follow_variance=False, issue 44).
            "zero_one_frozen": {"follow_variance": False},
            # The paper's variance, moved by the refresh steps' averaged gradients alone
            # (local_variance=False; issue 44), and with its blocks following.
            "zero_one_paper": {"local_variance": False},
            "zero_one_paper_follow": {"local_variance": False, "follow_variance": True},
            # Every tensor sends m, as the paper's (sparse_rows=False; issue 44).
            "zero_one_m_wire": {"sparse_rows": False},
            # A diagnostic (benchmarks/wire_probe.py): every unit sends m / denom, clamped at 1
            # or 3 (sparse_rows sends it for the tensors sparse in rows alone).
            "zero_one_od1": {}, "zero_one_od3": {}}
REFRESH_CAP = {"zero_one_refresh8": 8, "zero_one_refresh16": 16}
# 1-bit Adam at fixed freeze steps other than FIXED_FREEZE (0/1 Adam's comparisons).
ONEBIT_FIXED = {"onebit_fixed240": 240}
# 1-bit Adam whose variance follows the gradients after the freeze (refresh_interval, issue 44):
# (freeze_step, refresh_interval).
ONEBIT_REFRESH = {"onebit_auto_refresh16": ("auto", 16), "onebit_auto_refresh32": ("auto", 32),
                  "onebit_fixed240_refresh16": (240, 16), "onebit_fixed240_refresh32": (240, 32)}
# What the frozen variance costs apart from the compression: the same freeze ("auto"), the
# momentum averaged exactly (compress_momentum=False).
ONEBIT_EXACT = ("onebit_auto_exact",)
# The paper's frozen variance: the denominators do not follow (follow_variance=False).
ONEBIT_FROZEN = ("onebit_auto_frozen",)
# 1-bit LAMB on the large-batch workload: LAMB itself (never frozen), 1-bit LAMB's defaults
# (freeze_step="auto"), and Adam at three learning rates.
# What costs what: the same freeze with the momentum averaged exactly (the frozen ratio and
# variance alone), and without the bound.
LAMB = {"lamb": {"freeze_step": 10**9}, "onebit_lamb": {"freeze_step": "auto"},
        "onebit_lamb_exact": {"freeze_step": "auto", "compress_momentum": False},
        "onebit_lamb_unbounded": {"freeze_step": "auto", "bound_update": False}}
ADAM_LRS = {"adam_lr1e-3": 1e-3, "adam_lr3e-3": 3e-3, "adam_lr1e-2": 1e-2}
# warmup_bits (issue 45): a member's full-precision steps in bf16 or int8, "<variant>_w16" and
# "<variant>_w8" for each of these, compared with the same reference as the variant.
WARMUP_BITS = {f"{v}_w{bits}": (v, bits) for v in ("onebit_auto", "onebit_fixed", "zero_one",
                                                    "onebit_lamb", *REFRESH_CAP,
                                                    *ONEBIT_REFRESH)
               for bits in (16, 8)}
ALL_VARIANTS = (VARIANTS + list(ONEBIT_FIXED) + list(ONEBIT_REFRESH) + list(ONEBIT_EXACT)
                + list(ONEBIT_FROZEN) + list(ZERO_ONE) + list(LAMB) + list(ADAM_LRS)
                + list(WARMUP_BITS))
# The two-level topology (issue 46), with --world 4 --local-world-size 2: "<variant>_flat" and
# "<variant>_hier" for each member's variant, topology "flat" or "hierarchical".
TOPOLOGY = {"_flat": "flat", "_hier": "hierarchical"}
ALL_VARIANTS += tuple(v + suffix for v in ("onebit_auto", "zero_one", "onebit_lamb",
                                           "onebit_auto_w8", "zero_one_w8")
                      for suffix in TOPOLOGY)
# Sharded (issue 47), with --world 4 --local-world-size 2: the model under FSDP2, hosts of
# LOCAL ranks. "hsdp_adam": native HSDP (a 2-D mesh) with torch's Adam; the members: each
# parameter sharded over the host's ranks and exchanged across hosts by the optimizer
# (process_group=mesh["replicate"]), at their defaults.
HSDP = {"hsdp_adam": None, "hsdp_onebit_auto": "onebit_auto", "hsdp_zero_one": "zero_one"}
ALL_VARIANTS += tuple(HSDP)
WORLD, LOCAL = 2, None  # --world, --local-world-size
# The collectives a rank calls, counted by wrapping torch.distributed's functions (DDP's own
# C++ allreduce is not one of them: the plain-Adam variants average through an equal Python
# hook so that theirs are counted too). "Rounds": calls per optimizer step.
COLLECTIVES = ("all_reduce", "all_to_all_single", "all_gather", "broadcast",
               "all_gather_into_tensor", "reduce_scatter_tensor", "gather", "scatter", "send",
               "recv", "barrier")


def _topology(variant: str) -> tuple[str, dict]:
    """A variant without its topology suffix, and the topology keyword it asks for."""
    for suffix, topology in TOPOLOGY.items():
        if variant.endswith(suffix):
            return variant[: -len(suffix)], {"topology": topology}
    return variant, {}


def reference(variant: str) -> str:
    """The run a variant is compared with."""
    if variant in HSDP:
        return "hsdp_adam"
    variant = _topology(variant)[0]
    variant = WARMUP_BITS.get(variant, (variant, 32))[0]
    if "bf16" in variant or variant.endswith("compact_errors"):
        return "onebit_auto"
    if variant in LAMB or variant in ADAM_LRS:
        return "lamb"
    return "adam_clip" if "clip" in variant else "adam"


def _clip(variant, ddp, opt) -> float | None:
    """Clip as the variant says; the norm it clipped by (None: no clipping)."""
    if variant == "onebit_auto_clip":
        return float(opt.clip_grad_norm_(CLIP))
    if variant in ("adam_clip", "onebit_auto_clip_momentum"):
        # The latter is torch's clipping of p.grad, which in 1-bit Adam's compression stage
        # holds the averaged momentum: what clipping did before OneBitAdam.clip_grad_norm_.
        return float(nn.utils.clip_grad_norm_(ddp.parameters(), CLIP))
    return None


# ----------------------------------------------------------------------------- one run
def _sharded(variant, model, lr):
    """An HSDP variant's model (sharded in place) and optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from onebit_plugin import OneBitAdam, ZeroOneAdam

    mesh = init_device_mesh("cpu", (WORLD // LOCAL, LOCAL), mesh_dim_names=("replicate", "shard"))
    member = HSDP[variant]
    fully_shard(model, mesh=mesh if member is None else mesh["shard"])
    if member is None:
        return torch.optim.Adam(model.parameters(), lr=lr)
    group = mesh["replicate"].get_group()
    common = {"lr": lr, "total_steps": STEPS, "max_skipped_steps": STEPS + 1,
              "process_group": group}
    if member == "zero_one":
        return ZeroOneAdam(model.parameters(), **common, **ZERO_ONE[member])
    return OneBitAdam(model.parameters(), freeze_step="auto", **common)


def _optimizer(variant, ddp, lr):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from onebit_plugin import OneBitAdam
    from onebit_plugin.entry.ddp_hook import register_onebit_hook

    variant, topology = _topology(variant)
    variant, bits = WARMUP_BITS.get(variant, (variant, 32))

    if variant in LAMB:
        from onebit_plugin import OneBitLamb

        opt = OneBitLamb(ddp.parameters(), lr=lr, weight_decay=0.01, total_steps=STEPS,
                         max_skipped_steps=STEPS + 1, warmup_bits=bits, **LAMB[variant],
                         **topology)
        register_onebit_hook(ddp, opt)
        return opt
    if variant in ADAM_LRS:
        ddp.register_comm_hook(None, _mean_allreduce)
        return torch.optim.Adam(ddp.parameters(), lr=ADAM_LRS[variant])
    if variant in ZERO_ONE:
        from onebit_plugin import ZeroOneAdam

        if variant == "zero_one_exact_sync":
            _exact_syncs()
        if variant in REFRESH_CAP:
            _capped_refreshes(REFRESH_CAP[variant])
        opt = ZeroOneAdam(ddp.parameters(), lr=lr, total_steps=STEPS,
                          max_skipped_steps=STEPS + 1, warmup_bits=bits, **ZERO_ONE[variant],
                          **topology)
        register_onebit_hook(ddp, opt)
        if variant in ("zero_one_od1", "zero_one_od3"):
            import wire_probe

            wire_probe.over_denominator(opt, float(variant[-1]))
        return opt
    if variant.startswith("onebit"):
        freeze, refresh = ONEBIT_REFRESH.get(variant, (ONEBIT_FIXED.get(variant, "auto"), None))
        # Skipped steps (inf/NaN gradients) are counted and reported, not fatal.
        opt = OneBitAdam(ddp.parameters(), lr=lr, total_steps=STEPS, max_skipped_steps=STEPS + 1,
                         warmup_bits=bits, refresh_interval=refresh,
                         freeze_step=FIXED_FREEZE if variant == "onebit_fixed" else freeze,
                         bound_update=variant != "onebit_auto_unbounded",
                         compress_momentum=variant not in ONEBIT_EXACT,
                         follow_variance=variant not in ONEBIT_FROZEN,
                         master_weights=variant.endswith("_master"), **topology,
                         error_dtype="bfloat16" if variant.endswith("compact_errors")
                         else "float32")
        register_onebit_hook(ddp, opt)
        return opt
    if variant == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif variant == "powersgd":
        # Rank 2, exact allreduce for the same warm-up as 1-bit's fixed freeze.
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                            start_powerSGD_iter=FIXED_FREEZE)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:  # DDP's default averaging, in Python so that its allreduces are counted
        ddp.register_comm_hook(None, _mean_allreduce)
    return torch.optim.Adam(ddp.parameters(), lr=lr)


def _exact_syncs() -> None:
    """A diagnostic, not a setting: 0/1 Adam's syncs averaged by an exact fp32 allreduce instead
    of the 1-bit one (this rank's process only), to tell the local steps' own cost from the
    sync's compression error. Reaches into ``onebit_plugin.members.local_steps`` on purpose."""
    from onebit_plugin.members import local_steps

    class Exact:
        @staticmethod
        def reduce_(buffer, plan, errors):
            dist.all_reduce(buffer)
            buffer.div_(dist.get_world_size())
            return True

    send = local_steps.LocalSteps.send_
    local_steps.LocalSteps.send_ = (
        lambda self, units, comm, groups, fp32_of, corrections:
        send(self, units, Exact(), groups, fp32_of, corrections))


def _capped_refreshes(cap: int) -> None:
    """A diagnostic, not a setting: 0/1 Adam's refresh interval stops doubling at ``cap`` (this
    rank's process only; every rank patches the same), so that with phase A all run the
    variance keeps following the gradients at one refresh every ``cap`` steps. Reaches into
    ``onebit_plugin.settings.schedule`` on purpose."""
    from onebit_plugin.settings import schedule

    original = schedule.refreshes_variance

    def refreshes_variance(t: int, scaler: int) -> bool:
        phase_a = schedule.ZeroOneSchedule(10**9, scaler, 1, 1)  # its interval at t, phase A
        return original(t, scaler) if phase_a.interval(t) <= cap else t % cap == 0

    schedule.refreshes_variance = refreshes_variance


def _mean_allreduce(_, bucket):
    """DDP's default reduction, bits included (multiply by 1/W, then sum)."""
    buffer = bucket.buffer().mul_(1.0 / dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


def _count_collectives() -> list[int]:
    """Wrap torch.distributed's collectives; the one-element list counts their calls."""
    calls = [0]
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counted(*args, _original=original, **kwargs):
            calls[0] += 1
            return _original(*args, **kwargs)
        setattr(dist, name, counted)
    return calls


def _rank(rank, world, port, workload, variant, seed, queue):
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if LOCAL is not None:  # hosts of LOCAL ranks (the topology's layout)
            os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        work = WORKLOADS[workload]()
        torch.manual_seed(seed)  # the same initial weights on every rank
        model = work.model()
        bf16 = "bf16" in variant
        if bf16:
            model.to(torch.bfloat16)
        # PowerSGD chains its allreduces in future callbacks, which gloo runs on several
        # threads: with two buckets their order differs between ranks (gloo: "Received data
        # size doesn't match expected size"). One bucket keeps one chain.
        if variant in HSDP:
            ddp, opt = model, _sharded(variant, model, LR or work.lr)
        else:
            ddp = DDP(model, bucket_cap_mb=1000) if variant == "powersgd" else DDP(model)
            opt = _optimizer(variant, ddp, LR or work.lr)
        # A workload's learning-rate schedule (gpt_cosine's), stepped after each optimizer step
        # as Lightning and the transformers Trainer step theirs.
        scheduler = (torch.optim.lr_scheduler.LambdaLR(opt, lambda t: work.schedule(t, STEPS))
                     if hasattr(work, "schedule") else None)
        gen = torch.Generator().manual_seed(1000 * seed + rank)  # each rank its own batches
        curve, clipped = [], 0
        rows = RowWatch(model)
        calls = _count_collectives()
        start, began = written(), time.perf_counter()
        evaluated = {STEPS * k // 6 for k in range(1, 7)}
        for step in range(1, STEPS + 1):
            batch = work.batch_of(gen)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = work.loss(ddp, batch)
            loss.backward()
            norm = _clip(variant, ddp, opt)
            clipped += norm is not None and norm > CLIP
            opt.step()
            if scheduler is not None:
                scheduler.step()
            # Six points, the last at the run's end: with 2,000 steps the last was at 1,998
            # (6 x 333), where 0/1 Adam's ranks were between syncs (each on its own point; the
            # run's last step syncs them), and rank 0's own point was reported.
            if step in evaluated:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    curve.append((step, written() - start, work.val_loss(model)))
        sent = written() - start
        result = {"val_loss": curve[-1][2], "bytes": sent, "curve": curve, "clipped": clipped,
                  "rounds_per_step": calls[0] / STEPS,
                  "seconds": time.perf_counter() - began,
                  "switch_step": getattr(opt, "switch_step", None),
                  "skipped_steps": getattr(opt, "skipped_steps", 0),
                  "max_abs": largest_abs(model), "variance": variance_means(model, opt),
                  "rows": rows.result(model)}
        report(queue, rank, result)
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put((rank, repr(exc).encode()))


class RowWatch:
    """Each embedding table's rows (``nn.Embedding``, ``nn.EmbeddingBag``): which got a local
    gradient on this rank (a hook on the weight, which sees the rank's own gradient before DDP
    averages it) and, at the end, which still hold their initial values exactly."""

    def __init__(self, model):
        self.tables = {}
        for name, module in model.named_modules():
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
                w = module.weight
                touched = torch.zeros(w.shape[0], dtype=torch.bool)
                w.register_hook(functools.partial(_note_rows, touched))
                self.tables[f"{name}.weight"] = (w, w.detach().clone(), touched)

    def result(self, model) -> dict:
        """Per table: this rank's touched rows and the rows unchanged since the start."""
        return {name: {"touched": touched.clone(),
                       "unmoved": w.detach().eq(start).all(1)}
                for name, (w, start, touched) in self.tables.items()}


def _note_rows(touched: torch.Tensor, grad: torch.Tensor) -> None:
    touched.logical_or_(grad.reshape(grad.shape[0], -1).ne(0).any(1))


def rows_never_moved(results: list[dict]) -> dict[str, int]:
    """Per table, the rows some rank gave a gradient that end at their initial values (rank
    0's; the ranks end alike)."""
    out = {}
    for name, table in results[0].get("rows", {}).items():
        touched = torch.stack([r["rows"][name]["touched"] for r in results]).any(0)
        out[name] = int((touched & table["unmoved"]).sum())
    return out


def variance_means(model, opt) -> dict[str, float]:
    """Per tensor, the mean of the optimizer's frozen denominator at the end (1-bit Adam and
    LAMB: ``frozen_denominator``, 0/1 Adam: the last refreshed ``exp_avg_sq``): compared between
    the same member at 32 and fewer ``warmup_bits``, where both hold the same kind of value."""
    out = {}
    for name, p in model.named_parameters():
        state = opt.state.get(p, {})
        v = state.get("frozen_denominator", state.get("exp_avg_sq"))
        if torch.is_tensor(v):
            out[name] = float(v.double().mean())
    return out


def largest_abs(model) -> dict[str, float]:
    # A sharded parameter's whole tensor (a collective: every rank calls this).
    return {n: float((p.full_tensor() if hasattr(p, "full_tensor") else p).detach().abs().max())
            for n, p in model.named_parameters()}


def report(queue, rank: int, result: dict) -> None:
    """A rank's result to the parent (``spawn_ranks``)."""
    payload = io.BytesIO()
    torch.save(result, payload)
    queue.put((rank, payload.getvalue()))


def run(workload, variant, seed, world=None) -> dict:
    world = world or WORLD
    results = spawn_ranks(_rank, world, (workload, variant, seed), f"{workload}/{variant}/seed "
                          f"{seed}")
    out = results[0]
    out["bytes"] = sum(r["bytes"] for r in results) / world  # per rank, mean
    out["never_moved"] = rows_never_moved(results)
    out.pop("rows", None)
    return out


def spawn_ranks(target, world: int, args: tuple, what: str, timeout: float = 600) -> list:
    """``target(rank, world, port, *args, queue)`` on ``world`` forked gloo ranks, each putting
    ``(rank, torch.save'd result or its error text)`` on the queue; the results in rank order.
    A rank that dies or reports an error, or a run past ``timeout`` seconds, raises."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + timeout
    try:
        while len(results) < world:
            if queue.empty():
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"{what}: rank(s) {dead} died without a result" if dead
                                       else f"{what}: timed out")
                time.sleep(0.05)
                continue
            rank, payload = queue.get()
            try:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            except Exception:  # noqa: BLE001 - a rank's error text
                raise RuntimeError(f"{what} rank {rank}: {payload.decode()}") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world)]


# ----------------------------------------------------------------------------- report
def summarize(rows: list[dict]) -> str:
    lines = ["| workload | variant | val loss vs Adam (mean, min..max over seeds) | bytes vs "
             "Adam (fewer) | collectives per step | largest per-tensor max abs vs Adam | freeze "
             "step | steps skipped (inf/NaN), per seed | steps clipped, per seed | variance "
             "vs the member at 32 bits (largest per-tensor gap of means) | embedding rows "
             "with a gradient that never moved, mean per seed (Adam's) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for workload in WORKLOADS:
        for variant in ALL_VARIANTS:
            adam = {r["seed"]: r for r in rows
                    if r["workload"] == workload and r["variant"] == reference(variant)}
            mine = [r for r in rows if r["workload"] == workload and r["variant"] == variant]
            if not mine or not adam:
                continue
            rel = [r["val_loss"] / adam[r["seed"]]["val_loss"] - 1 for r in mine]
            fewer = statistics.mean(adam[r["seed"]]["bytes"] / r["bytes"] for r in mine)
            mag = max(r["max_abs"][k] / adam[r["seed"]]["max_abs"][k]
                      for r in mine for k in r["max_abs"])
            freeze = sorted({r["switch_step"] for r in mine if r["switch_step"] is not None})
            wide = {r["seed"]: r for r in rows if r["workload"] == workload and
                    r["variant"] == WARMUP_BITS.get(variant, (None,))[0]}
            drift = [abs(r["variance"][k] / wide[r["seed"]]["variance"][k] - 1)
                     for r in mine if r["seed"] in wide for k in r.get("variance", {})
                     if wide[r["seed"]].get("variance", {}).get(k)]
            lines.append(
                f"| {workload} | {variant} | {statistics.mean(rel):+.2%} ({min(rel):+.2%}.."
                f"{max(rel):+.2%}) | {fewer:.2f}x | "
                f"{statistics.mean(r.get('rounds_per_step', math.nan) for r in mine):.2f} | "
                f"{mag:.2f}x | "
                f"{', '.join(map(str, freeze)) or '-'} | "
                f"{', '.join(str(r.get('skipped_steps', 0)) for r in mine)} | "
                f"{', '.join(str(r.get('clipped', 0)) for r in mine) if 'clip' in variant else '-'}"
                f" | {f'{max(drift):.2%}' if drift else '-'} | {_never_moved(mine, adam)} |")
    return "\n".join(lines)


def _never_moved(mine: list[dict], adam: dict) -> str:
    """Rows with a gradient that never moved, summed over the tables, mean per seed."""
    def mean(runs):
        counts = [sum(r["never_moved"].values()) for r in runs if r.get("never_moved")]
        return statistics.mean(counts) if counts else None
    own, ref = mean(mine), mean([adam[r["seed"]] for r in mine])
    return "-" if own is None else f"{own:.0f} ({ref:.0f})"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = [w for w in WORKLOADS if any(r["workload"] == w for r in rows)]
    # Loss against bytes above, against step below: a frontier, and when each member gets there.
    fig, axes = plt.subplots(2, len(drawn), figsize=(5 * len(drawn), 8), squeeze=False)
    # A colour per variant of this run (the full list is longer than the palette).
    present = [v for v in ALL_VARIANTS if any(r["variant"] == v for r in rows)]
    for column, workload in enumerate(drawn):
        by_bytes, by_step = axes[0][column], axes[1][column]
        for variant in ALL_VARIANTS:
            mine = [r for r in rows if r["workload"] == workload and r["variant"] == variant]
            finals = [r["val_loss"] for r in mine]
            adam = [r["val_loss"] for r in rows if r["workload"] == workload and
                    r["variant"] == reference(variant)]
            if not mine or not adam or \
                    not all(math.isfinite(v) and v < 2 * max(adam) for v in finals):
                continue  # diverged: in the table, off the plot
            points = len(mine[0]["curve"])
            step = [mine[0]["curve"][i][0] for i in range(points)]
            mb = [statistics.mean(r["curve"][i][1] for r in mine) / 2**20 for i in range(points)]
            loss = [statistics.mean(r["curve"][i][2] for r in mine) for i in range(points)]
            style = dict(marker="o", label=variant, color=f"C{present.index(variant) % 10}",
                         linestyle="--" if "clip" in variant else "-")
            by_bytes.plot(mb, loss, **style)
            by_step.plot(step, loss, **style)
        by_bytes.set_xscale("log")
        # Log ticks between powers of ten are labelled too where a span is short: on their
        # side they overlapped.
        by_bytes.tick_params(axis="x", which="both", labelrotation=45, labelsize=7)
        by_bytes.set_xlabel("MiB written per rank (/proc/self/io)")
        by_step.set_xlabel("optimizer step")
        for ax in (by_bytes, by_step):
            ax.set_ylabel("validation loss (mean of seeds)")
            ax.set_title(workload)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    global STEPS, LR, WORLD, LOCAL
    p = argparse.ArgumentParser(
        description="Accuracy against bytes: Adam, LAMB, 1-bit Adam, 0/1 Adam, 1-bit LAMB (and "
                    "their warmup_bits variants), fp16 compression and PowerSGD on small "
                    "workloads, 2 gloo ranks, several seeds (the module docstring says more).")
    p.add_argument("--seeds", type=int, default=3,
                   help="runs per variant, seeds 0 to N-1 (default %(default)s)")
    p.add_argument("--steps", type=int, default=STEPS,
                   help="optimizer steps per run (default %(default)s)")
    p.add_argument("--workloads", default=",".join(STANDARD),
                   help=f"comma-separated, of: {', '.join(WORKLOADS)}; or one of "
                        f"{', '.join(NAMED)} (default: the standard three)")
    p.add_argument("--lr", type=float, default=None,
                   help="replaces the workloads' own lr (not the adam_lr* variants'): LAMB at "
                        "another lr on large_batch, say")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of: {', '.join(ALL_VARIANTS)} (default: "
                        f"{', '.join(VARIANTS)})")
    p.add_argument("--out", default=None,
                   help="also write the rows to this JSON file (the run's record goes to "
                        "fidelity.jsonl in benchmarks/results/, or in $ONEBIT_RESULTS_DIR, "
                        "in any case)")
    p.add_argument("--plot", default=str(ROOT / "docs" / "fidelity_loss_vs_bytes.png"),
                   help="the loss-vs-bytes plot (default: make fidelity's, a file of docs/: "
                        "give another path for any other run)")
    p.add_argument("--world", type=int, default=2, help="ranks (default %(default)s)")
    p.add_argument("--local-world-size", type=int, default=None,
                   help="ranks per emulated host, as LOCAL_WORLD_SIZE (the *_flat and *_hier "
                        "variants' layout)")
    args = p.parse_args()
    STEPS, LR, WORLD, LOCAL = args.steps, args.lr, args.world, args.local_world_size
    rows = []
    began = time.perf_counter()
    workloads = NAMED.get(args.workloads) or args.workloads.split(",")
    # Checked before any run: an unknown variant would otherwise train as plain Adam (the
    # optimizer's last branch), and an unknown workload fail in the ranks after earlier runs.
    unknown = [w for w in workloads if w not in WORKLOADS] + \
        [v for v in args.variants.split(",") if v not in ALL_VARIANTS]
    if unknown:
        p.error(f"unknown workload(s) or variant(s) {unknown}: see --help for the names")
    for workload in workloads:
        for seed in range(args.seeds):
            for variant in args.variants.split(","):
                r = run(workload, variant, seed)
                r.update(workload=workload, variant=variant, seed=seed, steps=STEPS)
                rows.append(r)
                print(f"{workload:10s} {variant:12s} seed {seed}: val {r['val_loss']:.4f} "
                      f"{r['bytes'] / 2**20:8.2f} MiB/rank  {r['seconds']:.0f} s", flush=True)
    table = summarize(rows)
    saved = [shown(append_run("fidelity", None, {"rows": rows, "table": table}))]
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))
        saved.append(args.out)
    print(table)
    plot(rows, Path(args.plot))
    print(f"{time.perf_counter() - began:.0f} s; {', '.join(saved)}, {args.plot}")


if __name__ == "__main__":
    main()
