"""Bytes this process has written, counted by the kernel, not by onebit_plugin.

``/proc/self/io``'s ``wchar`` sums every write and send system call: gloo's socket traffic (DDP's
C++ allreduce included, which the package's own counters cannot see), plus the process's file
and terminal writes, which the examples keep out of the measured steps. Linux only.
"""

from __future__ import annotations

import json
from pathlib import Path


def written() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


class WireLog:
    """``mark(step)`` after each optimizer step; ``save(path)`` writes the per-step deltas."""

    def __init__(self):
        self.marks: list[tuple[int, int]] = []

    def mark(self, step: int) -> None:
        self.marks.append((step, written()))

    def per_step(self) -> dict[int, int]:
        return {b[0]: b[1] - a[1] for a, b in zip(self.marks, self.marks[1:], strict=False)}

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.per_step()))
