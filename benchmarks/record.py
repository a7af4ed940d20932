"""One record per benchmark run, appended to ``benchmarks/results/<benchmark>.jsonl``.

Each line of a ``.jsonl`` file is one run, oldest first:

    {"benchmark": ..., "date": UTC ISO 8601, "commit": "git rev-parse HEAD" (+ "+dirty" when
     the tree has changes outside benchmarks/results/; null without git), "machine": {"cpu",
     "cores", "gpu"}, "versions": {"python", "torch", "triton", "lightning", ...: those
     installed}, "command": the command line, "results": what the script measured}

The benchmarks call ``append_run``; benchmarks/accuracy.sh uses the command line:

    .venv/bin/python benchmarks/record.py BENCHMARK COMMAND [NAME=FILE.json ...]

appends a record whose results map each NAME to the JSON in FILE. ``ONEBIT_RESULTS_DIR`` puts
the ``.jsonl`` files in another folder (a trial run, or a machine whose tree is a copy).

    .venv/bin/python benchmarks/record.py --show BENCHMARK

lists the runs of one file: date, commit and command. Records seeded from the result files of
2026-11-29 to 2026-12-02 carry what docs/benchmarks.md said of them (``date`` may be an ISO
interval, ``commit`` null where it was not recorded) and a ``source`` (the file they came from,
which git keeps).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# Distributions whose versions a record keeps, where installed (not imported: importing
# Lightning or transformers takes seconds).
DISTRIBUTIONS = ("torch", "triton", "lightning", "pytorch-lightning", "transformers",
                 "accelerate", "scikit-learn")


def results_path(benchmark: str) -> Path:
    return Path(os.environ.get("ONEBIT_RESULTS_DIR") or RESULTS) / f"{benchmark}.jsonl"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def commit() -> str | None:
    head = _git("rev-parse", "HEAD")
    if head is None:
        return None
    # What a run appends to benchmarks/results/ does not make the next run's tree dirty.
    changes = _git("status", "--porcelain", "--", ".", ":(exclude)benchmarks/results")
    return head + ("+dirty" if changes else "")


def machine() -> dict:
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        cpu = platform.processor() or None
    gpu = None
    if "torch" in sys.modules or _installed("torch"):
        try:
            import torch

            if torch.cuda.is_available():
                gpu = torch.cuda.get_device_name(0)
        except Exception:  # noqa: BLE001 - a record without the GPU's name, not a failed run
            gpu = None
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu}


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    found = {"python": platform.python_version()}
    for name in DISTRIBUTIONS:
        version = _installed(name)
        if version is not None:
            found[name] = version
    return found


def _relative(arg: str) -> str:
    try:
        return str(Path(os.path.abspath(arg)).relative_to(ROOT)) if os.path.isabs(arg) else arg
    except ValueError:
        return arg


def command_line() -> str:
    """This process's command line, paths inside the repository relative to it. Under torchrun
    it is torchrun's own (the parent's), which is what one types."""
    argv = [sys.executable, *sys.argv]
    if "TORCHELASTIC_RUN_ID" in os.environ:
        try:
            parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
            parent = [a.decode() for a in parent if a]
            if any(Path(a).name == "torchrun" for a in parent[:2]):
                argv = parent[1:] if Path(parent[1]).name == "torchrun" else parent
        except (OSError, IndexError, UnicodeDecodeError):
            pass
    return shlex.join(_relative(a) for a in argv)


def append_run(benchmark: str, command: str | None, results: dict) -> Path:
    """Append one run of ``benchmark`` to its ``.jsonl`` and return the file's path.
    ``command`` None: this process's command line."""
    record = {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": machine(),
        "versions": versions(),
        "command": command if command is not None else command_line(),
        "results": results,
    }
    path = results_path(benchmark)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record, separators=(",", ":")) + "\n")
    return path


def read_runs(benchmark: str) -> list[dict]:
    path = results_path(benchmark)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--show", action="store_true", help="list the runs of BENCHMARK")
    p.add_argument("benchmark")
    p.add_argument("command", nargs="?", help="the command line the record names")
    p.add_argument("files", nargs="*", metavar="NAME=FILE.json")
    args = p.parse_args()
    if args.show:
        for run in read_runs(args.benchmark):
            print(f"{run['date'] or '-'}  {run['commit'] or '-'}  {run['command']}")
        return
    if args.command is None:
        p.error("COMMAND is required (or --show)")
    results = {}
    for item in args.files:
        name, sep, file = item.partition("=")
        if not sep:
            p.error(f"{item!r}: expected NAME=FILE.json")
        results[name] = json.loads(Path(file).read_text())
    print(f"appended to {shown(append_run(args.benchmark, args.command, results))}")


if __name__ == "__main__":
    main()
