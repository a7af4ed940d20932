"""Compact (bf16) error buffers, ``error_dtype="bfloat16"`` (issue 30): the stochastic rounding
is unbiased and lands on a neighbour, error feedback still cancels the compression error over
calls, the optimizer keeps half the error bytes, and a run resumes bit for bit."""

import functools
import logging

import pytest
import torch
from torch import nn

from onebit_plugin import CompressedAllreduce, OneBitAdam
from onebit_plugin.core.memory import buffer_bytes
from onebit_plugin.wire.compression import round_to_bf16_
from tests.dist_helpers import resume, run_ranks, save_for_resume


def _neighbours(x):
    bits = x.view(torch.int32) >> 16
    return (bits << 16).view(torch.float32), ((bits + 1) << 16).view(torch.float32)


def test_stochastic_rounding_lands_on_a_neighbour_up_as_often_as_the_dropped_fraction():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=gen) * 1e-3
    down, up = _neighbours(x)
    out = torch.empty(x.numel(), dtype=torch.bfloat16)
    round_to_bf16_(x.clone(), out, seed=7)
    got = out.float()
    assert bool(((got == down) | (got == up)).all())
    # A value a quarter of a bf16 ulp above a bf16 number rounds up about 1 time in 4.
    quarter = (down + (up - down) * 0.25)[:50_000]
    ups = []
    for seed in range(4):
        round_to_bf16_(quarter.clone(), out[:50_000], seed)
        ups.append(float((out[:50_000].float() != _neighbours(quarter)[0]).float().mean()))
    assert all(0.24 < u < 0.26 for u in ups), ups
    # Unbiased: the mean of 32 roundings is far closer to x than one nearest rounding.
    mean = torch.zeros_like(x)
    for seed in range(32):
        round_to_bf16_(x.clone(), out, seed)
        mean += out.float() / 32
    nearest = (x.to(torch.bfloat16).float() - x).abs().mean()
    assert (mean - x).abs().mean() < nearest / 3
    assert abs(float((mean - x).sum())) < 0.01 * float(x.abs().sum()) / 100


def test_the_same_seed_gives_the_same_bits_and_another_other_bits():
    x = torch.randn(4096) * 3.0
    a, b, c = (torch.empty(4096, dtype=torch.bfloat16) for _ in range(3))
    round_to_bf16_(x.clone(), a, 1)
    round_to_bf16_(x.clone(), b, 1)
    round_to_bf16_(x.clone(), c, 2)
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("error_dtype", ["float32", "bfloat16"])
def test_error_feedback_with_compact_errors_cancels_the_compression_error(error_dtype):
    """A fixed tensor compressed 200 times: the mean of what came out approaches it (the error
    feedback carries each call's residual), with bf16 errors as with fp32 ones."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(20_000, generator=gen) * torch.rand(20_000, generator=gen)
    state = CompressedAllreduce(x.numel(), max_block=256, error_dtype=error_dtype)
    assert state.worker_error.dtype == getattr(torch, error_dtype)
    total = torch.zeros_like(x)
    for _ in range(200):
        total += state(x.clone())
    gap = float((total / 200 - x).norm() / x.norm())
    one = float((state(x.clone()) - x).norm() / x.norm())  # a single call's error
    assert one > 0.3 and gap < 0.02, (one, gap)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))


def _run(rank, world, steps, error_dtype, save_at=None, ckpt=None, load=None, compress=True):
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=3, error_dtype=error_dtype,
                     bucket_cap_mb=0.001, compress_momentum=compress)
    start = resume(load, rank, model, opt)
    trace = []
    for step in range(start, steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        trace.append([p.detach().clone() for p in model.parameters()])
        if step + 1 == save_at:
            save_for_resume(ckpt, rank, model, opt, step + 1)
    kinds = {k: v for k, v in buffer_bytes(opt).items() if k.endswith("error")}
    dtypes = {str(e.dtype) for u in opt.units for k, e in u.errors.items() if k != "draws"}
    return trace, kinds, dtypes


def test_compact_errors_halve_the_error_bytes_stay_near_fp32_errors_and_resume_bitwise(
        tmp_path):
    full = run_ranks(functools.partial(_run, error_dtype="float32"), 2, 12)
    exact = run_ranks(functools.partial(_run, error_dtype="float32", compress=False), 2, 12)
    compact = run_ranks(functools.partial(_run, error_dtype="bfloat16", save_at=7,
                                          ckpt=str(tmp_path / "c")), 2, 12)
    resumed = run_ranks(functools.partial(_run, error_dtype="bfloat16",
                                          load=str(tmp_path / "c")), 2, 12)
    for r in range(2):
        (f_trace, f_bytes, f_dtypes), (c_trace, c_bytes, c_dtypes) = full[r], compact[r]
        assert f_dtypes == {"torch.float32"} and c_dtypes == {"torch.bfloat16"}
        for name in ("worker error", "server error"):
            assert c_bytes[name] * 2 == f_bytes[name]
        # The warm-up is the same; compression steps differ by the rounding of the errors only.
        for a, b in zip(f_trace[2], c_trace[2], strict=True):
            assert torch.equal(a, b)
        # Rounding the errors moves the run far less than compressing does (its distance from
        # the same run averaged exactly), over the parameters' moves since the freeze.
        near, far = (sum(float((a - b).norm()) for a, b in
                         zip(f_trace[-1], run[-1], strict=True))
                     for run in (c_trace, exact[r][0]))
        assert 0 < near < 0.5 * far, (near, far)
        for a, b in zip(c_trace[7:], resumed[r][0], strict=True):
            assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    # ranks in lockstep
    for a, b in zip(compact[0][0][-1], compact[1][0][-1], strict=True):
        assert torch.equal(a, b)


class _Said(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _switch_run(rank, world, ckpt, cap):
    """Compression stage on fp32 errors, saved; resumed with bf16 errors (several units, or
    one: ``cap``); what was said, and the errors before and after."""
    said = _Said()
    logging.getLogger("onebit_plugin").addHandler(said)
    torch.manual_seed(0)  # no parameter holds half of the values
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2, bucket_cap_mb=cap)
    for step in range(4):
        gen = torch.Generator().manual_seed(100 * step + rank)
        opt.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(32, 16, generator=gen)),
                                    torch.randint(0, 4, (32,), generator=gen)).backward()
        opt.step()
    torch.save(opt.state_dict(), f"{ckpt}.{rank}")
    saved = [u.errors["worker"].clone() for u in opt.units]
    compact = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2, bucket_cap_mb=cap,
                         error_dtype="bfloat16")
    compact.load_state_dict(torch.load(f"{ckpt}.{rank}", weights_only=True))
    compact.prepare_stage()  # the units take the loaded errors, as the next step would
    loaded = [u.errors["worker"].clone() for u in compact.units]
    return said.lines, saved, loaded


def test_errors_saved_in_fp32_resume_as_bf16_said_and_compact_errors_that_save_nothing_said(
        tmp_path):
    for lines, saved, loaded in run_ranks(_switch_run, 2, str(tmp_path / "c"), 0.001):
        assert len(saved) > 2
        assert sum("converted (rounded to nearest once)" in line for line in lines) == 1
        for a, b in zip(saved, loaded, strict=True):
            assert b.dtype == torch.bfloat16 and torch.equal(a.to(torch.bfloat16), b)
        assert not any("saves no memory" in line for line in lines)
    # One unit for the whole model: its fp32 scratch outweighs halving the errors (rank 0 says).
    (lines0, saved, _), (lines1, _, _) = run_ranks(_switch_run, 2, str(tmp_path / "d"), None)
    assert len(saved) == 1
    assert sum("saves no memory" in line for line in lines0) == 1
    assert not any("saves no memory" in line for line in lines1)
