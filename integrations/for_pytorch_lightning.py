"""``strategy="onebit_adam"``, ``strategy="onebit_hsdp"`` and the callback for
``pytorch_lightning``, as top-level classes of this module (registered in that namespace's strategy
registry on import)."""

import pytorch_lightning as pl

from onebit_plugin.integrations.hsdp_strategy import make_hsdp_strategy_class
from onebit_plugin.integrations.lightning_strategy import make_strategy_class
from onebit_plugin.integrations.stage_callback import make_callback_class

__all__ = ["OneBitAdamCallback", "OneBitAdamStrategy", "OneBitHSDPStrategy"]

OneBitAdamCallback = make_callback_class(pl, __name__)
OneBitAdamStrategy = make_strategy_class(pl, OneBitAdamCallback, __name__)
OneBitAdamStrategy.register_strategies(pl.strategies.StrategyRegistry)
OneBitHSDPStrategy = make_hsdp_strategy_class(pl, OneBitAdamCallback, __name__)
OneBitHSDPStrategy.register_strategies(pl.strategies.StrategyRegistry)
