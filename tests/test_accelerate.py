"""The Accelerate flag end to end: `accelerate launch` with 2 CPU processes, flag on and off.

accelerate 1.15's `accelerate launch --cpu --num_processes 2` starts a single process unless
mpirun is set up; `ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2` starts
two gloo processes through torchrun on a machine without GPUs, so the tests use that.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.client_runs import accelerate_launch, median_bytes_per_step
from tests.dist_helpers import assert_ranks_identical
from tests.procs import owned_processes

pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_accelerate.py"
ACCELERATE = Path(sys.executable).with_name("accelerate")


ONEBIT_RUN = Path(sys.executable).with_name("onebit-run")
ON = {"ONEBIT_ADAM": "1", "ONEBIT_FREEZE_STEP": "10"}


def _launch(out: Path, env: dict, *args: str, check: bool = True, launcher: bool = True,
            processes: int = 2):
    """``accelerate launch`` of the example; with ``ONEBIT_ADAM=1`` in ``env`` under
    ``onebit-run`` (the unmodified script), unless ``launcher=False`` (the explicit import)."""
    cmd = [*accelerate_launch(ACCELERATE.parent, processes), str(SCRIPT), "--steps", "30",
           "--accumulate", "2", "--clip", "1.0", "--out", str(out), *args]
    if launcher and env.get("ONEBIT_ADAM") == "1":
        cmd = [str(ONEBIT_RUN), *cmd]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ONEBIT_")}
    full_env.update(ACCELERATE_USE_CPU="true", **env)
    with owned_processes() as start:  # accelerate launch -> torchrun -> the workers
        proc = start(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
        proc.stdout, proc.stderr = proc.communicate(timeout=300)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc




@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """The unmodified script under plain `accelerate launch`: AdamW and DDP's allreduce."""
    out = tmp_path_factory.mktemp("plain")
    _launch(out, {}, "--wire-out", str(out / "wire"))
    return out


def _ranks(out: Path) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.fixture(scope="module")
def joint_run(tmp_path_factory):
    """The unmodified script under `onebit-run`, prepare() given the model and the optimizer
    together: 30 uninterrupted steps, frozen at 10."""
    out = tmp_path_factory.mktemp("joint")
    _launch(out, ON, "--wire-out", str(out / "wire"))
    return out


@pytest.mark.parametrize("prepare", ["joint", "separate"])
def test_unmodified_script_under_onebit_run(plain_run, joint_run, tmp_path, prepare):
    """`onebit-run accelerate launch` of a script that imports nothing of onebit_plugin:
    AdamW (with a warm-up schedule from lr 0) becomes OneBitAdam and the hook is registered,
    whether prepare() gets the model and the optimizer together or one at a time; in the
    compression stage each rank writes at least 25x fewer bytes per step than under plain
    DDP + AdamW (counted by the kernel, not by the package), the ranks stay identical and the
    loss is that of the plain run."""
    out = joint_run
    if prepare == "separate":
        out = tmp_path
        _launch(out, ON, "--wire-out", str(out / "wire"), "--separate-prepare")
    ranks = _ranks(out)
    assert_ranks_identical([r["params"] for r in ranks], "parameters")
    assert ranks[0]["optimizer"] == "OneBitAdam" and ranks[0]["stage"] == "compression"
    summary = json.loads((out / "summary.json").read_text())
    plain = json.loads((plain_run / "summary.json").read_text())
    assert summary["switch_step"] == 10 and summary["steps"] == 30
    # The flag wraps with bucket views (the hook then leaves the last bucket's units to step());
    # plain Accelerate keeps DDP's default.
    assert summary["gradient_as_bucket_view"] is True
    assert plain["gradient_as_bucket_view"] is False
    # The LR schedule (from lr 0) drives OneBitAdam, also when the scheduler was built on the
    # original AdamW and never passed to prepare().
    assert summary["lr_of_optimizer"] == summary["lr_of_scheduler"] > 0
    compression = range(12, 31)  # step 11 also builds the units
    ours = median_bytes_per_step(out, compression)
    dense = median_bytes_per_step(plain_run, compression)
    ratio = dense / ours
    print(f"{prepare} prepare: median bytes written per compression-stage step "
          f"{ours} against {dense} for DDP + AdamW "
          f"({ratio:.1f}x); val loss {summary['val_loss']:.4f} against {plain['val_loss']:.4f}")
    assert ratio >= 25, (ours, dense)
    assert summary["val_loss"] <= plain["val_loss"] * 1.02, (summary, plain)


def test_save_load_state_continues_the_uninterrupted_run_bitwise(plain_run, joint_run, tmp_path):
    """save_state at step 20 (compression stage), load_state into a fresh model, optimizer and
    Accelerator, continue to 30: the same parameters as 30 uninterrupted steps."""
    # The resumed run takes the explicit route (no launcher, Accelerator imported from
    # onebit_plugin), the uninterrupted one onebit-run: the same training, bit for bit.
    _launch(tmp_path, ON, "--save-at", "20", "--explicit-import", launcher=False)
    straight, resumed = _ranks(joint_run), _ranks(tmp_path)
    assert sorted(p.name for p in (tmp_path / "state").glob("onebit_rank*")) == [
        "onebit_rank0.pt", "onebit_rank1.pt"]
    for a, b in zip(straight, resumed, strict=True):
        for x, y in zip(a["params"], b["params"], strict=True):
            assert torch.equal(x, y)
    # The same state on 3 processes under onebit-run (an elastic restart): the error feedback
    # restarts from zero, said once, and the 3 ranks compress on in lockstep.
    three = tmp_path / "three"
    proc = _launch(three, ON, "--load-from", str(tmp_path / "state"), "--wire-out",
                   str(three / "wire"), processes=3)
    log = proc.stdout + proc.stderr
    assert log.count("error feedback restarts from zero") == 1 and "saved by 2 ranks on 3" in log
    ranks = [torch.load(three / f"rank{r}.pt") for r in range(3)]
    assert_ranks_identical([r["params"] for r in ranks], "parameters")
    assert {r["stage"] for r in ranks} == {"compression"}
    steps = range(22, 31)
    # Against DDP on 3 ranks: a ring allreduce writes 2(W-1)/W of the buffer per rank, 4/3 of
    # the plain 2-rank run's.
    dense = median_bytes_per_step(plain_run, steps) * 4 / 3
    assert dense / median_bytes_per_step(three, steps, 3) >= 25


def test_flag_off_is_plain_accelerate(plain_run, tmp_path):
    """The explicit import with ONEBIT_ADAM=0 trains exactly as plain Accelerate."""
    _launch(tmp_path, {"ONEBIT_ADAM": "0"}, "--explicit-import")
    a, b = _ranks(tmp_path), _ranks(plain_run)
    assert a[0]["optimizer"] == b[0]["optimizer"] == "AdamW"
    for x, y in zip(a[0]["params"], b[0]["params"], strict=True):
        assert torch.equal(x, y)


def test_flag_without_freeze_step_is_a_clear_error(tmp_path):
    """Both routes refuse to start without the freeze step: the explicit import (one process:
    the check runs in Accelerator() on every rank alike) and the launcher."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONEBIT_")}
    env.update(ACCELERATE_USE_CPU="true", ONEBIT_ADAM="1")
    with owned_processes() as start:
        for cmd, code in [
            ([sys.executable, str(SCRIPT), "--explicit-import", "--out", str(tmp_path)], 1),
            ([str(ONEBIT_RUN), "true"], 2),
        ]:
            proc = start(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
            _, stderr = proc.communicate(timeout=120)
            assert proc.returncode == code, stderr[-3000:]
            assert "ONEBIT_ADAM=1 needs ONEBIT_FREEZE_STEP" in stderr, stderr[-3000:]


def test_conversion_keeps_hyperparameters_and_scheduler():
    from onebit_plugin import OneBitAdam
    from onebit_plugin.integrations.accelerate_flag import OneBitSettings, to_member

    model = torch.nn.Linear(4, 2)
    adamw = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(adamw, step_size=1, gamma=0.5)
    onebit = to_member(adamw, OneBitSettings(freeze_step=5))
    assert isinstance(onebit, OneBitAdam) and onebit.freeze_step == 5
    group = onebit.param_groups[0]
    assert group is adamw.param_groups[0]  # the scheduler's edits reach the new optimizer
    assert (group["lr"], group["betas"], group["weight_decay"]) == (0.01, (0.8, 0.9), 0.1)
    assert group["decoupled_weight_decay"] is True
    with pytest.warns(UserWarning, match="before `optimizer.step"):  # no training step here
        scheduler.step()
    assert onebit.param_groups[0]["lr"] == pytest.approx(0.005)
    with pytest.raises(ValueError, match="replaces torch.optim.Adam or AdamW by OneBitAdam; "
                                         "this script passes SGD"):
        to_member(torch.optim.SGD(model.parameters(), lr=0.1), OneBitSettings(5))
    with pytest.raises(ValueError, match="does not support Adam's amsgrad=True"):
        to_member(torch.optim.Adam(model.parameters(), amsgrad=True), OneBitSettings(5))


def test_latest_automatic_checkpoint_is_found(tmp_path):
    from onebit_plugin.integrations.accelerate_flag import Accelerator

    for n in (2, 10, 9):
        (tmp_path / "checkpoints" / f"checkpoint_{n}").mkdir(parents=True)
    (tmp_path / "checkpoints" / "checkpoint_x").mkdir()

    class Probe:
        project_dir = str(tmp_path)

    assert Accelerator._latest_checkpoint(Probe()).name == "checkpoint_10"


def test_survivor_exits_when_its_peer_hangs(tmp_path):
    """ONEBIT_TIMEOUT=3: process 1 hangs at step 20; process 0 raises CommunicationError and
    ends, torchrun (under accelerate launch) ends the hung one, the launch fails."""
    log = tmp_path / "log.txt"
    cmd = [str(ONEBIT_RUN), *accelerate_launch(ACCELERATE.parent), str(SCRIPT), "--steps", "40",
           "--hang-at", "20", "--out", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONEBIT_")}
    env.update(ACCELERATE_USE_CPU="true", ONEBIT_ADAM="1", ONEBIT_FREEZE_STEP="10",
               ONEBIT_TIMEOUT="3")
    with owned_processes() as start, open(log, "w") as sink:
        started = time.monotonic()
        proc = start(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
        proc.wait(timeout=120)
        elapsed = time.monotonic() - started
    output = log.read_text()
    assert proc.returncode != 0, output[-3000:]
    assert "onebit: the compressed allreduce" in output and "(timeout 3 s)" in output, \
        output[-3000:]
    print(f"accelerate launch exited {proc.returncode} {elapsed:.1f} s after the start")
    assert elapsed < 60, elapsed


@pytest.mark.parametrize("env,message", [
    ({"ONEBIT_MAXBLOCK": "1024"}, "unknown setting(s) ONEBIT_MAXBLOCK"),
    ({"ONEBIT_FREEZE_STEP": "0"}, "ONEBIT_FREEZE_STEP must be >= 1 or auto, got 0"),
    ({"ONEBIT_FREEZE_STEP": "soon"}, "ONEBIT_FREEZE_STEP must be an integer or auto, got 'soon'"),
    ({"ONEBIT_FREEZE_STEP": "auto", "ONEBIT_TOTAL_STEPS": "0"},
     "ONEBIT_TOTAL_STEPS must be >= 1, got 0"),
    ({"ONEBIT_SCALE": "rsm"}, "ONEBIT_SCALE must be one of ('rms', 'mean'), got 'rsm'"),
    ({"ONEBIT_MAX_BLOCK": "100"}, "ONEBIT_MAX_BLOCK must be a multiple of 8 in [8, 16384]"),
    ({"ONEBIT_TIMEOUT": "soon"}, "ONEBIT_TIMEOUT must be a number of seconds, got 'soon'"),
    ({"ONEBIT_BOUND_UPDATE": "maybe"}, "ONEBIT_BOUND_UPDATE must be 1 or 0"),
    ({"ONEBIT_MASTER_WEIGHTS": "2"}, "ONEBIT_MASTER_WEIGHTS must be 1 or 0"),
    ({"ONEBIT_CPU_KERNEL": "fast"}, "ONEBIT_CPU_KERNEL must be 1 or 0"),
    ({"ONEBIT_OPTIMIZER": "zero_one"}, "ONEBIT_OPTIMIZER must be one of onebit_adam, "
     "zero_one_adam, onebit_lamb, got 'zero_one' (did you mean zero_one_adam?)"),
    ({"ONEBIT_OPTIMIZER": "onebit_lamb", "ONEBIT_VAR_FREEZE_STEP": "100"},
     "ONEBIT_VAR_FREEZE_STEP is 0/1 Adam's, and the optimizer is onebit_lamb: unset it, or "
     "choose 0/1 Adam"),
    ({"ONEBIT_OPTIMIZER": "zero_one_adam"}, "ONEBIT_FREEZE_STEP is 1-bit Adam's warm-up"),
    ({"ONEBIT_VAR_FREEZE_STEP": "100"}, "ONEBIT_VAR_FREEZE_STEP is 0/1 Adam's, and the "
     "optimizer is onebit_adam"),
])
def test_every_setting_is_checked_naming_the_variable(monkeypatch, env, message):
    from onebit_plugin.integrations.accelerate_flag import OneBitSettings

    for name in [k for k in os.environ if k.startswith("ONEBIT_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("ONEBIT_ADAM", "1")
    monkeypatch.setenv("ONEBIT_FREEZE_STEP", "10")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as raised:
        OneBitSettings.from_env()
    assert message in str(raised.value)


@pytest.mark.parametrize("env,message", [
    ({"ONEBIT_VAR_FREEZE_STEP": "0"}, "ONEBIT_VAR_FREEZE_STEP must be an integer >= 1 or auto"),
    ({"ONEBIT_LOCAL_STEP_SCALER": "soon"},
     "ONEBIT_LOCAL_STEP_SCALER must be an integer >= 1 or auto, got 'soon'"),
])
def test_zero_one_settings_are_checked_naming_the_variable(monkeypatch, env, message):
    from onebit_plugin.integrations.accelerate_flag import OneBitSettings

    for name in [k for k in os.environ if k.startswith("ONEBIT_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("ONEBIT_ADAM", "1")
    monkeypatch.setenv("ONEBIT_OPTIMIZER", "zero_one_adam")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as raised:
        OneBitSettings.from_env()
    assert message in str(raised.value)


# 0/1 Adam under onebit-run: Adam to step 12, then local steps, the interval doubling every 2
# steps (steps 13, 14, 16 and 30, the last, sync); step 25 is between syncs.
ZERO_ONE = {"ONEBIT_ADAM": "1", "ONEBIT_OPTIMIZER": "zero_one_adam",
            "ONEBIT_VAR_FREEZE_STEP": "12", "ONEBIT_LOCAL_STEP_SCALER": "2",
            "ONEBIT_TOTAL_STEPS": "30"}


def test_zero_one_adam_under_onebit_run_resumes_between_syncs_bitwise(tmp_path):
    """The unmodified script's AdamW becomes ZeroOneAdam; every rank ends on one point (the last
    step syncs); save_state between syncs (each rank's own parameters) and load_state continue
    the uninterrupted run bit for bit. (Accuracy: benchmarks/fidelity.py; this schedule, local
    intervals of 16 from step 21 of 30, is there to reach phase B at all.)"""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    said = _launch(whole, ZERO_ONE).stdout
    # The launcher's line names the settings away from the member's own defaults: none here
    # (0/1 Adam's follow_variance=False is its default, not a change).
    assert "settings away from ZeroOneAdam's defaults: none" in said, said[-2000:]
    _launch(resumed, ZERO_ONE, "--save-at", "25", "--explicit-import", launcher=False)
    ranks = _ranks(whole)
    assert ranks[0]["optimizer"] == "ZeroOneAdam"
    assert_ranks_identical([r["params"] for r in ranks], "parameters")
    for a, b in zip(ranks, _ranks(resumed), strict=True):
        for x, y in zip(a["params"], b["params"], strict=True):
            assert torch.equal(x, y)
    assert json.loads((whole / "summary.json").read_text())["steps"] == 30


# 1-bit LAMB under onebit-run: the script's AdamW becomes OneBitLamb, LAMB to step 10, then the
# 1-bit momentum; save_state at step 20 (compression stage) and load_state continue bitwise.
LAMB = {"ONEBIT_ADAM": "1", "ONEBIT_OPTIMIZER": "onebit_lamb", "ONEBIT_FREEZE_STEP": "10",
        "ONEBIT_TOTAL_STEPS": "30"}


def test_onebit_lamb_under_onebit_run_resumes_bitwise_in_the_compression_stage(tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _launch(whole, LAMB)
    _launch(resumed, LAMB, "--save-at", "20", "--explicit-import", launcher=False)
    ranks = _ranks(whole)
    assert ranks[0]["optimizer"] == "OneBitLamb"
    assert_ranks_identical([r["params"] for r in ranks], "parameters")
    for a, b in zip(ranks, _ranks(resumed), strict=True):
        for x, y in zip(a["params"], b["params"], strict=True):
            assert torch.equal(x, y)
