"""The fused CPU passes (``cpu_compress.c``: the compressed allreduce's three passes;
``cpu_update.c``: the compression stage's parameter update; ``cpu_quantize.c``: the int8
allreduce's three passes, ``warmup_bits=8``): built once with the system's C
compiler into one library, cached, and called through ctypes (which releases the GIL, so the
overlap thread does not hold up backward's Python).

The library is built on first use into ``$XDG_CACHE_HOME/onebit_plugin`` (default
``~/.cache/onebit_plugin``), keyed by the source, the flags, the compiler's version and the CPU's
feature flags (``-march=native``); concurrent builds by several ranks each write their own file
and rename it into place. A library found there is loaded only if this package built it: its
sha256 digest, written beside it at the build, matches, and neither it, its digest nor the folder
belongs to another user or is writable by others; else it is rebuilt, and said (loading a library
runs its code). Without a compiler (``$CC`` when it names one on ``PATH``, else
``cc``/``gcc``), or when the build fails, :func:`library` returns None once it has said so in
one log line per process, and the torch passes of ``onebit_plugin.wire.compression`` run instead
(the same bits, slower). ``ONEBIT_CPU_KERNEL=0`` chooses the torch passes.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

__all__ = ["average_quantize", "decode_range", "decompress", "dequantize", "frozen_update_many",
           "library", "quantize", "server_compress", "worker_compress"]

log = logging.getLogger("onebit_plugin")

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_compress.c", "cpu_update.c",
                                                               "cpu_quantize.c"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-fast-math",
         "-fno-trapping-math", "-shared",
         "-fPIC", "-std=c11"]
# Below this many values a pass runs on one thread: starting OpenMP's team costs more than the
# pass (an 8M-value pass is a few ms; a 64K-value one a few tens of microseconds).
PARALLEL_FROM = 1 << 20

_state: dict = {}


def _compiler() -> str | None:
    for name in filter(None, (os.environ.get("CC"), "cc", "gcc")):
        found = shutil.which(name)
        if found:
            return found
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    texts = [src.read_text() for src in SOURCES]
    key = hashlib.sha256("\0".join([*texts, " ".join(FLAGS), version,
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "onebit_plugin"
    target = cache / f"onebit_cpu_{key}.so"
    if target.exists():
        why = _not_ours(target)
        if why is None:
            return target
        # Loading a library runs its code: one found in the cache is loaded only if this
        # package built it there (the digest it wrote beside it) and nobody else may have
        # written either since; else it is rebuilt, and said.
        log.warning("onebit: %s is not a library this package built (%s): rebuilt", target, why)
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", tmp, "-lm"],
                              capture_output=True,
                              text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip()
                               else f"{cc} exited {proc.returncode}")
        os.chmod(tmp, 0o755)
        _write_digest(Path(tmp), target)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _digest_file(target: Path) -> Path:
    return target.with_suffix(".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_digest(built: Path, target: Path) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".sha256", dir=target.parent)
    with os.fdopen(fd, "w") as f:
        f.write(_sha256(built))
    os.chmod(tmp, 0o644)
    os.replace(tmp, _digest_file(target))


def _not_ours(target: Path) -> str | None:
    """Why the cached ``target`` must not be loaded (None: it may): the library or its digest
    owned by another user or writable by others (as is its folder), or the digest missing or
    not the library's."""
    digest = _digest_file(target)
    for path in (target.parent, target, digest):
        try:
            st = path.stat()
        except OSError:
            return f"{path.name} is missing"
        if st.st_uid != os.getuid():
            return f"{path} belongs to another user"
        if st.st_mode & 0o022:
            return f"{path} is writable by other users"
    if digest.read_text().strip() != _sha256(target):
        return "its digest does not match"
    return None


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.onebit_worker_compress.argtypes = [p, i32, i64, p, p, p, p, p, i64, i64, i64, i32, i32]
    lib.onebit_worker_compress.restype = i32
    lib.onebit_worker_compress_fold.argtypes = [p, p, i64, p, p, p, p, i64, p, p, p, p, p, i64,
                                                i64, i64, i32, i32]
    lib.onebit_worker_compress_fold.restype = i32
    lib.onebit_server_compress.argtypes = [p, p, p, p, p, p, p, i64, i64, i64, i64, i32, i32]
    lib.onebit_server_compress.restype = i32
    lib.onebit_decompress.argtypes = [p, p, p, p, i64, i64, i64, i32]
    lib.onebit_decompress.restype = None
    f64 = ctypes.c_double
    lib.onebit_frozen_update_many.argtypes = [ctypes.POINTER(i64), ctypes.POINTER(f64), i64,
                                              f64, i32]
    lib.onebit_frozen_update_many.restype = i32
    lib.onebit_decode_range.argtypes = [p, p, p, p, i64, i64, i64]
    lib.onebit_decode_range.restype = None
    lib.onebit_quantize.argtypes = [p, p, p, i64, i64, i32]
    lib.onebit_quantize.restype = None
    lib.onebit_average_quantize.argtypes = [p, p, i64, i64, i64, p, p, i32]
    lib.onebit_average_quantize.restype = i32
    lib.onebit_dequantize.argtypes = [p, p, p, i64, i64, i32]
    lib.onebit_dequantize.restype = None
    return lib


def library(off: str | None = None) -> ctypes.CDLL | None:
    """The built library, or None (said once) when it cannot be had. ``off``, at the first
    call: why it must not be used (the setting that turned it off; ``onebit_plugin.wire.dispatch``
    reads it)."""
    if "lib" in _state:
        return _state["lib"]
    lib, why = None, off
    if why is None and (cc := _compiler()) is None:
        why = "no C compiler found ($CC, cc, gcc)"
    elif why is None:
        try:
            lib = _bind(ctypes.CDLL(str(_build(cc))))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            why = f"building {' and '.join(src.name for src in SOURCES)} failed: {exc}"
    if lib is None:  # said once per process
        log.warning("onebit: %s; the CPU compression runs as torch passes (the same bits, "
                    "3-6x slower per pass)", why)
    _state["lib"] = lib
    return lib


_budget = threading.local()


def beside_backward() -> None:
    """Called on OneBitAdam's background thread (once, as it starts): the passes it runs
    overlap backward, whose intra-op threads already hold every core, so they take one thread
    each; in ``step()`` (any other thread) they take torch's intra-op thread count."""
    _budget.threads = 1


def _threads(values: int) -> int:
    if values < PARALLEL_FROM:
        return 1
    return getattr(_budget, "threads", None) or torch.get_num_threads()


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def worker_compress(x, error, mask, layout, packed, scales, tile: int, fold=None) -> None:
    """The worker pass; ``x`` fp32 or bf16, contiguous, on the CPU; or, with ``fold`` (the
    momentum of a unit, fp32, and ``onebit_plugin.wire.deferred.Fold.cpu_table()``), the fold of the
    unit's gradients, computed inside the pass (``x`` unused)."""
    common = (_ptr(error), _ptr(mask.keep), _ptr(mask.counts), _ptr(packed), _ptr(scales),
              layout.num_blocks, layout.block, tile, int(layout.scale == "rms"),
              _threads(layout.padded_numel))
    if fold is not None:
        momentum, (offsets, grads, bf16, params, hypers) = fold
        rc = library().onebit_worker_compress_fold(
            _ptr(momentum), _ptr(offsets), grads.numel(), _ptr(grads), _ptr(bf16),
            _ptr(params), _ptr(hypers), layout.numel, *common)
    elif x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the CPU kernel reads fp32 or bf16 input, got {x.dtype}")
    else:
        rc = library().onebit_worker_compress(_ptr(x), int(x.dtype == torch.bfloat16),
                                              layout.numel, *common)
    if rc != 0:
        raise MemoryError("onebit: the CPU compression could not allocate its scratch")


def server_compress(recv_packed, recv_scales, error, mask, layout, packed, scales,
                    tile: int) -> None:
    rc = library().onebit_server_compress(
        _ptr(recv_packed), _ptr(recv_scales), _ptr(error), _ptr(mask.keep), _ptr(mask.counts),
        _ptr(packed), _ptr(scales), layout.world_size, layout.blocks_per_chunk, layout.block,
        tile, int(layout.scale == "rms"), _threads(layout.world_size * layout.chunk))
    if rc != 0:
        raise MemoryError("onebit: the CPU compression could not allocate its scratch")


def decompress(packed, scales, mask, layout, out) -> None:
    """The final decode into ``out`` (fp32, contiguous, ``layout.numel`` values)."""
    library().onebit_decompress(_ptr(packed), _ptr(scales), _ptr(mask.keep), _ptr(out),
                                layout.numel, layout.num_blocks, layout.block,
                                _threads(layout.padded_numel))


def decode_range(encoded, out) -> None:
    """Decode ``encoded`` (``onebit_plugin.wire.deferred.Encoded``) into ``out`` (fp32, contiguous,
    its size)."""
    library().onebit_decode_range(_ptr(encoded.packed), _ptr(encoded.scales),
                                  _ptr(encoded.keep), _ptr(out), encoded.offset, out.numel(),
                                  encoded.block)


def quantize(x, block: int, q, scales) -> None:
    """``x`` (fp32) to int8 ``q`` and one fp32 scale per ``block`` values
    (``onebit_plugin.wire.quantize``)."""
    library().onebit_quantize(_ptr(x), _ptr(q), _ptr(scales), scales.numel(), block,
                              _threads(x.numel()))


def average_quantize(recv_q, recv_scales, world: int, block: int, q, scales) -> None:
    """The int8 allreduce's owner pass (``onebit_plugin.wire.quantize.average_quantize``)."""
    rc = library().onebit_average_quantize(_ptr(recv_q), _ptr(recv_scales), world,
                                           scales.numel(), block, _ptr(q), _ptr(scales),
                                           _threads(recv_q.numel()))
    if rc != 0:
        raise MemoryError("onebit: the CPU int8 average could not allocate its scratch")


def dequantize(q, scales, block: int, out) -> None:
    """``out`` (fp32) = ``q`` times its block's scale."""
    library().onebit_dequantize(_ptr(q), _ptr(scales), _ptr(out), scales.numel(), block,
                                _threads(out.numel()))


def frozen_update_many(rows, *, decay: float) -> None:
    """The compression-stage update of several parameters in one call: ``rows`` of
    ``(param, averaged, denom, into, scale, bound)``, where each ``param`` becomes
    ``param * decay + clamp(averaged / denom, -bound, bound) * scale`` (no clamp for
    ``bound=None``), the torch passes' bits, in one pass over each; ``averaged`` is the fp32
    averaged momentum or its part of an encoded average (``onebit_plugin.wire.deferred.Encoded``,
    decoded as it is read, the same bits), copied ``into`` a tensor on the way (None: not
    copied). fp32, contiguous, CPU tensors of ``param``'s size."""
    if not rows:
        return
    table, coefs, values = [], [], 0
    for param, averaged, denom, into, scale, bound in rows:
        n = param.numel()
        values += n
        if isinstance(averaged, torch.Tensor):
            table += (param.data_ptr(), averaged.data_ptr(), denom.data_ptr(),
                      0 if into is None else into.data_ptr(), n, 0, 0, 0, 0, 1)
        else:
            table += (param.data_ptr(), 0, denom.data_ptr(),
                      0 if into is None else into.data_ptr(), n, averaged.packed.data_ptr(),
                      averaged.scales.data_ptr(), averaged.keep.data_ptr(), averaged.offset,
                      averaged.block)
        coefs += (scale, 0.0 if bound is None else bound, float(bound is not None))
    rc = library().onebit_frozen_update_many((ctypes.c_int64 * len(table))(*table),
                                             (ctypes.c_double * len(coefs))(*coefs), len(rows),
                                             decay, _threads(values))
    if rc != 0:
        raise MemoryError("onebit: the CPU update could not allocate its tile index")

