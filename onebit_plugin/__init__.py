"""onebit-plugin: 1-bit Adam (Tang et al., ICML 2021) for PyTorch.

``OneBitAdam`` is a ``torch.optim.Optimizer``: Adam during a warm-up, then Adam with a frozen
variance whose momentum is averaged across ranks by ``compressed_allreduce`` -- 1-bit signs with
error feedback on the worker and the server side, about 1/32 of an fp32 allreduce's bytes.
"""

from onebit_plugin.allreduce import (
    CommunicationError,
    CompressedAllreduce,
    ExactAllreduce,
    OneBitAllreduce,
    compressed_allreduce,
)
from onebit_plugin.compression import ChunkLayout
from onebit_plugin.ddp_hook import OneBitHookState, onebit_hook, register_onebit_hook
from onebit_plugin.deferred import fold_gradient_
from onebit_plugin.lockstep import LockstepError, check_lockstep
from onebit_plugin.momentum import MomentumUnit
from onebit_plugin.optimizer import OneBitAdam
from onebit_plugin.update import adam_update_, frozen_denominator, frozen_update_

__all__ = [
    "ChunkLayout",
    "CommunicationError",
    "CompressedAllreduce",
    "ExactAllreduce",
    "LockstepError",
    "MomentumUnit",
    "OneBitAdam",
    "OneBitAllreduce",
    "OneBitHookState",
    "adam_update_",
    "check_lockstep",
    "compressed_allreduce",
    "fold_gradient_",
    "frozen_denominator",
    "frozen_update_",
    "onebit_hook",
    "register_onebit_hook",
]
__version__ = "0.1.0"


def _register_lightning_strategies() -> None:
    """``Trainer(strategy="onebit_adam")`` and ``Fabric(strategy="onebit_adam")`` work after
    ``import onebit_plugin`` wherever a Lightning package is installed: the names are registered
    when (if ever) that package loads, so that this import does not load Lightning itself."""
    from onebit_plugin.integrations.bootstrap.onebit_post_import import when_imported
    from onebit_plugin.integrations.lightning import FABRIC_MODULES, NAMESPACES

    def register(namespace: str):
        def now(_module) -> None:
            from onebit_plugin.integrations import lightning

            if namespace in FABRIC_MODULES:
                lightning.fabric_strategy_for(namespace)
            else:
                lightning.classes_for(namespace)
        return now

    for namespace in (*NAMESPACES, *FABRIC_MODULES):
        when_imported(namespace, register(namespace))


_register_lightning_strategies()
