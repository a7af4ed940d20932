"""Start one torchrun node per emulated host (benchmarks/cluster.py's network namespaces, each
link limited with ``tc tbf``), or all ranks over loopback without root, and return their output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_ranks(argv: list[str], hosts: int, rate: str, port: int,
              timeout: float = 900) -> tuple[str, list[str]]:
    """Run ``argv`` (a script and its arguments) as ``hosts`` torchrun ranks of one thread each.
    Returns a description of the network and every node's output; raises SystemExit with the
    tails of the outputs when a rank fails. The namespaces are removed afterwards."""
    sys.path.insert(0, str(ROOT))
    from tests import netns

    torchrun = str(Path(sys.executable).with_name("torchrun"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    reason = netns.available()
    if reason is not None:
        print(f"no emulated hosts ({reason}): all ranks over loopback, unlimited")
        procs = [subprocess.Popen([torchrun, "--nproc_per_node", str(hosts), "--master_port",
                                   str(port), *argv], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)]
        outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
        network = "loopback (no bandwidth limit: not root)"
    else:
        with netns.emulated_hosts(hosts, rate=rate) as emulated:
            procs = [subprocess.Popen(
                host.command(["env", f"GLOO_SOCKET_IFNAME={host.ifname}", torchrun, "--nnodes",
                              str(hosts), "--nproc_per_node", "1", "--node_rank", str(rank),
                              "--master_addr", emulated[0].address, "--master_port", str(port),
                              *argv]),
                env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                for rank, host in enumerate(emulated)]
            outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
        network = f"{rate} per host link (tc tbf)"
    if any(proc.returncode for proc in procs):
        raise SystemExit("a rank failed:\n" + "\n".join(out[-2000:] for out in outputs))
    return network, outputs
