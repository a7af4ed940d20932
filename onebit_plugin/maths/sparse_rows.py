"""Which tensors' gradients are sparse in rows (an embedding's: a batch touches a few of its
rows), read once at the end of the exact stage (0/1 Adam's ``sparse_rows``).

A tensor's share is, in the last exact step's averaged gradient, the rows that are zero among
the rows that moved the variance at all (rows no gradient ever reached are masked anyway,
``onebit_plugin.maths.masks``: a byte embedding's 156 bytes that never occur in text would
otherwise count as sparse). Measured over the first 16 steps of ``benchmarks/fidelity.py``'s
workloads at 2 ranks: bow_topics' hashed identifiers 0.80, word_embed's words 0.83,
char_mlp's and the GPT's byte embeddings 0.33-0.34, digits' ReLU layers 0.05-0.07, every other
tensor 0. A tensor at :data:`ROW_SPARSE_SHARE` or more is row-sparse.
"""

from __future__ import annotations

import torch

__all__ = ["ROW_SPARSE_SHARE", "SHARE", "row_counts", "shares"]

ROW_SPARSE_SHARE = 0.5
SHARE = "zero_row_share"  # a parameter's state entry: its share, a number


def row_counts(grad: torch.Tensor | None, variance: torch.Tensor) -> torch.Tensor:
    """``[zero rows among the seen, seen rows]`` of a tensor of two or more dimensions (rows:
    its first), float64: seen, a row whose ``variance`` is not all zero; zero, a seen row whose
    ``grad`` is all zero (a missing ``grad``: none is, it tells nothing)."""
    rows = variance.shape[0]
    if variance.numel() == 0:  # an FSDP2 shard without rows
        return torch.zeros(2, dtype=torch.float64, device=variance.device)
    seen = variance.reshape(rows, -1).ne(0).any(dim=1)
    if grad is None:
        zero = torch.zeros((), dtype=torch.int64, device=seen.device)
    else:  # a NaN is not 0: a step skipped for one reads as dense
        zero = (seen & grad.reshape(rows, -1).ne(0).any(dim=1).logical_not_()).sum()
    return torch.stack([zero, seen.sum()]).to(torch.float64)


def shares(counts: list[torch.Tensor], total=None) -> list[float]:
    """Each tensor's share from its :func:`row_counts`, after ``total`` (a sum over the ranks
    holding the other shards of the same tensors, FSDP2's) where given: one host read."""
    if not counts:
        return []
    stacked = torch.stack([c.to(counts[0].device) for c in counts])
    if total is not None:
        stacked = total(stacked)
    return [zero / seen if seen else 0.0 for zero, seen in stacked.tolist()]
