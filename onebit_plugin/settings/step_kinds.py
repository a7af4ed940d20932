"""The words for what one step exchanges: a leaf module, so that the pure schedule
(``onebit_plugin.settings.schedule``) and the settings below it name them without importing the
exchanges (``onebit_plugin.core.exchanges``) that act on them.

``EXACT``: the gradients averaged in full precision (warm-up, or a variance refresh);
``MOMENTUM``: the momentum units through the policy's wire exchange; ``LOCAL``: nothing is sent
(a local step); ``SYNC``: a local step, then the average of the local steps' accumulated update.
"""

__all__ = ["EXACT", "LOCAL", "MOMENTUM", "SYNC"]

EXACT, MOMENTUM, LOCAL, SYNC = "exact", "momentum", "local", "sync"
