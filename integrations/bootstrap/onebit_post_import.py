"""Run a function right after a module has loaded, without importing it first (standard library
only). ``import onebit_plugin`` registers its Lightning and Fabric strategies this way, so that
the import does not pay for Lightning (about 5 s on a 2-core VM) in processes that never use
it; ``onebit-run``'s ``sitecustomize`` patches Accelerate and transformers with it."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable

_pending: dict[str, list[Callable]] = {}


def when_imported(name: str, callback: Callable) -> None:
    """``callback(module)`` once module ``name`` has been executed: now if it already has."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if module is not None and not getattr(spec, "_initializing", False):
        callback(module)
        return
    _pending.setdefault(name, []).append(callback)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _ThenCall(importlib.abc.Loader):
    def __init__(self, loader, name: str):
        self._loader, self._name = loader, name

    def __getattr__(self, attr):  # everything else is the real loader's
        return getattr(self._loader, attr)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        for callback in _pending.pop(self._name, []):
            callback(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _pending:
            return None
        for finder in sys.meta_path:
            if isinstance(finder, _Finder) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ThenCall(spec.loader, name)
                return spec
        return None
