"""Trainer(strategy="onebit_adam") end to end: 2 CPU processes launched by Lightning itself
(examples/train_lightning.py), precisions, accumulation, clipping, logging, checkpoint resume."""

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.dist_helpers import assert_ranks_identical, run_ranks
from tests.procs import owned_processes

pytest.importorskip("pytorch_lightning")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_lightning.py"
# The script's default freeze_step="auto": the strategy hands OneBitAdam the Trainer's
# estimated_stepping_batches, and on these short runs the variance freezes at the ceiling, 20%
# of it (6 of the 30-step runs' steps; the first settledness check is at step 16).
FREEZE = 6


def _fit(out: Path, *args: str) -> str:
    cmd = [sys.executable, str(SCRIPT), "--devices", "2", "--freeze-step", "auto",
           "--val-every", "10", "--log-every", "5", "--out", str(out), *args]
    with owned_processes() as start:  # Lightning's own rank processes included
        proc = start(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
    return stdout + stderr


def _ranks(out: Path) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _csv_column(out: Path, name: str) -> list[tuple[int, float]]:
    rows = []
    for path in sorted((out / "csv").glob("version_*/metrics.csv")):
        with open(path) as f:
            for row in csv.DictReader(f):
                if row.get(name):
                    rows.append((int(row["step"]), float(row[name])))
    return rows


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    """32-true with gradient accumulation, clipping, checkpoints every 10 steps and a test loop."""
    out = tmp_path_factory.mktemp("fp32")
    log = _fit(out, "--steps", "30", "--precision", "32-true", "--accumulate", "2",
               "--clip", "1.0", "--ckpt-every", "5", "--test", "--check-lockstep", "1")
    return out, log


def test_fp32_accumulation_clipping_lockstep(fp32_run):
    out, _ = fp32_run
    ranks = _ranks(out)
    assert_ranks_identical([r["params"] for r in ranks], "parameters")
    assert ranks[0]["stage"] == "compression" and ranks[0]["switch_step"] == FREEZE
    assert ranks[0]["global_step"] == 30
    summary = json.loads((out / "summary.json").read_text())
    assert summary["overlap"] is True
    assert summary["test_loss"] is not None
    assert summary["compression_stage_bytes"] <= 0.033 * summary["compression_stage_dense_bytes"]


def test_stage_switch_logged_once_at_the_right_step(fp32_run):
    out, log = fp32_run
    assert log.count(f"variance frozen after step {FREEZE};") == 1
    assert _csv_column(out, "onebit/switch_step") == [(FREEZE, float(FREEZE))]
    stages = dict(_csv_column(out, "onebit/stage"))
    assert stages[5] == 0.0 and stages[10] == 1.0  # logged every 5 steps
    ratios = _csv_column(out, "onebit/compression_ratio")
    assert ratios[-1][1] > ratios[0][1] > 0.99  # grows once compression starts
    assert list((out / "tb").glob("version_*/events.out.tfevents.*"))


def test_resume_in_warm_up_continues_the_uninterrupted_run_bitwise(fp32_run, tmp_path):
    """From the step-5 checkpoint, before the freeze (a resume in the compression stage, from
    fit(ckpt_path="last"), is the hang test's second half)."""
    out, _ = fp32_run
    resume_step = 5
    ckpt = out / "ckpt" / f"step={resume_step}.ckpt"
    assert ckpt.exists(), sorted(p.name for p in (out / "ckpt").iterdir())
    log = _fit(tmp_path, "--steps", "30", "--precision", "32-true", "--accumulate", "2",
               "--clip", "1.0", "--resume", str(ckpt), "--check-lockstep", "1")
    uninterrupted, resumed = _ranks(out), _ranks(tmp_path)
    # Resumed at step 5, not run again from 0 (the data and the initialisation are functions
    # of the seed: a rerun ends on the same bits).
    assert [r["started_at"] for r in uninterrupted] == [0, 0]
    assert [r["started_at"] for r in resumed] == [resume_step, resume_step]
    assert_ranks_identical([r["params"] for r in resumed], "resumed parameters")
    assert resumed[0]["global_step"] == 30 and resumed[0]["switch_step"] == FREEZE
    # Every rank's own error buffers came back: the same trajectory, bit for bit.
    for a, b in zip(uninterrupted[0]["params"], resumed[0]["params"], strict=True):
        assert torch.equal(a, b)
    # The callback's state came back too: the switch is announced once per run.
    assert log.count("variance frozen after step") == 1


def test_a_compression_stage_checkpoint_resumes_on_another_number_of_devices(fp32_run, tmp_path):
    """The 2-device run's step-15 checkpoint (compression stage) on 3 devices (an elastic
    restart): rank 0's state, the error feedback restarted from zero and said once, the ranks
    compress on in lockstep to the end."""
    out, _ = fp32_run
    log = _fit(tmp_path, "--steps", "30", "--precision", "32-true", "--accumulate", "2",
               "--clip", "1.0", "--resume", str(out / "ckpt" / "step=15.ckpt"),
               "--check-lockstep", "1", "--devices", "3")
    assert log.count("error feedback restarts from zero") == 1, log[-3000:]
    assert "saved by 2 ranks on 3" in log
    resumed = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    assert [r["started_at"] for r in resumed] == [15, 15, 15]
    assert resumed[0]["global_step"] == 30 and resumed[0]["switch_step"] == FREEZE
    assert_ranks_identical([r["params"] for r in resumed], "resumed parameters")


def test_bf16_mixed_accumulation_clipping_lockstep_logged_once_per_optimizer_step(tmp_path):
    _fit(tmp_path, "--steps", "12", "--precision", "bf16-mixed", "--accumulate", "2",
         "--clip", "0.5", "--log-every", "1", "--check-lockstep", "1")  # frozen at 2 (20% of 12)
    ranks = _ranks(tmp_path)
    assert_ranks_identical([r["params"] for r in ranks], "parameters")
    assert ranks[0]["stage"] == "compression"
    assert [r["lockstep_checks"] for r in ranks] == [12, 12]  # not 2 per optimizer step
    logged = [step for step, _ in _csv_column(tmp_path, "onebit/stage")]
    assert logged == list(range(1, 13)), logged


def _tiny_fit(rank, world, optimizer, precision, namespace="pytorch_lightning"):
    import importlib

    from torch import nn

    pl = importlib.import_module(namespace)

    import onebit_plugin  # noqa: F401 -- registers the strategy

    class M(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            if optimizer == "adam":
                return torch.optim.Adam(self.parameters())
            return onebit_plugin.OneBitAdam(self.parameters(), freeze_step=2)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), 4)
    # On CPU Lightning turns precision="16-mixed" into bf16-mixed; fp16 AMP with a GradScaler,
    # what "16-mixed" means on GPUs, has to be passed as a plugin here.
    plugins = []
    if precision == "16-mixed":
        plugins = [pl.plugins.precision.MixedPrecision(
            "16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))]
        precision = None
    trainer = pl.Trainer(strategy="onebit_adam", accelerator="cpu", devices=1, max_steps=2,
                         precision=precision, plugins=plugins, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)
    try:
        trainer.fit(M(), data)
    except ValueError as exc:
        return str(exc)
    return type(trainer.strategy).__mro__[1].__module__, trainer.optimizers[0].stage


@pytest.mark.parametrize("optimizer,precision,message", [
    ("adam", "32-true", "needs configure_optimizers() to return one onebit_plugin.OneBitAdam"),
    ("onebit", "16-mixed", "supports precision 32-true, bf16-mixed, bf16-true; got '16-mixed'"),
])
def test_misconfiguration_is_a_clear_error(optimizer, precision, message):
    (error,) = run_ranks(_tiny_fit, 1, optimizer, precision)
    assert message in error, error


@pytest.mark.parametrize("namespace", ["pytorch_lightning", "lightning.pytorch"])
def test_strategy_registered_in_each_lightning_namespace(namespace):
    pytest.importorskip(namespace)
    (result,) = run_ranks(_tiny_fit, 1, "onebit", "32-true", namespace)
    base_module, stage = result
    assert base_module == f"{namespace}.strategies.ddp" and stage == "compression"


def _exact_lightning_worker(rank, world, compress):
    """Lightning on an already initialised 2-rank group (LOCAL_RANK set: Lightning starts no
    processes), next to the exact-allreduce reference of test_one_path on the same data."""
    import os

    import pytorch_lightning as pl

    from onebit_plugin import OneBitAdam
    from onebit_plugin.integrations.lightning import OneBitAdamStrategy
    from tests.test_one_path import FREEZE, LR, STEPS, Uneven, _batch, _exact_reference, _path

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world),
                      RANK=str(rank))

    class M(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Uneven()

        def training_step(self, batch, batch_idx):
            tokens, y = _batch(self.global_rank, self.global_step)
            return torch.nn.functional.cross_entropy(self.net(tokens), y)

        def configure_optimizers(self):
            return OneBitAdam(self.parameters(), lr=LR, freeze_step=FREEZE, weight_decay=0.01,
                              compress_momentum=compress, follow_variance=compress)

    data = torch.utils.data.DataLoader(range(STEPS), batch_size=1)
    trainer = pl.Trainer(strategy=OneBitAdamStrategy(bucket_cap_mb=0.004), accelerator="cpu",
                         devices=world, max_steps=STEPS, use_distributed_sampler=False,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    module = M()
    trainer.fit(module, data)
    return ([p.detach().clone() for p in module.net.parameters()], _exact_reference(rank),
            len(trainer.optimizers[0].units), _path(rank, "plain", compress)["params"])


@pytest.mark.parametrize("compress", [False, True])
def test_lightning_equals_the_plain_path_and_compress_momentum_false_is_exact(compress):
    """The strategy (DDP, the hook, bucket views, Lightning's loop) ends on the bits of
    OneBitAdam without DDP on the same data, with the 1-bit exchange and without; and with
    compress_momentum=False on those of the exact-allreduce reference."""
    for lightning, exact, units, plain in run_ranks(_exact_lightning_worker, 2, compress):
        assert units >= 3
        for a, b in zip(lightning, plain, strict=True):
            assert torch.equal(a, b)
        same = all(torch.equal(a, b) for a, b in zip(lightning, exact, strict=True))
        assert same != compress  # exact when asked; the 1-bit exchange is not


@pytest.mark.parametrize("strategy", ["onebit_adam_spawn", "onebit_adam_fork"])
def test_spawn_and_fork_strategies_fit_on_two_processes(tmp_path, strategy):
    """Lightning pickles the trainer, strategy and callback for these start methods."""
    _fit(tmp_path, "--steps", "14", "--strategy", strategy, "--check-lockstep", "1")
    ranks = _ranks(tmp_path)
    assert_ranks_identical([r["params"] for r in ranks], "parameters")
    for r in ranks:
        assert r["stage"] == "compression" and r["global_step"] == 14
        assert r["lockstep_checks"] == 14


def test_rank_zero_exits_when_its_peer_hangs_and_fit_resumes_from_last(fp32_run, tmp_path):
    """strategy="onebit_adam" with comm_timeout=3 and the fp32 run's settings: rank 1 hangs at
    step 20, rank 0 raises CommunicationError and its process ends, non-zero. (Lightning does not
    end the hung rank it started; owned_processes does, and checks that nothing is left.) Then
    fit(ckpt_path="last") on the same folder ends bit for bit where the uninterrupted run ended."""
    settings = ["--steps", "30", "--precision", "32-true", "--accumulate", "2", "--clip", "1.0",
                "--ckpt-every", "5", "--check-lockstep", "1", "--comm-timeout", "3"]
    cmd = [sys.executable, str(SCRIPT), "--devices", "2", "--freeze-step", "auto",
           "--val-every", "10", "--log-every", "5", "--out", str(tmp_path), *settings,
           "--hang-at", "20"]
    log = tmp_path / "log.txt"
    with owned_processes() as start, open(log, "w") as sink:
        started = time.monotonic()
        # A file, not a pipe: the hung rank keeps its copy of the output open.
        proc = start(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
        proc.wait(timeout=120)
        elapsed = time.monotonic() - started
    output = log.read_text()
    assert proc.returncode not in (0, None), output[-3000:]
    # The model is one momentum unit, which the strategy's bucket views leave to step(): the
    # first collective of OneBitAdam's after the hang is the clipping norm's allreduce.
    assert "CommunicationError: onebit: the clipping norm's allreduce" in output, output[-3000:]
    assert "failed on rank 0 of 2 (timeout 3 s)" in output
    print(f"rank 0 exited {proc.returncode} {elapsed:.1f} s after the start")
    assert elapsed < 60, elapsed
    assert not (tmp_path / "rank0.pt").exists()

    resumed_log = _fit(tmp_path, *settings, "--resume", "last")
    assert "Restoring states from the checkpoint path at" in resumed_log and \
        "last.ckpt" in resumed_log, resumed_log[-3000:]
    # A resume in the compression stage: the callback's state says the switch was announced.
    assert "variance frozen after step" not in resumed_log
    uninterrupted, resumed = _ranks(fp32_run[0]), _ranks(tmp_path)
    assert resumed[0]["global_step"] == 30
    assert [r["started_at"] for r in resumed] == [15, 15]  # last.ckpt: step 15
    for r in range(2):
        for a, b in zip(uninterrupted[r]["params"], resumed[r]["params"], strict=True):
            assert torch.equal(a, b)


# OneBitLamb under the same strategy: LAMB to step 10, then the 1-bit momentum; the run is
# checkpointed every 5 steps and resumed at step 20, in the compression stage.
LAMB = ("--optimizer", "lamb", "--freeze-step", "10", "--steps", "30", "--precision", "32-true")


def test_onebit_lamb_fits_in_lockstep_and_resumes_bitwise(tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _fit(whole, *LAMB, "--ckpt-every", "5", "--check-lockstep", "1")
    ranks = _ranks(whole)
    assert_ranks_identical([r["params"] for r in ranks], "final parameters")
    assert [r["lockstep_checks"] for r in ranks] == [30, 30]
    _fit(resumed, *LAMB, "--resume", str(whole / "ckpt" / "step=20.ckpt"))
    assert [r["started_at"] for r in _ranks(resumed)] == [20, 20]
    for a, b in zip(ranks[0]["params"], _ranks(resumed)[0]["params"], strict=True):
        assert torch.equal(a, b)


# ZeroOneAdam under the same strategy: Adam to step 13, then phase B at once (phase A ends at
# var_freeze_step + 1 = 13, as DeepSpeed counts, before var_update_scaler 16), the local interval
# doubling every 2 steps: steps 14, 15, 16 and 30 (the run's last) sync, the others are local.
# Step 25 is between syncs.
ZERO_ONE = ("--optimizer", "zero_one", "--var-freeze-step", "12", "--local-step-scaler", "2",
            "--steps", "30", "--precision", "32-true")


@pytest.fixture(scope="module")
def zero_one_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero_one")
    log = _fit(out, *ZERO_ONE, "--ckpt-every", "5", "--check-lockstep", "1")
    return out, log


def test_zero_one_adam_fits_and_ends_on_one_point(zero_one_run):
    out, _ = zero_one_run
    ranks = _ranks(out)
    assert_ranks_identical([r["params"] for r in ranks], "final parameters")
    # Lockstep was checked only where the ranks must agree: 13 Adam steps and 4 syncs.
    assert [r["lockstep_checks"] for r in ranks] == [17, 17]
    phases = _csv_column(out, "onebit/phase")
    assert phases and phases[-1][1] == 2.0
    # Logged at step 30, after its sync: the schedule's 4 and the callback's before the
    # validation at step 20 (between the syncs at 16 and 30; validations every 10 steps).
    assert _csv_column(out, "onebit/syncs")[-1][1] == 5.0
    assert _csv_column(out, "onebit/local_interval")[-1][1] == 16.0


def test_zero_one_adam_resumed_between_syncs_continues_every_rank_bitwise(zero_one_run,
                                                                         tmp_path):
    out, _ = zero_one_run
    ckpt = out / "ckpt" / "step=25.ckpt"
    _fit(tmp_path, *ZERO_ONE, "--resume", str(ckpt))
    uninterrupted, resumed = _ranks(out), _ranks(tmp_path)
    assert [r["started_at"] for r in resumed] == [25, 25]
    for a, b in zip(uninterrupted[0]["params"], resumed[0]["params"], strict=True):
        assert torch.equal(a, b)


# Each import as a new user's first line, in a process of its own (nothing imported before):
# importing one of these modules is what loads the framework, whose import hook then registers
# the strategies while that module is still half made (2026-12-04: an ImportError on a
# circular import for the first five, before the hook left a module being imported alone).
FIRST_IMPORTS = [
    "from onebit_plugin.integrations.lightning import OneBitAdamStrategy, OneBitAdamCallback",
    "from onebit_plugin.integrations.for_pytorch_lightning import OneBitAdamStrategy",
    "from onebit_plugin.integrations.for_lightning_pytorch import OneBitAdamStrategy",
    "from onebit_plugin.integrations.for_lightning_fabric import OneBitAdamFabricStrategy",
    "from onebit_plugin.integrations.for_lightning_fabric_package import "
    "OneBitAdamFabricStrategy",
    "import onebit_plugin, pytorch_lightning as pl; pl.Trainer(strategy='onebit_adam', "
    "accelerator='cpu', devices=1, logger=False, enable_checkpointing=False)",
]


@pytest.mark.parametrize("line", FIRST_IMPORTS)
def test_each_entry_module_imports_first_in_a_new_process(line):
    with owned_processes() as start:
        proc = start([sys.executable, "-c", line], cwd="/", stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
