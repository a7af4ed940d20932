"""Lightning Fabric: `Fabric(strategy="onebit_adam")` on 2 CPU processes (examples/train_fabric.py,
Fabric's own launcher), against DDP + AdamW; and DDP + OneBitAdam without the strategy, which
must say so instead of reporting a compression that did not happen."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from onebit_plugin import OneBitAdam
from tests.client_runs import median_bytes_per_step, rank_params
from tests.dist_helpers import assert_ranks_identical, run_ranks
from tests.procs import owned_processes

pytest.importorskip("lightning.fabric")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_fabric.py"
ARGS = ["--steps", "30", "--freeze-step", "10", "--accumulate", "2", "--clip", "1.0"]


def _fit(out: Path, *args: str) -> str:
    cmd = [sys.executable, str(SCRIPT), "--devices", "2", "--out", str(out), *ARGS, *args]
    with owned_processes() as start:  # Fabric's own rank processes included
        proc = start(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    return output






def test_fabric_strategy_compresses_and_resumes_bitwise(tmp_path):
    plain, onebit, resumed = tmp_path / "plain", tmp_path / "onebit", tmp_path / "resumed"
    _fit(plain, "--optimizer", "adamw")
    # The unbounded update (--no-bound): its loss check below was set for that update; the
    # default settings' Fabric wiring is checked bit for bit by the next test. With the
    # default bound this 30-step run frozen at step 10 ends 3.1% above AdamW (+0.7% unbounded;
    # 2026-12-01, clipping through OneBitAdam.clip_grad_norm_; +3.0% and +0.35% before): the
    # cost docs/design.md, "Bounded steps", reports; benchmarks/fidelity.py measures the
    # default over 3 workloads x 3 seeds.
    _fit(onebit, "--save-at", "20", "--no-bound")
    _fit(resumed, "--resume", str(onebit / "checkpoint.ckpt"), "--no-bound")
    summary = json.loads((onebit / "summary.json").read_text())
    reference = json.loads((plain / "summary.json").read_text())
    assert summary["optimizer"] == "OneBitAdam" and summary["switch_step"] == 10
    ranks = rank_params(onebit)
    assert_ranks_identical(ranks, "parameters")
    steps = range(12, 31)
    ours, dense = median_bytes_per_step(onebit, steps), median_bytes_per_step(plain, steps)
    print(f"Fabric: {ours} bytes written per compression-stage step against {dense} under "
          f"DDP + AdamW ({dense / ours:.1f}x); val loss {summary['val_loss']:.4f} against "
          f"{reference['val_loss']:.4f}")
    assert dense / ours >= 25
    assert summary["val_loss"] <= 1.02 * reference["val_loss"]
    # fabric.save carried every rank's own error buffers: the resumed run ends bit for bit.
    for a, b in zip(ranks, rank_params(resumed), strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
    # The same checkpoint on 3 devices (an elastic restart): the error feedback restarts from
    # zero, said once; the 3 ranks compress on in lockstep.
    three = tmp_path / "three"
    log = _fit(three, "--resume", str(onebit / "checkpoint.ckpt"), "--no-bound", "--devices", "3")
    assert log.count("error feedback restarts from zero") == 1 and "saved by 2 ranks on 3" in log
    assert_ranks_identical(rank_params(three, 3), "parameters")
    # Against DDP on 3 ranks: a ring allreduce writes 2(W-1)/W of the buffer per rank, 4/3 of
    # the 2-rank run's.
    assert dense * 4 / 3 / median_bytes_per_step(three, range(22, 31), 3) >= 25


def _plain_loop_worker(rank, world, steps, freeze, accumulate, clip):
    """examples/train_fabric.py's loop and settings without Fabric and without DDP: OneBitAdam
    averages by itself and clips through its own clip_grad_norm_."""
    from examples.charlm import CharGPT, load_corpus, loss_fn, sample_batch

    torch.manual_seed(0)
    model = CharGPT(context=64)
    opt = OneBitAdam(model.parameters(), lr=3e-3, weight_decay=0.01,
                     decoupled_weight_decay=True, freeze_step=freeze, total_steps=steps)
    train, _ = load_corpus()
    for step in range(steps):
        gen = torch.Generator().manual_seed(rank * 1_000_003 + step)
        for _ in range(accumulate):
            x, y = sample_batch(train, 16, 64, gen)
            (loss_fn(model, x, y) / accumulate).backward()
        opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_fabric_with_default_settings_ends_on_the_plain_loops_bits(tmp_path):
    """Fabric(strategy="onebit_adam") with OneBitAdam's defaults (bounded update), accumulation
    under no_backward_sync and fabric.clip_gradients ends on the bits of the same loop without
    Fabric or DDP: the strategy, its hook and its clipping change nothing but the transport."""
    _fit(tmp_path)
    fabric = rank_params(tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())["switch_step"] == 10
    plain = run_ranks(_plain_loop_worker, 2, 30, 10, 2, 1.0)
    for rank in range(2):
        for a, b in zip(fabric[rank], plain[rank], strict=True):
            assert torch.equal(a, b)


def test_ddp_without_the_strategy_is_said_and_reports_no_ratio(tmp_path):
    output = _fit(tmp_path, "--strategy", "ddp", "--steps", "12")
    assert output.count("gradients reaching OneBitAdam.step() are identical on all 2") == 2
    assert "Fabric(strategy='onebit_adam')" in output
    assert math.isnan(json.loads((tmp_path / "summary.json").read_text())["compression_ratio"])


def test_fabric_zero_one_adam_resumed_between_syncs_continues_every_rank_bitwise(tmp_path):
    """ZeroOneAdam through Fabric: saved at step 25, between syncs (var_freeze_step 12, the
    local interval doubling every 2 steps: steps 13, 14, 16 and 30 sync), where each rank holds
    its own parameters and Fabric writes rank 0's; every rank resumes its own."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    settings = ("--optimizer", "zero_one", "--var-freeze-step", "12", "--local-step-scaler",
                "2")
    _fit(whole, *settings, "--save-at", "25")
    _fit(resumed, *settings, "--resume", str(whole / "checkpoint.ckpt"))
    assert json.loads((whole / "summary.json").read_text())["optimizer"] == "ZeroOneAdam"
    ends = rank_params(whole)
    assert_ranks_identical(ends, "parameters after the last step's sync")
    for a, b in zip(ends[0], rank_params(resumed)[0], strict=True):
        assert torch.equal(a, b)


def test_fabric_onebit_lamb_resumed_in_the_compression_stage_continues_bitwise(tmp_path):
    """OneBitLamb through Fabric: LAMB to step 10, saved at step 20 in the compression stage;
    every rank resumes its own error buffers and the run continues bit for bit."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    settings = ("--optimizer", "lamb", "--freeze-step", "10")
    _fit(whole, *settings, "--save-at", "20")
    _fit(resumed, *settings, "--resume", str(whole / "checkpoint.ckpt"))
    assert json.loads((whole / "summary.json").read_text())["optimizer"] == "OneBitLamb"
    ends = rank_params(whole)
    assert_ranks_identical(ends, "parameters")
    for a, b in zip(ends[0], rank_params(resumed)[0], strict=True):
        assert torch.equal(a, b)
