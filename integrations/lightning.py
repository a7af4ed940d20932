"""Lightning entry points: ``Trainer(strategy="onebit_adam")`` and ``OneBitAdamCallback``.

``import onebit_plugin`` registers the strategy names ``"onebit_adam"``, ``"onebit_adam_spawn"``
and ``"onebit_adam_fork"`` in ``pytorch_lightning`` and, when it is installed, in
``lightning.pytorch``, and the same names for ``Fabric`` in ``lightning_fabric`` and
``lightning.fabric``. Each namespace has its own classes, at the top level of
``onebit_plugin.integrations.for_pytorch_lightning`` and ``...for_lightning_pytorch``;
:func:`classes_for` returns them. ``OneBitAdamStrategy`` and ``OneBitAdamCallback`` here are the
``pytorch_lightning`` ones.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

NAMESPACES = ("pytorch_lightning", "lightning.pytorch")


def classes_for(namespace: str = "pytorch_lightning") -> tuple[type, type]:
    """``(OneBitAdamStrategy, OneBitAdamCallback)`` of ``pytorch_lightning`` or
    ``lightning.pytorch`` (importing them registers the strategy names there)."""
    if namespace not in NAMESPACES:
        raise ValueError(f"namespace must be one of {NAMESPACES}, got {namespace!r}")
    module = importlib.import_module(
        f"onebit_plugin.integrations.for_{namespace.replace('.', '_')}"
    )
    return module.OneBitAdamStrategy, module.OneBitAdamCallback


def hsdp_strategy_for(namespace: str = "pytorch_lightning") -> type:
    """``OneBitHSDPStrategy`` (``strategy="onebit_hsdp"``) of ``pytorch_lightning`` or
    ``lightning.pytorch``."""
    if namespace not in NAMESPACES:
        raise ValueError(f"namespace must be one of {NAMESPACES}, got {namespace!r}")
    module = importlib.import_module(
        f"onebit_plugin.integrations.for_{namespace.replace('.', '_')}"
    )
    return module.OneBitHSDPStrategy


def _installed(namespace: str) -> bool:
    try:
        return importlib.util.find_spec(namespace) is not None
    except ModuleNotFoundError:  # "lightning" absent while asking for "lightning.pytorch"
        return False


# Fabric's registries: lightning.fabric, and the standalone package pytorch_lightning uses.
FABRIC_MODULES = {"lightning.fabric": "for_lightning_fabric",
                  "lightning_fabric": "for_lightning_fabric_package"}


def fabric_strategy_for(namespace: str = "lightning.fabric") -> type:
    """``OneBitAdamFabricStrategy`` of ``lightning.fabric`` or ``lightning_fabric`` (importing
    it registers ``Fabric(strategy="onebit_adam")`` there)."""
    if namespace not in FABRIC_MODULES:
        raise ValueError(f"namespace must be one of {tuple(FABRIC_MODULES)}, got {namespace!r}")
    module = importlib.import_module(f"onebit_plugin.integrations.{FABRIC_MODULES[namespace]}")
    return module.OneBitAdamFabricStrategy


def register_all() -> list[str]:
    """Register the Trainer and Fabric strategies in every installed Lightning namespace;
    returns the namespaces."""
    done = [ns for ns in NAMESPACES if _installed(ns)]
    for namespace in done:
        classes_for(namespace)
    fabric = [ns for ns in FABRIC_MODULES if _installed(ns)]
    for namespace in fabric:
        fabric_strategy_for(namespace)
    return done + fabric


def register_when_imported() -> None:
    """``Trainer(strategy="onebit_adam")`` and ``Fabric(strategy="onebit_adam")`` work after
    ``import onebit_plugin`` wherever a Lightning package is installed: the names are
    registered when (if ever) that package loads, so that importing onebit_plugin does not load
    Lightning itself."""
    from onebit_plugin.integrations.bootstrap.onebit_post_import import when_imported

    def register(namespace: str):
        module = FABRIC_MODULES.get(namespace) or f"for_{namespace.replace('.', '_')}"

        def now(_module) -> None:
            # Importing one of our modules may be what loads the framework: that module is
            # then half made, and its own body registers its classes when it completes
            # (importing it again here would read it half made, and fail).
            if f"onebit_plugin.integrations.{module}" not in sys.modules:
                importlib.import_module(f"onebit_plugin.integrations.{module}")
        return now

    for namespace in (*NAMESPACES, *FABRIC_MODULES):
        when_imported(namespace, register(namespace))


def __getattr__(name: str):
    # Imported on first use, so that a machine with only lightning.pytorch can import this.
    if name in ("OneBitAdamStrategy", "OneBitAdamCallback"):
        strategy_cls, callback_cls = classes_for("pytorch_lightning")
        return strategy_cls if name == "OneBitAdamStrategy" else callback_cls
    if name == "OneBitHSDPStrategy":
        return hsdp_strategy_for("pytorch_lightning")
    raise AttributeError(name)


# OneBitAdamStrategy, OneBitAdamCallback and OneBitHSDPStrategy (pytorch_lightning's) come from
# __getattr__ above; hsdp_strategy_for("lightning.pytorch") gives lightning.pytorch's.
__all__ = ["classes_for", "fabric_strategy_for", "hsdp_strategy_for", "register_all",
           "register_when_imported"]
