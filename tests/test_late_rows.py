"""Rows first seen after the freeze (``onebit_plugin.maths.late_rows``): an embedding row whose
variance was zero at the freeze wakes at its first gradient on any rank, takes Adam's variance
and momentum after that gradient, and trains; the ranks stay alike, the DDP hook and
``step()`` give the same bits, and a resume across wakes is bit for bit."""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from onebit_plugin import OneBitAdam, OneBitLamb, ZeroOneAdam, register_onebit_hook
from onebit_plugin.comm.allreduce import Plan
from onebit_plugin.core.memory import buffer_bytes
from onebit_plugin.wire.compression import ChunkLayout
from tests.dist_helpers import assert_ranks_identical, resume, run_ranks, save_for_resume

ROWS, EARLY, FREEZE = 300, 60, 6
ONLY_RANK1 = ROWS - 1  # drawn by rank 1 alone, after the freeze
NEVER = ROWS - 2  # drawn by nobody


class _Table(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(ROWS, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, ids):
        return self.head(self.emb(ids)).squeeze(1)


def _ids(step: int, rank: int) -> torch.Tensor:
    """Rows below EARLY before step 10, then any row but NEVER (ONLY_RANK1 on rank 1 alone)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, EARLY if step < 10 else NEVER, (16,), generator=gen)
    if step >= 10 and rank == 1 and step % 5 == 0:
        ids[0] = ONLY_RANK1
    return ids


def _loss(net, step, rank):
    ids = _ids(step, rank)
    return ((net(ids) - ids.float() / ROWS) ** 2).mean()


def _members(topology):
    return {"onebit_adam": lambda ps: OneBitAdam(ps, lr=1e-2, freeze_step=FREEZE,
                                                 topology=topology),
            "onebit_lamb": lambda ps: OneBitLamb(ps, lr=1e-2, freeze_step=FREEZE,
                                                 topology=topology),
            # Exact to step 6, phase A to 13 (refreshes at 8, 10, 12), syncs every step to 20,
            # then local steps between syncs every 2 and 4 steps: rows wake in both phases.
            "zero_one_adam": lambda ps: ZeroOneAdam(ps, lr=1e-2, var_update_scaler=FREEZE,
                                                    var_freeze_step=12, local_step_scaler=6,
                                                    local_step_clipper=4, total_steps=30,
                                                    topology=topology)}


def _train(rank, world, member, hook, steps, save=None, load=None, topology="flat"):
    if topology == "hierarchical":
        os.environ["LOCAL_WORLD_SIZE"] = "2"  # 2 hosts of 2 ranks
    torch.manual_seed(0)
    model = _Table()
    start_rows = model.emb.weight.detach().clone()
    net = DDP(model) if hook else model
    opt = _members(topology)[member](net.parameters())
    if hook:
        register_onebit_hook(net, opt)
    begin = resume(load, rank, model, opt)
    after, apart, moved = [], [], torch.zeros(ROWS, dtype=torch.bool)
    for step in range(begin, steps):
        opt.zero_grad()
        _loss(net, step, rank).backward()
        opt.step()
        after.append([p.detach().clone() for p in model.parameters()])
        apart.append(opt.policy.apart(opt))  # 0/1 Adam's local steps since the last sync
        # Moved at some step: 1-bit Adam's sign noise may bring a rare row back to its start.
        moved |= model.emb.weight.detach().ne(start_rows).any(1)
        if save is not None and step + 1 == save[1]:
            save_for_resume(save[0], rank, model, opt, step + 1)
    unit = opt.unit_of(model.emb.weight)
    return {"after": after, "apart": apart, "moved": moved,
            "asleep": 0 if unit.late is None else unit.late.asleep(),
            "topology": opt.topology.describe()}


def _late_and_drawn(steps: int, world: int, last: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows first drawn after the freeze (with ``last``, up to the last step, where the
    Adam members' woken rows take their first step; else before it: 1-bit LAMB's move from
    the next step on), and every row drawn."""
    drawn = torch.zeros(ROWS, dtype=torch.bool)
    for step in range(steps if last else steps - 1):
        for rank in range(world):
            drawn[_ids(step, rank)] = True
    late = drawn.clone()
    late[:EARLY] = False
    for rank in range(world):
        drawn[_ids(steps - 1, rank)] = True
    return late, drawn


def _first_drawn_at_the_last_step(steps: int, world: int) -> torch.Tensor:
    before = torch.zeros(ROWS, dtype=torch.bool)
    for step in range(steps - 1):
        for rank in range(world):
            before[_ids(step, rank)] = True
    at_last = torch.zeros(ROWS, dtype=torch.bool)
    for rank in range(world):
        at_last[_ids(steps - 1, rank)] = True
    return at_last & ~before


@pytest.mark.parametrize("member", ["onebit_adam", "onebit_lamb", "zero_one_adam"])
def test_rows_first_drawn_after_the_freeze_train_alike_on_every_rank_and_path(member):
    steps = 30
    plain = run_ranks(_train, 2, member, False, steps)
    hooked = run_ranks(_train, 2, member, True, steps)
    for step in range(steps):
        if not plain[0]["apart"][step]:  # every step but 0/1 Adam's local steps
            assert_ranks_identical([r["after"][step] for r in plain], f"after step {step + 1}")
        for rank in range(2):
            assert_ranks_identical([plain[rank]["after"][step], hooked[rank]["after"][step]],
                                   f"the hook against step() on rank {rank} after step "
                                   f"{step + 1}")
    assert sum(map(bool, plain[0]["apart"])) == (6 if member == "zero_one_adam" else 0)
    late, drawn = _late_and_drawn(steps, 2, last=member != "onebit_lamb")
    assert int(late.sum()) > 100 and bool(late[ONLY_RANK1])
    assert int(_first_drawn_at_the_last_step(steps, 2).sum()) > 0  # the case is in the run
    moved = plain[0]["moved"]
    assert bool(moved[late].all()), f"{int((~moved[late]).sum())} late rows never moved"
    assert not bool(moved[NEVER])
    assert plain[0]["asleep"] == int((~drawn).sum())  # the undrawn rows sleep on


def test_rows_wake_alike_over_two_levels():
    """topology="hierarchical" (2 hosts of 2 ranks): the woken rows' average and bits cross
    the hosts as the rest does; every rank wakes the same rows."""
    steps = 20
    runs = run_ranks(_train, 4, "onebit_adam", False, steps, None, None, "hierarchical")
    assert runs[0]["topology"] == "hierarchical 2x2"
    for step in range(steps):
        assert_ranks_identical([r["after"][step] for r in runs], f"after step {step + 1}")
    late, _ = _late_and_drawn(steps, 4)
    assert bool(runs[0]["moved"][late].all())


@pytest.mark.parametrize(("member", "cut"), [("onebit_adam", 15), ("zero_one_adam", 23)])
def test_a_resume_across_wakes_is_bit_for_bit(tmp_path, member, cut):
    """0/1 Adam's cut falls between syncs (after the local step 23), rows woken in both
    phases before it and after it."""
    steps = 26
    whole = run_ranks(_train, 2, member, False, steps)
    path = str(tmp_path / "ckpt")
    run_ranks(_train, 2, member, False, cut, (path, cut))
    again = run_ranks(_train, 2, member, False, steps, None, path)
    assert whole[0]["asleep"] == again[0]["asleep"] > 0
    for rank in range(2):
        for a, b in zip(whole[rank]["after"][-1], again[rank]["after"][-1], strict=True):
            assert torch.equal(a, b)


def test_a_woken_row_takes_adams_variance_and_momentum_after_its_first_gradient():
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4)
    user = torch.ones(10, 4, dtype=torch.bool)
    user[7, 0] = False  # the user's mask holds after the row wakes
    opt = OneBitAdam(emb.parameters(), lr=1e-2, freeze_step=3, masks={emb.weight: user})
    b1, b2 = 0.9, 0.999
    for step in range(5):
        opt.zero_grad()
        ids = torch.tensor([0, 1, 2]) if step < 4 else torch.tensor([0, 7])
        emb(ids).pow(2).sum().backward()
        g7, w7 = emb.weight.grad[7].clone(), emb.weight[7].detach().clone()
        opt.step()
    unit = opt.unit_of(emb.weight)
    t = 5.0
    root = g7.abs() * math.sqrt((1 - b2) / (1 - b2**t))
    assert torch.allclose(unit.view(emb.weight, unit.denom)[7], root + 1e-8, rtol=1e-6)
    # Its first step at its wake, Adam's own: -lr * m_hat / denom (0.55 lr here, inside the
    # bound), where the user's mask keeps coordinate 0 still.
    first = 1e-2 * (1 - b1) * g7 / (1 - b1**t) / (root + 1e-8)
    first[0] = 0.0
    assert torch.allclose(emb.weight[7].detach(), w7 - first, rtol=1e-5, atol=1e-7)
    assert 0.5e-2 < float(first[1:].abs().min()) and float(first.abs().max()) < 1e-2
    momentum = opt.state[emb.weight]["exp_avg"][7]
    assert torch.allclose(momentum[1:], (1 - b1) * g7[1:], rtol=1e-6) and momentum[0] == 0
    assert unit.view(emb.weight, unit.masked)[7].tolist() == [True, False, False, False]
    assert bool(unit.view(emb.weight, unit.masked)[8].all())  # never drawn: still asleep
    assert unit.late.asleep() == 6  # rows 3-6, 8, 9
    assert buffer_bytes(opt)["late rows"] == 8 * 6  # their indices
    moved = emb.weight[7].detach().clone()
    opt.zero_grad()
    emb(torch.tensor([0])).pow(2).sum().backward()
    opt.step()
    assert not torch.equal(emb.weight[7], moved)  # its momentum moves it at the next step


def test_coordinates_joining_leave_the_plan_as_a_rebuild_from_the_new_mask_would():
    keep = torch.rand(1000, generator=torch.Generator().manual_seed(0)) > 0.7
    join = (~keep).nonzero().reshape(-1)[::3]
    for rank in range(2):
        layout = ChunkLayout.create(1000, 2, 64)
        plan = Plan(layout, keep, "cpu", rank, True)
        made = plan.mask.dropped, plan.chunk_mask.dropped  # the CPU passes' index lists
        assert all(d.numel() for d in made)
        plan.unmask_(join)
        after = keep.clone()
        after[join] = True
        rebuilt = Plan(layout, after, "cpu", rank, True)
        for mine, theirs in ((plan.mask, rebuilt.mask), (plan.chunk_mask, rebuilt.chunk_mask)):
            assert torch.equal(mine.keep, theirs.keep)
            assert torch.equal(mine.counts, theirs.counts)
            assert torch.equal(mine.dropped, theirs.dropped)


def test_zero_one_adams_rows_wake_between_its_variance_averages():
    """0/1 Adam (its default ``local_variance``) remakes the mask at every variance average;
    a row first drawn between averages (here in phase B, before its first average at step
    128) wakes at its first gradient, as under 1-bit Adam, and its local steps move it."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4)
    opt = ZeroOneAdam(emb.parameters(), lr=1e-2, var_update_scaler=2, var_freeze_step=4,
                      local_step_scaler=1, local_step_clipper=2, total_steps=20)
    b1, b2 = 0.9, 0.999
    for step in range(11):
        opt.zero_grad()
        emb(torch.tensor([0, 1]) if step < 10 else torch.tensor([0, 7])).pow(2).sum().backward()
        g7 = emb.weight.grad[7].clone()
        opt.step()
    assert opt.policy.schedule(20).phase(11) == "B"
    unit = opt.unit_of(emb.weight)
    root = g7.abs() * math.sqrt((1 - b2) / (1 - b2**11))
    assert torch.allclose(unit.view(emb.weight, unit.denom)[7], root + 1e-8, rtol=1e-6)
    assert torch.allclose(opt.state[emb.weight]["exp_avg"][7], (1 - b1) * g7, rtol=1e-6)
    assert not bool(unit.view(emb.weight, unit.masked)[7].any())
    assert unit.late.asleep() == 7  # rows 2-6, 8, 9
    moved = emb.weight[7].detach().clone()
    opt.zero_grad()
    emb(torch.tensor([0])).pow(2).sum().backward()
    opt.step()
    assert not torch.equal(emb.weight[7], moved)


@pytest.mark.parametrize("member", ["paper_zero_one", "refreshing_onebit"])
def test_members_that_refresh_from_exact_averages_wake_rows_at_their_refreshes_instead(member):
    """Their variance moves at a refresh alone, by the exactly averaged gradient: a row woken
    between refreshes would hold no variance at the next, which would mask it again."""
    emb = nn.Embedding(10, 4)
    opt = (ZeroOneAdam(emb.parameters(), lr=1e-2, var_freeze_step=4, total_steps=20,
                       local_variance=False) if member == "paper_zero_one" else
           OneBitAdam(emb.parameters(), lr=1e-2, freeze_step=3, refresh_interval=4))
    for _ in range(6):
        opt.zero_grad()
        emb(torch.tensor([0, 1])).pow(2).sum().backward()
        opt.step()
    assert all(u.late is None for u in opt.units) and opt.layout.mask_floor is None
