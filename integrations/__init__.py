"""Framework adapters, installed as ``onebit_plugin.integrations``.

* ``lightning``: ``Trainer(strategy="onebit_adam")`` (registered on ``import onebit_plugin``)
  and ``OneBitAdamCallback``;
* ``accelerate_flag``: an ``Accelerator`` that turns 1-bit Adam on with ``ONEBIT_ADAM=1``.

The core they adapt is framework-free and lives in ``onebit_plugin``.
"""
