"""Run at the start of every Python process that ``onebit-run`` launches (it puts this folder
first on ``PYTHONPATH``, as ``ddtrace-run`` and ``opentelemetry-instrument`` do), the workers
that ``accelerate launch`` or ``torchrun`` start included.

Standard library only, and nothing is imported until it is needed: ``accelerate`` and
``transformers.trainer`` are patched right after each has loaded, when ``ONEBIT_ADAM`` is on
(``onebit_plugin.integrations.autoload`` reads it, with the package's one reader of the
``ONEBIT_*`` variables). Any other ``sitecustomize`` on the path still runs.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _run_next_sitecustomize() -> None:
    paths = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _patch(name: str):
    def patch(module) -> None:
        from onebit_plugin.integrations import autoload

        getattr(autoload, name)(module)
    return patch


from onebit_post_import import when_imported  # noqa: E402 - beside this file

when_imported("accelerate", _patch("patch_accelerate"))
when_imported("transformers.trainer", _patch("patch_trainer"))
_run_next_sitecustomize()
