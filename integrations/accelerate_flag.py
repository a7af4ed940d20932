"""The Accelerate flag: ``ONEBIT_ADAM=1 accelerate launch train.py`` turns 1-bit Adam on.

A script opts in once, by importing its ``Accelerator`` from here instead of ``accelerate``::

    from onebit_plugin.integrations.accelerate_flag import Accelerator

With the flag off this class *is* ``accelerate.Accelerator`` in behaviour (``prepare`` hands
everything to it untouched). With ``ONEBIT_ADAM=1`` in the environment -- ``accelerate launch``
passes the environment to every process -- ``prepare()``:

* replaces each ``torch.optim.Adam``/``AdamW`` it is given by a ``OneBitAdam`` over the *same*
  param-group dicts (so LR schedulers built on the original keep working, and are re-pointed at
  the new optimizer), with the same lr, betas, eps, weight decay and AdamW semantics;
* registers OneBitAdam's DDP comm hook on the model it wraps in DDP, which it wraps with
  ``gradient_as_bucket_view=True`` (no gradient copies into DDP's buckets and back; the other
  settings of a ``DistributedDataParallelKwargs`` the script gave are kept).

Settings, all read from the environment when ``prepare()`` runs:

* ``ONEBIT_ADAM``: ``1``/``true``/``yes`` turns it on (``0``, unset: off);
* ``ONEBIT_FREEZE_STEP``: warm-up optimizer steps, or ``auto`` (frozen once the variance has
  settled, at most at 20% of ``ONEBIT_TOTAL_STEPS``; a ``transformers.Trainer`` fills that in
  from its ``max_steps``); required when on;
* ``ONEBIT_TOTAL_STEPS``: the run's optimizer steps, for ``auto``;
* ``ONEBIT_OPTIMIZER``: ``onebit_adam`` (default), ``zero_one_adam`` (``ZeroOneAdam``, 0/1
  Adam: no ``ONEBIT_FREEZE_STEP``; ``ONEBIT_VAR_FREEZE_STEP`` and ``ONEBIT_LOCAL_STEP_SCALER``,
  each an int or ``auto``, the default, which needs the run's length) or ``onebit_lamb``
  (``OneBitLamb``, 1-bit LAMB, with ``ONEBIT_FREEZE_STEP``);
* ``ONEBIT_MAX_BLOCK`` (default 2048), ``ONEBIT_SCALE`` (``rms``/``mean``),
  ``ONEBIT_OVERLAP`` (default 1; 0 compresses in ``optimizer.step()`` instead of inside
  backward), ``ONEBIT_TIMEOUT`` (seconds a compressed allreduce may take before the step
  raises ``CommunicationError``), ``ONEBIT_BOUND_UPDATE`` (default 1; 0 is
  ``OneBitAdam(bound_update=False)``), ``ONEBIT_MASTER_WEIGHTS`` (default 0; 1 keeps fp32
  master copies of bf16/fp16 parameters: ``OneBitAdam(master_weights=True)``),
  ``ONEBIT_ERROR_DTYPE`` (``float32``, the default, or ``bfloat16``: compact error buffers,
  ``OneBitAdam(error_dtype="bfloat16")``),
  ``ONEBIT_CPU_KERNEL`` (default 1; 0 runs the CPU compression as torch passes instead of the
  compiled C passes, for every OneBitAdam in the process).

Accelerate's YAML config rejects unknown keys and its ``kwargs_handlers`` reject unknown handler
classes, which is why this is an environment flag read at ``prepare()``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
from pathlib import Path

import accelerate
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from onebit_plugin import (
    MEMBERS,
    EnvSettings,
    OneBitHookState,
    OneBitLamb,
    OneBitOptimizer,
    ZeroOneAdam,
    register_onebit_hook,
)
from onebit_plugin.integrations.ddp_strategies import (
    say_at_exit_if_uncompressed,
    settle_before_teardown,
)
from onebit_plugin.integrations.rank_states import load_rank_states, save_rank_states

__all__ = ["Accelerator", "OneBitSettings", "to_member"]

log = logging.getLogger("onebit_plugin")

# The settings, read from the environment by the core's one reader (onebit_plugin.settings.config).
OneBitSettings = EnvSettings


def to_member(optimizer: torch.optim.Optimizer, settings: OneBitSettings) -> OneBitOptimizer:
    """The member ``settings.optimizer`` names (``ONEBIT_OPTIMIZER``: OneBitAdam by default,
    ZeroOneAdam or OneBitLamb) over ``optimizer``'s own param-group dicts (Adam or AdamW
    only)."""
    member = MEMBERS[settings.optimizer].load()
    if isinstance(optimizer, OneBitOptimizer):
        return optimizer
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise ValueError(
            f"ONEBIT_ADAM=1 replaces torch.optim.Adam or AdamW by {member.__name__}; this "
            f"script passes {type(optimizer).__name__} to prepare()"
        )
    # fused/foreach/capturable choose torch's implementation, not the update: dropped.
    for group in optimizer.param_groups:
        for option in ("amsgrad", "maximize", "differentiable"):
            if group.get(option):
                raise ValueError(f"ONEBIT_ADAM=1 does not support Adam's {option}=True")
    decoupled = isinstance(optimizer, torch.optim.AdamW) or any(
        g.get("decoupled_weight_decay") for g in optimizer.param_groups
    )
    first = optimizer.param_groups[0]
    decay = {"decoupled_weight_decay": decoupled}
    if member is OneBitLamb:  # LAMB adds its decay to the update, before the trust ratio
        decay = {}
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.warning("onebit: the script's %s becomes OneBitLamb with its lr (%g), betas, "
                        "eps and weight_decay: LAMB moves each layer by lr times its trust "
                        "ratio (a fraction of the layer's norm), so Adam's lr is rarely LAMB's; "
                        "its weight decay is added to the update", type(optimizer).__name__,
                        first["lr"])
    # The same dicts: an LR scheduler that edits them drives the new optimizer.
    return member(
        optimizer.param_groups, lr=first["lr"], betas=first["betas"], eps=first["eps"],
        weight_decay=first["weight_decay"], **decay,
        # A transformers.Trainer leaves its max_steps here (transformers_trainer).
        **settings.member_options(settings.total_steps or getattr(
            optimizer, "onebit_total_steps", None)),
    )


def _when(opt) -> str:
    """When the compression stage begins, as far as is known now (the launcher's line)."""
    if isinstance(opt, ZeroOneAdam):
        if opt.total_steps is None and "auto" in (opt.policy.var_freeze_step,
                                                  opt.policy.local_step_scaler):
            return (f"after step {opt.freeze_step} (0/1 Adam; its 'auto' schedule needs the "
                    "run's length, which a transformers.Trainer gives when it makes its "
                    "scheduler; in any other script set ONEBIT_TOTAL_STEPS or onebit-run "
                    f"--total-steps, or step {opt.freeze_step + 1} raises)")
        schedule = opt.policy.schedule(opt.total_steps)
        refreshes = ("1-bit steps, each rank feeding its own variance and its refresh steps "
                     "averaging them" if opt.policy.local_variance is not None else
                     "1-bit steps and full-precision refreshes of the variance")
        if schedule.total_steps is not None and schedule.last_a >= schedule.total_steps:
            return (f"after step {opt.freeze_step} (0/1 Adam: {refreshes}, to the run's end: "
                    "no local steps in this run)")
        return (f"after step {opt.freeze_step} (0/1 Adam: {refreshes}, to step "
                f"{schedule.last_a}, then local steps, the interval doubling "
                f"every {schedule.local_step_scaler} steps up to "
                f"{schedule.local_step_clipper})")
    if opt.auto_freeze is not None:
        if opt.auto_freeze.ceiling:
            return ("once the variance has settled (freeze_step=auto), at the latest after step "
                    f"{opt.auto_freeze.ceiling}")
        return ("once the variance has settled (freeze_step=auto; its ceiling, "
                f"{opt.auto_freeze.fraction:.0%} of the run, needs the run's length: a "
                "transformers.Trainer gives it, else set ONEBIT_TOTAL_STEPS)")
    reaches = opt.compresses_within_run()
    if reaches is None:
        return (f"after step {opt.freeze_step}, if the run is longer than that (its length is "
                "not known here: ONEBIT_TOTAL_STEPS or onebit-run --total-steps gives it)")
    if not reaches:
        return (f"never: freeze_step={opt.freeze_step} is at or past the run's "
                f"{opt.total_steps} optimizer steps, so the whole run is the uncompressed "
                "warm-up")
    return f"after step {opt.freeze_step} of {opt.total_steps}"


def _mark_step_tracked(optimizer: torch.optim.Optimizer) -> None:
    """What an LR scheduler does to the optimizer it is built on: flag each ``step()`` call, so
    the re-pointed scheduler can check that ``optimizer.step()`` ran before its own step."""
    step = optimizer.step
    if getattr(step, "_wrapped_by_lr_sched", False):
        return

    @functools.wraps(step)
    def tracked(*args, **kwargs):
        optimizer._opt_called = True
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True
    optimizer.step = tracked


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` that applies 1-bit Adam in ``prepare()`` when ``ONEBIT_ADAM``
    is on (see the module docstring). ``onebit`` holds the settings (None when off) and
    ``onebit_hook_state`` the DDP hook's state once registered."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.onebit = OneBitSettings.from_env()
        self.onebit_hook_state: OneBitHookState | None = None
        self._onebit_models: list[DistributedDataParallel] = []
        self._onebit_pending: list[OneBitOptimizer] = []
        self._said_idle = False
        if self.onebit is not None and not getattr(self.ddp_handler, "gradient_as_bucket_view",
                                                   False):
            # Also under a handler of the script's or transformers.Trainer's (which passes its
            # own, with find_unused_parameters): False is the dataclass default, and what it
            # costs is a copy of every gradient into DDP's buckets and back at each step.
            self.ddp_handler = dataclasses.replace(
                self.ddp_handler or accelerate.DistributedDataParallelKwargs(),
                gradient_as_bucket_view=True)
        if self.onebit is not None and self.distributed_type == accelerate.DistributedType.FSDP:
            # Accelerate shards the model inside prepare() and swaps the optimizer's parameters
            # for DTensors behind its back, after the flag built the 1-bit optimizer over whole
            # parameters and the world group: it would average unrelated shards.
            raise ValueError(
                "ONEBIT_ADAM=1 does not support Accelerate's FSDP plugin: the optimizer must be "
                "built over the model's FSDP2 shards and exchange them across hosts only. Shard "
                "with torch's fully_shard over the host's ranks in your own loop, or use "
                "Lightning's strategy='onebit_hsdp' (docs/usage.md, 'Sharded models (FSDP2, "
                "HSDP)'); for DDP, launch without the FSDP config")
        if self.onebit is not None and self.mixed_precision == "fp16":
            raise ValueError(
                "ONEBIT_ADAM=1 supports mixed_precision 'no' and 'bf16'; 'fp16' scales the loss "
                "with a GradScaler, whose scale would enter the compressed momentum before "
                "overflowed steps can be skipped"
            )

    def _onebit_optimizers(self) -> list[OneBitOptimizer]:
        inner = [getattr(o, "optimizer", o) for o in self._optimizers]
        return [o for o in inner if isinstance(o, OneBitOptimizer)]

    def save_state(self, output_dir=None, safe_serialization: bool = True, **kwargs):
        """``accelerate.Accelerator.save_state``, plus each rank's own OneBitAdam error buffers
        in ``onebit_rank<R>.pt`` (Accelerate writes the optimizer from the main process only,
        and the error buffers differ per rank)."""
        location = super().save_state(output_dir, safe_serialization=safe_serialization,
                                      **kwargs)
        optimizers = self._onebit_optimizers()
        if optimizers:
            self.wait_for_everyone()  # the main process made the folder
            save_rank_states(location, self.process_index, self.num_processes, optimizers)
            self.wait_for_everyone()
        return location

    def load_state(self, input_dir=None, load_kwargs=None, **kwargs):
        """``accelerate.Accelerator.load_state``, then each rank loads its own OneBitAdam error
        buffers (``save_state`` of this class wrote them)."""
        super().load_state(input_dir, load_kwargs, **kwargs)
        optimizers = self._onebit_optimizers()
        if optimizers:
            location = Path(input_dir) if input_dir is not None else self._latest_checkpoint()
            load_rank_states(location, self.process_index, self.num_processes, optimizers)

    def _latest_checkpoint(self) -> Path:
        # Accelerate's automatic naming: <project_dir>/checkpoints/checkpoint_<N>, newest wins.
        folder = Path(self.project_dir) / "checkpoints"
        found = [(int(m.group(1)), p) for p in folder.glob("checkpoint_*")
                 if (m := re.fullmatch(r"checkpoint_(\d+)", p.name))]
        if not found:
            raise ValueError(f"no checkpoint_<N> folder in {folder} to load OneBitAdam state")
        return max(found)[1]

    def prepare(self, *args, device_placement=None):
        if self.onebit is None:
            return super().prepare(*args, device_placement=device_placement)
        self._say_lone_processes()
        replaced: dict[int, OneBitOptimizer] = {}
        originals: list[tuple[torch.optim.Optimizer, OneBitOptimizer]] = []
        converted = []
        for obj in args:
            if isinstance(obj, torch.optim.Optimizer):
                new = to_member(obj, self.onebit)
                if new is not obj:
                    replaced[id(obj)] = new
                    originals.append((obj, new))
                    # A scheduler built on the original and not passed here checks that its
                    # optimizer has stepped.
                    new.register_step_post_hook(
                        lambda *_, old=obj: setattr(old, "_opt_called", True))
                obj = new
            converted.append(obj)
        for obj in converted:
            target = getattr(obj, "optimizer", None)
            if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) and id(target) in replaced:
                obj.optimizer = replaced[id(target)]
                _mark_step_tracked(obj.optimizer)
        result = super().prepare(*converted, device_placement=device_placement)
        # Accelerate's optimizer wrapper reloads the state dict, which replaces the param-group
        # dicts: an LR scheduler built on the original (and not passed to prepare) must still
        # drive the new optimizer's lr, so the original now holds the new groups.
        for old, new in originals:
            old.param_groups = new.param_groups
        outputs = result if isinstance(result, tuple) else (result,)
        # prepare(model) and prepare(optimizer) may come in separate calls, in either order
        # (transformers.Trainer does both): pair them once both have been seen.
        self._onebit_models += [o for o in outputs if isinstance(o, DistributedDataParallel)]
        self._onebit_pending += [o for o in (getattr(o, "optimizer", o) for o in outputs)
                                 if isinstance(o, OneBitOptimizer)]
        self._pair_hook()
        return result

    def _say_lone_processes(self) -> None:
        """Once: a launch whose processes Accelerate runs alone has nothing to compress, or
        (several processes, none of them distributed) trains the same model several times."""
        if getattr(self, "_onebit_said_lone", False) or self.num_processes > 1:
            return
        self._onebit_said_lone = True
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched > 1:
            log.warning(
                "onebit: this launch started %d processes but Accelerate runs each one alone "
                "(distributed type %s): every process trains the same model by itself and "
                "nothing is exchanged. On CPUs launch with ACCELERATE_USE_CPU=true "
                "(ACCELERATE_USE_CPU=true onebit-run --freeze-step N accelerate launch "
                "--multi_gpu --num_processes %d train.py)", launched, self.distributed_type,
                launched)
        else:
            self.print("onebit: 1-bit Adam on, in one process: there is nothing to exchange, "
                       "so OneBitAdam is Adam, then Adam with a frozen variance; launch several "
                       "processes (accelerate launch --num_processes N) to compress")

    def _pair_hook(self) -> None:
        if self.onebit_hook_state is not None or not self._onebit_models \
                or not self._onebit_pending:
            return
        if len(self._onebit_models) != 1 or len(self._onebit_pending) != 1:
            raise ValueError(
                "ONEBIT_ADAM=1 handles one DDP model with one optimizer; prepare() was given "
                f"{len(self._onebit_models)} models and {len(self._onebit_pending)} optimizers"
            )
        self.onebit_hook_state = register_onebit_hook(
            self._onebit_models[0], self._onebit_pending[0], overlap=self.onebit.overlap
        )
        # Said on the main process, whatever the logging level: the run is not what the
        # script's code alone suggests.
        opt = self._onebit_pending[0]
        say_at_exit_if_uncompressed(opt)
        settle_before_teardown()
        changed = ", ".join(f"{k}={v!r}" for k, v in opt.changed_settings().items())
        self.print(f"onebit: {type(opt).__name__} on: it averages with the 1-bit hook "
                   f"(overlap={self.onebit_hook_state.overlap}, DDP gradient_as_bucket_view="
                   f"{self._onebit_models[0].gradient_as_bucket_view}); the momentum is "
                   f"exchanged as 1-bit signs {_when(opt)}; settings away from "
                   f"{type(opt).__name__}'s defaults: {changed or 'none'}")


    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """``accelerate.Accelerator.clip_grad_norm_``; for the paired OneBitAdam's parameters,
        ``OneBitAdam.clip_grad_norm_`` (in the compression stage ``p.grad`` holds the averaged
        momentum, and torch's clipping would clip that)."""
        optimizers = self._onebit_optimizers()
        if len(optimizers) != 1:  # none (flag off), or more than the flag handles
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        return optimizers[0].clip_grad_norm_(max_norm, norm_type, params=parameters)

    def clip_grad_value_(self, parameters, clip_value):
        for optimizer in self._onebit_optimizers():
            optimizer.clip_grad_value_(clip_value)  # raises
        return super().clip_grad_value_(parameters, clip_value)

    def backward(self, loss, **kwargs):
        if self.onebit is not None and self.onebit_hook_state is None and not self._said_idle \
                and self._onebit_models:
            self._said_idle = True
            log.warning(
                "onebit: ONEBIT_ADAM=1 but no Adam/AdamW optimizer was passed to prepare() for "
                "the DDP model: DDP's fp32 allreduce runs unchanged. Pass the optimizer to "
                "accelerator.prepare()."
            )
        return super().backward(loss, **kwargs)
