"""0/1 Adam (ZeroOneAdam): its schedule, Adam's numbers where it is Adam, exact decoupled decay,
ranks apart between syncs and bit-identical after each, the same numbers with and without the
DDP hook, nothing sent by a local step, and bitwise resume in every phase."""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from onebit_plugin import ZeroOneAdam, register_onebit_hook
from onebit_plugin.members.zero_one_adam import auto_local_step_scaler
from onebit_plugin.settings.schedule import (
    ZeroOneSchedule,
    auto_var_freeze_step,
    refreshes_until,
    refreshes_variance,
)
from tests.dist_helpers import mean_square_steps, resume, run_ranks, save_for_resume


# ------------------------------------------------------------------------------- the schedule
def test_refreshes_follow_deepspeeds_doubling_interval():
    refreshed = [t for t in range(1, 241) if refreshes_variance(t, 16)]
    expected = (list(range(1, 17)) + list(range(18, 49, 2)) + list(range(52, 113, 4))
                + list(range(120, 241, 8)))
    assert refreshed == expected
    assert [refreshes_until(t, 16) for t in (1, 16, 17, 18, 48, 50, 112, 240)] == \
        [1, 16, 16, 17, 32, 32, 48, 64]
    # An odd scaler: the next interval starts at the next multiple of it.
    assert [t for t in range(1, 20) if refreshes_variance(t, 3)] == [1, 2, 3, 4, 6, 8, 12, 16]


def test_local_interval_doubles_every_scaler_steps_up_to_the_clipper_and_the_last_step_syncs():
    s = ZeroOneSchedule(var_freeze_step=10, var_update_scaler=4, local_step_scaler=3,
                        local_step_clipper=4, total_steps=40)
    kinds = "".join(s.kind(t)[0] for t in range(1, 41))
    # Steps 1-4 refresh, then every 2nd step; phase A ends at 11 (var_freeze_step + 1, as
    # DeepSpeed's); phase B from 12: interval 1 for 3 steps, 2 for 3, then 4 (a sync where
    # t % interval == 0), and step 40 syncs.
    assert kinds[:11] == "eeeemememem"
    assert kinds[11:23] == "sss" + "lsl" + "llslll"
    for t in range(12, 41):
        interval = s.interval(t)
        assert interval == min(4, 2 ** ((t - 12) // 3))
        expected = "sync" if t % interval == 0 or t == 40 else "local"
        assert s.kind(t) == expected, t


def _deepspeeds_wire(steps, var_freeze_step, var_update_scaler, local_step_scaler,
                     local_step_clipper):
    """What DeepSpeed's ZeroOneAdam sent at each of its steps (its ``state['step']``, its
    initialization call aside), replaying its counters as its step() kept them: "fp32" (the
    engine's gradient allreduce, a variance refresh), "1-bit" (phase A's momentum, or a sync) or
    "nothing" (a local step). Its variance froze after the first step past var_freeze_step."""
    var_interval, var_counter, interval, counter, frozen = 1, 0, 1, 0, False
    sent = []
    for t in range(1, steps + 1):
        if not frozen:
            sent.append("fp32" if t % var_interval == 0 else "1-bit")
            if t % var_interval == 0:
                var_counter += 1
                if var_counter == var_update_scaler:
                    var_counter, var_interval = 0, var_interval * 2
        else:
            sent.append("1-bit" if t % interval == 0 else "nothing")
            counter += 1
            if counter == local_step_scaler:
                counter, interval = 0, min(local_step_clipper, interval * 2)
        frozen = frozen or t > var_freeze_step
    return sent


@pytest.mark.parametrize("settings", [(60, 4, 8, 8), (63, 4, 5, 16), (20, 16, 3, 4)],
                         ids=["the-issues", "a-refresh-at-the-last-phase-a-step", "short-a"])
def test_the_schedule_sends_what_deepspeeds_counters_sent_at_every_step(settings):
    """Over runs that cross several doublings of both intervals (var_freeze_step=63 with
    var_update_scaler=4: DeepSpeed refreshes at step 64, past var_freeze_step)."""
    steps = 200
    s = ZeroOneSchedule(*settings)
    on_the_wire = {"exact": "fp32", "momentum": "1-bit", "sync": "1-bit", "local": "nothing"}
    ours = [on_the_wire[s.kind(t)] for t in range(1, steps + 1)]
    theirs = _deepspeeds_wire(steps, *settings)
    assert [t for t in range(1, steps + 1) if ours[t - 1] != theirs[t - 1]] == []
    assert ours.count("nothing") > steps // 2
    assert len({s.interval(t) for t in range(s.last_a + 1, steps)}) >= 3  # doublings crossed


def test_auto_rules():
    assert auto_var_freeze_step(2000, 16) == 240  # interval 8 ends at 240 >= 10% of 2000
    assert auto_var_freeze_step(200, 16) == 200  # capped at the run
    assert auto_local_step_scaler(2000, 240, 16) == 110  # 1760 phase-B steps / 16
    with pytest.raises(ValueError, match="total_steps"):
        model = nn.Linear(2, 2)
        opt = ZeroOneAdam(model.parameters(), var_update_scaler=1)
        for _ in range(2):
            model(torch.ones(1, 2)).sum().backward()
            opt.step()


@pytest.mark.parametrize("bad", [dict(var_freeze_step=0), dict(var_update_scaler="auto"),
                                 dict(local_step_clipper=0), dict(local_step_scaler=1.5)])
def test_bad_schedule_settings_are_named(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        ZeroOneAdam(nn.Linear(2, 2).parameters(), total_steps=10, **bad)


# ------------------------------------------------------------------------- one process, Adam
def test_the_first_var_update_scaler_steps_are_adamw_bit_for_bit():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    b = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    b.load_state_dict(a.state_dict())
    zo = ZeroOneAdam(a.parameters(), lr=1e-2, weight_decay=0.1, total_steps=100)
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(16):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
        for model, opt in ((a, zo), (b, ref)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    assert zo.phase == "A" and zo.switch_step == 16
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("decoupled", [True, False])
def test_phase_a_in_one_process_is_adam_whose_variance_moves_only_on_refresh_steps(decoupled):
    """Phase A, one process (the momentum's exchange is then exact): the momentum follows every
    gradient, the variance only the refresh steps' (1-4, then every 2nd to 12, every 4th to
    28, ...), each refresh weighing the steps since the previous one (``gap``) and the bias
    correction counting steps; written out here in plain torch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    lr, wd, (b1, b2), eps = 1e-2, 0.1, (0.9, 0.999), 1e-8
    opt = ZeroOneAdam(model.parameters(), lr=lr, weight_decay=wd, var_freeze_step=60,
                      var_update_scaler=4, decoupled_weight_decay=decoupled, total_steps=100,
                      bound_update=False, follow_variance=False, local_variance=False)
    params = [p.detach().clone() for p in model.parameters()]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    updates, last = 0, 0  # last: the step of the previous refresh
    for t, grads in mean_square_steps(model, opt, 60):
        refresh = refreshes_variance(t, 4)
        updates += refresh
        for p, g, m_, v_ in zip(params, grads, m, v, strict=True):
            if not decoupled:
                g = g + wd * p
            m_.mul_(b1).add_(g, alpha=1 - b1)
            if refresh:
                v_.mul_(b2 ** (t - last)).addcmul_(g, g, value=1 - b2 ** (t - last))
            denom = (v_ / (1 - b2 ** (t if refresh else last))).sqrt() + eps
            if decoupled:
                p.mul_(1 - lr * wd)
            p.sub_(lr * (m_ / (1 - b1**t)) / denom)
        last = t if refresh else last
    assert opt.phase == "A" and opt.variance_refreshes == updates == refreshes_until(60, 4)
    for p, q in zip(model.parameters(), params, strict=True):
        torch.testing.assert_close(p.detach(), q, rtol=1e-5, atol=1e-6)


def test_a_phase_a_state_from_before_steps_weighted_refreshes_is_a_clear_error():
    """Before ``variance_clock``, a 0/1 Adam refresh counted one step of the variance: a phase-A
    state of then would be weighted and bias-corrected wrongly from its next refresh on, so it
    is refused by name; with the mark, and an old state in phase B (its variance frozen), load."""
    def run(steps):
        torch.manual_seed(0)
        model = nn.Linear(6, 3)
        # local_variance=False: the states this refusal is for predate local_variance.
        opt = ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=20, var_update_scaler=4,
                          total_steps=40, local_variance=False)
        for t in range(steps):
            opt.zero_grad()
            model(torch.randn(8, 6, generator=torch.Generator().manual_seed(t))).sum().backward()
            opt.step()
        return model, opt

    model, opt = run(10)
    assert opt.phase == "A"
    saved = opt.state_dict()
    assert saved["onebit"]["variance_clock"] == "steps"
    ZeroOneAdam(model.parameters(), var_freeze_step=20, var_update_scaler=4,
                total_steps=40).load_state_dict(saved)
    del saved["onebit"]["variance_clock"]
    fresh = ZeroOneAdam(model.parameters(), var_freeze_step=20, var_update_scaler=4,
                        total_steps=40)
    with pytest.raises(ValueError, match=r"saved in phase A \(step 10\) by onebit-plugin "
                       r"before commit 120a7c6 .*'variance_clock'.*Nothing was loaded"):
        fresh.load_state_dict(saved)
    assert not fresh.state and fresh.global_step == 0  # refused before anything was loaded
    model, opt = run(25)  # phase B, between syncs (they fall at 24 and 28)
    assert opt.phase == "B" and opt.layout.local.steps == 1
    saved = opt.state_dict()
    # Between syncs the state holds this rank's own parameters: plain tensors, no graph.
    assert not any(t.requires_grad for t in saved["onebit"]["local_steps"]["params"])
    copy.deepcopy(saved)
    del saved["onebit"]["variance_clock"]
    ZeroOneAdam(model.parameters(), var_freeze_step=20, var_update_scaler=4,
                total_steps=40).load_state_dict(saved)


def test_in_one_process_a_sync_lands_where_the_local_steps_went(monkeypatch):
    """One rank: the average is its own ``y``, so the landing (from ``u``, the common point and
    ``D``, ``L``) must be the local trajectory's end, to rounding and the bias correction taken
    at the sync's step: within 0.1% of one step's size (2e-7 measured against lr 1e-3)."""
    from onebit_plugin.members.local_steps import LocalSteps

    land, gaps = LocalSteps.land_, []

    def recording(self, units, *args, **kwargs):
        before = [p.detach().clone() for u in units for p in u.params]
        land(self, units, *args, **kwargs)
        gaps.append(max(float((p - b).abs().max()) for p, b in
                        zip([p for u in units for p in u.params], before, strict=True)))

    monkeypatch.setattr(LocalSteps, "land_", recording)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 5))
    lr = 1e-3
    opt = ZeroOneAdam(model.parameters(), lr=lr, var_freeze_step=40, local_step_scaler=5,
                      total_steps=120, weight_decay=0.01, bound_update=False)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(512, 20, generator=gen), torch.randint(0, 5, (512,), generator=gen)
    for _ in range(120):
        i = torch.randint(0, 512, (32,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[i]), y[i]).backward()
        opt.step()
    assert opt.local_interval == 16 and len(gaps) == opt.syncs > 10
    assert max(gaps) <= 1e-3 * lr, gaps


# ------------------------------------------------------------------------------------ 2 ranks
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        # A parameter whose gradient is zero: weight decay alone moves it.
        self.idle = nn.Parameter(torch.linspace(-2.0, 2.0, 64))

    def forward(self, x):
        return self.body(x) + 0.0 * self.idle.sum()


def _model(seed=0):
    torch.manual_seed(seed)
    return _Net()


def _loss(model, rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(16, 16, generator=gen), torch.randint(0, 4, (16,), generator=gen)
    return nn.functional.cross_entropy(model(x), y)


def _run(rank, world, steps, *, ddp=False, interval=4, wd=0.0, save_at=None, ckpt=None,
         load=None, lr=1e-2, local_variance=True):
    model = _model()
    net = DDP(model, bucket_cap_mb=0.001) if ddp else model
    opt = ZeroOneAdam(model.parameters(), lr=lr, weight_decay=wd, var_freeze_step=12,
                      var_update_scaler=4, local_step_scaler=1, local_step_clipper=interval,
                      total_steps=steps, bucket_cap_mb=0.001,  # several units, either way
                      local_variance=local_variance)
    if ddp:
        register_onebit_hook(net, opt)
    start = resume(load, rank, model, opt)
    trace = []
    for step in range(start, steps):
        kind = opt.coming_exchange
        opt.zero_grad()
        _loss(net, rank, step).backward()
        opt.step()
        trace.append((kind, [p.detach().clone() for p in model.parameters()]))
        if save_at is not None and step + 1 == save_at:
            save_for_resume(ckpt, rank, model, opt, step + 1)
    return trace


def _rare_coordinate(rank, world, lr):
    """Coordinate 0 has a tiny gradient in the refreshes (its denominator about 1e-3), then
    one a thousand times larger; coordinate 1 a different gradient on each rank. Returns what
    each step exchanged and the values after it."""
    p = nn.Parameter(torch.zeros(2))
    opt = ZeroOneAdam([p], lr=lr, var_freeze_step=2, var_update_scaler=1, local_step_scaler=1,
                      local_step_clipper=4, total_steps=8)
    seen = []
    for t in range(1, 9):
        p.grad = torch.tensor([1e-3 if t <= 2 else 1.0, 1.0 if rank == 0 else -0.2])
        opt.step()
        seen.append((opt.coming_exchange, p.detach().clone()))
    return seen


def test_a_local_step_is_bounded_at_sqrt_w_lr_and_the_common_point_at_lr():
    """bound_update in phase B: a local step's ``m_hat / denom`` is clamped to sqrt(W) (its
    momentum averages 1/W of the batch), the landing's average to 1. Steps 3 and 4 sync, 5-7 are
    local, 8 syncs (interval 4): coordinate 0, over a zero variance, moves sqrt(2) lr per local
    step on each rank, and the common point 4 lr over the 4 steps to the sync, no more."""
    lr = 1e-2
    ranks = run_ranks(_rare_coordinate, 2, lr)
    for seen in ranks:
        values = [v for _, v in seen]
        for t in (5, 6, 7):  # values[t - 1]: after step t
            moved = float(values[t - 2][0] - values[t - 1][0])
            assert moved == pytest.approx(2**0.5 * lr, rel=1e-5), (t, moved)
        assert float(values[3][0] - values[7][0]) == pytest.approx(4 * lr, rel=1e-5)
    # The ranks' second coordinates (gradients 1 and -0.2) differ after a local step and agree
    # after the sync.
    assert not torch.equal(ranks[0][5][1], ranks[1][5][1])
    assert torch.equal(ranks[0][7][1], ranks[1][7][1])


def test_ranks_differ_between_syncs_and_are_bit_identical_after_each():
    traces = run_ranks(_run, 2, 40)
    kinds = [k for k, _ in traces[0]]
    assert kinds.count("local") >= 15 and kinds.count("sync") >= 5
    assert {"exact", "momentum"} <= set(kinds)
    for (kind, a), (_, b) in zip(*traces, strict=True):
        same = all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
        # Ranks step on different data: apart after a local step, together after the rest.
        assert same == (kind != "local"), kind


def test_the_ddp_hook_gives_the_same_numbers_as_the_optimizer_side_path():
    plain = run_ranks(_run, 2, 30)
    hooked = run_ranks(functools.partial(_run, ddp=True), 2, 30)
    for r in range(2):
        for (k1, a), (k2, b) in zip(plain[r], hooked[r], strict=True):
            assert k1 == k2
            for p, q in zip(a, b, strict=True):
                assert torch.equal(p, q), k1


@pytest.mark.parametrize("interval", [1, 4, 16])
def test_a_parameter_with_zero_gradient_decays_exactly_as_under_adamw(interval):
    steps, lr, wd = 12 + 4 * 16, 1e-2, 0.1
    traces = run_ranks(functools.partial(_run, interval=interval, wd=wd), 2, steps)
    idle = traces[0][-1][1][0]  # the last step syncs: every rank holds it
    assert torch.equal(idle, traces[1][-1][1][0])
    start = _model().idle.detach()
    adamw = start.clone()
    for _ in range(steps):
        adamw.mul_(1 - lr * wd)  # torch's AdamW on a zero gradient, rounded at every step
    exact = start.double() * (1 - lr * wd) ** steps

    def error(t):
        return float(((t.double() - exact) / exact).abs().max())

    # AdamW's decay to the rounding AdamW itself makes (about 1e-6 here), or one fp32 ulp.
    assert error(idle) <= max(error(adamw), 2.0**-23), (error(idle), error(adamw))
    # DeepSpeed's order carried lr * wd * p into the rebuilt momentum: 1.8x to 10x the decay.
    assert error(idle) < 1e-5


def _collectives_worker(rank, world, local_variance=False):
    calls = []
    names = ("all_reduce", "all_to_all_single", "all_gather", "broadcast", "reduce_scatter",
             "all_gather_into_tensor", "send", "recv", "barrier")
    originals = {n: getattr(dist, n) for n in names}

    def counting(name):
        def call(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)
        return call

    model = _model()
    net = DDP(model, bucket_cap_mb=0.001)
    opt = ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=12, var_update_scaler=4,
                      local_step_scaler=1, local_step_clipper=4, total_steps=40,
                      local_variance=local_variance)
    register_onebit_hook(net, opt)
    per_step = []
    for n in names:
        setattr(dist, n, counting(n))
    try:
        for step in range(40):
            kind = opt.coming_exchange
            del calls[:]
            opt.zero_grad()
            _loss(net, rank, step).backward()
            opt.step()
            per_step.append((kind, len(calls)))
    finally:
        for n, f in originals.items():
            setattr(dist, n, f)
    return per_step


@pytest.mark.parametrize("local_variance", [False, True])
def test_a_local_step_sends_nothing_and_a_sync_sends_one_compressed_allreduce_per_unit(
        local_variance):
    per_step = run_ranks(_collectives_worker, 2, local_variance)[0]
    after_first = per_step[1:]  # the first step also checks that the ranks' settings agree
    local = {n for k, n in after_first if k == "local"}
    assert local == {0}
    sync = {n for k, n in after_first if k == "sync"}
    momentum = {n for k, n in after_first if k == "momentum"}
    if not local_variance:
        assert sync and sync == momentum and 0 not in sync  # two all-to-alls per unit, both ways
        assert {n for k, n in after_first if k == "exact"} - {0}
        return
    # local_variance: every 1-bit step and sync sends one small allreduce more (the noise
    # samples), and phase A's refreshes, 1-bit steps now, one more again (the variances'
    # average); no step averages the gradients after the exact stage. Phase B's averages
    # fall every 128 steps: none in these 40.
    one_bit = min(momentum)
    assert 0 not in sync and sync == momentum == {one_bit}
    assert {n for k, n in after_first if k == "refresh"} == {one_bit + 1}
    assert all(k == "exact" for k, _ in per_step[:4]) and \
        "exact" not in {k for k, _ in per_step[4:]}


# Phase A before a 1-bit step and before a refresh (the units are built by either); phase B at
# a sync and between syncs.
@pytest.mark.parametrize("save_at", [10, 9, 13, 20, 22])
@pytest.mark.parametrize("local_variance", [True, False], ids=["local-variance", "paper"])
def test_resume_is_bitwise_in_every_phase(tmp_path, save_at, local_variance):
    ckpt = str(tmp_path / "ckpt")
    whole = run_ranks(functools.partial(_run, save_at=save_at, ckpt=ckpt,
                                        local_variance=local_variance), 2, 30)
    resumed = run_ranks(functools.partial(_run, load=ckpt, local_variance=local_variance), 2,
                        30)
    for r in range(2):
        for (k1, a), (k2, b) in zip(whole[r][save_at:], resumed[r], strict=True):
            assert k1 == k2
            assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True)), (save_at, k1)


def _rank0_weights_worker(rank, world, ckpt, save_at):
    """What Lightning does: rank 0's model and optimizer state, then each rank's own
    onebit_state_dict()."""
    whole = _run(rank, world, 30, save_at=save_at, ckpt=ckpt)
    dist.barrier()
    model = _model()
    opt = ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=12, var_update_scaler=4,
                      local_step_scaler=1, local_step_clipper=4, total_steps=30)
    rank0 = torch.load(f"{ckpt}.0", weights_only=True)
    own = torch.load(f"{ckpt}.{rank}", weights_only=True)
    model.load_state_dict(rank0["model"])
    opt.load_state_dict(rank0["opt"])
    opt.load_onebit_state_dict(own["opt"]["onebit"])
    trace = []
    for step in range(save_at, 30):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        opt.step()
        trace.append([p.detach().clone() for p in model.parameters()])
    return [t for _, t in whole[save_at:]], trace


def test_between_syncs_each_rank_resumes_its_own_parameters_from_rank_0s_checkpoint(tmp_path):
    for whole, resumed in run_ranks(_rank0_weights_worker, 2, str(tmp_path / "c"), 22):
        for a, b in zip(whole, resumed, strict=True):
            assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def _ended_apart_worker(rank, world, total=None):
    model = _model()
    # Both numbers given and no run length (the last step need not sync), or a run stopped
    # before its length.
    opt = ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=12, var_update_scaler=4,
                      local_step_scaler=1, local_step_clipper=4, total_steps=total)
    for step in range(19):  # 13, 14 and 16 sync; 17-19 are local
        opt.zero_grad()
        _loss(model, rank, step).backward()
        opt.step()
    apart = opt.between_syncs
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("onebit_plugin").addHandler(handler)
    opt.training_ended()
    counts = opt.bytes_sent, opt.dense_bytes
    opt.sync_local_steps()
    return apart, [r.getMessage() for r in records], opt.between_syncs, \
        [p.detach().clone() for p in model.parameters()], \
        (counts, (opt.bytes_sent, opt.dense_bytes))


@pytest.mark.parametrize("total,advice", [(None, "Give the optimizer the run's length"),
                                          (40, "stopped before the total_steps=40")])
def test_a_run_ending_between_syncs_is_said_and_sync_local_steps_lands_every_rank(total, advice):
    (apart0, said0, after0, params0, counts), (apart1, said1, after1, params1, _) = \
        run_ranks(_ended_apart_worker, 2, total)
    assert apart0 and apart1
    # The extra sync's bytes are sent; DDP with Adam would have sent nothing for it.
    (sent, dense), (sent_after, dense_after) = counts
    assert sent_after > sent and dense_after == dense
    assert any("3 local steps after the last sync" in m and advice in m for m in said0), said0
    assert not after0 and not after1
    assert all(torch.equal(p, q) for p, q in zip(params0, params1, strict=True))


def test_the_switch_line_says_the_schedule_and_freeze_step_is_refused():
    model = nn.Linear(2, 2)
    opt = ZeroOneAdam(model.parameters(), total_steps=2000)
    for _ in range(16):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    assert opt.switch_message() == (
        "onebit: 0/1 Adam was Adam for 16 steps; from step 17 the momentum is averaged exactly "
        "in fp32 (compress_momentum=False or one process), every rank's gradients folded into "
        "its own variance, the ranks' variances averaged in fp32 on 48 steps to step 241 "
        "(var_freeze_step + 1, as DeepSpeed counts), then local steps, the interval doubling "
        "every 110 steps up to 16, the variances averaged again at the first sync of every "
        "128 steps")
    brief = ZeroOneAdam(nn.Linear(2, 2).parameters(), total_steps=60, var_freeze_step=20,
                        var_update_scaler=4, warmup_bits=16)
    brief.switch_step = 4
    assert brief.switch_message().endswith(
        "the ranks' variances averaged in bf16 on 6 steps to step 21 (var_freeze_step + 1, as "
        "DeepSpeed counts), then local steps, the interval doubling every 2 steps up to 16 "
        "(phase B's variance averages fall every 128 steps: none in this run)")
    paper = ZeroOneAdam(nn.Linear(2, 2).parameters(), total_steps=2000, local_variance=False)
    paper.switch_step = 16
    assert paper.switch_message().endswith(
        "the variance refreshed in full precision on 64 steps to step 241 (var_freeze_step + 1, "
        "as DeepSpeed counts), then local steps, the interval doubling every 110 steps up to 16")
    short = ZeroOneAdam(nn.Linear(2, 2).parameters(), total_steps=100)
    short.switch_step = 16
    assert "no local steps in this run" in short.switch_message()
    with pytest.raises(TypeError, match="var_freeze_step"):
        ZeroOneAdam(model.parameters(), freeze_step=10)


def _local_clip_worker(rank, world):
    model = _model()
    opt = ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=4, var_update_scaler=4,
                      local_step_scaler=1, local_step_clipper=4, total_steps=20)
    seen = []
    for step in range(10):
        kind = opt.coming_exchange
        opt.zero_grad()
        (_loss(model, rank, step) * 50).backward()  # large enough that clipping acts
        local = [p.grad.clone() for p in model.parameters()]
        norm = opt.clip_grad_norm_(0.5)
        if kind == "local":
            expected = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g) for g in local]))
            seen.append((float(norm), float(expected), [
                torch.equal(p.grad, g * (0.5 / (expected + 1e-6))) for p, g in
                zip(model.parameters(), local, strict=True)]))
        opt.step()
    return seen


def test_a_local_step_clips_each_ranks_own_gradient_by_its_own_norm():
    """Phase B's local steps: no rank has the average and nothing is sent, so
    ``clip_grad_norm_`` is torch's on this rank's gradient (docs/usage.md, "0/1 Adam")."""
    for seen in run_ranks(_local_clip_worker, 2):
        assert seen  # local steps were taken
        for norm, expected, scaled in seen:
            assert norm == pytest.approx(expected, rel=1e-6) and norm > 0.5
            assert all(scaled)


def test_a_validation_between_syncs_is_said_once_or_synced_first(caplog):
    """Lightning's OneBitAdamCallback: a validation that starts between ZeroOneAdam's syncs
    evaluates each rank's own point with sync_before_validation=False, said once (rank zero);
    by default the ranks sync first (one more sync, the schedule as it was)."""
    import logging
    import warnings
    from types import SimpleNamespace

    pytest.importorskip("lightning")
    from onebit_plugin.integrations.lightning import classes_for

    callback_cls = classes_for("lightning.pytorch")[1]

    def between_syncs():
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(8))
        opt = ZeroOneAdam([p], lr=1e-2, var_freeze_step=2, var_update_scaler=1,
                          local_step_scaler=1, local_step_clipper=4, total_steps=50)
        for _ in range(10):
            p.grad = torch.randn(8)
            opt.step()
            if opt.between_syncs:
                return opt, SimpleNamespace(optimizers=[opt], global_step=opt.global_step)
        raise AssertionError("never between syncs")

    opt, trainer = between_syncs()
    quiet = callback_cls(sync_before_validation=False)
    with warnings.catch_warnings(record=True) as said, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        quiet.on_validation_start(trainer, None)
        quiet.on_validation_start(trainer, None)
    said = [str(w.message) for w in said] + [r.getMessage() for r in caplog.records]
    said = [m for m in said if "runs between ZeroOneAdam's syncs" in m]
    assert len(said) == 1 and "sync_before_validation=True" in said[0], said
    assert opt.between_syncs  # the run's trajectory untouched
    opt, trainer = between_syncs()
    syncing = callback_cls()  # the default
    syncs = opt.syncs
    syncing.on_validation_start(trainer, None)
    assert not opt.between_syncs and opt.syncs == syncs + 1


def test_the_launchers_line_says_a_run_too_short_for_local_steps():
    from onebit_plugin.integrations.accelerate_flag import _when

    def line(n, **kw):
        return _when(ZeroOneAdam(nn.Linear(2, 2).parameters(), total_steps=n, **kw))
    assert line(30).endswith("to the run's end: no local steps in this run)")
    assert "averaging them, to step 241, then local steps, the interval doubling every 3 " \
        "steps up to 16)" in line(300)
    assert "full-precision refreshes of the variance, to step 241" in line(
        300, local_variance=False)


# ------------------------------------------------------------------ a local step's inf/NaN
def _nan_local_step_run(rank, world):
    """0/1 Adam on 4 ranks over groups of 2 (global ranks 0 and 2, 1 and 3: HSDP's replicate
    groups on 2 hosts of 2); global rank 3's gradient is NaN at the first local step: it skips
    that step alone, said with its global rank; the next sync brings its group to one point."""
    import logging

    from onebit_plugin import check_lockstep

    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("onebit_plugin").addHandler(handler)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=6, var_update_scaler=2,
                      local_step_scaler=1, local_step_clipper=4, total_steps=16,
                      process_group=group)
    poisoned = None
    for step in range(16):
        g = torch.Generator().manual_seed(100 * step + rank)
        loss = nn.functional.mse_loss(model(torch.randn(8, 4, generator=g)),
                                      torch.randn(8, 2, generator=g))
        if poisoned is None and opt.coming_exchange == "local":
            poisoned = step + 1
            if rank == 3:
                loss = loss * float("nan")
        loss.backward()
        opt.step()
        opt.zero_grad()
    check_lockstep(model.parameters(), opt, group=group)  # the last step syncs the group
    return poisoned, [r.getMessage() for r in records if "skipped" in r.getMessage()]


def test_a_local_steps_nan_is_skipped_on_its_rank_alone_and_said_with_its_global_rank():
    runs = run_ranks(_nan_local_step_run, 4)
    step = runs[0][0]
    assert step is not None and all(run[0] == step for run in runs)
    assert [run[1] for run in runs[:3]] == [[], [], []]
    assert runs[3][1] == [f"onebit: local step {step} skipped on rank 3 (rank 1 of the "
                          "optimizer's process group): its gradient was inf or NaN (1 in a "
                          "row)"], runs[3][1]
