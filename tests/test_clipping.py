"""OneBitAdam.clip_grad_norm_: Adam's clipping in warm-up, the gradient inside the averaged
momentum clipped in the compression stage, the same bits on every path."""

import logging
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from onebit_plugin import OneBitAdam
from onebit_plugin.entry.ddp_hook import register_onebit_hook
from tests.dist_helpers import assert_ranks_identical, run_ranks

MAX_NORM = 0.3  # below the gradients' norms of these models (about 0.5-1.5): clipping acts


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def _batch(rank, step, n=8):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 16, generator=gen), torch.randint(0, 4, (n,), generator=gen)


def _backward(model, rank, step):
    x, y = _batch(rank, step)
    (nn.functional.cross_entropy(model(x), y) * 3).backward()


def test_single_process_clips_the_gradient_inside_the_momentum():
    """One process: the local gradient is the gradient, so OneBitAdam.clip_grad_norm_ must give
    what torch's clip_grad_norm_ on p.grad gives before the fold (coupled weight decay and a
    masked coordinate included), up to rounding; warm-up bit for bit."""
    models = [_mlp(), _mlp()]
    masks = [{m[0].bias: torch.arange(32) != 5} for m in models]
    opts = [OneBitAdam(m.parameters(), lr=1e-2, freeze_step=3, weight_decay=0.1, masks=k)
            for m, k in zip(models, masks, strict=True)]
    clipped_steps = 0
    for step in range(12):
        norms = []
        for i, (model, opt) in enumerate(zip(models, opts, strict=True)):
            opt.zero_grad()
            _backward(model, 0, step)
            norms.append(opt.clip_grad_norm_(MAX_NORM) if i == 0 else
                         nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
            opt.step()
        torch.testing.assert_close(norms[0], norms[1], rtol=1e-6, atol=0)
        clipped_steps += opts[0].stage == "compression" and float(norms[0]) > MAX_NORM
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
            if step < 3:
                assert torch.equal(a, b)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert clipped_steps >= 6
    assert opts[0].state[models[0][0].bias]["exp_avg"][5] == 0  # masked stays at zero


def _paths_worker(rank, world, overlap, views=False):
    """Clipped training with OneBitAdam averaging itself, or under DDP with the hook."""
    model = _mlp() if overlap is None else DDP(_mlp(), bucket_cap_mb=0.001,  # several buckets
                                               gradient_as_bucket_view=views)
    # One momentum unit on every path (the hook would otherwise size units like DDP's buckets).
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=3, bucket_cap_mb=25)
    if overlap is not None:
        register_onebit_hook(model, opt, overlap=overlap)
    norms = []
    for step in range(10):
        opt.zero_grad()
        _backward(model, rank, step)
        norms.append(float(opt.clip_grad_norm_(MAX_NORM, params=model.parameters())))
        opt.step()
    return [p.detach().clone() for p in model.parameters()], norms


def test_every_path_clips_to_the_same_bits():
    results = {path: run_ranks(_paths_worker, 2, path) for path in (None, True, False)}
    # With bucket views the hook leaves the one unit, completed by the last bucket, to step().
    results["views"] = run_ranks(_paths_worker, 2, True, True)
    for path, ranks in results.items():
        assert_ranks_identical([r[0] for r in ranks], f"parameters (overlap={path})")
    plain, plain_norms = results[None][0]
    assert sum(n > MAX_NORM for n in plain_norms[3:]) >= 5  # clipping acted in compression
    for path in (True, False, "views"):
        params, norms = results[path][0]
        assert norms == plain_norms
        for a, b in zip(plain, params, strict=True):
            assert torch.equal(a, b)


def _momentum_worker(rank, world):
    """Exact momentum allreduce: after a clipped compression-stage step the momentum must be
    Adam's with the averaged gradient scaled by max_norm / the returned norm, and that norm
    must estimate the averaged gradient's."""
    model = _mlp()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2, compress_momentum=False)
    for step in range(3):
        opt.zero_grad()
        _backward(model, rank, step)
        opt.clip_grad_norm_(MAX_NORM)
        opt.step()
    assert opt.stage == "compression"
    old = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    opt.zero_grad()
    _backward(model, rank, 3)
    local = [p.grad.clone() for p in model.parameters()]
    local_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in local]))
    norms = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(norms, local_norm)
    mean = [g.clone() for g in local]
    for g in mean:
        dist.all_reduce(g)
        g /= world
    true_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in mean]))
    norm = opt.clip_grad_norm_(MAX_NORM)
    opt.step()
    coef = MAX_NORM / (float(norm) + 1e-6)
    expected = [m * 0.9 + 0.1 * coef * g for m, g in zip(old, mean, strict=True)]
    return (float(norm), float(true_norm), float(sum(norms) / world), coef,
            [opt.state[p]["exp_avg"].clone() for p in model.parameters()], expected)


def test_compression_stage_momentum_is_adams_with_the_clipped_mean_gradient():
    for norm, true_norm, mean_local, coef, got, expected in run_ranks(_momentum_worker, 3):
        # The ranks' gradients disagree: their mean local norm is far above the averaged
        # gradient's, which the sketch estimates (width 256: about 4% standard deviation).
        print(f"estimate {norm:.4f}, averaged {true_norm:.4f}, mean local {mean_local:.4f}")
        assert mean_local > 1.3 * true_norm
        assert abs(norm / true_norm - 1) < 0.15
        assert coef < 0.5  # clipping acted
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def test_the_norm_sketch_is_unbiased_and_close():
    from onebit_plugin.maths.norm_sketch import NormSketch, squared_norm

    gen = torch.Generator().manual_seed(0)
    ratios = []
    for case in range(40):
        params = [torch.empty(n) for n in (3000, 70, 9000)]
        sketch = NormSketch(params, 256)
        sketch.index = {p: i + 3 * case for i, p in enumerate(params)}  # other signs per case
        grads = [torch.randn(p.numel(), generator=gen) * (1 + 10 * (i == 1))
                 for i, p in enumerate(params)]
        total = torch.stack([sketch.of(p, g) for p, g in zip(params, grads, strict=True)]).sum(0)
        ratios.append(float(squared_norm(total)) / sum(float(g.square().sum()) for g in grads))
    mean = sum(ratios) / len(ratios)
    assert abs(mean - 1) < 0.04, mean  # sqrt(2/256)/sqrt(40) = 1.4% standard error
    assert max(abs(r - 1) for r in ratios) < 0.35, ratios  # 4 standard deviations


def _hooked_and_logged(views=False, overlap=True):
    """A DDP model with the 1-bit hook (freeze at 2), and the package's log records."""
    model = DDP(_mlp(), gradient_as_bucket_view=views)
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    register_onebit_hook(model, opt, overlap=overlap)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("onebit_plugin").addHandler(handler)
    return model, opt, records


def _torch_clip_worker(rank, world, views=False, clip=True, overlap=True):
    model, opt, records = _hooked_and_logged(views, overlap)
    for step in range(6):
        opt.zero_grad()
        _backward(model, rank, step)
        if clip:  # on the averaged momentum; with bucket views, on the local gradient
            nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        opt.step()
    return ([r.getMessage() for r in records if "p.grad holds the averaged momentum" in
             r.getMessage()],
            [r.getMessage() for r in records if "leaves each rank's own local" in r.getMessage()])


def test_torch_clipping_of_the_averaged_momentum_is_said_once():
    for said, said_local in run_ranks(_torch_clip_worker, 2):
        assert len(said) == 1 and "optimizer.clip_grad_norm_(max_norm)" in said[0]
        assert said_local == []


@pytest.mark.parametrize("overlap", [True, False])
def test_torch_clipping_of_a_local_gradient_left_to_step_is_said_once(overlap):
    """With bucket views the hook leaves this one-unit model to step() (with overlap=False,
    every unit): p.grad holds the local gradient, and torch's clipping of it (each rank by its
    own norm) is seen from the bucket's version count and said once; without clipping nothing
    is said."""
    for said, said_local in run_ranks(_torch_clip_worker, 2, True, True, overlap):
        assert said == [] and len(said_local) == 1, (said, said_local)
        assert "optimizer.clip_grad_norm_(max_norm)" in said_local[0]
    for said, said_local in run_ranks(_torch_clip_worker, 2, True, False, overlap):
        assert said == [] and said_local == []


def _late_clip_worker(rank, world, views=False):
    model, opt, records = _hooked_and_logged(views)
    norms = []
    for step in range(5):
        opt.zero_grad()
        _backward(model, rank, step)
        if step >= 3:  # first clip in the compression stage: the hook folded unsketched
            norms.append(float(opt.clip_grad_norm_(MAX_NORM)))
        opt.step()
    said = [r.getMessage() for r in records if "first called in the compression" in
            r.getMessage()]
    return norms, said, opt.state_dict()["onebit"]["clipping"]


def test_a_first_clip_in_the_compression_stage_is_said_and_remembered():
    for norms, said, remembered in run_ranks(_late_clip_worker, 2):
        assert math.isnan(norms[0]) and math.isfinite(norms[1]) and norms[1] > 0
        assert len(said) == 1 and remembered is True
    # With bucket views nothing of this one-unit model was folded in backward: it clips at once.
    for norms, said, remembered in run_ranks(_late_clip_worker, 2, True):
        assert all(math.isfinite(n) and n > 0 for n in norms) and said == [], (norms, said)
        assert remembered is True


def test_bad_clipping_arguments_are_clear_errors():
    model, other = _mlp(), nn.Linear(2, 2)
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    _backward(model, 0, 0)
    with pytest.raises(ValueError, match="2-norm"):
        opt.clip_grad_norm_(1.0, norm_type=float("inf"))
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        opt.clip_grad_norm_(0.0)
    with pytest.raises(ValueError, match="clips all of the optimizer's 6 trainable"):
        opt.clip_grad_norm_(1.0, params=list(model.parameters())[:2])
    with pytest.raises(ValueError, match="2 of them not the optimizer's"):
        opt.clip_grad_norm_(1.0, params=other.parameters())


# ------------------------------------------------------------------- the integrations' routes
@pytest.fixture
def spy(monkeypatch):
    """Records OneBitAdam.clip_grad_norm_ calls (and still runs them)."""
    calls, real = [], OneBitAdam.clip_grad_norm_

    def clip(self, max_norm, norm_type=2.0, params=None):
        calls.append((max_norm, norm_type, params is not None))
        return real(self, max_norm, norm_type, params)

    monkeypatch.setattr(OneBitAdam, "clip_grad_norm_", clip)
    return calls


def _warm_model_and_optimizer():
    model = _mlp()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    _backward(model, 0, 0)
    return model, opt


def test_lightning_gradient_clip_val_reaches_onebit_adam(spy):
    import pytorch_lightning as pl

    from onebit_plugin.integrations.lightning_strategy import route_clipping

    precision = pl.plugins.precision.Precision()
    route_clipping(precision)
    route_clipping(precision)  # a second fit: routed once
    model, opt = _warm_model_and_optimizer()
    precision.clip_gradients(opt, 0.5, "norm")
    assert spy == [(0.5, 2.0, True)]
    with pytest.raises(ValueError, match="clipping by value"):
        precision.clip_gradients(opt, 0.5, "value")
    plain = torch.optim.Adam(model.parameters())  # other optimizers: Lightning's own clipping
    precision.clip_gradients(plain, 1e-3, "value")
    assert spy == [(0.5, 2.0, True)] and all(p.grad.abs().max() <= 1e-3
                                             for p in model.parameters())


def test_fabric_clip_gradients_reaches_onebit_adam(spy):
    from lightning.fabric.plugins import Precision

    from onebit_plugin.integrations.for_lightning_fabric import OneBitAdamFabricStrategy

    strategy = OneBitAdamFabricStrategy()
    strategy.precision = Precision()
    model, opt = _warm_model_and_optimizer()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    norm = strategy.clip_gradients_norm(model, opt, 0.5)
    assert spy == [(0.5, 2.0, True)]
    torch.testing.assert_close(norm, expected)
    with pytest.raises(ValueError, match="clipping by value"):
        strategy.clip_gradients_value(model, opt, 0.5)


def test_accelerate_clip_grad_norm_reaches_onebit_adam(spy, monkeypatch):
    monkeypatch.setenv("ONEBIT_ADAM", "1")
    monkeypatch.setenv("ONEBIT_FREEZE_STEP", "2")
    from onebit_plugin.integrations.accelerate_flag import Accelerator

    accelerator = Accelerator(cpu=True)
    model = _mlp()
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _backward(model, 0, 0)
    accelerator.clip_grad_norm_(model.parameters(), 0.5)
    assert spy == [(0.5, 2, True)]
    with pytest.raises(ValueError, match="clipping by value"):
        accelerator.clip_grad_value_(model.parameters(), 0.5)


def _compares_worker(rank, world, clip):
    """Several DDP buckets with bucket views: most units averaged in backward, the last
    bucket's left to step(). Counts the optimizer's value comparisons of p.grad; with ``clip``,
    torch clips every p.grad before the last step."""
    import onebit_plugin.core.handoff as handoff

    model = DDP(_mlp(), gradient_as_bucket_view=True, bucket_cap_mb=0.002)  # 500 values
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    register_onebit_hook(model, opt)
    records, averaged, compares = [], [], []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("onebit_plugin").addHandler(handler)
    mark = opt.handoff.mark_averaged
    opt.handoff.mark_averaged = lambda unit, ok: (averaged.append(unit), mark(unit, ok))
    differing = handoff.differing

    def counted(pairs):
        compares.extend(pairs)
        return differing(pairs)

    handoff.differing = counted
    try:
        for step in range(6):
            averaged.clear()
            opt.zero_grad()
            _backward(model, rank, step)
            if clip and step == 5:
                nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            opt.step()
    finally:
        handoff.differing = differing
    said = {key: [r.getMessage() for r in records if text in r.getMessage()] for key, text in
            (("averaged", "p.grad holds the averaged momentum"),
             ("mixed", "the change to it is ignored"), ("local", "leaves each rank's own"))}
    in_backward = [i for i, p in enumerate(model.parameters())
                   if any(p is q for unit in averaged for q in unit.params)]
    momenta = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    return in_backward, len(compares), said, momenta


def test_an_unchanged_averaged_momentum_is_not_compared_a_changed_one_is_kept_beside_local():
    """With bucket views the version counts say whether p.grad changed after the hook wrote
    the averaged momentum into it: untouched, step() reads no value of p.grad (the comparison
    was a pass over every averaged value). Clipped by torch beside the local gradients of the
    units left to step(), the clipping coefficient differs between ranks: the averaged
    momenta are kept as averaged (said once), the local gradients' clipping is used (said
    once), and the ranks stay identical."""
    plain = run_ranks(_compares_worker, 2, False)
    clipped = run_ranks(_compares_worker, 2, True)
    for (in_backward, compares, said, momenta), (c_in, c_compares, c_said, c_momenta) in \
            zip(plain, clipped, strict=True):
        assert len(in_backward) >= 3 and len(in_backward) < len(momenta), in_backward
        assert compares == 0 and said == {"averaged": [], "mixed": [], "local": []}
        assert c_in == in_backward and c_compares > 0
        assert len(c_said["mixed"]) == 1 and len(c_said["local"]) == 1, c_said
        assert c_said["averaged"] == []
        for i, (m, c) in enumerate(zip(momenta, c_momenta, strict=True)):
            assert torch.equal(m, c) == (i in in_backward), i  # kept / clipped before the fold
    assert_ranks_identical([r[3] for r in clipped], "momenta clipped by torch")


def test_a_sketch_goes_in_pieces_and_its_signs_may_be_drawn_again():
    """A gradient is sketched a piece of about 1M values at a time (whole, its float copy, its
    signed product and a padded copy were alive at once: 12 bytes per value of the largest
    gradient, on a GPU inside backward), and on a GPU its signs are drawn again at every
    sketch instead of kept (1 byte per parameter). On the CPU drawing again gives the very
    signs kept, so both give the same sketch, which is the definition's: sum of s_i g_i per
    bucket i mod width."""
    from onebit_plugin.maths.norm_sketch import SKETCH_PIECE, NormSketch
    from tests.live_values import LiveValues

    n, width = 3 * SKETCH_PIECE + 777, 300  # pieces of whole rows, a ragged end
    p = torch.empty(n)
    grad = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    params = [torch.empty(10), p]  # p's signs from its position, 1
    kept, drawn = NormSketch(params, width), NormSketch(params, width, keep_signs=False)
    with LiveValues(torch.float32, least=4096) as count:
        a = kept.of(p, grad)
    b = drawn.of(p, grad)
    assert 0 < count.peak <= 2 * SKETCH_PIECE, count.peak  # whole: 3 x 3.1M and more
    assert drawn.signs == {} and kept.signs[p].numel() == n
    assert torch.equal(a, b)
    signed = grad.double() * kept.signs[p].double()
    direct = torch.nn.functional.pad(signed, (0, -n % width)).view(-1, width).sum(0)
    torch.testing.assert_close(a.double(), direct, rtol=1e-5, atol=1e-3)
