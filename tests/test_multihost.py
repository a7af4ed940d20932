"""Two hosts as network namespaces: torchrun's multi-node rendezvous, a run that completes, and
a cut link that the workers report within the timeout and exit on."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests import netns
from tests.procs import owned_processes, tagged

REASON = netns.available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
PORT = "29517"


def _node(start, host, master, rank: int, out: Path, *args: str) -> subprocess.Popen:
    argv = [str(TORCHRUN), "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(rank),
            "--master_addr", master.address, "--master_port", PORT,
            str(ROOT / "examples" / "train_torchrun.py"), "--json", str(out), *args]
    env_argv = ["env", f"GLOO_SOCKET_IFNAME={host.ifname}", "OMP_NUM_THREADS=1",
                f"ONEBIT_TEST_HOST={host.netns}", *argv]
    return start(host.command(env_argv), cwd=ROOT, stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT, text=True)


def _workers(tag: str, host) -> list[int]:
    return [pid for pid in tagged(tag, f"ONEBIT_TEST_HOST={host.netns}")
            if "train_torchrun.py" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
            and "torchrun\0" not in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")]


def test_two_hosts_train_then_survive_a_cut_link(tmp_path):
    with netns.emulated_hosts(2) as (a, b), owned_processes() as start:
        # 1. A complete run across the two hosts.
        args = ["--steps", "40", "--freeze-step", "10", "--eval-every", "40"]
        procs = [_node(start, h, a, r, tmp_path / f"run{r}.json", *args)
                 for r, h in enumerate((a, b))]
        outputs = [p.communicate(timeout=240)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outputs
        summary = json.loads((tmp_path / "run0.json").read_text())
        assert summary["world_size"] == 2 and summary["steps"] == 40
        assert summary["compression_stage_bytes"] <= 0.033 * summary[
            "compression_stage_dense_bytes"]

        # 2. A long run; once compression has started, host b's link goes down.
        args = ["--steps", "100000", "--freeze-step", "5", "--eval-every", "1000000",
                "--comm-timeout", "3"]
        procs = [_node(start, h, a, r, tmp_path / f"cut{r}.json", *args)
                 for r, h in enumerate((a, b))]
        lines: list[str] = []
        started, failed = threading.Event(), threading.Event()

        def read():
            for line in procs[0].stdout:
                lines.append(line)
                if "compression stage starts" in line:
                    started.set()
                if "CommunicationError" in line:
                    failed.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert started.wait(120), "".join(lines)[-3000:]
        time.sleep(0.5)
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
