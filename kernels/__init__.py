"""Kernels of the compressed allreduce, installed as ``onebit_plugin.kernels``:

* ``sign_compress``: the Triton kernels, for CUDA tensors (``worker_compress``,
  ``server_compress`` and ``decompress`` here are its launchers; set ``TRITON_INTERPRET=1``
  before they are first used to run them on the CPU, as the tests do);
* ``cpu``: the fused CPU passes, a C library built on first use.

Both are imported lazily: a CPU-only install needs neither Triton nor a GPU.
"""

_TRITON_LAUNCHERS = ("decompress", "server_compress", "worker_compress")

__all__ = list(_TRITON_LAUNCHERS)


def __getattr__(name):
    if name not in _TRITON_LAUNCHERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # CUDA builds of torch on Linux bring triton; CPU builds do not
        raise ImportError("onebit_plugin's CUDA path runs Triton kernels: pip install triton "
                          "(or onebit-plugin[cuda])") from exc
    from onebit_plugin.kernels import sign_compress

    return getattr(sign_compress, name)
