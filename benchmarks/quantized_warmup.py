"""What the int8 average of the full-precision steps (``warmup_bits=8``) does to Adam's variance,
by block size.

    .venv/bin/python benchmarks/quantized_warmup.py [--workloads gpt_text,word_embed,digits]
        [--world 4] [--steps 48] [--blocks 512,1024,2048,4096,8192] [--seeds 2]

One process plays W ranks: every step each rank takes the gradient of its own batch (drawn as
benchmarks/fidelity.py's workloads draw them), and their fp32 mean drives Adam. Beside it, for
each block size, the two-phase int8 mean that the package's wire passes give for the same W
gradients (``onebit_plugin.wire.quantize``: each rank's ``quantize``, each owner's
``average_quantize``, every rank's ``dequantize``; the bits of the collective itself,
tests/test_warmup_bits.py) feeds a variance of its own, ``v_B = b2 v_B + (1 - b2) g_B**2``. So
what is measured is the rounding alone, on one trajectory (fidelity.py's variance column compares
separate runs, whose trajectories drift apart as well). At the last step (by default 48, where
1-bit Adam's ``"auto"`` freezes a 240-step run):

- per tensor, ``|mean(v_B) / mean(v) - 1|`` (the gap of means; the table shows the largest over
  the tensors) and the median over coordinates of ``|v_B - v| / v`` (where ``v > 0``);
- the gradient's relative error ``||g_B - g|| / ||g||``, mean over the steps;
- the share of the coordinates whose averaged gradient was not 0 and was decoded as 0 (below half
  a step of its block's scale: a small value beside a large one in the same block);
- bytes on the wire per value of a rank's two phases against the fp32 ring allreduce's
  ``8 (W - 1) / W``: ``2 (W - 1) / W * (1 + 4 / B)`` plus the padding of the layout.

Each run appends one record to ``benchmarks/results/quantized_warmup.jsonl``
(benchmarks/record.py) and prints a markdown table (docs/benchmarks.md shows it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity import WORKLOADS  # noqa: E402 - benchmarks/fidelity.py
from record import append_run, shown  # noqa: E402 - benchmarks/record.py

from onebit_plugin.wire.quantize import (  # noqa: E402
    QuantLayout,
    average_quantize,
    dequantize,
    quantize,
)

BETA2 = 0.999


def int8_mean(grads: list[torch.Tensor], block: int) -> tuple[torch.Tensor, QuantLayout]:
    """The two-phase int8 mean of the ranks' flat gradients, as every rank decodes it."""
    world, n = len(grads), grads[0].numel()
    lay = QuantLayout.create(n, world, block)
    qs, ss = [], []
    for g in grads:  # phase 1: every rank quantizes its values
        x = torch.zeros(lay.padded_numel)
        x[:n] = g
        q, s = torch.empty(lay.padded_numel, dtype=torch.int8), torch.empty(lay.num_blocks)
        quantize(x, lay, q, s)
        qs.append(q.view(world, lay.chunk))
        ss.append(s.view(world, lay.blocks_per_chunk))
    out_q = torch.empty(lay.padded_numel, dtype=torch.int8)
    out_s = torch.empty(lay.num_blocks)
    for k in range(world):  # phase 2: owner k averages the W copies of its chunk
        recv_q = torch.stack([q[k] for q in qs]).reshape(-1)
        recv_s = torch.stack([s[k] for s in ss]).reshape(-1)
        average_quantize(recv_q, recv_s, lay, out_q.view(world, lay.chunk)[k],
                         out_s.view(world, lay.blocks_per_chunk)[k])
    mean = torch.empty(lay.padded_numel)
    dequantize(out_q, out_s, lay, mean)
    return mean[:n], lay


def run(name: str, world: int, steps: int, blocks: list[int], seed: int) -> dict:
    work = WORKLOADS[name]()
    torch.manual_seed(seed)
    model = work.model()
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    sizes = [p.numel() for p in params]
    opt = torch.optim.Adam(params, lr=work.lr)
    gens = [torch.Generator().manual_seed(1000 * seed + r) for r in range(world)]
    v = torch.zeros(sum(sizes), dtype=torch.float64)
    v_b = {b: torch.zeros_like(v) for b in blocks}
    g_err = {b: 0.0 for b in blocks}
    zeroed = {b: 0.0 for b in blocks}
    wire = {}
    for _ in range(steps):
        grads = []
        for gen in gens:
            opt.zero_grad()
            work.loss(model, work.batch_of(gen)).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
        g = torch.stack(grads).sum(0) / world  # the fp32 mean drives the run
        v.mul_(BETA2).add_(g.double() ** 2, alpha=1 - BETA2)
        for b in blocks:
            gb, lay = int8_mean(grads, b)
            v_b[b].mul_(BETA2).add_(gb.double() ** 2, alpha=1 - BETA2)
            g_err[b] += float((gb - g).norm() / g.norm()) / steps
            zeroed[b] += float(((gb == 0) & (g != 0)).sum() / (g != 0).sum()) / steps
            wire[b] = 2 * (world - 1) / world * (lay.padded_numel + 4 * lay.num_blocks) / g.numel()
        offset = 0
        for p, n in zip(params, sizes, strict=True):
            p.grad = g[offset:offset + n].view_as(p).clone()
            offset += n
        opt.step()
    out = {}
    for b in blocks:
        per_tensor = {}
        for tensor, part_v, part_b in zip(names, v.split(sizes), v_b[b].split(sizes),
                                          strict=True):
            nonzero = part_v > 0
            per_tensor[tensor] = {
                "gap_of_means": float(abs(part_b.mean() / part_v.mean() - 1)),
                "median_rel": float(((part_b - part_v).abs()[nonzero] / part_v[nonzero])
                                    .median()) if nonzero.any() else 0.0}
        out[b] = {"per_tensor": per_tensor, "grad_rel_error": g_err[b],
                  "zeroed_share": zeroed[b], "bytes_per_value": wire[b],
                  "fp32_bytes_per_value": 8 * (world - 1) / world}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="gpt_text,word_embed,digits")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--blocks", default="512,1024,2048,4096,8192")
    p.add_argument("--seeds", type=int, default=2)
    args = p.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]
    lines = [f"W = {args.world} simulated ranks, {args.steps} steps, seeds 0-{args.seeds - 1}; "
             "worst over seeds", "",
             "| workload | block | largest per-tensor gap of means of v | largest per-tensor "
             "median coordinate error of v | gradient error | decoded as 0 | bytes per value "
             "(fp32 ring: 8 (W-1)/W) |", "|---|---|---|---|---|---|---|"]
    results = {}
    for name in args.workloads.split(","):
        runs = [run(name, args.world, args.steps, blocks, seed) for seed in range(args.seeds)]
        results[name] = runs
        for b in blocks:
            rs = [r[b] for r in runs]
            gap = max(max(t["gap_of_means"] for t in r["per_tensor"].values()) for r in rs)
            med = max(max(t["median_rel"] for t in r["per_tensor"].values()) for r in rs)
            lines.append(
                f"| {name} | {b} | {gap:.2%} | {med:.2%} | "
                f"{max(r['grad_rel_error'] for r in rs):.2%} | "
                f"{max(r['zeroed_share'] for r in rs):.2%} | {rs[0]['bytes_per_value']:.3f} "
                f"({rs[0]['fp32_bytes_per_value']:.2f}) |")
    table = "\n".join(lines)
    print(table)
    out = append_run("quantized_warmup", None, {
        "world": args.world, "steps": args.steps, "blocks": blocks, "seeds": args.seeds,
        "runs": results, "table": table})
    print(f"\nappended the run to {shown(out)}")


if __name__ == "__main__":
    main()
