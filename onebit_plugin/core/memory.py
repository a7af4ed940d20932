"""What a 1-bit family optimizer holds, by buffer: ``buffer_bytes(optimizer)``.

The memory benchmark (``benchmarks/memory.py``) measures each rank's peak resident memory from
outside; this says which buffers it is made of, so that docs/memory.md can say what each costs
and why it exists. Each storage is counted once, under the first name that holds it (a momentum
that is a view of its unit's buffer counts as the momentum). Bytes are allocated bytes: a buffer
never written (``torch.empty`` on the CPU) is not resident, which the benchmark's figures show.
"""

from __future__ import annotations

import torch

__all__ = ["buffer_bytes"]


# follow_variance's numbers, three per block of its values (core.variance_follow)
_FOLLOWING = dict.fromkeys(("variance_mean", "variance_ref", "variance_scale"),
                           "variance follow")


def _tensors(opt) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor the optimizer holds, most specific name first."""
    out = []
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                out.append(({"exp_avg": "momentum", "exp_avg_sq": "variance",
                             "frozen_denominator": "frozen denominator",
                             "master": "master weights", **_FOLLOWING}.get(
                                 key, f"state[{key!r}]"), value))
    for unit in opt.layout.units if opt.layout is not None else []:
        out.append(("frozen denominator", unit.denom))
        if unit._local is not None:  # made at its first use (not by asking here)
            out.append(("fold buffer", unit._local))
        out += unit.plan.buffers(unit.errors)
        if unit.masked is not None:
            out.append(("masks", unit.masked))
        if unit.late is not None:
            out += unit.late.buffers()
    if opt.layout is not None and opt.layout.local is not None:
        out += opt.layout.local.buffers()
    if opt.counts.comm is not None:
        out += opt.counts.comm.buffers()
    out += opt.policy.buffers()
    if opt.auto_freeze is not None:
        out += [("auto-freeze snapshots", t) for _, roots in opt.auto_freeze.snapshots
                for t in roots]
    sketch = opt.handoff.sketch
    if sketch is not None:
        out += [("norm-sketch signs", s) for s in sketch.signs.values()]
    return out


def buffer_bytes(opt) -> dict[str, int]:
    """Bytes the optimizer ``opt`` holds per kind of buffer (allocated, each storage once)."""
    seen, out = set(), {}
    for name, t in _tensors(opt):
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        out[name] = out.get(name, 0) + storage.nbytes()
    return out
