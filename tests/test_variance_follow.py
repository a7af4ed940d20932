"""``follow_variance``: after the freeze each block's denominator follows the averaged
gradients' scale, estimated from per-block sketches (``onebit_plugin.core.variance_follow``,
issue 44). Bytes are counted at torch's collectives, not by the package."""


from __future__ import annotations

import math

import pytest
import torch

from onebit_plugin import OneBitAdam, OneBitLamb, ZeroOneAdam, register_onebit_hook
from onebit_plugin.core.variance_follow import (
    BLOCK,
    EVERY,
    WIDTH,
    VarianceFollow,
    block_squares,
)
from onebit_plugin.settings.config import settings_from_env
from tests.dist_helpers import (
    assert_ranks_identical,
    counted_run,
    resume,
    run_ranks,
    save_for_resume,
)

FREEZE = 4
CAP_MB = 0.001  # 1 KB units: the 1,494-value model in several (the step told, the hook DDP's)

def scale(state: dict) -> list[float]:
    """The factors on a parameter's denominator blocks (1 before the freeze)."""
    applied = state.get("variance_scale")
    return [1.0] if applied is None else applied.tolist()


def _small():
    """Every tensor holds at most WIDTH values: its sketch is exact (one partial row of one
    block)."""
    assert WIDTH >= 2
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1))


def _growing_batch(step: int, rank: int = 0):
    """Inputs whose scale grows with the step, so that the gradients do."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 1, generator=g) * (1 + step / 4), torch.randn(8, 1, generator=g)


def test_one_process_is_adam_frozen_at_the_freeze_whose_denominator_scales_with_the_gradients():
    """The algorithm in plain torch: Adam to the freeze; then ``m_hat / (denom * c)`` with
    ``denom`` frozen and ``c = sqrt(v_bar_{t-1} / v_bar_freeze)``, ``v_bar`` each tensor's mean
    square gradient under Adam's average (bias corrected), moved on every warm-up step and
    every EVERY-th after, each move weighing the steps since the last: a step divides by the
    scale of the steps before it (0/1 Adam's local steps between two syncs share one)."""
    steps, lr, (b1, b2), eps = 18, 1e-2, (0.9, 0.999), 1e-8
    model, ref = _small(), _small()
    opt = OneBitAdam(model.parameters(), lr=lr, freeze_step=FREEZE, bound_update=False)
    m = [torch.zeros_like(p) for p in ref.parameters()]
    v = [torch.zeros_like(p) for p in ref.parameters()]
    vbar, frozen, at_freeze = [0.0] * len(m), None, None
    last = 0  # the step v_bar last moved at
    for step in range(steps):
        t = step + 1
        x, y = _growing_batch(step)
        for net in (model, ref):
            net.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        with torch.no_grad():
            moves = t <= FREEZE or t % EVERY == 0  # every warm-up step, every EVERY-th after
            for i, p in enumerate(ref.parameters()):
                g = p.grad
                c = 1.0 if t <= FREEZE else math.sqrt(vbar[i] / at_freeze[i])
                if moves:  # the one gradient stands for the steps since the last move
                    square, kept = float(g.double().square().mean()), b2 ** (t - last)
                    vbar[i] = (kept * (1 - b2**last) * vbar[i] + (1 - kept) * square) / (
                        1 - b2**t)
                m[i].lerp_(g, 1 - b1)
                if t <= FREEZE:
                    v[i].mul_(b2).addcmul_(g, g, value=1 - b2)
                    denom = (v[i] / (1 - b2**t)).sqrt() + eps
                else:
                    denom = frozen[i]
                p.sub_(lr * (m[i] / (1 - b1**t)) / (denom * c))
            last = t if moves else last
            if t == FREEZE:
                frozen = [(vi / (1 - b2**t)).sqrt() + eps for vi in v]
                at_freeze = list(vbar)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=f"step {t}")
    scales = [scale(opt.state[p])[0] for p in model.parameters()]
    assert all(abs(s - 1) > 0.01 for s in scales), scales  # not the frozen algorithm


def test_the_sketches_estimate_a_blocks_squared_norm_over_the_steps():
    """Each step draws its own signs: over 8,000 steps the mean estimate is each block's
    squared norm within 8% (a step's estimate at WIDTH 2 has a relative standard deviation
    of 1 to 1.4, the smooth one's buckets moving together; the mean of 8,000 at most 1.6%),
    for a smooth gradient (what one fixed draw of signs would get wrong for
    the whole run), dense random ones and a few rows of an embedding; and the exact part (a
    gradient every rank holds averaged) is each block's sum of squares."""
    follow = VarianceFollow()
    gen = torch.Generator().manual_seed(7)
    smooth = torch.linspace(-1, 1, 2 * BLOCK + 100).cos().reshape(-1, 4)

    def blocks(g):
        return torch.stack([c.square().sum() for c in g.reshape(-1).split(BLOCK)])

    for kind in ("smooth", "dense", "rows"):
        estimates, truth = torch.zeros(3), torch.zeros(3)
        for t in range(8000):
            g = smooth if kind == "smooth" else torch.randn(smooth.shape, generator=gen)
            if kind == "rows":
                g[torch.randperm(g.shape[0], generator=gen)[: g.shape[0] - 20]] = 0.0
            estimates += follow.summary(g, t).view(3, WIDTH).square().sum(1)
            truth += blocks(g)
        assert torch.allclose(estimates / truth, torch.ones(3), atol=0.08), (kind,
                                                                            estimates / truth)
    assert torch.equal(block_squares(smooth), blocks(smooth))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.Linear(48, 6))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 24, generator=g) * (1 + step / 8), torch.randn(16, 6, generator=g)


def _train(rank, world, ddp, steps, member="onebit_adam", follow=True, save=None, load=None):
    model = _model()
    if member.startswith("onebit_adam"):  # "onebit_adam_refresh": refreshes at 5, 10, 15
        opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE,
                         follow_variance=follow, bucket_cap_mb=CAP_MB,
                         refresh_interval=5 if member.endswith("refresh") else None)
    else:
        opt = ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=8, var_update_scaler=2,
                          local_step_scaler=2, local_step_clipper=4, total_steps=steps,
                          follow_variance=follow, bucket_cap_mb=CAP_MB,
                          local_variance=False)  # the paper's variance, which follow moves
    net = model
    if ddp:
        net = torch.nn.parallel.DistributedDataParallel(
            model, gradient_as_bucket_view=ddp == "views", bucket_cap_mb=CAP_MB)
        register_onebit_hook(net, opt)
    after, per_step, numbers = counted_run(
        rank, world, net, model, opt, steps, _batch,
        lambda o: [(o.state[p].get("variance_mean", torch.zeros(1)).tolist(), scale(o.state[p]))
                   for p in model.parameters()], save, load)
    return after, per_step, numbers, getattr(opt, "phase", None)


@pytest.mark.parametrize("ddp", [False, True], ids=["step", "ddp-hook"])
def test_ranks_follow_alike_and_the_following_sends_its_sketches_only_after_the_freeze(ddp):
    world, steps = 2, 12
    on = run_ranks(_train, world, ddp, steps)
    off = run_ranks(_train, world, ddp, steps, "onebit_adam", False)
    for step in range(steps):
        assert_ranks_identical([r[0][step] for r in on], f"parameters after step {step + 1}")
        assert [r[2][step] for r in on][0] == [r[2][step] for r in on][1], step
    blocks = sum(-(-p.numel() // BLOCK) for p in _model().parameters())
    sketches = 2 * (world - 1) * blocks * WIDTH * 4 // world  # one ring allreduce, fp32
    for step in range(steps):
        extra = on[0][1][step] - off[0][1][step]
        sketched = step + 1 > FREEZE and (step + 1) % EVERY == 0
        assert extra == (sketches if sketched else 0), step + 1
    final = [s for _, scales in on[0][2][-1] for s in scales]
    assert all(abs(s - 1) > 0.01 for s in final), final  # every block follows
    assert final[0] > 1.3, final  # the first layer's weight: its inputs grew 2.4x since
    assert not torch.equal(on[0][0][-1][0], off[0][0][-1][0])


def test_the_ddp_hook_and_the_step_follow_with_the_same_bits():
    by_step = run_ranks(_train, 2, False, 12)
    by_hook = run_ranks(_train, 2, True, 12)
    for step in range(12):
        assert_ranks_identical([by_step[0][0][step], by_hook[0][0][step]], f"step {step + 1}")
        assert by_step[0][2][step] == by_hook[0][2][step], step + 1


@pytest.mark.parametrize("member,ddp,save_at", [
    ("onebit_adam", True, 13), ("onebit_adam", "views", 13), ("zero_one_adam", True, 13),
    ("onebit_adam_refresh", True, 8)])
def test_a_following_run_resumes_bitwise(member, ddp, save_at, tmp_path):
    """Several momentum units; with bucket views the last bucket's units are left to step()
    in the uninterrupted run, not in the first resumed step. With refreshes, saved at step 8,
    which scaled the denominators the step-5 refresh made (checkpoints hold the variance, not
    them: a resume makes them again with their factors)."""
    steps = 20
    whole = run_ranks(_train, 2, ddp, steps, member, True, (str(tmp_path / "ck"), save_at))
    resumed = run_ranks(_train, 2, ddp, steps, member, True, None, str(tmp_path / "ck"))
    for rank in range(2):
        assert_ranks_identical([whole[rank][0][-1], resumed[rank][0][-1]], "resumed")
        assert whole[rank][2][-1] == resumed[rank][2][-1]
    if member == "zero_one_adam":
        assert whole[0][3] == "B"  # the resume crossed local steps and syncs
        assert any(s != 1.0 for _, scales in whole[0][2][-1] for s in scales)


def test_the_option_is_the_adam_members_and_read_from_the_environment(monkeypatch):
    with pytest.raises(TypeError, match="OneBitLamb.. takes no 'follow_variance'"):
        OneBitLamb(torch.nn.Linear(2, 2).parameters(), freeze_step=2, follow_variance=False)
    assert OneBitAdam(torch.nn.Linear(2, 2).parameters(), freeze_step=2).policy.follow
    # 0/1 Adam's is off unless asked (measured: it cost bow_topics; members.zero_one_adam)
    assert ZeroOneAdam(torch.nn.Linear(2, 2).parameters(), total_steps=10).policy.follow is None
    assert ZeroOneAdam(torch.nn.Linear(2, 2).parameters(), total_steps=10,
                       follow_variance=True, local_variance=False).policy.follow
    with pytest.raises(ValueError, match="pass local_variance=False with follow_variance=True"):
        ZeroOneAdam(torch.nn.Linear(2, 2).parameters(), total_steps=10, follow_variance=True)
    assert OneBitAdam(torch.nn.Linear(2, 2).parameters(), freeze_step=2,
                      follow_variance=False).policy.follow is None
    monkeypatch.setenv("ONEBIT_ADAM", "1")
    monkeypatch.setenv("ONEBIT_FREEZE_STEP", "5")
    assert settings_from_env().member_options(None)["follow_variance"] is True
    monkeypatch.setenv("ONEBIT_FOLLOW_VARIANCE", "0")
    assert settings_from_env().member_options(None)["follow_variance"] is False
    monkeypatch.setenv("ONEBIT_OPTIMIZER", "zero_one_adam")
    monkeypatch.delenv("ONEBIT_FOLLOW_VARIANCE")
    monkeypatch.delenv("ONEBIT_FREEZE_STEP")
    assert settings_from_env().member_options(100)["follow_variance"] is False
    assert settings_from_env().member_options(100)["local_variance"] is True
    monkeypatch.setenv("ONEBIT_FOLLOW_VARIANCE", "1")
    with pytest.raises(ValueError, match="set ONEBIT_LOCAL_VARIANCE=0 with it"):
        settings_from_env()
    monkeypatch.setenv("ONEBIT_LOCAL_VARIANCE", "0")
    options = settings_from_env().member_options(100)
    assert options["follow_variance"] is True and options["local_variance"] is False
    monkeypatch.delenv("ONEBIT_LOCAL_VARIANCE")
    monkeypatch.setenv("ONEBIT_OPTIMIZER", "onebit_adam")
    monkeypatch.setenv("ONEBIT_FREEZE_STEP", "5")
    monkeypatch.setenv("ONEBIT_FOLLOW_VARIANCE", "maybe")
    with pytest.raises(ValueError, match="ONEBIT_FOLLOW_VARIANCE must be 1 or 0"):
        settings_from_env()
    monkeypatch.setenv("ONEBIT_FOLLOW_VARIANCE", "1")
    monkeypatch.setenv("ONEBIT_OPTIMIZER", "onebit_lamb")
    with pytest.raises(ValueError, match="ONEBIT_FOLLOW_VARIANCE is the Adam members'"):
        settings_from_env()


def test_a_string_is_not_an_on_off_setting():
    with pytest.raises(ValueError, match="follow_variance must be True or False, got 'false'"):
        OneBitAdam(torch.nn.Linear(2, 2).parameters(), freeze_step=2, follow_variance="false")
    with pytest.raises(ValueError, match="bound_update must be True or False, got 'no'"):
        ZeroOneAdam(torch.nn.Linear(2, 2).parameters(), total_steps=10, bound_update="no")


def _stepped(follow: bool, steps: int = 8):
    model = _small()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE, follow_variance=follow)
    for step in range(steps):
        x, y = _growing_batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


def _go_on(model, opt, start: int, steps: int = 3):
    for step in range(start, start + steps):
        x, y = _growing_batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("saved_with", [True, False])
def test_resuming_with_the_other_setting_is_said_and_keeps_the_saved_denominators(saved_with,
                                                                                  caplog):
    model, opt = _stepped(saved_with)
    saved = opt.state_dict()
    denom = {i: s["frozen_denominator"].clone() for i, s in saved["state"].items()}
    again = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE,
                       follow_variance=not saved_with)
    with caplog.at_level("WARNING", logger="onebit_plugin"):
        again.load_state_dict(saved)
        _go_on(model, again, 8)
    said = ("follow_variance=False on a state saved with it" if saved_with
            else "follow_variance=True on a state saved without it")
    assert caplog.text.count(said) == 1
    for i, p in enumerate(model.parameters()):
        assert torch.equal(again.state[p]["frozen_denominator"], denom[i])  # nothing follows
        assert "variance_mean" not in again.state[p] or not saved_with
    assert "variance_mean" not in again.state_dict()["state"][0] or not saved_with


class _Rows(torch.nn.Module):
    """An embedding whose rows 30-49 no batch uses: zero variance at the freeze, masked."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, tokens):
        return self.head(self.emb(tokens).mean(1))


def _rows_run(rank, world, steps, save=None, load=None):
    model = _Rows()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE)
    net = torch.nn.parallel.DistributedDataParallel(model)
    register_onebit_hook(net, opt)
    start = resume(load, rank, model, opt)
    for step in range(start, steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        tokens, y = torch.randint(0, 30, (8, 5), generator=g), torch.randint(0, 3, (8,),
                                                                             generator=g)
        opt.zero_grad()
        # Small gradients (roots near 1e-5): the mask's bar, 1e-6 of their rms above eps, is
        # then far below eps * c - eps.
        (torch.nn.functional.cross_entropy(net(tokens), y) * 1e-3 * (1 + step / 4)).backward()
        opt.step()
        if save is not None and step + 1 == save[1]:
            save_for_resume(save[0], rank, model, opt, step + 1)
    return [p.detach().clone() for p in model.parameters()], scale(opt.state[model.emb.weight])


def test_a_resume_masks_the_zero_variance_rows_as_the_uninterrupted_run_did(tmp_path):
    """The factor scales each denominator's root, not its eps: a row of zero variance keeps
    exactly eps, stays masked when a resume makes the masks again from the denominators, and
    does not move (scaled with the root, eps * c passed the mask's test and took the 1-bit
    noise)."""
    whole = run_ranks(_rows_run, 2, 14, (str(tmp_path / "ck"), 9))
    resumed = run_ranks(_rows_run, 2, 14, None, str(tmp_path / "ck"))
    assert whole[0][1] != [1.0] and whole[0][1][0] > 1.0  # the embedding's block followed
    init = _Rows().emb.weight.detach()
    for rank in range(2):
        assert_ranks_identical([whole[rank][0], resumed[rank][0]], "resumed")
        assert torch.equal(resumed[rank][0][0][30:], init[30:])
