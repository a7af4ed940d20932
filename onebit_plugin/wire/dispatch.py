"""The core's one door to the kernels (``onebit_plugin.kernels``, the ``kernels/`` folder).

Every other module of ``onebit_plugin`` asks here which implementation runs a pass and gets the
kernel from here; the kernels import nothing of ``onebit_plugin`` (they read the duck-typed
layout and mask objects they are handed), so the arrows point one way: core -> this module ->
kernels. Both kernel modules are imported on first use: a CPU-only install needs neither Triton
nor a GPU, and a CUDA install never builds the C passes.

* ``"triton"``: the Triton kernels (``kernels/sign_compress.py``), for CUDA tensors;
* ``"cpu"``: the fused C passes (``kernels/cpu.py``), the default on the CPU when a C compiler
  is found, unless ``ONEBIT_CPU_KERNEL=0``;
* ``"torch"``: the torch passes of ``onebit_plugin.wire.compression`` and ``update`` (the
  reference; every backend gives the same bits).
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

import onebit_plugin.kernels as kernels  # light: its Triton launchers are imported on first use
from onebit_plugin.kernels import block_tile
from onebit_plugin.settings.config import flag

__all__ = ["BACKENDS", "backend_for", "block_tile", "cpu_kernel", "fits_cpu_kernel",
           "on_comm_thread", "triton_kernel"]

BACKENDS = ("triton", "cpu", "torch")


def cpu_kernel() -> ModuleType | None:
    """``kernels/cpu.py`` when its library is built (built at the first call), else None (said
    once, with why): the torch passes run instead."""
    from onebit_plugin.kernels import cpu

    if "lib" not in cpu._state:  # the setting is read once, when the library is first wanted
        off = None if flag("ONEBIT_CPU_KERNEL", "1") else \
            f"ONEBIT_CPU_KERNEL={os.environ['ONEBIT_CPU_KERNEL']!r}"
        cpu.library(off)
    return cpu if cpu.library() is not None else None


def triton_kernel(name: str):
    """The launcher ``name`` (``worker_compress``, ``server_compress``, ``decompress``;
    ``quantize``, ``average_quantize``, ``dequantize``) of the Triton kernels; set
    ``TRITON_INTERPRET=1`` before the first call to run them on the CPU."""
    return getattr(kernels, name)


def fits_cpu_kernel(*tensors: torch.Tensor, dtypes=(torch.float32,)) -> bool:
    """Whether the C passes can read ``tensors``: contiguous CPU tensors of ``dtypes``."""
    for t in tensors:  # a loop, not all(...): called for every parameter at every step
        if not (t.is_cpu and t.dtype in dtypes and t.is_contiguous()):
            return False
    return True


def on_comm_thread() -> None:
    """Run once by a communicator's background thread as it starts: the C passes there take one
    thread each (``kernels.cpu.beside_backward``)."""
    from onebit_plugin.kernels import cpu

    cpu.beside_backward()


def backend_for(data: torch.Tensor, backend: str | None, *tensors: torch.Tensor) -> str:
    """Which implementation runs a pass on ``data``: ``"triton"`` on CUDA tensors, on the CPU
    ``"cpu"`` when the C passes could be built, else ``"torch"``. ``backend`` forces one. The
    compiled ones read raw pointers: their ``tensors`` must be contiguous (else a
    ``ValueError``)."""
    if backend is None:
        if data.is_cuda:
            backend = "triton"
        else:
            fits = data.dtype != torch.float16  # fp16 input: the torch passes convert it
            backend = "cpu" if fits and cpu_kernel() is not None else "torch"
    elif backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "cpu":
        for t in tensors:
            if t.is_cuda or not t.is_contiguous():
                raise ValueError(f"the CPU kernel needs contiguous CPU tensors, got one of shape "
                                 f"{tuple(t.shape)} on {t.device}")
        if cpu_kernel() is None:
            raise RuntimeError("onebit: the CPU kernel is not available (see the log line)")
    return backend
