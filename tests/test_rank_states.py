"""Per-rank error-buffer files beside a framework's checkpoint (integrations/rank_states.py, used
by Accelerate's save_state/load_state and by transformers.Trainer checkpoints under onebit-run):
a missing, truncated, foreign or wrong-world file is a ValueError naming it."""

from pathlib import Path

import pytest
import torch
from torch import nn

from onebit_plugin import OneBitAdam
from onebit_plugin.integrations.rank_states import (
    load_rank_states,
    own_rank_state,
    save_rank_states,
)
from tests.dist_helpers import run_ranks


def _trained(steps: int) -> OneBitAdam:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
    return opt


def test_round_trip_and_every_bad_file_names_itself(tmp_path):
    saved = _trained(4)  # compression stage
    for rank in (0, 1):
        save_rank_states(tmp_path / "a", rank, 2, [saved])
    assert not list((tmp_path / "a").glob("*.tmp"))  # written under a temporary name first

    fresh = _trained(4)
    load_rank_states(tmp_path / "a", 1, 2, [fresh])
    assert fresh.onebit_state_dict()["global_step"] == 4

    # Files of 2 ranks on 3 processes: the optimizer's own load restarted the errors
    # (test_optimizer); the files are only checked to belong to the checkpoint.
    (tmp_path / "two").mkdir()
    for rank in (0, 1):
        torch.save([dict(saved.onebit_state_dict(), world_size=2)],
                   tmp_path / "two" / f"onebit_rank{rank}.pt")
    load_rank_states(tmp_path / "two", 0, 3, [fresh])
    (tmp_path / "gap").mkdir()
    (tmp_path / "two" / "onebit_rank1.pt").rename(tmp_path / "gap" / "onebit_rank1.pt")
    with pytest.raises(ValueError, match=r"holds the OneBitAdam error buffers of ranks \[1\]: "
                                         r"rank 0's is missing"):
        load_rank_states(tmp_path / "gap", 1, 2, [fresh])
    with pytest.raises(ValueError, match=r"ranks \[0\], and rank 0's file says 2 ranks wrote "
                                         r"it: ranks \[1\]'s are missing"):
        load_rank_states(tmp_path / "two", 0, 3, [fresh])
    # A 2-rank save into a folder where a 3-rank run saved: rank 0 removes the third file; one
    # left there anyway (an older version's save) is not read.
    (tmp_path / "gap" / "onebit_rank1.pt").rename(tmp_path / "two" / "onebit_rank1.pt")
    torch.save([dict(saved.onebit_state_dict(), world_size=3)],
               tmp_path / "two" / "onebit_rank2.pt")
    load_rank_states(tmp_path / "two", 1, 2, [fresh])  # as 2 ranks: rank 1's own file
    load_rank_states(tmp_path / "two", 0, 3, [fresh])  # as 3: another world size
    save_rank_states(tmp_path / "two", 1, 2, [fresh])
    assert (tmp_path / "two" / "onebit_rank2.pt").exists()  # rank 1 leaves it
    save_rank_states(tmp_path / "two", 0, 2, [fresh])
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == [
        "onebit_rank0.pt", "onebit_rank1.pt"]

    (tmp_path / "a" / "onebit_rank1.pt").write_bytes(
        (tmp_path / "a" / "onebit_rank1.pt").read_bytes()[:100])
    with pytest.raises(ValueError, match=r"onebit_rank1.pt: cannot read this rank's"):
        load_rank_states(tmp_path / "a", 1, 2, [fresh])

    later = _trained(5)  # the framework's state of another checkpoint
    with pytest.raises(ValueError, match=r"onebit_rank0.pt was saved at \(step, switch step\) "
                                         r"\(4, 2\), the optimizer state of this checkpoint at "
                                         r"\(5, 2\)"):
        load_rank_states(tmp_path / "a", 0, 2, [later])


class _Touch:
    """Unpickled in full, this creates a file: what a crafted checkpoint's code could do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_a_crafted_file_runs_no_code_and_is_named(tmp_path):
    saved = _trained(4)
    for rank in (0, 1):
        save_rank_states(tmp_path / "a", rank, 2, [saved])
    marker = tmp_path / "ran"
    torch.save([_Touch(marker)], tmp_path / "a" / "onebit_rank1.pt")
    with pytest.raises(ValueError, match=r"onebit_rank1.pt: cannot read this rank's"):
        load_rank_states(tmp_path / "a", 1, 2, [_trained(4)])
    assert not marker.exists()
    torch.load(tmp_path / "a" / "onebit_rank1.pt", weights_only=False)  # the file's payload
    assert marker.exists()


def test_a_checkpoint_written_by_rank_zero_alone_is_refused_in_the_compression_stage():
    state = _trained(4).state_dict()
    of_two = dict(state, onebit=dict(state["onebit"], world_size=2))  # 2 ranks, rank 0's only
    with pytest.raises(ValueError, match="holds rank 0's OneBitAdam error buffers only"):
        own_rank_state(of_two, 1, 2)
    assert own_rank_state(state, 0, 1) is state  # one process: nothing to choose
    # Saved by one process, loaded by two: another world size, whose load restarts the errors.
    assert own_rank_state(state, 1, 2) is state
    both = dict(state, onebit_ranks=[{"rank": 0}, {"rank": 1}])
    assert own_rank_state(both, 1, 2)["onebit"] == {"rank": 1}
    assert own_rank_state(both, 2, 3)["onebit"] is state["onebit"]  # rank 0's, as above


def _two_rank_round_trip_worker(rank, world, folder):
    """Each rank saves its own file in the compression stage; a fresh optimizer of the same
    checkpoint (its regular state loaded first, as the frameworks do) loads it back."""
    def trained():
        torch.manual_seed(0)
        model = nn.Linear(64, 16)
        opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2)
        for step in range(5):
            opt.zero_grad()
            gen = torch.Generator().manual_seed(10 * step + rank)
            model(torch.randn(3, 64, generator=gen)).square().sum().backward()
            opt.step()
        return opt

    saved = trained()
    save_rank_states(folder, rank, world, [saved])
    torch.distributed.barrier()
    fresh = trained()
    regular = saved.state_dict()
    fresh.load_state_dict(dict(regular, onebit=dict(regular["onebit"], units=None)))
    load_rank_states(folder, rank, world, [fresh])
    fresh.prepare_stage()  # the units, which take the loaded errors
    return ([{k: e.clone() for k, e in u.errors.items()} for u in saved.units],
            [{k: e.clone() for k, e in u.errors.items()} for u in fresh.units])


def test_each_ranks_own_errors_come_back_from_its_file(tmp_path):
    """Two ranks: every loaded worker and server error equals the one its own rank saved
    (nonzero, and different from the other rank's)."""
    results = run_ranks(_two_rank_round_trip_worker, 2, str(tmp_path))
    for saved, loaded in results:
        assert saved and all(e.abs().sum() > 0 for unit in saved for e in unit.values())
        assert [sorted(u) for u in loaded] == [["server", "worker"]] * len(saved)
        for a, b in zip(saved, loaded, strict=True):
            for name in a:
                assert torch.equal(a[name], b[name]), name
    assert not torch.equal(results[0][0][0]["worker"], results[1][0][0]["worker"])


def test_a_warm_up_checkpoint_resumes_on_another_world_size(tmp_path):
    """Warm-up holds no error buffers: files of 2 ranks load into 1 or 3 processes (the
    framework's state, rank 0's, is complete), and a Lightning/Fabric checkpoint's
    ``onebit_ranks`` of 2 into 1 or 3; the compression stage's are still refused."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    warm = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=10)
    for _ in range(3):
        warm.zero_grad()
        model(torch.randn(3, 8)).sum().backward()
        warm.step()
    (tmp_path / "w").mkdir()
    for rank in (0, 1):  # as 2 ranks write them
        torch.save([dict(warm.onebit_state_dict(), world_size=2)],
                   tmp_path / "w" / f"onebit_rank{rank}.pt")
    for world in (1, 3):
        resumed = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=10)
        resumed.load_state_dict(warm.state_dict())
        load_rank_states(tmp_path / "w", 0, world, [resumed])
        assert (resumed.global_step, resumed.stage) == (3, "warmup")
    state = dict(warm.state_dict(), onebit_ranks=[warm.onebit_state_dict()] * 2)
    for world in (1, 3):
        own = own_rank_state(state, 0, world)
        assert "onebit_ranks" not in own and own["onebit"]["global_step"] == 3
    # The compression stage's: rank 0's state, whose load restarts the errors (test_optimizer).
    frozen = _trained(4)
    frozen_state = dict(frozen.state_dict(), onebit_ranks=["rank 0's", "rank 1's"])
    own = own_rank_state(frozen_state, 2, 3)
    assert "onebit_ranks" not in own and own["onebit"] is frozen_state["onebit"]


def _gather_on_a_nccl_default(rank, world):
    """The default group claims NCCL: every rank's state must travel on a gloo group of its own
    (made once), never through the default group's gather_object into GPU memory."""
    import torch.distributed as dist

    from onebit_plugin.integrations import rank_states

    made, used = [], []
    new_group, gather = dist.new_group, dist.gather_object
    dist.get_backend = lambda group=None: "nccl" if group is None else "gloo"

    def recorded_new_group(*args, **kwargs):
        made.append(kwargs.get("backend"))
        return new_group(*args, **kwargs)

    def recorded_gather(obj, gathered=None, dst=0, group=None):
        used.append(group)
        return gather(obj, gathered, dst=dst, group=group)

    dist.new_group, dist.gather_object = recorded_new_group, recorded_gather
    opt = _trained(4)
    states = [rank_states.with_rank_states(opt.state_dict(), rank, world) for _ in range(2)]
    return made, [g is not None and g is used[0] for g in used], \
        [len(s.get("onebit_ranks") or []) for s in states]


def test_states_travel_on_a_host_group_when_the_default_is_nccl():
    """Issue 33, item 2 (the part a CPU can show: which group carries them)."""
    results = run_ranks(_gather_on_a_nccl_default, 2)
    for made, same_group, _ in results:
        assert made == ["gloo"] and same_group == [True, True]
    assert [gathered for *_, gathered in results] == [[2, 2], [0, 0]]


def _rss_peak_since_reset() -> int:
    """Bytes of this process's peak resident memory since the last reset."""
    status = Path("/proc/self/status").read_text()
    return int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("VmHWM"))) * 1024


def test_each_rank_reads_only_its_own_errors_from_a_strategys_checkpoint(tmp_path):
    """Lightning and Fabric write every rank's error buffers into rank 0's file, and every rank
    reads that file: in full, W ranks' errors in each rank's memory at once. The strategies'
    reader maps it and copies out rank 0's regular state and this rank's entry alone, nothing
    left mapped (a last.ckpt rewritten in place must not pull pages from under the run)."""
    import gc

    from onebit_plugin.integrations.rank_states import read_own_rank

    world, share = 8, 8 << 20  # 8 ranks' errors of 8M values: 32 MiB each, 256 MiB in all
    ranks = [{"errors": torch.full((share,), float(r)), "switch_step": 3} for r in range(world)]
    saved = {"epoch": 1, "state_dict": {"w": torch.ones(1000)},
             "optimizer_states": [{"state": {}, "param_groups": [], "onebit": ranks[0],
                                   "onebit_ranks": ranks}]}
    path = tmp_path / "last.ckpt"
    torch.save(saved, path)
    del saved, ranks
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
    before = _rss_peak_since_reset()
    read = read_own_rank(path, 2, world, weights_only=True)
    grown = _rss_peak_since_reset() - before
    state = read["optimizer_states"][0]
    assert [r is not None for r in state["onebit_ranks"]] == [i == 2 for i in range(world)]
    assert torch.equal(state["onebit_ranks"][2]["errors"], torch.full((share,), 2.0))
    assert torch.equal(state["onebit"]["errors"], torch.zeros(share))  # rank 0's own entry
    # Rank 0's entry (kept as the regular state) and rank 2's, each mapped then copied:
    # 4 x 32 MiB at the peak (128 MiB measured), where torch.load of the whole file took
    # 8 x 32 MiB (256 MiB).
    assert grown < 5 * 4 * share, grown
    tensors = [state["onebit_ranks"][2]["errors"], state["onebit"]["errors"],
               read["state_dict"]["w"]]
    assert all(t.untyped_storage().filename is None for t in tensors)  # copied, not mapped
    # Another number of ranks: no rank's entry is read (the load takes rank 0's "onebit").
    other = read_own_rank(path, 1, 2, weights_only=True)["optimizer_states"][0]
    assert other["onebit_ranks"] == [None] * world
    # Not a local zip file: the framework's own IO reads it.
    assert read_own_rank("s3://bucket/last.ckpt", 0, 1, weights_only=True) is None
    (tmp_path / "old.ckpt").write_bytes(b"not a zip")
    assert read_own_rank(tmp_path / "old.ckpt", 0, 1, weights_only=True) is None


def test_the_strategies_read_checkpoints_through_the_own_rank_reader(tmp_path):
    """Trainer(strategy="onebit_adam") and Fabric(strategy="onebit_adam") load through
    read_own_rank with the framework's TorchCheckpointIO, also once it was made by a save or
    given as such, and every time; a user's own IO (here a subclass) reads what it reads."""
    pytest.importorskip("lightning")
    import lightning.fabric
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from onebit_plugin.integrations.fabric_strategy import make_fabric_strategy_class
    from onebit_plugin.integrations.lightning import classes_for

    class OwnIO(TorchCheckpointIO):
        pass

    path = tmp_path / "a.ckpt"
    ranks = [{"errors": torch.full((4,), float(r))} for r in range(3)]
    torch.save({"optimizer_states": [{"onebit": ranks[0], "onebit_ranks": ranks}]}, path)
    lightning_cls = classes_for("lightning.pytorch")[0]
    fabric_cls = make_fabric_strategy_class(lightning.fabric, __name__)
    for cls in (lightning_cls, fabric_cls):
        for strategy in (cls(), cls(checkpoint_io=TorchCheckpointIO())):
            for _ in range(2):  # one process: another world size, no rank's entry is read
                read = strategy.load_checkpoint(path)
                assert read["optimizer_states"][0]["onebit_ranks"] == [None] * 3
            strategy.checkpoint_io  # noqa: B018 - made as a save makes it
            read = strategy.load_checkpoint(path)
            assert read["optimizer_states"][0]["onebit_ranks"] == [None] * 3
            assert type(strategy.checkpoint_io) is TorchCheckpointIO  # put back
        whole = cls(checkpoint_io=OwnIO()).load_checkpoint(path)
        assert all(torch.equal(a["errors"], b["errors"]) for a, b in
                   zip(whole["optimizer_states"][0]["onebit_ranks"], ranks, strict=True))
