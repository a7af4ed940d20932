"""DeepSpeed configs of the three 1-bit optimizers load and train (issue 31): the optimizer
sections of DeepSpeed's former unit tests (tests/unit/runtime/half_precision/onebit/
test_onebit.py) and tutorials, unchanged; unknown keys and types are refused by name."""

import json
import logging

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from onebit_plugin import (
    OneBitAdam,
    OneBitLamb,
    ZeroOneAdam,
    from_deepspeed_config,
    register_onebit_hook,
)
from tests.dist_helpers import run_ranks

# The optimizer sections as DeepSpeed's tests and tutorials wrote them ("nccl" for the test's
# get_accelerator().communication_backend_name()).
UNIT_TESTS = {
    "OneBitAdam": {"lr": 0.00015, "weight_decay": 0.01, "freeze_step": 2, "cuda_aware": False,
                   "comm_backend_name": "nccl"},
    "OneBitAdam pipeline": {"lr": 0.00001, "betas": [0.9, 0.999], "eps": 1e-8,
                            "weight_decay": 3e-7, "freeze_step": 200, "cuda_aware": False,
                            "comm_backend_name": "nccl"},
    "ZeroOneAdam": {"lr": 0.00015, "weight_decay": 0.01, "var_freeze_step": 4,
                    "var_update_scaler": 1, "local_step_scaler": 1, "local_step_clipper": 2,
                    "cuda_aware": False, "comm_backend_name": "nccl"},
    "OneBitLamb": {"lr": 0.00015, "weight_decay": 0.01, "max_coeff": 0.3, "min_coeff": 0.01,
                   "freeze_step": 2, "cuda_aware": False, "comm_backend_name": "nccl",
                   "coeff_beta": 0.9, "factor_max": 1.0, "factor_min": 0.5,
                   "factor_threshold": 0.1},
}
TUTORIALS = {
    "OneBitAdam": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7,
                   "freeze_step": 400, "cuda_aware": False, "comm_backend_name": "nccl"},
    "ZeroOneAdam": {"lr": 1e-3, "weight_decay": 0.01, "bias_correction": False,
                    "var_freeze_step": 1000, "var_update_scaler": 16,
                    "local_step_scaler": 1000, "local_step_clipper": 16, "cuda_aware": False,
                    "comm_backend_name": "nccl"},
    "OneBitLamb": {"lr": 11e-3, "weight_decay": 0.01, "bias_correction": False,
                   "max_coeff": 0.3, "min_coeff": 0.01, "freeze_step": 1000,
                   "cuda_aware": False, "comm_backend_name": "nccl", "coeff_beta": 0.9,
                   "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1},
}
CLASSES = {"OneBitAdam": OneBitAdam, "ZeroOneAdam": ZeroOneAdam, "OneBitLamb": OneBitLamb}


def _config(kind, params):
    return {"train_batch_size": 2, "steps_per_print": 1, "gradient_clipping": 1.0,
            "fp16": {"enabled": False, "loss_scale": 0, "initial_scale_power": 16},
            "optimizer": {"type": kind.split()[0], "params": dict(params)}}


def _train(rank, world, kind, params, steps):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10))
    net = DDP(model, gradient_as_bucket_view=True)
    opt = from_deepspeed_config(model.parameters(), _config(kind, params), total_steps=steps)
    register_onebit_hook(net, opt)
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(8, 10, generator=gen), torch.randint(0, 10, (8,), generator=gen)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return type(opt).__name__, opt.stage, opt.bytes_sent < opt.dense_bytes, losses


@pytest.mark.parametrize("kind", sorted(UNIT_TESTS))
def test_deepspeeds_unit_test_configs_load_and_train_on_two_ranks(kind):
    for name, stage, compressed, losses in run_ranks(_train, 2, kind, UNIT_TESTS[kind], 25):
        assert name == CLASSES[kind.split()[0]].__name__
        assert all(map(lambda v: v == v, losses))
        if "pipeline" not in kind:  # freeze_step 200 is past these 25 steps
            assert stage == "compression" and compressed


@pytest.mark.parametrize("kind", sorted(TUTORIALS))
def test_deepspeeds_tutorial_configs_load_with_their_settings(kind, tmp_path, caplog):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(_config(kind, TUTORIALS[kind])))
    model = nn.Linear(4, 4)
    with caplog.at_level(logging.INFO, logger="onebit_plugin"):
        opt = from_deepspeed_config(model.parameters(), str(path))
    assert type(opt) is CLASSES[kind]
    group = opt.param_groups[0]
    params = TUTORIALS[kind]
    assert group["lr"] == params["lr"] and group["weight_decay"] == params["weight_decay"]
    if kind == "OneBitAdam":
        assert group["betas"] == (0.8, 0.999) and opt.freeze_step == 400
        assert group["decoupled_weight_decay"]  # DeepSpeed added wd * p to the update
    if kind == "ZeroOneAdam":
        assert opt.policy.var_freeze_step == 1000 and opt.policy.local_step_scaler == 1000
    if kind == "OneBitLamb":
        assert group["max_coeff"] == 0.3 and group["factor_max"] == 4.0
    said = caplog.text
    assert "'cuda_aware'" in said and "'comm_backend_name'" in said
    assert "gradient_clipping" in said and "not applied" in said
    if "bias_correction" in params:  # DeepSpeed's optimizers applied none either way
        assert "applied no bias correction" in said
    # and it trains (its warm-up: these freeze after hundreds of steps) on 2 ranks
    for name, stage, _, losses in run_ranks(_train, 2, kind, params, 6):
        assert name == kind and stage == "warmup" and all(v == v for v in losses)


@pytest.mark.parametrize("section, error", [
    ({"type": "Adam", "params": {"lr": 1e-3}}, "'Adam' is not one of"),
    ({"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 2, "frezee_step": 3}},
     "unknown parameter(s) ['frezee_step']"),
    ({"type": "OneBitLamb", "params": {"lr": 1e-3, "freeze_step": 2, "var_freeze_step": 3}},
     "unknown parameter(s) ['var_freeze_step'] (var_freeze_step is a parameter of ZeroOneAdam "
     "only)"),
    ({"type": "OneBitLamb", "params": {"lr": 1e-3, "follow_variance": True}},
     "(follow_variance is a parameter of OneBitAdam and ZeroOneAdam only)"),
    ({"type": "OneBitAdam", "params": {"lr": 1e-3, "amsgrad": True}}, "amsgrad"),
    ({"type": "OneBitAdam", "params": {"lr": 1e-3, "amsgrad": "false"}},
     '"amsgrad": "false" is not supported'),
    ({"type": "OneBitAdam", "params": [1]}, '"params" must be an object'),
    ({"type": "OneBitLamb", "params": {"lr": "auto", "freeze_step": 5}},
     "the placeholder transformers' DeepSpeed integration fills in"),
    ({"type": "OneBitAdam", "params": {}, "scheduler": {}}, "unknown key(s) ['scheduler']"),
    ({"params": {"lr": 1e-3}}, "no \"optimizer\" section"),
])
def test_bad_configs_are_refused_by_name(section, error):
    with pytest.raises(ValueError) as info:
        from_deepspeed_config(nn.Linear(2, 2).parameters(), {"optimizer": section})
    assert error in str(info.value)


def test_engine_sections_that_change_training_are_warned_and_the_call_overrides(caplog):
    config = _config("OneBitLamb", TUTORIALS["OneBitLamb"])
    config["fp16"]["enabled"] = True
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}
    with caplog.at_level(logging.INFO, logger="onebit_plugin"):
        opt = from_deepspeed_config(nn.Linear(2, 2).parameters(), config, freeze_step=5)
    assert opt.freeze_step == 5  # the call's, not the config's 1000, and said
    warned = {r.getMessage().split('"')[1] for r in caplog.records
              if r.levelno == logging.WARNING and "is the engine's" in r.getMessage()}
    assert warned == {"fp16", "scheduler", "gradient_clipping"}
    assert "freeze_step=5 given to from_deepspeed_config replaces the config's 1000" in \
        caplog.text


def test_deepspeeds_momentum_mask_becomes_a_mask():
    """DeepSpeed's exp_avg_mask param-group key (TestOneBitAdamExpAvgMask): the first row of a
    weight kept, the rest masked; the key leaves the group."""
    torch.manual_seed(0)
    model = nn.Linear(10, 10)
    mask = torch.zeros_like(model.weight)
    mask[0] = 1
    groups = [{"params": [model.weight], "weight_decay": 0.01, "exp_avg_mask": mask.flatten()},
              {"params": [model.bias], "weight_decay": 0.01}]
    opt = from_deepspeed_config(groups, _config("OneBitAdam", UNIT_TESTS["OneBitAdam"]))
    assert "exp_avg_mask" not in opt.param_groups[0]
    assert "exp_avg_mask" in groups[0]  # the caller's dicts are left as they were
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(8, 10)).square().sum().backward()
        opt.step()
    assert opt.stage == "compression"
    momentum = opt.state[model.weight]["exp_avg"]
    assert torch.equal(momentum[1:], torch.zeros_like(momentum[1:]))
    assert bool((momentum[0] != 0).all())
