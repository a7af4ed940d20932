"""Start one torchrun node per emulated host (benchmarks/cluster.py's network namespaces, each
link limited with ``tc tbf``), or all ranks over loopback without root, and return their output.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # so that the cleanup below runs


def run_ranks(argv: list[str], hosts: int, rate: str, port: int,
              timeout: float = 900, per_host: int = 1) -> tuple[str, list[str]]:
    """Run ``argv`` (a script and its arguments) as ``hosts`` torchrun nodes of ``per_host``
    ranks each (every rank one thread; a node's ranks share its namespace, so their traffic to
    each other stays inside the host).
    Returns a description of the network and every node's output; raises SystemExit with the
    tails of the outputs when a rank fails. Every process started, torchrun's workers included
    (they run in sessions of their own), is tagged and killed if this function leaves early (a
    timeout, Ctrl-C, SIGTERM), and the namespaces are removed, in every case
    (tests/procs.py's ``owned_processes``, tests/netns.py)."""
    sys.path.insert(0, str(ROOT))
    from tests import netns
    from tests.procs import owned_processes

    torchrun = str(Path(sys.executable).with_name("torchrun"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        with contextlib.ExitStack() as stack:
            reason = netns.available()
            # Entered first, left last: the processes are killed before their namespaces go.
            emulated = None if reason else stack.enter_context(
                netns.emulated_hosts(hosts, rate=rate))
            start = stack.enter_context(owned_processes())

            def run(cmd):
                return start(cmd, env=env, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)

            if emulated is None:
                print(f"no emulated hosts ({reason}): all ranks over loopback, unlimited")
                procs = [run([torchrun, "--nproc_per_node", str(hosts * per_host),
                              "--master_port",
                              str(port), *argv])]
                network = "loopback (no bandwidth limit: not root)"
            else:
                procs = [run(host.command([
                    "env", f"GLOO_SOCKET_IFNAME={host.ifname}", torchrun, "--nnodes",
                    str(hosts), "--nproc_per_node", str(per_host), "--node_rank", str(rank),
                    "--master_addr", emulated[0].address, "--master_port", str(port),
                    *argv])) for rank, host in enumerate(emulated)]
                network = f"{rate} per host link (tc tbf)"
            outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        signal.signal(signal.SIGTERM, previous)
    if any(proc.returncode for proc in procs):
        raise SystemExit("a rank failed:\n" + "\n".join(out[-2000:] for out in outputs))
    return network, outputs
