"""Time the collectives of one compressed allreduce, in the two layouts this project has used,
and OneBitAdam's warm-up step without DDP with its gradient allreduce in chunks of several sizes.

    sudo .venv/bin/python benchmarks/collective_patterns.py [--hosts 4] [--rate 1gbit]

On the emulated hosts of benchmarks/cluster.py (network namespaces, each link limited with
``tc tbf``; over loopback without root), every rank times, after a barrier, what one
``OneBitAllreduce`` call sends for a tensor of N values (2048-value blocks, W ranks):

    separate  until 2026-12-01: an all-to-all of the bits and one of the scales, then an
              all-gather of the server chunk's bits and one of its scales (four collectives)
    rows      now: one all-to-all of W rows of bits-and-scales, then one all-to-all that sends
              the server row to every rank (two collectives, the same bytes)

and prints the median of ``--calls`` calls on rank 0. Only the collectives are timed (the rows'
copies too); no compression runs. Then a warm-up ``OneBitAdam.step()`` without DDP on the
gradients of benchmarks/cluster.py's communication-bound GPT (6,458,112 values in 102 tensors),
with ``onebit_plugin.core.gradient_average.WARMUP_CHUNK_BYTES`` at 1 GiB (one allreduce, as before
2026-12-01 21:00 UTC) and 1-16 MiB (4 MiB: the default), interleaved. The namespaces are
removed afterwards. Each run appends one record to ``benchmarks/results/collective_patterns.jsonl``
(benchmarks/record.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = (137_216, 6_458_112)  # the two workloads of benchmarks/cluster.py


def rank_main(calls: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = {}
    for numel in SIZES:
        time_one_size(numel, calls, results)
    time_warmup_chunks(calls, results)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(results))
    dist.destroy_process_group()


def time_one_size(numel: int, calls: int, results: dict) -> None:
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    chunk = -(-numel // world // 2048) * 2048
    bits, scale_bytes = chunk // 8, chunk // 2048 * 4
    u8 = dict(dtype=torch.uint8)
    send_bits, send_scales = torch.zeros(world * bits, **u8), torch.zeros(world * chunk // 2048)
    recv_bits, recv_scales = torch.empty_like(send_bits), torch.empty_like(send_scales)
    own_bits, own_scales = torch.zeros(bits, **u8), torch.zeros(chunk // 2048)
    all_bits, all_scales = torch.empty_like(send_bits), torch.empty_like(send_scales)
    send_rows = torch.empty(world, bits + scale_bytes, **u8)
    recv_rows = torch.empty_like(send_rows)

    def separate():
        works = [dist.all_to_all_single(recv_bits, send_bits, async_op=True),
                 dist.all_to_all_single(recv_scales, send_scales, async_op=True)]
        for work in works:
            work.wait()
        works = [gather(all_bits, own_bits, async_op=True),
                 gather(all_scales, own_scales, async_op=True)]
        for work in works:
            work.wait()

    def rows():
        send_rows[:, :bits].copy_(send_bits.view(world, bits))
        send_rows[:, bits:].copy_(send_scales.view(world, -1).view(torch.uint8))
        dist.all_to_all_single(recv_rows.view(-1), send_rows.view(-1))
        recv_bits.view(world, bits).copy_(recv_rows[:, :bits])
        recv_scales.view(world, -1).view(torch.uint8).copy_(recv_rows[:, bits:])
        send_rows[:, :bits].copy_(own_bits.expand(world, bits))
        send_rows[:, bits:].copy_(own_scales.view(torch.uint8).expand(world, scale_bytes))
        dist.all_to_all_single(recv_rows.view(-1), send_rows.view(-1))
        all_bits.view(world, bits).copy_(recv_rows[:, :bits])
        all_scales.view(world, -1).view(torch.uint8).copy_(recv_rows[:, bits:])

    for _ in range(2):  # interleaved, so that a drift of the machine hits both
        for name, fn in (("separate", separate), ("rows", rows)):
            times = []
            for _ in range(calls):
                dist.barrier()
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            results.setdefault(f"{numel:,} values, {name}", []).append(
                sorted(times)[len(times) // 2] * 1e3)


def time_warmup_chunks(calls: int, results: dict) -> None:
    import torch
    import torch.distributed as dist

    import onebit_plugin.core.gradient_average as optimizer
    from onebit_plugin import OneBitAdam

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from cluster_worker import CharGPT

    torch.manual_seed(0)  # the same weights on every rank (OneBitAdam checks it at the first step)
    model = CharGPT(dim=256, layers=8, context=32)  # cluster.py's "comm" workload
    opt = OneBitAdam(model.parameters(), lr=1e-6, freeze_step=10**9)
    torch.manual_seed(1 + dist.get_rank())  # and each rank's own gradients
    grads = [torch.randn_like(p) for p in model.parameters()]
    caps = {"one allreduce": 2**30, **{f"{mib} MiB chunks": mib * 2**20 for mib in (1, 2, 4, 8,
                                                                                    16)}}
    for _ in range(2):
        times = {name: [] for name in caps}
        for _ in range(calls):  # the sizes interleaved, call by call
            for name, cap in caps.items():
                optimizer.WARMUP_CHUNK_BYTES = cap
                for p, g in zip(model.parameters(), grads, strict=True):
                    p.grad = g.clone()
                dist.barrier()
                start = time.perf_counter()
                opt.step()
                times[name].append(time.perf_counter() - start)
        for name, values in times.items():
            results.setdefault(f"warm-up step without DDP, {name}", []).append(
                sorted(values)[len(values) // 2] * 1e3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hosts", type=int, default=4, help="ranks, one per host (default 4)")
    p.add_argument("--rate", default="1gbit",
                   help="tc tbf rate of each host's link, e.g. 1gbit, 100mbit (default 1gbit)")
    p.add_argument("--calls", type=int, default=40,
                   help="calls per layout and round; the median is printed (default 40)")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank:
        return rank_main(args.calls)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from emulated import run_ranks
    from record import append_run, shown

    me = [str(Path(__file__).resolve()), "--rank", "--calls", str(args.calls)]
    network, outputs = run_ranks(me, args.hosts, args.rate, port=29640, timeout=600)
    line = next(x for out in outputs for x in out.splitlines() if x.startswith("RESULT "))
    print(f"{args.hosts} hosts, {network}; median ms of "
          f"{args.calls} calls, round 1 / round 2 (the layouts interleaved):")
    measured = json.loads(line[len("RESULT "):])
    for name, medians in measured.items():
        print(f"  {name}: " + " / ".join(f"{m:.2f}" for m in medians))
    out = append_run("collective_patterns", None, {
        "hosts": args.hosts, "network": network, "calls": args.calls, "median_ms": measured})
    print(f"appended the run to {shown(out)}")


if __name__ == "__main__":
    main()
