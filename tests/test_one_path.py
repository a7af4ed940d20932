"""One momentum path: the optimizer without DDP and the DDP hook run the same momentum units, so
they agree bit for bit; ``compress_momentum=False`` is an exact fp32 momentum allreduce on every
path; saved errors never survive on coordinates masked when they are loaded."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from onebit_plugin import (
    OneBitAdam,
    adam_update_,
    fold_gradient_,
    frozen_denominator,
    frozen_update_,
)
from onebit_plugin.entry.ddp_hook import register_onebit_hook
from onebit_plugin.wire.dispatch import cpu_kernel
from tests.dist_helpers import assert_ranks_identical, run_ranks

FREEZE, STEPS, LR, CAP_MB = 3, 10, 1e-2, 0.004  # 0.004 MB: about 1,000 fp32 values per unit


class Uneven(nn.Module):
    """Parameters of very different sizes (50 to 1,200 values), one used only on some steps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 24)
        self.proj = nn.Linear(24, 40)
        self.norm = nn.LayerNorm(40)
        self.head = nn.Linear(40, 7)

    def forward(self, tokens):
        return self.head(self.norm(torch.tanh(self.proj(self.emb(tokens)))).mean(1))


def _batch(rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 30, (6, 5), generator=gen), torch.randint(0, 7, (6,), generator=gen)


def _train(model, opt, rank, steps=STEPS):
    for step in range(steps):
        tokens, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(tokens), y).backward()
        opt.step()


def _path(rank, path, compress):
    net = Uneven()
    model = net if path == "plain" else DDP(net, bucket_cap_mb=CAP_MB)
    # The plain path is told the unit size; the hook takes DDP's bucket size.
    cap = CAP_MB if path in ("plain", "no-overlap") else None
    # With compression the paths are compared with each other, follow_variance on (its
    # sketches over several units); without, with the paper's frozen algorithm written out.
    opt = OneBitAdam(net.parameters(), lr=LR, freeze_step=FREEZE, weight_decay=0.01,
                     compress_momentum=compress, bucket_cap_mb=cap, follow_variance=compress)
    if path != "plain":
        register_onebit_hook(model, opt, overlap=path == "overlap")
    _train(model, opt, rank)
    return {"params": [p.detach().clone() for p in net.parameters()],
            "units": [len(u.params) for u in opt.units],
            "errors": [{k: v.clone() for k, v in u.errors.items()} for u in opt.units],
            "stage": opt.stage}


def _exact_reference(rank):
    """Frozen-variance Adam with an fp32 momentum allreduce, from the public update functions."""
    net = Uneven()
    params = list(net.parameters())
    state = {p: (torch.zeros_like(p), torch.zeros_like(p)) for p in params}
    world = dist.get_world_size()
    for step in range(1, STEPS + 1):
        tokens, y = _batch(rank, step - 1)
        net.zero_grad()
        nn.functional.cross_entropy(net(tokens), y).backward()
        for p in params:
            m, v = state[p]
            grad = p.grad.clone()
            if step <= FREEZE:
                dist.all_reduce(grad)
                grad.div_(world)
                adam_update_([p.data], [grad], [m], [v], [step], lr=LR, beta1=0.9, beta2=0.999,
                             eps=1e-8, weight_decay=0.01, decoupled=False)
                continue
            local = torch.empty_like(m)
            fold_gradient_(m, grad, p.data, beta1=0.9, weight_decay=0.01, decoupled=False,
                           out=local)
            dist.all_reduce(local)
            local.div_(world).masked_fill_(v == 0, 0.0)  # never-seen coordinates stay masked
            m.copy_(local)
            denom = frozen_denominator(v, FREEZE, beta2=0.999, eps=1e-8)
            frozen_update_([p.data], [m], [denom], [step], lr=LR, beta1=0.9,
                           weight_decay=0.01, decoupled=False, bound=1.0)
    return [p.detach().clone() for p in params]


def _all_paths_worker(rank, world, compress):
    results = {path: _path(rank, path, compress) for path in ("plain", "overlap", "no-overlap")}
    results["exact"] = _exact_reference(rank)
    return results


def test_plain_and_hook_paths_are_bitwise_equal_over_several_units():
    per_rank = run_ranks(_all_paths_worker, 2, True)
    assert_ranks_identical([r["overlap"]["params"] for r in per_rank], "hook parameters")
    for r in per_rank:
        plain, overlap, no_overlap = r["plain"], r["overlap"], r["no-overlap"]
        assert plain["stage"] == "compression"
        assert len(plain["units"]) >= 3 and plain["units"] == overlap["units"], plain["units"]
        for other in (overlap, no_overlap):
            for a, b in zip(plain["params"], other["params"], strict=True):
                assert torch.equal(a, b)
            for ea, eb in zip(plain["errors"], other["errors"], strict=True):
                assert ea.keys() == {"worker", "server"}
                assert all(torch.equal(ea[k], eb[k]) for k in ea)
        # The 1-bit exchange is really on: it does not reproduce the exact allreduce.
        assert not all(torch.equal(a, b) for a, b in zip(plain["params"], r["exact"],
                                                          strict=True))


def test_compress_momentum_false_is_the_exact_allreduce_on_every_path():
    for r in run_ranks(_all_paths_worker, 2, False):
        for path in ("plain", "overlap", "no-overlap"):
            assert r[path]["stage"] == "compression" and r[path]["errors"][0] == {}
            for a, b in zip(r[path]["params"], r["exact"], strict=True):
                assert torch.equal(a, b), path


def _mask_worker(rank, world, tmp):
    net = Uneven()
    model = DDP(net, bucket_cap_mb=CAP_MB)
    opt = OneBitAdam(net.parameters(), lr=LR, freeze_step=FREEZE)
    register_onebit_hook(model, opt)
    _train(model, opt, rank)
    saved = opt.state_dict()
    assert any(e["worker"].abs().sum() > 0 for e in saved["onebit"]["units"] if e)
    # Resume with every other coordinate of every parameter masked.
    net2 = Uneven()
    net2.load_state_dict(net.state_dict())
    masks = {p: (torch.arange(p.numel()) % 2 == 0).view_as(p) for p in net2.parameters()}
    opt2 = OneBitAdam(net2.parameters(), lr=LR, freeze_step=FREEZE, masks=masks)
    model2 = DDP(net2, bucket_cap_mb=CAP_MB)
    register_onebit_hook(model2, opt2)
    opt2.load_state_dict(saved)
    leaks = []
    for steps in (0, 5):
        _train(model2, opt2, rank, steps)
        for unit in opt2.units:
            keep = torch.zeros_like(unit.errors["worker"], dtype=torch.bool)
            for p in unit.params:
                start = unit.offsets[p]
                keep[start : start + p.numel()] = masks[p].reshape(-1)
            chunk = unit.errors["server"].numel()
            own = keep[rank * chunk : (rank + 1) * chunk]
            leaks.append(unit.errors["worker"][~keep].abs().max().item())
            leaks.append(unit.errors["server"][~own].abs().max().item())
            leaks.append(unit.momentum[~keep[: unit.momentum.numel()]].abs().max().item())
    return leaks, [p.detach() for p in net2.parameters()]


def test_loading_under_a_changed_mask_clears_masked_errors(tmp_path):
    results = run_ranks(_mask_worker, 2, str(tmp_path))
    assert_ranks_identical([r[1] for r in results], "parameters")
    for leaks, _ in results:
        assert leaks and all(x == 0.0 for x in leaks), leaks


def _resume_check_worker(rank, world, fresh):
    model = nn.Linear(4, 2)
    opt = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=2 if fresh else 10)
    _loss = lambda: model(torch.randn(3, 4)).sum()  # noqa: E731
    saved = {}
    for step in range(1, 5):
        opt.zero_grad()
        _loss().backward()
        opt.step()
        saved[step] = opt.state_dict()
    if fresh:  # a new optimizer whose settings differ between the ranks
        opt = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=2,
                         max_block=2048 if rank == 0 else 1024)
        opt.load_state_dict(saved[3])
    else:  # the same optimizer, each rank loading another step's state
        opt.load_state_dict(saved[4 if rank == 0 else 2])
    opt.zero_grad()
    _loss().backward()
    try:
        opt.step()
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("fresh", [True, False], ids=["new-optimizer", "same-optimizer"])
def test_settings_are_checked_again_on_the_first_step_after_a_resume(fresh):
    """Also when the state is loaded into the optimizer that already checked its first step:
    ranks that resumed from different checkpoints are told so, not left to train apart."""
    said = ("max_block differs between ranks: [2048, 1024]" if fresh
            else "global_step differs between ranks: [5, 3]")
    for message in run_ranks(_resume_check_worker, 2, fresh):
        assert said in message, message


def _round_trip_worker(rank, world, compress):
    net = Uneven()
    opt = OneBitAdam(net.parameters(), lr=LR, freeze_step=2, compress_momentum=compress,
                     bucket_cap_mb=CAP_MB)
    _train(net, opt, rank, 4)
    clone = OneBitAdam(net.parameters(), lr=LR, freeze_step=2, compress_momentum=compress,
                       bucket_cap_mb=CAP_MB)
    clone.load_state_dict(opt.state_dict())
    clone.prepare_stage()
    return [(len(a.params), len(b.params), torch.equal(a.momentum, b.momentum),
             {k: e.clone() for k, e in a.errors.items()},
             {k: e.clone() for k, e in b.errors.items()})
            for a, b in zip(opt.units, clone.units, strict=True)]


@pytest.mark.parametrize("compress", [True, False])
def test_units_survive_a_state_dict_round_trip(compress):
    """Two ranks (one process always averages exactly): the loaded units hold the saved
    momenta and this rank's worker and server errors (nonzero with the 1-bit exchange; none
    with the exact one)."""
    for units in run_ranks(_round_trip_worker, 2, compress):
        assert len(units) >= 3
        for saved_params, loaded_params, same_momentum, saved, loaded in units:
            assert saved_params == loaded_params and same_momentum
            assert sorted(saved) == sorted(loaded) == (["server", "worker"] if compress else [])
            for name in saved:
                assert saved[name].abs().sum() > 0 and torch.equal(saved[name], loaded[name])


def test_loading_with_another_freeze_step_says_what_happens(caplog):
    net = Uneven()
    opt = OneBitAdam(net.parameters(), lr=LR, freeze_step=2)
    _train(net, opt, 0, 3)
    for freeze, said in ((5, "it is ignored, the variance was frozen after step 2"),):
        other = OneBitAdam(net.parameters(), lr=LR, freeze_step=freeze)
        with caplog.at_level("WARNING", logger="onebit_plugin"):
            other.load_state_dict(opt.state_dict())
        assert f"checkpoint has freeze_step=2, this optimizer {freeze}: {said}" in caplog.text
        assert other.stage == "compression"


def _memory_worker(rank, world, compress):
    net = Uneven()
    opt = OneBitAdam(net.parameters(), lr=LR, freeze_step=FREEZE, bucket_cap_mb=CAP_MB,
                     compress_momentum=compress)
    tokens, y = _batch(rank, 0)
    nn.functional.cross_entropy(net(tokens), y).backward()
    net.proj.bias.grad = None  # on no rank: its state starts at the next step, on its own
    opt.step()
    first = {p for p in net.parameters() if opt.state[p]}
    _train(net, opt, rank, steps=FREEZE - 1)
    assert opt.stage == "compression" and opt.layout is None
    where = {p: opt.state[p]["exp_avg"].data_ptr() for p in net.parameters()}
    spare = opt.policy.warmup.flat
    start, end = spare.data_ptr(), spare.data_ptr() + 4 * spare.numel()
    _train(net, opt, rank, steps=1)
    # The fold buffer where the step made one (read before asking unit.local, which makes one).
    return [(set(unit.params) <= first, unit.momentum.data_ptr() == where[unit.params[0]],
             None if unit._local is None else start <= unit._local.data_ptr() < end)
            for unit in opt.units]


@pytest.mark.parametrize("compress", [True, False])
def test_the_freeze_takes_warmups_momenta_and_gradient_buffer_as_they_lie(compress):
    """The momenta of the parameters that start together lie back to back in the units' order
    from the first step, and become the units' momentum where they lie. Without DDP, where the
    average is written into fold buffers (here the exact momentum average), they are cut from
    warm-up's gradient buffer; the CPU kernel's 1-bit path writes none, and none is kept (the
    other tests check the numbers)."""
    assert cpu_kernel() is not None  # the 1-bit path under test
    for units in run_ranks(_memory_worker, 2, compress):
        assert len(units) >= 3 and any(not together for together, _, _ in units)
        for together, adopted, spare in units:
            assert adopted == together
            assert spare is (None if compress else True)
