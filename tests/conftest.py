"""Triton's interpreter, and the ``multiprocess`` marker.

A test that starts processes (ranks through run_ranks, torchrun/accelerate/onebit-run/python
through owned_processes or subprocess, Lightning's own rank processes, network namespaces) is
marked ``multiprocess``; ``make test-quick`` runs the rest (``-m "not multiprocess"``).

Nobody has to remember the mark:
- at collection, a test is marked when its function, a fixture it uses (defined under tests/),
  or a function of tests/ that either one calls, directly or further down, names a launcher
  (run_ranks, owned_processes, emulated_hosts, subprocess, multiprocessing, ...);
- while an unmarked test sets up and runs, starting a Python process (os.fork, a
  multiprocessing Process, a command whose program is python, a Python script such as torchrun
  or accelerate, or ``ip netns``) is refused and fails the test, in ``make test`` as well as in
  ``make test-quick``: mark it ``@pytest.mark.multiprocess`` (the scan misses, say, a launch
  through an attribute of an object). Other programs (the C compiler that builds the CPU
  kernel, ldconfig, ptxas) may run anywhere.
"""

import functools
import multiprocessing.process
import os
import re
import shlex
import shutil
import subprocess
import sys
import types

import pytest

# Triton kernels run on the CPU through the interpreter; it is chosen when a kernel is decorated,
# so this must be set before onebit_plugin.kernels is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

MARK = "multiprocess"

# Names that, used by a test, a fixture or a helper of tests/, start processes (also attribute
# names: ``subprocess.Popen``, ``os.fork``, ``mp.spawn``).
LAUNCH_NAMES = frozenset({
    "run_ranks", "owned_processes", "emulated_hosts", "subprocess", "multiprocessing", "Popen",
    "fork", "spawn", "start_processes", "posix_spawn", "posix_spawnp",
})
# Modules whose every use counts, under whatever name they were imported (``mp``).
LAUNCH_MODULES = frozenset({"subprocess", "multiprocessing", "torch.multiprocessing"})


# ---- collection: mark what names a launcher -------------------------------------------------

def _launcher_in(func, seen: set) -> str | None:
    """The first launcher that ``func`` names, itself or through the functions of tests/ it
    names (their nested functions and lambdas included), as "via -> name"; None if none."""
    code = getattr(func, "__code__", None)
    if code is None or code in seen:
        return None
    seen.add(code)
    env = getattr(func, "__globals__", {})
    stack = [code]
    while stack:
        co = stack.pop()
        stack.extend(c for c in co.co_consts if isinstance(c, types.CodeType))
        for name in co.co_names:
            value = env.get(name)
            if name in LAUNCH_NAMES or (
                isinstance(value, types.ModuleType) and value.__name__ in LAUNCH_MODULES
            ):
                return f"{func.__name__} -> {name}"
            if isinstance(value, types.FunctionType) and value.__module__.startswith("tests"):
                found = _launcher_in(value, seen)
                if found:
                    return f"{func.__name__} -> {found}"
    return None


def launcher_of(item) -> str | None:
    """Why ``item`` counts as starting processes (None: it does not, as far as the scan sees)."""
    seen: set = set()
    found = _launcher_in(getattr(item, "obj", None), seen)
    if found:
        return found
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for name in getattr(item, "fixturenames", ()):
        for fixturedef in defs.get(name, ()):
            if getattr(fixturedef.func, "__module__", "").startswith("tests"):
                found = _launcher_in(fixturedef.func, seen)
                if found:
                    return f"fixture {found}"
    return None


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker(MARK) is None:
            why = launcher_of(item)
            if why:
                item.add_marker(pytest.mark.multiprocess(why=why))


# ---- run time: an unmarked test may not start a Python process -------------------------------

class ProcessStartRefused(RuntimeError):
    pass


_started: list[str] | None = None  # what the unmarked test now running tried to start


def _refuse(what: str) -> None:
    if _started is not None:
        _started.append(what)
        raise ProcessStartRefused(f"{what}, in a test not marked {MARK}")


@functools.lru_cache(maxsize=256)
def _is_python(token: str, search: str) -> bool:
    """``token`` names a Python interpreter or a Python script (torchrun, accelerate, ...),
    looked up in ``search`` (a PATH) when it has no directory."""
    if re.fullmatch(r"python[0-9.]*", os.path.basename(token)):
        return True
    path = token if os.sep in token else shutil.which(token, path=search)
    if not path or not os.path.isfile(path):
        return False
    if os.path.realpath(path) == os.path.realpath(sys.executable):
        return True
    try:
        with open(path, "rb") as f:
            first = f.readline(256)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first


def _check_command(args, shell=False, env=None) -> None:
    if _started is None:
        return
    try:
        if isinstance(args, str | bytes | os.PathLike):
            args = os.fsdecode(args)
            tokens = shlex.split(args) if shell else [args]
        else:
            tokens = [os.fsdecode(a) for a in args]
    except (TypeError, ValueError):
        return
    # The child's PATH, and the venv's scripts (torchrun, accelerate, onebit-run) also when
    # pytest was started by its path.
    search = os.pathsep.join([(env or os.environ).get("PATH", os.defpath),
                              os.path.dirname(sys.executable)])
    names = [os.path.basename(t) for t in tokens]
    if (any(_is_python(t, search) for t in tokens) or names[:1] in (["unshare"], ["nsenter"])
            or (names[:1] == ["ip"] and "netns" in tokens)):
        _refuse(f"started {shlex.join(tokens)[:300]!r}")


def _install_guard() -> None:
    popen_init = subprocess.Popen.__init__
    if getattr(popen_init, "_onebit_guard", False):  # installed already
        return

    @functools.wraps(popen_init)
    def init(self, args, *rest, **kwargs):
        _check_command(args, kwargs.get("shell", False), kwargs.get("env"))
        return popen_init(self, args, *rest, **kwargs)

    start = multiprocessing.process.BaseProcess.start

    @functools.wraps(start)
    def process_start(self):
        _refuse(f"started multiprocessing {type(self).__name__} {self.name}")
        return start(self)

    fork = os.fork

    @functools.wraps(fork)
    def os_fork():
        _refuse("called os.fork()")
        return fork()

    system = os.system

    @functools.wraps(system)
    def os_system(command):
        _check_command(command, shell=True)
        return system(command)

    init._onebit_guard = True
    subprocess.Popen.__init__ = init
    multiprocessing.process.BaseProcess.start = process_start
    os.fork = os_fork
    os.system = os_system
    for name in ("posix_spawn", "posix_spawnp"):
        original = getattr(os, name, None)
        if original is not None:
            def spawn(path, argv, *rest, _original=original, **kwargs):
                _check_command([path, *argv[1:]])
                return _original(path, argv, *rest, **kwargs)
            setattr(os, name, functools.wraps(original)(spawn))


def pytest_configure(config):
    _install_guard()


def _guarded(item):
    """Generator body of the setup and call wrappers: refuse Python processes while an
    unmarked test sets up (its fixtures) and runs; the test fails even when it caught the
    refusal."""
    global _started
    if item.get_closest_marker(MARK) is not None:
        return (yield)
    _started = []
    try:
        result = yield
    except BaseException:
        _fail_if_started(item)
        raise
    _fail_if_started(item)
    return result


def _fail_if_started(item) -> None:
    global _started
    started, _started = _started, None
    if started:
        raise pytest.fail.Exception(
            f"{item.nodeid} starts processes ({'; '.join(started)}) but is not marked "
            f"{MARK}: add @pytest.mark.{MARK} (make test-quick leaves such tests out)",
            pytrace=False,
        ) from None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded(item))
