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


def trust_ratio(p: torch.Tensor, u: torch.Tensor, *, max_coeff: float, min_coeff: float
                ) -> float:
    """LAMB's ``||p|| / ||u||`` clipped to ``[min_coeff, max_coeff]``; 1 where either norm is 0
    (a parameter with no elements, a zero parameter, a zero update)."""
    weight = float(torch.linalg.vector_norm(p))
    update = float(torch.linalg.vector_norm(u))
    if weight == 0 or update == 0 or not math.isfinite(weight / update):
        return 1.0
    return min(max(weight / update, min_coeff), max_coeff)


def lamb_update_(params, grads, exp_avgs, exp_avg_sqs, steps: list[float], *, lr: float,
                 beta1: float, beta2: float, eps: float, weight_decay: float, max_coeff: float,
                 min_coeff: float, masters=None) -> list[float]:
    """One LAMB step of one parameter group (module docstring), each parameter at its own
    ``steps`` count (from 1, this step included). Returns the trust ratio each parameter took."""
    masters = masters or [None] * len(params)
    ratios = []
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
        ratio = trust_ratio(p, u, max_coeff=max_coeff, min_coeff=min_coeff)
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
    factor = float((denom / fresh_denom).max())
    if weight_decay != 0:
        whole = float(torch.linalg.vector_norm(u))
        share = min(1.0, float(torch.linalg.vector_norm(u_adam)) / whole) if whole else 1.0
        factor = factor * share + (1.0 - share)
    if not math.isfinite(factor):
        factor = last
    factor = min(max(factor, factor_min), factor_max)
    return min(max(factor, last * (1.0 - factor_threshold)), last * (1.0 + factor_threshold))


def frozen_lamb_update_(params, exp_avgs, denoms, fresh_variances, steps: list[float], *,
                        averaged, lr: float, beta1: float, beta2: float, eps: float,
                        weight_decay: float, coeffs: list[float], last_factors: list[float],
                        factor_min: float, factor_max: float, factor_threshold: float,
                        masters=None) -> list[float]:
    """The compression stage's LAMB step of one parameter group: each averaged momentum
    (``averaged``: tensors, or parts still encoded) rebuilds a gradient against the momentum it
    replaces (``exp_avgs``, which then take it), that gradient updates the fresh variance, and
    the parameter moves by ``lr * coeff * factor * u`` over the frozen ``denoms``. No bound here:
    1-bit LAMB bounds what each rank sends, ``m / denom`` clamped before compression
    (``policy.OverDenominator``, which says why). Returns each parameter's factor (the next
    step's ``last_factors``)."""
    masters = masters or [None] * len(params)
    factors = []
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
        factor = lamb_factor(denom, fresh_denom, u_adam, u, weight_decay=weight_decay,
                             last=last_factors[i], factor_min=factor_min,
                             factor_max=factor_max, factor_threshold=factor_threshold)
        p.add_(u, alpha=-lr * coeffs[i] * factor)
        _write_back(param, p)
        factors.append(factor)
    return factors
