"""The hand-off between backward and ``step()``: everything the DDP hook (and clipping) leaves
for the coming ``step()`` of one iteration, in one object with one :meth:`HandOff.reset`.

Like torch's ``PowerSGDState`` it is plain state: the hook writes into it, ``step()`` reads it
and resets it at its end (raised or not), and ``load_state_dict`` resets it, so nothing of one
iteration survives into the next, or into a resumed run. A field added here is reset with the
others.
"""

from __future__ import annotations

import logging

import torch

from onebit_plugin.core import variance_follow
from onebit_plugin.maths.norm_sketch import NormSketch, sketch_width

__all__ = ["HandOff"]

log = logging.getLogger("onebit_plugin")


class HandOff:
    """What backward leaves for ``step()``.

    Per iteration (cleared by :meth:`reset`):

    * ``averaged``: unit -> whether every rank's average was finite, for the units the DDP hook
      averaged inside backward (``step()`` takes their momentum from ``p.grad``);
    * ``handed``: param -> ``(data_ptr, version)`` of the bucket view the hook wrote last, which
      is ``p.grad``: ``step()`` sees at no cost whether anything changed it in between;
    * ``reduced``: the parameters whose warm-up gradients the hook averaged;
    * ``local_norms`` and ``sketches``: per parameter, the norm and the sketch of the local
      gradient the hook folded (for ``clip_grad_norm_`` in the compression stage);
    * ``clip_coef``: the clipping coefficient ``clip_grad_norm_`` chose for this step;
    * ``grads_averaged``: ``clip_grad_norm_`` already averaged the warm-up gradients;
    * ``summaries``: per parameter, the summary of the local gradient the hook folded, for the
      variance's following (``onebit_plugin.core.variance_follow``);
    * ``local_notes``: per parameter, what the policy's ``local_variance`` noted of the local
      gradient the hook folded (0/1 Adam's, ``onebit_plugin.members.local_variance``).

    Kept across iterations: ``sketch``, the :class:`~onebit_plugin.maths.norm_sketch.NormSketch` the
    hook sketches with once clipping was asked for, and which warnings were said.
    """

    def __init__(self) -> None:
        self.sketch = None
        self._said: set[str] = set()
        self.reset()

    def reset(self) -> None:
        """Forget this iteration: the one place where the per-iteration fields are cleared."""
        self.averaged: dict = {}
        self.handed: dict[torch.Tensor, tuple[int, int]] = {}
        self.reduced: set = set()
        self.local_norms: dict = {}
        self.sketches: dict = {}
        self.clip_coef: float | None = None
        self.grads_averaged = False
        self.summaries: dict = {}
        self.local_notes: dict = {}

    def start_sketching(self, trainable: list[torch.Tensor]) -> None:
        """Clipping was asked for: from now on the hook sketches the local gradients it folds
        (``trainable``: the optimizer's trainable parameters)."""
        if self.sketch is None:
            self.sketch = NormSketch(trainable, sketch_width(sum(p.numel() for p in trainable)))

    # -------------------------------------------------------------------------- the hook's side
    def note_reduced(self, params) -> None:
        """The hook averaged the warm-up gradients of ``params`` (one bucket's)."""
        self.reduced.update(params)

    def mark_averaged(self, unit, ok: bool) -> None:
        """The hook averaged ``unit`` during backward (``ok``: every rank's was finite)."""
        self.averaged[unit] = ok

    def hand_over(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """The hook is done writing ``grad``, ``p``'s view of DDP's bucket, which is ``p.grad``
        (``gradient_as_bucket_view=True``): ``p``'s local gradient (a unit left to ``step()``)
        or its averaged momentum. Its version count is kept, so that ``step()`` sees whether
        something changed it in between (torch's ``clip_grad_norm_`` would clip each rank's
        local gradient by its own norm, or the momentum): a changed local gradient is folded as
        it is, a changed momentum is compared and used as it is (ignored beside local
        gradients), and either is said once. Call it after the hook's last write."""
        self.handed[p] = (grad.data_ptr(), grad._version)

    def note_local_gradient(self, p: torch.Tensor, grad: torch.Tensor, opt) -> None:
        """The hook is about to fold ``p``'s local gradient: its norm and sketch are kept for
        ``clip_grad_norm_``, since ``p.grad`` will hold the averaged momentum before anyone can
        clip it (nothing is computed while nobody clips); and its sketch where ``opt`` (the
        optimizer) follows the variance on this step."""
        if variance_follow.samples(opt, opt.global_step + 1):  # the coming step's
            self.summaries[p] = opt.policy.follow.summary(grad, opt.global_step + 1)
        if opt.policy.local_variance is not None:
            self.local_notes[p] = opt.policy.local_variance.note(grad, opt.global_step + 1)
        if self.sketch is None:
            return
        self.local_norms[p] = torch.linalg.vector_norm(grad, dtype=torch.float32)
        self.sketches[p] = self.sketch.of(p, grad)

    # ---------------------------------------------------------------------------- step()'s side
    def changed(self, p: torch.Tensor) -> bool:
        """Whether ``p.grad`` is no longer the bucket view the hook handed over, or was written
        since (any in-place op on a view of the bucket counts; one through ``.data`` does not).
        Not handed over counts as changed; a None gradient does not (DDP leaves the gradient of
        a parameter no rank used None, and the fold takes it as zero)."""
        handed = self.handed.get(p)
        if handed is None:
            return True
        grad = p.grad
        return grad is not None and (grad.data_ptr(), grad._version) != handed

    def settle(self, units: list) -> None:
        """After every unit was averaged (and all came back finite): what ``step()`` takes as
        each unit's new momentum, from the hook's average, a change made to ``p.grad`` since,
        and this step's clipping coefficient."""
        coef = self.clip_coef if self.clip_coef is not None and self.clip_coef < 1 else None
        # Some p.grad held local gradients (units left to step()) beside averaged momenta.
        mixed = bool(self.averaged) and len(self.averaged) < len(units)
        compared, decoded = [], []
        for unit in units:
            # The new momentum is in the fold buffer, or still encoded (decoded by the update's
            # pass, which copies it over the old one; the fold buffer then serves the torch
            # passes as scratch). What reads it as a tensor first has it decoded.
            if coef is None and (unit not in self.averaged or not any(
                    p.grad is not None and self.changed(p) for p in unit.params)):
                # Averaged by the hook into bucket views nobody wrote since: p.grad holds
                # exactly the average, and the update decodes it from the wire (or reads the
                # fold buffer) as it would have.
                continue
            unit.decode_()
            decoded.append(unit)
            # The hook handed the average to DDP as p.grad (rounded to p.grad's dtype). If
            # something changed it since (torch's clip_grad_norm_, say), p.grad is used, and
            # said: the same change on every rank, as long as every p.grad held an average.
            # Beside local gradients it is not, and ignored. Compared only when p.grad is not
            # the bucket view the hook wrote last, or was written since (a pass over both, as
            # much as the rest of the step's compression work on the CPU).
            compared += [(p, unit.view(p, unit.local)) for p in unit.params
                         if unit in self.averaged and p.grad is not None and self.changed(p)]
        for (p, new), changed in zip(compared, differing(compared), strict=True):
            if changed:
                self.say_once("mixed" if mixed else "momentum")
                if not mixed:
                    new.copy_(p.grad)
        if coef is not None:
            for unit in decoded:
                for p in unit.params:
                    unit.clip_(p, unit.view(p, unit.local), coef)

    def say_once(self, what: str) -> None:
        """Warn about a change to ``p.grad`` between backward and ``step()``, once per kind."""
        if what not in self._said:
            self._said.add(what)
            log.warning("%s", _CHANGED[what])


def differing(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[bool]:
    """For each ``(p, new)``: does ``p.grad`` differ from ``new`` (in ``p.grad``'s dtype)? One
    host sync for all of them (on a GPU, torch.equal per parameter was one each)."""
    if not pairs:
        return []
    return torch.stack([(p.grad != new.to(p.grad.dtype)).any() for p, new in pairs]).tolist()


_FIX = ("Call optimizer.clip_grad_norm_(max_norm) instead (the Lightning and Fabric strategies "
        "and onebit-run's Accelerator do)")
_CHANGED = {
    "momentum": (
        "onebit: in the compression stage p.grad holds the averaged momentum (the DDP hook "
        "folded the local gradients into it during backward), and something changed it "
        "before step(): torch.nn.utils.clip_grad_norm_ or clip_grad_value_ there clips the "
        f"momentum, which is not what clipping means for Adam. {_FIX}; the changed momentum is "
        "used as given"),
    "mixed": (
        "onebit: p.grad was changed between backward and step() (by "
        "torch.nn.utils.clip_grad_norm_ or clip_grad_value_?) where it held the averaged "
        "momentum, while other parameters' p.grad held each rank's own local gradient "
        "(momentum units left to step() with gradient_as_bucket_view=True). A clipping "
        "computed over both differs between ranks and would make them drift apart: the "
        "averaged momentum is kept as the DDP hook computed it, the change to it is ignored "
        f"(the local gradients' change is used). {_FIX}."),
    "local": (
        "onebit: p.grad was changed between backward and step() (by "
        "torch.nn.utils.clip_grad_norm_ or clip_grad_value_?). In the compression stage, "
        "with gradient_as_bucket_view=True, the DDP hook leaves each rank's own local "
        "gradient in p.grad for the parameters whose momentum step() averages, so torch's "
        "clipping there clips every rank's gradient separately, before averaging; under "
        f"DDP with Adam it clips the averaged gradient. {_FIX}. The changed gradients are used "
        "as given."),
}
