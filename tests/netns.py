"""Several "hosts" on one machine: network namespaces joined by a bridge (root only).

Each host is a namespace with one veth link to a bridge in a "switch" namespace, an address in
198.18.0.0/24 (RFC 2544's benchmarking range: never routed anywhere, the traffic stays inside
namespaces this helper made) and optionally a ``tc tbf`` bandwidth limit on its link. Everything
is removed on exit, also when the body fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    probe = f"obprobe{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"cannot create a network namespace: {getattr(exc, 'stderr', exc)}"
    _ip("netns", "del", probe)
    return None


@dataclass
class Host:
    netns: str
    ifname: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def cut_link(self) -> None:
        _ip("-n", self.netns, "link", "set", self.ifname, "down")

    def restore_link(self) -> None:
        _ip("-n", self.netns, "link", "set", self.ifname, "up")


@contextlib.contextmanager
def emulated_hosts(count: int, rate: str | None = None, delay: str | None = None):
    """Yield ``count`` Hosts on one bridge; ``rate`` (e.g. "1gbit") limits each host's outgoing
    link with tc tbf, ``delay`` (e.g. "1ms") adds netem latency in front of it."""
    tag = uuid.uuid4().hex[:5]
    switch = f"ob{tag}sw"
    made = []
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        hosts = []
        for i in range(count):
            netns = f"ob{tag}h{i}"
            _ip("netns", "add", netns)
            made.append(netns)
            host_end, switch_end = f"ob{tag}h{i}", f"ob{tag}s{i}"
            _ip("link", "add", host_end, "type", "veth", "peer", "name", switch_end)
            _ip("link", "set", host_end, "netns", netns)
            _ip("link", "set", switch_end, "netns", switch)
            _ip("-n", switch, "link", "set", switch_end, "master", "br0")
            _ip("-n", switch, "link", "set", switch_end, "up")
            address = f"198.18.0.{i + 1}"
            _ip("-n", netns, "addr", "add", f"{address}/24", "dev", host_end)
            _ip("-n", netns, "link", "set", host_end, "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            tc = ["ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", host_end]
            parent = ["root"]
            if delay is not None:
                subprocess.run([*tc, "root", "handle", "1:", "netem", "delay", delay],
                               check=True, capture_output=True, timeout=30)
                parent = ["parent", "1:"]
            if rate is not None:
                subprocess.run([*tc, *parent, "handle", "2:", "tbf", "rate", rate, "burst",
                                "256kb", "latency", "50ms"],
                               check=True, capture_output=True, timeout=30)
            hosts.append(Host(netns, host_end, address))
        yield hosts
    finally:
        for netns in reversed(made):  # deleting a namespace removes its veth ends too
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)
