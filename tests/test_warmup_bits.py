"""``warmup_bits``: the full-precision steps (the warm-up, 0/1 Adam's Adam steps and variance
refreshes) averaged in bf16 or blockwise int8 by a two-phase allreduce; fp32 at 32, the default,
as before. Bytes are counted at torch's collectives, not by the package's counters."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from onebit_plugin import OneBitAdam, OneBitLamb, ZeroOneAdam, register_onebit_hook
from onebit_plugin.comm.quantized import QuantizedAverage
from onebit_plugin.entry.deepspeed_config import from_deepspeed_config
from onebit_plugin.settings.config import settings_from_env
from onebit_plugin.wire.quantize import QuantLayout, average_quantize, dequantize, quantize
from tests.dist_helpers import assert_ranks_identical, counting_collectives, run_ranks

BACKENDS = ("torch", "cpu", "triton")


def _values(layout: QuantLayout, seed: int) -> torch.Tensor:
    """Heavy-tailed values with a zero block, a zero, an infinity and a NaN where they fit."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(layout.padded_numel, generator=g) * torch.rand(
        layout.padded_numel, generator=g) ** 4 * 30
    x[0] = 0.0
    if layout.num_blocks >= 4:
        x[layout.block: 2 * layout.block] = 0.0
        x[2 * layout.block + 3] = float("inf")
        x[3 * layout.block + 1] = float("nan")
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.int8 else t.view(torch.int32)


@pytest.mark.parametrize("numel,world,max_block", [(10000, 3, 2048), (5, 2, 2048),
                                                   (100_003, 4, 4096), (777, 1, 64)])
def test_the_three_passes_give_the_same_bits_on_every_backend(numel, world, max_block):
    layout = QuantLayout.create(numel, world, max_block)
    x = _values(layout, numel)
    outs = {}
    for backend in BACKENDS:
        q = torch.empty(layout.padded_numel, dtype=torch.int8)
        scales = torch.empty(layout.num_blocks)
        quantize(x, layout, q, scales, backend=backend)
        own_q = torch.empty(layout.chunk, dtype=torch.int8)
        own_scales = torch.empty(layout.blocks_per_chunk)
        average_quantize(q.view(world, -1).contiguous(), scales.view(world, -1).contiguous(),
                         layout, own_q, own_scales, backend=backend)
        out = torch.empty(layout.padded_numel)
        dequantize(q, scales, layout, out, backend=backend)
        outs[backend] = [_bits(t) for t in (q, scales, own_q, own_scales, out)]
    for backend in BACKENDS[1:]:
        for name, a, b in zip(("q", "scales", "own q", "own scales", "decoded"),
                              outs["torch"], outs[backend], strict=True):
            assert torch.equal(a, b), (backend, name)


def test_every_backend_quantizes_as_correctly_rounded_fp32_arithmetic_does():
    """numpy's float32 arithmetic (each operation rounded once) as the oracle, on 2M randn values
    and a block where 127 / m and torch's reciprocal(m) * 127 differ by an ulp that moves a value
    across a .5 tie: 0.25434482 * (127 / 3.800211) is 8.5 exactly (q = 8, half to even), with the
    reciprocal 8.500001 (q = 9)."""
    np = pytest.importorskip("numpy")
    layout = QuantLayout.create(1 << 21, 2, 2048)
    x = torch.randn(layout.padded_numel, generator=torch.Generator().manual_seed(0))
    x[:layout.block] = 0.0
    x[0], x[1] = 3.800210952758789, 0.2543448209762573
    blocks = x.numpy().reshape(-1, layout.block)
    m = np.abs(blocks).max(axis=1, keepdims=True)
    expect_q = np.clip(np.rint(blocks * (np.float32(127) / m)), -127, 127).astype(np.int8)
    expect_scales = (m[:, 0] / np.float32(127)).astype(np.float32)
    assert expect_q[0, 1] == 8
    for backend in BACKENDS:
        q = torch.empty(layout.padded_numel, dtype=torch.int8)
        scales = torch.empty(layout.num_blocks)
        quantize(x, layout, q, scales, backend=backend)
        assert int(q[1]) == 8, backend
        assert np.array_equal(q.numpy().reshape(-1, layout.block), expect_q), backend
        assert np.array_equal(scales.numpy(), expect_scales), backend


def test_quantization_is_round_to_nearest_within_a_254th_of_the_block_maximum():
    layout = QuantLayout.create(50_000, 2, 2048)
    x = _values(layout, 1)
    q = torch.empty(layout.padded_numel, dtype=torch.int8)
    scales = torch.empty(layout.num_blocks)
    quantize(x, layout, q, scales)
    out = torch.empty(layout.padded_numel)
    dequantize(q, scales, layout, out)
    blocks = x.view(-1, layout.block)
    finite = torch.isfinite(blocks).all(1)
    # A block holding inf or NaN decodes to NaN everywhere (the step will be skipped).
    assert finite.tolist().count(False) == 2
    assert torch.isnan(out.view(-1, layout.block)[~finite]).all()
    absmax = blocks[finite].abs().amax(1, keepdim=True)
    error = (out.view(-1, layout.block)[finite] - blocks[finite]).abs()
    bound = absmax / 254 * (1 + 1e-6)
    assert (error <= bound).all()
    # Round to nearest, not truncation: errors spread over the whole half-step.
    assert float((error / absmax.clamp_min(1e-30)).amax()) > 0.9 / 254
    # The zero block stays exactly zero, and the largest value of a block is 127 steps.
    assert torch.equal(out[layout.block: 2 * layout.block], torch.zeros(layout.block))
    assert q.view(-1, layout.block)[finite].abs().amax(1).eq(127).sum() == finite.sum() - 1


def test_the_layout_pads_little_and_scales_are_a_small_share():
    for numel, world in ((6_458_112, 4), (137_216, 3), (10_000, 3), (5, 2)):
        layout = QuantLayout.create(numel, world, 2048)
        assert layout.block <= 2048 and layout.block % 8 == 0
        assert layout.padded_numel - numel < 8 * layout.num_blocks
        if numel > 100_000:  # 4 bytes of scale and under 8 of padding a block
            assert layout.row_bytes * world < numel * (1 + 12 / layout.block)
    assert QuantLayout.create(10_000, 3, 2048).padded_numel == 10_032


def _average_on_ranks(rank, world, bits, numel):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(numel, generator=g) * (rank + 1)
    sent = [0]
    real = counting_collectives(world, sent)
    try:
        flat = x.clone()
        reported = QuantizedAverage(bits, 2048).average_(flat, None, world, None)
    finally:
        dist.all_to_all_single, dist.all_reduce = real
    return x, flat, reported, sent[0]


@pytest.mark.parametrize("bits", [8, 16])
def test_every_rank_decodes_the_same_average_at_a_quarter_or_half_of_fp32s_bytes(bits):
    world, numel = 3, 100_000
    out = run_ranks(_average_on_ranks, world, bits, numel)
    assert_ranks_identical([flat for _, flat, _, _ in out], "averages")
    mean = sum(x for x, _, _, _ in out) / world
    got = out[0][1]
    if bits == 8:
        # Each value quantized twice: at most a 254th of its block's maximum each time.
        assert float((got - mean).abs().max()) <= 2 * 3 * 4.5 / 254
        assert float((got - mean).abs().max()) > 1e-3  # and it is int8, not fp32
    else:
        assert float(((got - mean).abs() / mean.abs().clamp_min(1e-3)).median()) < 2 ** -8
    fp32_ring = 2 * (world - 1) * 4 * numel // world
    for _, _, reported, sent in out:
        assert sent == reported  # the package's count is what the collectives carried
        assert sent / fp32_ring == pytest.approx(0.25 if bits == 8 else 0.5, rel=0.01)


def _train(rank, world, member, bits, ddp, steps, nonfinite_at=None, save=None, load=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(),
                                torch.nn.Linear(48, 6))
    options = dict(lr=1e-2) if bits is None else dict(lr=1e-2, warmup_bits=bits)  # None: unset
    if member == "onebit_adam":
        opt = OneBitAdam(model.parameters(), freeze_step=8, **options)
    elif member == "onebit_lamb":
        opt = OneBitLamb(model.parameters(), freeze_step=8, **options)
    else:
        # local_variance=False: its refreshes average the gradients in warmup_bits, as these
        # tests measure (local_variance's own bf16 average: test_local_variance.py).
        opt = ZeroOneAdam(model.parameters(), var_freeze_step=6, var_update_scaler=2,
                          local_step_scaler=4, local_step_clipper=2, local_variance=False,
                          **options)
    net = model
    if ddp:
        net = torch.nn.parallel.DistributedDataParallel(model)
        register_onebit_hook(net, opt)
    start = 0
    if load is not None:
        saved = torch.load(f"{load}.{rank}", weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        start = saved["step"]
    sent, after, grads = [0], [], []
    real = counting_collectives(world, sent)
    try:
        for step in range(start, steps):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(16, 24, generator=g), torch.randn(16, 6, generator=g)
            if step == nonfinite_at and rank == 1:  # an overflow in this rank's backward
                y[0, 0] = float("inf")
            loss = torch.nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            if step == start and not ddp:  # this rank's own gradients
                grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
            opt.step()
            if step == start:  # what the step averaged them to (in place)
                grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
            after.append([p.detach().clone() for p in model.parameters()])
            if save is not None and step + 1 == save[1]:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "step": step + 1}, f"{save[0]}.{rank}")
    finally:
        dist.all_to_all_single, dist.all_reduce = real
    return after, sent[0], opt.skipped_steps, grads


def _first_gradients(world: int) -> list[torch.Tensor]:
    """Each rank's own flat gradients at ``_train``'s first step, computed here."""
    out = []
    for rank in range(world):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(),
                                    torch.nn.Linear(48, 6))
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(16, 24, generator=g), torch.randn(16, 6, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return out


def _two_phase_reference(local: list[torch.Tensor]) -> torch.Tensor:
    """The int8 two-phase average of the ranks' flat gradients ``local``, by the reference
    passes in one process: each rank's values quantized, each chunk's copies averaged and
    quantized again by its owner, the gathered chunks decoded."""
    world, n = len(local), local[0].numel()
    layout = QuantLayout.create(n, world, 2048)
    qs, ss = [], []
    for x in local:
        padded = torch.zeros(layout.padded_numel)
        padded[:n] = x
        q, s = torch.empty(layout.padded_numel, dtype=torch.int8), torch.empty(layout.num_blocks)
        quantize(padded, layout, q, s, backend="torch")
        qs.append(q.view(world, -1))
        ss.append(s.view(world, -1))
    all_q = torch.empty(world, layout.chunk, dtype=torch.int8)
    all_s = torch.empty(world, layout.blocks_per_chunk)
    for k in range(world):
        average_quantize(torch.stack([q[k] for q in qs]), torch.stack([s[k] for s in ss]),
                         layout, all_q[k], all_s[k], backend="torch")
    out = torch.empty(layout.padded_numel)
    dequantize(all_q.view(-1), all_s.view(-1), layout, out, backend="torch")
    return out[:n]


@pytest.mark.parametrize("ddp", [False, True], ids=["step", "ddp-hook"])
@pytest.mark.parametrize("member", ["onebit_adam", "zero_one_adam", "onebit_lamb"])
def test_8_bit_warmup_keeps_the_ranks_identical_and_sends_a_quarter(member, ddp):
    world, steps = 3, 8 if member != "zero_one_adam" else 6  # the exact stage only
    exact = run_ranks(_train, world, member, 32, ddp, steps)
    int8 = run_ranks(_train, world, member, 8, ddp, steps)
    for runs in (exact, int8):
        for step in range(steps):
            assert_ranks_identical([after[step] for after, *_ in runs], f"step {step}")
    averaged = int8[0][3][-1]
    if not ddp:  # the step's gradients are the two-phase average, bit for bit
        assert torch.equal(averaged, _two_phase_reference([r[3][0] for r in int8]))
    # Under the hook the buckets are DDP's: the fp32 run's average, rounded twice, each time by
    # at most a 254th of a block's largest value (each rank's, then the mean's).
    mean, local = exact[0][3][-1], _first_gradients(world)
    bound = (sum(float(g.abs().max()) for g in local) / world + float(mean.abs().max())) / 254
    assert 0 < float((averaged - mean).abs().max()) <= bound * (1 + 1e-5)
    ratio = int8[0][1] / exact[0][1]
    assert 0.25 < ratio < 0.28  # int8 and its scales, and the fp32 flags of the step path


def test_warmup_bits_32_is_the_default_bit_for_bit():
    world = 2
    default = run_ranks(_train, world, "onebit_adam", None, True, 8)
    explicit = run_ranks(_train, world, "onebit_adam", 32, True, 8)
    assert_ranks_identical([default[0][0], explicit[0][0]], "default and warmup_bits=32")


@pytest.mark.parametrize("ddp", [False, True], ids=["step", "ddp-hook"])
def test_a_nonfinite_gradient_on_one_rank_skips_the_8_bit_step_everywhere(ddp):
    out = run_ranks(_train, 2, "onebit_adam", 8, ddp, 6, 3)
    assert [r[2] for r in out] == [1, 1]
    for step in range(6):
        assert_ranks_identical([r[0][step] for r in out], f"step {step}")
    after = out[0][0]
    assert all(torch.equal(a, b) for a, b in zip(after[2], after[3], strict=True))
    assert all(torch.isfinite(p).all() for p in after[-1])


@pytest.mark.parametrize("member", ["onebit_adam", "zero_one_adam"])
def test_an_8_bit_run_resumes_bitwise_and_a_change_of_bits_is_said(member, tmp_path, caplog):
    whole = run_ranks(_train, 2, member, 8, False, 12, None, (str(tmp_path / "ck"), 4))
    resumed = run_ranks(_train, 2, member, 8, False, 12, None, None, str(tmp_path / "ck"))
    for rank in range(2):
        assert_ranks_identical([whole[rank][0][-1], resumed[rank][0][-1]], "resumed")
    # Nothing carries over between full-precision steps: another setting is allowed, said.
    model = torch.nn.Linear(3, 1)
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=8, warmup_bits=8)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    state = opt.state_dict()
    other = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=8, warmup_bits=16)
    with caplog.at_level(logging.WARNING, logger="onebit_plugin"):
        other.load_state_dict(state)
    assert "warmup_bits=8, this optimizer's at 16" in caplog.text


def test_warmup_bits_is_checked_and_read_from_the_environment_and_deepspeed(monkeypatch):
    params = [torch.nn.Parameter(torch.ones(3))]
    for bad in (4, 8.0, "8", True):
        with pytest.raises(ValueError, match=r"warmup_bits must be one of \(32, 16, 8\)"):
            OneBitAdam(params, freeze_step=2, warmup_bits=bad)
    monkeypatch.setenv("ONEBIT_ADAM", "1")
    monkeypatch.setenv("ONEBIT_FREEZE_STEP", "5")
    monkeypatch.setenv("ONEBIT_WARMUP_BITS", "8")
    assert settings_from_env().config.warmup_bits == 8
    assert settings_from_env().member_options(None)["warmup_bits"] == 8
    monkeypatch.setenv("ONEBIT_WARMUP_BITS", "12")
    with pytest.raises(ValueError, match=r"ONEBIT_WARMUP_BITS must be one of \(32, 16, 8\)"):
        settings_from_env()
    monkeypatch.setenv("ONEBIT_WARMUP_BITS", "eight")
    with pytest.raises(ValueError, match="ONEBIT_WARMUP_BITS must be an integer"):
        settings_from_env()
    for kind, extra in (("OneBitAdam", {"freeze_step": 3}), ("ZeroOneAdam", {}),
                        ("OneBitLamb", {"freeze_step": 3})):
        opt = from_deepspeed_config(params, {"optimizer": {"type": kind, "params": {
            "lr": 1e-3, "warmup_bits": 16, **extra}}}, total_steps=100)
        assert opt.config.warmup_bits == 16, kind


def _disagree(rank, world, member):
    param = torch.nn.Parameter(torch.ones(4))
    bits = 8 if rank == 0 else 32
    opt = (OneBitAdam([param], lr=0.1, freeze_step=2, warmup_bits=bits) if member == "adam"
           else ZeroOneAdam([param], lr=0.1, total_steps=10, warmup_bits=bits))
    param.grad = torch.ones(4)
    try:
        opt.step()
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("member", ["adam", "zero_one"])
def test_ranks_that_disagree_on_warmup_bits_are_refused_naming_the_member(member):
    name = "OneBitAdam" if member == "adam" else "ZeroOneAdam"
    for message in run_ranks(_disagree, 2, member):
        assert message.startswith(f"{name}'s warmup_bits differs between ranks: [8, 32]")


_COMPILE = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from onebit_plugin.core.gradient_average import QUANT_BLOCK
from onebit_plugin.kernels import int8_quantize as k

kernels = {
    k._quantize_kernel: {"x_ptr": "*fp32", "q_ptr": "*i8", "scales_ptr": "*fp32",
                         "block": "i32", "TILE": "constexpr"},
    k._average_quantize_kernel: {"recv_q_ptr": "*i8", "recv_scales_ptr": "*fp32",
                                 "q_ptr": "*i8", "scales_ptr": "*fp32", "world": "i32",
                                 "per": "i32", "block": "i32", "TILE": "constexpr"},
    k._dequantize_kernel: {"q_ptr": "*i8", "scales_ptr": "*fp32", "out_ptr": "*fp32",
                           "block": "i32", "TILE": "constexpr"},
}
for fn, sig in kernels.items():
    config = k._config(QUANT_BLOCK)  # the block the package sends
    compiled = triton.compile(ASTSource(fn=fn, signature=sig,
                                        constexprs={"TILE": config["TILE"]}),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config["num_warps"],
                                       "enable_fp_fusion": False})
    ptx = compiled.asm["ptx"]
    print(json.dumps([fn.__name__, [op for op in ("div.full", "div.approx", "rcp.approx",
                                                  "fma.rn.f32") if op in ptx],
                      "div.rn.f32" in ptx]))
"""


def test_the_int8_kernels_compile_for_a_gpu_with_correctly_rounded_divisions():
    """Compiled for sm_90 on the CPU (the interpreter divides exactly and never fuses): the
    quantizing kernels divide with div.rn, none with div.full or a reciprocal, and no product
    is fused into a sum (the reference rounds q * scale before adding it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.split("\n") if line.startswith("[")]
    assert rows == [["_quantize_kernel", [], True], ["_average_quantize_kernel", [], True],
                    ["_dequantize_kernel", [], False]]
