"""What an optimizer of the family sent, and what the same exchanges would have cost as fp32
ring allreduces: ``bytes_sent``, ``dense_bytes`` and their ratio (docs/api.md). These are the
package's own counts; the benchmarks measure the wire at the collectives instead."""

from __future__ import annotations

import math

__all__ = ["ByteCounts", "ring_bytes"]


def ring_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends in a bandwidth-optimal (ring) allreduce of ``nbytes``."""
    return math.ceil(2 * (world - 1) / world * nbytes)


class ByteCounts:
    """Warm-up allreduces (sent = dense), clipping-norm allreduces (sent only) and the
    compression stage's communicator, whose own counters hold its part while it exists (its
    counts are carried over when it is replaced, and through checkpoints)."""

    def __init__(self) -> None:
        self.warmup_sent = self.warmup_dense = self.clip_sent = 0
        self.comm = None
        self._compression = (0, 0)  # while there is no communicator

    def compression(self) -> tuple[int, int]:
        if self.comm is not None:
            return self.comm.bytes_sent, self.comm.dense_bytes
        return self._compression

    def attach(self, comm) -> None:
        """``comm`` counts the compression stage from now on, from the counts so far."""
        comm.bytes_sent, comm.dense_bytes = self.compression()
        self.comm = comm

    def detach(self) -> None:
        self._compression, self.comm = self.compression(), None

    @property
    def sent(self) -> int:
        return self.warmup_sent + self.compression()[0] + self.clip_sent

    @property
    def dense(self) -> int:
        return self.warmup_dense + self.compression()[1]

    def ratio(self, averaged_elsewhere: bool) -> float:
        if averaged_elsewhere:
            return math.nan
        return self.dense / self.sent if self.sent else math.inf

    def count_exact(self, nbytes: int, world: int) -> None:
        """An fp32 ring allreduce of ``nbytes`` (the DDP hook's warm-up bucket)."""
        self.add_exact(ring_bytes(nbytes, world), ring_bytes(nbytes, world))

    def add_exact(self, sent: int, dense: int) -> None:
        """Exact-stage allreduces that sent ``sent`` bytes for values worth ``dense``."""
        self.warmup_sent += sent
        self.warmup_dense += dense

    def state_dict(self) -> dict:
        return {"warmup_counts": (self.warmup_sent, self.warmup_dense),
                "clip_bytes": self.clip_sent, "compression_counts": self.compression()}

    def load_state_dict(self, state: dict) -> None:
        self.warmup_sent, self.warmup_dense = state["warmup_counts"]
        self.clip_sent = int(state.get("clip_bytes", 0))  # absent before 2026-12-01
        self._compression, self.comm = tuple(state["compression_counts"]), None
