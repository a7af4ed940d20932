"""The fused CPU passes (onebit_plugin.kernels.cpu) against the torch reference, bit for bit;
the build cache; the fallback when no compiler is found."""

import functools
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from onebit_plugin.kernels import cpu
from onebit_plugin.wire import compression as C
from onebit_plugin.wire.compression import ChunkLayout, CoordinateMask
from onebit_plugin.wire.deferred import Fold
from tests.procs import owned_processes

if cpu.library() is None:  # said in the log: this machine has no C compiler
    pytest.skip("the CPU kernel could not be built here", allow_module_level=True)

# Ragged sizes (less than a byte, partial blocks, uneven chunks), 1-5 ranks, one and several
# blocks per chunk, blocks whose byte count is and is not a power of two.
SIZES = [1, 7, 8, 1001, 4099, 70001]
LAYOUTS = [(1, 2048), (2, 64), (3, 2048), (4, 136), (5, 128)]


def _case(numel, world, max_block, scale, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed + numel + 31 * world)
    layout = ChunkLayout.create(numel, world, max_block, scale)
    mask = CoordinateMask.build(layout, torch.rand(numel, generator=gen) > 0.2)
    x = (torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen) * 10).to(dtype)
    error = torch.randn(layout.padded_numel, generator=gen) * 0.1 * mask.keep
    return layout, mask, x, error, gen


def _both(fn):
    return [fn(backend) for backend in ("torch", "cpu")]


def test_the_c_passes_never_build_the_index_list():
    """The C passes read ``keep``; the int64 list of masked indices (8 bytes per masked value)
    is built only for the torch passes."""
    layout, mask, x, error, _ = _case(4099, 3, 256, "rms")
    packed = torch.empty(layout.padded_numel // 8, dtype=torch.uint8)
    scales = torch.empty(layout.num_blocks)
    C.worker_compress(x, error.clone(), mask, layout, packed, scales, backend="cpu")
    C.decompress(packed, scales, mask, layout, torch.empty(layout.numel), backend="cpu")
    assert "dropped" not in vars(mask)
    C.worker_compress(x, error.clone(), mask, layout, packed, scales, backend="torch")
    assert vars(mask)["dropped"].numel() == int((~mask.keep).sum())


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("world,max_block", LAYOUTS)
@pytest.mark.parametrize("scale", ["rms", "mean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_worker_pass_equals_the_reference(numel, world, max_block, scale, dtype):
    layout, mask, x, error, _ = _case(numel, world, max_block, scale, dtype)

    def run(backend):
        err = error.clone()
        packed = torch.empty(layout.padded_numel // 8, dtype=torch.uint8)
        scales = torch.empty(layout.num_blocks)
        C.worker_compress(x, err, mask, layout, packed, scales, backend=backend)
        return packed, scales, err

    ref, native = _both(run)
    for a, b in zip(ref, native, strict=True):
        assert torch.equal(a, b)
    assert torch.all(native[2][~mask.keep] == 0)


def _fold_case(sizes, seed, grad_dtype):
    """A unit of parameters of ``sizes``: every fourth without a gradient, the others with
    ``grad_dtype`` gradients; betas, coupled weight decay and fp32 momenta that differ per
    parameter (both lerp forms: 1 - beta1 below and above 0.5)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen) for n in sizes]
    grads = [None if i % 4 == 3 else (torch.randn(n, generator=gen) * 3).to(grad_dtype)
             for i, n in enumerate(sizes)]
    offsets = [0]
    for n in sizes[:-1]:
        offsets.append(offsets[-1] + n)
    parts = [(o, p, g, (0.9, 0.3, 0.999)[i % 3], (0.0, 0.01)[i % 2])
             for i, (o, p, g) in enumerate(zip(offsets, params, grads, strict=True))]
    momentum = torch.randn(sum(sizes), generator=gen)
    return momentum, parts, gen


@pytest.mark.parametrize("sizes", [[1], [5, 2048, 3], [1001, 7, 4099, 64, 9, 2047], [70001]])
@pytest.mark.parametrize("world,max_block", [(1, 2048), (3, 64), (4, 136)])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_worker_pass_folds_a_unit_as_the_reference_does(sizes, world, max_block, grad_dtype):
    """The worker pass over a Fold (the fold of each gradient computed inside the pass, parts
    that start and end inside blocks) equals folding into the buffer with torch (lerp, add)
    and compressing that, bit for bit; the buffer is not written."""
    momentum, parts, gen = _fold_case(sizes, len(sizes) + world, grad_dtype)
    numel = momentum.numel()
    layout = ChunkLayout.create(numel, world, max_block, "rms")
    mask = CoordinateMask.build(layout, torch.rand(numel, generator=gen) > 0.2)
    error = torch.randn(layout.padded_numel, generator=gen) * 0.1 * mask.keep

    def run(backend):
        out = torch.full((numel,), 7.0)
        err = error.clone()
        packed = torch.empty(layout.padded_numel // 8, dtype=torch.uint8)
        scales = torch.empty(layout.num_blocks)
        C.worker_compress(Fold(out, momentum, parts), err, mask, layout, packed, scales,
                          backend=backend)
        return packed, scales, err, out

    ref, native = _both(run)
    for a, b in zip(ref[:3], native[:3], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(native[3], torch.full((numel,), 7.0))  # folded on the fly
    assert not torch.equal(ref[3], native[3])  # the reference folded into the buffer


def test_a_fold_the_kernel_cannot_read_is_folded_first():
    """An fp16 gradient (or one not contiguous) goes through the buffer, the same bits."""
    momentum, parts, gen = _fold_case([300, 500], 5, torch.float32)
    parts[0] = (*parts[0][:2], parts[0][2].half(), *parts[0][3:])
    layout = ChunkLayout.create(800, 2, 64, "rms")
    mask = CoordinateMask.build(layout, None)
    results = []
    for backend in ("torch", "cpu"):
        out, err = torch.zeros(800), torch.zeros(layout.padded_numel)
        packed = torch.empty(layout.padded_numel // 8, dtype=torch.uint8)
        scales = torch.empty(layout.num_blocks)
        C.worker_compress(Fold(out, momentum, parts), err, mask, layout, packed, scales,
                          backend=backend)
        results.append((packed, scales, err, out))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    assert results[1][3].abs().sum() > 0  # folded into the buffer first


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("world,max_block", LAYOUTS)
@pytest.mark.parametrize("scale", ["rms", "mean"])
def test_server_pass_equals_the_reference(numel, world, max_block, scale):
    layout, mask, _, _, gen = _case(numel, world, max_block, scale, seed=1)
    chunk, blocks = layout.chunk, layout.blocks_per_chunk
    recv_packed = torch.randint(0, 256, (world, chunk // 8), dtype=torch.uint8, generator=gen)
    recv_scales = torch.rand(world, blocks, generator=gen)
    own = mask.chunk(layout, world - 1)  # the last chunk holds the padding
    error = torch.randn(chunk, generator=gen) * 0.1 * own.keep

    def run(backend):
        err = error.clone()
        packed = torch.empty(chunk // 8, dtype=torch.uint8)
        scales = torch.empty(blocks)
        C.server_compress(recv_packed, recv_scales, err, own, layout, packed, scales,
                          backend=backend)
        return packed, scales, err

    for a, b in zip(*_both(run), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_equals_the_reference(numel, dtype):
    layout, mask, _, _, gen = _case(numel, 3, 128, "rms", seed=2)
    packed = torch.randint(0, 256, (layout.padded_numel // 8,), dtype=torch.uint8, generator=gen)
    scales = torch.rand(layout.num_blocks, generator=gen)

    def run(backend):
        out = torch.full((numel,), float("nan"), dtype=dtype)
        C.decompress(packed, scales, mask, layout, out, backend=backend)
        return out

    ref, native = _both(run)
    assert torch.equal(ref, native)


@pytest.mark.parametrize("bounded", [True, False])
@pytest.mark.parametrize("decay", [1.0, 1 - 3e-3 * 0.1])
def test_the_update_pass_equals_the_torch_passes(bounded, decay):
    """The one-pass update (kernels/cpu_update.c) against frozen_update_'s torch passes, bit for
    bit, with the averaged momentum copied into the optimizer's on the way: ragged sizes, a
    tensor above the threaded size, ratios inside and outside the clamp, steps of three bias
    corrections, and a NaN kept through the clamp."""
    from onebit_plugin.maths.update import _frozen_update_passes

    gen = torch.Generator().manual_seed(5)
    sizes = [1, 7, 1001, 70001, cpu.PARALLEL_FROM + 13]
    params = [torch.randn(n, generator=gen) for n in sizes]
    moms = [torch.randn(n, generator=gen) * 1e-2 for n in sizes]
    denoms = [torch.rand(n, generator=gen) * 2e-2 + 1e-8 for n in sizes]
    moms[2][5] = float("nan")
    corrections = [1 - 0.9**step for step in (1, 2, 40, 40, 7)]
    lr = 3e-3
    fused = [p.clone() for p in params]
    copies = [torch.full_like(m, 3.0) for m in moms]
    # All in one call, as a parameter group's; the tiles of several parameters shared by threads.
    cpu.frozen_update_many([(p, m, d, into, -(lr / c), c if bounded else None) for
                            p, m, d, c, into in zip(fused, moms, denoms, corrections, copies,
                                                    strict=True)], decay=decay)
    for m, into in zip(moms, copies, strict=True):  # the momentum copied on the way
        assert torch.equal(into.nan_to_num(7.0), m.nan_to_num(7.0))
    alone = params[3].clone()  # without a copy, the same update
    cpu.frozen_update_many([(alone, moms[3], denoms[3], None, -(lr / corrections[3]),
                             corrections[3] if bounded else None)], decay=decay)
    assert torch.equal(alone, fused[3])
    passes = [p.clone() for p in params]
    _frozen_update_passes(passes, moms, denoms, corrections, lr=lr, decay=decay,
                          bounds=[1.0 if bounded else None] * len(passes), work=None)
    clamped = sum(int(((m / d).abs() > c).sum())
                  for m, d, c in zip(moms, denoms, corrections, strict=True))
    assert clamped > 1000  # the clamp acts on many values
    for a, b in zip(fused, passes, strict=True):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
        assert torch.equal(a.isnan(), b.isnan())
    assert not torch.equal(fused[3], params[3])
    assert fused[2][5].isnan()


def test_the_background_thread_runs_the_passes_on_one_thread():
    """Beside backward (OneBitAdam's background thread) a large pass takes one thread; in
    step() (here, the main thread) torch's intra-op thread count."""
    from onebit_plugin.comm.collectives import comm_executor

    big = cpu.PARALLEL_FROM
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert cpu._threads(big) == 2 and cpu._threads(big - 1) == 1
        assert comm_executor(None).submit(cpu._threads, big).result() == 1
    finally:
        torch.set_num_threads(threads)


def test_the_cpu_path_is_the_default_and_rejects_what_it_cannot_read():
    layout, mask, x, error, _ = _case(1001, 2, 128, "rms")
    assert C.backend_for(x, None, x) == "cpu"
    assert C.backend_for(x.half(), None, x) == "torch"  # fp16 input: the torch passes
    packed = torch.empty(layout.padded_numel // 8, dtype=torch.uint8)
    scales = torch.empty(layout.num_blocks)
    with pytest.raises(ValueError, match=r"contiguous CPU tensors, got one of shape \(1001,\)"):
        C.worker_compress(torch.randn(2002)[::2], error, mask, layout, packed, scales,
                          backend="cpu")
    with pytest.raises(ValueError, match="fp32 or bf16 input, got torch.float16"):
        C.worker_compress(x.half(), error, mask, layout, packed, scales, backend="cpu")
    with pytest.raises(ValueError, match="backend must be one of"):
        C.worker_compress(x, error, mask, layout, packed, scales, backend="numba")


_CHILD = textwrap.dedent("""
    import logging, time, torch
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from onebit_plugin.wire import compression as C
    from onebit_plugin.kernels import cpu
    start = time.perf_counter()
    lay = C.ChunkLayout.create(5000, 2, 2048)
    mask = C.CoordinateMask.build(lay)
    x = torch.randn(5000)
    for _ in range(2):
        C.worker_compress(x, torch.zeros(lay.padded_numel), mask, lay,
                          torch.empty(lay.padded_numel // 8, dtype=torch.uint8),
                          torch.empty(lay.num_blocks))
    print(C.backend_for(x, None, x), f"{time.perf_counter() - start:.1f}")
""")


def _child(env):
    with owned_processes() as start:
        proc = start([sys.executable, "-c", _CHILD], env={**os.environ, **env},
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return out.split(), err


def test_a_bad_setting_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("ONEBIT_CPU_KERNEL", "fast")
    monkeypatch.setattr(cpu, "_state", {})
    from onebit_plugin.wire.dispatch import cpu_kernel

    with pytest.raises(ValueError, match="ONEBIT_CPU_KERNEL must be 1 or 0 .+ got 'fast'"):
        cpu_kernel()


def test_first_build_is_cached(tmp_path):
    (backend, seconds), said = _child({"XDG_CACHE_HOME": str(tmp_path)})
    built = list((tmp_path / "onebit_plugin").glob("onebit_cpu_*.so"))
    assert backend == "cpu" and len(built) == 1 and "onebit:" not in said
    print(f"first use, build included: {seconds} s")
    assert float(seconds) < 60
    stamp = built[0].stat().st_mtime_ns
    assert _child({"XDG_CACHE_HOME": str(tmp_path)})[0][0] == "cpu"
    assert built[0].stat().st_mtime_ns == stamp  # loaded from the cache, not rebuilt


_PLANTED = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) fclose(f);
}
"""


@pytest.mark.parametrize("how", ["replaced", "no digest", "writable by others"])
def test_a_library_planted_in_the_cache_is_rebuilt_never_loaded(tmp_path, how):
    """Loading a library runs its code: a crafted one put in the cache under the built
    library's name (whose constructor would create a file) is not loaded but rebuilt, and
    said; so is one without the digest this package writes, or one others may write."""
    (backend, _), said = _child({"XDG_CACHE_HOME": str(tmp_path)})
    (built,) = (tmp_path / "onebit_plugin").glob("onebit_cpu_*.so")
    marker = tmp_path / "planted_code_ran"
    source = tmp_path / "planted.c"
    source.write_text(_PLANTED.replace("MARKER", f'"{marker}"'))
    if how == "replaced":
        subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(built)], check=True)
        reason = "its digest does not match"
    elif how == "no digest":
        subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(built)], check=True)
        built.with_suffix(".sha256").unlink()
        reason = "onebit_cpu_"
    else:
        built.chmod(0o777)
        reason = "is writable by other users"
    (backend, _), said = _child({"XDG_CACHE_HOME": str(tmp_path)})
    lines = [line for line in said.splitlines() if line.startswith("onebit:")]
    assert backend == "cpu" and not marker.exists()
    assert len(lines) == 1 and "is not a library this package built" in lines[0] and \
        reason in lines[0], said
    assert _child({"XDG_CACHE_HOME": str(tmp_path)})[1].count("onebit:") == 0  # rebuilt, kept


@pytest.mark.parametrize("env,reason", [
    ({"CC": "/nonexistent/cc", "PATH": "/nonexistent"}, "no C compiler found"),
    ({"ONEBIT_CPU_KERNEL": "0"}, "ONEBIT_CPU_KERNEL='0'"),
    ({"ONEBIT_CPU_KERNEL": "False"}, "ONEBIT_CPU_KERNEL='False'"),
])
def test_without_the_kernel_the_torch_passes_run_and_it_is_said_once(tmp_path, env, reason):
    (backend, _), said = _child({"XDG_CACHE_HOME": str(tmp_path), **env})
    lines = [line for line in said.splitlines() if line.startswith("onebit:")]
    assert backend == "torch"
    assert len(lines) == 1 and reason in lines[0] and "torch passes" in lines[0], said


def _encoded_average(numel, world, max_block, masked, seed):
    """Random signs and scales of a layout, a random mask, and their decode (C)."""
    gen = torch.Generator().manual_seed(seed)
    layout = ChunkLayout.create(numel, world, max_block)
    mask = CoordinateMask.build(layout, torch.rand(numel, generator=gen) > masked)
    packed = torch.randint(0, 256, (layout.padded_numel // 8,), dtype=torch.uint8, generator=gen)
    scales = torch.rand(layout.num_blocks, generator=gen) * 1e-2
    decoded = torch.empty(numel)
    C.decompress(packed, scales, mask, layout, decoded, backend="cpu")
    return gen, layout, mask, packed, scales, decoded


@pytest.mark.parametrize("bounded", [True, False])
@pytest.mark.parametrize("decay", [1.0, 1 - 3e-3 * 0.1])
def test_the_update_pass_decodes_an_encoded_average_as_the_decode_would(bounded, decay):
    """The update reading each parameter's part of an encoded average (parts starting inside a
    byte and inside a block, spanning several blocks and several of the pass's 4096-value
    tiles, masked values, one part above the threaded size) gives the bits of the decode
    followed by the update, and copies the decoded average; its fallback decode is the
    decode's."""
    from onebit_plugin.wire.deferred import Encoded

    sizes = [1, 7, 1001, 70001, cpu.PARALLEL_FROM + 13]
    gen, layout, mask, packed, scales, decoded = _encoded_average(3 + sum(sizes), 3, 136, 0.2, 9)
    offset, lr = 3, 3e-3
    batch, wants = [], []
    for n, step in zip(sizes, (1, 2, 40, 40, 7), strict=True):
        c = 1 - 0.9**step
        p, d = torch.randn(n, generator=gen), torch.rand(n, generator=gen) * 2e-2 + 1e-8
        want_p, want_m = p.clone(), torch.full((n,), 3.0)
        cpu.frozen_update_many([(want_p, decoded[offset : offset + n], d, want_m, -(lr / c),
                                 c if bounded else None)], decay=decay)
        got_p, got_m = p.clone(), torch.full((n,), 3.0)
        part = Encoded(packed, scales, mask.keep, layout.block, offset, n,
                       functools.partial(torch.empty, n))
        cpu.frozen_update_many([(got_p, part, d, got_m, -(lr / c), c if bounded else None)],
                               decay=decay)
        assert torch.equal(got_p, want_p) and torch.equal(got_m, want_m), n
        assert not torch.equal(got_p, p)
        assert torch.equal(part.decoded(), decoded[offset : offset + n])
        # Again in one call for all: encoded and fp32 averages, in turns, without a copy for
        # the last, each row its own scale and bound.
        averaged = part if len(batch) % 2 == 0 else decoded[offset : offset + n]
        into = None if n == sizes[-1] else torch.full((n,), 3.0)
        batch.append((p.clone(), averaged, d, into, -(lr / c), c if bounded else None))
        wants.append((want_p, want_m))
        offset += n
    cpu.frozen_update_many(batch, decay=decay)
    for (got_p, _, _, got_m, _, _), (want_p, want_m) in zip(batch, wants, strict=True):
        assert torch.equal(got_p, want_p)
        assert got_m is None or torch.equal(got_m, want_m)


def test_frozen_update_takes_encoded_parts_and_decodes_those_it_cannot_read_so():
    """frozen_update_ with encoded averages equals it with the decoded ones; a parameter the
    C pass cannot read (a transposed view) has its part decoded into the fallback and goes
    through the torch passes."""
    from onebit_plugin.maths.update import frozen_update_
    from onebit_plugin.wire.deferred import Encoded

    shapes = [(30, 17), (5,), (64, 40)]
    numel = sum(torch.Size(s).numel() for s in shapes)
    gen, layout, mask, packed, scales, decoded = _encoded_average(numel, 2, 64, 0.1, 4)
    params = [torch.randn(s, generator=gen) for s in shapes]
    params[2] = torch.randn(40, 64, generator=gen).t()  # not contiguous: the torch passes
    denoms = [torch.rand(s, generator=gen) * 2e-2 + 1e-8 for s in shapes]
    results = []
    for encoded in (False, True):
        ps = [p.clone() for p in params]
        ps[2] = params[2].t().clone().t()
        moms = [torch.zeros(s) for s in shapes]
        averaged, offset = [], 0
        for s in shapes:
            n = torch.Size(s).numel()
            view = decoded[offset : offset + n].clone().view(s)
            averaged.append(Encoded(packed, scales, mask.keep, layout.block, offset, n,
                                    functools.partial(torch.empty, s)) if encoded else view)
            offset += n
        frozen_update_(ps, moms, denoms, [3.0, 3.0, 3.0], lr=1e-3, beta1=0.9,
                       weight_decay=0.1, decoupled=True, averaged=averaged)
        results.append((ps, moms))
    (want_p, want_m), (got_p, got_m) = results
    for a, b in zip(want_p + want_m, got_p + got_m, strict=True):
        assert torch.equal(a, b)
