"""Triton kernels, installed as ``onebit_plugin.kernels``; imported lazily, on CUDA tensors only.

Set ``TRITON_INTERPRET=1`` before importing this package to run them on the CPU (tests do).
"""

from onebit_plugin.kernels.sign_compress import decompress, server_compress, worker_compress

__all__ = ["decompress", "server_compress", "worker_compress"]
