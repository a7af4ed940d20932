"""1-bit LAMB (issue 31): the warm-up is LAMB as the paper writes it (a reference written here
from the algorithm, not from the code under test), parameters with no elements or zero norms
are fine, the compression stage's factor is clipped as specified, and on 2 ranks the stage
runs in lockstep, stays near the exact-momentum run and resumes bit for bit in both stages."""

import functools
import math

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from onebit_plugin import OneBitLamb, check_lockstep, register_onebit_hook
from onebit_plugin.maths.lamb_update import lamb_factor
from tests.dist_helpers import resume, run_ranks, save_for_resume


def reference_lamb(params, grads_per_step, *, lr, betas, eps, wd, max_coeff=10.0,
                   min_coeff=0.01, ratios=None):
    """LAMB (You et al., 2020, Algorithm 2; Adam's bias corrections), one tensor at a time,
    in float64: the parameters after each step (and each step's ratios into ``ratios``)."""
    b1, b2 = betas
    p = [q.detach().double().clone() for q in params]
    m = [torch.zeros_like(q) for q in p]
    v = [torch.zeros_like(q) for q in p]
    out = []
    for t, grads in enumerate(grads_per_step, start=1):
        if ratios is not None:
            ratios.append([])
        for i, g in enumerate(grads):
            g = g.double()
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            u = (m[i] / (1 - b1**t)) / ((v[i] / (1 - b2**t)).sqrt() + eps) + wd * p[i]
            wn, un = p[i].norm().item(), u.norm().item()
            ratio = min(max(wn / un, min_coeff), max_coeff) if wn > 0 and un > 0 else 1.0
            if ratios is not None:
                ratios[-1].append(ratio)
            p[i] = p[i] - lr * ratio * u
        out.append([q.clone() for q in p])
    return out


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def _grads(step, rank=0):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_the_warm_up_is_lamb(wd):
    model = _model()
    opt = OneBitLamb(model.parameters(), lr=1e-2, weight_decay=wd, freeze_step=100)
    params = list(model.parameters())
    start = [p.detach().clone() for p in params]
    seen, after = [], []
    for step in range(12):
        x, y = _grads(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        seen.append([p.grad.clone() for p in params])
        opt.step()
        after.append([p.detach().clone() for p in params])
    ref = reference_lamb(start, seen, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, wd=wd)
    for got, want in zip(after, ref, strict=True):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)
    # The ratios differ between layers: LAMB's point.
    coeffs = opt.lamb_coeffs()
    assert max(coeffs) > 1.5 * min(coeffs) > 0


def test_empty_and_zero_parameters_step_without_nan():
    torch.manual_seed(0)
    empty = nn.Parameter(torch.empty(0))
    zero = nn.Parameter(torch.zeros(5))
    w = nn.Parameter(torch.randn(5))
    opt = OneBitLamb([empty, zero, w], lr=1e-2, freeze_step=3)
    for _ in range(6):
        opt.zero_grad()
        ((w * zero).sum() + (w ** 2).sum() + empty.sum()).backward()
        opt.step()
    assert opt.stage == "compression"
    for p in (empty, zero, w):
        assert torch.isfinite(p).all()
    assert not torch.equal(zero.detach(), torch.zeros(5))  # a zero norm takes the ratio 1
    assert all(math.isfinite(c) for c in opt.lamb_coeffs())


def test_the_factor_is_clipped_to_its_bounds_and_to_its_relative_change():
    ones = torch.ones(4)
    args = dict(weight_decay=0.0, factor_min=0.5, factor_max=4.0, factor_threshold=0.1)
    # The fresh variance shrank 100x (denominator ratio 10): 4.0 at most, and +10% per step.
    assert lamb_factor(ones * 10, ones, ones, ones, last=1.0, **args) == pytest.approx(1.1)
    assert lamb_factor(ones * 10, ones, ones, ones, last=3.9, **args) == 4.0
    assert lamb_factor(ones * 0.1, ones, ones, ones, last=1.0, **args) == pytest.approx(0.9)
    assert lamb_factor(ones * 0.1, ones, ones, ones, last=0.52, **args) == 0.5
    assert lamb_factor(torch.tensor([1.0, 1.05]), ones[:2], ones[:2], ones[:2], last=1.0,
                       **args) == pytest.approx(1.05)  # the largest ratio of the tensor
    assert lamb_factor(torch.empty(0), torch.empty(0), torch.empty(0), torch.empty(0),
                       last=1.0, **args) == 1.0


def _run(rank, world, steps, *, compress=True, save_at=None, ckpt=None, load=None,
         ddp=True):
    model = _model()
    net = DDP(model, bucket_cap_mb=0.001, gradient_as_bucket_view=True) if ddp else model
    opt = OneBitLamb(model.parameters(), lr=1e-2, weight_decay=0.01, freeze_step=6,
                     compress_momentum=compress, bucket_cap_mb=0.001)
    if ddp:
        register_onebit_hook(net, opt)
    start = resume(load, rank, model, opt)
    trace = []
    for step in range(start, steps):
        x, y = _grads(step, rank)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        check_lockstep(model.parameters(), opt)
        trace.append([p.detach().clone() for p in model.parameters()])
        if step + 1 == save_at:
            save_for_resume(ckpt, rank, model, opt, step + 1)
    return trace, opt.stage, opt.bytes_sent, opt.dense_bytes


def test_two_ranks_compress_in_lockstep_near_the_exact_momentum_run():
    onebit = run_ranks(functools.partial(_run, compress=True), 2, 30)
    exact = run_ranks(functools.partial(_run, compress=False), 2, 30)
    alone = run_ranks(functools.partial(_run, compress=True, ddp=False), 2, 30)
    (trace, stage, sent, _), (e_trace, _, e_sent, _) = onebit[0], exact[0]
    assert stage == "compression" and sent < e_sent
    # the same without DDP (the optimizer averages itself): the same numbers
    for a, b in zip(trace[-1], alone[0][0][-1], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(trace[5], e_trace[5], strict=True):  # the warm-up is the same
        assert torch.equal(a, b)
    moved = sum(float((a - b).norm()) for a, b in zip(e_trace[-1], e_trace[5], strict=True))
    apart = sum(float((a - b).norm()) for a, b in zip(trace[-1], e_trace[-1], strict=True))
    assert 0 < apart < 0.5 * moved, (apart, moved)


@pytest.mark.parametrize("save_at", [4, 10])  # warm-up, compression stage
def test_resume_is_bitwise_in_both_stages(tmp_path, save_at):
    ckpt = str(tmp_path / "c")
    whole = run_ranks(functools.partial(_run, save_at=save_at, ckpt=ckpt), 2, 16)
    resumed = run_ranks(functools.partial(_run, load=ckpt), 2, 16)
    for r in range(2):
        for a, b in zip(whole[r][0][save_at:], resumed[r][0], strict=True):
            assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def test_bf16_parameters_with_master_weights_stay_finite_and_move():
    model = _model().to(torch.bfloat16)
    opt = OneBitLamb(model.parameters(), lr=1e-3, freeze_step=3, master_weights=True)
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(8):
        x, y = _grads(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x.to(torch.bfloat16)).float(), y).backward()
        opt.step()
    assert opt.stage == "compression"
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.isfinite(p).all() and not torch.equal(p, b)
        assert opt.state[p]["master"].dtype == torch.float32


def _rare_rows(rank, world, bounded, freeze):
    """A next-token model over 512 Zipf-distributed tokens: most embedding rows are rare."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(512, 16), nn.Flatten(), nn.Linear(32, 64), nn.GELU(),
                          nn.Linear(64, 512))
    opt = OneBitLamb(model.parameters(), lr=2e-2, weight_decay=0.01, freeze_step=freeze,
                     bound_update=bounded)
    gen = torch.Generator().manual_seed(rank)
    zipf = 1.0 / torch.arange(1, 513).float() ** 1.2
    for _ in range(60):
        x = torch.multinomial(zipf, 256 * 3, replacement=True, generator=gen).view(256, 3)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[:, :2]), x[:, 2]).backward()
        opt.step()
    return float(model[0].weight.detach().abs().max())


def test_the_bound_keeps_rare_embedding_rows_near_lambs_and_without_it_they_grow():
    """A rare row's frozen variance is tiny: its ``m / denom`` is large whenever it gets a
    gradient, and the frozen trust ratio does not shrink it as LAMB's own would. Clamped at 3
    before sending, the embedding's largest value stays near LAMB's (measured: 5.5 against
    4.7); not clamped it grows to 37. (Sending ``m`` with the decoded step bounded at 1, as
    before 2026-12-03, it stayed at 5.5 too, and unbounded reached 404.)"""
    lamb = run_ranks(functools.partial(_rare_rows, bounded=True, freeze=10**6), 2)[0]
    bounded = run_ranks(functools.partial(_rare_rows, bounded=True, freeze=10), 2)[0]
    unbounded = run_ranks(functools.partial(_rare_rows, bounded=False, freeze=10), 2)[0]
    assert bounded < 1.5 * lamb and unbounded > 5 * lamb, (lamb, bounded, unbounded)


def _sent_after_the_freeze(grad_scale):
    """One parameter, one process, frozen after 2 steps; the tensor the third step hands the
    communicator, what it should be, and the parameter before and after that step."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(64))
    opt = OneBitLamb([w], lr=1e-2, freeze_step=2)
    quiet = torch.full((64,), 1e-3)
    for _ in range(2):  # a quiet warm-up: a tiny frozen variance
        w.grad = quiet.clone()
        opt.step()
    opt.prepare_stage()  # the units: the frozen denominators
    sent = []
    comm = opt.communicator
    reduce = comm.reduce_

    def spy(tensor, *args, **kwargs):
        sent.append(tensor.clone())
        return reduce(tensor, *args, **kwargs)

    comm.reduce_ = spy
    w.grad = quiet * grad_scale
    m, denom = opt.state[w]["exp_avg"].clone(), opt.state[w]["frozen_denominator"].clone()
    before = w.detach().clone()
    opt.step()
    fold = torch.lerp(m, w.grad, 0.1)  # b1 * m + (1 - b1) * g, rounded as the fold is
    return sent, fold / denom, denom, before, w.detach().clone(), opt


def test_each_rank_sends_its_momentum_over_the_denominator_clamped_at_3():
    """What 1-bit LAMB exchanges is ``m / denom`` (policy.OverDenominator), clamped to +-3 per
    coordinate before it is sent, and the momentum comes back times the denominator."""
    sent, expected, denom, _, _, opt = _sent_after_the_freeze(torch.linspace(-400, 400, 64))
    assert len(sent) == 1
    assert expected.abs().max() > 30 and (expected.abs() < 3).sum() > 0  # both kinds
    torch.testing.assert_close(sent[0], expected.clamp(-3, 3), rtol=0, atol=0)
    w = opt.param_groups[0]["params"][0]
    torch.testing.assert_close(opt.state[w]["exp_avg"], expected.clamp(-3, 3) * denom,
                               rtol=0, atol=0)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_non_finite_gradient_skips_the_step_instead_of_being_clamped(bad):
    grad = torch.ones(64)
    grad[5] = bad
    sent, _, _, before, after, opt = _sent_after_the_freeze(grad)
    assert bool(torch.isnan(sent[0]).all())
    assert opt.skipped_steps == 1 and torch.equal(before, after)


def test_the_frozen_ratio_is_the_bias_corrected_average_of_the_warm_up_ratios():
    """After a 3-step warm-up the frozen ratio is the running average of the reference's ratios
    divided by 1 - 0.9**3 (DeepSpeed froze the raw average: 27% of it here)."""
    model = _model()
    opt = OneBitLamb(model.parameters(), lr=1e-2, freeze_step=3)
    params = list(model.parameters())
    start = [p.detach().clone() for p in params]
    seen = []
    for step in range(3):
        x, y = _grads(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        seen.append([p.grad.clone() for p in params])
        opt.step()
    assert opt.stage == "compression"
    ratios = []
    reference_lamb(start, seen, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, wd=0.0, ratios=ratios)
    assert opt.lamb_coeffs() == pytest.approx(ratios[-1], rel=1e-4)  # the last step's
    for i, coeff in enumerate(opt.state[p]["lamb_coeff"] for p in params):
        average = 0.0
        for step in range(3):
            average = 0.9 * average + 0.1 * ratios[step][i]
        assert coeff == pytest.approx(average / (1 - 0.9**3), rel=1e-4)


def _errors_after_loading(rank, world, drop_sent):
    """A compression-stage state of 2 ranks loaded into a fresh optimizer, with its ``sent``
    entry (what the errors are residuals of) or without it, as a state saved before 1-bit LAMB
    sent ``m / denom``: the errors the new units hold, the saved ones, and what was said."""
    import logging

    model = _model()
    opt = OneBitLamb(model.parameters(), lr=1e-2, freeze_step=2)
    for step in range(4):
        x, y = _grads(step, rank)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    state = opt.state_dict()
    saved = [e.clone() for u in opt.units for e in u.errors.values()]
    if drop_sent:
        state["onebit"] = {k: v for k, v in state["onebit"].items() if k != "sent"}
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("onebit_plugin").addHandler(handler)
    fresh = OneBitLamb(_model().parameters(), lr=1e-2, freeze_step=2)
    fresh.load_state_dict(state)
    fresh.prepare_stage()  # the units take the loaded errors, as the next step would
    loaded = [e.clone() for u in fresh.units for e in u.errors.values()]
    return saved, loaded, said


@pytest.mark.parametrize("drop_sent", [False, True])
def test_errors_saved_when_lamb_sent_the_momentum_are_not_loaded_and_that_is_said(drop_sent):
    ranks = run_ranks(functools.partial(_errors_after_loading, drop_sent=drop_sent), 2)
    for saved, loaded, _ in ranks:
        assert any(bool(e.any()) for e in saved)
        if drop_sent:
            assert not any(bool(e.any()) for e in loaded)
        else:
            assert all(torch.equal(a, b) for a, b in zip(saved, loaded, strict=True))
    warned = [m for m in ranks[0][2] if "residuals of the momentum," in m]
    assert len(warned) == int(drop_sent)  # said once, by rank 0
    assert not [m for m in ranks[1][2] if "residuals of the momentum," in m]


def test_auto_freezes_at_15_percent_of_the_run_at_the_latest():
    """1-bit LAMB's ceiling (LambPolicy.auto_ceiling): after step 6 of 40, where OneBitAdam's
    20% would be step 8; no check comes before (the first is at step 16)."""
    model = _model()
    opt = OneBitLamb(model.parameters(), lr=1e-2, freeze_step="auto", total_steps=40)
    for step in range(8):
        x, y = _grads(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        assert opt.stage == ("compression" if step + 1 >= 6 else "warmup"), step
    assert opt.switch_step == 6
