"""Which coordinates take part in the compression stage (docs/design.md, "Masks").

Coordinates whose frozen variance is exactly zero, or zero up to rounding, keep a zero momentum:
``1/eps`` would amplify the ``+-scale`` sent for their zero momentum. A user's masks
(``masks={param: bool tensor}``) drop more.
"""

from __future__ import annotations

import math

import torch

__all__ = ["NEGLIGIBLE_VARIANCE", "above_floor", "checked_masks", "keep_mask", "negligible_root"]

# A frozen sqrt(v) below this fraction of the rms sqrt(v) over all trainable coordinates is a
# gradient that is zero up to rounding: fp32 rounding leaves about 1e-7 of the terms' size, and
# the key bias of attention (softmax is shift-invariant, so its gradient is mathematically 0)
# measured 3e-10..4e-9 of its tensor's rms in a GPT-2 and an nn.MultiheadAttention model, while
# every real gradient seen was above 1e-5 (a rare byte's embedding row; docs/design.md). Sent
# as +-scale, such a coordinate moves by lr * scale / eps per step: 480 in 20 steps for GPT-2.
NEGLIGIBLE_VARIANCE = 1e-6


def negligible_root(roots: list[torch.Tensor]) -> float:
    """NEGLIGIBLE_VARIANCE of the rms of ``roots`` (every trainable coordinate's sqrt(v_hat),
    or its denominator sqrt(v_hat) + eps: eps is far below any real gradient's root)."""
    # In pieces of 64K values: a float64 sum of one fp32 tensor of 6.5M values measured
    # 48-51 ms on one CPU thread, of its 64K-value pieces 5 ms (torch 2.13; the same to 1e-15).
    # One host sync in all (on a GPU, one per piece was about 20K for 1.3B parameters), the
    # pieces added in the same order. ``roots`` may be a generator: each is read once.
    pieces, count = [], 0
    for r in roots:
        pieces += [piece.square().sum(dtype=torch.float64)
                   for piece in r.reshape(-1).split(1 << 16)]
        count += r.numel()
    total = sum(torch.stack(pieces).tolist()) if pieces else 0
    return NEGLIGIBLE_VARIANCE * math.sqrt(total / max(count, 1))


def keep_mask(params: list[torch.Tensor], denom: torch.Tensor, eps: list[float],
              negligible: float, mask_zero_variance: bool, masks: dict) -> torch.Tensor:
    """Flat bool mask of the coordinates of ``params`` that take part in the compression stage:
    those whose frozen ``sqrt(v_hat)`` is at least ``negligible``, read from their denominator
    ``sqrt(v_hat) + eps`` (``denom``, flat; ``eps`` per parameter), the one copy of the frozen
    variance a member keeps, so that a resumed run masks as the uninterrupted one did;
    ``masks``: the user's, per parameter."""
    keep = torch.empty(denom.numel(), dtype=torch.bool, device=denom.device)
    offset = 0
    for p, e in zip(params, eps, strict=True):
        piece, out = denom[offset : offset + p.numel()], keep[offset : offset + p.numel()]
        if not mask_zero_variance:
            out.fill_(True)
        else:
            above_floor(piece, e, negligible, out)
        if p in masks:
            out &= masks[p].reshape(-1)
        offset += p.numel()
    return keep


def above_floor(denom: torch.Tensor, eps: float, negligible: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Where denominators ``sqrt(v_hat) + eps`` (``denom``) have a root of at least
    ``negligible``: the coordinates the variance keeps (:func:`keep_mask`; a row that wakes,
    ``maths.late_rows``)."""
    if negligible != 0:  # a NaN fails the comparison (masked); a NaN bound masks all
        return torch.ge(denom, eps + negligible, out=out)
    return torch.gt(denom, eps, out=out)  # every sqrt(v) is 0: only the zeros (and NaNs)


def checked_masks(masks: dict | None, shards=None) -> dict:
    """A user's ``masks={param: bool tensor of param's shape}``, checked and made bool on the
    parameter's device; an FSDP2 parameter's (``comm.shards``) by its proxy and local shard."""
    out = {}
    for p, m in (masks or {}).items():
        if shards is not None and hasattr(p, "_local_tensor"):  # a DTensor
            p, m = shards.proxy_of(p), getattr(m, "_local_tensor", m)
        if m.shape != p.shape:
            raise ValueError(f"a mask has shape {tuple(m.shape)}, its parameter "
                             f"{tuple(p.shape)}")
        out[p] = m.to(device=p.device, dtype=torch.bool)
    return out
