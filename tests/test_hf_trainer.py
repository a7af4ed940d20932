"""transformers.Trainer, unmodified (examples/train_hf_trainer.py: a small GPT-2 from its config),
turned to 1-bit Adam at launch alone by `onebit-run accelerate launch`, 2 CPU processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.client_runs import median_bytes_per_step, rank_params
from tests.dist_helpers import assert_ranks_identical
from tests.procs import owned_processes

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_hf_trainer.py"
BIN = Path(sys.executable).parent
# freeze_step="auto": the Trainer's max_steps is the only place the run's length is known;
# on this short run the variance has not settled, so the freeze is the ceiling, 20% of 80.
STEPS, FREEZE = 80, 16


def _launch(out: Path, onebit: bool, *args: str) -> str:
    cmd = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           str(SCRIPT), "--steps", str(STEPS), "--out", str(out), *args]
    if onebit:
        cmd = [str(BIN / "onebit-run"), "--freeze-step", "auto", *cmd]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONEBIT_")}
    env.update(ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    with owned_processes() as start:
        proc = start(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                     text=True)
        output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    return output






def test_trainer_under_onebit_run_compresses_and_resumes_bitwise(tmp_path):
    plain, onebit, resumed = tmp_path / "plain", tmp_path / "onebit", tmp_path / "resumed"
    _launch(plain, False)
    _launch(onebit, True, "--save-steps", "60")
    summary = json.loads((onebit / "summary.json").read_text())
    reference = json.loads((plain / "summary.json").read_text())
    assert reference["optimizer"] == "AdamW"
    assert summary["optimizer"] == "OneBitAdam" and summary["switch_step"] == FREEZE
    ranks = rank_params(onebit)
    assert_ranks_identical(ranks, "parameters")
    # Bytes each rank wrote per compression-stage step, counted by the kernel (wire.py).
    steps = range(FREEZE + 2, STEPS + 1)
    ours, dense = median_bytes_per_step(onebit, steps), median_bytes_per_step(plain, steps)
    print(f"Trainer: {ours} bytes written per compression-stage step against {dense} under "
          f"DDP + AdamW ({dense / ours:.1f}x); val loss {summary['val_loss']:.4f} against "
          f"{reference['val_loss']:.4f}; largest |parameter| {summary['largest_abs_param']:.2f}"
          f" against {reference['largest_abs_param']:.2f}")
    assert dense / ours >= 25
    # A sanity bound; the accuracy figures are benchmarks/fidelity.py's.
    assert summary["val_loss"] <= 1.05 * reference["val_loss"]
    # Each rank's own error buffers are in the Trainer's checkpoint and come back on resume.
    checkpoint = onebit / "checkpoints" / "checkpoint-60"
    assert sorted(p.name for p in checkpoint.glob("onebit_rank*.pt")) == [
        "onebit_rank0.pt", "onebit_rank1.pt"]
    _launch(resumed, True, "--resume", str(checkpoint))
    for a, b in zip(ranks, rank_params(resumed), strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
