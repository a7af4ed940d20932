"""A rank that dies or hangs mid-step: the others raise a clear error within the timeout."""

import os
import time

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from onebit_plugin import OneBitAdam, register_onebit_hook
from tests.dist_helpers import run_ranks

TIMEOUT = 2.0
FAULT_STEP = 4  # compression stage (freeze at 2)


def _worker(rank, world, use_hook, fault):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    if use_hook:
        model = DDP(model)
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm_timeout=TIMEOUT)
    if use_hook:
        register_onebit_hook(model, opt)
    for step in range(8):
        if step == FAULT_STEP and rank == 1:
            if fault == "die":
                os._exit(1)
            time.sleep(3 * TIMEOUT)  # hang past the others' timeout
            return "hung"
        start = time.monotonic()
        try:
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
        except RuntimeError as exc:  # DDP re-raises a hook's CommunicationError as RuntimeError
            return step, time.monotonic() - start, f"{type(exc).__name__}: {exc}"
    return "finished"


@pytest.mark.parametrize("use_hook", [False, True], ids=["optimizer-side", "ddp-hook"])
@pytest.mark.parametrize("fault", ["hang", "die"])
def test_survivor_fails_clearly_within_the_timeout(use_hook, fault):
    results = run_ranks(_worker, 2, use_hook, fault, timeout=60, allow_missing=True)
    step, elapsed, message = results[0]
    assert step == FAULT_STEP
    assert elapsed < TIMEOUT + 3.0, elapsed
    assert "CommunicationError" in message  # the type, or its name inside DDP's wrapper
    assert "onebit:" in message and "failed on rank 0 of 2" in message
    assert "Resume from the last checkpoint" in message


def _checkpointing_worker(rank, world, tmp, fault):
    """Save every rank's state after each step; with ``fault``, rank 1 dies at FAULT_STEP."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm_timeout=TIMEOUT)
    start = 0
    path = f"{tmp}/rank{rank}.pt"
    if not fault:  # the restarted job: resume from the last checkpoint
        ckpt = torch.load(path)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start = ckpt["step"]
    for step in range(start, 8):
        if fault and step == FAULT_STEP and rank == 1:
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
    return [p.detach() for p in model.parameters()]


def test_training_resumes_from_the_last_checkpoint_after_a_fault(tmp_path):
    first = run_ranks(_checkpointing_worker, 2, str(tmp_path), True, timeout=60,
                      allow_missing=True)
    assert first == [f"failed at step {FAULT_STEP}: CommunicationError", None]
    resumed = run_ranks(_checkpointing_worker, 2, str(tmp_path), False)
    # Both ranks finish from their own checkpoints of step FAULT_STEP, in lockstep.
    for a, b in zip(*resumed, strict=True):
        assert torch.equal(a, b)
