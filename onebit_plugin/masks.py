"""Which coordinates take part in the compression stage (docs/design.md, "Masks").

Coordinates whose frozen variance is exactly zero, or zero up to rounding, keep a zero momentum:
``1/eps`` would amplify the ``+-scale`` sent for their zero momentum. A user's masks
(``masks={param: bool tensor}``) drop more.
"""

from __future__ import annotations

import math

import torch

__all__ = ["NEGLIGIBLE_VARIANCE", "keep_mask", "negligible_root"]

# A frozen sqrt(v) below this fraction of the rms sqrt(v) over all trainable coordinates is a
# gradient that is zero up to rounding: fp32 rounding leaves about 1e-7 of the terms' size, and
# the key bias of attention (softmax is shift-invariant, so its gradient is mathematically 0)
# measured 3e-10..4e-9 of its tensor's rms in a GPT-2 and an nn.MultiheadAttention model, while
# every real gradient seen was above 1e-5 (a rare byte's embedding row; docs/design.md). Sent
# as +-scale, such a coordinate moves by lr * scale / eps per step: 480 in 20 steps for GPT-2.
NEGLIGIBLE_VARIANCE = 1e-6


def negligible_root(roots: list[torch.Tensor]) -> float:
    """NEGLIGIBLE_VARIANCE of the rms of ``roots`` (every trainable coordinate's sqrt(v_hat))."""
    # In pieces of 64K values: a float64 sum of one fp32 tensor of 6.5M values measured
    # 48-51 ms on one CPU thread, of its 64K-value pieces 5 ms (torch 2.13; the same to 1e-15).
    total = sum(float(piece.square().sum(dtype=torch.float64))
                for r in roots for piece in r.reshape(-1).split(1 << 16))
    count = sum(r.numel() for r in roots)
    return NEGLIGIBLE_VARIANCE * math.sqrt(total / max(count, 1))


def keep_mask(params: list[torch.Tensor], root: torch.Tensor, negligible: float,
              mask_zero_variance: bool, masks: dict) -> torch.Tensor:
    """Flat bool mask of the coordinates of ``params`` (``root``: their frozen sqrt(v), flat)
    that take part in the compression stage; ``masks``: the user's, per parameter."""
    if not mask_zero_variance:
        keep = torch.ones(root.numel(), dtype=torch.bool, device=root.device)
    elif negligible != 0:  # a NaN root fails the comparison (masked); a NaN bound masks all
        keep = root >= negligible
    else:  # every sqrt(v) is 0: only the zeros (and NaNs) are masked
        keep = root > 0
    offset = 0
    for p in params:
        if p in masks:
            keep[offset : offset + p.numel()] &= masks[p].reshape(-1)
        offset += p.numel()
    return keep
