"""Two GPUs with NCCL: what one GPU cannot show, for when two GPUs are lent (docs/benchmarks.md,
"GPU check"; benchmarks/gpu_check.sh is the one-GPU check).

    benchmarks/gpu_check_nccl.sh                 # OUT=gpu_check_out PYTHON=python3
    python benchmarks/gpu_check_nccl.py [--out gpu_check_out/gpu_check_nccl.json]
    .venv/bin/python benchmarks/gpu_check_nccl.py --backend gloo --device cpu   # CPU check

No torchrun: the script spawns its two ranks itself (``torch.multiprocessing``, spawn), rank
``r`` on ``cuda:r`` with backend ``nccl``, three times, and ends them itself: a rank that has not
ended when its part is over (a hung collective, an NCCL communicator that keeps the process
alive) is killed and joined.

1. ``hook_steps``: OneBitAdam under the DDP hook (``register_onebit_hook``,
   ``gradient_as_bucket_view=True``, small DDP buckets: several momentum units a step) through
   the compression stage, with ``comm_timeout=None`` and ``comm_timeout=60``: two models in the
   same two processes, their steps interleaved (the order swapped every step), each step timed
   between two ``torch.cuda.synchronize``. Reports the ranks' ``check_lockstep`` and the mean,
   median and minimum time of the steady compression-stage steps of each setting. Issue 33:
   NCCL's ``wait(timeout)`` sleeps 1 ms between checks, at least 1 ms per exchange; the
   optimizer now polls the work's completion instead (``allreduce.wait_collectives``). The
   difference of the two means is what ``comm_timeout`` still costs.
2. ``hung_rank``, on the optimizer's own path (no DDP) and under the DDP hook: rank 1 sleeps
   ``--hang-sleep`` seconds (90) before its first steady compression-stage step, with
   ``comm_timeout=--hang-timeout`` (5). Rank 0 must raise onebit_plugin's
   ``CommunicationError`` (under DDP, inside DDP's ``RuntimeError``) within ``comm_timeout +
   30`` s. Reports the time, the exception's type and message, and how each process ended: by
   itself (its exit code, or the signal: NCCL's watchdog aborts a process, SIGABRT, at the
   optimizer group's timeout of ``comm_timeout + max(comm_timeout, 30)`` s), or killed by this
   script. Rank 1 sleeps past that watchdog timeout, so a rank 0 that never raised shows as a
   process ended by the watchdog, not as a step completed late.
3. ``hierarchical`` (issue 46): the two GPUs as one host of the two-level topology's parts
   (the host group of both, a cross-host group of each rank alone, on NCCL): the exact
   two-level mean must equal ``(x0 + x1) / 2`` bit for bit, and six calls of the 1-bit
   hierarchical communicator must come back finite and identical on both ranks.

Writes the report to ``--out``, appends one record of the run (benchmarks/record.py) to
``benchmarks/results/gpu_check_nccl.jsonl`` and writes that record alone next to the report
(``gpu_check_nccl_record.json``: on a machine whose tree is a copy, the line to bring back).
Exits non-zero unless every part passed. ``--backend gloo --device cpu`` runs the same parts on
the CPU: a check of the script, not of NCCL.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import sys
import time
import traceback
from multiprocessing.connection import wait as wait_connections

import torch
from record import append_run, read_runs, shown  # benchmarks/record.py

WORLD = 2
# Rank 0 must raise within comm_timeout + this many seconds of the start of its step.
RAISE_MARGIN_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(device, dim: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(dim, dim), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks[:-1]).to(device)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(net, opt, x) -> None:
    opt.zero_grad()
    (net(x) - x).square().mean().backward()
    opt.step()


def _ddp(model, opts, device):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=opts["bucket_mb"], gradient_as_bucket_view=True)


def _hook_steps(rank: int, device, opts) -> dict:
    """Part 1 on one rank: two hook-path models, comm_timeout None and 60, steps interleaved."""
    from onebit_plugin import OneBitAdam, check_lockstep, register_onebit_hook

    settings = {"comm_timeout_none": None, "comm_timeout_60": 60.0}
    runs = {}
    for name, timeout in settings.items():  # the same order on every rank (groups are made)
        model = _model(device, opts["dim"], opts["layers"])
        opt = OneBitAdam(model.parameters(), lr=1e-4, freeze_step=opts["freeze_step"],
                         comm_timeout=timeout)
        ddp = _ddp(model, opts, device)
        register_onebit_hook(ddp, opt)
        runs[name] = (ddp, opt, torch.Generator(device=device).manual_seed(rank), [])
    names = list(runs)
    warmup = opts["freeze_step"] + 2  # the freeze at freeze_step + 1, then one steady step
    for i in range(warmup + opts["steps"]):
        for name in names if i % 2 == 0 else names[::-1]:
            ddp, opt, gen, times = runs[name]
            x = torch.randn(opts["batch"], opts["dim"], generator=gen, device=device)
            _sync(device)
            start = time.perf_counter()
            _step(ddp, opt, x)
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
    result = {}
    for name, (ddp, opt, _, times) in runs.items():
        try:
            check_lockstep(ddp.parameters(), opt)
            lockstep = "identical"
        except Exception as exc:  # noqa: BLE001 - reported
            lockstep = f"{type(exc).__name__}: {exc}"[:500]
        result[name] = {
            "stage": opt.stage, "bytes_sent": opt.bytes_sent, "lockstep": lockstep,
            "steps_timed": len(times),
            "mean_ms": round(1e3 * statistics.fmean(times), 3),
            "median_ms": round(1e3 * statistics.median(times), 3),
            "min_ms": round(1e3 * min(times), 3),
        }
    result["parameters"] = sum(p.numel() for p in runs[names[0]][0].parameters())
    result["mean_ms_difference_60_minus_none"] = round(
        result["comm_timeout_60"]["mean_ms"] - result["comm_timeout_none"]["mean_ms"], 3)
    return result


def _hierarchical(rank: int, device, opts) -> dict:
    """Part 3 on one rank: the two GPUs as one host of a two-level topology (issue 46; the
    topology itself wants two hosts, so its parts are built here: the host group of both
    ranks, a cross-host group of the rank alone), on NCCL: the exact two-level mean against
    the plain mean, and the 1-bit communicator's calls, both ranks' results compared."""
    import torch.distributed as dist

    from onebit_plugin.comm.allreduce import OneBitAllreduce
    from onebit_plugin.comm.collectives import new_group_of
    from onebit_plugin.comm.hierarchical import HierarchicalAllreduce, two_level_mean_

    host = new_group_of([0, 1], None, None, device)
    cross = new_group_of([rank], None, None, device)
    levels = (host, cross, WORLD, 1)
    n = opts["dim"] * opts["dim"] * opts["layers"] + 7  # not a multiple of anything
    gen = torch.Generator(device=device).manual_seed(100 + rank)
    x = torch.randn(n, generator=gen, device=device)
    both = [torch.empty_like(x) for _ in range(WORLD)]
    dist.all_gather(both, x)
    mean = x.clone()
    two_level_mean_(mean, levels, None)
    exact = bool(torch.equal(mean, (both[0] + both[1]) / WORLD))
    comm = HierarchicalAllreduce(OneBitAllreduce(cross), None, host, WORLD)
    plan = comm.plan(n, None, device)
    errors = plan.new_errors()
    outs, times, oks = [], [], []
    for _ in range(6):
        y = torch.randn(n, generator=gen, device=device)
        out = torch.empty_like(y)
        _sync(device)
        start = time.perf_counter()
        oks.append(bool(comm.reduce_(y, plan, errors, out=out)))
        _sync(device)
        times.append(time.perf_counter() - start)
        outs.append(out)
    identical = []
    for out in outs:
        theirs = [torch.empty_like(out) for _ in range(WORLD)]
        dist.all_gather(theirs, out)
        identical.append(bool(torch.equal(theirs[0], theirs[1])))
    return {"values": n, "exact_mean_equal": exact, "calls_ok": oks,
            "ranks_identical": identical, "worker_error": errors["worker"].numel(),
            "median_ms_after_first": round(1e3 * statistics.median(times[1:]), 3)}


def _is_communication_error(exc: BaseException) -> bool:
    """The exception, or one it was raised from, is CommunicationError; DDP re-raises a hook's
    error as a RuntimeError that carries its type's name in the message."""
    from onebit_plugin.comm.collectives import CommunicationError

    seen = exc
    while seen is not None:
        if isinstance(seen, CommunicationError) or "CommunicationError" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _hung_rank(rank: int, device, opts, path: str) -> dict:
    """Part 2 on one rank: rank 1 sleeps before its step; rank 0's step must raise."""
    from onebit_plugin import OneBitAdam, register_onebit_hook

    model = _model(device, opts["dim"], opts["layers"])
    opt = OneBitAdam(model.parameters(), lr=1e-4, freeze_step=opts["freeze_step"],
                     comm_timeout=opts["hang_timeout"])
    net = model
    if path == "ddp_hook":
        net = _ddp(model, opts, device)
        register_onebit_hook(net, opt)
    gen = torch.Generator(device=device).manual_seed(rank)
    for _ in range(opts["freeze_step"] + 2):
        _step(net, opt, torch.randn(opts["batch"], opts["dim"], generator=gen, device=device))
    _sync(device)
    result = {"stage_before": opt.stage}
    if rank == 1:
        time.sleep(opts["hang_sleep"])  # the parent kills this process once rank 0 is done
    x = torch.randn(opts["batch"], opts["dim"], generator=gen, device=device)
    start = time.monotonic()
    try:
        _step(net, opt, x)
        _sync(device)
        result.update(raised=None, seconds=round(time.monotonic() - start, 2))
    except Exception as exc:  # noqa: BLE001 - what is being checked
        result.update(raised=type(exc).__name__, seconds=round(time.monotonic() - start, 2),
                      communication_error=_is_communication_error(exc),
                      message=str(exc)[:800])
    return result


def _rank_main(rank: int, port: int, part: str, opts: dict, conn) -> None:
    """One rank of one part: its result (or its traceback) goes to the parent through
    ``conn``. After part 1 the group is destroyed; after part 2 the process just returns (the
    parent reports whether it then ends by itself)."""
    import torch.distributed as dist

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if opts["device"] == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
            dist.init_process_group(opts["backend"], rank=rank, world_size=WORLD,
                                    device_id=device)
        else:
            device = torch.device("cpu")
            dist.init_process_group(opts["backend"], rank=rank, world_size=WORLD)
        if part == "hook_steps":
            result = _hook_steps(rank, device, opts)
        elif part == "hierarchical":
            result = _hierarchical(rank, device, opts)
        else:
            result = _hung_rank(rank, device, opts, part.split(":", 1)[1])
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = {"error": traceback.format_exc()[-2500:]}
    try:
        conn.send(result)
        conn.close()
    except OSError:
        pass
    if part in ("hook_steps", "hierarchical") and "error" not in result:
        dist.destroy_process_group()


def _ended(proc, killed: bool) -> dict:
    code = proc.exitcode
    if killed:
        how = "killed by this script"
    elif code is None:
        how = "still running after kill and join"
    elif code < 0:
        how = f"ended by signal {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    return {"ended": how, "exitcode": code}


def run_part(part: str, opts: dict, wait_for: tuple[int, ...], deadline_s: float,
             linger_s: float) -> dict:
    """Spawn the two ranks of ``part``; wait up to ``deadline_s`` for the results of the ranks
    in ``wait_for``, then up to ``linger_s`` for those ranks' processes to end by themselves;
    then kill whatever is left and join every process (also on an exception here)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = _free_port()
    procs, readers = [], []
    results: dict[int, dict | None] = {rank: None for rank in range(WORLD)}
    result_after: dict[int, float] = {}
    ended_after: dict[int, float] = {}  # seen ended by itself, seconds after the spawn
    killed = set()
    started = time.monotonic()
    try:
        for rank in range(WORLD):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_rank_main, args=(rank, port, part, opts, writer),
                               name=f"{part}-rank{rank}")
            proc.start()
            writer.close()
            procs.append(proc)
            readers.append(reader)
        waiting = {readers[rank]: rank for rank in wait_for}
        while waiting and (left := started + deadline_s - time.monotonic()) > 0:
            for conn in wait_connections(list(waiting), timeout=left):
                rank = waiting.pop(conn)
                try:
                    results[rank] = conn.recv()
                    result_after[rank] = round(time.monotonic() - started, 1)
                except EOFError:  # the process ended without a result
                    pass
        linger_end = time.monotonic() + linger_s
        for rank in wait_for:
            procs[rank].join(max(0.0, linger_end - time.monotonic()))
            if not procs[rank].is_alive():
                ended_after[rank] = round(time.monotonic() - started, 1)
        for rank, reader in enumerate(readers):  # the others' results, if they came
            if results[rank] is None and reader.poll():
                try:
                    results[rank] = reader.recv()
                except EOFError:
                    pass
    finally:
        for rank, proc in enumerate(procs):
            if proc.is_alive():
                proc.kill()
                killed.add(rank)
            proc.join(30)
        for reader in readers:
            reader.close()
    return {f"rank{rank}": {"result": results[rank],
                            "result_after_s": result_after.get(rank),
                            "process": {**_ended(procs[rank], rank in killed),
                                        "ended_after_s": ended_after.get(rank)}}
            for rank in range(WORLD)}


def _hook_steps_ok(report: dict) -> bool:
    for rank in range(WORLD):
        result = report[f"rank{rank}"]["result"]
        if not result or "error" in result:
            return False
        for name in ("comm_timeout_none", "comm_timeout_60"):
            if result[name]["stage"] != "compression" or result[name]["lockstep"] != "identical":
                return False
    return True


def _hierarchical_ok(report: dict) -> bool:
    results = [report[f"rank{rank}"]["result"] for rank in range(WORLD)]
    return all(r and "error" not in r and r["exact_mean_equal"] and all(r["calls_ok"])
               and all(r["ranks_identical"]) for r in results)


def _hung_rank_ok(report: dict, timeout: float) -> bool:
    result = report["rank0"]["result"]
    return bool(result and "error" not in result and result.get("communication_error")
                and result["seconds"] < timeout + RAISE_MARGIN_S)


def _hung_summary(report: dict, timeout: float) -> dict:
    """Rank 0 in a line: what it raised and when, and whether its process ended (NCCL's
    watchdog: SIGABRT) before it could report an exception."""
    rank0 = report["rank0"]
    result = rank0["result"] or {}
    return {"raised": result.get("raised"), "seconds": result.get("seconds"),
            "communication_error": result.get("communication_error"),
            "bound_s": timeout + RAISE_MARGIN_S,
            "ended_before_raising": rank0["result"] is None and
            rank0["process"]["ended"] != "killed by this script",
            "process": rank0["process"]["ended"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", default="gpu_check_out/gpu_check_nccl.json", help="the report")
    p.add_argument("--dim", type=int, help="width of the MLP (1024; 64 on the CPU)")
    p.add_argument("--layers", type=int, help="its linear layers (8; 2 on the CPU)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--bucket-mb", type=float,
                   help="DDP's bucket size, the momentum units' (4: 9 units of the 8.4M "
                        "parameters; 0.01 on the CPU)")
    p.add_argument("--steps", type=int, help="timed steady steps per setting (40; 4 on the CPU)")
    p.add_argument("--hang-timeout", type=float, default=5.0, help="comm_timeout of part 2")
    p.add_argument("--hang-sleep", type=float, default=90.0,
                   help="rank 1's sleep in part 2: past the watchdog's comm_timeout + 30 s")
    parts = ["hook_steps", "hierarchical", "hung_optimizer", "hung_ddp_hook"]
    p.add_argument("--parts", nargs="*", default=parts, choices=parts)
    args = p.parse_args()
    cpu = args.device == "cpu"
    opts = {"backend": args.backend, "device": args.device, "batch": args.batch,
            "dim": args.dim or (64 if cpu else 1024), "layers": args.layers or (2 if cpu else 8),
            "bucket_mb": args.bucket_mb or (0.01 if cpu else 4.0),
            "steps": args.steps or (4 if cpu else 40), "freeze_step": 3,
            "hang_timeout": args.hang_timeout, "hang_sleep": args.hang_sleep}
    report = {"torch": torch.__version__, "backend": args.backend, "device": args.device,
              "settings": opts,
              "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get(
                  "TORCH_NCCL_ASYNC_ERROR_HANDLING", "unset (torch's default)")}
    if not cpu:
        count = torch.cuda.device_count()
        if count < WORLD:
            print(f"gpu_check_nccl: needs two GPUs, found {count}", file=sys.stderr)
            sys.exit(2)
        report["gpus"] = [torch.cuda.get_device_name(i) for i in range(WORLD)]
        version = torch.cuda.nccl.version()
        report["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) \
            else str(version)
    print(json.dumps({k: report[k] for k in report if k != "settings"}), flush=True)
    # Two processes: torch, CUDA, NCCL, Triton compiling, the warm-up steps. The parts' limits
    # add up to at most about 520 s, inside a lent machine's 10 minutes per command.
    startup_s = 90.0
    checks = {}
    out_dir = os.path.dirname(args.out) or "."
    os.makedirs(out_dir, exist_ok=True)
    for part in args.parts:
        started = time.perf_counter()
        try:
            if part == "hook_steps":
                report[part] = run_part("hook_steps", opts, (0, 1), startup_s + 120, 30)
                checks[part] = _hook_steps_ok(report[part])
            elif part == "hierarchical":
                report[part] = run_part("hierarchical", opts, (0, 1), startup_s + 60, 30)
                checks[part] = _hierarchical_ok(report[part])
            else:
                path = part.removeprefix("hung_")
                report[part] = run_part(f"hung:{path}", opts, (0,),
                                        startup_s + args.hang_timeout + RAISE_MARGIN_S, 15)
                checks[part] = _hung_rank_ok(report[part], args.hang_timeout)
                report[part]["summary"] = _hung_summary(report[part], args.hang_timeout)
        except Exception:  # noqa: BLE001 - reported, the next part runs
            report[part] = {"error": traceback.format_exc()[-2000:]}
            checks[part] = False
        report[f"{part}_seconds"] = round(time.perf_counter() - started, 1)
        print(json.dumps({part: report[part], "ok": checks[part]}), flush=True)
        report["ok"] = checks
        with open(args.out, "w") as f:  # after every part: a run cut short keeps what it saw
            json.dump(report, f, indent=1)
    path = append_run("gpu_check_nccl", None, report)
    with open(os.path.join(out_dir, "gpu_check_nccl_record.json"), "w") as f:
        f.write(json.dumps(read_runs("gpu_check_nccl")[-1], separators=(",", ":")) + "\n")
    print(f"gpu_check_nccl: {checks}; report in {args.out}, the run appended to {shown(path)}",
          flush=True)
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
