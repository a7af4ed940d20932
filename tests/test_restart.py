"""Surviving a fault end to end: torchrun --max-restarts restarts the job after a rank is killed
(SIGKILL, compression stage); every rank resumes from the newest checkpoint all ranks wrote
(its own error buffers included) and the job ends where the uninterrupted run ends, bit for
bit."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.dist_helpers import assert_ranks_identical
from tests.procs import owned_processes

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
# torchrun shares its rendezvous store with the workers by default, and a restarted worker can
# read the previous attempt's gloo addresses from it ("connectFullMesh failed ... Connection
# refused"; pytorch/pytorch#135712). A store of the workers' own avoids that.
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _run(start, out: Path, *extra: str, nproc: int = 2) -> str:
    argv = [str(TORCHRUN), "--standalone", "--nproc_per_node", str(nproc), "--max-restarts", "1",
            str(ROOT / "examples" / "train_torchrun.py"), "--steps", "30", "--freeze-step", "8",
            "--eval-every", "30", "--ckpt-dir", str(out / "ckpt"), "--ckpt-every", "5",
            "--params-out", str(out / "params"), "--comm-timeout", "5", *extra]
    proc = start(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                 env=dict(os.environ, OMP_NUM_THREADS="1", **RESTARTABLE))
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    return output


def test_killed_rank_restarts_and_ends_where_the_uninterrupted_run_ends(tmp_path):
    with owned_processes() as start:
        _run(start, tmp_path / "straight")
        output = _run(start, tmp_path / "faulty", "--kill-at", "18", "--kill-rank", "1")
    assert "rank 1: killing itself before step 18" in output
    for rank in (0, 1):  # both ranks restarted and took the step-15 checkpoint
        assert f"rank {rank}: resumed from {tmp_path / 'faulty' / 'ckpt'} at step 15 " \
               "(attempt 1)" in output, output[-4000:]
    for rank in (0, 1):
        straight = torch.load(tmp_path / "straight" / f"params.rank{rank}.pt")
        faulty = torch.load(tmp_path / "faulty" / f"params.rank{rank}.pt")
        for a, b in zip(straight, faulty, strict=True):
            assert torch.equal(a, b)
    # Its step-30 checkpoint (compression stage) on 3 processes, 10 steps more (an elastic
    # restart): rank 2 takes rank 0's file, the error feedback restarts from zero, said once;
    # the 3 ranks compress on in lockstep.
    with owned_processes() as start:
        output = _run(start, tmp_path / "faulty", "--steps", "40", "--check-lockstep", "1",
                      nproc=3)
    assert output.count("error feedback restarts from zero") == 1, output[-4000:]
    assert "saved by 2 ranks on 3" in output
    for rank in (0, 1, 2):
        assert f"rank {rank}: resumed from {tmp_path / 'faulty' / 'ckpt'} at step 30" in output
    ends = [torch.load(tmp_path / "faulty" / f"params.rank{rank}.pt") for rank in range(3)]
    assert_ranks_identical(ends, "parameters")
