"""Bounded compression-stage steps: a coordinate whose variance froze small (seen rarely in
warm-up, often after) moves no further per step than Adam ever could."""

import math

import pytest
import torch

from onebit_plugin import OneBitAdam, adam_step_bound


def _adam_ratio(grads, b1=0.9, b2=0.999):
    m = v = 0.0
    for g in grads:
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
    t = len(grads)
    return abs(m / (1 - b1**t)) / math.sqrt(v / (1 - b2**t))


@pytest.mark.parametrize("t", [1, 7, 50, 240])
def test_the_bound_is_adams_supremum(t):
    b1, b2 = 0.9, 0.999
    bound = adam_step_bound(b1, b2, t)
    k = torch.arange(t, dtype=torch.float64)
    extremal = ((1 - b1) * b1**k / ((1 - b2) * b2**k)).flip(0).tolist()  # g ~ w / u
    assert _adam_ratio(extremal) == pytest.approx(bound, rel=1e-9)
    gen = torch.Generator().manual_seed(t)
    for _ in range(200):
        g = torch.randn(t, generator=gen, dtype=torch.float64) * \
            torch.exp(2 * torch.randn(t, generator=gen, dtype=torch.float64))
        assert _adam_ratio(g.tolist()) <= bound * (1 + 1e-12)
    assert adam_step_bound(0.9, 0.5, t) == math.inf  # b1**2 >= b2: no bound exists


def _run(bounded, freeze=20, steps=60, lr=1e-2):
    """Coordinate 0 gets a tiny gradient once in warm-up, then 1.0 every step; coordinate 1 a
    steady gradient throughout."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = OneBitAdam([p], lr=lr, freeze_step=freeze, bound_update=bounded) if bounded is not None \
        else torch.optim.Adam([p], lr=lr)
    moves = []
    for step in range(1, steps + 1):
        rare = 1e-3 if step == 1 else (1.0 if step > freeze else 0.0)
        p.grad = torch.tensor([rare, 0.5])
        before = p.detach().clone()
        opt.step()
        moves.append((p.detach() - before).abs())
    return p.detach().abs(), torch.stack(moves)


def test_a_rarely_seen_coordinate_moves_no_further_than_adam_could():
    lr, freeze, steps = 1e-2, 20, 60
    adam_final, adam_moves = _run(None)
    final, moves = _run(True)
    free_final, free_moves = _run(False)
    # Unbounded, the frozen sqrt(v) of ~3e-5 turns each step into ~300 lr: the ablation shows it.
    assert free_moves[freeze:, 0].max() > 100 * lr
    assert free_final[0] > 50 * adam_final[0]
    for step in range(freeze + 1, steps + 1):  # + one fp32 ulp of |p| < 1 from the difference
        assert moves[step - 1, 0] <= lr * adam_step_bound(0.9, 0.999, step) + 6e-8
    assert final[0] <= 2 * adam_final[0], (final, adam_final)
    # A coordinate whose variance is right is untouched by the bound.
    assert torch.equal(moves[:, 1], free_moves[:, 1])
