"""HSDP's entry points end to end: examples/train_hsdp.py under torchrun (a plain loop) and
under Lightning's ``strategy="onebit_hsdp"`` (4 CPU processes as 2 hosts x 2), and the
strategy's refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_helpers import free_port
from tests.procs import owned_processes

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_hsdp.py"


def _run(cmd: list[str], out: Path) -> dict:
    # The ranks' rendezvous port from below the ephemeral range (dist_helpers.free_port says
    # why); torchrun takes it as --master_port, Lightning's launcher as MASTER_PORT.
    port = str(free_port())
    if Path(cmd[0]).name == "torchrun":
        cmd = [cmd[0], "--master_port", port, *cmd[1:]]
    with owned_processes() as start:  # torchrun's and Lightning's rank processes included
        proc = start(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                     env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
        stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
    return json.loads(out.read_text())


def test_the_torchrun_example_trains_into_the_compression_stage_in_lockstep(tmp_path):
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    out = tmp_path / "summary.json"
    summary = _run([torchrun, "--nproc_per_node", "4", str(SCRIPT), "--host-size", "2",
                    "--steps", "20", "--freeze-step", "6", "--json", str(out)], out)
    # The script raises (and exits non-zero) unless the replicas are bit-identical.
    assert summary["stage"] == "compression" and summary["switch_step"] == 6
    assert 0 < summary["val_loss"] < 5.6  # ln(256) = 5.55: below chance after 20 steps


def test_lightning_onebit_hsdp_fits_and_resumes_every_shard_bit_for_bit(tmp_path):
    """Three fits in one launch, clipped by norm (through the optimizer): 16 steps; 10 steps
    saved (a DCP folder); resumed to 16. The script compares every rank's shards of the resumed
    fit with the uninterrupted one's."""
    out = tmp_path / "summary.json"
    summary = _run([sys.executable, str(SCRIPT), "--lightning", "--devices", "4",
                    "--host-size", "2", "--steps", "16", "--freeze-step", "6",
                    "--check-resume", "10", "--clip", "0.5", "--ckpt-dir", str(tmp_path / "ckpt"),
                    "--json", str(out)], out)
    assert summary["stage"] == "compression"
    assert summary["resumed_bitwise"] is True
    folder = tmp_path / "ckpt" / "check"
    assert (folder / ".metadata").is_file() and (folder / "lightning.pt").is_file()


@pytest.mark.parametrize("namespace", ["pytorch_lightning", "lightning.pytorch"])
def test_onebit_hsdp_is_registered_and_refuses_what_it_cannot_do(namespace):
    pl = pytest.importorskip(namespace)
    import onebit_plugin  # noqa: F401 - registers the names when Lightning loads
    from onebit_plugin.integrations.lightning import hsdp_strategy_for

    cls = hsdp_strategy_for(namespace)
    assert pl.strategies.StrategyRegistry["onebit_hsdp"]["strategy"] is cls
    assert issubclass(cls, pl.strategies.ModelParallelStrategy)
    with pytest.raises(ValueError, match="save_distributed_checkpoint=False is not supported"):
        cls(save_distributed_checkpoint=False)
    with pytest.raises(TypeError, match="tensor_parallel_size has no meaning here"):
        cls(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="shard_size must be 'auto' or an int >= 1"):
        cls(shard_size=0)
