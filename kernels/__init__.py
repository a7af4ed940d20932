"""Triton kernels, installed as ``onebit_plugin.kernels``; imported lazily, on CUDA tensors only.

Set ``TRITON_INTERPRET=1`` before importing this package to run them on the CPU (tests do).
"""

try:
    import triton  # noqa: F401
except ImportError as exc:  # CUDA builds of torch on Linux bring triton; CPU builds do not
    raise ImportError("onebit_plugin's CUDA path runs Triton kernels: pip install triton "
                      "(or onebit-plugin[cuda])") from exc

from onebit_plugin.kernels.sign_compress import decompress, server_compress, worker_compress  # noqa: E402

__all__ = ["decompress", "server_compress", "worker_compress"]
