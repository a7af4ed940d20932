"""OneBitAdam: Adam during warm-up, then frozen-variance Adam with a 1-bit momentum allreduce.

Warm-up (steps ``1..freeze_step``) is ``torch.optim.Adam`` -- or ``AdamW`` with
``decoupled_weight_decay=True`` -- operation for operation, on gradients averaged across ranks.
At the end of step ``freeze_step`` the variance stops changing; ``V = sqrt(v_hat) + eps`` is then
a fixed linear preconditioner, which is what lets error feedback cancel the compression error
(Tang et al., 2021, Theorem 1). From then on each rank folds its *local* gradient into the
momentum, the momentum units are averaged by the communicator (1-bit, or exact with
``compress_momentum=False``) and every rank applies the same update.

Coordinates whose frozen variance is exactly zero are masked: ``1/eps`` would amplify the
``+-scale`` sent for their zero momentum (docs/design.md, "Masks").
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from onebit_plugin.allreduce import (
    ExactAllreduce,
    OneBitAllreduce,
    all_finite,
    group_size_and_rank,
    wait_collectives,
)
from onebit_plugin.compression import SCALE_RULES, ChunkLayout
from onebit_plugin.freeze import AutoFreeze
from onebit_plugin.momentum import MomentumUnit, partition
from onebit_plugin.norm_sketch import NormSketch, sketch_width, squared_norm
from onebit_plugin.update import adam_update_, corrected_root, frozen_update_

__all__ = ["OneBitAdam"]

log = logging.getLogger("onebit_plugin")

WARMUP = "warmup"
COMPRESSION = "compression"
DEFAULT_UNIT_MB = 25.0  # DDP's default bucket size
# A frozen sqrt(v) below this fraction of the rms sqrt(v) over all trainable coordinates is a
# gradient that is zero up to rounding: fp32 rounding leaves about 1e-7 of the terms' size, and
# the key bias of attention (softmax is shift-invariant, so its gradient is mathematically 0)
# measured 3e-10..4e-9 of its tensor's rms in a GPT-2 and an nn.MultiheadAttention model, while
# every real gradient seen was above 1e-5 (a rare byte's embedding row; docs/design.md). Sent
# as +-scale, such a coordinate moves by lr * scale / eps per step: 480 in 20 steps for GPT-2.
NEGLIGIBLE_VARIANCE = 1e-6
# Without DDP the warm-up allreduce goes in chunks of this many fp32 bytes, all started at once:
# the copy of the next chunk's gradients and the division of the last one's means overlap the
# transfer; in one piece those two passes came on top of it. A warm-up step on the 6.5M values
# of benchmarks/cluster.py's GPT, 4 emulated hosts at 1 Gbit/s: 422-430 ms in one allreduce,
# 408 in 4 MiB chunks, 409-413 in 8, 417-420 in 2, 490-503 in 1 (why 1 MiB is slower was not
# looked into); medians of 40 steps, benchmarks/collective_patterns.py, 2026-12-01.
WARMUP_CHUNK_BYTES = 4 * 2**20


class OneBitAdam(Optimizer):
    """1-bit Adam (Tang et al., ICML 2021) as a ``torch.optim.Optimizer``.

    Use it like ``torch.optim.Adam`` in every process of a data-parallel job. Without DDP it
    averages gradients itself during warm-up (fp32 allreduces in 4 MiB chunks) and the momentum
    units afterwards; with DDP, :func:`onebit_plugin.register_onebit_hook` does both inside
    backward. In a single process it is Adam, then Adam with a frozen variance.

    Args:
        params: parameters or parameter groups, as for ``torch.optim.Adam``.
        lr: learning rate, > 0.
        betas: ``(beta1, beta2)``, each in ``[0, 1)``.
        eps: added to ``sqrt(v_hat)``, >= 0.
        weight_decay: L2 penalty (added to the gradient, as ``Adam``) or, with
            ``decoupled_weight_decay=True``, decoupled decay (as ``AdamW``); >= 0.
        freeze_step: number of uncompressed warm-up steps (skipped ones do not count); the
            variance is frozen at the end of the last. Required. The paper uses 15-25% of the run.
            ``"auto"``: frozen once the variance has settled (``onebit_plugin.freeze``), at
            most at 20% of ``total_steps``; the step chosen is logged once.
        total_steps: optimizer steps of the whole run, for ``freeze_step="auto"``'s ceiling
            (the Lightning strategy and the transformers Trainer fill it in).
        decoupled_weight_decay: AdamW semantics for ``weight_decay``.
        max_block: values that share one fp32 scale in the compressed allreduce (multiple of 8).
        scale: block scale rule of the compressor, ``"rms"`` (default) or ``"mean"``.
        mask_zero_variance: keep coordinates whose frozen variance is 0, or zero up to rounding
            (sqrt below ``NEGLIGIBLE_VARIANCE`` = 1e-6 of the rms over all trainable
            coordinates: attention's key bias), at zero momentum: sent as +-scale, the
            1-bit momentum would move them by ``lr * scale / eps`` per step.
        masks: optional ``{param: bool tensor of param's shape}``; False freezes that coordinate's
            momentum at zero in the compression stage. Must be the same on every rank.
        process_group: group to average over (default: the world, when initialised).
        average_grads: average gradients across ranks during warm-up. False when something
            else already did; the compression stage always averages the momentum itself.
        compress_momentum: False averages the momentum with an exact fp32 allreduce after the
            freeze (the ablation that separates freezing the variance from compressing).
        bound_update: in the compression stage, take the frozen variance as at least
            ``m_hat**2``: each coordinate moves at most ``lr`` per step, so that a variance
            frozen before a coordinate's gradients grew (a rare embedding row) cannot let it run
            away (an embedding-heavy model diverged to NaN without it). It also slows
            coordinates whose true step is inside the bound: short runs frozen early lost 2-5%
            of loss (docs/design.md, "Bounded steps"). False is the ablation.
        comm_timeout: seconds any of OneBitAdam's collectives may take before ``step()`` raises
            ``CommunicationError``. Default: the process group's timeout.
        bucket_cap_mb: fp32 megabytes per momentum unit (the parameters are cut into units in
            reverse order). Default: the DDP model's bucket size when the DDP hook overlaps,
            else 25 (DDP's default).
        max_skipped_steps: raise after this many steps in a row skipped for inf/NaN gradients
            (each skip logs a warning).
        master_weights: keep an fp32 copy of every bf16/fp16 parameter in the optimizer state
            (``state[p]["master"]``, 4 bytes per value) and step that copy; the parameter is its
            rounding. Without it an update below half a bf16 ulp of the value is lost at every
            step (docs/design.md, "bf16 parameters"). No effect on fp32 parameters.

    Attributes: ``stage`` (``"warmup"``/``"compression"``), ``global_step``, ``switch_step``,
    ``skipped_steps``, ``bytes_sent``, ``dense_bytes``, ``compression_ratio``, ``communicator``
    and ``units`` (docs/api.md).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int | str | None = None,
        *,
        total_steps: int | None = None,
        decoupled_weight_decay: bool = False,
        max_block: int = 2048,
        scale: str = "rms",
        mask_zero_variance: bool = True,
        masks: dict[torch.Tensor, torch.Tensor] | None = None,
        process_group: dist.ProcessGroup | None = None,
        average_grads: bool = True,
        compress_momentum: bool = True,
        bound_update: bool = True,
        comm_timeout: float | None = None,
        bucket_cap_mb: float | None = None,
        max_skipped_steps: int = 20,
        master_weights: bool = False,
    ):
        _check_hparams(lr, betas, eps, weight_decay)
        if freeze_step is None:
            raise ValueError(
                "freeze_step is required: the number of uncompressed Adam warm-up steps "
                "(an int >= 1; 15-25% of the run is typical)"
            )
        if freeze_step != "auto" and (isinstance(freeze_step, bool) or
                                      not isinstance(freeze_step, int) or freeze_step < 1):
            raise ValueError(f"freeze_step must be an int >= 1 or 'auto', got {freeze_step!r}")
        if total_steps is not None and (isinstance(total_steps, bool) or
                                        not isinstance(total_steps, int) or total_steps < 1):
            raise ValueError(f"total_steps must be an int >= 1, got {total_steps!r}")
        if isinstance(max_block, bool) or not isinstance(max_block, int):
            raise ValueError(f"max_block must be an int, got {max_block!r}")
        ChunkLayout.create(1, 1, max_block)  # the range check
        if scale not in SCALE_RULES:
            raise ValueError(f"scale must be one of {SCALE_RULES}, got {scale!r}")
        if comm_timeout is not None and not comm_timeout > 0:
            raise ValueError(f"comm_timeout must be > 0 seconds, got {comm_timeout!r}")
        if isinstance(max_skipped_steps, bool) or not isinstance(max_skipped_steps, int) or \
                max_skipped_steps < 1:
            raise ValueError(f"max_skipped_steps must be an int >= 1, got {max_skipped_steps!r}")
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults)
        self.freeze_step = freeze_step
        self.auto_freeze = AutoFreeze(total_steps) if freeze_step == "auto" else None
        self.max_block = max_block
        self.scale = scale
        self.mask_zero_variance = mask_zero_variance
        self.process_group = process_group
        self.average_grads = average_grads
        self.compress_momentum = compress_momentum
        self.bound_update = bool(bound_update)
        self.master_weights = bool(master_weights)
        self.comm_timeout = None if comm_timeout is None else timedelta(seconds=comm_timeout)
        self.bucket_cap_mb = bucket_cap_mb
        self._masks = {}
        for p, m in (masks or {}).items():
            if m.shape != p.shape:
                raise ValueError(
                    f"a mask has shape {tuple(m.shape)}, its parameter {tuple(p.shape)}"
                )
            self._masks[p] = m.to(device=p.device, dtype=torch.bool)
        _reject_sharded(self._trainable())
        low = [p for p in self._trainable() if p.dtype in (torch.bfloat16, torch.float16)]
        if low and not self.master_weights:
            log.warning("onebit: %d parameter tensors are %s without master_weights=True: an "
                        "update smaller than half an ulp of the value (1/256 for bf16) is "
                        "rounded away at every step (measured: +0.4%% to +3.3%% validation loss "
                        "against fp32 parameters; within 0.3%% with master_weights=True)",
                        len(low), low[0].dtype)
        devices = {p.device for p in self._trainable()}
        if len(devices) > 1:
            raise ValueError(
                f"OneBitAdam needs all parameters on one device, got {sorted(map(str, devices))}"
            )
        self.global_step = 0
        self.switch_step: int | None = None
        self.skipped_steps = 0  # steps skipped on every rank for a non-finite gradient
        self._skip_streak = 0
        self._said_no_ceiling = False
        self.max_skipped_steps = max_skipped_steps
        self._unit_cap_bytes = int((bucket_cap_mb or DEFAULT_UNIT_MB) * 2**20)
        self._comm_group, self._group_ready = process_group, False
        self._comm = None
        self._units: list[MomentumUnit] | None = None
        self._unit_of: dict[torch.Tensor, MomentumUnit] = {}
        self._steps: torch.Tensor | None = None  # the units' step counters, one tensor
        self._step_index: dict[torch.Tensor, int] = {}  # param: its place in _steps
        self._rows: tuple | None = None  # per group, what the update reads (_update_rows)
        self._saved: dict = {}  # units' errors and counters from a checkpoint, until built
        self._averaged: dict[MomentumUnit, bool] = {}  # by the DDP hook, this iteration
        # param: (data_ptr, version) of the bucket view in which the DDP hook left p's local
        # gradient for step() to fold, or p's averaged momentum, this iteration (see
        # hand_over)
        self._handed: dict[torch.Tensor, tuple[int, int]] = {}
        self._warmup_sent = self._warmup_dense = 0
        self._clip_sent = 0  # the compression stage's clipping-norm allreduces
        self._grad_flat: torch.Tensor | None = None
        self._settings_checked = False
        self._hook_params: set | None = None  # what the DDP hook averages, once registered
        self._reduced: set = set()  # parameters whose bucket the hook averaged (warm-up)
        self._local_norms: dict = {}  # param: norm of the local gradient the hook folded
        self._sketches: dict = {}  # param: its local gradient's NormSketch, once clipping is on
        self._norm_sketch: NormSketch | None = None  # made at the first clip_grad_norm_
        self._said_late_clip = False
        self._clip_coef: float | None = None  # set by clip_grad_norm_ for this step
        self._grads_averaged = False  # by clip_grad_norm_ in warm-up, before step()
        self._said_grad_changed = False
        self._said_local_changed = False
        self._said_mixed_changed = False
        # Set when the first step's gradients were already identical on every rank (below).
        self.averaged_elsewhere = False

    # ----------------------------------------------------------------------------- properties
    @property
    def stage(self) -> str:
        return WARMUP if self.switch_step is None else COMPRESSION

    @property
    def world_size(self) -> int:
        return group_size_and_rank(self.process_group)[0]

    @property
    def communicator(self) -> OneBitAllreduce | ExactAllreduce:
        """The compression stage's communicator: 1-bit, or exact with ``compress_momentum=False``
        (on the DDP hook's own process group once the hook is registered). A single process
        has nothing to send: exact, so it is Adam with a frozen variance."""
        if self._comm is None:
            if self.compress_momentum and self.world_size > 1:
                self._comm = OneBitAllreduce(self.comm_group, max_block=self.max_block,
                                             scale=self.scale, timeout=self.comm_timeout)
            else:
                self._comm = ExactAllreduce(self.comm_group, timeout=self.comm_timeout)
            self._comm.bytes_sent, self._comm.dense_bytes = self._saved.pop("counts", (0, 0))
        return self._comm

    @property
    def units(self) -> list[MomentumUnit]:
        """The momentum units (built at the first use in the compression stage; empty before)."""
        if self._units is None and self.switch_step is not None:
            self._build_units()
        return self._units or []

    def unit_of(self, p: torch.Tensor) -> MomentumUnit | None:
        """The momentum unit that holds ``p``'s momentum (compression stage); None for a
        parameter in none (it was not trainable when the variance froze)."""
        self.units  # noqa: B018 - built on first use
        return self._unit_of.get(p)

    @property
    def bytes_sent(self) -> int:
        return self._warmup_sent + self._compression_counts()[0] + self._clip_sent

    @property
    def dense_bytes(self) -> int:
        return self._warmup_dense + self._compression_counts()[1]

    @property
    def compression_ratio(self) -> float:
        """``dense_bytes / bytes_sent`` over the run so far (inf while nothing was sent; nan
        when something else also averaged the gradients: see :attr:`averaged_elsewhere`)."""
        if self.averaged_elsewhere:
            return math.nan
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else math.inf

    def _compression_counts(self) -> tuple[int, int]:
        if self._comm is not None:
            return self._comm.bytes_sent, self._comm.dense_bytes
        return self._saved.get("counts", (0, 0))

    def count_uncompressed(self, nbytes: int) -> None:
        """Account an fp32 ring allreduce of ``nbytes`` made for this optimizer (warm-up)."""
        sent = _ring_bytes(nbytes, self.world_size)
        self._warmup_sent += sent
        self._warmup_dense += sent

    @property
    def comm_group(self) -> dist.ProcessGroup | None:
        """The group of all of OneBitAdam's collectives: with ``comm_timeout`` (and under the DDP
        hook) one of its own, made on every rank at the first use, whose backend timeout is
        ``comm_timeout``, so that a process can exit after a peer fails (docs/design.md)."""
        if not self._group_ready and self.comm_timeout is not None and self.world_size > 1:
            self._comm_group = _new_group(self.process_group, self.comm_timeout)
        self._group_ready = True
        return self._comm_group

    # -------------------------------------------------------------------- the DDP hook's API
    def use_ddp_hook(self, process_group: dist.ProcessGroup | None, overlap: bool,
                     bucket_bytes: int) -> dist.ProcessGroup:
        """Called by ``register_onebit_hook`` on every rank: DDP's hook averages warm-up
        gradients from now on; with ``overlap`` also the units, inside backward, sized by DDP's
        ``bucket_bytes`` unless ``bucket_cap_mb`` was given. Returns :attr:`comm_group`."""
        self.average_grads = False
        self._hook_params = set(self._trainable())
        if self.bucket_cap_mb is None and self._units is None and overlap:
            self._unit_cap_bytes = int(bucket_bytes)
        if not self._group_ready or self._comm_group is process_group:
            self._comm_group = _new_group(process_group, self.comm_timeout)
            self._group_ready = True
        if self._comm is not None:  # resumed before the hook existed: keep the counts
            self._saved["counts"] = self._compression_counts()
            self._comm = None
        return self._comm_group

    def mark_averaged(self, unit: MomentumUnit, ok: bool) -> None:
        """The DDP hook averaged ``unit`` during backward (``ok``: every rank's was finite);
        ``step()`` then takes its momentum from ``p.grad`` (clipping included)."""
        self._averaged[unit] = ok

    def hand_over(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """The DDP hook is done writing ``grad``, ``p``'s view of DDP's bucket, which is
        ``p.grad`` (``gradient_as_bucket_view=True``). It holds either ``p``'s local gradient,
        for ``step()`` to fold and average (a unit the last bucket completed, or every unit with
        ``overlap=False``), or ``p``'s averaged momentum (a unit averaged in backward).
        Its version count is kept, so that ``step()`` sees at no cost whether something changed
        it in between: a changed local gradient is folded as it is, a changed momentum is
        compared and used as it is (ignored beside local gradients: ``_say_mixed_changed``),
        and either is said once (torch's ``clip_grad_norm_`` would clip each rank's local
        gradient by its own norm, or the momentum). Call it after the hook's last write to the
        bucket."""
        self._handed[p] = (grad.data_ptr(), grad._version)

    def note_local_gradient(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """The DDP hook is about to fold ``p``'s local gradient in the compression stage: its
        norm is kept for :meth:`clip_grad_norm_`, since ``p.grad`` will hold the averaged
        momentum before anyone can clip it."""
        if self._norm_sketch is None:  # nobody clips: no pass over the gradients
            return
        self._local_norms[p] = torch.linalg.vector_norm(grad, dtype=torch.float32)
        self._sketches[p] = self._norm_sketch.of(p, grad)

    # ------------------------------------------------------------------------------- clipping
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        params: Iterable[torch.Tensor] | None = None) -> torch.Tensor:
        """Clip the averaged gradient's 2-norm to ``max_norm`` for the coming ``step()``, as
        ``torch.nn.utils.clip_grad_norm_`` does for Adam under DDP; call it between backward and
        ``step()`` instead of torch's (the integrations do). Returns the total norm.

        Warm-up: the averaged gradients are clipped (averaged here first when OneBitAdam
        averages them itself), exactly torch's clipping. Compression stage: no rank has the
        averaged gradient, only its local one, already folded into the momentum by the DDP hook.
        Every rank takes the same coefficient ``max_norm / norm``, with ``norm`` estimated
        without bias from a sketch of each rank's local gradient (``onebit_plugin.norm_sketch``:
        one allreduce of 256-4096 values, a few percent of error), and ``step()`` scales the
        gradient inside the averaged momentum by it: the momentum Adam would have after clipping
        by that norm, identical on every rank (docs/design.md, "Clipping"). The hook sketches
        the gradients it folds only once clipping was asked for (checkpoints remember it): a
        first call in the compression stage under the DDP hook, whose gradients are already
        folded, does not clip that step, returns nan and says so.

        ``params``, when given, must be the optimizer's trainable parameters (a clip over a
        subset has no compression-stage counterpart)."""
        if norm_type != 2.0:
            raise ValueError(f"OneBitAdam.clip_grad_norm_ clips by the 2-norm; got norm_type="
                             f"{norm_type!r}")
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
        trainable = self._trainable()
        if params is not None:
            given = {p for p in params if p.requires_grad}
            if given != set(trainable):
                raise ValueError(
                    f"OneBitAdam.clip_grad_norm_ clips all of the optimizer's {len(trainable)} "
                    f"trainable parameters together; {len(given)} were given, "
                    f"{len(given - set(trainable))} of them not the optimizer's: in the "
                    "compression stage only the whole gradient's norm can be clipped")
        device = trainable[0].device if trainable else torch.device("cpu")
        late = self._norm_sketch is None and bool(self._averaged)  # folded, never sketched
        self._start_sketching()
        if self.switch_step is None:
            if self.average_grads and self.world_size > 1 and not self._grads_averaged:
                self._average_gradients()
                self._grads_averaged = True
            grads = [p.grad for p in trainable if p.grad is not None]
            if not grads:
                return torch.zeros((), device=device)
            return torch.nn.utils.clip_grad_norm_(trainable, max_norm)
        if late:  # the same on every rank: the hook ran, and nobody had clipped, everywhere
            if not self._said_late_clip:
                self._said_late_clip = True
                log.warning("onebit: clip_grad_norm_ was first called in the compression stage, "
                            "after the DDP hook had folded this step's gradients unsketched: "
                            "this step is not clipped (nan returned); the next ones are")
            return torch.full((), math.nan, device=device)
        # Per parameter, in the same order on every path: the same bits whoever folded.
        local = [p for p in trainable if p in self._local_norms or p.grad is not None]
        if self.world_size == 1:  # the local gradient is the gradient: its norm is exact
            norms = [self._local_norms.get(p, None) for p in local]
            norms = [n if n is not None else torch.linalg.vector_norm(p.grad, dtype=torch.float32)
                     for n, p in zip(norms, local, strict=True)]
            estimate = (torch.linalg.vector_norm(torch.stack(norms)) if norms
                        else torch.zeros((), device=device))
        else:
            sketch = torch.zeros(self._norm_sketch.width, device=device)
            if local:
                sketch = torch.stack([self._sketches[p] if p in self._sketches
                                      else self._norm_sketch.of(p, p.grad)
                                      for p in local]).sum(0)
            work = dist.all_reduce(sketch, group=self.comm_group, async_op=True)
            wait_collectives([work], self.comm_timeout, "the clipping norm's allreduce",
                             self.comm_group)
            self._clip_sent += _ring_bytes(sketch.nbytes, self.world_size)
            estimate = squared_norm(sketch.div_(self.world_size)).sqrt()
        norm = float(estimate)
        # Non-finite: step() skips this step on every rank anyway.
        self._clip_coef = min(1.0, max_norm / (norm + 1e-6)) if math.isfinite(norm) else None
        return estimate.reshape(())

    def _start_sketching(self) -> None:
        if self._norm_sketch is None:  # from now on the hook sketches what it folds
            trainable = self._trainable()
            self._norm_sketch = NormSketch(trainable,
                                           sketch_width(sum(p.numel() for p in trainable)))

    def clip_grad_value_(self, clip_value: float) -> None:
        """Always a ``ValueError``: clamping the averaged gradient's coordinates has no
        compression-stage counterpart (no rank holds that gradient, and clamping is not linear,
        so it cannot be applied inside the averaged momentum as :meth:`clip_grad_norm_` is).
        The integrations raise it where a user asks for clipping by value."""
        raise ValueError(
            f"gradient clipping by value ({clip_value!r}) has no 1-bit Adam counterpart: in the "
            "compression stage no rank holds the averaged gradient whose coordinates it would "
            "clamp. Clip by norm instead (Lightning: gradient_clip_algorithm='norm'; Fabric: "
            "clip_gradients(max_norm=...); Accelerate: accelerator.clip_grad_norm_; your own "
            "loop: optimizer.clip_grad_norm_)")

    def _trainable(self) -> list[torch.Tensor]:
        # Fixed order, the same on every rank: the units are cut from it.
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    @torch._disable_dynamo
    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "switch_step", None) is not None:
            raise ValueError(
                "cannot add a parameter group in the compression stage: the compressed momentum "
                "layout was fixed when the variance froze"
            )
        super().add_param_group(param_group)
        params = self.param_groups[-1]["params"]
        if len(set(params)) != len(params):
            # torch only warns; one parameter stepped twice per step is not Adam (its step
            # count would advance twice), and a momentum unit would hold it twice.
            self.param_groups.pop()
            seen: set = set()
            twice = next(i for i, p in enumerate(params) if p in seen or seen.add(p))
            raise ValueError(
                f"onebit: a parameter appears more than once in one parameter group (group "
                f"{len(self.param_groups)}, again at #{twice}, shape "
                f"{tuple(params[twice].shape)}); pass each parameter once")

    # ----------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        trainable = self._trainable()
        for p in trainable:
            if p.grad is not None and p.grad.is_sparse:
                raise ValueError("OneBitAdam does not support sparse gradients")
        self._check_trainable(trainable)
        self.global_step += 1
        if not self._settings_checked:
            self._check_ranks_agree()
        self._settings_checked = True
        if self.switch_step is None:
            if self.average_grads and self.world_size > 1 and not self._grads_averaged:
                self._average_gradients()
            self._grads_averaged = False
            if self._hook_params is not None:
                self._check_reduced(trainable)
            self._warmup_step()
            if self._freeze_now(self.global_step - self.skipped_steps):  # applied steps
                self._freeze()
        else:
            self._compression_step()
        self._local_norms, self._sketches, self._clip_coef = {}, {}, None
        return loss

    def _check_trainable(self, trainable: list[torch.Tensor]) -> None:
        """The same decision on every rank (the same parameters and flags everywhere), taken
        before any collective: no rank diverges or waits on a peer that raised."""
        trainable_set = set(trainable)
        outside_ddp = trainable_set - self._hook_params if self._hook_params is not None \
            else set()
        if outside_ddp:
            raise ValueError(
                f"onebit: {self._name(outside_ddp)} not in the DDP model's reducer (frozen when "
                "DDP wrapped the model, unfrozen since?): DDP would never average their "
                "gradients and the ranks would drift apart. Unfreeze them before wrapping the "
                "model in DDP (Lightning's BackboneFinetuning: use another strategy or train "
                "all parameters)")
        outside_units = trainable_set - set(self._unit_of) if self._units else set()
        if outside_units:
            raise ValueError(
                f"onebit: {self._name(outside_units)} in no momentum unit: not trainable when "
                f"the variance froze after step {self.switch_step}, and the compressed "
                "momentum's layout is fixed then. Make them trainable before the freeze "
                "(freeze_step) or keep them frozen for the rest of the run (a parameter "
                "trainable at the freeze may be frozen and unfrozen again afterwards)")

    def _name(self, params: set) -> str:
        """``params`` as a message names them: their place in the param groups and shape."""
        where = [f"group {g} #{i} {tuple(p.shape)}" for g, group in enumerate(self.param_groups)
                 for i, p in enumerate(group["params"]) if p in params]
        shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
        return f"{len(where)} trainable parameter(s) ({shown}) are"

    def note_reduced(self, params) -> None:
        """The DDP hook averaged the warm-up gradients of ``params`` (one bucket's) in this
        iteration."""
        self._reduced.update(params)

    def _check_reduced(self, trainable: list[torch.Tensor]) -> None:
        """Under the DDP hook in warm-up, every gradient ``step()`` is about to use must have
        been averaged by it: a bucket DDP never found ready (a parameter without a gradient
        under ``find_unused_parameters=False``; every backward under ``no_sync()``) leaves
        each rank's own gradients, and stepping on them would make the ranks drift apart (DDP
        says so only at the next forward, after this step)."""
        reduced, self._reduced = self._reduced, set()
        missing = {p for p in trainable if p.grad is not None and p not in reduced}
        if missing:
            raise ValueError(
                f"onebit: {self._name(missing)} not averaged by DDP in this iteration (their "
                "bucket never became ready: a parameter that got no gradient while "
                "find_unused_parameters=False, or backward only under no_sync()); stepping on "
                "each rank's own gradients would make the ranks drift apart, so this step is "
                "refused. Pass find_unused_parameters=True to DDP, or leave no_sync() for the "
                "last micro-batch's backward")

    def _check_ranks_agree(self) -> None:
        """First step (and first after a resume): every rank must run the same configuration,
        or the ranks would switch stages at different steps or lay the units out differently,
        and hold the same parameters."""
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched > 1 and not dist.is_initialized():
            raise RuntimeError(f"onebit: this process is one of WORLD_SIZE={launched} (torchrun?) "
                               "but torch.distributed is not initialised, so it would train "
                               "alone; call torch.distributed.init_process_group() first")
        if self.world_size == 1:
            return
        params = self._trainable()
        config = {
            "freeze_step": -1 if self.auto_freeze else self.freeze_step,  # -1: "auto"
            "total_steps": self.auto_freeze.total_steps or 0 if self.auto_freeze else 0,
            "max_block": self.max_block,
            "scale": SCALE_RULES.index(self.scale), "bucket bytes": self._unit_cap_bytes,
            "mask_zero_variance": int(self.mask_zero_variance),
            "compress_momentum": int(self.compress_momentum),
            "bound_update": int(self.bound_update), "global_step": self.global_step,
            "master_weights": int(self.master_weights),
            "trainable parameters": len(params),
            "trainable values": sum(p.numel() for p in params),
        }
        local = torch.tensor(list(config.values()), dtype=torch.int64)
        # The gradients' fingerprint (float64 bits as int64) and the parameters' travel in the
        # same gather.
        fingerprint = self._grad_fingerprint(params).view(torch.int64)
        weights = _param_fingerprints(params)
        digest = (weights * torch.arange(1, len(params) + 1)).sum().reshape(1)  # int64, wraps
        gathered = self._gather(torch.cat([local, fingerprint, digest]), "the settings check")
        prints = {tuple(g[len(config):len(config) + 2].tolist()) for g in gathered}
        if len(prints) == 1 and fingerprint[1] != 0 and not self.averaged_elsewhere:
            self._say_averaged_elsewhere(self.world_size)
        for i, name in enumerate(config):
            values = [int(g[i]) for g in gathered]
            if len(set(values)) > 1:
                raise ValueError(
                    f"OneBitAdam's {name} differs between ranks: {values} (rank "
                    f"0..{self.world_size - 1}); every rank must use the same settings and "
                    "parameters"
                )
        if len({int(g[-1]) for g in gathered}) > 1:  # as many parameters everywhere (above)
            every = self._gather(weights, "the parameters check")
            differ = {p for i, p in enumerate(params) if len({int(w[i]) for w in every}) > 1}
            raise ValueError(
                f"onebit: {self._name(differ)} not the same on every rank at step "
                f"{self.global_step}: each rank would train a model of its own (without "
                "DDP nothing makes them equal). Start every rank from the same weights: the "
                "same torch.manual_seed before building the model, one checkpoint loaded by "
                "every rank, or rank 0's broadcast (for p in model.parameters(): "
                "torch.distributed.broadcast(p.data, src=0)), as DDP does when it wraps a model"
            )

    def _gather(self, local: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Every rank's ``local`` (int64, as long on every rank)."""
        params = self._trainable()
        if params and params[0].is_cuda:  # NCCL gathers device tensors
            local = local.to(params[0].device)
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        work = dist.all_gather(gathered, local, group=self.comm_group, async_op=True)
        wait_collectives([work], self.comm_timeout, what, self.comm_group)
        return [g.cpu() for g in gathered]

    def _grad_fingerprint(self, params: list[torch.Tensor]) -> torch.Tensor:
        """Sum and sum of squares of this rank's gradients (float64, on the CPU), or zeros when
        the DDP hook averages them (identical by design). Each rank computes its gradients from
        its own data, so identical fingerprints on every rank mean that something averaged them
        before ``step()``."""
        out = torch.zeros(2, dtype=torch.float64)
        if self._hook_params is not None or self._grads_averaged:  # by clip_grad_norm_
            return out
        grads = [p.grad.detach().double() for p in params if p.grad is not None]
        if grads:  # the first step only: one host sync for the whole check
            out = torch.stack([sum(g.sum() for g in grads),
                               sum(g.square().sum() for g in grads)]).cpu()
        return out

    def _say_averaged_elsewhere(self, world: int) -> None:
        self.averaged_elsewhere = True
        log.warning(
            "onebit: the gradients reaching OneBitAdam.step() are identical on all %d ranks: "
            "something already averaged them (DDP without the 1-bit hook, FSDP, another "
            "wrapper), so each step also sends a full fp32 allreduce and compression_ratio "
            "reports nan. Fix: Lightning Trainer(strategy='onebit_adam'); Fabric(strategy="
            "'onebit_adam'); Accelerate scripts and transformers.Trainer: launch with "
            "`onebit-run accelerate launch ...`; your own DDP model: "
            "onebit_plugin.register_onebit_hook(ddp_model, optimizer) before the first backward; "
            "no DDP: pass the bare model to OneBitAdam and drop your own gradient allreduce. "
            "(If every rank trained on the same "
            "batch, give each rank its own data.)", world)

    def _hyper(self):
        """Each trainable parameter with its group's hyperparameters, as the update functions
        take them."""
        for g in self.param_groups:
            hyper = dict(lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1], eps=g["eps"],
                         weight_decay=g["weight_decay"], decoupled=g["decoupled_weight_decay"])
            yield from ((p, hyper) for p in g["params"] if p.requires_grad)

    def _warmup_step(self) -> None:
        stepped = [p for p in self._trainable() if p.grad is not None]
        # After averaging every rank holds the same gradients, hence the same decision.
        if not all_finite([p.grad for p in stepped]):
            return self._skip()
        self._skip_streak = 0
        self._init_states([p for p in stepped if not self.state[p]])
        for g in self.param_groups:
            params = [p for p in g["params"] if p.requires_grad and p.grad is not None]
            if not params:
                continue
            states = [self.state[p] or self._init_state(p) for p in params]
            counts = [state["step"] for state in states]
            torch._foreach_add_(counts, 1.0)
            adam_update_(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                         [s["exp_avg_sq"] for s in states], [c.item() for c in counts],
                         lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1], eps=g["eps"],
                         weight_decay=g["weight_decay"], decoupled=g["decoupled_weight_decay"],
                         masters=[self._master(p, s) for p, s in zip(params, states,
                                                                     strict=True)])

    def _say_grad_changed(self) -> None:
        self._said_grad_changed = True
        log.warning(
            "onebit: in the compression stage p.grad holds the averaged momentum (the DDP hook "
            "folded the local gradients into it during backward), and something changed it "
            "before step(): torch.nn.utils.clip_grad_norm_ or clip_grad_value_ there clips the "
            "momentum, which is not what clipping means for Adam. "
            "Call optimizer.clip_grad_norm_(max_norm) instead (the Lightning and Fabric "
            "strategies and onebit-run's Accelerator do); the changed momentum is used as given")

    def _say_mixed_changed(self) -> None:
        self._said_mixed_changed = True
        log.warning(
            "onebit: p.grad was changed between backward and step() (by "
            "torch.nn.utils.clip_grad_norm_ or clip_grad_value_?) where it held the averaged "
            "momentum, while other parameters' p.grad held each rank's own local gradient "
            "(momentum units left to step() with gradient_as_bucket_view=True). A clipping "
            "computed over both differs between ranks and would make them drift apart: the "
            "averaged momentum is kept as the DDP hook computed it, the change to it is ignored "
            "(the local gradients' change is used). Call optimizer.clip_grad_norm_(max_norm) "
            "instead (the Lightning and Fabric strategies and onebit-run's Accelerator do).")

    def _say_local_changed(self) -> None:
        self._said_local_changed = True
        log.warning(
            "onebit: p.grad was changed between backward and step() (by "
            "torch.nn.utils.clip_grad_norm_ or clip_grad_value_?). In the compression stage, "
            "with gradient_as_bucket_view=True, the DDP hook leaves each rank's own local "
            "gradient in p.grad for the parameters whose momentum step() averages, so torch's "
            "clipping there clips every rank's gradient separately, before averaging; under "
            "DDP with Adam it clips the averaged gradient. Call "
            "optimizer.clip_grad_norm_(max_norm) instead (the Lightning and Fabric strategies "
            "and onebit-run's Accelerator do). The changed gradients are used as given.")

    def _skip(self) -> None:
        """A step skipped on every rank (some rank's gradient was not finite): said each time,
        and an error after ``max_skipped_steps`` in a row, never a silent stall."""
        self.skipped_steps += 1
        self._skip_streak += 1
        log.warning("onebit: step %d skipped on every rank: a gradient was inf or NaN on some "
                    "rank (%d in a row, %d in all)", self.global_step, self._skip_streak,
                    self.skipped_steps)
        if self._skip_streak >= self.max_skipped_steps:
            raise RuntimeError(
                f"onebit: {self._skip_streak} steps in a row were skipped for inf/NaN gradients "
                "(the loss has diverged, or the data holds NaN): lower the learning rate, clip "
                "gradients or check the data; max_skipped_steps sets this limit"
            )

    def _master(self, p: torch.Tensor, state: dict) -> torch.Tensor | None:
        """``p``'s fp32 master copy with ``master_weights`` (made from ``p`` when missing: the
        first step, or a checkpoint saved without it), else None."""
        if not self.master_weights or p.dtype == torch.float32:
            return None
        if "master" not in state:
            state["master"] = p.detach().float()
        return state["master"]

    def _init_state(self, p: torch.Tensor, exp_avg: torch.Tensor | None = None) -> dict:
        state = self.state[p]
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = (torch.zeros_like(p, dtype=torch.float32) if exp_avg is None
                            else exp_avg)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        return state

    def _init_states(self, params: list[torch.Tensor]) -> None:
        """Adam's state for ``params`` (none yet), their momenta back to back in one buffer in
        the order the momentum units will lay them out: the freeze then takes that memory as
        the units' momentum instead of copying it into new memory (``MomentumUnit``)."""
        if len(params) < 2 or len({p.device for p in params}) > 1 or \
                any(p.layout != torch.strided for p in params):
            return  # each its own, in _init_state
        order = {p: i for i, p in enumerate(
            q for unit in partition(self._trainable(), self._unit_cap_bytes) for q in unit)}
        params = sorted(params, key=lambda p: order.get(p, len(order)))
        flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32,
                           device=params[0].device)
        for p, m in zip(params, flat.split([p.numel() for p in params]), strict=True):
            self._init_state(p, m.view(p.shape))

    def _average_gradients(self) -> None:
        """The mean of every trainable gradient over the ranks (zeros where a rank has none),
        with a has-gradient flag per parameter so that all ranks agree on which params step:
        fp32 allreduces of ``WARMUP_CHUNK_BYTES`` each, all started before the first is waited
        on, so that copying the gradients in and dividing the means out overlap the transfer."""
        params = self._trainable()
        sizes = [p.numel() for p in params]
        total, head = sum(sizes), len(params)
        if self._grad_flat is None or self._grad_flat.numel() != head + total:
            self._grad_flat = torch.empty(head + total, dtype=torch.float32,
                                          device=params[0].device)
        flat = self._grad_flat
        flat[:head] = torch.tensor([float(p.grad is not None) for p in params])
        views = flat[head:].split(sizes)
        chunks = _chunks(sizes, head, WARMUP_CHUNK_BYTES // 4)
        works = []
        for start, end, lo, hi in chunks:
            for p, view in zip(params[lo:hi], views[lo:hi], strict=True):
                view.copy_(p.grad.reshape(-1)) if p.grad is not None else view.zero_()
            works.append(dist.all_reduce(flat[start:end], group=self.comm_group, async_op=True))
        world = self.world_size
        present = None
        for work, (start, end, lo, hi) in zip(works, chunks, strict=True):
            wait_collectives([work], self.comm_timeout, "the warm-up gradient allreduce",
                             self.comm_group)
            self._warmup_sent += _ring_bytes(4 * (end - start), world)
            if present is None:  # the flags travel in the first chunk
                present = flat[:head].tolist()
            for p, view, there in zip(params[lo:hi], views[lo:hi], present[lo:hi], strict=True):
                if p.grad is not None and p.grad.dtype == torch.float32:
                    # The mean straight into p.grad: one pass fewer over the gradients than
                    # dividing in place and copying (the same division, the same bits).
                    torch.div(view.view_as(p), world, out=p.grad)
                elif p.grad is not None:
                    p.grad.copy_(view.div_(world).view_as(p))
                elif there:  # another rank had one
                    p.grad = view.div_(world).view_as(p).to(p.dtype, copy=True)
        self._warmup_dense += _ring_bytes(4 * total, world)

    # --------------------------------------------------------------------------- compression
    def set_total_steps(self, total_steps: int) -> None:
        """The run's length, for ``freeze_step="auto"``'s ceiling (integrations call it)."""
        if self.auto_freeze is not None and self.auto_freeze.total_steps is None:
            self.auto_freeze.total_steps = int(total_steps)

    def _freeze_now(self, applied: int) -> bool:
        if self.auto_freeze is None:
            return applied >= self.freeze_step
        rank = group_size_and_rank(self.process_group)[1]
        if self.auto_freeze.total_steps is None and not self._said_no_ceiling:
            self._said_no_ceiling = True
            if rank == 0:  # said once per job, like the freeze itself
                log.warning("onebit: freeze_step='auto' without total_steps: the variance freezes "
                            "only once it has settled, which on a short run may be never (all of "
                            "it uncompressed Adam); pass OneBitAdam(total_steps=...) "
                            "(ONEBIT_TOTAL_STEPS for the Accelerate flag) to freeze at 20% of the "
                            "run at the latest")
        reason = self.auto_freeze.observe(applied, self._roots_now, negligible_root)
        if reason is not None and rank == 0:
            log.warning("onebit: freeze_step='auto' froze the variance after step %d: %s",
                        applied, reason)
        return reason is not None

    def _roots_now(self) -> list[torch.Tensor]:
        """This step's bias-corrected sqrt(v) per trainable parameter, flat (0 without state)."""
        roots = []
        for p, hyper in self._hyper():
            state = self.state[p]
            if not state:
                roots.append(torch.zeros(p.numel(), dtype=torch.float32, device=p.device))
                continue
            roots.append(corrected_root(state["exp_avg_sq"].reshape(-1), float(state["step"]),
                                        beta2=hyper["beta2"]))
        return roots

    def _freeze(self) -> None:
        """End of step ``freeze_step``: fix the variance (the units are built at first use)."""
        for p in self._trainable():
            state = self.state[p] or self._init_state(p)  # no gradient yet: v == 0, all masked
            # v's bias correction 1 - b2**0 would be 0 (0/0 = NaN) where v never moved.
            # A Python number, not a tensor: Lightning moves every optimizer state tensor but
            # "step" to the GPU on resume, and reading it per step would then sync the host.
            state["frozen_step"] = max(float(state["step"]), 1.0)
        self.switch_step = self.global_step
        if group_size_and_rank(self.process_group)[1] == 0:  # once per job, like the freeze
            log.info("%s", self.switch_message())

    def switch_message(self) -> str | None:
        """The stage switch in one line, None in warm-up. Rank 0 logs it at INFO (logger
        ``onebit_plugin``) when the variance freezes; the Lightning callback shows it too."""
        if self.switch_step is None:
            return None
        how = ("exchanged as 1-bit signs" if self.compress_momentum and self.world_size > 1
               else "averaged exactly in fp32 (compress_momentum=False or one process)")
        return (f"onebit: Adam variance frozen after step {self.switch_step}; momentum is {how} "
                f"from step {self.switch_step + 1} on")

    def _frozen_roots(self, params: list[torch.Tensor], beta2: dict) -> torch.Tensor:
        """The bias-corrected sqrt(v) of ``params``, frozen, in one flat fp32 buffer (the one
        that becomes their unit's denominator once eps is added)."""
        root = torch.empty(sum(p.numel() for p in params), dtype=torch.float32,
                           device=params[0].device)
        for p, piece in zip(params, root.split([p.numel() for p in params]), strict=True):
            state = self.state[p]
            corrected_root(state["exp_avg_sq"].reshape(-1), state["frozen_step"],
                           beta2=beta2[p], out=piece)
        return root

    def _keep(self, params: list[torch.Tensor], root: torch.Tensor,
              negligible: float) -> torch.Tensor:
        """Flat bool mask of the coordinates of ``params`` (``root``: their frozen sqrt(v))
        that take part in the compression stage."""
        if not self.mask_zero_variance:
            keep = torch.ones(root.numel(), dtype=torch.bool, device=root.device)
        elif negligible != 0:  # a NaN root fails the comparison (masked); a NaN bound masks all
            keep = root >= negligible
        else:  # every sqrt(v) is 0: only the zeros (and NaNs) are masked
            keep = root > 0
        offset = 0
        for p in params:
            if p in self._masks:
                keep[offset : offset + p.numel()] &= self._masks[p].reshape(-1)
            offset += p.numel()
        return keep

    def _build_units(self) -> None:
        """Move every momentum into its unit (``state['exp_avg']`` become views) and load the
        units' saved errors, if a checkpoint left some."""
        hyper = {p: g for g in self.param_groups for p in g["params"]}
        saved = self._saved.pop("units", None)
        if saved is not None:
            self._unit_cap_bytes = self._saved.pop("unit_cap_bytes")
        self._units = []
        beta2 = {p: g["betas"][1] for p, g in hyper.items()}
        parts = partition(self._trainable(), self._unit_cap_bytes)
        # One root per coordinate, computed into the buffer that becomes the denominator, read
        # by the masks first: with a root per use (three) and the temporaries each made, this
        # step took 1.3 s on each of 4 emulated hosts sharing 2 cores at 6.5M parameters,
        # against some 0.2 s for a compression-stage step (2026-12-01, benchmarks/cluster.py).
        roots = [self._frozen_roots(params, beta2) for params in parts]
        negligible = negligible_root(roots) if self.mask_zero_variance else 0.0
        # Warm-up's gradient buffer (without DDP) is resident and no longer used: the units'
        # fold buffers are cut from it rather than from new memory (MomentumUnit's note).
        spare, self._grad_flat, start = self._grad_flat, None, 0
        for params, root in zip(parts, roots, strict=True):
            local = None
            if spare is not None and spare.device == root.device and \
                    start + root.numel() <= spare.numel():
                local, start = spare[start : start + root.numel()], start + root.numel()
            keep = self._keep(params, root, negligible)
            offset = 0
            for p in params:
                root[offset : offset + p.numel()].add_(hyper[p]["eps"])
                offset += p.numel()
            unit = MomentumUnit(params, [self.state[p]["exp_avg"] for p in params], root, keep,
                                [hyper[p] for p in params], self.communicator, local)
            for p in params:
                self.state[p]["exp_avg"] = unit.view(p)
            self._units.append(unit)
        self._unit_of = {p: u for u in self._units for p in u.params}
        # The step counters become views of one tensor: one add and one read a step for all of
        # them (a foreach add, a stack and a read of some 100 scalar tensors cost ~0.7 ms).
        trainable = self._trainable()
        self._steps = torch.tensor([float(self.state[p]["step"]) for p in trainable],
                                   dtype=torch.float32)
        for p, count in zip(trainable, self._steps.unbind(), strict=True):
            self.state[p]["step"] = count
        self._step_index = {p: i for i, p in enumerate(trainable)}
        self._rows = None
        if saved is not None:
            if len(saved) != len(self._units):
                raise ValueError(f"the checkpoint holds {len(saved)} momentum units, this "
                                 f"optimizer has {len(self._units)}")
            rank = group_size_and_rank(self.process_group)[1]
            saved_by = self._saved.pop("rank", None)
            errors = any(set(state) - {"numel"} for state in saved)  # none when exact
            if errors and saved_by is not None and saved_by != rank:
                self._say_other_ranks_errors(rank, saved_by)
                return  # the errors stay zero
            for unit, state in zip(self._units, saved, strict=True):
                unit.load_state_dict(state)

    @staticmethod
    def _say_other_ranks_errors(rank: int, saved_by: int) -> None:
        log.warning(
            "onebit: rank %d resumes from a OneBitAdam state that rank %d saved in the "
            "compression stage: its error buffers are rank %d's (every rank's differ) and are "
            "not loaded; this rank's error feedback restarts from zero, so the run is not the "
            "uninterrupted one. Save every rank's optimizer.onebit_state_dict() and load each "
            "rank's own with load_onebit_state_dict() after load_state_dict() (the Lightning "
            "and Fabric strategies, onebit-run's Accelerate flag and Trainer patch do; "
            "examples/train_torchrun.py --ckpt-dir shows it in a plain loop)",
            rank, saved_by, saved_by)

    def _compression_step(self) -> None:
        """Every unit the DDP hook did not average during backward is folded and averaged here,
        now; the step is skipped on every rank if any unit came back non-finite."""
        averaged, self._averaged = self._averaged, {}
        handed, self._handed = self._handed, {}
        ok = True
        for unit in self.units:
            if unit in averaged:
                ok &= averaged[unit]
                continue
            for p in unit.params:
                if p in handed and not self._said_local_changed and _changed(p.grad, handed[p]):
                    self._say_local_changed()
            # Left encoded where the CPU update pass can decode it as it reads it.
            ok &= unit.reduce_(self.communicator, {p: p.grad for p in unit.params},
                               decode=False)
        if not ok:
            return self._skip()
        self._skip_streak = 0
        coef = self._clip_coef if self._clip_coef is not None and self._clip_coef < 1 else None
        # Some p.grad held local gradients (units left to step()) beside averaged momenta.
        mixed = bool(averaged) and len(averaged) < len(self.units)
        for unit in self.units:
            # The new momentum is in the fold buffer, or still encoded (decoded by the update's
            # pass, which copies it over the old one; the fold buffer then serves the torch
            # passes as scratch). What reads it as a tensor first has it decoded.
            if unit in averaged or coef is not None:
                unit.decode_()
                for p in unit.params:
                    new = unit.view(p, unit.local)
                    # The hook handed the average to DDP as p.grad (rounded to p.grad's dtype).
                    # If something changed it since (torch's clip_grad_norm_, say), p.grad is
                    # used, and said: the same change on every rank, as long as every p.grad
                    # held an average. Beside local gradients it is not, and ignored.
                    # Compared only when p.grad is not the bucket view the hook wrote last,
                    # or was written since (a pass over both: 8 ms per 6.5M values on one
                    # CPU thread, as much as the rest of the step's compression work).
                    if unit in averaged and p.grad is not None and \
                            (p not in handed or _changed(p.grad, handed[p])) and \
                            not torch.equal(p.grad, new.to(p.grad.dtype)):
                        if mixed:
                            if not self._said_mixed_changed:
                                self._say_mixed_changed()
                        else:
                            if not self._said_grad_changed:
                                self._say_grad_changed()
                            new.copy_(p.grad)
                    if coef is not None:
                        unit.clip_(p, new, coef)
        rows, counting = self._update_rows()
        if counting is None:
            self._steps.add_(1.0)
        else:  # some parameters of the units are not trainable now: their counts stay
            self._steps.index_add_(0, counting, torch.ones(counting.numel()))
        counts = self._steps.tolist()
        for group, params, index, units, exp_avgs, denoms in rows:
            frozen_update_(
                params, exp_avgs, denoms, [counts[i] for i in index], lr=group["lr"],
                beta1=group["betas"][0], weight_decay=group["weight_decay"],
                decoupled=group["decoupled_weight_decay"], bounded=self.bound_update,
                masters=([self._master(p, self.state[p]) for p in params]
                         if self.master_weights else None),
                averaged=[u.averaged(p) for u, p in zip(units, params, strict=True)])

    def _update_rows(self) -> tuple[list, torch.Tensor | None]:
        """Per parameter group with trainable parameters: the group, its trainable parameters,
        their step counters' places in ``_steps``, units, momenta and denominators; and the
        places of the counters that count this step (None: all). Made again when the trainable
        parameters change (one of them frozen since, say)."""
        trainable = tuple(map(id, self._trainable()))
        if self._rows is None or self._rows[0] != trainable:
            rows = []
            for group in self.param_groups:
                params = [p for p in group["params"] if p.requires_grad]
                if params:
                    units = [self._unit_of[p] for p in params]
                    rows.append((group, params, [self._step_index[p] for p in params], units,
                                 [u.view(p) for u, p in zip(units, params, strict=True)],
                                 [u.view(p, u.denom) for u, p in zip(units, params,
                                                                       strict=True)]))
            counting = [i for row in rows for i in row[2]]
            self._rows = (trainable, rows, None if len(counting) == self._steps.numel() else
                          torch.tensor(counting, dtype=torch.int64))
        return self._rows[1:]

    # ---------------------------------------------------------------------------- state dict
    def state_dict(self) -> dict:
        """Adam's state (``step``, ``exp_avg``, ``exp_avg_sq`` per param, fp32) plus the
        ``onebit`` entry of :meth:`onebit_state_dict` (this rank's)."""
        sd = super().state_dict()
        sd["onebit"] = self.onebit_state_dict()
        return sd

    def onebit_state_dict(self) -> dict:
        """What Adam's state does not hold: the stage, the switch step, byte counters and this
        rank's error buffers, per momentum unit. Errors differ between ranks: each rank must
        save its own (the Lightning strategy and the Accelerate flag do)."""
        units = ([u.state_dict() for u in self._units] if self._units is not None
                 else self._saved.get("units"))
        return {"global_step": self.global_step, "freeze_step": self.freeze_step,
                "auto_freeze": (self.auto_freeze.state_dict()
                                if self.auto_freeze is not None and self.switch_step is None
                                else None),
                "switch_step": self.switch_step, "skipped_steps": self.skipped_steps,
                "world_size": self.world_size,
                "rank": group_size_and_rank(self.process_group)[1],
                "unit_cap_bytes": self._unit_cap_bytes,
                "warmup_counts": (self._warmup_sent, self._warmup_dense),
                "clip_bytes": self._clip_sent, "clipping": self._norm_sketch is not None,
                "compression_counts": self._compression_counts(), "units": units}

    def load_state_dict(self, state_dict: dict) -> None:
        onebit = state_dict.get("onebit")
        # torch casts loaded state to each param's dtype; keep our fp32 state fp32.
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        own = [p for g in self.param_groups for p in g["params"]]
        fp32 = {
            p: {k: v for k, v in state_dict["state"].get(i, {}).items() if torch.is_tensor(v)}
            for i, p in zip(saved_ids, own, strict=False)
        }
        super().load_state_dict(state_dict)
        if not self.master_weights and any("master" in t for t in fp32.values()):
            # A stale master would come back, overwriting every update since, the day this
            # state is loaded with master_weights=True: dropped, and said.
            log.warning("onebit: the checkpoint holds fp32 master copies of low-precision "
                        "parameters, this OneBitAdam has master_weights=False: they are dropped "
                        "and the parameters continue from their own (rounded) values")
            for tensors in fp32.values():
                tensors.pop("master", None)
            for p in fp32:
                self.state[p].pop("master", None)
        for p, tensors in fp32.items():
            for k, v in tensors.items():
                # Step counters stay on the CPU (as torch's Adam keeps them), so that reading
                # them never syncs with a GPU, whatever map_location loaded them to;
                # frozen_step is a number (a tensor in checkpoints of 0.x).
                self.state[p][k] = (float(v) if k == "frozen_step" else
                                    v.to(device="cpu" if k == "step" else p.device, copy=True))
        self._units, self._unit_of, self._averaged = None, {}, {}  # rebuilt from the new state
        self._steps = self._rows = None
        self._handed = {}
        self._settings_checked = False
        if onebit is not None:
            self.load_onebit_state_dict(onebit)

    def load_onebit_state_dict(self, onebit: dict) -> None:
        """Load an :meth:`onebit_state_dict` (after Adam's state is in place): also how a rank
        puts back its own error buffers when the rest came from rank 0's checkpoint."""
        if "units" not in onebit:
            raise ValueError("this OneBitAdam state was saved by an older onebit-plugin "
                             "(no momentum units); resume it with that version")
        saved_world = onebit["world_size"]
        if onebit["switch_step"] is not None and saved_world != self.world_size:
            raise ValueError(
                f"this OneBitAdam state was saved in the compression stage by {saved_world} "
                f"ranks and is loaded by {self.world_size}: its error buffers are sharded per "
                "rank; resume with the same world size"
            )
        if onebit["freeze_step"] != self.freeze_step:
            log.warning(
                "onebit: the checkpoint has freeze_step=%s, this optimizer %s: %s",
                onebit["freeze_step"], self.freeze_step,
                f"it is ignored, the variance was frozen after step {onebit['switch_step']}"
                if onebit["switch_step"] is not None else "the new value applies")
        self.global_step = int(onebit["global_step"])
        self.switch_step = onebit["switch_step"]
        auto = onebit.get("auto_freeze")
        if self.auto_freeze is not None and auto is not None:  # resumed mid warm-up
            self.auto_freeze.load_state_dict(auto, [p.device for p in self._trainable()])
        self.skipped_steps = int(onebit["skipped_steps"])
        self._warmup_sent, self._warmup_dense = onebit["warmup_counts"]
        self._clip_sent = int(onebit.get("clip_bytes", 0))  # absent before 2026-12-01
        if onebit.get("clipping"):  # so that the hook sketches the first resumed step too
            self._start_sketching()
        self._comm = None
        self._saved = {"counts": tuple(onebit["compression_counts"])}
        if onebit["units"] is not None:
            # Whose errors they are is checked when the units take them (_build_units): the
            # integrations load rank 0's whole state first, then each rank's own errors.
            self._saved.update(units=onebit["units"], unit_cap_bytes=onebit["unit_cap_bytes"],
                               rank=onebit.get("rank"))  # absent in states saved before this field
        self._units, self._unit_of, self._averaged, self._handed = None, {}, {}, {}
        self._steps = self._rows = None
        self._settings_checked = False

    def __getstate__(self) -> dict:
        # torch's Optimizer pickles only defaults, state and param_groups; keep ours too, less
        # the process groups (an unpickled optimizer runs on the default group).
        return {**self.__dict__, "process_group": None, "_comm_group": None,
                "_group_ready": False}


SUPPORTED_SETUPS = (
    "plain torch.distributed (OneBitAdam averages by itself), DDP with register_onebit_hook, "
    "Lightning strategy='onebit_adam', Accelerate with ONEBIT_ADAM=1"
)


def _changed(grad: torch.Tensor | None, handed: tuple[int, int]) -> bool:
    """Whether ``grad`` is no longer the bucket view the DDP hook handed over, or was written
    since (any in-place op on a view of the bucket counts; one through ``.data`` does not).
    None is not a change: DDP leaves the gradient of a parameter no rank used None (with
    ``find_unused_parameters``), and the fold takes a missing gradient as zero."""
    return grad is not None and (grad.data_ptr(), grad._version) != handed


def _reject_sharded(params: list[torch.Tensor]) -> None:
    """FSDP and DeepSpeed ZeRO hand the optimizer shards of parameters; OneBitAdam averages
    whole momenta across data-parallel ranks and would silently mix unrelated shards."""
    for p in params:
        kind = None
        if type(p).__name__ == "DTensor" or hasattr(p, "_local_tensor"):
            kind = "FSDP2/DTensor-sharded"
        elif getattr(p, "_is_flat_param", False) or hasattr(p, "_fsdp_flattened"):
            kind = "FSDP-flattened"
        elif hasattr(p, "ds_id") or hasattr(p, "ds_tensor"):
            kind = "DeepSpeed ZeRO-partitioned"
        if kind is not None:
            raise ValueError(f"OneBitAdam got {kind} parameters; it supports unsharded data "
                             f"parallelism only: {SUPPORTED_SETUPS}")


WATCHDOG_MARGIN = timedelta(seconds=30)


def negligible_root(roots: list[torch.Tensor]) -> float:
    """NEGLIGIBLE_VARIANCE of the rms of ``roots`` (every trainable coordinate's sqrt(v_hat))."""
    # In pieces of 64K values: a float64 sum of one fp32 tensor of 6.5M values measured
    # 48-51 ms on one CPU thread, of its 64K-value pieces 5 ms (torch 2.13; the same to 1e-15).
    total = sum(float(piece.square().sum(dtype=torch.float64))
                for r in roots for piece in r.reshape(-1).split(1 << 16))
    count = sum(r.numel() for r in roots)
    return NEGLIGIBLE_VARIANCE * math.sqrt(total / max(count, 1))


def _new_group(group: dist.ProcessGroup | None, timeout: timedelta | None) -> dist.ProcessGroup:
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    if timeout is not None and dist.get_backend(group) == "nccl":
        # gloo ends a stuck collective at the group's timeout; NCCL's watchdog instead ends the
        # *process* at it (TORCH_NCCL_ASYNC_ERROR_HANDLING's default). Every wait here passes
        # comm_timeout itself (an NCCL wait with a timeout blocks and raises), so the watchdog
        # gets twice that, at least 30 s more: CommunicationError comes first, then the group is
        # aborted (wait_collectives).
        timeout = timeout + max(timeout, WATCHDOG_MARGIN)
    return dist.new_group(ranks=ranks, timeout=timeout)


def _chunks(sizes: list[int], head: int, cap: int) -> list[tuple[int, int, int, int]]:
    """``(start, end, lo, hi)`` per chunk of a flat buffer holding ``head`` values, then tensors
    of ``sizes`` values back to back: values ``start:end``, tensors ``lo:hi``. Cut between
    tensors after about ``cap`` values (a larger tensor is a chunk of its own); the first chunk
    holds the head."""
    out, start, end, lo = [], 0, head, 0
    for i, n in enumerate(sizes):
        if i > lo and end - start + n > cap:
            out.append((start, end, lo, i))
            start, lo = end, i
        end += n
    out.append((start, end, lo, len(sizes)))
    return out


def _param_fingerprints(params: list[torch.Tensor]) -> torch.Tensor:
    """Per parameter, the sum of its values' bit patterns as integers (int64, wrapping), on the
    CPU: equal on two ranks when the values are, whatever the order or the number of threads
    that summed them (a float sum's rounding depends on both)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    sums = [p.detach().reshape(-1).view(ints.get(p.element_size(), torch.uint8))
            .sum(dtype=torch.int64) for p in params]
    return torch.stack(sums).cpu() if sums else torch.zeros(0, dtype=torch.int64)


def _ring_bytes(nbytes: int, world: int) -> int:
    return math.ceil(2 * (world - 1) / world * nbytes)


def _check_hparams(lr, betas, eps, weight_decay) -> None:
    # lr = 0 is allowed, as in torch's Adam: a warm-up LR schedule starts there.
    if not isinstance(lr, float | int) or not lr >= 0:
        raise ValueError(f"lr must be >= 0, got {lr!r}")
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for name, b in zip(("betas[0]", "betas[1]"), betas, strict=True):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {b!r}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
