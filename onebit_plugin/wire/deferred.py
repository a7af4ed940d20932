"""Work described now and done later, by whichever pass reads it first.

* :class:`Fold`: a momentum unit's fold of its local gradients, ``b1 * m + (1 - b1) * g``
  (:func:`fold_gradient_`), which the CPU kernel computes inside its compression pass and every
  other path materializes first;
* :class:`Encoded`: one parameter's part of a compressed allreduce's average, left as the wire
  holds it, which the CPU update pass decodes as it reads it.

They live apart from ``onebit_plugin.maths.update`` (the optimizer's maths) because the wire format
(``compression``, ``allreduce``) takes them as inputs: it imports these descriptions, not the
update rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from onebit_plugin.wire.dispatch import cpu_kernel, fits_cpu_kernel

__all__ = ["Encoded", "Fold", "as_fp32", "fold_gradient_"]


def as_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t``, or its fp32 copy: the one way a bf16/fp16 value enters fp32 maths."""
    return t if t.dtype == torch.float32 else t.float()


def fold_gradient_(
    exp_avg: torch.Tensor, grad: torch.Tensor | None, param: torch.Tensor, *, beta1: float,
    weight_decay: float, decoupled: bool, out: torch.Tensor,
) -> None:
    """``out = b1 * m + (1 - b1) * g`` with a *local* gradient (coupled weight decay folded in);
    ``m`` is left alone until the average comes back. A missing gradient counts as zero: every
    rank must still send its momentum."""
    if grad is None:
        torch.mul(exp_avg, beta1, out=out)
        return
    grad = as_fp32(grad)
    if weight_decay != 0 and not decoupled:
        grad = grad.add(param, alpha=weight_decay)
    torch.lerp(exp_avg, grad, 1 - beta1, out=out)


class Encoded(NamedTuple):
    """One parameter's part of a compressed allreduce's average, still as the communicator left
    it: ``packed`` signs (bit i of byte k is value 8k+i), one fp32 scale per ``block`` values in
    ``scales``, the bool ``keep`` mask (False: the value is 0), for values ``offset`` on of the
    layout, as many as ``numel``; ``fallback`` makes the fp32 tensor (a slice of the unit's
    fold buffer, made at its first use) it is decoded into where it cannot be read encoded.
    :func:`frozen_update_`'s CPU pass decodes it as it reads it: the fp32 average is never
    written and read back. Made by ``MomentumUnit.averaged``, only where the CPU kernel is
    built."""

    packed: torch.Tensor
    scales: torch.Tensor
    keep: torch.Tensor
    block: int
    offset: int
    numel: int
    fallback: Callable[[], torch.Tensor]

    def decoded(self) -> torch.Tensor:
        """Decode into ``fallback()`` and return it."""
        out = self.fallback()
        self.decode_into(out)
        return out

    def decode_into(self, out: torch.Tensor) -> None:
        """Decode into ``out`` (fp32, contiguous, ``numel`` values, on the CPU)."""
        cpu_kernel().decode_range(self, out)


class Fold:
    """The fold of a momentum unit's local gradients, described and not yet done: for each part
    ``(offset, param, grad, beta1, weight_decay)``, :func:`fold_gradient_` of ``grad`` into
    ``out[offset:]`` from ``exp_avg[offset:]`` (``weight_decay`` the coupled one, or 0). The CPU
    kernel's worker pass folds on the fly as it compresses (``kernels/cpu_compress.c``: the fold
    is never written, and the pass before it that summed it for finiteness is gone); every other
    path calls :meth:`materialize` and compresses ``out``, with the same bits. ``out`` may be
    given as a function that makes it, called at its first use: the CPU kernel's path, which
    leaves the average encoded, never needs one (4 bytes per value)."""

    __slots__ = ("_out", "exp_avg", "parts")

    def __init__(self, out, exp_avg: torch.Tensor, parts: list[tuple]):
        self._out, self.exp_avg, self.parts = out, exp_avg, parts

    @property
    def out(self) -> torch.Tensor:
        if not isinstance(self._out, torch.Tensor):
            self._out = self._out()
        return self._out

    @torch.no_grad()  # also on the DDP hook's background thread, where grad mode is on
    def materialize(self) -> torch.Tensor:
        """Fold into ``out``, now; returns it."""
        for offset, param, grad, beta1, weight_decay in self.parts:
            n = param.numel()
            fold_gradient_(self.exp_avg[offset : offset + n].view_as(param), grad, param,
                           beta1=beta1, weight_decay=weight_decay, decoupled=False,
                           out=self.out[offset : offset + n].view_as(param))
        return self.out

    def cpu_table(self) -> tuple[torch.Tensor, ...] | None:
        """The parts as the CPU kernel reads them (offsets, gradient and parameter addresses,
        bf16 flags, hyperparameters), or None when one does not fit it (a gradient not fp32 or
        bf16, contiguous and on the CPU; a parameter read for weight decay not fp32)."""
        offsets, grads, params, bf16, hypers = [], [], [], [], []
        for offset, param, grad, beta1, weight_decay in self.parts:
            if grad is not None and not fits_cpu_kernel(grad, dtypes=(torch.float32,
                                                                          torch.bfloat16)):
                return None
            if grad is not None and weight_decay != 0 and not fits_cpu_kernel(param):
                return None
            offsets.append(offset)
            grads.append(0 if grad is None else grad.data_ptr())
            params.append(param.data_ptr() if weight_decay != 0 else 0)
            bf16.append(int(grad is not None and grad.dtype == torch.bfloat16))
            hypers += [beta1, 1 - beta1, weight_decay]
        offsets.append(self.exp_avg.numel())
        return (torch.tensor(offsets, dtype=torch.int64), torch.tensor(grads, dtype=torch.int64),
                torch.tensor(bf16, dtype=torch.int32), torch.tensor(params, dtype=torch.int64),
                torch.tensor(hypers, dtype=torch.float64))
