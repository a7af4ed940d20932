"""What ``onebit-run`` patches in each process, right after the library has loaded (the import
hook is in ``bootstrap/sitecustomize.py``).

* ``accelerate``: ``accelerate.Accelerator`` becomes this package's flag-aware subclass
  (``accelerate_flag.Accelerator``), so an unmodified script, and ``transformers.Trainer``,
  which builds its own, get Adam/AdamW converted and the 1-bit hook registered in
  ``prepare()``, however ``prepare`` is called, and the per-rank error buffers in
  ``save_state``/``load_state``.
* ``transformers.trainer``: ``Trainer`` checkpoints carry each rank's error buffers
  (``transformers_trainer.patch_trainer``).
"""

from __future__ import annotations

import sys


def _on() -> bool:
    from onebit_plugin.settings.config import flag

    return flag("ONEBIT_ADAM", "0")


def patch_accelerate(module) -> None:
    if not _on():
        return
    from onebit_plugin.integrations.accelerate_flag import Accelerator

    module.Accelerator = Accelerator
    sys.modules["accelerate.accelerator"].Accelerator = Accelerator


def patch_trainer(module) -> None:
    if not _on():
        return
    from onebit_plugin.integrations.transformers_trainer import patch_trainer

    patch_trainer(module.Trainer)
