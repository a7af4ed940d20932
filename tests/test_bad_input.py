"""Bad input gets a clear error naming the problem; lockstep violations are caught."""

import pytest
import torch
from torch import nn

from onebit_plugin import LockstepError, OneBitAdam, OneBitLamb, ZeroOneAdam, check_lockstep
from tests.dist_helpers import run_ranks


def test_empty_parameter_list():
    with pytest.raises(ValueError, match="empty parameter list"):
        OneBitAdam([], freeze_step=5)


@pytest.mark.parametrize("member", [OneBitAdam, OneBitLamb, ZeroOneAdam])
def test_a_misspelt_family_option_names_the_option_and_the_nearest(member):
    params = nn.Linear(2, 2).parameters()
    schedule = {} if member is ZeroOneAdam else {"freeze_step": 4}
    with pytest.raises(TypeError, match=rf"^{member.__name__}\(\) got an unexpected keyword "
                                        r"argument 'max_blok' \(did you mean 'max_block'\?\)"):
        member(params, max_blok=1024, **schedule)
    with pytest.raises(TypeError, match="unexpected keyword argument 'overlap'$"):
        member(params, overlap=True, **schedule)
    # Spelt right, each option reaches the config, and a bad value is the config's error.
    opt = member(nn.Linear(2, 2).parameters(), max_block=1024, bound_update=False,
                 error_dtype="bfloat16", **schedule)
    assert (opt.config.max_block, opt.config.bound_update, opt.config.error_dtype) == \
        (1024, False, "bfloat16")
    with pytest.raises(ValueError, match="max_block must be a positive multiple of 8"):
        member(nn.Linear(2, 2).parameters(), max_block=12, **schedule)


@pytest.mark.parametrize("member,wrong,meant", [
    (OneBitAdam, "freze_step", "freeze_step"),
    (OneBitAdam, "decoupled_weigth_decay", "decoupled_weight_decay"),
    (ZeroOneAdam, "local_step_scalar", "local_step_scaler"),
    (ZeroOneAdam, "var_freez_step", "var_freeze_step"),
    (OneBitLamb, "max_coef", "max_coeff")])
def test_a_misspelt_member_argument_names_the_members_own_nearest(member, wrong, meant):
    schedule = {"freeze_step": 4} if member is not ZeroOneAdam and wrong != "freze_step" else {}
    with pytest.raises(TypeError, match=rf"^{member.__name__}\(\) got an unexpected keyword "
                                        rf"argument '{wrong}' \(did you mean '{meant}'\?\)"):
        member(nn.Linear(2, 2).parameters(), **{wrong: 1}, **schedule)


def test_one_bit_lamb_refuses_adams_weight_decay_switch_saying_why():
    with pytest.raises(TypeError, match=r"OneBitLamb\(\) takes no 'decoupled_weight_decay': "
                                        r".*LAMB's"):
        OneBitLamb(nn.Linear(2, 2).parameters(), freeze_step=4, decoupled_weight_decay=True)


def test_zero_one_adam_refuses_one_bit_adams_options_saying_why():
    params = nn.Linear(2, 2).parameters()
    with pytest.raises(TypeError, match=r"ZeroOneAdam\(\) takes no 'freeze_step': .*"
                                        r"var_freeze_step"):
        ZeroOneAdam(params, freeze_step=10)
    with pytest.raises(TypeError, match=r"takes no 'compress_momentum': .*OneBitAdam"):
        ZeroOneAdam(params, compress_momentum=False)


def test_the_family_options_are_declared_once_and_read_as_keyword_arguments():
    """One declaration (OneBitConfig's fields): every member takes each of them by name, and a
    reader of signatures (jsonargparse, as LightningCLI uses it) sees them with their types."""
    import dataclasses

    from jsonargparse import ArgumentParser

    from onebit_plugin.settings.config import FamilyOptions, OneBitConfig

    fields = {f.name for f in dataclasses.fields(OneBitConfig)} - {"freeze_step"}
    assert set(FamilyOptions.__annotations__) == fields
    parser = ArgumentParser()
    parser.add_class_arguments(ZeroOneAdam, "opt", skip={"params"})
    got = parser.parse_args(["--opt.max_block=1024", "--opt.bound_update=false",
                             "--opt.comm_timeout=30"]).opt
    assert (got.max_block, got.bound_update, got.comm_timeout) == (1024, False, 30.0)
    with pytest.raises(SystemExit):  # a typed option: not a number
        parser.parse_args(["--opt.max_block=many"])


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate")
def test_a_parameter_twice_in_one_group():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"more than once in one parameter group \(group 0, "
                                         r"again at #2, shape \(2,\)\)"):
        OneBitAdam([a, b, a], freeze_step=5)
    opt = OneBitAdam([b], freeze_step=5)
    with pytest.raises(ValueError, match="more than once"):
        opt.add_param_group({"params": [a, a]})
    assert len(opt.param_groups) == 1  # the refused group is not kept


def test_adam_update_with_a_step_count_not_from_one():
    from onebit_plugin import adam_update_

    p, g, m, v = (torch.ones(3) for _ in range(4))
    for step in (0.0, torch.tensor(1.0)):
        with pytest.raises(ValueError, match="each step must be a number >= 1"):
            adam_update_([p], [g], [m], [v], [step], lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8,
                         weight_decay=0.0, decoupled=False)
    assert torch.equal(p, torch.ones(3)) and torch.equal(m, torch.ones(3))


def test_parameters_on_mixed_devices():
    a = nn.Parameter(torch.zeros(2))
    b = nn.Parameter(torch.zeros(2, device="meta"))
    with pytest.raises(ValueError, match=r"all parameters on one device, got \['cpu', 'meta'\]"):
        OneBitAdam([a, b], freeze_step=5)


def test_deepspeed_zero_partitioned_parameters():
    p = nn.Parameter(torch.zeros(4))
    p.ds_id = 0  # what DeepSpeed ZeRO-3 puts on its partitioned parameters
    with pytest.raises(ValueError, match="DeepSpeed ZeRO-partitioned parameters; it supports "
                                         "unsharded data parallelism only: plain torch"):
        OneBitAdam([p], freeze_step=5)


def _mismatch_worker(rank, world):
    model = nn.Linear(4, 2)
    opt = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=10 if rank == 0 else 12)
    model(torch.randn(3, 4)).sum().backward()
    try:
        opt.step()
    except ValueError as exc:
        return str(exc), [p.detach().clone() for p in model.parameters()]
    return "no error", None


def test_mismatched_freeze_step_between_ranks():
    for message, _ in run_ranks(_mismatch_worker, 2):
        assert message == ("OneBitAdam's freeze_step differs between ranks: [10, 12] (rank 0..1);"
                           " every rank must use the same settings and parameters")


def _weights_worker(rank, world, differ):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 2))
    # A float sum's rounding would depend on the thread count: no false alarm. Two threads in a
    # forked child hang once the parent has used OpenMP: the test starts these ranks by spawn.
    torch.set_num_threads(1 + rank)
    if differ and rank == 1:
        with torch.no_grad():
            model[1].bias[0] = torch.nextafter(model[1].bias[0], torch.tensor(1.0))  # one ulp
    before = [p.detach().clone() for p in model.parameters()]
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=5)
    model(torch.randn(5, 512, generator=torch.Generator().manual_seed(rank))).sum().backward()
    try:
        opt.step()
    except ValueError as exc:
        return str(exc), all(torch.equal(a, b) for a, b in zip(before, model.parameters(),
                                                               strict=True))
    return "no error", None


def test_ranks_starting_from_different_weights_is_a_clear_error():
    """Without DDP nothing broadcasts the initial weights: ranks seeded differently trained
    models of their own, silently. One ulp in one bias is caught on every rank, by name, before
    any parameter moves; equal weights pass whatever each rank's thread count."""
    for message, unmoved in run_ranks(_weights_worker, 2, True, start_method="spawn"):
        assert message.startswith("onebit: 1 trainable parameter(s) (group 0 #3 (2,)) are not "
                                  "the same on every rank at step 1: each rank would train a "
                                  "model of its own"), message
        assert "torch.manual_seed" in message and "broadcast" in message and unmoved
    assert run_ranks(_weights_worker, 2, False, start_method="spawn") == [("no error", None)] * 2


def _lockstep_worker(rank, world, perturb):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    for step in range(4):
        opt.zero_grad()
        model(torch.randn(5, 4, generator=torch.Generator().manual_seed(step + rank))).sum() \
            .backward()
        opt.step()
    if perturb and rank == 1:
        with torch.no_grad():
            flat = model.weight.view(-1)
            flat[3] = torch.nextafter(flat[3], torch.tensor(float("inf")))  # one ulp
    try:
        check_lockstep(model.parameters(), opt)
    except LockstepError as exc:
        return str(exc)
    return "in lockstep"


def test_check_lockstep_passes_and_catches_one_ulp():
    assert run_ranks(_lockstep_worker, 3, False) == ["in lockstep"] * 3
    messages = run_ranks(_lockstep_worker, 2, True)
    assert messages == ["rank 1 differs from rank 0 in parameter 0"] * 2


def test_launched_as_several_ranks_without_a_process_group(monkeypatch):
    """torchrun sets WORLD_SIZE; without init_process_group each rank would train alone."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = nn.Linear(4, 2)
    opt = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=5)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2 .* torch.distributed is not initialised"):
        opt.step()


def test_the_gradient_fingerprint_holds_one_gradient_in_float64_at_a_time():
    """The first step's fingerprint of the gradients (the settings check) once copied every
    gradient to float64 at once: 8 more bytes per parameter alive together. Live float64 values
    are counted at torch's dispatcher while it runs: at most the largest gradient's (and its
    square's), not the sum of all of them (issue 33, item 3)."""
    from onebit_plugin.core.rank_checks import grad_fingerprint
    from tests.live_values import LiveValues

    params = [torch.nn.Parameter(torch.randn(n)) for n in (1000, 3000, 2000, 500)]
    for p in params:
        p.grad = torch.randn_like(p)
    with LiveValues(torch.float64) as count:
        fingerprint = grad_fingerprint(params, averaged_by_us=False)
    grads = torch.cat([p.grad for p in params]).double()
    assert torch.allclose(fingerprint, torch.stack([grads.sum(), grads.square().sum()]))
    assert 0 < count.peak <= 2 * 3000, count.peak
