"""Processes that tests start and own. Each process started here, and everything it starts
(launchers such as torchrun put their workers in sessions of their own, and a worker whose
launcher died is reparented), carries a tag in its environment; at the end every tagged
process is killed and the test fails if one is still alive."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid

TAG = "ONEBITTEST_OWNER"


def tagged(tag: str, extra: str = "") -> list[int]:
    """Pids of live (not zombie) processes whose environment holds ``TAG=tag`` and, when given,
    the text ``extra`` (another variable, e.g. ``GLOO_SOCKET_IFNAME=eth0``)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and f"{TAG}={tag}".encode() in env and (
            not extra or extra.encode() in env
        ):
            found.append(int(entry))
    return found


@contextlib.contextmanager
def owned_processes():
    """Yield ``start(argv, **popen_kwargs) -> Popen``, which starts a tagged process in a new
    session, and exposes ``start.tag``. On exit every tagged process is killed, the started ones
    are reaped, and the test fails if anything tagged is still alive 10 s later."""
    tag = uuid.uuid4().hex

    def start(argv, env=None, **kwargs) -> subprocess.Popen:
        env = dict(os.environ if env is None else env, **{TAG: tag})
        proc = subprocess.Popen(argv, env=env, start_new_session=True, **kwargs)
        started.append(proc)
        return proc

    started: list[subprocess.Popen] = []
    start.tag = tag
    try:
        yield start
    finally:
        for pid in tagged(tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not tagged(tag), f"processes left behind: {tagged(tag)}"
