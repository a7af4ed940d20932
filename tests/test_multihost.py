"""Two hosts as network namespaces: torchrun's multi-node rendezvous, a run that completes, a cut
link that the workers report within the timeout and exit on, and the relaunched job that resumes
from its checkpoints and ends where the complete run ended."""

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests import netns
from tests.procs import owned_processes, tagged

REASON = netns.available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
PORT = "29517"
PORT_AGAIN = "29518"  # a store port of its own, apart from the first job's


def _node(start, host, master, rank: int, out: Path, *args: str, port: str = PORT):
    argv = [str(TORCHRUN), "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(rank),
            "--master_addr", master.address, "--master_port", port,
            str(ROOT / "examples" / "train_torchrun.py"), "--json", str(out), *args]
    env_argv = ["env", f"GLOO_SOCKET_IFNAME={host.ifname}", "OMP_NUM_THREADS=1",
                f"ONEBITTEST_HOST={host.netns}", *argv]
    return start(host.command(env_argv), cwd=ROOT, stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT, text=True)


def _workers(tag: str, host) -> list[int]:
    return [pid for pid in tagged(tag, f"ONEBITTEST_HOST={host.netns}")
            if "train_torchrun.py" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
            and "torchrun\0" not in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")]


STEPS = ["--steps", "60", "--freeze-step", "10", "--eval-every", "60"]


def test_two_hosts_train_then_survive_a_cut_link(tmp_path):
    """1. a complete run; 2. the same run, checkpointing every 5 steps, with host b's link cut
    after the step-20 checkpoint: both workers report or exit within the timeout, and both
    torchrun agents end non-zero (b's rendezvous store is across the cut, so torchrun cannot
    restart in place); 3. the link comes back and the job is launched again, as a cluster
    scheduler would: it resumes from the newest checkpoint both ranks wrote (each its own error
    buffers) and ends bit for bit where the complete run ended."""
    with netns.emulated_hosts(2) as (a, b), owned_processes() as start:
        # 1. A complete run across the two hosts.
        procs = [_node(start, h, a, r, tmp_path / f"run{r}.json", *STEPS,
                       "--params-out", str(tmp_path / "straight"))
                 for r, h in enumerate((a, b))]
        outputs = [p.communicate(timeout=240)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outputs
        summary = json.loads((tmp_path / "run0.json").read_text())
        assert summary["world_size"] == 2 and summary["steps"] == 60
        assert summary["compression_stage_bytes"] <= 0.033 * summary[
            "compression_stage_dense_bytes"]

        # 2. The same run with checkpoints; in the compression stage host b's link goes down.
        faulty = [*STEPS, "--comm-timeout", "3", "--ckpt-dir", str(tmp_path / "ckpt"),
                  "--ckpt-every", "5", "--params-out", str(tmp_path / "faulty")]
        procs = [_node(start, h, a, r, tmp_path / f"cut{r}.json", *faulty)
                 for r, h in enumerate((a, b))]
        lines: list[str] = []
        checkpointed, failed = threading.Event(), threading.Event()

        def read():
            for line in procs[0].stdout:
                lines.append(line)
                if "step 20: checkpoint written" in line:
                    checkpointed.set()
                if "CommunicationError" in line:
                    failed.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert checkpointed.wait(120), "".join(lines)[-3000:]
        b.cut_link()
        cut_at = time.monotonic()
        # The worker reports at once; then every worker process ends by itself.
        assert failed.wait(60), "".join(lines)[-3000:]
        reported_after = time.monotonic() - cut_at
        gone = {}
        while len(gone) < 2 and time.monotonic() - cut_at < 60:
            for host in (a, b):
                if host.netns not in gone and not _workers(start.tag, host):
                    gone[host.netns] = time.monotonic() - cut_at
            time.sleep(0.1)
        agent_a_code = procs[0].wait(timeout=60)
        agent_a_after = time.monotonic() - cut_at
        agent_b_code = procs[1].wait(timeout=60)  # its rendezvous store is across the cut
        agent_b_after = time.monotonic() - cut_at
        reader.join(timeout=10)

        # 3. The link is back; the job is launched again and resumes from the checkpoints.
        b.restore_link()
        procs = [_node(start, h, a, r, tmp_path / f"again{r}.json", *faulty, port=PORT_AGAIN)
                 for r, h in enumerate((a, b))]
        again = [p.communicate(timeout=240)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], again
    text = "".join(lines)
    assert "onebit:" in text and "failed on rank 0 of 2 (timeout 3 s)" in text, text[-3000:]
    # The 3 s collective timeout plus the step that was already on the wire.
    print(f"survivor reported the cut link after {reported_after:.1f} s; workers gone after "
          f"{gone}; host a's torchrun exited {agent_a_code} after {agent_a_after:.1f} s, "
          f"host b's {agent_b_code} after {agent_b_after:.1f} s")
    assert reported_after < 10, reported_after
    assert len(gone) == 2 and max(gone.values()) < 3 + 10, gone
    assert agent_a_code != 0 and agent_a_after < 3 + 10, (agent_a_code, agent_a_after)
    assert agent_b_code != 0 and agent_b_after < 3 + 10, (agent_b_code, agent_b_after)
    resumed = [int(m) for m in re.findall(r"rank \d: resumed from \S+ at step (\d+)",
                                             "".join(again))]
    print(f"relaunched job resumed at step {resumed}")
    assert len(resumed) == 2 and len(set(resumed)) == 1 and 20 <= resumed[0] < 60, again
    for rank in (0, 1):
        straight = torch.load(tmp_path / f"straight.rank{rank}.pt")
        relaunched = torch.load(tmp_path / f"faulty.rank{rank}.pt")
        for x, y in zip(straight, relaunched, strict=True):
            assert torch.equal(x, y)
