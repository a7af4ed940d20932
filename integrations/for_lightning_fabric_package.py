"""``Fabric(strategy="onebit_adam")`` for the standalone ``lightning_fabric`` package (what
``pytorch_lightning`` installs), as a top-level class of this module."""

import lightning_fabric as fabric

from onebit_plugin.integrations.fabric_strategy import make_fabric_strategy_class

__all__ = ["OneBitAdamFabricStrategy"]

OneBitAdamFabricStrategy = make_fabric_strategy_class(fabric, __name__)
OneBitAdamFabricStrategy.register_strategies(fabric.strategies.STRATEGY_REGISTRY)
