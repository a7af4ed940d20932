"""Framework adapters, installed as ``onebit_plugin.integrations``.

The Lightning strategy ``"onebit_adam"``, its stage callback and the Accelerate flag live here
(issue 3); the core they adapt is framework-free and lives in ``onebit_plugin``.
"""
