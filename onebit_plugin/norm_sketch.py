"""The averaged gradient's norm, estimated from each rank's local gradient: what clipping needs
in the compression stage, where no rank holds the averaged gradient (docs/design.md,
"Clipping").

A CountSketch (Charikar et al., 2002; the AMS estimate of a squared norm): coordinate ``i`` of a
parameter adds ``s_i * g_i`` to bucket ``i mod width``, with random signs ``s_i`` that are the same
on every rank. A sketch is linear, so the mean of the ranks' sketches (one allreduce of
``width`` values) is the sketch of the averaged gradient, and its squared norm estimates the
averaged gradient's squared norm without bias: the cross terms of colliding coordinates carry
independent random signs. Its relative standard deviation is about ``sqrt(2 / width)``
(``width`` 256: 9% on the squared norm, 4% on the norm). The mean of the ranks' local norms,
the other cheap estimate, is biased upwards: up to ``sqrt(W)`` times the averaged gradient's
norm when the ranks' gradients are mostly noise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["NormSketch", "sketch_width"]

_SEED = 0x5EED


def sketch_width(values: int) -> int:
    """Buckets for ``values`` trainable values: 1/1024 of them, from 256 to 4096 (1-16 KB per
    allreduce, at most about 3% of a compression-stage step's bytes)."""
    return min(4096, max(256, values // 1024))


class NormSketch:
    """Sketches of parameters' gradients, ``width`` buckets each; the signs of a parameter are
    drawn once, from its position among the trainable parameters (the same on every rank), and
    kept (1 byte per value)."""

    def __init__(self, params: list[torch.Tensor], width: int):
        self.width = width
        self.index = {p: i for i, p in enumerate(params)}
        self.signs: dict[torch.Tensor, torch.Tensor] = {}

    def _signs(self, p: torch.Tensor) -> torch.Tensor:
        signs = self.signs.get(p)
        if signs is None:
            gen = torch.Generator().manual_seed(_SEED + self.index[p])
            bits = torch.randint(0, 2, (p.numel(),), generator=gen, dtype=torch.int8)
            signs = self.signs[p] = (bits * 2 - 1).to(p.device)
        return signs

    def of(self, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The sketch of ``p``'s gradient ``grad`` (fp32, ``width`` values)."""
        signed = grad.reshape(-1).float() * self._signs(p)
        tail = -signed.numel() % self.width
        return F.pad(signed, (0, tail)).view(-1, self.width).sum(dim=0)


def squared_norm(sketch: torch.Tensor) -> torch.Tensor:
    """The estimate of the sketched vector's squared norm."""
    return sketch.square().sum()
