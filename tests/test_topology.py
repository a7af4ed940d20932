"""``topology``: flat, or two levels (exact inside a host, the member's exchange across hosts by
local rank) for ranks laid out as hosts of ``local_world_size`` (issue 46). Four gloo ranks
stand for 2 hosts x 2; bytes are counted at torch's collectives, by the group they cross."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from onebit_plugin import OneBitAdam, OneBitLamb, ZeroOneAdam, register_onebit_hook
from onebit_plugin.comm.allreduce import OneBitAllreduce
from onebit_plugin.comm.hierarchical import HierarchicalAllreduce, two_level_mean_
from onebit_plugin.settings.config import settings_from_env
from tests.dist_helpers import (
    assert_ranks_identical,
    counting_by_host,
    restore_collectives,
    resume,
    run_ranks,
    save_for_resume,
)

LOCAL = 2


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 5))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 24, generator=g), torch.randn(16, 5, generator=g)


def _train(rank, world, member, topology, ddp, steps, save=None, load=None, local=LOCAL):
    os.environ["LOCAL_WORLD_SIZE"] = str(local)
    model = _model()
    if member == "onebit_adam":
        opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=4, topology=topology)
    elif member == "onebit_lamb":
        opt = OneBitLamb(model.parameters(), lr=1e-2, freeze_step=4, topology=topology)
    else:
        opt = ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=6, var_update_scaler=2,
                          local_step_scaler=4, local_step_clipper=2, total_steps=steps,
                          topology=topology)
    net = model
    if ddp:
        net = torch.nn.parallel.DistributedDataParallel(model)
        register_onebit_hook(net, opt)
    start = resume(load, rank, model, opt)
    counts = {"cross": 0, "host": 0}
    per_step, after = [], []
    real = counting_by_host(LOCAL, counts)
    try:
        for step in range(start, steps):
            x, y = _batch(step, rank)
            before = dict(counts)
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            per_step.append({k: counts[k] - before[k] for k in counts})
            after.append([p.detach().clone() for p in model.parameters()])
            if save is not None and step + 1 == save[1]:
                save_for_resume(save[0], rank, model, opt, step + 1)
    finally:
        restore_collectives(real)
    errors = [u.errors.get("worker") for u in opt.units]
    return (after, per_step, opt.topology.describe(),
            sum(e.numel() for e in errors if e is not None), type(opt.communicator).__name__)


@pytest.mark.parametrize("ddp", [False, True], ids=["step", "ddp-hook"])
def test_hierarchical_ranks_stay_identical_and_a_host_sends_half_across(ddp):
    world, steps = 4, 10
    flat = run_ranks(_train, world, "onebit_adam", "flat", ddp, steps)
    tiered = run_ranks(_train, world, "onebit_adam", "hierarchical", ddp, steps)
    for runs in (flat, tiered):
        for step in range(steps):
            assert_ranks_identical([r[0][step] for r in runs], f"step {step + 1}")
    assert [r[2] for r in tiered] == ["hierarchical 2x2"] * world
    assert [r[4] for r in tiered] == ["HierarchicalAllreduce"] * world
    assert [r[2] for r in flat] == ["flat"] * world
    # Worker errors: each rank's over its half of every unit (the tail padded to a block).
    assert all(r[3] <= flat[0][3] / LOCAL + 64 for r in tiered), [r[3] for r in tiered]
    # Bytes across hosts per host (both of its ranks) in the compression stage and the warm-up.
    def host_cross(runs, steps_of):
        return sum(runs[r][1][s]["cross"] for r in (0, 1) for s in steps_of)
    compression, warmup = range(5, steps), range(4)
    ratio = host_cross(tiered, compression) / host_cross(flat, compression)
    assert ratio <= 0.6, ratio  # ideal 0.5: half the senders, the same share each
    # Warm-up, n fp32 values: flat, gloo's ring over 4 ranks has one rank of each host send
    # 2 * 3/4 * 4n bytes across; two levels, each rank sends its quarter (n bytes) out and
    # gathers it back (n bytes): 4n per host, 2/3 of flat.
    warm = host_cross(tiered, warmup) / host_cross(flat, warmup)
    assert warm == pytest.approx(2 / 3, rel=0.02), warm


def test_the_ddp_hook_and_the_step_give_the_same_bits_over_two_levels():
    by_step = run_ranks(_train, 4, "onebit_adam", "hierarchical", False, 8)
    by_hook = run_ranks(_train, 4, "onebit_adam", "hierarchical", True, 8)
    for step in range(8):
        assert_ranks_identical([by_step[0][0][step], by_hook[0][0][step]], f"step {step + 1}")


def _mean_on_ranks(rank, world, numel):
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
    from onebit_plugin.comm.topology import make_topology

    topo = make_topology(None, "hierarchical")
    levels = topo.levels(None, torch.device("cpu"))
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    mine = x.clone()
    two_level_mean_(x, levels, None)
    return mine, x


def test_the_exact_two_level_mean_sums_in_host_then_local_rank_order():
    out = run_ranks(_mean_on_ranks, 4, 1001)
    assert_ranks_identical([x for _, x in out], "means")
    inputs = [m for m, _ in out]
    expect = ((inputs[0] + inputs[1]) + (inputs[2] + inputs[3])) / 4
    assert torch.equal(out[0][1], expect)


def _compressed_on_ranks(rank, world, numel):
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
    from onebit_plugin.comm.topology import make_topology

    topo = make_topology(None, "hierarchical")
    host, cross, local, hosts = topo.levels(None, torch.device("cpu"))
    comm = HierarchicalAllreduce(OneBitAllreduce(cross, max_block=256), None, host, local)
    plan = comm.plan(numel)
    errors = plan.new_errors()
    g = torch.Generator().manual_seed(7 + rank)
    xs, outs = [], []
    for _ in range(30):
        x = torch.randn(numel, generator=g) + 0.5
        out = torch.empty(numel)
        assert comm.reduce_(x, plan, errors, out=out)
        xs.append(x)
        outs.append(out)
    bad = torch.randn(numel)
    if rank == 3:
        bad[5] = float("inf")
    kept = torch.full((numel,), 3.0)
    skipped = comm.reduce_(bad, plan, errors, out=kept)
    assert torch.equal(kept, torch.full((numel,), 3.0))  # a skipped call leaves out as it was
    return xs, outs, errors["worker"].numel(), errors["server"].numel(), skipped


def test_the_two_level_1_bit_average_is_the_same_everywhere_and_unbiased_over_calls():
    numel = 3000
    out = run_ranks(_compressed_on_ranks, 4, numel)
    for call in range(30):
        assert_ranks_identical([r[1][call] for r in out], f"call {call}")
    mean = [sum(r[0][c] for r in out) / 4 for c in range(30)]
    # Error feedback on both sides: the sum of 30 decoded averages is off the true sum by about
    # one call's error (the residuals left at the end), where 30 independent errors would add
    # up to sqrt(30) = 5.5 times one call's.
    def rms(x):
        return float(x.pow(2).mean().sqrt())
    drift = rms(sum(out[0][1]) - sum(mean))
    one_call = sum(rms(d - m) for d, m in zip(out[0][1], mean, strict=True)) / 30
    assert drift < 2 * one_call, (drift, one_call)
    worker, server = out[0][2], out[0][3]
    assert numel / LOCAL <= worker < numel / LOCAL + 256  # half of the tensor, padded
    assert server == worker // 2  # one of 2 hosts' chunks
    assert [r[4] for r in out] == [False] * 4  # one rank's inf skips the call everywhere


def test_auto_is_flat_on_one_host_and_hierarchical_needs_a_layout_that_fits():
    for message in run_ranks(_layout_errors, 4):
        assert message is not None
    one_host = run_ranks(_train, 2, "onebit_adam", "auto", False, 6, None, None, 2)
    assert [r[2] for r in one_host] == ["flat", "flat"]
    assert one_host[0][4] == "OneBitAllreduce"


def _layout_errors(rank, world):
    os.environ["LOCAL_WORLD_SIZE"] = "3"
    param = torch.nn.Parameter(torch.ones(4))
    opt = OneBitAdam([param], lr=0.1, freeze_step=2, topology="hierarchical")
    param.grad = torch.ones(4)
    try:
        opt.step()
    except ValueError as exc:
        assert "LOCAL_WORLD_SIZE=3 does not divide the 4 ranks into hosts of one size" in \
            str(exc)
    else:
        return None
    # One host of 4 (torchrun --nproc_per_node 4 sets LOCAL_WORLD_SIZE=4 whatever was given):
    # the error says where the number came from and how to lay one machine out as hosts.
    os.environ["LOCAL_WORLD_SIZE"] = "4"
    opt = OneBitAdam([param], lr=0.1, freeze_step=2, topology="hierarchical")
    try:
        opt.step()
    except ValueError as exc:
        assert "1 host(s) of 4 rank(s) (LOCAL_WORLD_SIZE=4)" in str(exc), str(exc)
        assert "pass local_world_size=L" in str(exc) and "--nproc_per_node" in str(exc)
        return str(exc)
    return None


@pytest.mark.parametrize("member", ["zero_one_adam", "onebit_lamb"])
def test_every_member_runs_over_two_levels_with_ranks_identical(member):
    steps = 14
    runs = run_ranks(_train, 4, member, "hierarchical", True, steps)
    last = [r[0][-1] for r in runs]  # 0/1 Adam: the run's last step syncs
    assert_ranks_identical(last, "the last step")
    assert runs[0][4] == "HierarchicalAllreduce"


def test_a_hierarchical_run_resumes_bitwise_and_another_topology_restarts_the_errors(
        tmp_path, caplog):
    ck = str(tmp_path / "ck")
    whole = run_ranks(_train, 4, "onebit_adam", "hierarchical", False, 10, (ck, 7))
    resumed = run_ranks(_train, 4, "onebit_adam", "hierarchical", False, 10, None, ck)
    for rank in range(4):
        assert_ranks_identical([whole[rank][0][-1], resumed[rank][0][-1]], "resumed")
    flat = run_ranks(_load_flat, 4, ck)
    assert all("saved with topology hierarchical 2x2 under topology flat" in m
               for m in flat[:1]), flat[0]


def _load_flat(rank, world, ck):
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=4, topology="flat")
    saved = torch.load(f"{ck}.{rank}", weights_only=True)
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("onebit_plugin").addHandler(handler)
    opt.load_state_dict(saved["opt"])
    x, y = _batch(7, rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return " ".join(records)


def test_topology_is_checked_and_read_from_the_environment(monkeypatch):
    params = [torch.nn.Parameter(torch.ones(3))]
    with pytest.raises(ValueError, match="topology must be one of"):
        OneBitAdam(params, freeze_step=2, topology="ring")
    with pytest.raises(ValueError, match="local_world_size must be an int >= 1"):
        OneBitAdam(params, freeze_step=2, local_world_size=0)
    monkeypatch.setenv("ONEBIT_ADAM", "1")
    monkeypatch.setenv("ONEBIT_FREEZE_STEP", "5")
    assert settings_from_env().member_options(None)["topology"] == "auto"
    monkeypatch.setenv("ONEBIT_TOPOLOGY", "hierarchical")
    assert settings_from_env().member_options(None)["topology"] == "hierarchical"
    monkeypatch.setenv("ONEBIT_TOPOLOGY", "tree")
    with pytest.raises(ValueError, match="ONEBIT_TOPOLOGY must be one of"):
        settings_from_env()
    from onebit_plugin import CompressedAllreduce
    from onebit_plugin.entry.deepspeed_config import from_deepspeed_config

    with pytest.raises(ValueError, match="topology must be one of"):
        CompressedAllreduce(10, topology="bogus")
    with pytest.raises(ValueError, match="local_world_size must be an int >= 1"):
        CompressedAllreduce(10, local_world_size=0)
    opt = from_deepspeed_config(params, {"optimizer": {"type": "OneBitAdam", "params": {
        "lr": 1e-3, "freeze_step": 3, "topology": "flat", "refresh_interval": 8}}})
    assert (opt.config.topology, opt.config.refresh_interval) == ("flat", 8)


def _standalone(rank, world):
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
    from onebit_plugin import CompressedAllreduce

    state = CompressedAllreduce(5000, topology="hierarchical", max_block=512)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(rank))
    out = state(x.clone())
    saved = state.state_dict()
    flat = CompressedAllreduce(5000, topology="flat", max_block=512)
    try:
        flat.load_state_dict(saved)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return out, x, saved["topology"], state.worker_error.numel(), refused


def test_the_standalone_allreduce_takes_the_topology_too():
    out = run_ranks(_standalone, 4)
    assert_ranks_identical([r[0] for r in out], "averages")
    mean = sum(r[1] for r in out) / 4
    assert float((out[0][0] - mean).abs().mean()) < float(mean.abs().mean())  # an estimate
    assert [r[2] for r in out] == ["hierarchical 2x2"] * 4
    assert 2500 <= out[0][3] < 2500 + 512
    assert out[0][4] == ("compressed allreduce state was saved with topology='hierarchical "
                         "2x2'; this one has 'flat'")
