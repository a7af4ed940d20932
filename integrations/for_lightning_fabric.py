"""``Fabric(strategy="onebit_adam")`` for ``lightning.fabric``, as a top-level class of this
module (registered in that namespace's strategy registry on import)."""

import lightning.fabric as fabric

from onebit_plugin.integrations.fabric_strategy import make_fabric_strategy_class

__all__ = ["OneBitAdamFabricStrategy"]

OneBitAdamFabricStrategy = make_fabric_strategy_class(fabric, __name__)
OneBitAdamFabricStrategy.register_strategies(fabric.strategies.STRATEGY_REGISTRY)
