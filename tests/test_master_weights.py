"""master_weights=True: bf16 parameters stepped through fp32 master copies."""

import pytest
import torch

from onebit_plugin import OneBitAdam

STEPS, LR = 60, 1e-4  # 60 steps of about lr: 6e-3, more than half a bf16 ulp (2**-8) below 1


def _run(dtype, master_weights, state_dict=None, steps=STEPS):
    torch.manual_seed(0)
    w0 = torch.randn(64, 64).to(torch.bfloat16)  # representable in bf16: both start equal
    direction = torch.randn(64, 64)
    w = w0.to(dtype, copy=True).requires_grad_()
    opt = OneBitAdam([w], lr=LR, freeze_step=10, master_weights=master_weights)
    if state_dict is not None:
        w.data.copy_(state_dict["w"])
        opt.load_state_dict(state_dict["opt"])
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        # A steady direction plus noise, rounded to bf16 so every run sees the same gradient.
        g = (direction + 0.1 * torch.randn(64, 64, generator=gen)).to(torch.bfloat16)
        if state_dict is not None and step < opt.global_step:
            continue
        w.grad = g.to(dtype)
        opt.step()
    return w0, w, opt


def test_bf16_master_weights_follow_the_fp32_run_bitwise():
    _, w32, _ = _run(torch.float32, False)
    w0, w16, opt = _run(torch.bfloat16, True)
    assert opt.stage == "compression"
    assert torch.equal(opt.state[w16]["master"], w32.detach())
    assert torch.equal(w16.detach(), w32.detach().to(torch.bfloat16))
    changed = (w16.detach() != w0).float().mean().item()
    _, plain, _ = _run(torch.bfloat16, False)
    lost = (plain.detach() != w0).float().mean().item()
    assert changed > 0.9 and lost < 0.1, (changed, lost)  # without: rounded away every step


def test_master_weights_resume_continues_bitwise():
    _, full, _ = _run(torch.bfloat16, True)
    _, half, opt = _run(torch.bfloat16, True, steps=STEPS // 2)
    saved = {"w": half.detach().clone(), "opt": opt.state_dict()}
    assert saved["opt"]["state"][0]["master"].dtype == torch.float32
    _, resumed, _ = _run(torch.bfloat16, True, state_dict=saved)
    assert torch.equal(resumed, full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_master_weights_only_for_low_precision(dtype):
    _, w, opt = _run(dtype, True, steps=2)
    assert ("master" in opt.state[w]) == (dtype != torch.float32)


def test_a_master_is_dropped_when_loaded_without_master_weights(caplog):
    _, w, opt = _run(torch.bfloat16, True, steps=12)
    saved = opt.state_dict()
    plain = OneBitAdam([w], lr=LR, freeze_step=10)
    with caplog.at_level("WARNING", logger="onebit_plugin"):
        plain.load_state_dict(saved)
    assert "master" not in plain.state[w]
    assert sum("master copies" in r.getMessage() for r in caplog.records) == 1


def test_low_precision_parameters_without_master_weights_are_said(caplog):
    w = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    with caplog.at_level("WARNING", logger="onebit_plugin"):
        OneBitAdam([w], freeze_step=2)
        OneBitAdam([w], freeze_step=2, master_weights=True)
    said = [r.getMessage() for r in caplog.records if "master_weights=True" in r.getMessage()]
    assert len(said) == 1 and "torch.bfloat16" in said[0]
