"""A non-finite gradient on one rank: every rank skips that step, nothing is poisoned."""

import math

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from onebit_plugin import CompressedAllreduce, OneBitAdam, check_lockstep, register_onebit_hook
from tests.dist_helpers import assert_ranks_identical, run_ranks


def _allreduce_worker(rank, world):
    state = CompressedAllreduce(1001, max_block=64)
    gen = torch.Generator().manual_seed(rank)
    skipped = []
    outputs = []
    for call in range(6):
        x = torch.randn(1001, generator=gen)
        if call == 3 and rank == 1:
            x[17] = math.inf
        if call == 4 and rank == 1:  # finite, but its square overflows fp32: an inf scale
            x[900] = 1e20
        errors = (state.worker_error.clone(), state.server_error.clone())
        out = torch.full((1001,), 7.0)
        state(x, out=out)
        skipped.append(state.last_call_skipped)
        if state.last_call_skipped:
            assert torch.equal(out, torch.full((1001,), 7.0))
            assert torch.equal(state.server_error, errors[1])
            if rank == 1:  # the rank with the bad input cleared its overwritten error
                assert torch.equal(state.worker_error, torch.zeros_like(errors[0]))
            else:  # the others keep this compression's residual
                assert not torch.equal(state.worker_error, errors[0])
        outputs.append(out)
    assert torch.isfinite(state.worker_error).all() and torch.isfinite(state.server_error).all()
    return skipped, outputs, state.skipped_calls


def test_compressed_allreduce_skips_everywhere_without_poisoning():
    results = run_ranks(_allreduce_worker, 3)
    assert_ranks_identical([r[1] for r in results], "outputs")
    for skipped, _, count in results:
        assert skipped == [False, False, False, True, True, False] and count == 2


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _training_worker(rank, world, use_hook, bad_step):
    model = _model()
    if use_hook:
        model = DDP(model, bucket_cap_mb=0.001)
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=3)
    if use_hook:
        register_onebit_hook(model, opt)
    before = after = None
    for step in range(8):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        opt.zero_grad()
        loss = model(x).square().mean()
        if step == bad_step and rank == 1:
            loss = loss * math.nan
        loss.backward()
        if step == bad_step:
            before = [p.detach().clone() for p in model.parameters()]
            momenta = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
        opt.step()
        if step == bad_step:
            after = [p.detach().clone() for p in model.parameters()]
            unchanged_momenta = all(
                torch.equal(m, opt.state[p]["exp_avg"])
                for m, p in zip(momenta, model.parameters(), strict=True)
            )
        check_lockstep(model.parameters(), opt)
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    return before, after, unchanged_momenta, opt.skipped_steps, finite


@pytest.mark.parametrize("use_hook", [False, True], ids=["optimizer-side", "ddp-hook"])
@pytest.mark.parametrize("bad_step", [1, 5], ids=["warm-up", "compression"])
def test_nonfinite_gradient_on_one_rank_skips_the_step_on_all(use_hook, bad_step):
    for before, after, unchanged_momenta, skipped, finite in run_ranks(
        _training_worker, 2, use_hook, bad_step
    ):
        for a, b in zip(before, after, strict=True):
            assert torch.equal(a, b)  # the step was skipped
        assert unchanged_momenta and skipped == 1 and finite


def test_skipped_steps_are_said_each_time_and_a_streak_is_an_error(caplog):
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2, max_skipped_steps=3)

    def step(bad: bool):
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).square().mean()
        (loss * math.nan if bad else loss).backward()
        opt.step()

    with caplog.at_level("WARNING", logger="onebit_plugin"):
        for bad in (True, True, False, True, True):  # a good step ends the streak
            step(bad)
        assert [r.getMessage().split(": a ")[0] for r in caplog.records] == [
            f"onebit: step {s} skipped on every rank" for s in (1, 2, 4, 5)]
        assert "(2 in a row, 4 in all)" in caplog.records[-1].getMessage()
        with pytest.raises(RuntimeError, match="3 steps in a row were skipped for inf/NaN"):
            step(True)
    assert opt.skipped_steps == 5 and all(torch.isfinite(p).all() for p in model.parameters())
    assert opt.stage == "warmup"  # skipped steps do not count towards freeze_step (2)
    with pytest.raises(ValueError, match="max_skipped_steps must be an int >= 1, got 0"):
        OneBitAdam(model.parameters(), freeze_step=2, max_skipped_steps=0)


def _late_gradients_worker(rank, world):
    torch.manual_seed(0)
    used, late = nn.Linear(8, 3), nn.Linear(8, 3)
    opt = OneBitAdam([*used.parameters(), *late.parameters()], lr=1e-2, freeze_step=2)
    before = [p.detach().clone() for p in late.parameters()]
    gen = torch.Generator().manual_seed(rank)
    moved, largest = torch.zeros_like(late.weight, dtype=torch.bool), 0.0
    for step in range(6):
        opt.zero_grad()
        x = torch.randn(4, 8, generator=gen)
        # "late" gets gradients only after the freeze: its frozen variance is 0.
        loss = used(x).square().mean() + (late(x).square().mean() if step >= 2 else 0)
        loss.backward()
        last = late.weight.detach().clone()
        opt.step()
        # Moved at some step (a coordinate's +-lr steps may bring it back to its start) and
        # the largest step any coordinate took.
        moved |= late.weight.detach().ne(before[0])
        largest = max(largest, float((late.weight.detach() - last).abs().max()))
    return (opt.stage, [p.detach() for p in late.parameters()], before,
            [p.detach() for p in used.parameters()], moved, largest)


def test_a_parameter_without_gradients_in_warmup_stays_finite_after_the_freeze():
    """Its variance froze at 0, and it shares a compressed block with the used parameters
    (unmasked, the 1-bit exchange would send it +-scale, and the update divide it by eps).
    Its bias (1-D) stays masked: a zero momentum, no step, no 0/0. Its weight's rows wake at
    their first gradient (step 3, ``maths.late_rows``) with Adam's variance after it, take
    Adam's first step there and move by at most lr a step (steps 3-6): bounded, never by
    ``scale / eps``."""
    for stage, late, before, used, moved, largest in run_ranks(_late_gradients_worker, 2):
        assert stage == "compression"
        (weight, bias), (weight0, bias0) = late, before
        assert torch.equal(bias, bias0)  # v == 0: masked, no step (and no 0/0)
        assert bool(moved.all()) and largest <= 1e-2 * (1 + 1e-6)
        assert float((weight - weight0).abs().max()) <= 4 * 1e-2 * (1 + 1e-6)
        assert all(torch.isfinite(p).all() for p in used)
