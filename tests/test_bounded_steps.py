"""Bounded compression-stage steps: the frozen variance is taken as at least m_hat**2, so a
coordinate whose variance froze small (seen rarely in warm-up, often after) moves at most lr per
step instead of running away."""

import torch

from onebit_plugin import OneBitAdam


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


def test_a_rarely_seen_coordinate_moves_at_most_lr_per_step():
    lr, freeze = 1e-2, 20
    adam_final, adam_moves = _run(None)
    final, moves = _run(True)
    free_final, free_moves = _run(False)
    # Unbounded, the frozen sqrt(v) of ~3e-5 turns each step into ~300 lr: the ablation shows it.
    assert free_moves[freeze:, 0].max() > 100 * lr
    assert free_final[0] > 50 * adam_final[0]
    # + one fp32 ulp of |p| < 1 from the difference of two parameters
    assert moves[freeze:, 0].max() <= lr + 6e-8
    assert final[0] <= 2 * adam_final[0], (final, adam_final)
    # A coordinate whose variance is right is untouched by the bound.
    assert torch.equal(moves[:, 1], free_moves[:, 1])
