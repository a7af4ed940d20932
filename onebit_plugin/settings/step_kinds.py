"""The words for what one step exchanges: a leaf module, so that the pure schedule
(``onebit_plugin.settings.schedule``) and the settings below it name them without importing the
exchanges (``onebit_plugin.core.exchanges``) that act on them.

``EXACT``: the gradients averaged in full precision (warm-up, or a variance refresh);
``MOMENTUM``: the momentum units through the policy's wire exchange; ``LOCAL``: nothing is sent
(a local step); ``SYNC``: a local step, then the average of the local steps' accumulated update;
``REFRESH``: a ``MOMENTUM`` step, then the ranks' own variances averaged (0/1 Adam's refresh
with ``local_variance``).
"""

__all__ = ["EXACT", "LOCAL", "MOMENTUM", "REFRESH", "SYNC"]

EXACT, MOMENTUM, LOCAL, SYNC, REFRESH = "exact", "momentum", "local", "sync", "refresh"
