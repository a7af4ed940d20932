"""0/1 Adam's ``sparse_rows``: the freeze reads which tensors' gradients are sparse in rows
(``onebit_plugin.maths.sparse_rows``); each gets momentum units of its own that send every
rank's ``m / denom`` clamped at +-3.16 (Adam's own largest step on one gradient, ``(1 - b1) /
sqrt(1 - b2)``), in phase A and at the syncs, for the same bytes; the ranks
stay alike, the DDP hook and ``step()`` give the same bits, a resume is bit for bit, and a
resume with the other setting is said."""

from __future__ import annotations

import functools
import logging
import math

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from onebit_plugin import ZeroOneAdam, register_onebit_hook
from onebit_plugin.maths.sparse_rows import ROW_SPARSE_SHARE, SHARE, row_counts, shares
from onebit_plugin.settings.config import settings_from_env
from tests.dist_helpers import counting_collectives, resume, run_ranks, save_for_resume

ROWS = 2000


def test_a_tensors_share_counts_its_zero_rows_among_the_rows_its_variance_has_seen():
    variance = torch.zeros(6, 3)
    variance[:4] = 1.0  # rows 4 and 5 never had a gradient: not counted
    grad = torch.zeros(6, 3)
    grad[0, 2] = 0.5  # row 0 moves; rows 1-3 are zero
    assert row_counts(grad, variance).tolist() == [3.0, 4.0]
    assert row_counts(None, variance).tolist() == [0.0, 4.0]  # no gradient tells nothing
    grad[1:4] = math.nan  # a skipped step's gradient reads as dense
    assert row_counts(grad, variance).tolist() == [0.0, 4.0]
    assert row_counts(torch.zeros(0, 3), torch.zeros(0, 3)).tolist() == [0.0, 0.0]
    doubled = []
    assert shares([torch.tensor([3.0, 4.0]), torch.tensor([0.0, 0.0])],
                  lambda t: doubled.append(1) or t * 2) == [0.75, 0.0]
    assert doubled == [1]  # one sum over the host for all tensors


class _Bag(nn.Module):
    """Bags of word ids (sparse rows) into a dense classifier."""

    def __init__(self):
        super().__init__()
        self.words = nn.EmbeddingBag(ROWS, 8, mode="mean")
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, ids):
        return self.body(self.words(ids))


def _loss(model, rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, ROWS, (16, 6), generator=gen)
    return nn.functional.cross_entropy(model(ids), ids[:, 0] % 4)


# (1 - b1) / sqrt(1 - b2) at the default betas: the rows' clamp.
ADAM_STEP = (1 - 0.9) / (1 - 0.999) ** 0.5


def _optimizer(model, steps, **kw):
    return ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=12, var_update_scaler=4,
                       local_step_scaler=1, local_step_clipper=4, total_steps=steps, **kw)


def _wire_run(rank, world, sparse):
    """The shares, the units, and what the embedding's unit handed to the communicator: at a
    phase-A 1-bit step against ``fold / denom`` clamped at +-ADAM_STEP computed beside it,
    and at phase B's first sync."""
    torch.manual_seed(0)
    model = _Bag()
    opt = _optimizer(model, 40, sparse_rows=sparse)
    emb = model.words.weight
    handed, expected, now = {}, None, {}
    for step in range(24):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        now["kind"] = opt.coming_exchange  # read by the wrapper below, as the step runs
        if step == 10:
            assert now["kind"] == "momentum"
            opt.prepare_stage()  # where the step would: its units, its communicator
            unit = opt.unit_of(emb)
            b1 = opt.param_groups[0]["betas"][0]
            fold = torch.lerp(opt.state[emb]["exp_avg"], emb.grad, 1 - b1)  # the package's
            expected = (fold / unit.view(emb, unit.denom)).clamp(-ADAM_STEP, ADAM_STEP)
            comm, real = opt.communicator, opt.communicator.reduce_

            def reduce_(x, plan, errors, decode=True, unit=unit, real=real):
                if plan is unit.plan and now["kind"] not in handed:
                    handed[now["kind"]] = (x[: emb.numel()].view_as(emb).clone()
                                           if torch.is_tensor(x) else None)
                return real(x, plan, errors, decode=decode)
            comm.reduce_ = reduce_
        opt.step()
    comm.reduce_ = real
    return ({n: opt.state[p].get(SHARE) for n, p in model.named_parameters()},
            [(u.momentum.numel(), u.send_bound) for u in opt.units], handed,
            expected), opt.switch_message()


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse-rows", "paper-wire"])
def test_the_freeze_gives_a_row_sparse_tensor_a_unit_that_sends_m_over_denom(sparse):
    ((read, units, handed, expected), said), _ = run_ranks(_wire_run, 2, sparse)
    dense = 8 * 16 + 16 + 16 * 4 + 4
    assert set(handed) == {"momentum", "refresh", "sync"}
    if not sparse:
        assert all(v is None for v in read.values())
        assert units == [(dense + ROWS * 8, None)]
        assert handed["momentum"] is handed["refresh"] is None  # the fold itself, sent as m
        assert handed["sync"].abs().max() < 0.1  # what moved, as a momentum
        return
    # The switch line names the rows' clamp as it is.
    assert "as m / denom clamped at Adam's own largest step, +-3.16: sparse_rows" in said, said
    assert read["words.weight"] >= ROW_SPARSE_SHARE  # 2 x 96 ids a step over 2,000 rows
    assert read["body.0.weight"] == read["body.2.weight"] == 0.0
    assert read["body.0.bias"] is None  # one dimension: no rows
    # Reverse order, the dense layers first; the embedding alone, its wire bounded at 3.16.
    assert units == [(dense, None), (ROWS * 8, pytest.approx(ADAM_STEP, rel=1e-12))]
    assert torch.equal(handed["momentum"], expected)
    # The clamp bites, in phase A (its refreshes too) and at the syncs: a rare row's m
    # outgrows its denom.
    assert all(handed[k].abs().max() == pytest.approx(ADAM_STEP, rel=1e-6)
               for k in ("momentum", "refresh", "sync"))


def _run(rank, world, steps, *, ddp=False, sparse=True, save_at=None, ckpt=None, load=None,
         **kw):
    """Per step: its word, the bytes this rank handed to others (counted at torch's
    collectives), the parameters and momenta after it."""
    torch.manual_seed(0)
    model = _Bag()
    net = DDP(model, bucket_cap_mb=0.001) if ddp else model
    opt = _optimizer(model, steps, sparse_rows=sparse, **kw)
    if ddp:
        register_onebit_hook(net, opt)
    start = resume(load, rank, model, opt)
    sent = [0]
    real = counting_collectives(world, sent)
    trace = []
    try:
        for step in range(start, steps):
            kind, before = opt.coming_exchange, sent[0]
            opt.zero_grad()
            _loss(net, rank, step).backward()
            opt.step()
            trace.append((kind, sent[0] - before, [p.detach().clone() for p in model.parameters()]
                          + [opt.state[p]["exp_avg"].clone() for p in model.parameters()]))
            if save_at is not None and step + 1 == save_at:
                save_for_resume(ckpt, rank, model, opt, step + 1)
    finally:
        torch.distributed.all_to_all_single, torch.distributed.all_reduce = real
    return trace


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_ranks_stay_alike_the_hook_gives_steps_bits_and_the_wire_costs_the_same_bytes():
    a, b = run_ranks(_run, 2, 40)
    kinds = [k for k, _, _ in a]
    assert {"exact", "refresh", "momentum", "local", "sync"} <= set(kinds)
    for (kind, _, ta), (_, _, tb) in zip(a, b, strict=True):
        assert _same(ta, tb) == (kind != "local"), kind  # apart only between syncs
    hooked = run_ranks(functools.partial(_run, ddp=True), 2, 40)
    for by_step, by_hook in zip((a, b), hooked, strict=True):
        for (ks, _, ts), (kh, _, th) in zip(by_step, by_hook, strict=True):
            assert ks == kh and _same(ts, th), ks
    # The paper's wire over the same cut (the embedding alone, 64,000 bytes over a 10 KiB cap).
    paper = run_ranks(functools.partial(_run, sparse=False, bucket_cap_mb=0.01), 2, 40)[0]
    assert [(k, n) for k, n, _ in a] == [(k, n) for k, n, _ in paper]
    assert not _same(a[-1][2], paper[-1][2])  # another wire, other numbers


# Phase A between refreshes (10), phase B between syncs (22).
@pytest.mark.parametrize("save_at", [10, 22])
def test_resume_is_bitwise(tmp_path, save_at):
    steps = 40
    whole = run_ranks(functools.partial(_run, save_at=save_at, ckpt=str(tmp_path / "c")), 2,
                      steps)
    again = run_ranks(functools.partial(_run, load=str(tmp_path / "c")), 2, steps)
    for w, r in zip(whole, again, strict=True):
        assert len(r) == steps - save_at
        for (kw, _, tw), (kr, _, tr) in zip(w[save_at:], r, strict=True):
            assert kw == kr and _same(tw, tr), kw


def _other_setting(rank, world, path, saved_with, save_at):
    torch.manual_seed(0)
    model = _Bag()
    opt = _optimizer(model, 40, sparse_rows=saved_with)
    for step in range(save_at):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        opt.step()
    assert opt.between_syncs == (save_at == 22)
    save_for_resume(path, rank, model, opt, save_at)
    model = _Bag()
    opt = _optimizer(model, 40, sparse_rows=not saved_with)
    handler = _Capture()
    logging.getLogger("onebit_plugin").addHandler(handler)
    try:
        resume(path, rank, model, opt)
        opt.prepare_stage()  # the sync point it resumed from, in its layout
        local = opt.layout.local
        point = None if local is None else torch.cat([local.anchor[u] for u in opt.units])
        for step in range(save_at, 40):
            opt.zero_grad()
            _loss(model, rank, step).backward()
            opt.step()
    finally:
        logging.getLogger("onebit_plugin").removeHandler(handler)
    return (handler.text, [u.send_bound for u in opt.units],
            [p.detach().clone() for p in model.parameters()],
            [SHARE in s for s in opt.state_dict()["state"].values()], point,
            torch.load(f"{path}.{rank}", weights_only=True)["opt"]["onebit"]["local_steps"])


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.text = ""

    def emit(self, record):
        self.text += record.getMessage() + "\n"


# In phase A (10) and in phase B between syncs (22), whose sync points are cut otherwise too.
@pytest.mark.parametrize("save_at", [10, 22])
@pytest.mark.parametrize("saved_with", [True, False])
def test_resuming_with_the_other_setting_is_said_once_and_goes_on(tmp_path, saved_with, save_at):
    """Saved with it, resumed without: the embedding's unit is cut into the others, its
    errors are not loaded, the reads dropped. Saved without, resumed with: the freeze is past,
    every tensor goes on sending m. Said once (rank 0), and the ranks end on one point."""
    ranks = run_ranks(_other_setting, 2, str(tmp_path / "c"), saved_with, save_at)
    said = ("this checkpoint sends 1 tensor(s) whose gradients are sparse in rows"
            if saved_with else "sparse_rows=True on a state saved without it")
    assert ranks[0][0].count(said) == 1 and said not in ranks[1][0]
    assert ranks[0][1] == [None]  # one unit, sent as m, either way
    assert _same(ranks[0][2], ranks[1][2])  # the last step syncs
    assert all(torch.isfinite(p).all() for p in ranks[0][2])
    assert not any(ranks[0][3])  # the next checkpoint holds no stale reads
    for rank in ranks:  # between syncs: the saved sync point, cut into this run's units
        point, saved = rank[4], rank[5]
        assert (point is None) == (saved is None) == (save_at == 10)
        if saved is not None:
            assert len(saved["anchors"]) == (2 if saved_with else 1)
            assert torch.equal(point, torch.cat(saved["anchors"]))


def test_bad_values_are_refused_and_the_setting_is_read_from_the_environment(monkeypatch):
    with pytest.raises(TypeError, match="sparse_rows must be True or False"):
        ZeroOneAdam(_Bag().parameters(), total_steps=10, sparse_rows=1)
    monkeypatch.setenv("ONEBIT_ADAM", "1")
    monkeypatch.setenv("ONEBIT_OPTIMIZER", "zero_one_adam")
    assert settings_from_env().member_options(100)["sparse_rows"] is True
    monkeypatch.setenv("ONEBIT_SPARSE_ROWS", "0")
    assert settings_from_env().member_options(100)["sparse_rows"] is False
    monkeypatch.setenv("ONEBIT_SPARSE_ROWS", " ")  # empty, as a template leaves it: the default
    assert settings_from_env().member_options(100)["sparse_rows"] is True
    monkeypatch.setenv("ONEBIT_SPARSE_ROWS", "maybe")
    with pytest.raises(ValueError, match="ONEBIT_SPARSE_ROWS must be 1 or 0"):
        settings_from_env()
    monkeypatch.setenv("ONEBIT_OPTIMIZER", "onebit_adam")
    monkeypatch.setenv("ONEBIT_FREEZE_STEP", "10")
    with pytest.raises(ValueError, match="ONEBIT_SPARSE_ROWS is 0/1 Adam's, and the optimizer "
                                         "is onebit_adam: unset it"):
        settings_from_env()
    monkeypatch.setenv("ONEBIT_SPARSE_ROWS", "")  # empty: not set
    assert settings_from_env().optimizer == "onebit_adam"


def test_a_deepspeed_config_sets_it_and_another_member_is_told_whose_it_is():
    from onebit_plugin.entry.deepspeed_config import from_deepspeed_config

    def config(kind, **params):
        return {"optimizer": {"type": kind, "params": {"lr": 1e-3, **params}}}
    schedule = dict(var_freeze_step=10, local_step_scaler=5)
    opt = from_deepspeed_config(_Bag().parameters(), config("ZeroOneAdam", **schedule))
    assert opt.policy.sparse_rows_bound == 1.0
    opt = from_deepspeed_config(_Bag().parameters(),
                                config("ZeroOneAdam", sparse_rows=False, **schedule))
    assert opt.policy.sparse_rows_bound is None
    with pytest.raises(ValueError, match="sparse_rows is a parameter of ZeroOneAdam only"):
        from_deepspeed_config(_Bag().parameters(),
                              config("OneBitAdam", sparse_rows=False, freeze_step=10))


def _one_process(sparse, steps=30):
    torch.manual_seed(0)
    model = _Bag()
    opt = _optimizer(model, 40, sparse_rows=sparse)
    for step in range(steps):
        opt.zero_grad()
        _loss(model, 0, step).backward()
        opt.step()
    return opt, [p.detach().clone() for p in model.parameters()]


def test_one_process_compresses_nothing_and_so_sends_no_tensor_apart():
    """In one process the exchange is exact: ``sparse_rows`` clamps nothing there (the same
    bits as without it), though the freeze still reads the shares (for a resume on more)."""
    opt, params = _one_process(True)
    assert opt.state[opt.param_groups[0]["params"][0]][SHARE] >= ROW_SPARSE_SHARE
    assert [u.send_bound for u in opt.units] == [None]
    assert _same(params, _one_process(False)[1])


def _small_table(rank, world, sparse_everywhere):
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(40, 4, mode="mean"), nn.Linear(4, 4))  # 160 values
    sparse = sparse_everywhere or rank == 0
    opt = _optimizer(model, 20, sparse_rows=sparse)
    for step in range(14):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        ids = torch.randint(0, 40, (2, 2), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(ids), ids[:, 0] % 4).backward()
        opt.step()
    return opt.state[model[0].weight][SHARE], [u.send_bound for u in opt.units]


def test_a_table_too_small_for_a_unit_of_its_own_stays_with_its_neighbours():
    """A row-sparse tensor of fewer than 256 values (an FSDP2 shard too, or an empty one)
    keeps sending m in its neighbours' unit: a unit of two levels needs a value per rank of
    a host."""
    for share, bounds in run_ranks(_small_table, 2, True):
        assert share >= ROW_SPARSE_SHARE and bounds == [None]


def test_ranks_that_disagree_on_sparse_rows_are_refused_at_the_first_step():
    with pytest.raises(RuntimeError, match="sparse_rows differs between ranks: \\[1, 0\\]"):
        run_ranks(_small_table, 2, False)
