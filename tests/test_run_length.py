"""A run that will never compress says so: a fixed freeze_step at or past the run's length is said
once at the start (wherever the length is known), a run that ended in warm-up says so once at
its end, and the Accelerate flag's line says what will happen (issue 32, item 2)."""

import logging

import pytest
import torch
from torch import nn

from onebit_plugin import OneBitAdam
from tests.dist_helpers import run_ranks

NEVER = "is at or past the end of the run"
ENDED = "nothing was compressed"


def _said(caplog, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records if r.name == "onebit_plugin")


def _steps(opt, model, n):
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(4, 3)).square().sum().backward()
        opt.step()


@pytest.mark.parametrize("freeze_step,total_steps,said", [
    (20, 20, 1), (30, 20, 1), (19, 20, 0), ("auto", 20, 0), (20, None, 0)])
def test_a_freeze_step_at_or_past_the_runs_end_is_said_at_construction(
        caplog, freeze_step, total_steps, said):
    caplog.set_level(logging.WARNING, "onebit_plugin")
    opt = OneBitAdam(nn.Linear(3, 2).parameters(), freeze_step=freeze_step,
                     total_steps=total_steps)
    assert _said(caplog, NEVER) == said
    assert opt.compresses_within_run() is {1: False, 0: None if total_steps is None else True}[said]


def test_a_length_learnt_later_is_checked_and_said_once(caplog):
    caplog.set_level(logging.WARNING, "onebit_plugin")
    opt = OneBitAdam(nn.Linear(3, 2).parameters(), freeze_step=10)
    assert opt.compresses_within_run() is None
    opt.set_total_steps(10)
    opt.set_total_steps(10)
    assert _said(caplog, NEVER) == 1
    assert "(10 optimizer steps)" in caplog.text and "2-2" not in caplog.text
    assert opt.compresses_within_run() is False


def test_the_end_of_a_run_that_never_compressed_is_said_once(caplog):
    caplog.set_level(logging.WARNING, "onebit_plugin")
    model = nn.Linear(3, 2)
    untouched = OneBitAdam(model.parameters(), freeze_step=100)
    untouched.training_ended()  # no step taken: nothing to say
    warm = OneBitAdam(model.parameters(), freeze_step=100)
    _steps(warm, model, 3)
    warm.training_ended()
    warm.training_ended()
    frozen = OneBitAdam(model.parameters(), freeze_step=2)
    _steps(frozen, model, 3)
    frozen.training_ended()
    assert _said(caplog, ENDED) == 1
    assert "after 3 optimizer steps" in caplog.text


def test_the_accelerate_line_says_what_will_happen():
    pytest.importorskip("accelerate")
    from onebit_plugin.integrations.accelerate_flag import _when

    params = nn.Linear(3, 2).parameters
    assert _when(OneBitAdam(params(), freeze_step=5)).startswith(
        "after step 5, if the run is longer than that")
    assert _when(OneBitAdam(params(), freeze_step=5, total_steps=20)) == "after step 5 of 20"
    assert _when(OneBitAdam(params(), freeze_step=50, total_steps=20)).startswith(
        "never: freeze_step=50 is at or past the run's 20 optimizer steps")


def test_the_trainer_patch_says_when_train_never_compressed(caplog):
    """The patched ``Trainer.train``, on a class with the methods it wraps (the real Trainer
    under onebit-run: tests/test_hf_trainer.py)."""
    from onebit_plugin.integrations.transformers_trainer import patch_trainer

    caplog.set_level(logging.WARNING, "onebit_plugin")
    model = nn.Linear(3, 2)

    class Trainer:
        def _save_optimizer_and_scheduler(self, output_dir):
            pass

        def _load_optimizer_and_scheduler(self, checkpoint):
            pass

        def create_scheduler(self, num_training_steps, optimizer=None):
            return None

        def train(self):
            self.create_scheduler(4)
            _steps(self.optimizer, model, 4)
            return "trained"

    patch_trainer(Trainer)
    trainer = Trainer()
    trainer.optimizer = OneBitAdam(model.parameters(), freeze_step=10)
    assert trainer.train() == "trained"
    assert _said(caplog, NEVER) == 1 and "(4 optimizer steps)" in caplog.text
    assert _said(caplog, ENDED) == 1


def _fit_past_the_end(rank, world):
    import pytorch_lightning as pl

    import onebit_plugin

    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logging.getLogger("onebit_plugin").addHandler(Keep())

    class M(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch, _):
            return self.layer(batch[0]).square().mean()

        def configure_optimizers(self):
            return onebit_plugin.OneBitAdam(self.parameters(), freeze_step=1000)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), 4)
    trainer = pl.Trainer(strategy="onebit_adam", accelerator="cpu", devices=1, max_steps=6,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(M(), data)
    return messages


def test_lightning_says_it_at_the_start_and_at_the_end():
    (messages,) = run_ranks(_fit_past_the_end, 1)
    never = [m for m in messages if NEVER in m]
    ended = [m for m in messages if ENDED in m]
    assert len(never) == 1 and "(6 optimizer steps)" in never[0], messages
    assert len(ended) == 1 and "after 6 optimizer steps" in ended[0], messages


def test_a_misspelt_variable_gets_the_nearest_name(monkeypatch):
    from onebit_plugin.settings.config import settings_from_env

    for name in [k for k in __import__("os").environ if k.startswith("ONEBIT_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("ONEBIT_ADAM", "1")
    monkeypatch.setenv("ONEBIT_FREEZE_STEP", "10")
    monkeypatch.setenv("ONEBIT_TOTALSTEPS", "100")
    with pytest.raises(ValueError,
                       match=r"ONEBIT_TOTALSTEPS \(did you mean ONEBIT_TOTAL_STEPS\?\)"):
        settings_from_env()


def test_two_optimizers_under_a_strategy_name_the_way_that_works():
    from onebit_plugin.integrations.ddp_strategies import require_member

    params = nn.Linear(3, 2).parameters
    with pytest.raises(ValueError, match=r"got OneBitAdam, OneBitAdam; for several optimizers "
                                         r"\(a GAN's\).*register_onebit_hook"):
        require_member([OneBitAdam(params(), freeze_step=2), OneBitAdam(params(), freeze_step=2)],
                       "one onebit_plugin.OneBitAdam")
