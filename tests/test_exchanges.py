"""The step exchanges are the seam: a policy's exchange for a step is the one the step driver,
clipping and the DDP hook call, on every path, and a new exchange plugged into a policy takes
over every step of its kind (docs/family.md, "An exchange")."""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from onebit_plugin import OneBitAdam, ZeroOneAdam, register_onebit_hook
from onebit_plugin.core.exchanges import MomentumStep
from onebit_plugin.core.gradient_average import GradientAverage
from onebit_plugin.settings.step_kinds import EXACT, LOCAL, MOMENTUM, REFRESH, SYNC
from tests.dist_helpers import run_ranks

FREEZE, STEPS = 3, 6


def _recording(base):
    """A subclass of exchange class ``base`` that notes each call, by what called it."""

    class Recording(base):
        def __init__(self, *args):
            super().__init__(*args)
            self.calls = []

        def in_backward(self, opt, hook, bucket):
            self.calls.append(("hook", opt.global_step + 1))
            return super().in_backward(opt, hook, bucket)

        def clip_grad_norm_(self, opt, trainable, max_norm, norm_type):
            self.calls.append(("clip", opt.global_step + 1))
            return super().clip_grad_norm_(opt, trainable, max_norm, norm_type)

        def step(self, opt):
            self.calls.append(("step", opt.global_step))
            super().step(opt)

    return Recording


def _plugged_worker(rank, world, hooked):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    model = DDP(net) if hooked else net
    opt = OneBitAdam(net.parameters(), lr=1e-2, freeze_step=FREEZE)
    policy = opt.policy
    policy.warmup = _recording(GradientAverage)(policy.warmup.then)
    policy.exchanges[MOMENTUM] = _recording(MomentumStep)(policy.exchange)
    if hooked:
        register_onebit_hook(model, opt)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        opt.zero_grad()
        x = torch.randn(4, 8, generator=gen)
        nn.functional.cross_entropy(model(x), torch.randint(0, 3, (4,), generator=gen)).backward()
        opt.clip_grad_norm_(10.0)
        opt.step()
    return {"warmup": policy.warmup.calls, "momentum": policy.exchanges[MOMENTUM].calls,
            "stage": opt.stage, "params": [p.detach().clone() for p in net.parameters()]}


def _expected(steps, hooked):
    """Per step: the hook's calls (one per bucket: the model is one bucket), the clip, step()."""
    return [call for t in steps for call in
            ([("hook", t)] if hooked else []) + [("clip", t), ("step", t)]]


def test_the_policys_exchanges_are_called_by_step_clipping_and_the_hook_on_both_paths():
    results = {hooked: run_ranks(_plugged_worker, 2, hooked) for hooked in (False, True)}
    for hooked, per_rank in results.items():
        for r in per_rank:
            assert r["stage"] == "compression"
            assert r["warmup"] == _expected(range(1, FREEZE + 1), hooked)
            assert r["momentum"] == _expected(range(FREEZE + 1, STEPS + 1), hooked)
    # Plugged in, nothing else changed: both paths still agree bit for bit.
    for a, b in zip(results[False][0]["params"], results[True][0]["params"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("local_variance", [False, True])
def test_zero_one_adams_policy_names_an_exchange_for_every_word_of_its_schedule(local_variance):
    net = nn.Linear(4, 2)
    opt = ZeroOneAdam(net.parameters(), lr=1e-3, var_freeze_step=40, var_update_scaler=4,
                      local_step_scaler=8, local_step_clipper=4, local_variance=local_variance)
    policy = opt.policy
    assert policy.step_exchange(1, None, compressing=False) is policy.warmup
    kinds = {policy.step_exchange(t, None, compressing=True).kind for t in range(1, 80)}
    assert kinds == {REFRESH if local_variance else EXACT, MOMENTUM, LOCAL, SYNC}
    for t in range(1, 80):
        exchange = policy.step_exchange(t, None, compressing=True)
        assert exchange is policy.exchanges[policy.exchange_at(t, None)]
        assert exchange.kind == policy.exchange_at(t, None)
