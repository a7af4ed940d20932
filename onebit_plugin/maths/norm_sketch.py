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

__all__ = ["NormSketch", "sketch_width"]

_SEED = 0x5EED
# A gradient is sketched in pieces of about this many values: the float copy and the signed
# product stay at a few MiB whatever the parameter (whole, a 1B-value embedding's were 8 GB).
SKETCH_PIECE = 1 << 20


def sketch_width(values: int) -> int:
    """Buckets for ``values`` trainable values: 1/1024 of them, from 256 to 4096 (1-16 KB per
    allreduce, at most about 3% of a compression-stage step's bytes)."""
    return min(4096, max(256, values // 1024))


class NormSketch:
    """Sketches of parameters' gradients, ``width`` buckets each; the signs of a parameter are
    drawn from its position among the trainable parameters (the same on every rank), in
    pieces, in order. ``keep_signs``: keep them (1 byte per value; the default on the CPU,
    where drawing them again made a sketch of 4M values about 4.5 times slower, one thread,
    torch 2.13) or draw them again at every sketch (the default on a GPU, to save the byte per
    parameter; what the drawing costs there is not measured yet)."""

    def __init__(self, params: list[torch.Tensor], width: int, keep_signs: bool | None = None):
        self.width = width
        self.index = {p: i for i, p in enumerate(params)}
        self.keep_signs = keep_signs if keep_signs is not None else \
            not any(p.is_cuda for p in params)
        self.signs: dict[torch.Tensor, torch.Tensor] = {}

    def _draws(self, p: torch.Tensor, sizes: list[int]):
        """``p``'s signs (+1/-1, int8), piece after piece of ``sizes``."""
        kept = self.signs.get(p)
        if kept is None and self.keep_signs:
            gen = torch.Generator().manual_seed(_SEED + self.index[p])
            bits = torch.randint(0, 2, (p.numel(),), generator=gen, dtype=torch.int8)
            kept = self.signs[p] = (bits * 2 - 1).to(p.device)
        if kept is not None:
            yield from kept.split(sizes)
            return
        # Drawn again, in the same pieces in the same order on every rank: the same signs.
        gen = torch.Generator(device=p.device).manual_seed(_SEED + self.index[p])
        for size in sizes:
            bits = torch.randint(0, 2, (size,), generator=gen, dtype=torch.int8, device=p.device)
            yield bits.mul_(2).sub_(1)

    def of(self, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The sketch of ``p``'s gradient ``grad`` (fp32, ``width`` values): coordinate ``i``
        into bucket ``i mod width``, a piece of whole rows of buckets at a time."""
        flat, width = grad.reshape(-1), self.width
        pieces = flat.split(max(width, SKETCH_PIECE // width * width))
        out = torch.zeros(width, dtype=torch.float32, device=grad.device)
        draws = self._draws(p, [piece.numel() for piece in pieces])
        for piece, signs in zip(pieces, draws, strict=True):
            signed = piece.float() * signs
            rows = signed.numel() // width * width
            out += signed[:rows].view(-1, width).sum(dim=0)
            out[: signed.numel() - rows] += signed[rows:]
            del signed  # before the next piece's product: two pieces alive at most
        return out


def squared_norm(sketch: torch.Tensor) -> torch.Tensor:
    """The estimate of the sketched vector's squared norm."""
    return sketch.square().sum()
