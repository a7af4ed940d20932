"""OneBitAdam: Adam during warm-up, then frozen-variance Adam with a 1-bit momentum allreduce.

Warm-up (steps ``1..freeze_step``) is ``torch.optim.Adam`` -- or ``AdamW`` with
``decoupled_weight_decay=True`` -- operation for operation, on gradients averaged across ranks.
At the end of step ``freeze_step`` the variance stops changing; ``V = sqrt(v_hat) + eps`` is then
a fixed linear preconditioner, which is what lets error feedback cancel the compression error
(Tang et al., 2021, Theorem 1). From then on each rank folds its *local* gradient into the
momentum, the momentum units are averaged by the communicator (1-bit, or exact with
``compress_momentum=False``) and every rank applies the same update.

A thin member of the family: the base (``onebit_plugin.core.base``) runs every step, the policy
(``onebit_plugin.core.policy.AdamPolicy``) says what Adam does in it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Unpack

import torch
import torch.distributed as dist

from onebit_plugin.core.base import COMPRESSION, WARMUP, OneBitOptimizer
from onebit_plugin.core.policy import AdamPolicy, ExactMomentum, OneBitMomentum
from onebit_plugin.maths.masks import NEGLIGIBLE_VARIANCE, negligible_root
from onebit_plugin.settings.config import FamilyOptions, check_hparams, member_config

__all__ = ["COMPRESSION", "NEGLIGIBLE_VARIANCE", "WARMUP", "OneBitAdam", "negligible_root"]


class OneBitAdam(OneBitOptimizer):
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
            ``"auto"``: frozen once the variance has settled (``onebit_plugin.maths.freeze``), at
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
        process_group: group to average over (default: the world, when initialised); FSDP2
            shards: the ranks holding this shard on other hosts, ``mesh["replicate"]
            .get_group()`` (docs/usage.md, "Sharded models (FSDP2, HSDP)").
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
        follow_variance: True (default): after the freeze each block of 2,048 values keeps its
            frozen denominator's coordinates in place but follows the block's scale, read from
            2-value sketches of the gradients on every 4th step (1/128 bit per value a step;
            ``onebit_plugin.core.variance_follow``). False: the paper's frozen variance.
        refresh_interval: None (default): no full-precision refreshes after the warm-up. ``N``:
            every compression-stage step ``t`` with ``t % N == 0`` refreshes it instead of
            sending 1-bit momentum: the gradients are averaged in ``warmup_bits`` bits (as in
            the warm-up, with the DDP hook or without), the momentum and the variance take
            them (the variance weighing them as the steps since it last changed) and the
            denominator follows. Costs ``exp_avg_sq`` kept (4 bytes per value) and a warm-up
            step's bytes every ``N`` steps (docs/usage.md, "A variance that follows").
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
        decoupled_weight_decay: bool = False,
        masks: dict[torch.Tensor, torch.Tensor] | None = None,
        process_group: dist.ProcessGroup | None = None,
        **options: Unpack[FamilyOptions],
    ):
        check_hparams(lr, betas, eps, weight_decay)
        config = member_config(type(self), freeze_step, options)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=decoupled_weight_decay)
        exchange = OneBitMomentum() if config.compress_momentum else ExactMomentum()
        super().__init__(params, defaults, config,
                         AdamPolicy(exchange, config.refresh_interval, config.follow_variance),
                         masks=masks,
                         process_group=process_group)
