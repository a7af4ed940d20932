"""Lightning Fabric strategy ``"onebit_adam"``: ``Fabric(strategy="onebit_adam")`` is DDP whose
gradient sync is OneBitAdam's comm hook, registered once ``fabric.setup`` (or
``setup_module`` and ``setup_optimizers``, in either order) has seen the model and the
optimizer; ``fabric.save``/``fabric.load`` carry every rank's own error buffers."""

from __future__ import annotations

import logging

import torch

from onebit_plugin import OneBitOptimizer
from onebit_plugin.integrations.ddp_strategies import (
    check_precision,
    ddp_kwargs,
    pair,
    register_names,
    require_member,
    say_at_exit_if_uncompressed,
)
from onebit_plugin.integrations.rank_states import (
    own_rank_state,
    reading_own_rank,
    with_rank_states,
)

log = logging.getLogger("onebit_plugin")


class _LoadsOwnRank:
    """Stands for a OneBitAdam while Fabric loads a checkpoint: hands it this rank's entry."""

    def __init__(self, optimizer: OneBitOptimizer, rank: int, world: int):
        self.optimizer, self.rank, self.world = optimizer, rank, world

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(own_rank_state(state, self.rank, self.world))


def make_fabric_strategy_class(fabric, module: str):
    """The strategy of one Fabric namespace (``lightning.fabric`` or ``lightning_fabric``), to be
    bound at the top level of ``module``."""
    DDPStrategy = fabric.strategies.DDPStrategy

    class OneBitAdamFabricStrategy(DDPStrategy):
        """``DDPStrategy`` plus OneBitAdam's comm hook. The optimizer given to Fabric must be
        one ``onebit_plugin.OneBitAdam``.

        Args:
            overlap: run the compressed allreduce inside backward (default); False averages
                the momentum in ``optimizer.step()``.
            comm_timeout: seconds a collective of OneBitAdam may take before the step raises
                ``CommunicationError`` (default: the optimizer's).
            **kwargs: everything Fabric's ``DDPStrategy`` takes (``gradient_as_bucket_view``
                defaults to True here).
        """

        def __init__(self, overlap: bool = True, comm_timeout: float | None = None, **kwargs):
            super().__init__(**ddp_kwargs(kwargs, ("comm_hook", "ddp_comm_hook")))
            self.overlap, self.comm_timeout = overlap, comm_timeout
            self.hook_state = None
            self._model = self._optimizer = None

        def setup_module(self, module):
            check_precision(self.precision.precision)
            self._model = super().setup_module(module)
            self._pair()
            return self._model

        def setup_optimizer(self, optimizer):
            require_member([optimizer], "a onebit_plugin.OneBitAdam optimizer, e.g. OneBitAdam("
                           "model.parameters(), lr=1e-3, freeze_step=1000)")
            if self._optimizer is not None and self._optimizer is not optimizer:
                raise ValueError(
                    "strategy='onebit_adam' handles one optimizer; for several (a GAN's), wrap "
                    "each model in torch's DistributedDataParallel and call "
                    "onebit_plugin.register_onebit_hook(ddp_model, optimizer) for each pair "
                    "(docs/limits.md)")
            self._optimizer = optimizer
            self._pair()
            return optimizer

        def _pair(self) -> None:
            if self.hook_state is not None or self._model is None or self._optimizer is None:
                return
            self.hook_state = pair(self._model, self._optimizer, self.overlap, self.comm_timeout,
                                   local_world_size=self.num_processes)
            say_at_exit_if_uncompressed(self._optimizer)
            log.info("onebit: Fabric strategy onebit_adam, freeze_step=%s, overlap=%s",
                     self._optimizer.freeze_step, self.hook_state.overlap)

        def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0,
                                error_if_nonfinite=True):
            """``OneBitAdam.clip_grad_norm_``: in the compression stage ``p.grad`` holds the
            averaged momentum, which torch's clipping would clip."""
            if not isinstance(optimizer, OneBitOptimizer):
                return super().clip_gradients_norm(module, optimizer, max_norm, norm_type,
                                                   error_if_nonfinite)
            norm = optimizer.clip_grad_norm_(max_norm, norm_type,
                                             params=self.precision.main_params(optimizer))
            if error_if_nonfinite and not torch.isfinite(norm):
                raise RuntimeError(f"the total norm of the gradients is {float(norm)}: not finite "
                                   "(error_if_nonfinite=True)")
            return norm

        def clip_gradients_value(self, module, optimizer, clip_val):
            if isinstance(optimizer, OneBitOptimizer):
                optimizer.clip_grad_value_(clip_val)  # raises: no 1-bit counterpart
            return super().clip_gradients_value(module, optimizer, clip_val)

        def get_optimizer_state(self, optimizer) -> dict:
            """Every rank's own error buffers under ``onebit_ranks`` (Fabric writes the
            checkpoint from rank 0 only). Collective: every rank calls it in ``fabric.save``."""
            state = super().get_optimizer_state(optimizer)
            if isinstance(optimizer, OneBitOptimizer):
                state = with_rank_states(state, self.global_rank, self.world_size)
            return state

        def load_checkpoint(self, path, state=None, strict: bool = True, **kwargs):
            """Every rank reads the checkpoint; each keeps only its own error buffers."""
            if isinstance(state, OneBitOptimizer):
                state = _LoadsOwnRank(state, self.global_rank, self.world_size)
                with reading_own_rank(self):
                    return super().load_checkpoint(path, {"": state}, strict, **kwargs)
            # In place: Fabric copies the loaded plain values back from this very dict.
            swapped = {k: v for k, v in (state or {}).items() if isinstance(v, OneBitOptimizer)}
            for k, v in swapped.items():
                state[k] = _LoadsOwnRank(v, self.global_rank, self.world_size)
            try:
                with reading_own_rank(self):
                    return super().load_checkpoint(path, state, strict, **kwargs)
            finally:
                if swapped:
                    state.update(swapped)

        @classmethod
        def register_strategies(cls, strategy_registry) -> None:
            register_names(cls, strategy_registry, "1-bit Adam over DDP")

    OneBitAdamFabricStrategy.__module__ = module
    OneBitAdamFabricStrategy.__qualname__ = "OneBitAdamFabricStrategy"
    return OneBitAdamFabricStrategy
