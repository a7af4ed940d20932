"""Run a function on N gloo ranks in forked processes and collect what each returns."""

from __future__ import annotations

import io
import os
import random
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Rendezvous ports come from below the kernel's ephemeral range (32768-60999 here), which every
# bind(0) draws from: gloo's pair listeners, store clients, and the port Lightning's launcher
# picks for its ranks seconds before they bind it. A port taken from that range and released
# for the ranks to bind later could be handed to another job of the parallel test run in the
# meantime; a full `make test` once failed so (2026-12-06: a 4-rank test's gloo full mesh
# "Connection closed by peer" beside a Lightning run). torchrun's default 29500 is avoided.
_PORTS = [p for p in range(20000, 32000) if not 29400 <= p < 29700]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 below the ephemeral range (drawn at random, checked)."""
    for port in random.sample(_PORTS, 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # all taken: any port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, queue, args):
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            # Plain bytes: torch's queues would share tensors through file descriptors that
            # vanish when this process exits before the parent reads them.
            payload = io.BytesIO()
            torch.save(fn(rank, world_size, *args), payload)
            queue.put((rank, "ok", payload.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world_size: int, *args, timeout: float = 180.0,
              allow_missing: bool = False, start_method: str = "fork") -> list:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return their results
    in rank order. Fork start keeps each launch well under a second; a rank that raises fails
    the caller with that rank's traceback. With ``allow_missing`` a rank that exits without a
    result (a fault test killing it) yields None instead of failing.

    A rank that runs torch ops on more than one thread needs ``start_method="spawn"`` (a few
    seconds more per launch): once the parent (the pytest worker) has run an OpenMP parallel
    region, a forked child's own parallel region waits forever on the parent's thread pool,
    which fork did not copy (libgomp is not fork-safe)."""
    ctx = mp.get_context(start_method)
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, queue, args), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        if time.monotonic() > deadline:
            break
        if queue.empty():
            if not any(p.is_alive() for p in procs) and queue.empty():
                break
            time.sleep(0.01)
            continue
        rank, status, value = queue.get()
        if status == "ok":
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        else:
            errors.append(f"rank {rank}:\n{value}")
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    if len(results) != world_size and not allow_missing:
        raise RuntimeError(
            f"only ranks {sorted(results)} of {world_size} finished within {timeout:.0f} s"
        )
    return [results.get(r) for r in range(world_size)]


def assert_ranks_identical(per_rank: list, what: str = "tensors") -> None:
    """Every rank's tensors (a tensor, or a list/dict of them) are bitwise equal to rank 0's."""
    first = per_rank[0]
    for rank, other in enumerate(per_rank[1:], start=1):
        _assert_equal(first, other, f"{what}: rank {rank} differs from rank 0")


def _assert_equal(a, b, msg):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), msg
        for k in a:
            _assert_equal(a[k], b[k], f"{msg} at {k!r}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), msg
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{msg} at [{i}]")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), msg
    else:
        assert a == b, msg


def counting_collectives(world: int, sent: list) -> tuple:
    """Wrap torch's collectives to count in ``sent[0]`` the bytes this rank hands to other
    ranks: an all-to-all's rows for the others, a ring allreduce's 2 (W - 1) / W. Returns the
    real functions, to be put back (``dist.all_to_all_single, dist.all_reduce = real``)."""
    real = dist.all_to_all_single, dist.all_reduce

    def all_to_all_single(out, inp, *args, **kwargs):
        sent[0] += inp.nbytes * (world - 1) // world
        return real[0](out, inp, *args, **kwargs)

    def all_reduce(tensor, *args, **kwargs):
        sent[0] += 2 * (world - 1) * tensor.nbytes // world
        return real[1](tensor, *args, **kwargs)

    dist.all_to_all_single, dist.all_reduce = all_to_all_single, all_reduce
    return real


def counted_run(rank: int, world: int, net, model, opt, steps: int, batch, record,
                save=None, load=None) -> tuple[list, list, list]:
    """Train ``net`` (``model``, maybe wrapped) with ``opt`` on the MSE of ``batch(step,
    rank)``'s inputs and targets, from what :func:`resume` finds in ``load``; per step the bytes
    this rank handed to others (:func:`counting_collectives`), the parameters after it and
    ``record(opt)``; ``save`` ``(path, step)``: :func:`save_for_resume` after that step."""
    start = resume(load, rank, model, opt)
    sent = [0]
    real = counting_collectives(world, sent)
    after, per_step, recorded = [], [], []
    try:
        for step in range(start, steps):
            x, y = batch(step, rank)
            before = sent[0]
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            per_step.append(sent[0] - before)
            after.append([p.detach().clone() for p in model.parameters()])
            recorded.append(record(opt))
            if save is not None and step + 1 == save[1]:
                save_for_resume(save[0], rank, model, opt, step + 1)
    finally:
        dist.all_to_all_single, dist.all_reduce = real
    return after, per_step, recorded


def mean_square_steps(model, opt, steps: int):
    """Steps 1..``steps`` of ``opt`` on the mean square of ``model``'s output over fixed random
    batches of 32 x 8, one process; yields each step's number and the gradients it took (for
    the plain-torch references beside it)."""
    for t in range(1, steps + 1):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(t))
        opt.zero_grad()
        model(x).square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        yield t, grads


def save_for_resume(path: str, rank: int, model, opt, step: int) -> None:
    """This rank's model, optimizer and step count in ``<path>.<rank>``."""
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
               f"{path}.{rank}")


def resume(path: str | None, rank: int, model, opt) -> int:
    """Load what :func:`save_for_resume` wrote for this rank (nothing for ``path`` None);
    returns the step to continue from."""
    if path is None:
        return 0
    saved = torch.load(f"{path}.{rank}", weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    return saved["step"]


def _members(group) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else \
        list(range(dist.get_world_size()))


def counting_by_host(local: int, counts: dict) -> tuple:
    """Wrap the collectives: bytes this rank sends to other ranks, ``cross`` those to a rank on
    another host (host = rank // ``local``), ``host`` the rest. An all-to-all sends one row to
    each other member; gloo's allreduce and all-gather are rings, each rank sending to the next
    member only (2 (W - 1) / W of the tensor, and W - 1 parts); a reduce-scatter, (W - 1) / W
    of its input to the next. Returns the real functions for :func:`restore_collectives`."""
    real = (dist.all_to_all_single, dist.all_reduce, dist.all_gather_into_tensor,
            dist.reduce_scatter_tensor)

    def add(group, nbytes: int, ring: bool) -> None:
        members, me = _members(group), dist.get_rank()
        size = len(members)
        if ring:
            after = members[(members.index(me) + 1) % size]
            counts["cross" if after // local != me // local else "host"] += nbytes
            return
        for other in members:
            if other != me:
                counts["cross" if other // local != me // local else "host"] += nbytes // size

    def all_to_all_single(out, inp, *args, group=None, **kwargs):
        add(group, inp.nbytes, ring=False)
        return real[0](out, inp, *args, group=group, **kwargs)

    def all_reduce(tensor, *args, group=None, **kwargs):
        size = dist.get_world_size(group)
        add(group, 2 * (size - 1) * tensor.nbytes // size, ring=True)
        return real[1](tensor, *args, group=group, **kwargs)

    def all_gather_into_tensor(out, inp, *args, group=None, **kwargs):
        add(group, inp.nbytes * (dist.get_world_size(group) - 1), ring=True)
        return real[2](out, inp, *args, group=group, **kwargs)

    def reduce_scatter_tensor(out, inp, *args, group=None, **kwargs):
        size = dist.get_world_size(group)
        add(group, inp.nbytes * (size - 1) // size, ring=True)
        return real[3](out, inp, *args, group=group, **kwargs)

    (dist.all_to_all_single, dist.all_reduce, dist.all_gather_into_tensor,
     dist.reduce_scatter_tensor) = (all_to_all_single, all_reduce, all_gather_into_tensor,
                                    reduce_scatter_tensor)
    return real


def restore_collectives(real) -> None:
    (dist.all_to_all_single, dist.all_reduce, dist.all_gather_into_tensor,
     dist.reduce_scatter_tensor) = real
