"""Checks that keep the ranks in lockstep, each taken on every rank before any collective of the
step it guards, so that no rank diverges or waits on a peer that raised: the same settings and
parameters everywhere (first step and first after a resume), gradients that something averaged
(DDP's reducer under the hook), parameters inside the layout frozen at the stage change.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from onebit_plugin.comm.collectives import wait_collectives
from onebit_plugin.maths.update import say_if_rounded_away

__all__ = ["check_gradients", "check_params", "check_ranks_agree", "check_reduced",
           "check_settings_agree", "check_trainable", "grad_fingerprint", "name_params",
           "reject_sharded"]

log = logging.getLogger("onebit_plugin")

SUPPORTED_SETUPS = (
    "plain torch.distributed (OneBitAdam averages by itself), DDP with register_onebit_hook, "
    "Lightning strategy='onebit_adam', Accelerate with ONEBIT_ADAM=1, FSDP2 over one mesh "
    "dimension (fully_shard(m, mesh=mesh['shard'])) with process_group=mesh['replicate']"
    ".get_group()"
)


def name_params(param_groups: list[dict], params: set) -> str:
    """``params`` as a message names them: their place in the param groups and shape."""
    where = [f"group {g} #{i} {tuple(p.shape)}" for g, group in enumerate(param_groups)
             for i, p in enumerate(group["params"]) if p in params]
    shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
    return f"{len(where)} trainable parameter(s) ({shown}) are"


def check_trainable(param_groups, trainable: list, hook_params: set | None,
                    unit_params: set | None, switch_step: int | None) -> None:
    """Every trainable parameter is in the DDP model's reducer (under the hook) and, in the
    compression stage, in a momentum unit."""
    trainable_set = set(trainable)
    outside_ddp = trainable_set - hook_params if hook_params is not None else set()
    if outside_ddp:
        raise ValueError(
            f"onebit: {name_params(param_groups, outside_ddp)} not in the DDP model's reducer "
            "(frozen when DDP wrapped the model, unfrozen since?): DDP would never average their "
            "gradients and the ranks would drift apart. Unfreeze them before wrapping the "
            "model in DDP (Lightning's BackboneFinetuning: use another strategy or train "
            "all parameters)")
    outside_units = trainable_set - unit_params if unit_params else set()
    if outside_units:
        raise ValueError(
            f"onebit: {name_params(param_groups, outside_units)} in no momentum unit: not "
            f"trainable when the variance froze after step {switch_step}, and the compressed "
            "momentum's layout is fixed then. Make them trainable before the freeze "
            "(freeze_step) or keep them frozen for the rest of the run (a parameter "
            "trainable at the freeze may be frozen and unfrozen again afterwards)")


def check_reduced(param_groups, trainable: list, reduced: set) -> None:
    """Under the DDP hook in warm-up, every gradient ``step()`` is about to use must have been
    averaged by it: a bucket DDP never found ready (a parameter without a gradient under
    ``find_unused_parameters=False``; every backward under ``no_sync()``) leaves each rank's own
    gradients, and stepping on them would make the ranks drift apart (DDP says so only at the
    next forward, after this step)."""
    missing = {p for p in trainable if p.grad is not None and p not in reduced}
    if missing:
        raise ValueError(
            f"onebit: {name_params(param_groups, missing)} not averaged by DDP in this iteration "
            "(their bucket never became ready: a parameter that got no gradient while "
            "find_unused_parameters=False, or backward only under no_sync()); stepping on "
            "each rank's own gradients would make the ranks drift apart, so this step is "
            "refused. Pass find_unused_parameters=True to DDP, or leave no_sync() for the "
            "last micro-batch's backward")


def check_once_each(index: int, params: list) -> None:
    """Each parameter at most once in param group ``index``: torch only warns; one parameter
    stepped twice per step is not Adam (its step count would advance twice), and a momentum
    unit would hold it twice."""
    if len(set(params)) != len(params):
        seen: set = set()
        twice = next(i for i, p in enumerate(params) if p in seen or seen.add(p))
        raise ValueError(
            f"onebit: a parameter appears more than once in one parameter group (group "
            f"{index}, again at #{twice}, shape {tuple(params[twice].shape)}); pass each "
            "parameter once")


def check_launched() -> None:
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and not dist.is_initialized():
        raise RuntimeError(f"onebit: this process is one of WORLD_SIZE={launched} (torchrun?) "
                           "but torch.distributed is not initialised, so it would train "
                           "alone; call torch.distributed.init_process_group() first")


def check_settings_agree(config: dict, param_groups, params: list, grad_print: torch.Tensor,
                         world: int, group, timeout, step: int,
                         sync_point: list | None = None, member: str = "OneBitAdam") -> bool:
    """First step (and first after a resume): every rank must run the same ``config`` (name:
    int), or the ranks would switch stages at different steps or lay the units out
    differently, and hold the same parameters. ``grad_print``: :func:`grad_fingerprint`.
    ``sync_point``: between syncs of local steps, where the parameters differ by design, the
    last sync's point (flat tensors), which must agree instead. Returns whether the gradients
    were identical on every rank (something averaged them)."""
    if sync_point is not None:
        params = sync_point
    local = torch.tensor(list(config.values()), dtype=torch.int64)
    # The gradients' fingerprint (float64 bits as int64) and the parameters' travel in the
    # same gather.
    fingerprint = grad_print.view(torch.int64)
    weights = _param_fingerprints(params)
    digest = (weights * torch.arange(1, len(params) + 1)).sum().reshape(1)  # int64, wraps
    gathered = _gather(torch.cat([local, fingerprint, digest]), params, world, group, timeout,
                       "the settings check")
    prints = {tuple(g[len(config):len(config) + 2].tolist()) for g in gathered}
    for i, name in enumerate(config):
        values = [int(g[i]) for g in gathered]
        if len(set(values)) > 1:
            raise ValueError(
                f"{member}'s {name} differs between ranks: {values} (rank "
                f"0..{world - 1}); every rank must use the same settings and parameters"
            )
    if len({int(g[-1]) for g in gathered}) > 1 and sync_point is not None:
        raise ValueError(
            f"onebit: the ranks resumed between syncs from different sync points at step "
            f"{step}: every rank must load its own state of the same checkpoint")
    if len({int(g[-1]) for g in gathered}) > 1:  # as many parameters everywhere (above)
        every = _gather(weights, params, world, group, timeout, "the parameters check")
        differ = {p for i, p in enumerate(params) if len({int(w[i]) for w in every}) > 1}
        raise ValueError(
            f"onebit: {name_params(param_groups, differ)} not the same on every rank at step "
            f"{step}: each rank would train a model of its own (without "
            "DDP nothing makes them equal). Start every rank from the same weights: the "
            "same torch.manual_seed before building the model, one checkpoint loaded by "
            "every rank, or rank 0's broadcast (for p in model.parameters(): "
            "torch.distributed.broadcast(p.data, src=0)), as DDP does when it wraps a model"
        )
    return len(prints) == 1 and fingerprint[1] != 0


def _gather(local: torch.Tensor, params: list, world: int, group, timeout,
            what: str) -> list[torch.Tensor]:
    """Every rank's ``local`` (int64, as long on every rank)."""
    if params and params[0].is_cuda:  # NCCL gathers device tensors
        local = local.to(params[0].device)
    gathered = [torch.empty_like(local) for _ in range(world)]
    work = dist.all_gather(gathered, local, group=group, async_op=True)
    wait_collectives([work], timeout, what, group)
    return [g.cpu() for g in gathered]


def grad_fingerprint(params: list[torch.Tensor], averaged_by_us: bool) -> torch.Tensor:
    """Sum and sum of squares of this rank's gradients (float64, on the CPU), or zeros when
    they were averaged on purpose (the DDP hook, ``clip_grad_norm_``: identical by design). Each
    rank computes its gradients from its own data, so identical fingerprints on every rank mean
    that something averaged them before ``step()``."""
    out = torch.zeros(2, dtype=torch.float64)
    if averaged_by_us:
        return out
    # One gradient in float64 at a time (all at once were 8 more bytes per parameter alive
    # together on the device, at the first step and the first after every resume).
    sums = []
    for p in params:
        if p.grad is not None:
            g = p.grad.detach().double()
            sums.append(torch.stack([g.sum(), g.square().sum()]))
            del g
    if sums:  # the first step only: one host sync for the whole check
        out = torch.stack(sums).sum(0).cpu()
    return out


def say_averaged_elsewhere(world: int) -> None:
    log.warning(
        "onebit: the gradients reaching OneBitAdam.step() are identical on all %d ranks: "
        "something already averaged them (DDP without the 1-bit hook, FSDP, another "
        "wrapper), so each step also sends a full fp32 allreduce: twice DDP's bytes in "
        "warm-up (its allreduce and OneBitAdam's), and DDP's full allreduce on top of the "
        "1-bit exchange after the freeze; compression_ratio reports nan. Fix: Lightning "
        "Trainer(strategy='onebit_adam'); Fabric(strategy='onebit_adam'); Accelerate "
        "scripts and transformers.Trainer: launch with "
        "`onebit-run accelerate launch ...`; your own DDP model: "
        "onebit_plugin.register_onebit_hook(ddp_model, optimizer) before the first backward; "
        "no DDP: pass the bare model to OneBitAdam and drop your own gradient allreduce. "
        "(If every rank trained on the same "
        "batch, give each rank its own data.)", world)


def _param_fingerprints(params: list[torch.Tensor]) -> torch.Tensor:
    """Per parameter, the sum of its values' bit patterns as integers (int64, wrapping), on the
    CPU: equal on two ranks when the values are, whatever the order or the number of threads
    that summed them (a float sum's rounding depends on both)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    sums = [p.detach().reshape(-1).view(ints.get(p.element_size(), torch.uint8))
            .sum(dtype=torch.int64) for p in params]
    return torch.stack(sums).cpu() if sums else torch.zeros(0, dtype=torch.int64)


def check_params(params: list[torch.Tensor], owner: str, master_weights: bool) -> None:
    """At construction: no parameters sharded out of sight, all on one device; parameters
    whose dtype rounds updates away said (``update.say_if_rounded_away``)."""
    reject_sharded(params)
    say_if_rounded_away(params, master_weights)
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"{owner} needs all parameters on one device, got "
                         f"{sorted(map(str, devices))}")


def check_gradients(name: str, trainable: list[torch.Tensor], step: int, said: bool) -> bool:
    """At each ``step`` of an optimizer of the family (its class ``name``): sparse gradients
    refused; a step where none of the trainable parameters has a gradient is said unless
    ``said`` (the optimizer keeps it: once per process); returns whether it said it now. Most
    often the model's parameters were replaced after the optimizer was made: ``fully_shard``
    (FSDP2), which marks the tensors it replaced (``_fsdp_orig_uid``): that is
    a ``ValueError`` naming the fix; another wrapper that makes new parameters is said."""
    some = False  # one pass over the parameters: this runs every step
    for p in trainable:
        if p.grad is not None:
            some = True
            if p.grad.is_sparse:
                raise ValueError(f"{name} does not support sparse gradients")
    if some or not trainable:
        return False
    replaced = sum(hasattr(p, "_fsdp_orig_uid") for p in trainable)  # FSDP2 marks what it replaced
    if replaced:
        raise ValueError(
            f"{name} was made before fully_shard sharded the model: {replaced} of "
            f"its {len(trainable)} parameters are tensors fully_shard replaced (no loss reaches "
            "them, so the whole run would train nothing). Make the optimizer after sharding: "
            "fully_shard(...) first, then the optimizer over model.parameters()")
    if said:
        return False
    log.warning(
        "onebit: step %d of %s found no gradient on any of its %d trainable parameters: "
        "nothing moves. If the model was sharded (fully_shard) or wrapped after the optimizer "
        "was made, its parameters are new tensors: make the optimizer over model.parameters() "
        "after sharding. (Said once by each process.)", step, name, len(trainable))
    return True


def reject_sharded(params: list[torch.Tensor]) -> None:
    """FSDP1's flat parameters and DeepSpeed ZeRO hand the optimizer shards of parameters that
    the family cannot tell apart from whole ones; it would average unrelated shards across
    ranks. (FSDP2's DTensors say what they are: ``onebit_plugin.comm.shards`` steps them.)"""
    for p in params:
        kind = None
        if getattr(p, "_is_flat_param", False) or hasattr(p, "_fsdp_flattened"):
            kind = "FSDP-flattened"
        elif hasattr(p, "ds_id") or hasattr(p, "ds_tensor"):
            kind = "DeepSpeed ZeRO-partitioned"
        if kind is not None:
            raise ValueError(f"OneBitAdam got {kind} parameters; it supports unsharded data "
                             f"parallelism only: {SUPPORTED_SETUPS}")


def check_ranks_agree(opt, params: list[torch.Tensor]) -> None:
    """The first step's check (and the first after a load) of ``opt``, a member of the family
    (a friend function on its privates, as ``onebit_plugin.core.checkpoint``'s): every rank runs the
    same settings and holds the same parameters (between syncs of local steps, where those
    differ by design, the same sync point); said once when the gradients were already the same
    everywhere (something else averaged them)."""
    check_launched()
    if opt.world_size == 1:
        return
    settings = {
        **opt.config.agreement(opt.auto_freeze.total_steps if opt.auto_freeze else None),
        **opt.policy.agreement(opt.run_length.total), **opt.topology.agreement(),
        "bucket bytes": opt.unit_cap_bytes, "global_step": opt.global_step,
        "trainable parameters": len(params),
        "trainable values": sum(p.numel() for p in params),
    }
    grads = grad_fingerprint(params, opt.hooked_params is not None or opt.handoff.grads_averaged)
    sync_point = opt.policy.sync_point(opt)
    same = check_settings_agree(settings, opt.param_groups, params, grads, opt.world_size,
                                opt.comm_group, opt.comm_timeout, opt.global_step, sync_point,
                                type(opt).__name__)
    if same and not opt.averaged_elsewhere:
        opt.averaged_elsewhere = True
        say_averaged_elsewhere(opt.world_size)
