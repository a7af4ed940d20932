"""The Accelerate flag says once when its processes have nothing to exchange: one process, or
several that Accelerate runs each alone (``accelerate launch --multi_gpu`` on a CPU-only machine
without ACCELERATE_USE_CPU=true: every process trains the same model by itself)."""

import logging

import pytest
import torch

pytest.importorskip("accelerate")


@pytest.mark.parametrize("world_size,said", [
    ("1", "in one process: there is nothing to exchange"),
    ("2", "this launch started 2 processes but Accelerate runs each one alone"),
])
def test_processes_that_exchange_nothing_are_said_once(monkeypatch, caplog, capsys, world_size,
                                                       said):
    from onebit_plugin.integrations.accelerate_flag import Accelerator

    for name in [k for k in __import__("os").environ if k.startswith("ONEBIT_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("ONEBIT_ADAM", "1")
    monkeypatch.setenv("ONEBIT_FREEZE_STEP", "3")
    monkeypatch.setenv("WORLD_SIZE", world_size)
    caplog.set_level(logging.WARNING, "onebit_plugin")
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    accelerator.prepare(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()))
    text = caplog.text + capsys.readouterr().out
    assert text.count(said) == 1, text
    assert type(optimizer.optimizer).__name__ == "OneBitAdam"


def test_accelerates_fsdp_plugin_is_refused_by_name(monkeypatch):
    """Accelerate runs FSDP only on GPUs (on CPUs it falls back to MULTI_CPU), so its
    distributed type is set by hand here: the flag refuses it at construction, before any
    optimizer is built over whole parameters."""
    import accelerate

    from onebit_plugin.integrations.accelerate_flag import Accelerator

    for name in [k for k in __import__("os").environ if k.startswith("ONEBIT_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("ONEBIT_ADAM", "1")
    monkeypatch.setenv("ONEBIT_FREEZE_STEP", "3")
    monkeypatch.setattr(accelerate.Accelerator, "distributed_type",
                        property(lambda self: accelerate.DistributedType.FSDP))
    with pytest.raises(ValueError, match="does not support Accelerate's FSDP plugin"):
        Accelerator(cpu=True)
