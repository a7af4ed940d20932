"""Processes that tests start and own: each in a new session, the whole tree killed at the end,
and nothing of theirs left behind (asserted)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time


def session_members(sid: int) -> list[int]:
    """Pids of live (not zombie) processes whose session is ``sid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:  # state, ppid, pgrp, session
            found.append(int(entry))
    return found


@contextlib.contextmanager
def owned_processes():
    """Yield ``start(argv, **popen_kwargs) -> Popen``; every process started is the leader of a
    new session. On exit each session is killed (SIGKILL to every member, which also reaches
    workers that a launcher reparented) and the test fails if anything of them is still alive."""
    started: list[subprocess.Popen] = []

    def start(argv, **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(argv, start_new_session=True, **kwargs)
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            for pid in session_members(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        left = [pid for p in started for pid in session_members(p.pid)]
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = [pid for p in started for pid in session_members(p.pid)]
        assert not left, f"processes left behind: {left}"
