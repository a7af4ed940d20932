"""``OneBitOptimizer``: what every member of the 1-bit family shares.

An exact stage first: the member's own update (``Policy.warmup_update_``) on gradients averaged
across ranks, by the DDP hook or here. When the member's policy says so
(``Policy.stage_changes``: ``freeze_step``, or ``"auto"``) the variance is frozen and the
compression stage begins: each rank folds its *local* gradient into the momentum, the momentum
units (``onebit_plugin.core.momentum``) are averaged by the policy's wire exchange (1-bit, or exact)
and every rank applies the same update (``Policy.compression_update_``). ``V = sqrt(v_hat) +
eps`` is then a fixed linear preconditioner, which is what lets error feedback cancel the
compression error (Tang et al., 2021, Theorem 1). How each step's values cross ranks is the
step's exchange's, which the policy chooses (``onebit_plugin.core.exchanges``); the step driver
asks for it and calls it.

Around that, shared by every member: the settings (``settings.config``, checked once), the
hand-off with the DDP hook (``core.handoff``), clipping (``core.clipping``), rank checks
(``core.rank_checks``), checkpoints (``core.checkpoint``) and FSDP2's shards (``comm.shards``).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from onebit_plugin.comm.allreduce import ExactAllreduce, OneBitAllreduce
from onebit_plugin.comm.byte_counts import ByteCounts
from onebit_plugin.comm.shards import exchange_group, localize
from onebit_plugin.comm.topology import make_topology
from onebit_plugin.core import checkpoint, compression_stage, rank_checks
from onebit_plugin.core.checkpoint import Resumed
from onebit_plugin.core.clipping import check_clip_args, value_clipping_error
from onebit_plugin.core.compression_stage import UnitLayout
from onebit_plugin.core.exchanges import StepExchange
from onebit_plugin.core.handoff import HandOff
from onebit_plugin.core.momentum import (
    MomentumUnit,
    init_states_in_unit_order,
    new_state,
    partition,
)
from onebit_plugin.core.policy import Policy
from onebit_plugin.core.run_length import RunLength, say_ended_apart
from onebit_plugin.core.skips import Skips
from onebit_plugin.maths.freeze import AutoFreeze
from onebit_plugin.maths.masks import checked_masks
from onebit_plugin.settings.config import OneBitConfig, changed
from onebit_plugin.wire.deferred import as_fp32

__all__ = ["COMPRESSION", "DEFAULT_UNIT_MB", "WARMUP", "OneBitOptimizer"]

WARMUP = "warmup"
COMPRESSION = "compression"
DEFAULT_UNIT_MB = 25.0  # DDP's default bucket size


class OneBitOptimizer(Optimizer):
    """The base of the 1-bit family (``OneBitAdam``; docs/family.md for writing a member).

    Args:
        params: parameters or parameter groups.
        defaults: the member's hyperparameters per group (``decoupled_weight_decay`` among them).
        config: the settings (``onebit_plugin.settings.config.OneBitConfig``), already checked.
        policy: what the member decides (``onebit_plugin.core.policy.Policy``).
        masks: optional ``{param: bool tensor of param's shape}``.
        process_group: group to average over (default: the world, when initialised); FSDP2
            shards': the ranks holding this shard on other hosts (``comm.shards``).
    """

    #: the family's settings (``OneBitConfig``'s fields) whose default this member changes
    family_defaults: dict = {}

    def __init__(self, params, defaults: dict, config: OneBitConfig, policy: Policy, *,
                 masks: dict | None = None, process_group: dist.ProcessGroup | None = None):
        # FSDP2's DTensors are stepped through proxies over their local shards (comm.shards).
        params, self.shards = localize(params)
        super().__init__(params, defaults)
        self.config, self.policy = config, policy
        self._given = config  # as made: the DDP hook and the strategies replace some of it
        process_group, topology = exchange_group(self.shards, process_group, config.topology,
                                                 type(self).__name__, policy)
        self.topology = make_topology(process_group, topology, config.local_world_size)
        self.auto_freeze = AutoFreeze(config.total_steps, policy.auto_ceiling) \
            if config.freeze_step == "auto" else None
        self._masks = checked_masks(masks, self.shards)
        rank_checks.check_params(self.trainable(), type(self).__name__, config.master_weights)
        self.run_length = RunLength(config.total_steps)
        self.global_step = 0
        self.switch_step: int | None = None
        self.skips = Skips()  # steps skipped for a non-finite gradient
        self._unit_cap_bytes = int((config.bucket_cap_mb or DEFAULT_UNIT_MB) * 2**20)
        self.counts = ByteCounts()
        self.layout: UnitLayout | None = None  # the units, built by prepare_stage
        self.resumed = Resumed()  # what a loaded checkpoint leaves for them until then
        self.handoff = HandOff()  # what backward leaves for step(), reset once per step
        self.syncs = 0  # syncs of local steps so far
        self._said_apart = self._said_no_gradient = False
        self._settings_checked = False
        self.hooked_params: set | None = None  # what the DDP hook averages, once registered
        self.averaged_elsewhere = False  # the first step's gradients were identical already
        self.run_length.say_if_never(self.freeze_step, False, self._rank)

    # ----------------------------------------------------------------------------- properties
    @property
    def stage(self) -> str:
        return WARMUP if self.switch_step is None else COMPRESSION

    @property
    def between_syncs(self) -> bool:
        """Whether the ranks have taken local steps since the last sync: their parameters
        differ, by design, until the next (the member's policy keeps them)."""
        return self.policy.apart(self) > 0

    def progress(self) -> dict[str, float]:
        """What the Lightning callback logs per step, as ``onebit/<name>``: here the stage (0
        warm-up, 1 compression); a member adds its own."""
        return {"stage": float(self.switch_step is not None)}

    @property
    def coming_exchange(self) -> str:
        """What the coming step exchanges (``onebit_plugin.settings.step_kinds``): ``"exact"`` in
        warm-up, else the policy's word for step ``global_step + 1``."""
        return self.exchange_for(self.global_step + 1).kind

    def exchange_for(self, t: int) -> StepExchange:
        """The exchange of step ``t`` (``global_step`` once it is taken), as the policy chooses
        it (``onebit_plugin.core.exchanges``): the DDP hook, clipping and ``step()`` call it."""
        return self.policy.step_exchange(t, self.run_length.total, self.switch_step is not None)

    @property
    def unit_cap_bytes(self) -> int:
        """The momentum units' size in bytes: the built units', a loaded checkpoint's until
        they are built, else ``bucket_cap_mb`` (or DDP's bucket size under the hook)."""
        if self.layout is not None:
            return self.layout.cap_bytes
        if self.resumed.unit_cap_bytes is not None:
            return self.resumed.unit_cap_bytes
        return self._unit_cap_bytes

    @property
    def skipped_steps(self) -> int:
        """Steps skipped on every rank for a non-finite gradient so far."""
        return self.skips.total

    @property
    def freeze_step(self) -> int | str:
        return self.config.freeze_step

    @property
    def comm_timeout(self) -> timedelta | None:
        t = self.config.comm_timeout
        return None if t is None else timedelta(seconds=t)

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group the optimizer averages over (None: the world)."""
        return self.topology.process_group

    @property
    def communicator(self) -> OneBitAllreduce | ExactAllreduce | None:
        """The compression stage's communicator, the policy's exchange (on the DDP hook's own
        process group once the hook is registered); None before :meth:`prepare_stage`."""
        return self.counts.comm

    @property
    def units(self) -> list[MomentumUnit]:
        """The momentum units (:meth:`prepare_stage`; empty before)."""
        return self.layout.units if self.layout is not None else []

    def unit_of(self, p: torch.Tensor) -> MomentumUnit | None:
        """The momentum unit that holds ``p``'s momentum (compression stage); None for a
        parameter in none (it was not trainable when the variance froze)."""
        return self.layout.unit_of.get(p) if self.layout is not None else None

    def prepare_stage(self) -> None:
        """The compression stage's communicator and momentum units where the stage begins
        (``compression_stage.prepare``): ``step()`` and the DDP hook call it."""
        compression_stage.prepare(self)

    @property
    def bytes_sent(self) -> int:
        return self.counts.sent

    @property
    def dense_bytes(self) -> int:
        return self.counts.dense

    @property
    def compression_ratio(self) -> float:
        """``dense_bytes / bytes_sent`` over the run so far (inf while nothing was sent; nan
        when something else also averaged the gradients: see :attr:`averaged_elsewhere`)."""
        return self.counts.ratio(self.averaged_elsewhere)

    def count_uncompressed(self, nbytes: int) -> None:
        """Account an fp32 ring allreduce of ``nbytes`` made for this optimizer (warm-up)."""
        self.counts.count_exact(nbytes, self.world_size)

    @property
    def comm_group(self) -> dist.ProcessGroup | None:
        """The group of all of the optimizer's collectives, its topology's
        (``onebit_plugin.comm.topology``): with ``comm_timeout`` (and under the DDP hook) one of its
        own, whose backend timeout is ``comm_timeout``."""
        return self.topology.comm_group(self.comm_timeout, self._device())

    def use_ddp_hook(self, process_group: dist.ProcessGroup | None, overlap: bool,
                     bucket_bytes: int, comm_timeout: float | None = None) -> dist.ProcessGroup:
        """Called by ``register_onebit_hook`` on every rank: DDP's hook averages warm-up
        gradients from now on; with ``overlap`` also the units, inside backward, sized by DDP's
        ``bucket_bytes`` unless ``bucket_cap_mb`` was given. ``comm_timeout`` (seconds): an
        integration's, replacing the optimizer's (before the hook's group is made with it).
        Returns :attr:`comm_group`."""
        if comm_timeout is not None:
            self.config = self.config.replace(comm_timeout=comm_timeout)
        self.config = self.config.replace(average_grads=False)
        self.hooked_params = set(self.trainable())
        if self.config.bucket_cap_mb is None and self.layout is None and overlap:
            self._unit_cap_bytes = int(bucket_bytes)
        group = self.topology.adopt(process_group, self.comm_timeout, self._device(),
                                    again=comm_timeout is not None)
        self.counts.detach()  # resumed before the hook existed: the counts go on
        return group

    @property
    def total_steps(self) -> int | None:
        """The run's optimizer steps, when known (``total_steps``, or ``set_total_steps``)."""
        return self.run_length.total

    def changed_settings(self) -> dict:
        """The family's settings as this optimizer was made with them, away from this member's
        defaults (``settings.config.changed``): what a launcher's line names."""
        return changed(self._given, self.family_defaults)

    def set_total_steps(self, total_steps: int) -> None:
        """The run's length in optimizer steps, from whoever knows it (the integrations call
        it): ``freeze_step="auto"``'s ceiling, and a fixed ``freeze_step`` at or past it is said
        at once (the run would never compress)."""
        self.run_length.learn(total_steps)
        if self.auto_freeze is not None and self.auto_freeze.total_steps is None:
            self.auto_freeze.total_steps = int(total_steps)
        self.run_length.say_if_never(self.freeze_step, self.switch_step is not None, self._rank)

    def set_local_world_size(self, local_world_size: int) -> None:
        """Ranks per host, from an integration that knows them (a strategy's processes per
        node), for ``topology`` where neither ``local_world_size=`` nor LOCAL_WORLD_SIZE says."""
        self.topology.learn_local_world_size(int(local_world_size))

    def compresses_within_run(self) -> bool | None:
        """Whether the compression stage begins before the run ends (None: its length is not
        known; ``onebit_plugin.core.run_length``)."""
        return self.run_length.reaches(self.freeze_step, self.switch_step is not None)

    def training_ended(self) -> None:
        """Training is over (the integrations call it; a loop of one's own may): when it never
        reached the compression stage, that is said once, on rank 0; when it ended between
        syncs of local steps (the ranks' parameters differ), that is said on every rank."""
        self.run_length.say_ended(self.global_step, self.freeze_step,  # one host: said already
                                  self.switch_step is not None or self.shards is not None
                                  and self.shards.alone, self._rank)
        if self.between_syncs and not self._said_apart:
            self._said_apart = True
            say_ended_apart(self.policy.apart(self), self.total_steps)

    @torch.no_grad()
    def sync_local_steps(self) -> None:
        """Sync now, between steps: every rank lands on the common point of the local steps
        taken since the last sync (as the next sync would, without a step of its own). A
        collective: call it on every rank. Nothing happens at a common point."""
        if self.between_syncs:
            self.policy.sync_now(self)

    @property
    def _rank(self) -> int:
        """Rank 0 says the job's lines once: the group's, or with shards the world's rank."""
        return self.topology.rank if self.shards is None else dist.get_rank()

    # ------------------------------------------------------------------------------- clipping
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        params=None) -> torch.Tensor:
        """Clip the averaged gradient's 2-norm to ``max_norm`` for the coming ``step()``, as
        ``torch.nn.utils.clip_grad_norm_`` does under DDP; call it between backward and
        ``step()`` instead of torch's (the integrations do). Returns the total norm.

        Warm-up: the averaged gradients are clipped (averaged here first when the optimizer
        averages them itself), exactly torch's clipping. Compression stage: no rank has the
        averaged gradient; every rank takes the same coefficient from an unbiased estimate of
        its norm (``onebit_plugin.core.clipping``) and ``step()`` scales the gradient inside the
        averaged momentum by it (docs/design.md, "Clipping"). The hook sketches the gradients
        it folds only once clipping was asked for (checkpoints remember it): a first call in
        the compression stage under the DDP hook, whose gradients are already folded, does not
        clip that step, returns nan and says so.

        ``params``, when given, must be the optimizer's trainable parameters (a clip over a
        subset has no compression-stage counterpart)."""
        if self.shards is not None:
            self.shards.pull_grads()
        trainable = self.trainable()
        check_clip_args(max_norm, norm_type, params, trainable)
        return self.exchange_for(self.global_step + 1).clip_grad_norm_(
            self, trainable, max_norm, norm_type)

    def clip_grad_value_(self, clip_value: float) -> None:
        """Always a ``ValueError`` (the integrations raise it for clipping by value): clamping
        is not linear, so unlike :meth:`clip_grad_norm_` it has no compression-stage
        counterpart inside the averaged momentum (no rank holds the averaged gradient)."""
        raise value_clipping_error(clip_value)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # and the DTensors' own, which backward accumulates into
        self.shards is not None and self.shards.zero_grad(set_to_none)

    def trainable(self) -> list[torch.Tensor]:
        # Fixed order, the same on every rank: the units are cut from it.
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def _device(self) -> torch.device:
        trainable = self.trainable()
        return trainable[0].device if trainable else torch.device("cpu")

    @torch._disable_dynamo
    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "switch_step", None) is not None:
            raise ValueError(
                "cannot add a parameter group in the compression stage: the compressed momentum "
                "layout was fixed when the variance froze"
            )
        shards = getattr(self, "shards", None)
        groups, found = localize([param_group], shards)
        if found is not shards:
            raise ValueError("cannot add FSDP2-sharded parameters to an optimizer of plain ones "
                             "(nothing would average the plain ones inside a host)")
        super().add_param_group(groups[0])
        try:
            rank_checks.check_once_each(len(self.param_groups) - 1,
                                        self.param_groups[-1]["params"])
        except ValueError:
            self.param_groups.pop()
            raise

    # ----------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            self._step()
        finally:
            self.handoff.reset()  # nothing of this iteration reaches the next
        return loss

    def _step(self) -> None:
        if self.shards is not None:
            self.shards.pull_grads()
        trainable = self.trainable()
        self._said_no_gradient |= rank_checks.check_gradients(
            type(self).__name__, trainable, self.global_step + 1, self._said_no_gradient)
        rank_checks.check_trainable(self.param_groups, trainable, self.hooked_params,
                                    set(self.layout.unit_of) if self.layout and
                                    self.layout.units else None,
                                    self.switch_step)
        self.global_step += 1
        if not self._settings_checked:
            rank_checks.check_ranks_agree(self, trainable)
        self._settings_checked = True
        self.prepare_stage()
        self.exchange_for(self.global_step).step(self)

    def _master(self, p: torch.Tensor, state: dict) -> torch.Tensor | None:
        """``p``'s fp32 master copy with ``master_weights`` (made from ``p`` when missing: the
        first step, or a checkpoint saved without it), else None."""
        if not self.config.master_weights or p.dtype == torch.float32:
            return None
        if "master" not in state:
            state["master"] = p.detach().float()
        return state["master"]

    def _init_state(self, p: torch.Tensor) -> dict:
        return new_state(self.state[p], p)

    def _init_states(self, params: list[torch.Tensor]) -> None:
        init_states_in_unit_order(self.state, params,
                                  partition(self.trainable(), self.unit_cap_bytes))

    # ---------------------------------------------------------------------- the stage change
    def switch_message(self) -> str | None:
        """The stage switch in one line, None in warm-up. Rank 0 logs it at INFO (logger
        ``onebit_plugin``) when the variance freezes; the Lightning callback shows it too."""
        if self.switch_step is None:
            return None
        how = self.policy.exchange.describe(self.world_size)
        return (f"onebit: Adam variance frozen after step {self.switch_step}; momentum is {how} "
                f"from step {self.switch_step + 1} on{self.policy.after_freeze(self.config)}")

    def _fp32_of(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s fp32 values: its master copy, itself, or an fp32 copy."""
        master = self._master(p, self.state[p]) if self.config.master_weights else None
        return master if master is not None else as_fp32(p)

    def _land(self, p: torch.Tensor, x: torch.Tensor) -> None:
        """``p`` (and its master copy) takes the fp32 values ``x``."""
        master = self._master(p, self.state[p]) if self.config.master_weights else None
        master is not None and master.copy_(x)
        p.copy_(x)

    # ---------------------------------------------------------------------------- state dict
    def state_dict(self) -> dict:
        """The member's state per parameter plus the ``onebit`` entry of
        :meth:`onebit_state_dict` (this rank's)."""
        sd = super().state_dict()
        sd["onebit"] = self.onebit_state_dict()
        return sd

    def onebit_state_dict(self) -> dict:
        """What the per-parameter state does not hold: the stage, counters and this rank's
        error buffers per momentum unit, which differ between ranks: each rank must save its
        own (the Lightning strategy and the Accelerate flag do)."""
        return checkpoint.onebit_state(self)

    def load_state_dict(self, state_dict: dict) -> None:
        checkpoint.load_state(self, state_dict, super().load_state_dict)

    def load_onebit_state_dict(self, onebit: dict) -> None:
        """Load an :meth:`onebit_state_dict` after the per-parameter state: also how a rank
        puts back its own error buffers when the rest came from rank 0's checkpoint."""
        checkpoint.load_onebit_state(self, onebit)

    def _forget_layout(self) -> None:
        """After a load: the units, counters' views and this iteration are rebuilt from the new
        state, and the ranks' settings checked again at the next step."""
        self.layout = None  # with the member's state over the units (its local steps)
        self.handoff.reset()
        self._settings_checked = False

    def __getstate__(self) -> dict:
        # torch's Optimizer pickles only defaults, state and param_groups; keep ours too (the
        # topology drops its process groups: an unpickled optimizer runs on the default group).
        return dict(self.__dict__)
