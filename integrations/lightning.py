"""Lightning entry points: ``Trainer(strategy="onebit_adam")`` and ``OneBitAdamCallback``.

``import onebit_plugin`` registers the strategy names ``"onebit_adam"``, ``"onebit_adam_spawn"``
and ``"onebit_adam_fork"`` in ``pytorch_lightning`` and, when it is installed, in
``lightning.pytorch`` (each namespace gets its own subclasses of its own ``DDPStrategy`` and
``Callback``). The classes of a namespace: :func:`classes_for`.

``OneBitAdamStrategy`` and ``OneBitAdamCallback`` here are the ``pytorch_lightning`` flavour.
"""

from __future__ import annotations

import importlib
import importlib.util

from onebit_plugin.integrations.lightning_strategy import make_strategy_class
from onebit_plugin.integrations.stage_callback import make_callback_class

NAMESPACES = ("pytorch_lightning", "lightning.pytorch")
_CLASSES: dict[str, tuple[type, type]] = {}


def classes_for(namespace: str = "pytorch_lightning") -> tuple[type, type]:
    """``(OneBitAdamStrategy, OneBitAdamCallback)`` for ``pytorch_lightning`` or
    ``lightning.pytorch``, built once and registered in that namespace's strategy registry."""
    if namespace not in _CLASSES:
        pl = importlib.import_module(namespace)
        callback_cls = make_callback_class(pl)
        strategy_cls = make_strategy_class(pl, callback_cls)
        strategy_cls.__module__ = callback_cls.__module__ = __name__
        registry = importlib.import_module(f"{namespace}.strategies").StrategyRegistry
        strategy_cls.register_strategies(registry)
        _CLASSES[namespace] = (strategy_cls, callback_cls)
    return _CLASSES[namespace]


def _installed(namespace: str) -> bool:
    try:
        return importlib.util.find_spec(namespace) is not None
    except ModuleNotFoundError:  # "lightning" absent while asking for "lightning.pytorch"
        return False


def register_all() -> list[str]:
    """Register the strategies in every installed Lightning namespace; returns their names."""
    done = []
    for namespace in NAMESPACES:
        if _installed(namespace):
            classes_for(namespace)
            done.append(namespace)
    return done


def __getattr__(name: str):
    # Built on first use, so that a machine with only lightning.pytorch can import this module.
    if name in ("OneBitAdamStrategy", "OneBitAdamCallback"):
        strategy_cls, callback_cls = classes_for("pytorch_lightning")
        return strategy_cls if name == "OneBitAdamStrategy" else callback_cls
    raise AttributeError(name)


# OneBitAdamStrategy and OneBitAdamCallback come from __getattr__ above.
__all__ = ["classes_for", "register_all"]
