"""The family under HSDP: FSDP2 shards each parameter over a host's ranks (the mesh's "shard"
dimension), the optimizer exchanges each shard across hosts over the "replicate" group
(``onebit_plugin.comm.shards``). 4 gloo ranks as 2 hosts x 2, rank // 2 the host."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

from onebit_plugin import OneBitAdam, OneBitLamb, ZeroOneAdam, check_lockstep
from tests.dist_helpers import counting_by_host, restore_collectives, run_ranks

LOCAL, HOSTS = 2, 2


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (HOSTS, LOCAL), mesh_dim_names=("replicate", "shard"))


def _model(width: int = 67) -> nn.Module:
    torch.manual_seed(0)
    # 67 rows shard 34/33; the last layer's single row leaves one rank of each host an empty
    # shard of its weight and bias.
    return nn.Sequential(nn.Linear(24, width), nn.GELU(), nn.Linear(width, 48), nn.GELU(),
                         nn.Linear(48, 1))


def _shard(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 24, generator=g), torch.randn(8, 1, generator=g)


def _locals(model) -> list[torch.Tensor]:
    return [p._local_tensor.detach().clone() for p in model.parameters()]


def _optimizer(kind: str, model, group, steps: int):
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-2)
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if kind == "onebit_warmup":
        return OneBitAdam(model.parameters(), lr=1e-2, freeze_step=1000, process_group=group)
    if kind == "onebit_warmup_w":
        return OneBitAdam(model.parameters(), lr=1e-2, freeze_step=1000, weight_decay=0.1,
                          decoupled_weight_decay=True, process_group=group)
    if kind == "zero_one_warmup":  # its first 16 steps are AdamW's
        return ZeroOneAdam(model.parameters(), lr=1e-2, weight_decay=0.1, process_group=group)
    if kind == "onebit":
        return OneBitAdam(model.parameters(), lr=1e-2, freeze_step=3, process_group=group)
    return ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=6, var_update_scaler=2,
                       local_step_scaler=4, local_step_clipper=2, total_steps=steps,
                       process_group=group)


def _train(rank, world, kind, steps, native=False, width=67, model_zero_grad=False):
    """``steps`` steps of ``kind`` on the HSDP model; per step: every parameter's local shard,
    the bytes this rank sent to the other host and inside its own, and whether the replicas
    were in lockstep (``check_lockstep``, raising otherwise)."""
    mesh = _mesh()
    model = _shard(_model(width), mesh if native else mesh["shard"])
    group = mesh["replicate"].get_group()
    opt = _optimizer(kind, model, group, steps)
    counts = {"cross": 0, "host": 0}
    out = {"params": [], "bytes": [], "kinds": []}
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("onebit_plugin")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    real = counting_by_host(LOCAL, counts)
    try:
        for step in range(steps):
            x, y = _batch(step, rank)
            before = dict(counts)
            kind_now = getattr(opt, "coming_exchange", "exact")
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            # The model's zero_grad reaches only the DTensors: the optimizer's proxies of the
            # shards still point at last step's gradients, which its next step replaces.
            (model if model_zero_grad else opt).zero_grad()
            out["bytes"].append({k: counts[k] - before[k] for k in counts})
            out["kinds"].append(kind_now)
            out["params"].append(_locals(model))
            if isinstance(opt, OneBitAdam | ZeroOneAdam) and not opt.between_syncs:
                check_lockstep(model.parameters(), opt)  # over the replicate group
    finally:
        restore_collectives(real)
        logger.removeHandler(handler)
        logger.setLevel(level)
    out["said"] = [r.getMessage() for r in records]
    if hasattr(opt, "stage"):
        out["stage"] = opt.stage
        out["state_numel"] = sum(t.numel() for s in opt.state.values() for t in s.values()
                                 if torch.is_tensor(t) and t.dim() > 0)
    return out


def _warmups(rank, world):
    return {kind: _train(rank, world, kind, 8, native=kind in ("adam", "adamw"),
                         model_zero_grad=kind == "onebit_warmup_w")
            for kind in ("adam", "adamw", "onebit_warmup", "onebit_warmup_w", "zero_one_warmup")}


def test_warmup_is_native_hsdp_with_torch_adam_bit_for_bit():
    """The full-precision steps on 1-D FSDP2 shards, averaged across hosts by the optimizer,
    give the very bits of native HSDP (a 2-D mesh) with torch's Adam and AdamW: FSDP2's
    reduce-scatter inside the host, then the mean over the hosts, both in fp32; also with the
    gradients cleared by the model's zero_grad instead of the optimizer's."""
    for rank, runs in enumerate(run_ranks(_warmups, LOCAL * HOSTS, timeout=300)):
        for ours, theirs in (("onebit_warmup", "adam"), ("onebit_warmup_w", "adamw"),
                             ("zero_one_warmup", "adamw")):
            for step, (a, b) in enumerate(zip(runs[ours]["params"], runs[theirs]["params"],
                                              strict=True)):
                for i, (x, y) in enumerate(zip(a, b, strict=True)):
                    assert torch.equal(x, y), (rank, ours, step, i)
        # The last layer's one row: one rank of each host holds all of it, the other none.
        sizes = [p.numel() for p in runs["onebit_warmup"]["params"][0]]
        assert sizes[4:] == ([48, 1] if rank % 2 == 0 else [0, 0]), sizes
        # Across hosts, per step: the shard in fp32 and one fp32 has-a-gradient flag per
        # parameter (6 here), a ring of 2 sending each value once; native HSDP's all-reduce
        # sends the shard padded to the host's largest, so at most the flags fewer.
        for ours, theirs in zip(runs["onebit_warmup"]["bytes"], runs["adam"]["bytes"],
                                strict=True):
            assert ours["cross"] == 4 * (sum(sizes) + 6), (ours, sizes)
            assert ours["cross"] <= theirs["cross"] + 4 * 6, (ours, theirs)


def _compression(rank, world):
    return {"onebit": _train(rank, world, "onebit", 12, width=1024),
            "adam": _train(rank, world, "adam", 4, native=True, width=1024),
            "zero_one": _train(rank, world, "zero_one", 40)}


def test_compression_stage_sends_a_shard_in_one_bit_and_keeps_the_replicas_identical():
    runs = run_ranks(_compression, LOCAL * HOSTS, timeout=300)
    for rank, run in enumerate(runs):
        onebit, adam = run["onebit"], run["adam"]
        assert onebit["stage"] == "compression"
        adam_cross = adam["bytes"][-1]["cross"]
        assert adam_cross > 0
        for step in range(3, 12):  # the compression stage: 1/20 of native HSDP's or less
            cross = onebit["bytes"][step]["cross"]
            assert 0 < cross <= adam_cross / 20, (rank, step, cross, adam_cross)
        # Each rank holds Adam's state of its shard alone: about half of the model's.
        total = sum(p.numel() for p in _model(1024).parameters())
        assert onebit["state_numel"] <= 2 * (total / LOCAL + 1024), onebit["state_numel"]
        # 0/1 Adam: local steps send nothing across hosts, syncs and refreshes do.
        zero = run["zero_one"]
        for kind, b in zip(zero["kinds"], zero["bytes"], strict=True):
            assert (b["cross"] == 0) == (kind == "local"), (kind, b)
        assert {"exact", "momentum", "local", "sync"} <= set(zero["kinds"])
    # The freeze said once in the job, not once per replicate group.
    assert sum("variance frozen" in m for run in runs for m in run["onebit"]["said"]) == 1
    # Replicas (same shard, other host) identical after every step (check_lockstep ran);
    # the host's two shards differ.
    for a, b in ((0, 2), (1, 3)):
        for x, y in zip(runs[a]["onebit"]["params"][-1], runs[b]["onebit"]["params"][-1],
                        strict=True):
            assert torch.equal(x, y)
    assert not torch.equal(runs[0]["onebit"]["params"][-1][0][:8],
                           runs[1]["onebit"]["params"][-1][0][:8])


def _refusals(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = _mesh()
    said = {}

    def attempt(name, fn):
        try:
            fn()
            said[name] = "no error"
        except (ValueError, NotImplementedError) as exc:
            said[name] = f"{type(exc).__name__}: {exc}"

    group = mesh["replicate"].get_group()
    native = _shard(_model(), mesh)
    attempt("native", lambda: OneBitAdam(native.parameters(), process_group=group, freeze_step=5))
    sharded = _shard(_model(), mesh["shard"])
    attempt("no group", lambda: OneBitAdam(sharded.parameters(), freeze_step=5))
    attempt("world group", lambda: OneBitAdam(sharded.parameters(),
                                              process_group=dist.group.WORLD, freeze_step=5))
    attempt("hierarchical", lambda: OneBitAdam(sharded.parameters(), process_group=group,
                                               topology="hierarchical", freeze_step=5))
    opt = OneBitAdam(sharded.parameters(), process_group=group, freeze_step=5)
    attempt("mixed", lambda: opt.add_param_group({"params": [nn.Parameter(torch.ones(2))]}))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("onebit_plugin").addHandler(handler)
    # The optimizer made before fully_shard: it holds tensors that no gradient reaches, which
    # fully_shard marked as replaced. An error at the first step, not a run that trains nothing.
    early = _model()
    stale = OneBitAdam(early.parameters(), lr=1e-2, freeze_step=5, topology="flat")
    _shard(early, mesh["shard"])
    nn.functional.mse_loss(early(_batch(0, rank)[0]), _batch(0, rank)[1]).backward()
    attempt("before sharding", stale.step)
    said["before sharding, logged"] = [r.getMessage() for r in records]
    said["before sharding, steps"] = stale.global_step
    # FSDP2 over all 4 ranks, without a group or with a replicate group of one rank: no
    # replicas, nothing to compress: said, and torch's Adam exactly.
    one_host = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    for case, on, group in (("no group", init_device_mesh("cpu", (world,)), None),
                            ("replicate group of one", one_host["shard"],
                             one_host["replicate"].get_group())):
        records.clear()
        ours, theirs = _shard(_model(), on), _shard(_model(), on)
        opt = OneBitAdam(ours.parameters(), lr=1e-2, freeze_step=2, process_group=group)
        ref = torch.optim.Adam(theirs.parameters(), lr=1e-2)
        for step in range(4):
            for m, o in ((ours, opt), (theirs, ref)):
                nn.functional.mse_loss(m(_batch(step, rank)[0]), _batch(step, rank)[1]).backward()
                o.step()
                o.zero_grad()
        opt.training_ended()  # what the strategies call at the end: nothing more to say
        said[f"one host, {case}"] = {
            "said": [r.getMessage() for r in records],
            "equal": [torch.equal(a, b) for a, b in zip(_locals(ours), _locals(theirs),
                                                        strict=True)],
            "sent": opt.bytes_sent, "stage": opt.stage}
    return said


def test_what_cannot_be_stepped_is_refused_by_name():
    runs = run_ranks(_refusals, LOCAL * HOSTS, timeout=300)
    said = runs[0]
    assert "2-D mesh" in said["native"] and "mesh=mesh['shard']" in said["native"], said
    assert "the world (no process_group given) holds 2" in said["no group"], said["no group"]
    for name in ("no group", "world group"):
        assert "would average different shards" in said[name], said[name]
        assert "mesh['replicate'].get_group()" in said[name], said[name]
    assert "topology='hierarchical'" in said["hierarchical"]
    assert "plain parameters" in said["mixed"]
    for rank, run in enumerate(runs):
        # Every rank refuses its first step by name; nothing else said, nothing stepped.
        before = run["before sharding"]
        assert before.startswith("ValueError: OneBitAdam was made before fully_shard"), before
        assert "fully_shard(...) first, then the optimizer over model.parameters()" in before
        assert run["before sharding, logged"] == [] and run["before sharding, steps"] == 0
        for case in ("no group", "replicate group of one"):
            one = run[f"one host, {case}"]
            said_here = [m for m in one["said"] if "nothing crosses ranks" in m]
            assert len(said_here) == (1 if rank == 0 else 0), (case, one["said"])
            # The fix for torch and for Lightning's strategy, both in the one line.
            assert all("process_group=mesh['replicate'].get_group()" in m and
                       "OneBitHSDPStrategy(shard_size=L)" in m for m in said_here), said_here
            assert not [m for m in one["said"] if "training ended" in m], one["said"]
            assert all(one["equal"]) and one["sent"] == 0 and one["stage"] == "warmup", case


# ----------------------------------------------------------------------------- 1-bit LAMB
def _lamb_run(rank, world, hosts):
    """OneBitLamb on ``hosts`` x ``world / hosts`` (shards over each host's ranks), the ranks of
    "host pair" rank // 2 reading the same batches, so that 2 x 2 and 4 x 1 average the same
    gradients: per step, the whole parameters and this rank's trust ratios."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (hosts, world // hosts), mesh_dim_names=("replicate", "shard"))
    model = _shard(_model(), mesh["shard"])
    opt = OneBitLamb(model.parameters(), lr=1e-2, freeze_step=4, weight_decay=0.01,
                     process_group=mesh["replicate"].get_group())
    out = []
    for step in range(10):
        x, y = _batch(step, rank // 2)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        check_lockstep(model.parameters(), opt)
        # full_tensor() on a mesh of one rank is the live shard itself: copied
        out.append(([p.full_tensor().clone() for p in model.parameters()], opt.lamb_coeffs()))
    return {"steps": out, "stage": opt.stage}


def _lamb(rank, world):
    return {"2x2": _lamb_run(rank, world, 2), "4x1": _lamb_run(rank, world, 4)}


def test_onebit_lamb_takes_whole_parameters_norms_on_shards():
    """1-bit LAMB's trust ratio and factor are the whole parameter's (its shards' squares
    summed, their largest ratio taken, over the host): the ranks of a host take the same
    ratios, and the warm-up on 2 x 2 shards is the one of 4 x 1 whole parameters on the same
    averaged gradients, within fp32 rounding (the sums' order differs)."""
    runs = run_ranks(_lamb, LOCAL * HOSTS, timeout=300)
    for rank, run in enumerate(runs):
        assert run["2x2"]["stage"] == "compression"
        host_peer = runs[rank ^ 1]["2x2"]["steps"]
        for step, ((params, ratios), (whole, whole_ratios), (_, peer_ratios)) in enumerate(
                zip(run["2x2"]["steps"], run["4x1"]["steps"], host_peer, strict=True)):
            assert ratios == peer_ratios, (rank, step)  # one optimizer per host
            assert all(torch.isfinite(p).all() for p in params)
            if step < 4:  # the warm-up: exact averages on both layouts
                assert ratios == pytest.approx(whole_ratios, rel=1e-4), (rank, step)
                for a, b in zip(params, whole, strict=True):
                    assert torch.allclose(a, b, rtol=0, atol=1e-6), (rank, step)


# ----------------------------------------------------------------------------- clipping
MAX_NORM = 0.05


def _exact_norm(model, group) -> float:
    """The norm of the gradient averaged over the hosts, whole: each shard's averaged over
    its replicas, the squares summed over the host."""
    squares = torch.zeros(())
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad._local_tensor.clone()
            dist.all_reduce(g, group=group)
            squares += g.div(HOSTS).double().square().sum().float()
    dist.all_reduce(squares, group=model[0].weight.device_mesh.get_group())
    return float(squares.sqrt())


def _clipped(rank, world, kind, steps):
    mesh = _mesh()
    native = kind == "adam"
    model = _shard(_model(), mesh if native else mesh["shard"])
    group = mesh["replicate"].get_group()
    opt = _optimizer(kind, model, group, steps)
    out = []
    for step in range(steps):
        x, y = _batch(step, rank)
        nn.functional.mse_loss(model(x), y).backward()
        exact = None if native else _exact_norm(model, group)
        kind_now = getattr(opt, "coming_exchange", "exact")
        if native:
            norm = nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        else:
            norm = float(opt.clip_grad_norm_(MAX_NORM))
        opt.step()
        opt.zero_grad()
        if not native and not opt.between_syncs:
            check_lockstep(model.parameters(), opt)
        out.append((kind_now, norm, exact, _locals(model)))
    return out


def _clipping(rank, world):
    return {kind: _clipped(rank, world, kind, steps) for kind, steps in
            (("adam", 6), ("onebit_warmup", 6), ("onebit", 10), ("zero_one", 30))}


def test_clipping_spans_the_hosts_shards():
    """In the full-precision steps the clip is torch's over whole parameters (the squares of a
    host's shards summed): native HSDP's torch clipping within fp32 rounding; in the compression
    stage the norm estimated from each shard's sketch, its squares summed over the host; a
    local step clips the rank's own gradient, over the host's shards."""
    for rank, runs in enumerate(run_ranks(_clipping, LOCAL * HOSTS, timeout=300)):
        for (_, theirs, _, a), (_, ours, exact, b) in zip(runs["adam"], runs["onebit_warmup"],
                                                            strict=True):
            assert theirs > MAX_NORM  # the clip is active
            assert ours == pytest.approx(theirs, rel=1e-5) and ours == pytest.approx(exact,
                                                                                   rel=1e-5)
            for x, y in zip(a, b, strict=True):
                assert torch.allclose(x, y, rtol=0, atol=1e-6), (rank, float((x - y).abs().max()))
        for kind, norm, exact, _ in runs["onebit"][3:]:
            assert kind == "momentum" and norm == pytest.approx(exact, rel=0.15), (norm, exact)
        local = [(n, e) for k, n, e, _ in runs["zero_one"] if k == "local"]
        assert local
        for norm, _ in local:  # this rank's own gradient over the host's shards: finite, > 0
            assert 0 < norm < float("inf")


# ----------------------------------------------------------------------------- checkpoints
def _resumed(rank, world, kind, steps, stop, path, local=LOCAL):
    """``kind`` on a mesh of (world / local) x local: the uninterrupted run's shards per step,
    and those of a run saved after ``stop`` steps by save_sharded and resumed by load_sharded
    into a fresh model and optimizer (of the same mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    from onebit_plugin import load_sharded, save_sharded

    mesh = init_device_mesh("cpu", (world // local, local), mesh_dim_names=("replicate", "shard"))

    def fresh():
        model = _shard(_model(), mesh["shard"])
        return model, _optimizer(kind, model, mesh["replicate"].get_group(), steps)

    def run(model, opt, start, end, out):
        for step in range(start, end):
            x, y = _batch(step, rank)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            out.append(_locals(model))

    model, opt = fresh()
    whole = []
    run(model, opt, 0, steps, whole)
    model, opt = fresh()
    first = []
    run(model, opt, 0, stop, first)
    between = opt.between_syncs
    save_sharded(path, model, opt)
    model, opt = fresh()
    load_sharded(path, model, opt)
    resumed = []
    run(model, opt, stop, steps, resumed)
    return {"whole": whole, "resumed": first + resumed, "between": between,
            "stage": opt.stage}


@pytest.mark.parametrize("kind,stop", [("onebit", 2), ("onebit", 7), ("zero_one", 27)])
def test_dcp_checkpoint_resumes_every_shard_bit_for_bit(kind, stop, tmp_path):
    runs = run_ranks(_resumed, LOCAL * HOSTS, kind, 30, stop, str(tmp_path / "ckpt"),
                     timeout=300)
    if kind == "zero_one":
        assert runs[0]["between"], "saved between two syncs"
    for rank, run in enumerate(runs):
        assert run["stage"] == "compression"
        for step, (a, b) in enumerate(zip(run["whole"], run["resumed"], strict=True)):
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x, y), (kind, rank, step)


def _other_mesh(rank, world, path):
    """Saved on 2 hosts x 2 in the compression stage, loaded on 4 x 1 (whole parameters per
    rank): the parameters and moments as saved, resharded; the error feedback restarted."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from onebit_plugin import load_sharded, save_sharded

    def train(model, opt, steps):
        for step in range(steps):
            x, y = _batch(step, rank)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    mesh = init_device_mesh("cpu", (HOSTS, LOCAL), mesh_dim_names=("replicate", "shard"))
    model = _shard(_model(), mesh["shard"])
    opt = _optimizer("onebit", model, mesh["replicate"].get_group(), 8)
    train(model, opt, 7)
    save_sharded(path, model, opt)
    whole = [p.full_tensor() for p in model.parameters()]
    momenta = [DTensor.from_local(opt.state[q]["exp_avg"].clone(), p.device_mesh, p.placements,
                                  shape=p.shape, stride=p.stride()).full_tensor()
               for q, p in opt.shards.dtensor_of.items()]
    other = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    model = _shard(_model(), other["shard"])
    opt = _optimizer("onebit", model, other["replicate"].get_group(), 8)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("onebit_plugin").addHandler(handler)
    load_sharded(path, model, opt)
    loaded = [p._local_tensor.clone() for p in model.parameters()]
    loaded_momenta = [opt.state[q]["exp_avg"].clone() for q in opt.shards.dtensor_of]
    train(model, opt, 3)
    check_lockstep(model.parameters(), opt)
    return {"said": [r.getMessage() for r in records if "mesh" in r.getMessage()],
            "params": all(torch.equal(a, b) for a, b in zip(whole, loaded, strict=True)),
            "momenta": all(torch.equal(a, b) for a, b in zip(momenta, loaded_momenta,
                                                             strict=True)),
            "stage": opt.stage, "switch": opt.switch_step}


def test_dcp_checkpoint_on_another_mesh_reshards_and_restarts_the_errors(tmp_path):
    runs = run_ranks(_other_mesh, LOCAL * HOSTS, str(tmp_path / "ckpt"), timeout=300)
    for rank, run in enumerate(runs):
        assert run["params"] and run["momenta"], rank
        assert run["stage"] == "compression" and run["switch"] == 3
        assert len(run["said"]) == (1 if rank == 0 else 0), run["said"]
    assert "2 hosts x 2 ranks on one of 4 x 1" in runs[0]["said"][0]
    assert "restart from zero" in runs[0]["said"][0]


def _crafted(rank, world, folder, marker):
    from torch.distributed.device_mesh import init_device_mesh

    from onebit_plugin import load_sharded

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    model = _shard(_model(), mesh["shard"])
    opt = _optimizer("onebit", model, mesh["replicate"].get_group(), 8)
    try:
        load_sharded(folder, model, opt)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_a_crafted_checkpoint_runs_no_code(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    marker = tmp_path / "ran"
    # A pickle (protocol 0) that calls posix.system("touch <marker>") when unpickled.
    (folder / ".metadata").write_bytes(f"cposix\nsystem\n(Vtouch {marker}\ntR.".encode())
    said = run_ranks(_crafted, 1, str(folder), str(marker))[0]
    assert "UnpicklingError" in said and "posix.system" in said, said
    assert not marker.exists()


ADAM_STEP = (1 - 0.9) / (1 - 0.999) ** 0.5


class _Tables(nn.Module):
    """A bag of 3,000 rows, and a table of one row (256 values) that FSDP2 leaves empty on
    one rank of each host, whose gradient is zero on the gated steps."""

    def __init__(self):
        super().__init__()
        self.bag, self.one = nn.EmbeddingBag(3000, 8, mode="mean"), nn.Embedding(1, 256)
        self.head = nn.Linear(8, 4)

    def forward(self, ids, on: float):
        extra = self.one(torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device))
        return self.head(self.bag(ids) + on * extra[:, :8])


def _sparse_rows_run(rank, world):
    """0/1 Adam under HSDP on a model whose embeddings FSDP2 shards by rows over the host."""
    from torch.distributed.fsdp import fully_shard

    from onebit_plugin.maths.sparse_rows import SHARE

    mesh = _mesh()
    torch.manual_seed(0)
    model = _Tables()
    for part in (model.bag, model.one, model.head, model):
        fully_shard(part, mesh=mesh["shard"])
    # 4 exact steps: a share read after k steps is at most 1 - 1/k (rows seen once).
    opt = ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=8, var_update_scaler=4,
                      local_step_scaler=4, local_step_clipper=2, total_steps=30,
                      process_group=mesh["replicate"].get_group())
    for step in range(30):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        ids = torch.randint(0, 3000, (8, 4), generator=gen)
        on = 0.0 if step == 3 else 1.0  # the one row zero at the last exact step: share 1
        nn.functional.cross_entropy(model(ids, on), ids[:, 0] % 4).backward()
        opt.step()
        opt.zero_grad()
    check_lockstep(model.parameters(), opt)
    return ([opt.state[p].get(SHARE) for p in opt.trainable()],
            [(u.momentum.numel(), u.send_bound) for u in opt.units], _locals(model))


def test_zero_one_reads_a_row_sharded_embedding_alike_on_every_rank_and_keeps_replicas_one():
    """The freeze sums each tensor's zero rows over the host's shards: every rank reads the
    same shares; each rank's shard of the bag gets a unit sending ``m / denom``, and so does
    the one-row table's where it is not empty (an empty shard stays with its neighbours);
    the replicas (same shard, other host) end bit-identical."""
    runs = run_ranks(_sparse_rows_run, LOCAL * HOSTS, timeout=300)
    shares = runs[0][0]
    assert shares[0] >= 0.5 and shares[1] == 1.0 and shares[2] == 0.0, shares
    for read, units, _ in runs:
        assert read == shares
        # The rows' units clamp at Adam's own largest step, (1 - b1) / sqrt(1 - b2).
        apart = sorted(n for n, bound in units if bound == ADAM_STEP)
        assert len(apart) == 2 or (len(apart) == 1 and apart[0] != 256), units
    assert sum(256 in [n for n, b in units if b == ADAM_STEP] for _, units, _ in runs) == HOSTS
    for a, b in ((0, 2), (1, 3)):
        assert all(torch.equal(x, y) for x, y in zip(runs[a][2], runs[b][2], strict=True))


class _Late(nn.Module):
    """A table of 400 rows (200 per shard) of which the first 40 are drawn before the
    freeze, any after it."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(400, 8), nn.Linear(8, 1)

    def forward(self, ids):
        return self.head(self.emb(ids)).squeeze(1)


def _late_rows_run(rank, world, member="onebit_adam"):
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh()
    torch.manual_seed(0)
    model = _Late()
    start = model.emb.weight.detach().clone()
    for part in (model.emb, model.head, model):
        fully_shard(part, mesh=mesh["shard"])
    group = mesh["replicate"].get_group()
    if member == "onebit_adam":
        opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=4, process_group=group)
    else:  # phase A from step 4 to 10, then syncs every step to 16, local steps after
        opt = ZeroOneAdam(model.parameters(), lr=1e-2, var_update_scaler=4, var_freeze_step=9,
                          local_step_scaler=6, local_step_clipper=4, total_steps=24,
                          process_group=group)
    drawn, moved = torch.zeros(400, dtype=torch.bool), None
    lo = -(-400 // LOCAL) * (rank % LOCAL)
    for step in range(24):
        ids = [torch.randint(0, 40 if step < 4 else 400, (16,),
                             generator=torch.Generator().manual_seed(100 * step + r))
               for r in range(world)]
        for i in ids:  # a woken row takes its first step at its wake, the last step's too
            drawn[i] = True
        nn.functional.mse_loss(model(ids[rank]), ids[rank].float() / 400).backward()
        opt.step()
        opt.zero_grad()
        if not opt.between_syncs:
            check_lockstep(model.parameters(), opt)
        # Moved at some step: the sign noise may bring a rare row back to its start.
        local = model.emb.weight._local_tensor.detach()
        now = local.ne(start[lo : lo + local.shape[0]]).any(1)
        moved = now if moved is None else moved | now
    return moved, drawn[lo : lo + moved.numel()], _locals(model)


@pytest.mark.parametrize("member", ["onebit_adam", "zero_one_adam"])
def test_rows_first_drawn_after_the_freeze_wake_on_each_shard(member):
    """1-bit Adam and 0/1 Adam (its rows woken in phase A and between phase B's syncs) under
    HSDP: each shard's rows that no batch drew by the freeze wake at their first gradient on
    any host, alike on the two replicas of the shard."""
    runs = run_ranks(_late_rows_run, LOCAL * HOSTS, member, timeout=300)
    for moved, drawn, _ in runs:
        assert int(drawn.sum()) > 100  # of the shard's 200 rows, most drawn after the freeze
        assert bool(moved[drawn].all()), f"{int((~moved[drawn]).sum())} drawn rows unmoved"
        assert not bool(moved[~drawn].any())
    for a, b in ((0, 2), (1, 3)):
        assert all(torch.equal(x, y) for x, y in zip(runs[a][2], runs[b][2], strict=True))
