"""OneBitAdam: Adam during warm-up, then frozen-variance Adam with a 1-bit momentum allreduce.

Warm-up (steps ``1..freeze_step``) is ``torch.optim.Adam`` -- or ``AdamW`` with
``decoupled_weight_decay=True`` -- operation for operation, on gradients averaged across ranks.
At the end of step ``freeze_step`` the variance stops changing; ``V = sqrt(v_hat) + eps`` is then
a fixed linear preconditioner, which is what lets error feedback cancel the compression error
(Tang et al., 2021, Theorem 1). From then on each rank folds its *local* gradient into the
momentum and the momenta are averaged by the compressed allreduce, so every rank applies the same
update.

Coordinates whose frozen variance is exactly zero never received a gradient during warm-up
(embedding rows of unseen tokens, padding); there ``V = eps`` and the sign compressor's
``+-scale`` for their zero momentum would be amplified by ``1/eps``. A plain implementation
diverged on a character-level model for that reason (design notes, section 6), so such
coordinates are masked: their momentum stays exactly zero and they are not sent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from onebit_plugin.allreduce import CompressedAllreduce, all_finite, wait_collectives
from onebit_plugin.compression import SCALE_RULES

__all__ = ["OneBitAdam"]

WARMUP = "warmup"
COMPRESSION = "compression"


def _adam_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: float,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
) -> None:
    """One Adam/AdamW step, the same operations in the same order as torch's single-tensor Adam
    (so fp32 results are bitwise equal). State is fp32; a low-precision param is updated through
    an fp32 copy and rounded once."""
    p = param if param.dtype == torch.float32 else param.float()
    grad = grad if grad.dtype == torch.float32 else grad.float()
    if weight_decay != 0:
        if decoupled:
            p.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(p, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
    if p is not param:
        param.copy_(p)


def _fold_gradient_(
    exp_avg: torch.Tensor,
    grad: torch.Tensor | None,
    param: torch.Tensor,
    *,
    beta1: float,
    weight_decay: float,
    decoupled: bool,
    out: torch.Tensor,
) -> None:
    """``out = b1 * m + (1 - b1) * g`` with a *local* gradient (coupled weight decay folded in);
    ``m`` itself is left alone until the average comes back. A missing gradient counts as zero:
    every rank must still send its momentum."""
    if grad is None:
        torch.mul(exp_avg, beta1, out=out)
        return
    grad = grad if grad.dtype == torch.float32 else grad.float()
    if weight_decay != 0 and not decoupled:
        grad = grad.add(param, alpha=weight_decay)
    torch.lerp(exp_avg, grad, 1 - beta1, out=out)


def _frozen_update_(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: float,
    frozen_step: float,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
) -> None:
    """The compression-stage update: the averaged momentum over the variance frozen at
    ``frozen_step`` (its bias correction frozen with it)."""
    p = param if param.dtype == torch.float32 else param.float()
    if weight_decay != 0 and decoupled:
        p.mul_(1 - lr * weight_decay)
    denom = (exp_avg_sq.sqrt() / (1 - beta2**frozen_step) ** 0.5).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-(lr / (1 - beta1**step)))
    if p is not param:
        param.copy_(p)


class OneBitAdam(Optimizer):
    """1-bit Adam (Tang et al., ICML 2021) as a ``torch.optim.Optimizer``.

    Use it like ``torch.optim.Adam`` in every process of a data-parallel job. Without DDP it
    averages gradients itself during warm-up (one fp32 allreduce per step) and runs the compressed
    momentum allreduce afterwards; in a single process it is Adam, then Adam with a frozen
    variance.

    Args:
        params: parameters or parameter groups, as for ``torch.optim.Adam``.
        lr: learning rate, > 0.
        betas: ``(beta1, beta2)``, each in ``[0, 1)``.
        eps: added to ``sqrt(v_hat)``, >= 0.
        weight_decay: L2 penalty (added to the gradient, as ``Adam``) or, with
            ``decoupled_weight_decay=True``, decoupled decay (as ``AdamW``); >= 0.
        freeze_step: number of uncompressed warm-up steps; the variance is frozen at the end of
            this step. Required. The paper uses 15-25% of the run; too short a warm-up freezes a
            variance that has not settled yet.
        decoupled_weight_decay: AdamW semantics for ``weight_decay``.
        max_block: values that share one fp32 scale in the compressed allreduce (multiple of 8).
            Each block costs 4 bytes beside its ``max_block / 8`` bytes of signs.
        scale: block scale rule of the compressor, ``"rms"`` (default) or ``"mean"``.
        mask_zero_variance: keep coordinates whose frozen variance is exactly 0 at zero momentum
            (see the module docstring). Turning it off reproduces the divergence it prevents.
        masks: optional ``{param: bool tensor of param's shape}``; False freezes that coordinate's
            momentum at zero in the compression stage (for example padding rows). Must be the
            same on every rank.
        process_group: group to average over (default: the world, when initialised).
        average_grads: average gradients across ranks during warm-up. Set False when something
            else already did (DDP without the onebit comm hook); the compression stage always
            communicates the momentum itself.
        compress_momentum: False averages the momentum with an exact fp32 allreduce in the
            compression stage: frozen-variance Adam without compression, the ablation that
            separates the cost of freezing the variance from the cost of the 1-bit exchange.
        comm_timeout: seconds any of OneBitAdam's own collectives may take before ``step()``
            raises ``CommunicationError`` (a peer rank died, hung or lost its link). Default:
            the process group's timeout (30 minutes for gloo).

    Attributes (for callbacks and logs): ``stage`` (``"warmup"`` or ``"compression"``),
    ``global_step`` (completed steps), ``switch_step`` (the step after which compression
    started, or None), ``bytes_sent`` (bytes this rank sent; warm-up allreduces counted as a
    ring allreduce of the tensor handed to it), ``dense_bytes`` (what an fp32 ring allreduce of
    the gradients would have sent over the same steps), ``compression_ratio``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int | None = None,
        *,
        decoupled_weight_decay: bool = False,
        max_block: int = 2048,
        scale: str = "rms",
        mask_zero_variance: bool = True,
        masks: dict[torch.Tensor, torch.Tensor] | None = None,
        process_group: dist.ProcessGroup | None = None,
        average_grads: bool = True,
        compress_momentum: bool = True,
        comm_timeout: float | None = None,
    ):
        _check_hparams(lr, betas, eps, weight_decay)
        if freeze_step is None:
            raise ValueError(
                "freeze_step is required: the number of uncompressed Adam warm-up steps "
                "(an int >= 1; 15-25% of the run is typical)"
            )
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(f"freeze_step must be an int >= 1, got {freeze_step!r}")
        if isinstance(max_block, bool) or not isinstance(max_block, int) or max_block < 8 or (
            max_block % 8
        ):
            raise ValueError(f"max_block must be a positive multiple of 8, got {max_block!r}")
        if scale not in SCALE_RULES:
            raise ValueError(f"scale must be one of {SCALE_RULES}, got {scale!r}")
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults)
        self.freeze_step = freeze_step
        self.max_block = max_block
        self.scale = scale
        self.mask_zero_variance = mask_zero_variance
        self.process_group = process_group
        self.average_grads = average_grads
        self.compress_momentum = compress_momentum
        if comm_timeout is not None and not comm_timeout > 0:
            raise ValueError(f"comm_timeout must be > 0 seconds, got {comm_timeout!r}")
        self.comm_timeout = None if comm_timeout is None else timedelta(seconds=comm_timeout)
        self._masks = {}
        for p, m in (masks or {}).items():
            if m.shape != p.shape:
                raise ValueError(
                    f"a mask has shape {tuple(m.shape)}, its parameter {tuple(p.shape)}"
                )
            self._masks[p] = m.to(device=p.device, dtype=torch.bool)
        _reject_sharded(self._trainable())
        devices = {p.device for p in self._trainable()}
        if len(devices) > 1:
            raise ValueError(
                f"OneBitAdam needs all parameters on one device, got {sorted(map(str, devices))}"
            )
        self.global_step = 0
        self.switch_step: int | None = None
        self.comm: CompressedAllreduce | None = None
        self._flat_momentum: torch.Tensor | None = None
        self._grad_flat: torch.Tensor | None = None
        self._uncompressed_sent = 0
        self._uncompressed_dense = 0
        # Set by onebit_plugin.ddp_hook.register_onebit_hook: the comm hook folds the gradient
        # into the momentum and averages it inside backward, and hands the averaged momentum
        # to step() through p.grad.
        self.momentum_from_hook = False
        self._hook_comms: dict[int, CompressedAllreduce] = {}  # by DDP bucket index
        self._saved_hook_comms: dict[int, dict] = {}  # loaded, not yet claimed by a bucket
        self._retired_sent = 0
        self._retired_dense = 0
        self.state_version = 0  # bumped by load_state_dict: hooks rebuild their views
        self.skipped_steps = 0  # steps skipped on every rank for a non-finite gradient
        self._skipped_by_hook: set = set()  # filled by the comm hook during backward
        self._local_momentum: torch.Tensor | None = None

    # ----------------------------------------------------------------------------- properties
    @property
    def stage(self) -> str:
        return WARMUP if self.switch_step is None else COMPRESSION

    @property
    def world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def _all_comms(self) -> list[CompressedAllreduce]:
        return ([self.comm] if self.comm is not None else []) + list(self._hook_comms.values())

    @property
    def bytes_sent(self) -> int:
        compressed = sum(c.bytes_sent for c in self._all_comms())
        return self._uncompressed_sent + self._retired_sent + compressed

    @property
    def dense_bytes(self) -> int:
        compressed = sum(c.dense_bytes for c in self._all_comms())
        return self._uncompressed_dense + self._retired_dense + compressed

    def count_uncompressed(self, nbytes: int) -> None:
        """Account an fp32 ring allreduce of ``nbytes`` made for this optimizer (warm-up)."""
        sent = _ring_bytes(nbytes, self.world_size)
        self._uncompressed_sent += sent
        self._uncompressed_dense += sent

    def attach_comm(self, key: int, comm: CompressedAllreduce) -> None:
        """Adopt the compressed allreduce of DDP bucket ``key`` (the comm hook's): its bytes
        count here, its errors are saved with this optimizer, and errors saved under the same
        key by a checkpoint are loaded into it. A comm it replaces is retired, counts kept."""
        old = self._hook_comms.pop(key, None)
        if old is not None:
            self._retired_sent += old.bytes_sent
            self._retired_dense += old.dense_bytes
        saved = self._saved_hook_comms.pop(key, None)
        if saved is not None:
            comm.load_state_dict(saved, counters=False)  # counts were folded into retired
        self._hook_comms[key] = comm

    def momentum_keep_mask(self, p: torch.Tensor) -> torch.Tensor:
        """Flat bool mask of ``p``'s coordinates that take part in the compression stage:
        a non-zero frozen variance (with ``mask_zero_variance``) and the user's mask."""
        keep = torch.ones(p.numel(), dtype=torch.bool, device=p.device)
        if self.mask_zero_variance:
            keep &= self.state[p]["exp_avg_sq"].reshape(-1) != 0
        if p in self._masks:
            keep &= self._masks[p].reshape(-1)
        return keep

    @property
    def compression_ratio(self) -> float:
        """``dense_bytes / bytes_sent`` over the run so far (inf while nothing was sent)."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else math.inf

    def _trainable(self) -> list[torch.Tensor]:
        # Fixed order, the same on every rank: the flat buffers are laid out in it.
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    @torch._disable_dynamo
    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "switch_step", None) is not None:
            raise ValueError(
                "cannot add a parameter group in the compression stage: the compressed momentum "
                "layout was fixed when the variance froze"
            )
        super().add_param_group(param_group)

    # ----------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p in self._trainable():
            if p.grad is not None and p.grad.is_sparse:
                raise ValueError("OneBitAdam does not support sparse gradients")
        self.global_step += 1
        if self.global_step == 1 and self.world_size > 1:
            self._check_ranks_agree()
        if self.switch_step is None:
            if self.average_grads and self.world_size > 1:
                self._average_gradients()
            self._warmup_step()
            if self.global_step >= self.freeze_step:
                self._freeze()
        else:
            self._compression_step()
        return loss

    def _check_ranks_agree(self) -> None:
        """First step: every rank must run the same configuration, or the ranks would switch
        stages at different steps or lay out the compressed momentum differently."""
        params = self._trainable()
        config = {
            "freeze_step": self.freeze_step,
            "max_block": self.max_block,
            "scale": SCALE_RULES.index(self.scale),
            "mask_zero_variance": int(self.mask_zero_variance),
            "compress_momentum": int(self.compress_momentum),
            "trainable parameters": len(params),
            "trainable values": sum(p.numel() for p in params),
        }
        local = torch.tensor(list(config.values()), dtype=torch.int64)
        if params and params[0].is_cuda:  # NCCL gathers device tensors
            local = local.to(params[0].device)
        world = self.world_size
        gathered = [torch.empty_like(local) for _ in range(world)]
        work = dist.all_gather(gathered, local, group=self.process_group, async_op=True)
        wait_collectives([work], self.comm_timeout, "the settings check", self.process_group)
        for i, name in enumerate(config):
            values = [int(g[i]) for g in gathered]
            if len(set(values)) > 1:
                raise ValueError(
                    f"OneBitAdam's {name} differs between ranks: {values} (rank 0..{world - 1});"
                    " every rank must use the same settings and parameters"
                )

    def _warmup_step(self) -> None:
        # After averaging every rank holds the same gradients, hence the same decision.
        if not all_finite([p.grad for p in self._trainable() if p.grad is not None]):
            self.skipped_steps += 1
            return
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p)
                state["step"] += 1
                _adam_update_(
                    p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"].item(),
                    lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    decoupled=group["decoupled_weight_decay"],
                )

    def _init_state(self, p: torch.Tensor) -> None:
        state = self.state[p]
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)

    def _average_gradients(self) -> None:
        """One fp32 allreduce of every trainable gradient (zeros where a rank has none) plus a
        has-gradient count per parameter, so that all ranks agree on which params step."""
        params = self._trainable()
        total = sum(p.numel() for p in params)
        if self._grad_flat is None or self._grad_flat.numel() != total + len(params):
            self._grad_flat = torch.empty(
                total + len(params), dtype=torch.float32, device=params[0].device
            )
        flat = self._grad_flat
        present = flat[total:]
        offset = 0
        for i, p in enumerate(params):
            view = flat[offset : offset + p.numel()]
            if p.grad is None:
                view.zero_()
                present[i] = 0.0
            else:
                view.copy_(p.grad.reshape(-1))
                present[i] = 1.0
            offset += p.numel()
        work = dist.all_reduce(flat, group=self.process_group, async_op=True)
        wait_collectives([work], self.comm_timeout, "the warm-up gradient allreduce",
                         self.process_group)
        world = self.world_size
        flat[:total].div_(world)
        self._uncompressed_sent += _ring_bytes(flat.nbytes, world)
        self._uncompressed_dense += _ring_bytes(4 * total, world)
        offset = 0
        for i, p in enumerate(params):
            view = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if present[i] == 0:
                continue
            if p.grad is None:
                p.grad = view.to(p.dtype, copy=True)
            else:
                p.grad.copy_(view)

    # --------------------------------------------------------------------------- compression
    def _freeze(self) -> None:
        """End of step ``freeze_step``: fix the variance, move every momentum into one flat fp32
        buffer (``state['exp_avg']`` become views of it) and build the compressed allreduce."""
        params = self._trainable()
        for p in params:
            if not self.state[p]:
                self._init_state(p)  # never had a gradient: v == 0, fully masked below
            self.state[p]["frozen_step"] = self.state[p]["step"].clone()
        if not self.momentum_from_hook:
            self._build_flat_state(params)
        self.switch_step = self.global_step

    def _build_flat_state(self, params: list[torch.Tensor]) -> None:
        total = sum(p.numel() for p in params)
        device = params[0].device
        flat = torch.empty(total, dtype=torch.float32, device=device)
        keep = torch.empty(total, dtype=torch.bool, device=device)
        offset = 0
        for p in params:
            state = self.state[p]
            n = p.numel()
            flat[offset : offset + n].copy_(state["exp_avg"].reshape(-1))
            state["exp_avg"] = flat[offset : offset + n].view_as(p)
            keep[offset : offset + n] = self.momentum_keep_mask(p)
            offset += n
        self._masked_coords = keep.logical_not().nonzero().view(-1)
        flat.index_fill_(0, self._masked_coords, 0.0)
        self._flat_momentum = flat
        # The folded local momentum goes here, so that a skipped step leaves exp_avg untouched.
        self._local_momentum = torch.empty_like(flat)
        self.comm = CompressedAllreduce(
            total, self.process_group, max_block=self.max_block, scale=self.scale, mask=keep,
            device=device, timeout=self.comm_timeout,
        )

    def _compression_step(self) -> None:
        if self.momentum_from_hook:
            # The hook averaged the momentum during backward; p.grad carries it, possibly
            # clipped since (by the same global norm on every rank, so still identical).
            skipped = self._skipped_by_hook
            for p in self._trainable():
                if p.grad is not None and p not in skipped:
                    self.state[p]["exp_avg"].copy_(p.grad)
            if skipped:
                self.skipped_steps += 1
            self._apply_frozen_updates(skip=skipped)
            skipped.clear()
            return
        if self._fold_and_average():
            self._apply_frozen_updates()
        else:
            self.skipped_steps += 1

    def _fold_and_average(self) -> bool:
        """Fold the local gradients into a copy of the momentum, average it into exp_avg.
        False (exp_avg untouched) when some rank's gradient was not finite."""
        local, offset = self._local_momentum, 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    _fold_gradient_(
                        self.state[p]["exp_avg"], p.grad, p, beta1=group["betas"][0],
                        weight_decay=group["weight_decay"],
                        decoupled=group["decoupled_weight_decay"],
                        out=local[offset : offset + p.numel()].view_as(p),
                    )
                    offset += p.numel()
        world = self.world_size
        if world > 1 and self.compress_momentum:
            self.comm(local, out=self._flat_momentum)
            return not self.comm.last_call_skipped
        if world > 1:
            work = dist.all_reduce(local, group=self.process_group, async_op=True)
            wait_collectives([work], self.comm_timeout, "the momentum allreduce",
                             self.process_group)
            local.div_(world)
            self.count_uncompressed(local.nbytes)
        if not all_finite([local]):  # the same on every rank after the allreduce
            return False
        local.index_fill_(0, self._masked_coords, 0.0)
        self._flat_momentum.copy_(local)
        return True

    def _apply_frozen_updates(self, skip: set | frozenset = frozenset()) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if not p.requires_grad or p in skip:
                    continue
                state = self.state[p]
                state["step"] += 1
                _frozen_update_(
                    p, state["exp_avg"], state["exp_avg_sq"], state["step"].item(),
                    state["frozen_step"].item(), lr=group["lr"], beta1=beta1, beta2=beta2,
                    eps=group["eps"], weight_decay=group["weight_decay"],
                    decoupled=group["decoupled_weight_decay"],
                )

    # ---------------------------------------------------------------------------- state dict
    def state_dict(self) -> dict:
        """Adam's state (``step``, ``exp_avg``, ``exp_avg_sq`` per param, fp32) plus the
        ``onebit`` entry of :meth:`onebit_state_dict` (this rank's)."""
        sd = super().state_dict()
        sd["onebit"] = self.onebit_state_dict()
        return sd

    def onebit_state_dict(self) -> dict:
        """What Adam's state does not hold: the stage, the switch step, byte counters and this
        rank's error buffers (flat, or per DDP bucket). Errors differ between ranks: each rank
        must save its own (the Lightning strategy and the Accelerate flag do)."""
        hook = {k: c.state_dict() for k, c in self._hook_comms.items()}
        hook.update({k: v for k, v in self._saved_hook_comms.items() if k not in hook})
        return {
            "global_step": self.global_step,
            "freeze_step": self.freeze_step,
            "switch_step": self.switch_step,
            "world_size": self.world_size,
            "uncompressed_sent": self._uncompressed_sent,
            "uncompressed_dense": self._uncompressed_dense,
            "retired_sent": self._retired_sent,
            "retired_dense": self._retired_dense,
            "comm": self.comm.state_dict() if self.comm is not None else None,
            "hook_comms": hook,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        onebit = state_dict.get("onebit")
        # torch casts loaded state to each param's dtype; keep our fp32 state fp32.
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        own = [p for g in self.param_groups for p in g["params"]]
        fp32 = {
            p: {k: v for k, v in state_dict["state"].get(i, {}).items() if torch.is_tensor(v)}
            for i, p in zip(saved_ids, own, strict=False)
        }
        super().load_state_dict(state_dict)
        for p, tensors in fp32.items():
            for k, v in tensors.items():
                self.state[p][k] = v.to(device=p.device if k != "step" else v.device, copy=True)
        self.state_version += 1
        self.comm, self._flat_momentum = None, None
        if onebit is not None:
            self.load_onebit_state_dict(onebit)
        elif self.switch_step is not None and not self.momentum_from_hook:
            self._build_flat_state(self._trainable())

    def load_onebit_state_dict(self, onebit: dict) -> None:
        """Load an :meth:`onebit_state_dict` (after Adam's state is in place): also how a rank
        puts back its own error buffers when the rest came from rank 0's checkpoint."""
        saved_world = onebit.get("world_size", self.world_size)
        if onebit["switch_step"] is not None and saved_world != self.world_size:
            raise ValueError(
                f"this OneBitAdam state was saved in the compression stage by {saved_world} "
                f"ranks and is loaded by {self.world_size}: its error buffers are sharded per "
                "rank; resume with the same world size"
            )
        self.global_step = int(onebit["global_step"])
        self.switch_step = onebit["switch_step"]
        self._uncompressed_sent = int(onebit["uncompressed_sent"])
        self._uncompressed_dense = int(onebit["uncompressed_dense"])
        saved_hook = dict(onebit.get("hook_comms") or {})
        self._retired_sent = int(onebit.get("retired_sent", 0))
        self._retired_dense = int(onebit.get("retired_dense", 0))
        self._retired_sent += sum(int(c["bytes_sent"]) for c in saved_hook.values())
        self._retired_dense += sum(int(c["dense_bytes"]) for c in saved_hook.values())
        self._hook_comms, self._saved_hook_comms = {}, saved_hook
        self.state_version += 1
        self.comm, self._flat_momentum = None, None
        if self.switch_step is not None and not self.momentum_from_hook:
            self._build_flat_state(self._trainable())
            if onebit["comm"] is not None:
                self.comm.load_state_dict(onebit["comm"])


SUPPORTED_SETUPS = (
    "plain torch.distributed (OneBitAdam averages by itself), DDP with register_onebit_hook, "
    "Lightning strategy='onebit_adam', Accelerate with ONEBIT_ADAM=1"
)


def _reject_sharded(params: list[torch.Tensor]) -> None:
    """FSDP and DeepSpeed ZeRO hand the optimizer shards of parameters; OneBitAdam averages
    whole momenta across data-parallel ranks and would silently mix unrelated shards."""
    for p in params:
        kind = None
        if type(p).__name__ == "DTensor" or hasattr(p, "_local_tensor"):
            kind = "FSDP2/DTensor-sharded"
        elif getattr(p, "_is_flat_param", False) or hasattr(p, "_fsdp_flattened"):
            kind = "FSDP-flattened"
        elif hasattr(p, "ds_id") or hasattr(p, "ds_tensor"):
            kind = "DeepSpeed ZeRO-partitioned"
        if kind is not None:
            raise ValueError(
                f"OneBitAdam got {kind} parameters; it supports unsharded data parallelism only: "
                f"{SUPPORTED_SETUPS}"
            )


def _ring_bytes(nbytes: int, world: int) -> int:
    return math.ceil(2 * (world - 1) / world * nbytes)


def _check_hparams(lr, betas, eps, weight_decay) -> None:
    if not isinstance(lr, float | int) or not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for name, b in zip(("betas[0]", "betas[1]"), betas, strict=True):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {b!r}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
