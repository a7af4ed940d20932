"""1-bit LAMB's pure update functions (Li et al., "1-bit LAMB: Communication Efficient
Large-Scale Large-Batch Training with LAMB's Convergence Speed", 2021), in the manner of
``onebit_plugin.maths.update``: fp32 state, a bf16/fp16 parameter stepped through its fp32 master
copy
or an fp32 copy rounded once.

LAMB (You et al., 2020) moves each parameter by ``lr * ratio * u``, with ``u`` Adam's update
``m_hat / (sqrt(v_hat) + eps)`` plus ``weight_decay * p``, and the trust ratio
``||p|| / ||u||`` clipped to ``[min_coeff, max_coeff]`` (1 where either norm is 0): a layer moves
by a fraction of its own size, whatever the scale of its gradients. Adam's bias corrections apply
(DeepSpeed's ``OnebitLamb`` took ``bias_correction`` and ignored it); the trust ratio cancels the
momentum's, so it only weighs the weight decay term early on.

In the compression stage the variance is frozen, so the ratio cannot be computed from the fresh
one: ``frozen_lamb_update_`` scales the ratio averaged over the warm-up (``coeff``) by how much
the variance has moved since, ``max(denom / fresh_denom)`` over the tensor, from a fresh variance
rebuilt from two consecutive averaged momenta (``g = (m_t - b1 * m_(t-1)) / (1 - b1)``), clipped
to ``[factor_min, factor_max]`` and to ``factor_threshold`` relative change per step.
"""

from __future__ import annotations

import math

import torch

from onebit_plugin.maths.update import _fp32_param, _write_back
from onebit_plugin.wire.deferred import Encoded, as_fp32

__all__ = ["frozen_lamb_update_", "lamb_factor", "lamb_update_", "trust_ratio"]


def _clipped_ratio(weight: float, update: float, max_coeff: float, min_coeff: float) -> float:
    if weight == 0 or update == 0 or not math.isfinite(weight / update):
        return 1.0
    return min(max(weight / update, min_coeff), max_coeff)


def trust_ratio(p: torch.Tensor, u: torch.Tensor, *, max_coeff: float, min_coeff: float
                ) -> float:
    """LAMB's ``||p|| / ||u||`` clipped to ``[min_coeff, max_coeff]``; 1 where either norm is 0
    (a parameter with no elements, a zero parameter, a zero update)."""
    return _clipped_ratio(float(torch.linalg.vector_norm(p)), float(torch.linalg.vector_norm(u)),
                          max_coeff, min_coeff)


def _squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32).square()
                        for t in tensors])


def lamb_update_(params, grads, exp_avgs, exp_avg_sqs, steps: list[float], *, lr: float,
                 beta1: float, beta2: float, eps: float, weight_decay: float, max_coeff: float,
                 min_coeff: float, masters=None, host=None) -> list[float]:
    """One LAMB step of one parameter group (module docstring), each parameter at its own
    ``steps`` count (from 1, this step included). Returns the trust ratio each parameter took.
    ``host``: FSDP2's shards (``comm.shards.Shards``): each parameter is a shard, and its norms
    are the whole parameter's, the shards' squares summed over the host in one collective once
    every update is made."""
    masters = masters or [None] * len(params)
    ratios, pending = [], []
    for param, grad, m, v, step, master in zip(params, grads, exp_avgs, exp_avg_sqs, steps,
                                                masters, strict=True):
        p = _fp32_param(param, master)
        g = as_fp32(grad)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = v.sqrt().div_((1 - beta2**step) ** 0.5).add_(eps)
        u = (m / (1 - beta1**step)).div_(denom)
        if weight_decay != 0:
            u.add_(p, alpha=weight_decay)
        if host is not None:
            pending.append((param, p, u))
            continue
        ratio = trust_ratio(p, u, max_coeff=max_coeff, min_coeff=min_coeff)
        p.add_(u, alpha=-lr * ratio)
        _write_back(param, p)
        ratios.append(ratio)
    if pending:
        norms = host.sum_over_host_(torch.stack([_squares([p for _, p, _ in pending]),
                                                 _squares([u for _, _, u in pending])]))
        for (param, p, u), weight, update in zip(pending, *norms.sqrt().tolist(), strict=True):
            ratio = _clipped_ratio(weight, update, max_coeff, min_coeff)
            p.add_(u, alpha=-lr * ratio)
            _write_back(param, p)
            ratios.append(ratio)
    return ratios


def lamb_factor(denom: torch.Tensor, fresh_denom: torch.Tensor, u_adam: torch.Tensor,
                u: torch.Tensor, *, weight_decay: float, last: float, factor_min: float,
                factor_max: float, factor_threshold: float) -> float:
    """The compression stage's scaling of the frozen trust ratio: ``max(denom / fresh_denom)``
    (how much smaller the fresh variance's step size divisor got), diluted by the weight-decay
    share of the update, clipped to ``[factor_min, factor_max]`` and to ``factor_threshold`` of
    the ``last`` factor; 1 for a parameter with no elements."""
    if denom.numel() == 0:
        return 1.0
    return _factor_from(float((denom / fresh_denom).max()),
                        float(torch.linalg.vector_norm(u)) if weight_decay != 0 else 0.0,
                        float(torch.linalg.vector_norm(u_adam)) if weight_decay != 0 else 0.0,
                        weight_decay=weight_decay, last=last, factor_min=factor_min,
                        factor_max=factor_max, factor_threshold=factor_threshold)


def _factor_from(factor: float, whole: float, adam: float, *, weight_decay: float, last: float,
                 factor_min: float, factor_max: float, factor_threshold: float) -> float:
    """:func:`lamb_factor` from its three numbers: ``max(denom / fresh_denom)``, ``||u||`` and
    ``||u_adam||``."""
    if weight_decay != 0:
        share = min(1.0, adam / whole) if whole else 1.0
        factor = factor * share + (1.0 - share)
    if not math.isfinite(factor):
        factor = last
    factor = min(max(factor, factor_min), factor_max)
    return min(max(factor, last * (1.0 - factor_threshold)), last * (1.0 + factor_threshold))


def frozen_lamb_update_(params, exp_avgs, denoms, fresh_variances, steps: list[float], *,
                        averaged, lr: float, beta1: float, beta2: float, eps: float,
                        weight_decay: float, coeffs: list[float], last_factors: list[float],
                        factor_min: float, factor_max: float, factor_threshold: float,
                        masters=None, host=None) -> list[float]:
    """The compression stage's LAMB step of one parameter group: each averaged momentum
    (``averaged``: tensors, or parts still encoded) rebuilds a gradient against the momentum it
    replaces (``exp_avgs``, which then take it), that gradient updates the fresh variance, and
    the parameter moves by ``lr * coeff * factor * u`` over the frozen ``denoms``. No bound here:
    1-bit LAMB bounds what each rank sends, ``m / denom`` clamped before compression
    (``policy.OverDenominator``, which says why). Returns each parameter's factor (the next
    step's ``last_factors``). ``host``: as :func:`lamb_update_`'s; the largest ratio is the
    whole parameter's (the shards' maximum over the host), the norms too."""
    masters = masters or [None] * len(params)
    factors, pending = [], []
    for i, (param, m, denom, fresh, step) in enumerate(zip(params, exp_avgs, denoms,
                                                           fresh_variances, steps, strict=True)):
        new = averaged[i]
        if isinstance(new, Encoded):  # decoded into a temporary of this parameter's size
            out = torch.empty(new.numel, dtype=torch.float32, device=m.device)
            new.decode_into(out)
            new = out.view_as(m)
        g = (new - m * beta1).div_(1 - beta1)
        fresh.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        m.copy_(new)
        p = _fp32_param(param, masters[i])
        u_adam = (m / (1 - beta1**step)).div_(denom)
        u = u_adam.add(p, alpha=weight_decay) if weight_decay != 0 else u_adam
        fresh_denom = fresh.sqrt().div_((1 - beta2**step) ** 0.5).add_(eps)
        if host is not None:  # an empty shard's largest ratio: -inf, under any other's
            largest = (denom / fresh_denom).max() if denom.numel() else \
                torch.tensor(-math.inf, device=denom.device)
            pending.append((i, param, p, u, largest, u_adam))
            continue
        factor = lamb_factor(denom, fresh_denom, u_adam, u, weight_decay=weight_decay,
                             last=last_factors[i], factor_min=factor_min,
                             factor_max=factor_max, factor_threshold=factor_threshold)
        p.add_(u, alpha=-lr * coeffs[i] * factor)
        _write_back(param, p)
        factors.append(factor)
    if pending:
        largest = host.max_over_host_(torch.stack([row[4] for row in pending]))
        norms = host.sum_over_host_(torch.stack([_squares([row[3] for row in pending]),
                                                 _squares([row[5] for row in pending])]))
        for (i, param, p, u, _, _), top, whole, adam in zip(
                pending, largest.tolist(), *norms.sqrt().tolist(), strict=True):
            factor = 1.0 if top == -math.inf else _factor_from(
                top, whole, adam, weight_decay=weight_decay, last=last_factors[i],
                factor_min=factor_min, factor_max=factor_max,
                factor_threshold=factor_threshold)
            p.add_(u, alpha=-lr * coeffs[i] * factor)
            _write_back(param, p)
            factors.append(factor)
    return factors
