"""Checkpoint I/O of the family's base: the per-parameter state kept in fp32 through torch's
loading, and the ``onebit`` entry (stage, counters and this rank's error buffers per momentum
unit). Each rank's errors differ: each rank saves its own and loads its own (the integrations
carry every rank's beside rank 0's checkpoint, ``integrations/rank_states.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from onebit_plugin.core import variance_follow

__all__ = ["Resumed", "load_onebit_state", "load_state", "load_unit_errors", "onebit_state"]

log = logging.getLogger("onebit_plugin")


@dataclass
class Resumed:
    """What a loaded ``onebit`` entry leaves for the momentum units until they are built
    (``OneBitOptimizer.resumed``): this rank's saved errors per unit, the unit size they were
    cut at, the rank that saved them, what they are residuals of, and a member's local-step
    state (0/1 Adam's between syncs). Each is taken (set back to None) when used."""

    units: list | None = None
    unit_cap_bytes: int | None = None
    rank: int | None = None
    sent: str = "momentum"
    local_steps: dict | None = None
    mask_floor: float | None = None


def onebit_state(opt) -> dict:
    """``opt.onebit_state_dict()``."""
    units = ([u.state_dict() for u in opt.layout.units] if opt.layout is not None
             else opt.resumed.units)
    return {"global_step": opt.global_step, "freeze_step": opt.freeze_step,
            "auto_freeze": (opt.auto_freeze.state_dict()
                            if opt.auto_freeze is not None and opt.switch_step is None
                            else None),
            "switch_step": opt.switch_step, "skipped_steps": opt.skipped_steps,
            "world_size": opt.world_size,
            "rank": opt.topology.rank,
            "unit_cap_bytes": opt.unit_cap_bytes, **opt.counts.state_dict(),
            "clipping": opt.handoff.sketch is not None, "units": units,
            # The freeze's negligible root, where asleep rows wake (maths.late_rows): a resume
            # masks from it, not from the denominators as woken rows left them.
            "mask_floor": (opt.layout.mask_floor if opt.layout is not None
                           else opt.resumed.mask_floor),
            "local_steps": opt.policy.rank_state(opt), "syncs": opt.syncs,
            "own_variances": opt.policy.own_variances(opt),
            "variance_clock": "steps", "sent": opt.policy.exchange.sent,
            "warmup_bits": opt.config.warmup_bits,
            # Settled for a compression-stage state (its errors are laid out by it); a warm-up
            # state holds no errors, and settling it there would raise a layout's error early.
            "topology": opt.topology.describe(settle=opt.switch_step is not None)}


def load_state(opt, state_dict: dict, torch_load) -> None:
    """``opt.load_state_dict(state_dict)``; ``torch_load``: torch's ``Optimizer`` loader."""
    onebit = state_dict.get("onebit")
    if onebit is not None:  # before anything is loaded: a refused state leaves nothing behind
        _refuse_refresh_counts(opt, onebit, state_dict["state"].values())
    # torch casts loaded state to each param's dtype; keep our fp32 state fp32.
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    own = [p for g in opt.param_groups for p in g["params"]]
    fp32 = {
        p: {k: v for k, v in state_dict["state"].get(i, {}).items() if torch.is_tensor(v)}
        for i, p in zip(saved_ids, own, strict=False)
    }
    torch_load(state_dict)
    if not opt.config.master_weights and any("master" in t for t in fp32.values()):
        # A stale master would come back, overwriting every update since, the day this
        # state is loaded with master_weights=True: dropped, and said.
        log.warning("onebit: the checkpoint holds fp32 master copies of low-precision "
                    "parameters, this OneBitAdam has master_weights=False: they are dropped "
                    "and the parameters continue from their own (rounded) values")
        for tensors in fp32.values():
            tensors.pop("master", None)
        for p in fp32:
            opt.state[p].pop("master", None)
    for p, tensors in fp32.items():
        for k, v in tensors.items():
            # Step counters stay on the CPU (as torch's Adam keeps them), so that reading
            # them never syncs with a GPU, whatever map_location loaded them to;
            # frozen_step is a number (a tensor in checkpoints of 0.x).
            opt.state[p][k] = (float(v) if k == "frozen_step" else
                               v.to(device="cpu" if k == "step" else p.device, copy=True))
    if opt.policy.follow is None:
        variance_follow.drop_numbers(opt)
    opt._forget_layout()
    if onebit is not None:
        load_onebit_state(opt, onebit)


def load_onebit_state(opt, onebit: dict) -> None:
    """``opt.load_onebit_state_dict(onebit)``."""
    if "units" not in onebit:
        raise ValueError("this OneBitAdam state was saved by an older onebit-plugin "
                         "(no momentum units); resume it with that version")
    _refuse_refresh_counts(opt, onebit, [opt.state[p] for p in opt.trainable()])
    saved_world = onebit["world_size"]
    if onebit["switch_step"] is not None and saved_world != opt.world_size:
        onebit = _restart_error_feedback(opt, onebit, saved_world)
    elif onebit["switch_step"] is not None and onebit["units"] is not None and \
            onebit.get("topology", "flat") != opt.topology.describe():
        onebit = _restart_for_topology(opt, onebit)
    if onebit["freeze_step"] != opt.freeze_step:
        log.warning(
            "onebit: the checkpoint has freeze_step=%s, this optimizer %s: %s",
            onebit["freeze_step"], opt.freeze_step,
            f"it is ignored, the variance was frozen after step {onebit['switch_step']}"
            if onebit["switch_step"] is not None else "the new value applies")
    saved_bits = onebit.get("warmup_bits", 32)  # absent before warmup_bits: fp32
    if saved_bits != opt.config.warmup_bits:
        # Nothing carries over between full-precision steps (no error feedback): allowed.
        log.warning("onebit: the checkpoint's full-precision steps were sent at warmup_bits=%s, "
                    "this optimizer's at %s: the steps from now on use %s", saved_bits,
                    opt.config.warmup_bits, opt.config.warmup_bits)
    opt.global_step = int(onebit["global_step"])
    opt.switch_step = onebit["switch_step"]
    auto = onebit.get("auto_freeze")
    if opt.auto_freeze is not None and auto is not None:  # resumed mid warm-up
        opt.auto_freeze.load_state_dict(auto, [p.device for p in opt.trainable()])
    opt.skips.total = int(onebit["skipped_steps"])
    opt.syncs = int(onebit.get("syncs", 0))  # absent before 0/1 Adam
    opt.counts.load_state_dict(onebit)
    if onebit.get("clipping"):  # so that the hook sketches the first resumed step too
        opt.handoff.start_sketching(opt.trainable())
    opt.resumed = Resumed()
    if onebit["units"] is not None:
        # Whose errors they are is checked when the units take them (load_unit_errors): the
        # integrations load rank 0's whole state first, then each rank's own errors.
        opt.resumed = Resumed(units=onebit["units"], unit_cap_bytes=onebit["unit_cap_bytes"],
                              rank=onebit.get("rank"),  # absent in states saved before it
                              sent=onebit.get("sent", "momentum"),  # absent: the momentum
                              mask_floor=onebit.get("mask_floor"))  # absent before it
    opt._forget_layout()
    opt.policy.load_rank_state(opt, onebit.get("local_steps"))
    opt.policy.load_own_variances(opt, onebit.get("own_variances"))


def _refuse_refresh_counts(opt, onebit: dict, states) -> None:
    """A 0/1 Adam state saved in phase A (``states``: its per-parameter states, which hold the
    variance until phase B) before ``variance_clock``: its ``frozen_step`` counted the
    variance's refreshes, which now count the steps each stands for (``ZeroOnePolicy``), so its
    variance would be weighted and bias-corrected wrongly from the next refresh on."""
    if onebit.get("variance_clock") == "steps" or not opt.policy.keeps_variance or \
            onebit["switch_step"] is None:
        return
    if any("exp_avg_sq" in s for s in states):
        raise ValueError(
            f"this ZeroOneAdam state was saved in phase A (step {onebit['global_step']}) by "
            "onebit-plugin before commit 120a7c6 (its 'onebit' entry has no 'variance_clock'): "
            "its variance refreshes counted one step each, and a refresh now stands for every "
            "step since the previous one (docs/usage.md, \"0/1 Adam\"); the saved variance "
            "does not convert. Nothing was loaded. Resume it with a checkout before 120a7c6 "
            "up to phase B (var_freeze_step) and save there: phase-B checkpoints load")


def _restart_error_feedback(opt, onebit: dict, saved_world: int) -> dict:
    """``onebit`` without its error buffers, said once (rank 0): a compression-stage state
    saved by another number of ranks (an elastic restart after losing a node). Each rank's
    errors belong to its own share of every exchange, and the server's are cut into as many
    chunks as there were ranks, so no mapping onto another world size is right; the momentum,
    the frozen variance and the step are every rank's alike and carry on. DeepSpeed restarted
    the error feedback on every load; here only when the world size changed."""
    if onebit.get("local_steps") is not None:
        raise ValueError(
            f"this ZeroOneAdam state was saved between two syncs by {saved_world} ranks and is "
            f"loaded by {opt.world_size}: between syncs every rank holds its own parameters, "
            "which do not map onto another number of ranks; resume with the same world size, "
            "or from a checkpoint written at a sync (call sync_local_steps() before saving)"
        )
    if opt._rank == 0:
        log.warning(
            "onebit: resuming a compressed stage (compressing since after step %s) saved by "
            "%d ranks on %d: error buffers are per rank and do not map onto another world "
            "size, so the error feedback restarts from zero; the momentum, variance and step "
            "carry on. The run goes on from there, not bit for bit as the uninterrupted one; "
            "what that cost (benchmarks/elastic_resume.py) is in docs/limits.md, \"Another "
            "world size\"", onebit["switch_step"], saved_world, opt.world_size)
    return dict(onebit, units=None)


def _restart_for_topology(opt, onebit: dict) -> dict:
    """``onebit`` without its error buffers, said once (rank 0): a compression-stage state
    saved under another topology (``onebit_plugin.comm.topology``), whose errors are laid out
    over other slices and groups (hierarchical: each rank's over its 1/L of every unit)."""
    if opt._rank == 0:
        log.warning(
            "onebit: resuming a compressed stage saved with topology %s under topology %s: "
            "the error buffers are laid out by topology and do not map onto another, so the "
            "error feedback restarts from zero; the momentum, variance and step carry on. The "
            "run goes on from there, not bit for bit as the uninterrupted one (as after a "
            "change of world size, docs/limits.md, \"Another world size\")",
            onebit.get("topology", "flat"), opt.topology.describe())
    return dict(onebit, units=None)


def load_unit_errors(opt, saved: list[dict]) -> None:
    """Give the units just built their saved error buffers, if this rank saved them."""
    units = opt.layout.units
    if len(saved) != len(units):
        raise ValueError(f"the checkpoint holds {len(saved)} momentum units, this "
                         f"optimizer has {len(units)}")
    rank = opt.topology.rank
    saved_by, sent = opt.resumed.rank, opt.resumed.sent
    opt.resumed.rank, opt.resumed.sent = None, "momentum"
    errors = any(set(state) - {"numel"} for state in saved)  # none when exact
    if errors and sent != opt.policy.exchange.sent:
        if rank == 0:
            log.warning(
                "onebit: the checkpoint's error buffers are residuals of the %s, and this "
                "optimizer sends the %s (1-bit LAMB sends m / denom since 2026-12-03, "
                "docs/usage.md): they do not convert and are not loaded; the error feedback "
                "restarts from zero (as DeepSpeed's did at every load), so the run goes on "
                "from the checkpoint but not bit for bit", sent, opt.policy.exchange.sent)
        return  # the errors stay zero
    if errors and saved_by is not None and saved_by != rank:
        log.warning(
            "onebit: rank %d resumes from a %s state that rank %d saved in the "
            "compression stage: its error buffers are rank %d's (every rank's differ) and are "
            "not loaded; this rank's error feedback restarts from zero, so the run is not the "
            "uninterrupted one. Save every rank's optimizer.onebit_state_dict() and load each "
            "rank's own with load_onebit_state_dict() after load_state_dict() (the Lightning "
            "and Fabric strategies, onebit-run's Accelerate flag and Trainer patch do; "
            "examples/train_torchrun.py --ckpt-dir shows it in a plain loop)",
            rank, type(opt).__name__, saved_by, saved_by)
        return  # the errors stay zero
    plan = units[0].plan if units else None
    theirs = next((d for s in saved if (d := plan.error_dtype_of(s)) is not None), None) \
        if plan is not None else None
    ours = plan.error_dtype_of(units[0].errors) if plan is not None else None
    if theirs is not None and ours is not None and theirs != ours:
        log.warning("onebit: rank %d's checkpoint holds %s error buffers and this optimizer "
                    "keeps %s ones (error_dtype): they are converted%s, so the run goes on "
                    "from them but is not bit for bit the one that saved them", rank,
                    str(theirs).removeprefix("torch."), opt.config.error_dtype,
                    " (rounded to nearest once)" if theirs == torch.float32 else " exactly")
    for unit, state in zip(units, saved, strict=True):
        unit.load_state_dict(state)
