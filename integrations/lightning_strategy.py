"""Lightning strategy ``"onebit_adam"``: DDP whose gradient sync is OneBitAdam's comm hook."""

from __future__ import annotations

import logging
import math
from datetime import timedelta

import torch

from onebit_plugin import OneBitOptimizer, group_timeout
from onebit_plugin.integrations.ddp_strategies import (
    check_precision,
    ddp_kwargs,
    pair,
    register_names,
    require_member,
)
from onebit_plugin.integrations.rank_states import (
    own_rank_state,
    reading_own_rank,
    with_rank_states,
)

log = logging.getLogger("onebit_plugin")


def route_clipping(precision_plugin) -> None:
    """``gradient_clip_val`` reaches OneBitAdam.clip_grad_norm_ (in the compression stage
    ``p.grad`` holds the averaged momentum, which the precision plugin's torch clipping would
    clip); by value it is a clear error. Lightning clips through its precision plugin, whatever
    its class, so these two methods are replaced on this strategy's instance."""
    by_norm, by_value = precision_plugin.clip_grad_by_norm, precision_plugin.clip_grad_by_value

    def clip_grad_by_norm(optimizer, clip_val):
        inner = getattr(optimizer, "_optimizer", optimizer)
        if not isinstance(inner, OneBitOptimizer):
            return by_norm(optimizer, clip_val)
        inner.clip_grad_norm_(clip_val, params=precision_plugin.main_params(optimizer))

    def clip_grad_by_value(optimizer, clip_val):
        inner = getattr(optimizer, "_optimizer", optimizer)
        if not isinstance(inner, OneBitOptimizer):
            return by_value(optimizer, clip_val)
        inner.clip_grad_value_(clip_val)  # raises: no 1-bit counterpart

    if not getattr(by_norm, "_onebit", False):
        clip_grad_by_norm._onebit = True
        precision_plugin.clip_grad_by_norm = clip_grad_by_norm
        precision_plugin.clip_grad_by_value = clip_grad_by_value


def make_strategy_class(pl, callback_cls, module: str):
    """The strategy of one Lightning namespace (``pytorch_lightning`` or ``lightning.pytorch``,
    each with its own ``DDPStrategy``), to be bound at the top level of ``module`` (so that it
    pickles, as ``"onebit_adam_spawn"`` needs)."""
    from typing_extensions import override

    DDPStrategy = pl.strategies.DDPStrategy
    TrainerFn = pl.trainer.states.TrainerFn

    class OneBitAdamStrategy(DDPStrategy):
        """DDP with OneBitAdam's comm hook: warm-up gradients are averaged like DDP's, then the
        momentum is exchanged as 1-bit signs inside backward.

        ``configure_optimizers`` must return one ``onebit_plugin.OneBitAdam`` (an LR scheduler
        beside it is fine). Works on CPU (gloo) and GPU (NCCL); unlike ``DDPStrategy``'s own
        ``ddp_comm_hook`` the hook is registered on CPU too.

        Args:
            overlap: run the compressed allreduce inside backward (default). False keeps DDP's
                warm-up averaging but averages the momentum units in ``optimizer.step()``.
            add_callback: add ``OneBitAdamCallback`` unless the trainer already has one.
            record_timeline: keep per-bucket timings in ``hook_state.timeline``.
            comm_timeout: seconds a compressed allreduce may take before the step raises
                ``CommunicationError`` (a peer died, hung or lost its link); default: the
                optimizer's ``comm_timeout``, else the process group's ``timeout``. Unless
                ``timeout=`` is given, the default group's collectives (Lightning's per-batch
                broadcast, barriers, DDP's) get this timeout too, so a hung peer ends the fit
                within it wherever it hangs.
            **kwargs: everything ``DDPStrategy`` takes (``find_unused_parameters``,
                ``bucket_cap_mb``, ``timeout``, ``start_method``, ...). ``ddp_comm_hook``,
                ``ddp_comm_state`` and ``ddp_comm_wrapper`` are taken by the 1-bit hook;
                ``gradient_as_bucket_view`` defaults to True here.

        Gradient clipping (``gradient_clip_val``) goes through ``OneBitAdam.clip_grad_norm_``:
        in warm-up it clips the averaged gradient, as with DDP; in the compression stage it
        scales the gradient inside the averaged momentum by ``max_norm`` over an unbiased
        estimate of the averaged gradient's norm from sketches of the ranks' local gradients
        (the same on every rank; docs/design.md, "Clipping"). Clipping by value is an error.

        Checkpoints hold every rank's own error buffers (``onebit_ranks`` beside rank 0's
        optimizer state) and each rank loads its own on resume, so a run resumed in either stage
        continues the uninterrupted run's trajectory. On another world size the error feedback
        restarts from zero (the optimizer's load says so).
        """

        strategy_name = "onebit_adam"

        def __init__(self, overlap: bool = True, add_callback: bool = True,
                     record_timeline: bool = False, comm_timeout: float | None = None,
                     **kwargs):
            kwargs = ddp_kwargs(kwargs, ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"))
            super().__init__(**kwargs)
            # None: the default group's timeout follows comm_timeout once that is known.
            self._user_timeout = kwargs.get("timeout")
            self.overlap = overlap
            self.add_callback = add_callback
            self.record_timeline = record_timeline
            self.comm_timeout = comm_timeout
            self.hook_state = None

        def _bound_default_group(self, comm_timeout: timedelta | None) -> None:
            """Lightning's own collectives run on the default group: a broadcast at every batch
            (the SIGTERM check), barriers, DDP's buffer broadcast. A peer that hangs outside
            OneBitAdam's collectives (between two micro-batches, in data loading) is only
            noticed there, after that group's timeout (30 minutes by default), so with
            ``comm_timeout`` and no ``timeout=`` of the user's the default group gets
            ``comm_timeout`` too; on NCCL, whose watchdog ends the process at a group's
            timeout, ``group_timeout``'s longer one, so that a hang inside OneBitAdam's
            collectives ends in its ``CommunicationError`` first. It is set after the
            rendezvous, whose store timeout stays the default (ranks may start seconds apart).
            A checkpoint that rank 0 writes for longer than that while the others wait at a
            barrier then fails: size it."""
            if comm_timeout is None or self._user_timeout is not None or self.world_size < 2:
                return
            set_timeout = getattr(torch.distributed.distributed_c10d, "_set_pg_timeout", None)
            if set_timeout is None:  # private in torch; present since 2.3
                log.warning(
                    "onebit: this torch cannot change the default process group's timeout; "
                    "Lightning's own collectives wait up to %s for a hung peer. Pass "
                    "OneBitAdamStrategy(timeout=timedelta(seconds=...)) to bound them.",
                    self._timeout)
                return
            timeout = group_timeout(comm_timeout, torch.distributed.get_backend())
            set_timeout(timeout)
            log.info("onebit: the default process group's timeout is %s (comm_timeout %s)",
                     timeout, comm_timeout)

        @override
        def setup_environment(self) -> None:
            super().setup_environment()
            trainer = self.lightning_module.trainer if self.lightning_module else None
            if (
                self.add_callback
                and trainer is not None
                and not any(isinstance(c, callback_cls) for c in trainer.callbacks)
            ):
                trainer.callbacks.append(callback_cls())

        @override
        def setup(self, trainer) -> None:
            if trainer.state.fn == TrainerFn.FITTING:
                check_precision(self.precision_plugin.precision)
            super().setup(trainer)
            if trainer.state.fn != TrainerFn.FITTING:
                return
            optimizer = require_member(
                [getattr(o, "_optimizer", o) for o in self.optimizers],
                "configure_optimizers() to return one onebit_plugin.OneBitAdam (optionally with "
                "an LR scheduler), e.g. `return OneBitAdam(self.parameters(), lr=1e-3, "
                "freeze_step=1000)`")
            total = trainer.estimated_stepping_batches  # inf for max_steps=-1 and no epochs
            if math.isfinite(total):  # "auto"'s ceiling; a fixed freeze_step past it is said
                optimizer.set_total_steps(int(total))
            self._bound_default_group(optimizer.comm_timeout if self.comm_timeout is None
                                      else timedelta(seconds=self.comm_timeout))
            self.hook_state = pair(self.model, optimizer, self.overlap, self.comm_timeout,
                                   self.record_timeline, self.num_processes)
            route_clipping(self.precision_plugin)

        @override
        def on_train_end(self) -> None:
            super().on_train_end()
            for optimizer in self.optimizers:  # a fit that never compressed says so
                inner = getattr(optimizer, "_optimizer", optimizer)
                if isinstance(inner, OneBitOptimizer):
                    inner.training_ended()

        @override
        def optimizer_state(self, optimizer) -> dict:
            """Rank 0's optimizer state, plus every rank's own error buffers under
            ``onebit_ranks``: the errors differ per rank and a checkpoint is written by rank 0
            only. Collective: every rank calls it while the checkpoint is dumped."""
            state = super().optimizer_state(optimizer)
            if not isinstance(getattr(optimizer, "_optimizer", optimizer), OneBitOptimizer):
                return state
            return with_rank_states(state, self.global_rank, self.world_size)

        @override
        def load_checkpoint(self, checkpoint_path, *args, **kwargs) -> dict:
            """Every rank reads the checkpoint; each keeps only its own error buffers."""
            with reading_own_rank(self):
                return super().load_checkpoint(checkpoint_path, *args, **kwargs)

        @override
        def load_optimizer_state_dict(self, checkpoint) -> None:
            states = [own_rank_state(state, self.global_rank, self.world_size)
                      for state in checkpoint["optimizer_states"]]
            super().load_optimizer_state_dict({**checkpoint, "optimizer_states": states})

        @classmethod
        @override
        def register_strategies(cls, strategy_registry) -> None:
            register_names(cls, strategy_registry, "1-bit Adam over DDP")

    OneBitAdamStrategy.__module__, OneBitAdamStrategy.__qualname__ = module, "OneBitAdamStrategy"
    return OneBitAdamStrategy
