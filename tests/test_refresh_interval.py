"""``refresh_interval``: 1-bit Adam's variance refreshed every N compression-stage steps (the
gradients averaged as in the warm-up, the momentum and the variance updated from them) instead
of frozen for good (issue 44). Bytes are counted at torch's collectives, not by the package."""

from __future__ import annotations

import logging

import pytest
import torch

from onebit_plugin import OneBitAdam, OneBitLamb, ZeroOneAdam, register_onebit_hook
from onebit_plugin.settings.config import settings_from_env
from tests.dist_helpers import (
    assert_ranks_identical,
    counted_run,
    run_ranks,
)

FREEZE, EVERY = 4, 3  # refreshes at steps 6, 9, 12, ...


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.Linear(48, 6))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 24, generator=g), torch.randn(16, 6, generator=g)


def _train(rank, world, ddp, steps, every=EVERY, bits=32, save=None, load=None):
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE, refresh_interval=every,
                     warmup_bits=bits)
    net = model
    if ddp:
        net = torch.nn.parallel.DistributedDataParallel(model)
        register_onebit_hook(net, opt)
    after, per_step, variances = counted_run(
        rank, world, net, model, opt, steps, _batch,
        lambda o: [o.state[p]["exp_avg_sq"].clone() for p in model.parameters()], save, load)
    return after, per_step, variances


@pytest.mark.parametrize("ddp", [False, True], ids=["step", "ddp-hook"])
def test_refreshes_keep_ranks_identical_and_send_a_warmup_step_every_interval(ddp):
    world, steps = 2, 13
    out = run_ranks(_train, world, ddp, steps)
    for step in range(steps):
        assert_ranks_identical([r[0][step] for r in out], f"parameters after step {step + 1}")
        assert_ranks_identical([r[2][step] for r in out], f"variances after step {step + 1}")
    per_step, variances = out[0][1], out[0][2]
    warmup = per_step[0]
    refreshes = [t for t in range(FREEZE + 1, steps + 1) if t % EVERY == 0]
    assert refreshes == [6, 9, 12]
    for t in range(FREEZE + 1, steps + 1):
        if t in refreshes:  # a warm-up step's fp32 average (the DDP hook's flags aside)
            assert per_step[t - 1] == pytest.approx(warmup, rel=0.01), t
            assert not all(torch.equal(a, b)
                           for a, b in zip(variances[t - 2], variances[t - 1], strict=True)), t
        else:  # 1-bit momentum, the variance untouched
            assert 0 < per_step[t - 1] < warmup / 20, t
            assert all(torch.equal(a, b)
                       for a, b in zip(variances[t - 2], variances[t - 1], strict=True)), t


def test_the_ddp_hook_and_the_step_give_the_same_bits():
    by_step = run_ranks(_train, 2, False, 13)
    by_hook = run_ranks(_train, 2, True, 13)
    for step in range(13):
        assert_ranks_identical([by_step[0][0][step], by_hook[0][0][step]], f"step {step + 1}")


def test_a_refresh_weighs_the_steps_it_stands_for():
    """One process (nothing to compress): the frozen-variance update with the variance
    refreshed at steps 6, 9, 12 as ``v <- b2**gap * v + (1 - b2**gap) * g * g``, its bias
    correction counting every step to the refresh, against a plain re-computation."""
    steps, lr, (b1, b2), eps = 13, 1e-2, (0.9, 0.999), 1e-8
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=lr, freeze_step=FREEZE, refresh_interval=EVERY,
                     bound_update=False, follow_variance=False)
    ref = _model()
    m = [torch.zeros_like(p) for p in ref.parameters()]
    v = [torch.zeros_like(p) for p in ref.parameters()]
    clock = 0  # the variance's bias-correction count
    for step in range(steps):
        t = step + 1
        x, y = _batch(step, 0)
        for net in (model, ref):
            net.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        with torch.no_grad():
            refresh = t <= FREEZE or t % EVERY == 0
            gap = t - clock if refresh else 0
            for p, mi, vi in zip(ref.parameters(), m, v, strict=True):
                mi.lerp_(p.grad, 1 - b1)
                if refresh:
                    vi.mul_(b2**gap).addcmul_(p.grad, p.grad, value=1 - b2**gap)
            clock += gap
            for p, mi, vi in zip(ref.parameters(), m, v, strict=True):
                denom = (vi / (1 - b2**clock)).sqrt() + eps
                p.sub_(lr * (mi / (1 - b1**t)) / denom)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=f"step {t}")
    # Not frozen: the variance at the end is the step-12 refresh's, not the step-4 freeze's.
    assert opt.state[model[0].weight]["frozen_step"] == 12.0


@pytest.mark.parametrize("ddp", [False, True], ids=["step", "ddp-hook"])
def test_a_run_resumes_bitwise_between_refreshes(ddp, tmp_path):
    whole = run_ranks(_train, 2, ddp, 13, EVERY, 32, (str(tmp_path / "ck"), 7))
    resumed = run_ranks(_train, 2, ddp, 13, EVERY, 32, None, str(tmp_path / "ck"))
    for rank in range(2):
        assert_ranks_identical([whole[rank][0][-1], resumed[rank][0][-1]], "resumed")
        assert_ranks_identical([whole[rank][2][-1], resumed[rank][2][-1]], "resumed variance")


def test_8_bit_refreshes_send_a_quarter_of_the_fp32_ones():
    fp32 = run_ranks(_train, 2, False, 10, EVERY, 32)
    int8 = run_ranks(_train, 2, False, 10, EVERY, 8)
    for t in (6, 9):
        assert 0.25 < int8[0][1][t - 1] / fp32[0][1][t - 1] < 0.28, t
    for step in range(10):
        assert_ranks_identical([r[0][step] for r in int8], f"step {step + 1}")


def test_refresh_interval_is_checked_and_read_from_the_environment(monkeypatch):
    params = [torch.nn.Parameter(torch.ones(3))]
    for bad in (0, -2, 1.5, "8", True):
        with pytest.raises(ValueError, match="refresh_interval must be an int >= 1 or None"):
            OneBitAdam(params, freeze_step=2, refresh_interval=bad)
    with pytest.raises(TypeError, match="ZeroOneAdam.. takes no 'refresh_interval': 0/1 Adam"):
        ZeroOneAdam(params, total_steps=10, refresh_interval=8)
    with pytest.raises(TypeError, match="OneBitLamb.. takes no 'refresh_interval'"):
        OneBitLamb(params, freeze_step=2, refresh_interval=8)
    monkeypatch.setenv("ONEBIT_ADAM", "1")
    monkeypatch.setenv("ONEBIT_FREEZE_STEP", "5")
    assert settings_from_env().member_options(None)["refresh_interval"] is None
    monkeypatch.setenv("ONEBIT_REFRESH_INTERVAL", "16")
    assert settings_from_env().member_options(None)["refresh_interval"] == 16
    monkeypatch.setenv("ONEBIT_REFRESH_INTERVAL", "0")
    with pytest.raises(ValueError, match="ONEBIT_REFRESH_INTERVAL must be >= 1"):
        settings_from_env()
    monkeypatch.setenv("ONEBIT_REFRESH_INTERVAL", "16")
    monkeypatch.delenv("ONEBIT_FREEZE_STEP")
    monkeypatch.setenv("ONEBIT_OPTIMIZER", "zero_one_adam")
    with pytest.raises(ValueError, match="ONEBIT_REFRESH_INTERVAL is 1-bit Adam's"):
        settings_from_env()
    # Unset, the other members are made from the environment without it.
    monkeypatch.delenv("ONEBIT_REFRESH_INTERVAL")
    ZeroOneAdam(params, **settings_from_env().member_options(10))
    monkeypatch.setenv("ONEBIT_OPTIMIZER", "onebit_lamb")
    monkeypatch.setenv("ONEBIT_FREEZE_STEP", "5")
    OneBitLamb(params, **settings_from_env().member_options(10))


def _disagree(rank, world):
    param = torch.nn.Parameter(torch.ones(4))
    opt = OneBitAdam([param], lr=0.1, freeze_step=2, refresh_interval=8 if rank == 0 else None)
    param.grad = torch.ones(4)
    try:
        opt.step()
    except ValueError as exc:
        return str(exc)
    return None


def test_ranks_that_disagree_on_refresh_interval_are_refused():
    for message in run_ranks(_disagree, 2):
        assert message.startswith("OneBitAdam's refresh_interval differs between ranks: [8, 0]")


def test_the_switch_line_says_the_variance_is_refreshed():
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2, refresh_interval=16)
    for step in range(2):
        x, y = _batch(step, 0)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert opt.switch_message().endswith(
        "from step 3 on (the variance refreshed on every step that is a multiple of 16, in "
        "32-bit like the warm-up)")


def test_refresh_interval_added_on_resume_rebuilds_the_variance_from_the_denominator(caplog):
    model = _model()
    # Without follow_variance the saved denominator is the one the first refresh rebuilds
    # from (with it, the denominator moves at steps 7 and 8 first).
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE, follow_variance=False)
    for step in range(6):
        x, y = _batch(step, 0)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    saved = opt.state_dict()
    assert "exp_avg_sq" not in saved["state"][0]  # the frozen denominator instead
    denom = saved["state"][0]["frozen_denominator"].clone()
    again = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE, refresh_interval=EVERY,
                       follow_variance=False)
    again.load_state_dict(saved)
    with caplog.at_level(logging.WARNING, logger="onebit_plugin"):
        for step in range(6, 9):  # steps 7-9, the last a refresh
            x, y = _batch(step, 0)
            again.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            again.step()
    assert caplog.text.count("the variance is rebuilt from the saved frozen denominator") == 1
    state = again.state[model[0].weight]
    assert state["frozen_step"] == 9.0 and "frozen_denominator" not in state
    # The variance rebuilt from the saved denominator, then the step-9 refresh on its gradient
    # (one process: the gradient is this process's own).
    b2, gap = 0.999, 9.0 - FREEZE
    g = model[0].weight.grad
    rebuilt = (denom - 1e-8).clamp(min=0).square() * (1 - b2**FREEZE)
    expect = rebuilt * b2**gap + (1 - b2**gap) * g * g
    torch.testing.assert_close(state["exp_avg_sq"], expect, rtol=1e-5, atol=0)
