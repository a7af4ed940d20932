"""``strategy="onebit_adam"`` and its callback for ``lightning.pytorch``, as top-level classes
of this module (registered in that namespace's strategy registry on import)."""

import lightning.pytorch as pl

from onebit_plugin.integrations.lightning_strategy import make_strategy_class
from onebit_plugin.integrations.stage_callback import make_callback_class

__all__ = ["OneBitAdamCallback", "OneBitAdamStrategy"]

OneBitAdamCallback = make_callback_class(pl, __name__)
OneBitAdamStrategy = make_strategy_class(pl, OneBitAdamCallback, __name__)
OneBitAdamStrategy.register_strategies(pl.strategies.StrategyRegistry)
