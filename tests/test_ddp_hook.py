"""The DDP comm hook: DDP-equal warm-up, the same numbers as the optimizer-side path, overlap
with backward, lockstep with accumulation and unused parameters."""

import logging
import pickle

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from onebit_plugin import OneBitAdam, check_lockstep
from onebit_plugin.comm.allreduce import OneBitAllreduce
from onebit_plugin.entry.ddp_hook import register_onebit_hook
from tests.dist_helpers import assert_ranks_identical, run_ranks


def _mlp(seed=0, width=32, depth=3):
    torch.manual_seed(seed)
    layers = [nn.Linear(16, width), nn.Tanh()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 4))


def _batch(rank, step, n=8):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 16, generator=gen), torch.randint(0, 4, (n,), generator=gen)


def _step(model, opt, rank, step):
    x, y = _batch(rank, step)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _warmup_grads_worker(rank, world):
    grads = []
    for use_hook in (False, True):
        model = DDP(_mlp(), bucket_cap_mb=0.001)  # several buckets
        opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=100, average_grads=False)
        if use_hook:
            register_onebit_hook(model, opt)
        x, y = _batch(rank, 0)
        nn.functional.cross_entropy(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads


def test_warmup_hook_gradients_equal_ddp_default():
    """Bit for bit at 3 ranks, where x / 3 and x * (1 / 3) round differently."""
    for default, hooked in run_ranks(_warmup_grads_worker, 3):
        for a, b in zip(default, hooked, strict=True):
            assert torch.equal(b, a), (b - a).abs().max()


def _paths_worker(rank, world, model_fn, overlap):
    """The same training three ways: no DDP (optimizer-side path), and DDP with the hook."""
    plain = model_fn()
    opt_plain = OneBitAdam(plain.parameters(), lr=1e-2, freeze_step=3)
    ddp = DDP(model_fn(), bucket_cap_mb=0.001)
    opt_ddp = OneBitAdam(ddp.parameters(), lr=1e-2, freeze_step=3)
    state = register_onebit_hook(ddp, opt_ddp, overlap=overlap)
    for step in range(10):
        _step(plain, opt_plain, rank, step)
        _step(ddp, opt_ddp, rank, step)
    return ([p.detach() for p in plain.parameters()], [p.detach() for p in ddp.parameters()],
            state.overlap, opt_ddp.stage, opt_ddp.bytes_sent, opt_plain.bytes_sent)


def _single_tensor_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 4, bias=False))


def test_overlapping_hook_equals_optimizer_side_path_on_one_bucket():
    """One parameter, one bucket: the hook's bucket layout is the optimizer's flat layout, so
    the two paths must agree bit for bit (warm-up on W=2 included: x/2 + y/2 == (x+y)/2)."""
    results = run_ranks(_paths_worker, 2, _single_tensor_model, True)
    assert_ranks_identical([r[1] for r in results], "hook-path parameters")
    plain, hooked, overlap, stage, hook_bytes, plain_bytes = results[0]
    assert overlap and stage == "compression"
    for a, b in zip(plain, hooked, strict=True):
        assert torch.equal(a, b)


def test_fallback_hook_equals_optimizer_side_path():
    """overlap=False: the hook averages warm-up gradients, step() compresses the momentum."""
    results = run_ranks(_paths_worker, 2, _mlp, False)
    assert_ranks_identical([r[1] for r in results], "hook-path parameters")
    plain, hooked, overlap, stage, hook_bytes, plain_bytes = results[0]
    assert not overlap and stage == "compression"
    for a, b in zip(plain, hooked, strict=True):
        assert torch.equal(a, b)


def _views_worker(rank, world):
    plain = _mlp(depth=4)
    opt_plain = OneBitAdam(plain.parameters(), lr=1e-2, freeze_step=3, bucket_cap_mb=0.001)
    ddp = DDP(_mlp(depth=4), bucket_cap_mb=0.001, gradient_as_bucket_view=True)
    # The same units as the optimizer-side path: the same bits.
    opt_ddp = OneBitAdam(ddp.parameters(), lr=1e-2, freeze_step=3, bucket_cap_mb=0.001)
    state = register_onebit_hook(ddp, opt_ddp)
    in_backward = []
    mark = opt_ddp.handoff.mark_averaged
    opt_ddp.handoff.mark_averaged = lambda unit, ok: (in_backward.append(unit), mark(unit, ok))
    for step in range(10):
        _step(plain, opt_plain, rank, step)
        in_backward.clear()
        _step(ddp, opt_ddp, rank, step)
    return ([p.detach() for p in plain.parameters()], [p.detach() for p in ddp.parameters()],
            len(set(in_backward)), len(state.to_defer), len(opt_ddp.units))


def test_with_bucket_views_the_last_units_go_to_step_with_the_same_numbers():
    """gradient_as_bucket_view=True, several buckets and units: the units the last bucket
    completes are folded and averaged in step(), the others inside backward; the parameters
    are the optimizer-side path's, bit for bit."""
    results = run_ranks(_views_worker, 2)
    assert_ranks_identical([r[1] for r in results], "hook-path parameters")
    plain, hooked, in_backward, deferred, units = results[0]
    assert in_backward >= 2 and deferred >= 1 and in_backward + deferred == units, \
        (in_backward, deferred, units)
    for a, b in zip(plain, hooked, strict=True):
        assert torch.equal(a, b)


def _lockstep_worker(rank, world, views):
    torch.manual_seed(0)
    # "dead" is never used, on any rank: DDP leaves its p.grad None. Registered first, it is in
    # DDP's last bucket, whose units the hook leaves to step() with bucket views.
    model = nn.ModuleDict({"dead": nn.Linear(16, 4), "body": _mlp(width=48),
                           "extra": nn.Linear(16, 4)})

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x, use_extra):
            out = self.m["body"](x)
            return out + self.m["extra"](x) if use_extra else out

    ddp = DDP(Net(), bucket_cap_mb=0.002, find_unused_parameters=True,
              gradient_as_bucket_view=views)
    opt = OneBitAdam(ddp.parameters(), lr=1e-2, freeze_step=4, weight_decay=0.01)
    state = register_onebit_hook(ddp, opt)
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("onebit_plugin").addHandler(handler)
    stages = []
    for step in range(12):
        opt.zero_grad()
        # Two micro-batches, DDP syncs on the second only; "extra" is unused on rank 1.
        for micro in range(2):
            x, y = _batch(rank, 10 * step + micro)
            ctx = ddp.no_sync() if micro == 0 else torch.enable_grad()
            with ctx:
                loss = nn.functional.cross_entropy(ddp(x, use_extra=rank == 0), y) / 2
                loss.backward()
        opt.step()
        stages.append(opt.stage)
        check_lockstep(ddp.parameters(), opt)
    return ([p.detach() for p in ddp.parameters()], stages, opt.switch_step, state.overlap,
            len(opt.units), opt.bytes_sent, opt.dense_bytes,
            [m for m in said if "changed" in m])


@pytest.mark.parametrize("views", [False, True])
def test_hook_lockstep_with_accumulation_and_unused_parameters(views):
    """Accumulation under no_sync, a parameter unused on one rank and one unused on every rank
    (whose p.grad DDP leaves None: not a change to report)."""
    results = run_ranks(_lockstep_worker, 2, views)
    assert_ranks_identical([r[0] for r in results], "parameters")
    for _, stages, switch, overlap, buckets, sent, dense, said in results:
        assert stages == ["warmup"] * 3 + ["compression"] * 9 and switch == 4
        assert overlap and buckets > 1
        assert sent < dense
        assert said == [], said


def _overlap_worker(rank, world):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # Eight 512x512 layers in ~1 MB buckets: each bucket's compressed allreduce should finish
    # while autograd is still computing the gradients of earlier layers. 1024 rows per batch:
    # backward then takes 125-156 ms alone against 8-18 ms for a bucket's average; with 256
    # rows (40-60 ms) a test file running beside this one under `make test` once stretched the
    # first bucket's average to 94 ms, past the end of backward.
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(8)])
    ddp = DDP(model, bucket_cap_mb=1)
    opt = OneBitAdam(ddp.parameters(), lr=1e-3, freeze_step=2)
    state = register_onebit_hook(ddp, opt, record_timeline=True)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(5):
        opt.zero_grad()
        ddp(torch.randn(1024, 512, generator=gen)).square().mean().backward()
        opt.step()
    return state.timeline


def test_compressed_allreduce_runs_inside_backward():
    last_steps = [timeline[-len(timeline) // 3:]  # the buckets of each rank's final step
                  for timeline in run_ranks(_overlap_worker, 2)]
    assert all(len(last_step) >= 3 for last_step in last_steps)
    # The first bucket's allreduce completed before backward reached the last bucket, on the
    # rank that got there last: a collective completes only once every rank is in it, so a
    # rank descheduled for a while (two test files share two cores under `make test`) holds up
    # the first bucket's average past the other rank's end of backward (in one run of
    # 2026-12-01 it completed 196 ms after rank 0's last bucket, 316 ms after its first).
    # perf_counter is the system's monotonic clock, the same in both processes.
    last_called = max(called for last_step in last_steps for _, called, _ in last_step)
    for last_step in last_steps:
        assert min(done for _, _, done in last_step) < last_called, last_steps


def _async_worker(rank, world):
    import threading
    import time

    from onebit_plugin.core.momentum import MomentumUnit
    from onebit_plugin.entry.ddp_hook import OneBitHookState, onebit_hook

    # Several buckets and units, no bucket views: every unit is averaged inside backward.
    ddp = DDP(_mlp(depth=4), bucket_cap_mb=0.001)
    opt = OneBitAdam(ddp.parameters(), lr=1e-2, freeze_step=1)
    state = OneBitHookState(opt, ddp.process_group, True, False, ddp.bucket_bytes_cap)
    submitted, returned, marked = [], {}, {}

    def spy(state, bucket):
        submitted.clear()
        fut = onebit_hook(state, bucket)
        now = time.perf_counter()
        if not bucket.is_last():  # the last one waits for every unit by design (the drain)
            returned.update((unit, now) for unit in submitted)
        return fut

    ddp.register_comm_hook(state, spy)
    real_submit, real_reduce = MomentumUnit.submit, OneBitAllreduce._reduce
    mark = opt.handoff.mark_averaged

    def submit(self, comm, grads):
        submitted.append(self)
        return real_submit(self, comm, grads)

    def slow(self, *args):
        time.sleep(0.02)  # longer than a hook: an asynchronous average cannot beat its return
        return real_reduce(self, *args)

    def marking(unit, ok):
        marked[unit] = (time.perf_counter(), threading.current_thread() is threading.main_thread())
        mark(unit, ok)

    opt.handoff.mark_averaged = marking
    MomentumUnit.submit, OneBitAllreduce._reduce = submit, slow
    try:
        _step(ddp, opt, rank, 0)  # warm-up
        returned.clear()
        marked.clear()
        x, y = _batch(rank, 1)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        backward_returned = time.perf_counter()
        opt.step()
    finally:
        MomentumUnit.submit, OneBitAllreduce._reduce = real_submit, real_reduce
    return [(marked[u][0] - returned[u], marked[u][1], backward_returned - marked[u][0])
            for u in returned]


def test_a_units_average_completes_after_its_hook_returned_and_before_backward_returns():
    """The hook hands a completed unit to the background thread and returns: its average
    completes after that hook returned (on the comm thread, not backward's), and before
    backward returns (DDP waits on the futures). A communicator that averaged inline, blocking
    backward, fails the first. (The last bucket's hook waits for every unit: left out.)"""
    for timings in run_ranks(_async_worker, 2):
        assert len(timings) >= 3, timings
        for after_return, on_main_thread, before_backward_end in timings:
            assert after_return > 0 and not on_main_thread, timings
            assert before_backward_end > 0, timings


def _drain_worker(rank, world):
    import time

    from onebit_plugin.entry.ddp_hook import OneBitHookState, onebit_hook

    ddp = DDP(_mlp(depth=4), bucket_cap_mb=0.001, find_unused_parameters=True)
    opt = OneBitAdam(ddp.parameters(), lr=1e-2, freeze_step=1)
    state = OneBitHookState(opt, ddp.process_group, True, False, ddp.bucket_bytes_cap)
    last_done = []

    def spy(state, bucket):
        stage = opt.stage
        fut = onebit_hook(state, bucket)
        if bucket.is_last() and stage == "compression":
            last_done.append(fut.done())
        return fut

    ddp.register_comm_hook(state, spy)
    slow_reduce = OneBitAllreduce._reduce

    def slow(self, *args):
        time.sleep(0.05)  # a slow network: without the drain the last hook returns first
        return slow_reduce(self, *args)

    OneBitAllreduce._reduce = slow
    try:
        for step in range(3):
            _step(ddp, opt, rank, step)
    finally:
        OneBitAllreduce._reduce = slow_reduce
    return last_done, opt.stage


def test_the_last_buckets_hook_returns_after_every_unit_is_averaged():
    """DDP issues its own collectives (the used-parameter map under find_unused_parameters)
    right after the last bucket's hook: no compressed collective may still be in flight on
    the other thread then (two NCCL communicators on one GPU from two threads may hang)."""
    for last_done, stage in run_ranks(_drain_worker, 2):
        assert stage == "compression"
        assert last_done == [True, True], last_done  # the two compression-stage backwards


def _idle_drain_worker(rank, world):
    import onebit_plugin.entry.ddp_hook as hook_module

    drains, real = [], hook_module.comm_executor
    hook_module.comm_executor = lambda group: (drains.append(group), real(group))[1]
    counts = {}
    try:
        for views in (True, False):
            ddp = DDP(_mlp(), gradient_as_bucket_view=views)  # one bucket
            opt = OneBitAdam(ddp.parameters(), lr=1e-2, freeze_step=1)
            register_onebit_hook(ddp, opt)
            drains.clear()
            for step in range(4):  # three in the compression stage
                _step(ddp, opt, rank, step)
            counts[views] = len(drains)
    finally:
        hook_module.comm_executor = real
    return counts


def test_the_last_bucket_drains_only_when_a_unit_went_to_the_background():
    """With bucket views the one bucket's units are left to step(): nothing went to the
    background thread, so the last bucket's hook does not hand off to it; without views every
    unit is averaged in backward and drained before DDP's own collectives."""
    for counts in run_ranks(_idle_drain_worker, 2):
        assert counts == {True: 0, False: 3}, counts


def _pickle_worker(rank, world):
    ddp = DDP(_mlp())
    opt = OneBitAdam(ddp.parameters(), lr=1e-2, freeze_step=1)
    state = register_onebit_hook(ddp, opt)
    for step in range(3):
        _step(ddp, opt, rank, step)
    clone = pickle.loads(pickle.dumps(state))
    return (clone.process_group is None and clone.comm_group is None
            and len(clone.optimizer.units) > 0)


def test_hook_state_pickles_without_process_group():
    assert all(run_ranks(_pickle_worker, 2))


def test_register_rejects_wrong_types():
    with pytest.raises(ValueError, match="needs a DistributedDataParallel model"):
        register_onebit_hook(nn.Linear(2, 2), None)


def _hook_resume_worker(rank, world, tmp):
    def make():
        ddp = DDP(_mlp(width=48), bucket_cap_mb=0.002)
        opt = OneBitAdam(ddp.parameters(), lr=1e-2, freeze_step=3)
        register_onebit_hook(ddp, opt)
        return ddp, opt

    ddp, opt = make()
    for step in range(6):
        _step(ddp, opt, rank, step)
    path = f"{tmp}/rank{rank}.pt"
    torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict()}, path)
    for step in range(6, 12):
        _step(ddp, opt, rank, step)
    ckpt = torch.load(path)
    ddp2, opt2 = make()
    ddp2.module.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    for step in range(6, 12):
        _step(ddp2, opt2, rank, step)
    return [p.detach() for p in ddp.parameters()], [p.detach() for p in ddp2.parameters()]


def test_hook_resume_in_compression_stage_is_bitwise(tmp_path):
    """Each rank reloads its own per-bucket error buffers; DDP's buckets of the first resumed
    iteration (before its rebuild) must still get the right ones."""
    results = run_ranks(_hook_resume_worker, 2, str(tmp_path))
    assert_ranks_identical([r[1] for r in results], "resumed parameters")
    for uninterrupted, resumed in results:
        for a, b in zip(uninterrupted, resumed, strict=True):
            assert torch.equal(a, b)


def _unfreeze_worker(rank, world, stage):
    model = _mlp()
    model[0].weight.requires_grad_(False)  # frozen when DDP wraps the model
    ddp = DDP(model)
    opt = OneBitAdam(ddp.parameters(), lr=1e-2, freeze_step=2)
    register_onebit_hook(ddp, opt)
    for step in range(3 if stage == "compression" else 1):
        _step(ddp, opt, rank, step)
    model[0].weight.requires_grad_(True)  # what BackboneFinetuning does (then add_param_group)
    try:
        _step(ddp, opt, rank, 5)
    except ValueError as exc:
        return str(exc), [p.detach() for p in model.parameters()]
    return "no error", None


@pytest.mark.parametrize("stage", ["warmup", "compression"])
def test_a_parameter_unfrozen_after_ddp_wrapped_the_model_is_an_error_on_every_rank(stage):
    results = run_ranks(_unfreeze_worker, 2, stage, timeout=60)
    for message, _ in results:
        assert "not in the DDP model's reducer (frozen when DDP wrapped the model" in message
    assert_ranks_identical([params for _, params in results], "parameters")


def _frozen_at_the_freeze_worker(rank, world, use_ddp, views):
    """A parameter trainable when DDP wrapped the model, frozen before the variance froze:
    trained on into the compression stage, then unfrozen."""
    model = _mlp()
    net = DDP(model, bucket_cap_mb=0.001, find_unused_parameters=True,
              gradient_as_bucket_view=views) if use_ddp else model
    opt = OneBitAdam(net.parameters(), lr=1e-2, freeze_step=3)
    if use_ddp:
        register_onebit_hook(net, opt)
    frozen = model[2].weight
    for step in range(2):
        _step(net, opt, rank, step)
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    for step in range(2, 7):
        _step(net, opt, rank, step)
    assert opt.stage == "compression" and opt.unit_of(frozen) is None
    unchanged = torch.equal(frozen, before)
    frozen.requires_grad_(True)
    try:
        _step(net, opt, rank, 7)
    except ValueError as exc:
        return str(exc), unchanged, [p.detach() for p in model.parameters()]
    return "no error", unchanged, None


@pytest.mark.parametrize("use_ddp,views", [(True, False), (True, True), (False, False)])
def test_a_parameter_frozen_at_the_freeze_is_left_out_and_unfreezing_it_is_an_error(use_ddp,
                                                                                       views):
    """The units hold what was trainable at the freeze: a parameter DDP still reduces but
    frozen then is left out by the hook (it raised a KeyError inside backward), stays as it
    is, and making it trainable again is a ValueError naming it, on every rank."""
    results = run_ranks(_frozen_at_the_freeze_worker, 2, use_ddp, views, timeout=90)
    for message, unchanged, _ in results:
        assert unchanged
        assert "1 trainable parameter(s) (group 0 #2 (32, 32)) are in no momentum unit: not " \
            "trainable when the variance froze after step 3" in message, message
    assert_ranks_identical([params for _, _, params in results], "parameters")


def _unreduced_worker(rank, world, how):
    """Warm-up under the hook, a step whose gradients DDP did not average: a parameter frozen
    with find_unused_parameters=False, or the last backward under no_sync()."""
    model = _mlp()
    ddp = DDP(model, bucket_cap_mb=0.001)
    opt = OneBitAdam(ddp.parameters(), lr=1e-2, freeze_step=10)
    register_onebit_hook(ddp, opt)
    _step(ddp, opt, rank, 0)
    x, y = _batch(rank, 1)
    opt.zero_grad()
    if how == "frozen":
        model[2].weight.requires_grad_(False)
        nn.functional.cross_entropy(ddp(x), y).backward()
    else:
        with ddp.no_sync():
            nn.functional.cross_entropy(ddp(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        opt.step()
    except ValueError as exc:
        return str(exc), all(torch.equal(a, b) for a, b in zip(before, model.parameters(),
                                                                 strict=True)), before
    return "no error", False, [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("how", ["frozen", "no_sync"])
def test_a_warm_up_step_on_gradients_ddp_did_not_average_is_refused(how):
    """Such a step would make the ranks drift apart (DDP's own error comes only at the next
    forward): it is a ValueError on every rank, before any parameter moves."""
    results = run_ranks(_unreduced_worker, 2, how, timeout=90)
    for message, unmoved, _ in results:
        assert "not averaged by DDP in this iteration" in message, message
        assert unmoved
    assert_ranks_identical([params for _, _, params in results], "parameters")
    # DDP reduces its buckets in order: the frozen weight's bucket holds up its bias's and
    # the first layer's (the frozen weight itself has no gradient to step on).
    named = {"frozen": "3 trainable parameter(s) (group 0 #0 (32, 16), group 0 #1 (32,), "
                       "group 0 #3 (32,)) are not averaged",
             "no_sync": "8 trainable parameter(s) (group 0 #0 (32, 16), group 0 #1 (32,), "
                        "group 0 #2 (32, 32) and 5 more) are not averaged"}[how]
    assert named in results[0][0]


def _mismatch_worker(rank, world):
    ddp = DDP(_mlp())
    opt = OneBitAdam(list(ddp.parameters())[2:], lr=1e-2, freeze_step=2)
    try:
        register_onebit_hook(ddp, opt)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_register_rejects_a_model_and_optimizer_with_other_parameters():
    for message in run_ranks(_mismatch_worker, 2):
        assert "2 of the model's are not in OneBitAdam" in message


def _guard_worker(rank, world, setup):
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("onebit_plugin").addHandler(handler)
    model = _mlp()
    if setup in ("ddp-without-hook", "ddp-with-hook"):
        model = DDP(model)
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    if setup == "ddp-with-hook":
        register_onebit_hook(model, opt)
    for step in range(4):
        _step(model, opt, rank, step)
    said = [r.getMessage() for r in records if "identical on all" in r.getMessage()]
    return said, opt.averaged_elsewhere, opt.compression_ratio


@pytest.mark.parametrize("setup", ["ddp-without-hook", "ddp-with-hook", "no-ddp"])
def test_gradients_averaged_before_step_are_said_once_and_no_ratio_is_reported(setup):
    """DDP's own allreduce before OneBitAdam.step() (no hook): said once on every rank, with
    the fixes, and compression_ratio is nan instead of a ratio that did not happen."""
    for said, flagged, ratio in run_ranks(_guard_worker, 2, setup):
        if setup == "ddp-without-hook":
            assert len(said) == 1 and "register_onebit_hook" in said[0], said
            assert "strategy='onebit_adam'" in said[0] and "onebit-run" in said[0]
            assert flagged and ratio != ratio  # nan
        else:
            assert said == [] and not flagged and ratio > 1, (said, ratio)
