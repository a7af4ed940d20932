"""0/1 Adam's variance from every step's gradients: each rank folds in its own, the refreshes
average the ranks' (``ZeroOneAdam(local_variance=True)``, the default; issue 44).

Why: the paper's 0/1 Adam (and DeepSpeed's) moves the variance on its refresh steps alone, by
that step's averaged gradient: 64 of phase A's first 240 steps (at intervals 1, 2, 4, 8 at
``var_update_scaler=16``) and none in phase B. A coordinate's variance is then the squares of a
few gradients, a rare row's or class's seen by a refresh or not at all, and phase B divides by
it for the rest of the run. On ``char_mlp`` (benchmarks/fidelity.py, 2,000 steps, 3 seeds)
that 0/1 Adam ended 5.33% above Adam; with Adam's own variance through phase A, 4.17% above
(phase B's frozen variance); with refreshes every 8 steps for the whole run, 0.56% below, at
5.9x fewer bytes instead of 25x (docs/benchmarks.md, "Wider workloads").

How: after the exact stage every rank folds the square of its own gradient into its own copy
of the variance on every step, as Adam folds the averaged gradient's: ``v <- b2 v + (1 - b2) r
g_i**2``, sending nothing. A refresh averages the ranks' variances, one allreduce of the
variance where the paper's averaged that step's gradient (the same bytes; bf16 at
``warmup_bits`` 16 or 8, never int8), and the denominators
are made from the average, the same on every rank: the ranks stay alike. The refresh step's
momentum goes as any 1-bit step's. Refreshes: phase A's own schedule, and in phase B the first
sync of every :data:`PHASE_B_INTERVAL` steps. Between refreshes each rank's variance is its own:
checkpoints carry each rank's (``own_variances``) and the denominators as they are.

``r``: a rank's gradient is noisier than the average Adam folds (``E[g_i**2] = mu**2 + s**2``
against ``E[gbar**2] = mu**2 + s**2 / W``). Per block of ``BLOCK`` values, ``r`` is the block's
``E||gbar||**2`` over the ranks' mean ``E||g_i||**2``, both under Adam's average of the steps,
in ``[1/W, 1]``: the first from the ranks' CountSketches of their gradients averaged
(``core.variance_follow``'s, unbiased), the second exact, both in one small allreduce of
``WIDTH + 1`` values a block on every phase-A step and every sync. Until the first of them,
``r = 1/W`` (gradient noise dominating, as it does in most coordinates).

Costs: the refresh bytes as before; 1/680 of an fp32 value's bytes per value on every phase-A
step and sync (the samples) and a full fp32 variance allreduce every ``PHASE_B_INTERVAL`` steps
of phase B (0.25 bit per value a step at 128); memory: the variance is kept through phase B (4
bytes per parameter more than the paper's phase B), and under the DDP hook each local
gradient's square waits for ``step()`` in bf16 (2 bytes per parameter, within the step: a step
skipped for an inf/NaN gradient must not fold it).
"""

from __future__ import annotations

import torch

from onebit_plugin.comm.quantized import QuantizedAverage
from onebit_plugin.core import compression_stage
from onebit_plugin.core.exchanges import MomentumStep
from onebit_plugin.core.momentum import back_to_back
from onebit_plugin.core.variance_follow import (
    WIDTH,
    VarianceFollow,
    block_sums,
    blocks_of,
    mean_over_ranks_,
    times_blocks,
)
from onebit_plugin.settings.step_kinds import MOMENTUM, REFRESH
from onebit_plugin.wire.deferred import as_fp32

__all__ = ["NOISE", "PHASE_B_INTERVAL", "LocalVariance", "LocalVarianceStep", "average_",
           "due_at_sync", "fold_", "load_own", "own"]

# Phase B averages the ranks' variances at the first sync of every PHASE_B_INTERVAL steps. On
# char_mlp (3 seeds, 2,000 steps, a probe of this design with exact noise ratios) every 64
# steps ended +0.17% against Adam, every 128 +0.17% too (-0.33/+1.32/-0.48%), for half the
# bytes: 14 variance averages in phase B, 21x fewer bytes than Adam in all.
PHASE_B_INTERVAL = 128
NOISE = "local_noise"  # per block: [E||gbar||^2 (sketched), the ranks' mean E||g_i||^2]


class LocalVariance:
    """0/1 Adam's local variance (module docstring): its sketches' signs, drawn per step."""

    def __init__(self) -> None:
        self.sketches = VarianceFollow()
        self.bf16: QuantizedAverage | None = None  # the variance's average below 32 bits

    def averager(self, bits: int) -> QuantizedAverage | None:
        """The variance's average at ``warmup_bits=bits``: fp32 (None) at 32, else bf16. Not
        int8: a variance spans orders of magnitude inside a block, and a value below 1/254 of
        its block's largest would read 0 (a row masked that has a gradient)."""
        if bits == 32:
            return None
        if self.bf16 is None:
            self.bf16 = QuantizedAverage(16)
        return self.bf16

    def note(self, grad: torch.Tensor, t: int, sample: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What step ``t``'s local gradient ``grad`` brings: its square (bf16, as the DDP hook
        keeps it for ``step()``; every path rounds it alike) and, with ``sample`` (a step that
        sends its samples), its sample: per block, ``WIDTH`` sketch values, then the block's
        sum of squares."""
        square = as_fp32(grad).square()
        part = None
        if sample:
            part = torch.cat([self.sketches.summary(grad, t), block_sums(square.view(-1))])
        return square.to(torch.bfloat16), part

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        return self.sketches.buffers() + (self.bf16.buffers() if self.bf16 is not None else [])


class LocalVarianceStep(MomentumStep):
    """A 1-bit momentum step of phase A that folds every rank's gradient into its own variance
    and samples the noise ratio; with ``refresh``, the ranks' variances are averaged after it
    and the denominators made from the average (a refresh of phase A)."""

    def __init__(self, wire, refresh: bool) -> None:
        super().__init__(wire)
        self.refresh = refresh
        self.kind = REFRESH if refresh else MOMENTUM

    def step(self, opt) -> None:
        skipped = opt.skips.total
        compression_stage.momentum_step(opt)
        if opt.skips.total != skipped:  # skipped on every rank: nothing is folded
            return
        notes, lv, t = opt.handoff.local_notes, opt.policy.local_variance, opt.global_step
        for p in opt.trainable():
            if p not in notes and p.grad is not None:  # step()'s path: p.grad is local
                notes[p] = lv.note(p.grad, t)
        fold_(opt, notes, opt.handoff.clip_coef)
        sample_(opt, notes)
        if self.refresh:
            average_(opt)


def _ratio(opt, p: torch.Tensor, blocks: int) -> torch.Tensor:
    """``p``'s noise ratio ``r`` per block, in [1/W, 1]."""
    floor = 1.0 / opt.world_size
    noise = opt.state[p].get(NOISE)
    if noise is None:
        return torch.full((blocks,), floor, dtype=torch.float32, device=p.device)
    ratio = torch.where(noise[1] > 0, noise[0] / noise[1].clamp(min=1e-38),
                        torch.full_like(noise[1], floor))
    return ratio.clamp_(floor, 1.0)


@torch.no_grad()
def fold_(opt, notes: dict, coef: float | None = None) -> None:
    """Every trainable parameter's variance on this rank takes this step's local gradient,
    its square from ``notes`` (``LocalVariance.note``; none: a zero gradient) times ``r`` and
    the clipping coefficient's square ``coef**2``; its count advances."""
    scale = 1.0 if coef is None else coef * coef
    beta2_of = {p: g["betas"][1] for g in opt.param_groups for p in g["params"]}
    for p in opt.trainable():
        state, beta2 = opt.state[p], beta2_of[p]
        v = state["exp_avg_sq"].view(-1)
        v.mul_(beta2)
        note = notes.get(p)
        if note is not None:
            square = note[0].view(-1).to(torch.float32)
            times_blocks(square, _ratio(opt, p, blocks_of(p.numel())))
            v.add_(square, alpha=(1.0 - beta2) * scale)
        state["frozen_step"] = float(state["frozen_step"]) + 1.0


@torch.no_grad()
def sample_(opt, notes: dict) -> None:
    """The noise ratio's numbers from this step's samples (``notes``), averaged over the ranks
    in one allreduce (two levels on hosts of several ranks); nothing on one rank, whose ``r``
    stays 1."""
    world = opt.world_size
    if world == 1:
        return
    trainable = opt.trainable()
    parts = []
    for p in trainable:
        part = notes[p][1] if p in notes else None
        parts.append(part if part is not None else
                     torch.zeros(blocks_of(p.numel()) * (WIDTH + 1), device=p.device))
    flat = torch.cat(parts)
    mean_over_ranks_(opt, flat, "the local variance's samples allreduce")
    if not bool(torch.isfinite(flat).all()):
        return  # a rank's gradient was not finite (a local step it skipped): the next sample
    beta2_of = {p: g["betas"][1] for g in opt.param_groups for p in g["params"]}
    offset = 0
    for p in trainable:
        blocks = blocks_of(p.numel())
        part = flat[offset: offset + blocks * (WIDTH + 1)]
        offset += blocks * (WIDTH + 1)
        averaged = part[: blocks * WIDTH].view(blocks, WIDTH).square().sum(1)
        local = part[blocks * WIDTH:]
        beta2 = beta2_of[p]
        noise = opt.state[p].get(NOISE)
        if noise is None:
            noise = opt.state[p][NOISE] = torch.zeros(2, blocks, device=p.device)
        noise.mul_(beta2)
        noise[0].add_(averaged, alpha=1.0 - beta2)
        noise[1].add_(local, alpha=1.0 - beta2)


@torch.no_grad()
def average_(opt) -> None:
    """A refresh: every rank's variances averaged (one fp32 allreduce; bf16 at ``warmup_bits``
    16 or 8), then the denominators and masks made from the average, the same on every
    rank."""
    if opt.world_size > 1:
        # In the units' layout order, where warm-up laid the variances out back to back
        # (momentum.init_states_in_unit_order): averaged in their own memory, where a copy
        # cost 4 bytes per parameter at the refresh's peak (benchmarks/memory.py, 25.2M
        # parameters: +14.25 over Adam's peak, against +11.10 on a 1-bit step). A loaded
        # state lies elsewhere: a copy in the same order, so its ring sums every value in
        # the same order as the uninterrupted run.
        trainable = opt.trainable()
        ours = set(trainable)
        order = [p for unit in opt.units for p in unit.params if p in ours]
        order += [p for p in trainable if opt.unit_of(p) is None]
        variances = [opt.state[p]["exp_avg_sq"] for p in order]
        flat = back_to_back(variances, sum(v.numel() for v in variances))
        copied = flat is None
        if copied:
            flat = torch.cat([v.reshape(-1) for v in variances])
        mean_over_ranks_(opt, flat, "the local variance's allreduce",
                         opt.policy.local_variance.averager(opt.config.warmup_bits))
        if copied:
            for v, piece in zip(variances, flat.split([v.numel() for v in variances]),
                                strict=True):
                v.copy_(piece.view_as(v))
    compression_stage.remask(opt)


def due_at_sync(t: int, since: int) -> bool:
    """Whether phase B's sync at step ``t``, ``since`` steps after the last one, averages the
    variances: the first sync at or past each multiple of :data:`PHASE_B_INTERVAL`."""
    return t // PHASE_B_INTERVAL != (t - since) // PHASE_B_INTERVAL


def own(opt) -> list[torch.Tensor] | None:
    """This rank's own variances (each trainable parameter's, in order) once they differ from
    the other ranks' (the compression stage); None before."""
    if opt.switch_step is None:
        return None
    return [opt.state[p]["exp_avg_sq"].detach().clone() for p in opt.trainable()]


def load_own(opt, saved: list | None) -> None:
    """A checkpoint's :func:`own` back into this rank's state (after the parameters' state,
    which holds the saving rank 0's)."""
    if saved is None:
        return
    trainable = opt.trainable()
    if len(saved) != len(trainable):
        raise ValueError(f"the checkpoint's own variances hold {len(saved)} tensors, this "
                         f"optimizer has {len(trainable)} trainable parameters")
    for p, v in zip(trainable, saved, strict=True):
        if v.shape != p.shape:
            raise ValueError(f"a saved own variance has shape {tuple(v.shape)}, its parameter "
                             f"{tuple(p.shape)}")
        opt.state[p]["exp_avg_sq"].copy_(v)
