"""Lightning Fabric strategy ``"onebit_adam"``: ``Fabric(strategy="onebit_adam")`` is DDP whose
gradient sync is OneBitAdam's comm hook, registered once ``fabric.setup`` (or
``setup_module`` and ``setup_optimizers``, in either order) has seen the model and the
optimizer; ``fabric.save``/``fabric.load`` carry every rank's own error buffers."""

from __future__ import annotations

import logging
from datetime import timedelta

import torch

from onebit_plugin.ddp_hook import register_onebit_hook
from onebit_plugin.integrations.rank_states import own_rank_state, with_rank_states
from onebit_plugin.optimizer import OneBitAdam

log = logging.getLogger("onebit_plugin")

# As for the Trainer strategy: a GradScaler's scaled gradients would enter the momentum.
SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


class _LoadsOwnRank:
    """Stands for a OneBitAdam while Fabric loads a checkpoint: hands it this rank's entry."""

    def __init__(self, optimizer: OneBitAdam, rank: int, world: int):
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
            for taken in ("comm_hook", "ddp_comm_hook"):
                if kwargs.get(taken) is not None:
                    raise ValueError(f"the onebit_adam strategy registers its own DDP comm hook; "
                                     f"{taken} cannot be set")
            # As the Trainer strategy: no gradient copies into DDP's buckets and back.
            kwargs.setdefault("gradient_as_bucket_view", True)
            super().__init__(**kwargs)
            self.overlap, self.comm_timeout = overlap, comm_timeout
            self.hook_state = None
            self._model = self._optimizer = None

        def setup_module(self, module):
            precision = str(self.precision.precision)
            if precision not in SUPPORTED_PRECISIONS:
                raise ValueError(
                    f"strategy='onebit_adam' supports precision {', '.join(SUPPORTED_PRECISIONS)}"
                    f"; got {precision!r}. '16-mixed' needs a GradScaler, whose loss scale would "
                    "enter the compressed momentum: use 'bf16-mixed'."
                )
            self._model = super().setup_module(module)
            self._pair()
            return self._model

        def setup_optimizer(self, optimizer):
            if not isinstance(optimizer, OneBitAdam):
                raise ValueError(
                    "strategy='onebit_adam' needs a onebit_plugin.OneBitAdam optimizer, e.g. "
                    "OneBitAdam(model.parameters(), lr=1e-3, freeze_step=1000); got "
                    f"{type(optimizer).__name__}"
                )
            if self._optimizer is not None and self._optimizer is not optimizer:
                raise ValueError("strategy='onebit_adam' handles one optimizer")
            self._optimizer = optimizer
            self._pair()
            return optimizer

        def _pair(self) -> None:
            if self.hook_state is not None or self._model is None or self._optimizer is None:
                return
            if self.comm_timeout is not None:
                self._optimizer.comm_timeout = timedelta(seconds=self.comm_timeout)
            self.hook_state = register_onebit_hook(self._model, self._optimizer,
                                                   overlap=self.overlap)
            log.info("onebit: Fabric strategy onebit_adam, freeze_step=%s, overlap=%s",
                     self._optimizer.freeze_step, self.hook_state.overlap)

        def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0,
                                error_if_nonfinite=True):
            """``OneBitAdam.clip_grad_norm_``: in the compression stage ``p.grad`` holds the
            averaged momentum, which torch's clipping would clip."""
            if not isinstance(optimizer, OneBitAdam):
                return super().clip_gradients_norm(module, optimizer, max_norm, norm_type,
                                                   error_if_nonfinite)
            norm = optimizer.clip_grad_norm_(max_norm, norm_type,
                                             params=self.precision.main_params(optimizer))
            if error_if_nonfinite and not torch.isfinite(norm):
                raise RuntimeError(f"the total norm of the gradients is {float(norm)}: not finite "
                                   "(error_if_nonfinite=True)")
            return norm

        def clip_gradients_value(self, module, optimizer, clip_val):
            if isinstance(optimizer, OneBitAdam):
                optimizer.clip_grad_value_(clip_val)  # raises: no 1-bit counterpart
            return super().clip_gradients_value(module, optimizer, clip_val)

        def get_optimizer_state(self, optimizer) -> dict:
            """Every rank's own error buffers under ``onebit_ranks`` (Fabric writes the
            checkpoint from rank 0 only). Collective: every rank calls it in ``fabric.save``."""
            state = super().get_optimizer_state(optimizer)
            if isinstance(optimizer, OneBitAdam):
                state = with_rank_states(state, self.global_rank, self.world_size)
            return state

        def load_checkpoint(self, path, state=None, strict: bool = True, **kwargs):
            if isinstance(state, OneBitAdam):
                state = _LoadsOwnRank(state, self.global_rank, self.world_size)
                return super().load_checkpoint(path, {"": state}, strict, **kwargs)
            # In place: Fabric copies the loaded plain values back from this very dict.
            swapped = {k: v for k, v in (state or {}).items() if isinstance(v, OneBitAdam)}
            for k, v in swapped.items():
                state[k] = _LoadsOwnRank(v, self.global_rank, self.world_size)
            try:
                return super().load_checkpoint(path, state, strict, **kwargs)
            finally:
                if swapped:
                    state.update(swapped)

        @classmethod
        def register_strategies(cls, strategy_registry) -> None:
            for name, start_method in (("onebit_adam", "popen"), ("onebit_adam_spawn", "spawn"),
                                       ("onebit_adam_fork", "fork")):
                strategy_registry.register(
                    name, cls, description=f"1-bit Adam over DDP, start_method {start_method!r}",
                    override=True, start_method=start_method)

    OneBitAdamFabricStrategy.__module__ = module
    OneBitAdamFabricStrategy.__qualname__ = "OneBitAdamFabricStrategy"
    return OneBitAdamFabricStrategy
