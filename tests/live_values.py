"""How many values of new tensors are alive at once while some code runs, counted at torch's
dispatcher: what a test of a memory bound reads (the CPU shows no GPU's allocator)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveValues(TorchDispatchMode):
    """While active, ``peak`` is the most values of ``dtype`` alive together in tensors that
    torch made (more than ``least`` values each; views and in-place results share an input's
    memory and are not counted), each counted until it is freed."""

    def __init__(self, dtype: torch.dtype, least: int = 2):
        super().__init__()
        self.dtype, self.least, self.live, self.peak = dtype, least, 0, 0

    def _release(self, numel: int) -> None:
        self.live -= numel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == self.dtype and \
                    t.numel() > self.least and t.untyped_storage().data_ptr() not in inputs:
                self.live += t.numel()
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._release, t.numel())
        return out
