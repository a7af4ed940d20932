"""How one step's values cross ranks: one exchange per kind of step.

The member's policy chooses the exchange of every step (``Policy.step_exchange``); the step
driver (``OneBitOptimizer.step``), clipping (``OneBitOptimizer.clip_grad_norm_``) and the DDP
hook (``onebit_plugin.entry.ddp_hook``) ask for it and call it, and nothing else branches on the
kind
of step. An exchange does three things, and counts its own bytes (sent, and what an fp32 ring
allreduce would have sent) in the optimizer's ``counts``:

* :meth:`StepExchange.in_backward`: the DDP hook's part, one bucket at a time;
* :meth:`StepExchange.clip_grad_norm_`: clipping by the norm this step's gradient can have;
* :meth:`StepExchange.step`: ``step()``'s part: whatever the hook did not send, then the
  step's update.

The family's exchanges: ``gradient_average.GradientAverage`` (the fp32 average of the warm-up
and of 0/1 Adam's variance refreshes), :class:`MomentumStep` (the momentum units through the
policy's wire exchange, ``policy.Exchange``: 1-bit, or exact for ``compress_momentum=False``),
and 0/1 Adam's ``local_steps.LocalStep`` and ``local_steps.SyncStep``. A new kind of step is
one class here and its policy's choice (docs/family.md).
"""

from __future__ import annotations

import math

import torch

from onebit_plugin.core import compression_stage
from onebit_plugin.core.clipping import clip_coefficient, compression_stage_norm, say_late_clip
from onebit_plugin.settings.step_kinds import MOMENTUM

__all__ = ["MomentumStep", "StepExchange"]


class StepExchange:
    """One kind of step (the base: subclass it)."""

    #: the step's word (``onebit_plugin.settings.step_kinds``): ``OneBitOptimizer.coming_exchange``
    kind: str = ""

    def in_backward(self, opt, hook, bucket) -> torch.futures.Future:
        """The DDP hook's part for one bucket (``hook``: its ``OneBitHookState``): the future
        of what DDP takes as the bucket's gradients."""
        raise NotImplementedError

    def clip_grad_norm_(self, opt, trainable: list[torch.Tensor], max_norm: float,
                        norm_type: float) -> torch.Tensor:
        """``opt.clip_grad_norm_`` for this step (the arguments already checked)."""
        raise NotImplementedError

    def step(self, opt) -> None:
        """``step()``'s part: what backward did not send, then the step's update."""
        raise NotImplementedError

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of the buffers this exchange holds (``onebit_plugin.core.memory``)."""
        return []

    def release_buffer(self) -> torch.Tensor | None:
        """A buffer this exchange no longer needs once the variance freezes, which the momentum
        units' fold buffers are cut from; None: none."""
        return None


class MomentumStep(StepExchange):
    """The compression stage's momentum units, each through ``wire``'s communicator (1-bit
    signs with error feedback, or exact): inside backward by the DDP hook, or in ``step()``."""

    kind = MOMENTUM

    def __init__(self, wire) -> None:
        self.wire = wire  # policy.Exchange: what is sent for each unit
        self._said_late_clip = False

    def in_backward(self, opt, hook, bucket) -> torch.futures.Future:
        return hook.average_units(bucket)

    def clip_grad_norm_(self, opt, trainable, max_norm, norm_type) -> torch.Tensor:
        handoff = opt.handoff
        late = handoff.sketch is None and bool(handoff.averaged)  # folded, never sketched
        handoff.start_sketching(trainable)
        device = trainable[0].device if trainable else torch.device("cpu")
        if late:  # the same on every rank: the hook ran, and nobody had clipped, everywhere
            if not self._said_late_clip:
                self._said_late_clip = True
                say_late_clip()
            return torch.full((), math.nan, device=device)
        estimate, sent = compression_stage_norm(trainable, handoff, opt.world_size,
                                                opt.comm_group, opt.comm_timeout, device,
                                                opt.shards)
        opt.counts.clip_sent += sent
        handoff.clip_coef = clip_coefficient(max_norm, float(estimate))
        return estimate.reshape(())

    def step(self, opt) -> None:
        compression_stage.momentum_step(opt)
