"""The three pure update functions of 1-bit Adam, in the manner of torchao's optimizers.

Whoever runs a step imports them from here: ``OneBitAdam.step()`` (warm-up and frozen update) and
the momentum units (the fold, in ``step()`` without DDP or inside backward with the DDP hook).
One fp32 pattern throughout: optimizer state is fp32; a bf16/fp16 parameter or gradient is
read through an fp32 copy and the parameter is rounded back once per step. With ``master`` (an
fp32 copy of a bf16/fp16 parameter kept in the optimizer state) the step updates the master and
the parameter is its rounding: updates smaller than half a bf16 ulp (1/256 of the value) add up
instead of being rounded away every step.
"""

from __future__ import annotations

import logging

import torch

from onebit_plugin.wire.deferred import Encoded, as_fp32
from onebit_plugin.wire.dispatch import cpu_kernel, fits_cpu_kernel

__all__ = ["adam_update_", "clip_folded_", "corrected_root", "frozen_denominator",
           "frozen_update_", "say_if_rounded_away"]

log = logging.getLogger("onebit_plugin")


def say_if_rounded_away(params: list[torch.Tensor], master_weights: bool) -> None:
    """Said at construction: bf16/fp16 parameters without an fp32 master copy lose every update
    below half an ulp of their value."""
    low = [p for p in params if p.dtype in (torch.bfloat16, torch.float16)]
    if low and not master_weights:
        log.warning("onebit: %d parameter tensors are %s without master_weights=True: an "
                    "update smaller than half an ulp of the value (1/256 for bf16) is "
                    "rounded away at every step (measured: +0.4%% to +3.3%% validation loss "
                    "against fp32 parameters; within 0.3%% with master_weights=True)",
                    len(low), low[0].dtype)


def _write_back(param: torch.Tensor, p32: torch.Tensor) -> None:
    if p32 is not param:
        param.copy_(p32)


def _fp32_param(param: torch.Tensor, master: torch.Tensor | None) -> torch.Tensor:
    return master if master is not None else as_fp32(param)


# adam_update_ works through its tensors in runs of at most this many values (a larger tensor
# alone): its square roots are temporaries as large as the run, and the allocator hands freed
# memory back and faults it in again when many are alive at once. For cluster.py's 6.5M-value
# model (102 tensors, one thread) the square roots took 11-12 ms a step in runs of 2**22 values
# and 4.4-5.2 ms in runs of 2**14 to 2**20, as one tensor at a time does.
ADAM_RUN_VALUES = 1 << 18
# On a GPU the caching allocator keeps freed blocks, and a run of 2**18 values is about one
# tensor: a launch per operation per tensor, where torch's foreach Adam needs about ten for a
# group. Runs of 2**26 values there: temporaries of at most 256 MiB (not measured on a GPU yet:
# benchmarks/gpu_check.py times the warm-up step against torch's Adam).
ADAM_RUN_VALUES_CUDA = 1 << 26


def adam_update_(
    params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor], steps: list[float], *, lr: float, beta1: float,
    beta2: float, eps: float, weight_decay: float, decoupled: bool,
    masters: list[torch.Tensor | None] | None = None,
) -> None:
    """One Adam/AdamW step of one parameter group (each parameter at its own ``steps`` count),
    the same operations in the same order as torch's single-tensor Adam, so fp32 results are
    bitwise equal; as foreach ops (one call per operation for a run of tensors instead of one
    per tensor: torch Adam's default on the CPU pays ~6 Python calls per parameter).
    ``steps``: each parameter's step number as a float, counted from 1 and including this
    step (the caller advances it, as torch's ``state["step"]``). ``masters``: fp32 master
    copies (or None) per parameter."""
    bad = [step for step in steps if not isinstance(step, (int, float)) or step < 1]
    if bad:
        raise ValueError(f"adam_update_: each step must be a number >= 1 (this step's count, "
                         f"from 1; a tensor count: pass .item()), got {bad[0]!r}")
    masters = masters or [None] * len(params)
    step_sizes = [-(lr / (1 - beta1**step)) for step in steps]
    roots = [(1 - beta2**step) ** 0.5 for step in steps]
    start = 0
    cap = ADAM_RUN_VALUES_CUDA if params and params[0].is_cuda else ADAM_RUN_VALUES
    while start < len(params):
        end, values = start + 1, params[start].numel()
        while end < len(params) and values + params[end].numel() <= cap:
            values += params[end].numel()
            end += 1
        # A bf16/fp16 parameter's fp32 copies are made per run too, not for the whole group.
        run = params[start:end]
        p = [_fp32_param(q, master) for q, master in zip(run, masters[start:end], strict=True)]
        g = [as_fp32(grad) for grad in grads[start:end]]
        m, v = exp_avgs[start:end], exp_avg_sqs[start:end]
        if weight_decay != 0:
            if decoupled:
                torch._foreach_mul_(p, 1 - lr * weight_decay)
            else:
                g = torch._foreach_add(g, p, alpha=weight_decay)
        torch._foreach_lerp_(m, g, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, value=1 - beta2)
        denoms = torch._foreach_sqrt(v)
        torch._foreach_div_(denoms, roots[start:end])
        torch._foreach_add_(denoms, eps)
        torch._foreach_addcdiv_(p, m, denoms, step_sizes[start:end])
        for param, p32 in zip(run, p, strict=True):
            _write_back(param, p32)
        start = end


def clip_folded_(
    averaged: torch.Tensor, exp_avg: torch.Tensor, param: torch.Tensor, coef: float, *,
    beta1: float, weight_decay: float, decoupled: bool,
) -> None:
    """Scale the gradient inside an averaged fold by ``coef``, in place: the fold is
    ``b1 * m + (1 - b1) * (g + wd * p)`` (linear in ``g``), so
    ``coef * fold + (1 - coef) * (b1 * m + (1 - b1) * wd * p)`` is the fold of ``coef * g``,
    what Adam's momentum would be after clipping the averaged gradient ``g`` by ``coef``.
    ``m`` is the momentum before the fold, the same on every rank."""
    averaged.mul_(coef).add_(exp_avg, alpha=(1 - coef) * beta1)
    if weight_decay != 0 and not decoupled:
        averaged.add_(as_fp32(param), alpha=(1 - coef) * (1 - beta1) * weight_decay)


def corrected_root(exp_avg_sq: torch.Tensor, step: float, *, beta2: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``sqrt(v_hat)``, the bias-corrected root of the variance at ``step``, rounded as torch's
    Adam rounds it (``sqrt(v) / sqrt(1 - beta2**step)``), into ``out`` when given."""
    return torch.sqrt(exp_avg_sq, out=out).div_((1 - beta2**step) ** 0.5)


def frozen_denominator(exp_avg_sq: torch.Tensor, frozen_step: float, *, beta2: float,
                       eps: float) -> torch.Tensor:
    """``sqrt(v_hat) + eps`` of the variance frozen at ``frozen_step`` (its bias correction
    frozen with it): the same for the whole compression stage, so computed once (the optimizer
    computes :func:`corrected_root` into its units and adds ``eps`` there)."""
    return corrected_root(exp_avg_sq, frozen_step, beta2=beta2).add_(eps)


def adam_step_bound(beta1: float, beta2: float) -> float:
    """The largest ``|m_hat / sqrt(v_hat)|`` Adam takes on one gradient that comes after a
    silence long enough for the momentum and the variance to have decayed: ``m = (1 - b1) g``
    over ``sqrt(v) >= sqrt(1 - b2) |g|``, so ``(1 - b1) / sqrt(1 - b2)``, 3.16 at (0.9,
    0.999). A rare embedding row's first step after a gap is of this size under Adam."""
    return (1 - beta1) / (1 - beta2) ** 0.5


def frozen_update_(
    params: list[torch.Tensor], exp_avgs: list[torch.Tensor], denoms: list[torch.Tensor],
    steps: list[float], *, lr: float, beta1: float, weight_decay: float, decoupled: bool,
    bound: float | list[float] | None = 1.0, masters: list[torch.Tensor | None] | None = None,
    averaged: list[torch.Tensor | Encoded] | None = None,
) -> None:
    """The compression-stage update of one parameter group: each parameter moves by
    ``-lr * m_hat / denom`` (``denom`` from :func:`frozen_denominator`, ``m_hat`` the averaged
    momentum over its bias correction at the parameter's ``step``). fp32 CPU tensors take one
    pass of the C kernel each (``kernels/cpu_update.c``, when it could be built); the others
    foreach ops (one kernel per operation for the whole group), with the same bits.

    ``bound`` (None: no bound; a list: one per parameter): the variance is taken as at least
    ``(m_hat / bound)**2``, so each coordinate's ``m_hat / denom`` is clamped to +-``bound``
    (``bound * lr`` per step; 1 for an averaged momentum, more for a local step's,
    ``onebit_plugin.members.local_steps``, or a unit of rows, ``MomentumUnit.step_bound``). A
    second
    moment is never below the square of a mean of the same gradients (Jensen); a variance frozen
    before a coordinate's gradients grew (a rare embedding row, attention weights) breaks that,
    and would let the coordinate run away. The clamp acts on each step's decoded momentum
    (``+-scale`` per coordinate, right only on average through error feedback), so it also slows
    coordinates whose true step is inside the bound; docs/design.md, "Bounded steps", measures
    what that costs. ``masters``: fp32 master copies (or None) per parameter. ``averaged``: the
    new momenta (the optimizer passes its fold buffer, which holds the averaged momentum by
    then, or :class:`Encoded` parts of the allreduce's average, decoded by the same pass),
    copied into ``exp_avgs`` by the same pass and then free to be overwritten; without it
    ``exp_avgs`` already hold them, and the torch passes allocate their ratios."""
    masters = masters or [None] * len(params)
    p32 = [_fp32_param(p, m) for p, m in zip(params, masters, strict=True)]
    decay = 1 - lr * weight_decay if weight_decay != 0 and decoupled else 1.0
    # |m_hat / denom| <= 1 is |m / denom| <= 1 - b1**step, before m's bias correction.
    corrections = [1 - beta1**step for step in steps]
    bounds = bound if isinstance(bound, list) else [bound] * len(params)
    kernel = cpu_kernel()
    rows, rest = [], []
    if averaged is not None:
        averaged = list(averaged)
    for i, (p, m, d) in enumerate(zip(p32, exp_avgs, denoms, strict=True)):
        new = m if averaged is None else averaged[i]
        encoded = isinstance(new, Encoded)
        if kernel is not None and fits_cpu_kernel(p, m, d) and \
                (encoded or fits_cpu_kernel(new)):
            # One pass instead of the six below, the same bits (kernels/cpu_update.c); an
            # encoded average decoded as it is read (the fold buffer neither written nor read).
            rows.append((p, new, d, None if averaged is None else m, -(lr / corrections[i]),
                         None if bounds[i] is None else corrections[i] * bounds[i]))
            continue
        if encoded:
            averaged[i] = new.decoded()
        rest.append(i)
    if rows:  # one call for the group (one per parameter cost ~10 us each of Python)
        kernel.frozen_update_many(rows, decay=decay)
    if rest:
        work = None
        if averaged is not None:
            work = [averaged[i] for i in rest]
            torch._foreach_copy_([exp_avgs[i] for i in rest], work)
        _frozen_update_passes([p32[i] for i in rest], [exp_avgs[i] for i in rest],
                              [denoms[i] for i in rest], [corrections[i] for i in rest],
                              lr=lr, decay=decay, bounds=[bounds[i] for i in rest], work=work)
    for param, p in zip(params, p32, strict=True):
        _write_back(param, p)


def _frozen_update_passes(p32, exp_avgs, denoms, corrections, *, lr, decay, bounds, work):
    """The torch passes of :func:`frozen_update_` (GPU tensors, bf16 parameters without master
    copies, or no C compiler), multi-tensor: ``p *= decay``, ``r = m / d``, the clamp,
    ``r *= -lr / correction``, ``p += r``, each rounded once (not ``add_`` with ``alpha``,
    which may fuse the multiply-add), as the CPU kernel does."""
    if decay != 1.0:
        torch._foreach_mul_(p32, decay)
    if work is None:
        ratios = torch._foreach_div(exp_avgs, denoms)
    else:
        ratios = work
        torch._foreach_div_(ratios, denoms)
    # Parameters that share a step count (all of them, unless some had no gradient early on)
    # and a bound share the clamp: one clamp and one scaled add for them together.
    by_correction: dict[tuple[float, float | None], list[int]] = {}
    for i, key in enumerate(zip(corrections, bounds, strict=True)):
        by_correction.setdefault(key, []).append(i)
    for (correction, bound), index in by_correction.items():
        these = [ratios[i] for i in index]
        if bound is not None:
            limit = correction * bound
            # One pass per large tensor; the small ones in two foreach passes (fewer launches).
            small = [r for r in these if r.numel() < 1 << 16]
            for r in these:
                if r.numel() >= 1 << 16:
                    r.clamp_(-limit, limit)
            if small:
                torch._foreach_clamp_min_(small, -limit)
                torch._foreach_clamp_max_(small, limit)
        torch._foreach_mul_(these, -(lr / correction))
        torch._foreach_add_([p32[i] for i in index], these)
