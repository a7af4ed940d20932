"""A rank that dies or hangs mid-step: the others raise a clear error within the timeout and
exit; a job restarted from the last checkpoints finishes in lockstep."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from onebit_plugin import OneBitAdam
from tests.dist_helpers import assert_ranks_identical, free_port, run_ranks
from tests.procs import owned_processes

ROOT = Path(__file__).resolve().parents[1]

TIMEOUT = 2.0
FAULT_STEP = 4  # compression stage (freeze at 2)


def _launch(start, path: str, fault: str):
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        argv = [sys.executable, "-m", "tests.fault_worker", path, fault, str(TIMEOUT),
                str(FAULT_STEP)]
        procs.append(start(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True))
    return procs


@pytest.mark.parametrize("path", ["plain", "hook"], ids=["optimizer-side", "ddp-hook"])
@pytest.mark.parametrize("fault", ["hang", "die"])
def test_survivor_fails_clearly_and_exits_within_the_timeout(path, fault):
    """The survivor raises CommunicationError within the timeout and its process ends, non-zero,
    within TIMEOUT + 10 s of the fault: its collectives ran on a group whose own backend timeout
    is comm_timeout, so gloo's threads do not keep the interpreter from exiting."""
    with owned_processes() as start:
        survivor, faulty = _launch(start, path, fault)
        # "FAULT", printed just before it dies or hangs, maybe after log lines (without the C
        # compiler or with ONEBIT_CPU_KERNEL=0, the torch passes are said once). Line by line,
        # no read(): the hung rank's pipe never ends.
        before = []
        while (line := faulty.stdout.readline()) and line.strip() != "FAULT":
            before.append(line)
        fault_at = time.monotonic()
        assert line.strip() == "FAULT", "".join(before)
        output, _ = survivor.communicate(timeout=TIMEOUT + 30)
        exited_after = time.monotonic() - fault_at
    assert survivor.returncode not in (0, None), output
    assert exited_after < TIMEOUT + 10, (exited_after, output[-3000:])
    raised = re.search(rf"RAISED step={FAULT_STEP} after=([0-9.]+)", output)
    assert raised and float(raised.group(1)) < TIMEOUT + 3.0, output[-3000:]
    assert "CommunicationError" in output  # the type, or its name inside DDP's wrapper
    assert "onebit:" in output and "failed on rank 0 of 2" in output
    assert "Resume from the last checkpoint" in output


def _checkpointing_worker(rank, world, tmp, run):
    """Save every rank's state after each step. ``run``: "fault" (rank 1 dies at FAULT_STEP),
    "resume" (the restarted job, from the last checkpoint) or "whole" (uninterrupted)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm_timeout=TIMEOUT)
    start = 0
    path = f"{tmp}/rank{rank}.pt"
    if run == "resume":
        ckpt = torch.load(path)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start = ckpt["step"]
    for step in range(start, 8):
        if run == "fault" and step == FAULT_STEP and rank == 1:
            os._exit(1)
        try:
            opt.zero_grad()
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).sum().backward()
            opt.step()
        except RuntimeError as exc:
            return f"failed at step {step}: {type(exc).__name__}"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1},
                   path)
    return start, opt.global_step, [p.detach() for p in model.parameters()]


def test_training_resumes_from_the_last_checkpoint_after_a_fault(tmp_path):
    (tmp_path / "job").mkdir()
    first = run_ranks(_checkpointing_worker, 2, str(tmp_path / "job"), "fault", timeout=60,
                      allow_missing=True)
    assert first == [f"failed at step {FAULT_STEP}: CommunicationError", None]
    resumed = run_ranks(_checkpointing_worker, 2, str(tmp_path / "job"), "resume")
    (tmp_path / "whole").mkdir()
    whole = run_ranks(_checkpointing_worker, 2, str(tmp_path / "whole"), "whole")
    # Both ranks resume from their own checkpoints of step FAULT_STEP and end bit for bit where
    # the uninterrupted job ends (each rank's own error buffers came back).
    for (start, steps, params), (_, whole_steps, whole_params) in zip(resumed, whole,
                                                                      strict=True):
        assert start == FAULT_STEP and steps == whole_steps == 8
        for a, b in zip(params, whole_params, strict=True):
            assert torch.equal(a, b)


class _TimedOut:
    def is_completed(self):  # a work that failed is completed
        return True

    def wait(self, timeout=None):
        raise RuntimeError("Timed out waiting 2000ms for recv operation to complete")


class _Work:
    """A collective that completes after ``polls`` checks (never for None)."""

    def __init__(self, polls):
        self.polls, self.checks, self.waits = polls, 0, []

    def is_completed(self):
        self.checks += 1
        return self.polls is not None and self.checks > self.polls

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return True


@pytest.mark.parametrize("backend", ["gloo", "nccl", "cpu:gloo,cuda:nccl"])
def test_an_nccl_wait_with_comm_timeout_polls_instead_of_sleeping_a_millisecond(monkeypatch,
                                                                              backend):
    """NCCL's wait(timeout) sleeps 1 ms between its checks: at least 1 ms per exchange. On
    NCCL the wait polls the work's completion with pauses from 10 us up, then waits without a
    timeout (which raises the work's error and orders the stream); a work still running at
    comm_timeout raises CommunicationError and aborts the group. gloo's wait(timeout) wakes
    when the work ends and is used as it is."""
    from datetime import timedelta

    import torch.distributed as dist

    from onebit_plugin.comm import collectives as allreduce

    aborted, slept = [], []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", aborted.append)
    monkeypatch.setattr(allreduce, "_sleep", slept.append)
    limit = timedelta(seconds=60)
    works = [_Work(4), _Work(0)]
    allreduce.wait_collectives(works, limit, "a test", object())
    if backend == "gloo":
        assert [w.waits for w in works] == [[limit], [limit]] and slept == []
        return
    assert [w.waits for w in works] == [[None], [None]]
    # 5 checks of the first work and 1 of the second (done by then): 70 us asleep in all,
    # where NCCL's own wait(timeout) would have slept 1 ms after each of the first 4 checks.
    assert works[0].checks == 5 and works[1].checks == 1
    assert slept == [0.0, 1e-5, 2e-5, 4e-5]
    group = object()
    with pytest.raises(allreduce.CommunicationError, match=r"timeout 0.05 s.*not completed"):
        allreduce.wait_collectives([_Work(None)], timedelta(seconds=0.05), "a test", group)
    assert aborted == [group] and max(slept) == 1e-3  # pauses stop doubling at 1 ms


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_a_timed_out_group_is_aborted_on_nccl_only(monkeypatch, backend):
    """What the CPU can show of the NCCL error path: the group whose collective failed is
    aborted before CommunicationError is raised when (and only when) it is an NCCL group."""
    from datetime import timedelta

    import torch.distributed as dist

    from onebit_plugin.comm import collectives as allreduce

    aborted = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", aborted.append)
    group = object()
    with pytest.raises(allreduce.CommunicationError, match="failed on rank 0 of 2"):
        allreduce.wait_collectives([_TimedOut()], timedelta(seconds=2), "a test", group)
    assert aborted == ([group] if backend == "nccl" else [])


@pytest.mark.parametrize("backend", ["gloo", "nccl", "cpu:gloo,cuda:nccl"])
def test_nccl_watchdog_waits_longer_than_comm_timeout(monkeypatch, backend):
    """NCCL's watchdog ends the process at its group's timeout; OneBitAdam's group gives it
    2 x comm_timeout (at least +30 s) so that CommunicationError, which every wait raises at
    comm_timeout, comes first. gloo's group keeps comm_timeout: it is what ends a stuck op."""
    from datetime import timedelta

    import torch.distributed as dist

    from onebit_plugin.comm.collectives import new_group

    made = []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "new_group", lambda ranks=None, timeout=None: made.append(timeout))
    new_group(None, timedelta(seconds=3))
    new_group(None, timedelta(seconds=100))
    if "nccl" in backend:  # also a backend per device: CUDA tensors go to NCCL
        assert made == [timedelta(seconds=33), timedelta(seconds=200)]
    else:
        assert made == [timedelta(seconds=3), timedelta(seconds=100)]



@pytest.mark.parametrize("backend,device,eager", [
    ("nccl", "cuda:0", True), ("nccl", "cpu", False), ("gloo", "cuda:0", False)])
def test_an_nccl_group_makes_its_communicator_when_it_is_made(monkeypatch, backend, device,
                                                               eager):
    """NCCL makes a communicator at a group's first collective unless the group is bound to a
    device: the optimizer's group is bound to its parameters' GPU, so a run resumed straight
    into the compression stage does not make it on the background thread inside backward."""
    import torch.distributed as dist

    from onebit_plugin.comm.collectives import new_group

    made = []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "new_group", lambda **kwargs: made.append(kwargs))
    new_group(None, None, torch.device(device))
    assert made == [{"ranks": None, "timeout": None,
                     **({"device_id": torch.device(device)} if eager else {})}]

@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_lightnings_default_group_gets_the_same_timeout_as_the_optimizers(monkeypatch, backend):
    """strategy="onebit_adam" with comm_timeout bounds the default group (Lightning's and DDP's
    collectives) too: with comm_timeout itself on gloo, but on NCCL with the optimizer group's
    longer timeout, or the watchdog would end the process before CommunicationError."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    pytest.importorskip("pytorch_lightning")
    from onebit_plugin.integrations.lightning import classes_for

    strategy_cls = classes_for("pytorch_lightning")[0]
    given = []
    monkeypatch.setattr(c10d, "_set_pg_timeout", lambda timeout, group=None: given.append(timeout))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    fake = SimpleNamespace(_user_timeout=None, world_size=2, _timeout=None)
    strategy_cls._bound_default_group(fake, timedelta(seconds=3))
    assert given == [timedelta(seconds=33 if backend == "nccl" else 3)]

def _data_parallel_subgroup_worker(rank, world):
    """4 ranks as 2 data-parallel groups of 2 (beside, say, tensor parallelism): only the
    first group's OneBitAdam has comm_timeout, so only ranks 0 and 1 make a group of their own,
    at their first step; ranks 2 and 3 train plain Adam on theirs meanwhile."""
    from datetime import timedelta

    import torch.distributed as dist

    groups = [dist.new_group(ranks=[0, 1]), dist.new_group(ranks=[2, 3])]
    mine = groups[rank // 2]
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    if rank < 2:
        opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm_timeout=20,
                         process_group=mine)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(3, 8, generator=gen)).square().sum().backward()
        if rank >= 2:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=mine)
        opt.step()
    # A group every rank makes afterwards (a checkpoint's gloo group, the user's own): its name
    # comes from a count of the groups made so far, so it meets only if every rank counted
    # the same.
    everyone = dist.new_group(timeout=timedelta(seconds=20))
    total = torch.ones(1)
    dist.all_reduce(total, group=everyone)
    return ([p.detach().clone() for p in model.parameters()], getattr(opt, "stage", None),
            float(total))


def test_a_data_parallel_subgroup_makes_its_own_group_alone():
    """new_group(ranks=subset) must be entered by every process of the world, in the same
    order, unless it synchronizes locally: without that, ranks 0 and 1 counted one group more
    than 2 and 3, and the next group every rank made never met (gloo: a timeout; with
    TORCH_DIST_INIT_BARRIER=1 the subgroup itself hangs)."""
    results = run_ranks(_data_parallel_subgroup_worker, 4, timeout=90)
    assert [stage for _, stage, _ in results] == ["compression", "compression", None, None]
    assert_ranks_identical([params for params, _, _ in results[:2]], "group 0's parameters")
    assert [total for _, _, total in results] == [4.0] * 4


def test_the_integrations_collect_garbage_right_before_the_group_is_destroyed(monkeypatch):
    """gloo's exit race (docs/limits.md): once an integration has paired an optimizer, the
    default group's destroy_process_group() (Lightning's at exit, Accelerate's end_training,
    a script's own) runs gc.collect() first, once per call; another group's does not."""
    import gc

    import torch.distributed as dist

    from onebit_plugin.integrations import ddp_strategies

    calls = []
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: calls.append(group))
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect"))
    monkeypatch.setattr(ddp_strategies, "_SETTLING", [])
    ddp_strategies.settle_before_teardown()
    ddp_strategies.settle_before_teardown()  # once per process: not wrapped twice
    dist.destroy_process_group()
    dist.destroy_process_group("a subgroup")
    assert calls == ["collect", None, "a subgroup"]
