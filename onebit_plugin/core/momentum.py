"""Momentum units: the one layout in which the compression stage averages the momentum.

A unit is a fixed set of parameters (cut once by :func:`partition`) whose momenta live in one
flat fp32 buffer (the optimizer's ``state['exp_avg']`` are views of it), with a fold buffer for
the local momentum, the mask of coordinates that take part, the communicator's plan and the
error buffers. Both paths run the same units: ``OneBitAdam.step()`` folds and reduces them one
after another when nothing else did, the DDP comm hook folds and reduces a unit in the background
as soon as all its gradients are in. The units do not follow DDP's buckets, which DDP rebuilds
after the first iteration of every run: a resumed run compresses in the same layout as the
uninterrupted one (docs/design.md, "Momentum units").
"""

from __future__ import annotations

import functools
import math

import torch

from onebit_plugin.maths.masks import keep_mask, negligible_root
from onebit_plugin.maths.update import clip_folded_, corrected_root
from onebit_plugin.wire.deferred import Encoded, Fold

__all__ = ["MomentumUnit", "back_to_back", "build_units", "init_states_in_unit_order", "new_state",
           "partition", "refresh_denominators", "update_rows"]


def partition(params: list[torch.Tensor], cap_bytes: int, alone=frozenset()
              ) -> list[list[torch.Tensor]]:
    """Cut ``params`` into units in reverse order (as backward usually produces gradients),
    each up to ``cap_bytes`` of fp32 momentum (a larger parameter gets a unit of its own, and
    so does every parameter in ``alone``). The order is the same whatever the cuts: the
    momenta laid out once (:func:`init_states_in_unit_order`) lie back to back in any."""
    units, current, size = [], [], 0
    for p in reversed(params):
        if current and (size + 4 * p.numel() > cap_bytes or p in alone or current[-1] in alone):
            units.append(current)
            current, size = [], 0
        current.append(p)
        size += 4 * p.numel()
    if current:
        units.append(current)
    return units


def back_to_back(momenta: list[torch.Tensor], numel: int) -> torch.Tensor | None:
    """``momenta`` (or variances) as one flat fp32 tensor over their own memory, when they lie
    back to back in one buffer in layout order (as :func:`init_states_in_unit_order` lays them
    out in warm-up); else None."""
    first = momenta[0]
    end = first.data_ptr()
    for m in momenta:
        if m.dtype != torch.float32 or not m.is_contiguous() or m.data_ptr() != end or \
                m.device != first.device or \
                m.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        end += 4 * m.numel()
    return first.as_strided((numel,), (1,))


class MomentumUnit:
    """The momenta of ``params`` in one flat buffer, averaged together.

    Args:
        params: the unit's parameters, in layout order.
        momenta: their current fp32 momenta (copied in; use :meth:`view` from then on).
        denom: their frozen ``sqrt(v_hat) + eps`` (``update.frozen_denominator``), one flat
            fp32 tensor in layout order, which the unit keeps (not copied).
        keep: flat bool tensor in layout order: False coordinates keep a zero momentum.
        hypers: per parameter, its optimizer param-group dict (read at every fold, so LR and
            beta schedules take effect).
        comm: the communicator whose plan (layout, mask) and error buffers the unit keeps.
        send_bound: None: each rank's fold ``m`` is sent; a number: ``m / denom`` clamped to
            +-it is (``policy.OverDenominator``; ``math.inf``: not clamped), and the average
            comes back times ``denom``.
    """

    __slots__ = ("params", "offsets", "hypers", "momentum", "_local", "denom", "plan", "errors",
                 "masked", "_views", "_encoded", "send_bound", "late")

    def __init__(self, params, momenta, denom, keep, hypers, comm, local=None,
                 send_bound: float | None = None):
        self.params = list(params)
        self.hypers = dict(zip(self.params, hypers, strict=True))
        numel = sum(p.numel() for p in self.params)
        for name, t in (("denominator", denom), ("mask", keep), ("fold buffer", local)):
            if t is not None and t.shape != (numel,):
                raise ValueError(f"a unit of {numel} values got a {name} of shape "
                                 f"{tuple(t.shape)}")
        self.denom, self.send_bound = denom, send_bound
        self.offsets, offset = {}, 0
        for p in self.params:
            self.offsets[p] = offset
            offset += p.numel()
        # Fresh memory is the dearest part of building a unit: on 4 emulated hosts sharing a
        # 2-core VM each new 26 MB took 100-280 ms to fault in (2026-12-01), against about 30
        # ms for the whole step. Momenta that already lie back to back are taken as they are.
        self.momentum = back_to_back(momenta, numel)
        if self.momentum is None:
            self.momentum = torch.empty_like(denom)
            for p, m in zip(self.params, momenta, strict=True):
                self._slice(p, self.momentum).copy_(m)
        masked = keep.logical_not()
        # count_nonzero reads a bool tensor several times faster than any() on CPU.
        if int(masked.count_nonzero()):
            self.momentum.masked_fill_(masked, 0.0)
            self.masked = masked  # for clip_
        else:
            self.masked = None
        self.plan = comm.plan(numel, keep, denom.device)
        self.errors = self.plan.new_errors()
        # The views of the unit's own buffers, made once: step() takes three per parameter
        # per step (about 100 parameters in a 6.5M-parameter GPT: some 0.5 ms of slicing).
        self._views = {}
        for b in (self.momentum, self.denom):
            self._add_views(b)
        self._local = None
        if local is not None:
            self._set_local(local)
        self._encoded = None  # averaged()'s parts, made at its first use (the wire is fixed)
        self.late = None  # its rows asleep since the freeze (``maths.late_rows``), if any

    @property
    def local(self) -> torch.Tensor:
        """The fold buffer: gradients are folded into it (the CPU kernel folds them on the fly
        instead); the average comes back into it (or stays encoded: averaged()), and reaches
        the momentum (copied by the update's pass) only once every unit of the step came back
        finite. Made at its first use: the CPU kernel's paths never use it (an average left
        encoded is decoded by the update's pass, and by the DDP hook straight into the
        gradients), which saves 4 bytes per parameter (docs/memory.md)."""
        if self._local is None:
            self._set_local(torch.empty_like(self.momentum))
        return self._local

    def _local_view(self, p: torch.Tensor) -> torch.Tensor:
        return self.view(p, self.local)

    def _set_local(self, local: torch.Tensor) -> None:
        self._local = local
        self._add_views(local)

    def _add_views(self, buffer: torch.Tensor) -> None:
        self._views[id(buffer)] = {p: self._slice(p, buffer) for p in self.params}

    def remask_(self, keep: torch.Tensor) -> None:
        """The mask again (``refresh_denominators``): masked coordinates' momentum is cleared;
        a changed mask clears their errors too, and the communicator's plan takes it."""
        if not self.plan.keeps(keep):
            masked = keep.logical_not()
            self.masked = masked if int(masked.count_nonzero()) else None
            self.plan.remask_(keep)
            self.plan.clear_masked_(self.errors)
            self._encoded = None  # its parts hold the old mask
        if self.masked is not None:  # a refresh folded a gradient into masked momenta too
            self.momentum.masked_fill_(self.masked, 0.0)

    def unmask_(self, index: torch.Tensor) -> None:
        """Coordinates ``index`` (int64, flat in the unit; masked until now: their momentum
        was cleared and their errors stay zero) join the exchange (``maths.late_rows``)."""
        if index.numel():
            self.masked[index] = False
            self.plan.unmask_(index)
            self._encoded = None  # its parts hold the old mask

    def view(self, p: torch.Tensor, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """``p``'s slice of the momentum (or of ``buffer``), shaped like ``p``."""
        buffer = self.momentum if buffer is None else buffer
        views = self._views.get(id(buffer))
        return views[p] if views is not None else self._slice(p, buffer)

    def _slice(self, p: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        start = self.offsets[p]
        return buffer[start : start + p.numel()].view_as(p)

    def clip_(self, p: torch.Tensor, averaged: torch.Tensor, coef: float) -> None:
        """Clip the gradient inside ``p``'s averaged fold (``averaged``, shaped like ``p``) by
        ``coef``, before it replaces the momentum; masked coordinates stay at zero."""
        hyper = self.hypers[p]
        clip_folded_(averaged, self.view(p), p, coef, beta1=hyper["betas"][0],
                     weight_decay=hyper["weight_decay"], decoupled=hyper["decoupled_weight_decay"])
        if self.masked is not None and hyper["weight_decay"] != 0:
            averaged.masked_fill_(self.view(p, self.masked), 0.0)

    def fold(self, grads: dict) -> Fold:
        """The fold of ``grads`` (every parameter's local gradient, or None: zero) into the
        unit's local momentum, described (``deferred.Fold``); the communicator computes it, the
        CPU kernel inside its worker pass. Asleep rows' gradients are noted on the way
        (``maths.late_rows``)."""
        if self.late is not None:
            self.late.note(grads)
        parts = []
        for p in self.params:
            hyper = self.hypers[p]
            coupled = 0.0 if hyper["decoupled_weight_decay"] else hyper["weight_decay"]
            parts.append((self.offsets[p], p, grads[p], hyper["betas"][0], coupled))
        return Fold(self._local if self._local is not None else (lambda: self.local),
                    self.momentum, parts)

    def reduce_(self, comm, grads: dict, decode: bool = True) -> bool:
        """Fold ``grads`` and average the fold into the local momentum, now; False when some
        rank's was not finite. With ``decode=False`` the average may stay encoded: read it
        through :meth:`averaged`, or :meth:`decode_` it first."""
        if self.send_bound is None:
            return comm.reduce_(self.fold(grads), self.plan, self.errors, decode=decode)
        return self._times_denom(comm.reduce_(self._over_denom(grads), self.plan, self.errors))

    def _over_denom(self, grads: dict) -> torch.Tensor:
        """The fold over the denominator, clamped (:meth:`bound_`), in the fold buffer."""
        return self.bound_(self.fold(grads).materialize().div_(self.denom))

    def step_bound(self) -> float:
        """The clamp of a synchronous step's ``m_hat / denom`` on this unit (``bound_update``):
        what it sends where it sends ``m / denom`` clamped (0/1 Adam's rows, at Adam's own
        largest step, ``update.adam_step_bound``), else 1."""
        return 1.0 if self.send_bound is None else self.send_bound

    def bound_(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (a momentum over the denominator) clamped to +-``send_bound``, in place; all
        NaN where some value is not finite, so that the communicator skips the step on every
        rank as it would have (a clamp would turn an inf into a finite value)."""
        if math.isfinite(self.send_bound):
            finite = torch.isfinite(x).all()  # kept on the device: no host sync
            x.clamp_(-self.send_bound, self.send_bound)
            x.masked_fill_(finite.logical_not(), math.nan)
        return x

    def _times_denom(self, ok: bool) -> bool:
        """The average of ``m / denom`` back to a momentum, in the fold buffer."""
        if ok:
            self.local.mul_(self.denom)
        return ok

    def averaged(self, p: torch.Tensor) -> torch.Tensor | Encoded:
        """``p``'s averaged momentum after :meth:`reduce_`: its slice of the fold buffer, or
        its part of the average the communicator left encoded (``deferred.Encoded``, which
        ``update.frozen_update_`` decodes as it reads it)."""
        if not self.plan.encoded:
            return self.view(p, self.local)
        if self._encoded is None:
            self._encoded = {q: self.plan.encoded_part(self.offsets[q], q.numel(),
                                                       functools.partial(self._local_view, q))
                             for q in self.params}
        return self._encoded[p]

    def decode_(self) -> None:
        """Decode an average left encoded into the fold buffer (before the fold buffer is read
        as the average: the DDP hook's compare, clipping)."""
        if self.plan.encoded:
            self.plan.decode_into_(self.local)

    def submit(self, comm, grads: dict) -> torch.futures.Future:
        """:meth:`reduce_` on the communicator's background thread, the average left encoded
        where it can be (:meth:`average_into` reads it). With ``send_bound`` the fold over the
        denominator is made on the calling thread first, and the average comes back decoded
        (and times the denominator) into the fold buffer."""
        if self.send_bound is None:
            return comm.submit(self.fold(grads), self.plan, self.errors, decode=False)
        future = comm.submit(self._over_denom(grads), self.plan, self.errors)
        return future.then(lambda done: self._times_denom(done.value()))

    def average_into(self, p: torch.Tensor, out: torch.Tensor) -> None:
        """``p``'s averaged momentum into ``out`` (``p``'s shape; the DDP hook's bucket view),
        decoded straight from the wire when the average is still encoded: the fold buffer is
        then neither written nor read. Writes only ``p``'s own part (the hook's callbacks for
        two buckets sharing a unit may run at once)."""
        average = self.averaged(p)
        if not isinstance(average, Encoded):
            out.copy_(average)
        elif out.dtype == torch.float32 and out.is_contiguous() and not out.is_cuda:
            average.decode_into(out)
        else:
            out.copy_(average.decoded())

    def state_dict(self) -> dict:
        """This rank's error buffers (they differ between ranks)."""
        return {"numel": self.momentum.numel(),
                **{name: e.clone() for name, e in self.errors.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Load this rank's error buffers; those of masked coordinates are cleared (the mask may
        have changed since they were saved). Errors saved in another ``error_dtype`` are
        converted (``checkpoint.load_unit_errors`` says so): fp32 to bf16 rounded to nearest
        once, bf16 to fp32 exactly; the count of stochastic roundings restarts from 0."""
        names = set(state) - {"numel", "draws"}
        if state["numel"] != self.momentum.numel() or names != set(self.errors) - {"draws"}:
            raise ValueError(
                f"saved momentum-unit state ({state['numel']} values, errors "
                f"{sorted(set(state) - {'numel'})}) does not fit this unit "
                f"({self.momentum.numel()} values, errors {sorted(self.errors)}): save and "
                "resume with the same parameters, bucket_cap_mb, compress_momentum and "
                "error_dtype"
            )
        for name, e in self.errors.items():
            if name in state:
                e.copy_(state[name])
            else:  # draws, saved with fp32 errors
                e.zero_()
        self.plan.clear_masked_(self.errors)


def _roots_into(params: list[torch.Tensor], state, groups: dict, out: torch.Tensor) -> None:
    """Each parameter's ``sqrt(v_hat)`` (its variance at its ``frozen_step`` count) into its
    piece of the flat ``out``, in layout order (``out`` may be the variances' own memory)."""
    for p, piece in zip(params, out.split([p.numel() for p in params]), strict=True):
        corrected_root(state[p]["exp_avg_sq"].reshape(-1), state[p]["frozen_step"],
                       beta2=groups[p]["betas"][1], out=piece)


def _add_eps_(params: list[torch.Tensor], groups: dict, root: torch.Tensor) -> None:
    offset = 0
    for p in params:
        root[offset : offset + p.numel()].add_(groups[p]["eps"])
        offset += p.numel()


def _denominator(params: list[torch.Tensor], state, groups: dict, in_place: bool
                 ) -> torch.Tensor:
    """The flat frozen ``sqrt(v_hat) + eps`` of ``params``: a checkpoint's (``state[p]``'s
    ``frozen_denominator``), or computed from the variances, in their own memory when
    ``in_place`` and they lie back to back (as ``init_states_in_unit_order`` lays them out):
    a member whose variance stays frozen needs no copy of it beside its denominator."""
    numel = sum(p.numel() for p in params)
    if all("frozen_denominator" in state[p] for p in params):  # resumed
        saved = [state[p]["frozen_denominator"] for p in params]
        flat = back_to_back(saved, numel)
        if flat is None:
            flat = torch.cat([d.reshape(-1) for d in saved])
        return flat
    flat = back_to_back([state[p]["exp_avg_sq"] for p in params], numel) if in_place else None
    if flat is None:
        flat = torch.empty(numel, dtype=torch.float32, device=params[0].device)
    _roots_into(params, state, groups, flat)
    _add_eps_(params, groups, flat)
    return flat


def build_units(parts: list[list[torch.Tensor]], state, groups: dict, masks: dict,
                mask_zero_variance: bool, comm, spare: torch.Tensor | None,
                keep_variance: bool = False, send_bounds: list | None = None,
                negligible: float | None = None) -> tuple[list[MomentumUnit], float]:
    """At the stage change: a unit per part of :func:`partition`, its denominator the frozen
    ``sqrt(v_hat) + eps`` of its parameters (``state[p]``: ``exp_avg_sq`` and
    ``frozen_step``; ``groups[p]``: its param group), its mask from the denominators and
    ``masks``; every ``state[p]["exp_avg"]`` becomes a view of its unit's momentum. Unless
    ``keep_variance`` (a member that refreshes it), the variance is dropped: its memory becomes
    the denominator where it can, and ``state[p]["frozen_denominator"]`` (a view of it) is what
    checkpoints hold. ``spare``: resident memory no longer used (warm-up's gradient buffer),
    cut into fold buffers where it fits. ``send_bounds``: each part's unit's
    :class:`MomentumUnit` ``send_bound`` (None: None for all). ``negligible``: the root below
    which a coordinate is masked (``masks.negligible_root``; None: from these denominators).
    Returns the units and that root."""
    # One pass computes each denominator into the memory that keeps it; the masks read it: with
    # a root per use (three) and the temporaries each made, this step took 1.3 s on each of 4
    # emulated hosts sharing 2 cores at 6.5M parameters, against some 0.2 s for a
    # compression-stage step (2026-12-01, benchmarks/cluster.py).
    denoms = [_denominator(params, state, groups, not keep_variance) for params in parts]
    if negligible is None:
        negligible = negligible_root(denoms) if mask_zero_variance else 0.0
    units, start = [], 0
    for params, denom, bound in zip(parts, denoms, send_bounds or [None] * len(parts),
                                    strict=True):
        local = None
        if spare is not None and spare.device == denom.device and \
                start + denom.numel() <= spare.numel():
            local, start = spare[start : start + denom.numel()], start + denom.numel()
        keep = keep_mask(params, denom, [groups[p]["eps"] for p in params], negligible,
                         mask_zero_variance, masks)
        unit = MomentumUnit(params, [state[p]["exp_avg"] for p in params], denom, keep,
                            [groups[p] for p in params], comm, local, bound)
        for p in params:
            state[p]["exp_avg"] = unit.view(p)
            if not keep_variance or "exp_avg_sq" not in state[p]:  # or resumed without it
                state[p].pop("exp_avg_sq", None)
                state[p]["frozen_denominator"] = unit.view(p, denom)
        units.append(unit)
    return units, negligible


def refresh_denominators(units: list[MomentumUnit], state, groups: dict, masks: dict,
                         mask_zero_variance: bool) -> float:
    """After the variances changed (a refresh step of 0/1 Adam): every unit's denominator from
    them, in place, and its mask again (a coordinate whose variance was zero may have a gradient
    now, or the other way round); the same on every rank, from the same averaged gradients.
    Returns the root below which a coordinate is masked now."""
    for unit in units:
        _roots_into(unit.params, state, groups, unit.denom)
        _add_eps_(unit.params, groups, unit.denom)
    negligible = negligible_root([u.denom for u in units]) if mask_zero_variance else 0.0
    for unit in units:
        unit.remask_(keep_mask(unit.params, unit.denom,
                               [groups[p]["eps"] for p in unit.params], negligible,
                               mask_zero_variance, masks))
    return negligible


def update_rows(param_groups: list[dict], unit_of: dict, step_index: dict,
                counters: int) -> tuple[list, torch.Tensor | None]:
    """What the compression stage's update reads, per parameter group with trainable
    parameters: the group, its trainable parameters, their step counters' places
    (``step_index``), units, momenta and denominators; and the places of the counters that
    count this step (None: all ``counters`` of them)."""
    rows = []
    for group in param_groups:
        params = [p for p in group["params"] if p.requires_grad]
        if params:
            units = [unit_of[p] for p in params]
            rows.append((group, params, [step_index[p] for p in params], units,
                         [u.view(p) for u, p in zip(units, params, strict=True)],
                         [u.view(p, u.denom) for u, p in zip(units, params, strict=True)]))
    counting = [i for row in rows for i in row[2]]
    return rows, (None if len(counting) == counters else
                  torch.tensor(counting, dtype=torch.int64))


def new_state(state: dict, p: torch.Tensor, exp_avg: torch.Tensor | None = None,
              exp_avg_sq: torch.Tensor | None = None) -> dict:
    """Adam's state for ``p`` in ``state`` (its dict in the optimizer's state), fp32 whatever
    ``p``'s dtype; ``exp_avg``, ``exp_avg_sq``: zeroed memory to take as the moments."""
    def zeros(given):
        return torch.zeros_like(p, dtype=torch.float32) if given is None else given
    state["step"] = torch.tensor(0.0, dtype=torch.float32)
    state["exp_avg"], state["exp_avg_sq"] = zeros(exp_avg), zeros(exp_avg_sq)
    return state


def init_states_in_unit_order(states, params: list[torch.Tensor],
                              units: list[list[torch.Tensor]]) -> None:
    """The state of ``params`` (none yet), their momenta back to back in one buffer in the
    order ``units`` (:func:`partition`) lays them out, and their variances in another: the
    freeze then takes that memory as the units' momentum and denominator instead of copying
    them into new memory (``MomentumUnit``, :func:`build_units`). Parameters on several
    devices or not strided get each its own, later."""
    if len(params) < 2 or len({p.device for p in params}) > 1 or \
            any(p.layout != torch.strided for p in params):
        return
    order = {p: i for i, p in enumerate(q for unit in units for q in unit)}
    params = sorted(params, key=lambda p: order.get(p, len(order)))
    sizes = [p.numel() for p in params]
    flat = [torch.zeros(sum(sizes), dtype=torch.float32, device=params[0].device)
            for _ in range(2)]
    for p, m, v in zip(params, flat[0].split(sizes), flat[1].split(sizes), strict=True):
        new_state(states[p], p, m.view(p.shape), v.view(p.shape))
