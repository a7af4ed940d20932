"""Which block scale keeps error feedback tight: the mean |c| or the RMS of the block?

    .venv/bin/python benchmarks/scale_rule.py

Feeds T calls of one error-feedback sign compressor (``worker_compress``, one 4096-value block)
with ``x_t = signal + noise_t`` and reports the relative error of the running average of the
outputs against the running average of the inputs, and the error buffer's norm. Three signals:
a persistent Gaussian signal, pure noise (zero mean), and a persistent signal with log-normal
magnitudes (heavy tails, like momenta of mixed layers).
"""

from __future__ import annotations

import torch

from onebit_plugin.wire.compression import ChunkLayout, CoordinateMask, worker_compress


def run(signal: torch.Tensor, scale: str, steps: int, seed: int = 0) -> list[tuple]:
    n = signal.numel()
    layout = ChunkLayout.create(n, 1, max_block=n, scale=scale)
    mask = CoordinateMask.build(layout)
    error = torch.zeros(layout.padded_numel)
    packed = torch.empty(layout.padded_numel // 8, dtype=torch.uint8)
    scales = torch.empty(layout.num_blocks)
    out = torch.empty(n)
    gen = torch.Generator().manual_seed(seed)
    sum_in = torch.zeros(n, dtype=torch.float64)
    sum_out = torch.zeros(n, dtype=torch.float64)
    rows = []
    for t in range(1, steps + 1):
        x = signal + torch.randn(n, generator=gen)
        before = error[:n].clone()
        worker_compress(x, error, mask, layout, packed, scales)
        out.copy_(x + before - error[:n])  # what was sent: c - new error
        sum_in += x.double()
        sum_out += out.double()
        if t in (10, 100, steps):
            rel = ((sum_out - sum_in).norm() / sum_in.norm()).item()
            rows.append((t, rel, error.norm().item()))
    return rows


def main() -> None:
    torch.manual_seed(0)
    n = 4096
    signals = {
        "persistent gaussian": torch.randn(n),
        "zero mean": torch.zeros(n),
        "log-normal magnitudes": torch.randn(n) * torch.randn(n).exp(),
    }
    print(f"{'signal':24s} {'scale':5s}  running-average error (|error buffer|) at T=10/100/400")
    for name, signal in signals.items():
        for scale in ("mean", "rms"):
            rows = run(signal, scale, 400)
            cells = "  ".join(f"{rel:7.4f} ({norm:6.0f})" for _, rel, norm in rows)
            print(f"{name:24s} {scale:5s}  {cells}")


if __name__ == "__main__":
    main()
