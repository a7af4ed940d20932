"""Triton kernels (under TRITON_INTERPRET=1 on the CPU) against the torch reference."""

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from onebit_plugin.wire import compression as ref
from onebit_plugin.wire.compression import ChunkLayout, CoordinateMask

kernels = pytest.importorskip("onebit_plugin.kernels")

# Ragged sizes: a single value, less than a byte, one byte, and sizes that leave partial bytes,
# partial blocks and uneven chunks for 3 ranks.
SIZES = [1, 7, 8, 1001, 4099]
# (world size, max_block): one block per chunk, and several blocks per chunk.
LAYOUTS = [(1, 2048), (3, 2048), (2, 64), (5, 128)]
SCALES = ["rms", "mean"]
DTYPES = [torch.float32, torch.bfloat16]


def _mask(layout: ChunkLayout, gen: torch.Generator) -> CoordinateMask:
    user = torch.rand(layout.numel, generator=gen) > 0.2
    return CoordinateMask.build(layout, user)


def _inputs(numel, world, max_block, dtype, seed=0, scale="rms"):
    gen = torch.Generator().manual_seed(seed + numel + 31 * world)
    layout = ChunkLayout.create(numel, world, max_block, scale)
    mask = _mask(layout, gen)
    x = torch.randn(numel, generator=gen).to(dtype)
    error = torch.randn(layout.padded_numel, generator=gen) * 0.1 * mask.keep
    return layout, mask, x, error


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("world,max_block", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", SCALES)
def test_worker_compress(numel, world, max_block, dtype, scale):
    _check_worker(numel, world, max_block, dtype, scale)


def _check_worker(numel, world, max_block, dtype, scale):
    layout, mask, x, error = _inputs(numel, world, max_block, dtype, scale=scale)
    outs = []
    for fn in (functools.partial(ref.worker_compress, backend="torch"), kernels.worker_compress):
        err = error.clone()
        packed = torch.empty(layout.padded_numel // 8, dtype=torch.uint8)
        scales = torch.empty(layout.num_blocks)
        fn(x, err, mask, layout, packed, scales)
        outs.append((packed, scales, err))
    (p_ref, s_ref, e_ref), (p_k, s_k, e_k) = outs
    assert torch.equal(p_k, p_ref)
    assert torch.equal(s_k, s_ref)  # the block sums' order is part of the reference
    assert torch.equal(e_k, e_ref)
    # Masked coordinates and the padding carry no error.
    assert torch.all(e_k[~mask.keep] == 0)


def test_kernels_never_build_the_cpu_passes_index_list():
    """The Triton kernels read ``keep``; the int64 list of masked indices (8 bytes per masked
    value) is built only for the torch passes (the C passes: tests/test_cpu_kernel.py)."""
    layout, mask, x, error = _inputs(4099, 3, 256, torch.float32, scale="rms")
    packed = torch.empty(layout.padded_numel // 8, dtype=torch.uint8)
    scales = torch.empty(layout.num_blocks)
    kernels.worker_compress(x, error.clone(), mask, layout, packed, scales)
    out = torch.empty(layout.numel)
    kernels.decompress(packed, scales, mask, layout, out)
    assert "dropped" not in vars(mask)
    ref.worker_compress(x, error.clone(), mask, layout, packed, scales, backend="torch")
    assert vars(mask)["dropped"].numel() == int((~mask.keep).sum())


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("world,max_block", LAYOUTS)
@pytest.mark.parametrize("scale", SCALES)
def test_server_compress(numel, world, max_block, scale):
    _check_server(numel, world, max_block, scale)


def _check_server(numel, world, max_block, scale):
    layout, mask, _, _ = _inputs(numel, world, max_block, torch.float32, 1, scale)
    gen = torch.Generator().manual_seed(7)
    chunk, blocks = layout.chunk, layout.blocks_per_chunk
    recv_packed = torch.randint(0, 256, (world, chunk // 8), dtype=torch.uint8, generator=gen)
    recv_scales = torch.rand(world, blocks, generator=gen)
    rank = world - 1  # the last chunk holds the padding
    own_mask = mask.chunk(layout, rank)
    error = torch.randn(chunk, generator=gen) * 0.1 * own_mask.keep
    outs = []
    for fn in (functools.partial(ref.server_compress, backend="torch"), kernels.server_compress):
        err = error.clone()
        packed = torch.empty(chunk // 8, dtype=torch.uint8)
        scales = torch.empty(blocks)
        fn(recv_packed, recv_scales, err, own_mask, layout, packed, scales)
        outs.append((packed, scales, err))
    (p_ref, s_ref, e_ref), (p_k, s_k, e_k) = outs
    assert torch.equal(p_k, p_ref)
    assert torch.equal(s_k, s_ref)  # the block sums' order is part of the reference
    assert torch.equal(e_k, e_ref)


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("world,max_block", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decompress(numel, world, max_block, dtype):
    _check_decompress(numel, world, max_block, dtype)


def _check_decompress(numel, world, max_block, dtype):
    layout, mask, _, _ = _inputs(numel, world, max_block, torch.float32, seed=2)
    gen = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (layout.padded_numel // 8,), dtype=torch.uint8, generator=gen)
    scales = torch.rand(layout.num_blocks, generator=gen)
    out_ref = torch.full((numel,), float("nan"), dtype=dtype)
    out_k = out_ref.clone()
    ref.decompress(packed, scales, mask, layout, out_ref, backend="torch")
    kernels.decompress(packed, scales, mask, layout, out_k)
    # Decoding is exact: +-scale or 0, then one rounding to the output dtype.
    if dtype == torch.float32:
        assert torch.equal(out_k, out_ref)
    else:
        # The interpreter converts fp32 to bf16 by truncation, torch (and the GPU) round to
        # nearest: the two differ by at most one bf16 ulp (2**-7 relative), and only there.
        ulp = out_ref.float().abs() * 2**-7
        assert torch.all((out_k.float() - out_ref.float()).abs() <= ulp)
        assert torch.all(out_k.float().abs() <= out_ref.float().abs())
    assert torch.all(out_ref[~mask.keep[:numel]] == 0)


@pytest.mark.parametrize("dtype,scale", [(torch.float32, "rms"), (torch.bfloat16, "mean")])
def test_the_largest_block_matches_the_reference(dtype, scale):
    """max_block=16384 (a tile of 2048 bytes, 16 warps on a GPU), 2 ranks, a partial last
    block: the kernels' int32 offsets within a block, added to int64 block pointers."""
    _check_worker(40001, 2, 16384, dtype, scale)
    _check_server(40001, 2, 16384, scale)
    _check_decompress(40001, 2, 16384, dtype)


@pytest.mark.parametrize("scale", SCALES)
def test_reference_bit_convention(scale):
    """Bit i of byte k is element 8k+i, set for >= 0 (zero is sent as +1); scale = RMS or
    mean |c|."""
    layout = ChunkLayout.create(8, 1, 8, scale)
    mask = CoordinateMask.build(layout)
    x = torch.tensor([1.0, -2.0, 0.0, 3.0, -4.0, 5.0, -6.0, 7.0])
    err = torch.zeros(8)
    packed = torch.empty(1, dtype=torch.uint8)
    scales = torch.empty(1)
    ref.worker_compress(x, err, mask, layout, packed, scales)
    assert packed.item() == 0b10101101
    expected = (140.0 / 8) ** 0.5 if scale == "rms" else 28.0 / 8
    assert scales.item() == pytest.approx(expected)
    torch.testing.assert_close(err, x - expected * torch.where(x >= 0, 1.0, -1.0))


def test_launchers_reject_strided_or_scattered_tensors():
    layout, mask, _, error = _inputs(64, 1, 64, torch.float32)
    packed = torch.empty(layout.padded_numel // 8, dtype=torch.uint8)
    scales = torch.empty(layout.num_blocks)
    with pytest.raises(ValueError, match=r"kernel argument of shape \(64,\) is not contiguous"):
        kernels.worker_compress(torch.randn(128)[::2], error, mask, layout, packed, scales)
    with pytest.raises(ValueError, match=r"several devices: \['cpu', 'meta'\]"):
        kernels.decompress(packed, scales, mask, layout, torch.empty(64, device="meta"))


_COMPILE = r"""
import json, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
from triton.compiler import ASTSource
from onebit_plugin.kernels import sign_compress as k

common = {"err_ptr": "*fp32", "mask_ptr": "*u8", "counts_ptr": "*fp32", "packed_ptr": "*u8",
          "scales_ptr": "*fp32", "block": "i32", "BYTES": "constexpr", "LEVELS": "constexpr",
          "RMS": "constexpr"}
kernels = {
    k._worker_compress_kernel: {"x_ptr": "*bf16", **common, "n": "i64"},
    k._server_compress_kernel: {"recv_packed_ptr": "*u8", "recv_scales_ptr": "*fp32", **common,
                                "world": "i32", "blocks_per_chunk": "i32"},
    k._decompress_kernel: {"packed_ptr": "*u8", "scales_ptr": "*fp32", "mask_ptr": "*u8",
                           "out_ptr": "*fp16", "n": "i64", "block": "i32", "BYTES": "constexpr"},
}
# The tiles of the default max_block (2048 values: 256 bytes) and of the largest (16384), each
# with the warps its launcher gives it.
for tile in (256, 2048):
    warps = k.num_warps(tile)
    for fn, sig in kernels.items():
        levels = (8 * tile).bit_length() - 1
        consts = ({"BYTES": tile, "LEVELS": levels, "RMS": True} if "RMS" in sig
                  else {"BYTES": tile})
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps, "enable_fp_fusion": False})
        ptx = compiled.asm["ptx"]
        # Approximate divides and reciprocals would make scales differ from the reference's.
        approx = [op for op in ("div.full", "div.approx", "rcp.approx", "sqrt.approx")
                  if op in ptx]
        exact = [op for op in ("div.rn.f32", "sqrt.rn.f32") if op in ptx]
        # Registers and spills as ptxas reports them, with Triton's own ptxas and arch.
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as src:
            src.write(ptx)
            src.flush()
            report = subprocess.run([get_ptxas(90).path, "-v", "--fmad=false",
                                     f"-arch={sm_arch_from_capability(90)}", src.name,
                                     "-o", "/dev/null"], capture_output=True, text=True)
        assert report.returncode == 0, report.stderr
        registers = int(re.search(r"Used (\d+) registers", report.stderr).group(1))
        spilled = int(re.search(r"(\d+) bytes spill stores", report.stderr).group(1))
        print(json.dumps([fn.__name__, tile, warps, approx, exact, registers, spilled]))
"""


def test_kernels_compile_for_a_gpu_without_one():
    """The interpreter accepts code that the compiler rejects (and the reverse): compile each
    kernel for sm_90 on the CPU, in a process without TRITON_INTERPRET. Their PTX divides and
    takes square roots correctly rounded (div.rn, sqrt.rn), as the reference does: Triton's "/"
    is div.full.f32 (up to 2 ulp), which the interpreter, dividing exactly, never shows. And
    ptxas's report: at max_block=16384, int64 offsets per value took 203-255 registers at 8
    warps and the server and decompress kernels spilled (56 and 300 bytes); int32 offsets
    within the block and 16 warps (at most 128 registers a thread) spill nothing but 144 bytes
    in the server's pass (docs/benchmarks.md, "GPU check")."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.split("\n") if line.startswith("[")]
    print(*rows, sep="\n")
    exact = {"_worker_compress_kernel": ["div.rn.f32", "sqrt.rn.f32"],
             "_server_compress_kernel": ["div.rn.f32", "sqrt.rn.f32"], "_decompress_kernel": []}
    assert [(name, tile, warps) for name, tile, warps, *_ in rows] == [
        (name, tile, warps) for tile, warps in ((256, 8), (2048, 16)) for name in exact]
    for name, tile, _, approx, ops, registers, spilled in rows:
        assert approx == [] and ops == exact[name], (name, tile)
        assert registers <= 128, (name, tile, registers)
        # The default block spills nothing; at the largest only the server's pass does, 144
        # bytes with triton 3.9's ptxas (the decompress pass spilled 300 at 8 warps).
        limit = 144 if (tile, name) == (2048, "_server_compress_kernel") else 0
        assert spilled <= limit, (name, tile, spilled)
