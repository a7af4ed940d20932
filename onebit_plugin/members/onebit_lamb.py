"""OneBitLamb: 1-bit LAMB (Li et al., 2021), a member of the 1-bit family for large-batch
training, with DeepSpeed's ``OnebitLamb`` argument names.

LAMB on exactly averaged gradients during the warm-up (``freeze_step`` steps, or ``"auto"``),
with a running average of each parameter's trust ratio; then the variance freezes, the momentum
is exchanged with the 1-bit allreduce and error feedback on the shared momentum units, and each
parameter's trust ratio is the frozen average times a factor from the frozen and a fresh
variance (``onebit_plugin.maths.lamb_update``).

DeepSpeed scaled every tensor's momentum to one common scale before compressing it (one scale
for the whole flattened buffer, so small-momentum layers were not swamped). Here each
coordinate is: every rank sends ``m / denom``, its momentum over the frozen denominator (the
scale of its own step), clamped to +-3 before compression where ``bound_update`` is on, and the
average comes back times the denominator (``onebit_plugin.core.policy.OverDenominator`` says why and
what it measured).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Unpack

import torch
import torch.distributed as dist

from onebit_plugin.core.base import OneBitOptimizer
from onebit_plugin.core.policy import ExactMomentum, OneBitMomentum, OverDenominator, Policy
from onebit_plugin.maths.lamb_update import frozen_lamb_update_, lamb_update_
from onebit_plugin.settings.config import FamilyOptions, check_hparams, member_config

__all__ = ["LambPolicy", "OneBitLamb"]


class LambPolicy(Policy):
    """1-bit LAMB's decisions: LAMB during the warm-up, then LAMB over the frozen variance with
    the trust ratio frozen and scaled (module docstring)."""

    keeps_variance = False
    # freeze_step="auto" at 15% of the run at the latest: 1-bit LAMB's authors froze their
    # tuned BERT runs at step 1,000 of about 7,000 (14%; DeepSpeed's tutorial configs). At 20%
    # the whole run sends 4.4x fewer bytes than LAMB's, at 15% 5.6x; on the large-batch
    # workload the loss did not suffer (docs/benchmarks.md, "1-bit LAMB, large batch").
    auto_ceiling = 0.15

    #: FSDP2's shards (``comm.shards``), when the optimizer steps them: the trust ratio is
    #: ||w|| / ||update|| of each whole parameter, its shards' norms summed over the host
    #: (else each rank of a host would take its shard's ratio: another optimizer per rank).
    host = None

    def use_shards(self, shards) -> None:
        self.host = shards

    def warmup_update_(self, group, params, states, masters) -> None:
        counts = [state["step"] for state in states]
        torch._foreach_add_(counts, 1.0)
        ratios = lamb_update_(
            params, [p.grad for p in params], [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states], [c.item() for c in counts], lr=group["lr"],
            beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
            weight_decay=group["weight_decay"], max_coeff=group["max_coeff"],
            min_coeff=group["min_coeff"], masters=masters, host=self.host)
        beta = group["coeff_beta"]
        for state, ratio in zip(states, ratios, strict=True):
            state["last_ratio"] = ratio
            state.setdefault("lamb_coeff", 0.0)
            state.setdefault("lamb_coeff_weight", 0.0)
            state.setdefault("last_factor", 1.0)
            # As DeepSpeed's: a ratio of exactly 1 (a norm was 0) does not enter the average.
            if ratio != 1.0:
                state["lamb_coeff"] = beta * state["lamb_coeff"] + (1 - beta) * ratio
                # 1 - beta**k after k ratios: the average's bias correction (below).
                state["lamb_coeff_weight"] = beta * state["lamb_coeff_weight"] + (1 - beta)

    def freeze_(self, state: dict) -> None:
        # The fresh variance starts from the frozen one; the frozen one becomes the denominator.
        state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()
        # The average started from 0: divided by 1 - beta**k, a warm-up shorter than
        # 1 / (1 - coeff_beta) steps does not freeze a ratio biased towards 0 (DeepSpeed froze
        # the raw average, 41% of the ratio after 5 steps at 0.9). No ratio yet: 1.
        weight = state.pop("lamb_coeff_weight", 0.0)
        state["lamb_coeff"] = state.get("lamb_coeff", 0.0) / weight if weight else 1.0
        state.setdefault("last_factor", 1.0)

    def compression_update_(self, group, params, exp_avgs, denoms, counts, *, bound, masters,
                            averaged, states) -> None:
        # The exchange bounds what each rank sends (OverDenominator): the base passes no bound.
        assert bound is None, bound
        factors = frozen_lamb_update_(
            params, exp_avgs, denoms, [s["exp_avg_sq_fresh"] for s in states], counts,
            averaged=averaged, lr=group["lr"], beta1=group["betas"][0],
            beta2=group["betas"][1], eps=group["eps"], weight_decay=group["weight_decay"],
            coeffs=[s["lamb_coeff"] for s in states],
            last_factors=[s["last_factor"] for s in states], factor_min=group["factor_min"],
            factor_max=group["factor_max"], factor_threshold=group["factor_threshold"],
            masters=masters, host=self.host)
        for state, factor in zip(states, factors, strict=True):
            state["last_factor"] = factor
            state["last_ratio"] = state["lamb_coeff"] * factor


def _check_lamb(max_coeff, min_coeff, coeff_beta, factor_max, factor_min, factor_threshold
                ) -> None:
    if not 0 < min_coeff <= max_coeff:
        raise ValueError(f"OneBitLamb needs 0 < min_coeff <= max_coeff, got min_coeff="
                         f"{min_coeff!r}, max_coeff={max_coeff!r}")
    if not 0 <= coeff_beta < 1:
        raise ValueError(f"coeff_beta must be in [0, 1), got {coeff_beta!r}")
    if not 0 < factor_min <= 1 <= factor_max:
        raise ValueError(f"OneBitLamb needs 0 < factor_min <= 1 <= factor_max, got "
                         f"factor_min={factor_min!r}, factor_max={factor_max!r}")
    if not 0 <= factor_threshold < 1:
        raise ValueError(f"factor_threshold must be in [0, 1), got {factor_threshold!r}")


class OneBitLamb(OneBitOptimizer):
    """1-bit LAMB as a ``torch.optim.Optimizer``, with DeepSpeed's ``OnebitLamb`` argument names
    (module docstring; docs/usage.md, "1-bit LAMB").

    Use it like ``OneBitAdam``: in every process of a data-parallel job, with or without DDP
    (:func:`onebit_plugin.register_onebit_hook`).

    Args:
        params, lr, betas, eps: as for ``torch.optim.Adam``; Adam's bias corrections apply.
        weight_decay: LAMB's: ``weight_decay * p`` is added to the update before the trust
            ratio is taken.
        freeze_step: warm-up steps (uncompressed LAMB), or ``"auto"`` as for ``OneBitAdam``
            but at 15% of ``total_steps`` at the latest (``LambPolicy.auto_ceiling``).
        max_coeff, min_coeff: the trust ratio's bounds (10.0, 0.01).
        coeff_beta: the running average of the trust ratio over the warm-up (0.9), bias-corrected
            at the freeze (DeepSpeed's was not, which biased short warm-ups towards 0).
        factor_max, factor_min: the bounds of the compression stage's factor (4.0, 0.5).
        factor_threshold: the factor's largest relative change per step (0.1).

    The family's options (``OneBitAdam``'s docstring): ``total_steps``, ``max_block``,
    ``scale``, ``mask_zero_variance``, ``masks``, ``process_group``, ``average_grads``,
    ``compress_momentum``, ``bound_update`` (in the compression stage each rank's ``m / denom``
    is clamped to +-3 before it is sent, ``onebit_plugin.core.policy.OverDenominator``),
    ``comm_timeout``, ``bucket_cap_mb``, ``max_skipped_steps``, ``master_weights``,
    ``error_dtype``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int | str | None = None,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        *,
        masks: dict[torch.Tensor, torch.Tensor] | None = None,
        process_group: dist.ProcessGroup | None = None,
        **options: Unpack[FamilyOptions],
    ):
        check_hparams(lr, betas, eps, weight_decay)
        _check_lamb(max_coeff, min_coeff, coeff_beta, factor_max, factor_min, factor_threshold)
        config = member_config(type(self), freeze_step, options, refused={
            "decoupled_weight_decay": "1-bit LAMB's weight decay is always LAMB's, added to "
                                      "the update inside the trust ratio",
            "refresh_interval": "1-bit LAMB's frozen variance has no refreshes (its fresh "
                                "variance for the trust ratio costs no exchange)",
            "follow_variance": "1-bit LAMB follows the variance its own way: its fresh "
                               "variance sets the trust ratio's factor"})
        # decoupled_weight_decay: the fold of a local gradient into the momentum leaves the
        # decay out; LAMB adds it to the update itself.
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=True, max_coeff=max_coeff,
                        min_coeff=min_coeff, coeff_beta=coeff_beta, factor_max=factor_max,
                        factor_min=factor_min, factor_threshold=factor_threshold)
        exchange = OneBitMomentum() if config.compress_momentum else ExactMomentum()
        exchange = OverDenominator(exchange, bound=config.bound_update)
        super().__init__(params, defaults, config, LambPolicy(exchange), masks=masks,
                         process_group=process_group)

    def switch_message(self) -> str | None:
        message = super().switch_message()
        return None if message is None else message.replace("Adam variance", "LAMB variance")

    def lamb_coeffs(self) -> list[float]:
        """The trust ratio each trainable parameter took at the last step, in parameter order
        (DeepSpeed's ``get_lamb_coeffs``): LAMB's own in warm-up, the frozen average times the
        factor in the compression stage (``state[p]["lamb_coeff"]`` holds the average); 1.0
        for a parameter not stepped yet."""
        return [float(self.state[p].get("last_ratio", 1.0)) for p in self.trainable()]
