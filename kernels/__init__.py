"""Kernels of the compressed allreduce, installed as ``onebit_plugin.kernels``:

* ``sign_compress``: the Triton kernels, for CUDA tensors (set ``TRITON_INTERPRET=1`` before
  they are first used to run them on the CPU, as the tests do);
* ``int8_quantize``: the Triton kernels of the int8 allreduce (``warmup_bits=8``);
* ``cpu``: the fused CPU passes of both, a C library built on first use;
* :func:`block_tile`, the tile both use for a block's sum.

Nothing here imports ``onebit_plugin``: the core reaches these through
``onebit_plugin.wire.dispatch`` alone, which imports them lazily (a CPU-only install needs neither
Triton nor a GPU).
"""

__all__ = ["block_tile"]


def block_tile(block: int) -> int:
    """Values a block is padded to for its sum: 8 times the next power of two of its bytes (at
    least 2 bytes), the Triton kernels' tile and the order of every backend's sum."""
    rows = block // 8
    return 8 * max(2, 1 << (rows - 1).bit_length())


# Each launcher's module.
_TRITON_LAUNCHERS = {"decompress": "sign_compress", "server_compress": "sign_compress",
                     "worker_compress": "sign_compress", "quantize": "int8_quantize",
                     "average_quantize": "int8_quantize", "dequantize": "int8_quantize"}
__all__ += list(_TRITON_LAUNCHERS)


def __getattr__(name):
    """The Triton launchers, imported on first use (with Triton's absence said plainly)."""
    if name not in _TRITON_LAUNCHERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # CUDA builds of torch on Linux bring triton; CPU builds do not
        raise ImportError("onebit_plugin's CUDA path runs Triton kernels: pip install triton "
                          "(or onebit-plugin[cuda])") from exc
    import importlib

    return getattr(importlib.import_module(f".{_TRITON_LAUNCHERS[name]}", __name__), name)
