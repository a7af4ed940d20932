"""LightningCLI with `trainer.strategy: onebit_adam` in a config file (examples/cli_config.yaml),
against the same config with `--trainer.strategy ddp --model.optimizer adamw`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.client_runs import median_bytes_per_step, rank_params
from tests.dist_helpers import assert_ranks_identical
from tests.procs import owned_processes

pytest.importorskip("lightning.pytorch")
pytest.importorskip("jsonargparse")

ROOT = Path(__file__).resolve().parents[1]


def _fit(out: Path, *args: str) -> dict:
    cmd = [sys.executable, str(ROOT / "examples" / "lightning_cli.py"), "fit", "--config",
           str(ROOT / "examples" / "cli_config.yaml"), "--trainer.max_steps", "30",
           "--model.freeze_step", "10", "--model.out", str(out), *args]
    with owned_processes() as start:
        proc = start(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    return json.loads((out / "summary.json").read_text())




def test_config_file_strategy_onebit_adam(tmp_path):
    onebit = _fit(tmp_path / "onebit")
    plain = _fit(tmp_path / "plain", "--trainer.strategy", "ddp", "--model.optimizer", "adamw")
    assert onebit["strategy"] == "OneBitAdamStrategy" and onebit["switch_step"] == 10
    assert plain["strategy"] == "DDPStrategy" and plain["optimizer"] == "AdamW"
    assert_ranks_identical(rank_params(tmp_path / "onebit"), "parameters")
    steps = range(12, 31)
    ours = median_bytes_per_step(tmp_path / "onebit", steps)
    dense = median_bytes_per_step(tmp_path / "plain", steps)
    print(f"LightningCLI: {ours} bytes written per compression-stage step against {dense} "
          f"under DDP + AdamW ({dense / ours:.1f}x); val loss {onebit['val_loss']:.4f} against "
          f"{plain['val_loss']:.4f}")
    assert dense / ours >= 25
    # A sanity bound (freeze at 33% of a 30-step run measured +1.7%); the accuracy target
    # without tuning belongs to the fidelity work.
    assert onebit["val_loss"] <= 1.05 * plain["val_loss"]
