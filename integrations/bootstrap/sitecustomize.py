"""Run at the start of every Python process that ``onebit-run`` launches (it puts this folder
first on ``PYTHONPATH``, as ``ddtrace-run`` and ``opentelemetry-instrument`` do), the workers
that ``accelerate launch`` or ``torchrun`` start included.

Standard library only, and nothing is imported until it is needed: with ``ONEBIT_ADAM`` on,
an import hook waits for ``accelerate`` and ``transformers.trainer`` and patches each right
after it has loaded (``onebit_plugin.integrations.autoload``). Any other ``sitecustomize`` on
the path still runs.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_PATCHED = {"accelerate": "patch_accelerate", "transformers.trainer": "patch_trainer"}


def _run_next_sitecustomize() -> None:
    paths = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


class _PatchAfterLoad(importlib.abc.Loader):
    def __init__(self, loader, name: str):
        self._loader, self._name = loader, name

    def __getattr__(self, attr):  # everything else is the real loader's
        return getattr(self._loader, attr)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        from onebit_plugin.integrations import autoload

        getattr(autoload, _PATCHED[self._name])(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchAfterLoad(spec.loader, name)
                return spec
        return None


if os.environ.get("ONEBIT_ADAM", "").strip().lower() in {"1", "true", "yes", "on"}:
    sys.meta_path.insert(0, _Finder())
_run_next_sitecustomize()
