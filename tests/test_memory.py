"""What the family holds beside Adam's state (issue 30, docs/memory.md): the frozen denominator
in the variance's own memory, no fold buffer on the CPU kernel's paths, 0/1 Adam's variance
dropped in phase B; ``buffer_bytes`` says so."""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from onebit_plugin import OneBitAdam, ZeroOneAdam, register_onebit_hook
from onebit_plugin.core.memory import buffer_bytes
from onebit_plugin.core.variance_follow import BLOCK, WIDTH
from onebit_plugin.wire.dispatch import cpu_kernel
from tests.dist_helpers import run_ranks


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 8))


def _step(net, opt, rank, step):
    gen = torch.Generator().manual_seed(100 * step + rank)
    opt.zero_grad()
    nn.functional.cross_entropy(net(torch.randn(16, 32, generator=gen)),
                                torch.randint(0, 8, (16,), generator=gen)).backward()
    opt.step()


def test_the_frozen_denominator_takes_the_variances_memory():
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    for step in range(2):
        _step(model, opt, 0, step)
    variances = {p: opt.state[p]["exp_avg_sq"].data_ptr() for p in model.parameters()}
    _step(model, opt, 0, 2)  # builds the compression stage
    numel = sum(p.numel() for p in model.parameters())
    for p in model.parameters():
        assert "exp_avg_sq" not in opt.state[p]
        assert opt.state[p]["frozen_denominator"].data_ptr() == variances[p]
    held = buffer_bytes(opt)
    # One process averages exactly: the fold is a tensor there, and no errors, no wire.
    # follow_variance: three fp32 numbers per block of a tensor of several blocks (a single
    # one's are not counted, as no 1-value tensor is), and a sketching step's row signs.
    blocks = [-(-p.numel() // BLOCK) for p in model.parameters()]
    drawn = opt.policy.follow.signs is not None
    following = 12 * sum(b for b in blocks if b > 1) + 4 * (BLOCK // WIDTH) * drawn
    assert held == {"momentum": 4 * numel, "frozen denominator": 4 * numel,
                    "fold buffer": 4 * numel, "masks": held["masks"],
                    "variance follow": following}
    assert held["masks"] <= 2 * numel


def _hook_run(rank, world, member):
    model = _model()
    net = DDP(model, bucket_cap_mb=0.01, gradient_as_bucket_view=True)  # several units
    if member.startswith("zero_one"):  # "zero_one_paper": local_variance=False
        opt = ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=6, var_update_scaler=2,
                          local_step_scaler=2, local_step_clipper=4, total_steps=16,
                          bucket_cap_mb=0.01, local_variance=member == "zero_one")
    else:
        opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=3, bucket_cap_mb=0.01)
    register_onebit_hook(net, opt)
    seen = []
    for step in range(16 if member.startswith("zero_one") else 8):
        _step(net, opt, rank, step)
        if opt.switch_step is not None and opt.global_step > opt.switch_step:  # units built
            seen.append((opt.coming_exchange, sorted(buffer_bytes(opt)),
                         sum(u._local is not None for u in opt.units), len(opt.units)))
    numel = sum(p.numel() for p in model.parameters())
    return seen, buffer_bytes(opt), numel


def test_under_the_ddp_hook_the_compression_stage_holds_errors_wire_and_masks_only():
    """The CPU kernel's hook path: the average is decoded from the wire into the bucket views
    and again by the update, so no unit makes a fold buffer; beside the momentum and the
    denominator there are only the errors, the wire and the masks."""
    assert cpu_kernel() is not None  # the path under test
    for seen, held, numel in run_ranks(_hook_run, 2, "onebit"):
        assert len(seen) == 5 and seen[0][3] > 2  # several units
        for _, kinds, with_fold, _ in seen:
            assert with_fold == 0
            assert kinds == ["frozen denominator", "masks", "momentum", "server error",
                             "variance follow", "wire", "worker error"]
        assert held["momentum"] == held["frozen denominator"] == 4 * numel
        # follow_variance: 12 bytes a block of 2,048 values (0.006 a value) and its signs
        assert held["variance follow"] < 0.01 * numel + 4096
        # padding to whole blocks: at most one block per unit and chunk beyond 4 and 2 bytes
        assert 4 * numel <= held["worker error"] < 4 * numel + 4 * 2048 * seen[0][3]
        assert held["wire"] < 1.0 * numel + 8 * 2048 * seen[0][3]


@pytest.mark.parametrize("member", ["zero_one_paper", "zero_one"])
def test_zero_one_drops_the_variance_when_phase_b_begins_and_keeps_no_fold_buffer(member):
    """The paper's 0/1 Adam drops its variance in phase B (4 bytes per parameter);
    ``local_variance`` keeps it (every rank still feeds its own, phase B averages them)."""
    kept = member == "zero_one"
    for seen, held, numel in run_ranks(_hook_run, 2, member):
        phase_a = [kinds for kind, kinds, _, _ in seen if kind in ("momentum", "exact",
                                                                    "refresh")]
        phase_b = [kinds for kind, kinds, _, _ in seen if kind in ("local", "sync")]
        assert phase_a and phase_b
        assert all("variance" in k and "local-step anchors" not in k for k in phase_a[:-1])
        assert all(("variance" in k) == kept and "local-step anchors" in k
                   for k in phase_b[1:])
        assert all(with_fold == 0 for _, _, with_fold, _ in seen)
        assert held.get("variance", 0) == (4 * numel if kept else 0)
        assert held["local-step anchors"] == 4 * numel


def _own_average_run(rank, world):
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=3, bucket_cap_mb=0.01)
    for step in range(3):
        _step(model, opt, rank, step)
    warm = buffer_bytes(opt)
    seen = []
    for step in range(3, 7):
        _step(model, opt, rank, step)
        seen.append((sorted(buffer_bytes(opt)), sum(u._local is not None for u in opt.units)))
    return warm, seen, sum(p.numel() for p in model.parameters())


def test_without_ddp_the_warmup_buffer_is_let_go_where_the_cpu_kernel_folds():
    """The optimizer averages by itself (no DDP): its warm-up gradient buffer (4 bytes a value)
    is resident until the freeze; the CPU kernel's 1-bit path then writes no fold buffer, so
    the buffer is not kept as one."""
    assert cpu_kernel() is not None  # the path under test
    for warm, seen, numel in run_ranks(_own_average_run, 2):
        assert warm["warm-up gradient buffer"] >= 4 * numel
        for kinds, with_fold in seen:
            assert with_fold == 0 and "fold buffer" not in kinds, kinds
