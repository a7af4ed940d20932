"""Throughput of the CPU (torch) compression path against the machine's copy bandwidth.

    .venv/bin/python benchmarks/compression_throughput.py [--numel 8388608] [--world 4]

Times each stage of one compressed allreduce on one thread, without communication: the worker
pass over the whole tensor, the server pass over one chunk (W senders), the final decode, and a
plain fp32 copy of the same tensor for reference (read n*4 + write n*4 bytes). Prints ms and
GB/s counted as the fp32 bytes the stage reads and writes.
"""

from __future__ import annotations

import argparse
import time

import torch

from onebit_plugin import compression as C


def bench(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--numel", type=int, default=8 * 2**20)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--max-block", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lay = C.ChunkLayout.create(args.numel, args.world, args.max_block)
    mask = C.CoordinateMask.build(lay)
    buf = C.CompressionBuffers(lay.padded_numel, lay.block)
    x = torch.randn(args.numel)
    err = torch.zeros(lay.padded_numel)
    packed = torch.empty(lay.padded_numel // 8, dtype=torch.uint8)
    scales = torch.empty(lay.num_blocks)
    recv_packed = packed.view(args.world, -1).clone()
    recv_scales = scales.view(args.world, -1).clone()
    server_err = torch.zeros(lay.chunk)
    own_packed = torch.empty(lay.chunk // 8, dtype=torch.uint8)
    own_scales = torch.empty(lay.blocks_per_chunk)
    out = torch.empty(args.numel)
    dst = torch.empty(args.numel)
    n = args.numel
    rows = [
        ("fp32 copy (reference)", lambda: dst.copy_(x), 8 * n),
        ("worker compress", lambda: C.worker_compress(
            x, err, mask, lay, packed, scales, buf), 12 * n),
        ("server compress (1 chunk)", lambda: C.server_compress(
            recv_packed, recv_scales, server_err, mask.chunk(lay, 0), lay, own_packed,
            own_scales, buf), 8 * lay.chunk),
        ("decompress", lambda: C.decompress(packed, scales, mask, lay, out, buf), 4 * n),
    ]
    print(f"numel={n} world={args.world} block={lay.block} threads={args.threads} "
          f"torch={torch.__version__}")
    copy_gbs = None
    for name, fn, nbytes in rows:
        t = bench(fn, args.repeat)
        gbs = nbytes / t / 1e9
        copy_gbs = copy_gbs or gbs
        print(f"{name:28s} {t * 1e3:8.2f} ms  {gbs:6.2f} GB/s  ({gbs / copy_gbs:.2f} of copy)")


if __name__ == "__main__":
    main()
