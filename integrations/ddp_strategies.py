"""What the Lightning Trainer strategy (``lightning_strategy``) and the Fabric strategy
(``fabric_strategy``) share: both are DDP whose gradient sync is the 1-bit family's DDP comm
hook, registered under the same names with the same precisions and refusals; and, with the
Accelerate flag, the word at the end of a run that never compressed."""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import weakref

from onebit_plugin import OneBitOptimizer, register_onebit_hook

__all__ = ["STRATEGY_NAMES", "SUPPORTED_PRECISIONS", "check_precision", "ddp_kwargs",
           "pair", "register_names", "require_member", "say_at_exit_if_uncompressed",
           "settle_before_teardown"]

log = logging.getLogger("onebit_plugin")

# Precisions whose gradients can be folded into the momentum as they come out of backward.
# "16-mixed" scales the loss with a GradScaler: the scaled local gradients would enter the
# compressed momentum before the scaler could unscale them or skip an overflowed step.
SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
# name: DDP's start_method
STRATEGY_NAMES = {"onebit_adam": "popen", "onebit_adam_spawn": "spawn",
                  "onebit_adam_fork": "fork"}


def check_precision(precision) -> None:
    precision = str(precision)
    if precision not in SUPPORTED_PRECISIONS:
        raise ValueError(
            f"strategy='onebit_adam' supports precision {', '.join(SUPPORTED_PRECISIONS)}; "
            f"got {precision!r}. '16-mixed' needs a GradScaler, whose loss scale would "
            "enter the compressed momentum before overflowed steps can be skipped: use "
            "'bf16-mixed'."
        )


def ddp_kwargs(kwargs: dict, hook_options: tuple[str, ...]) -> dict:
    """The DDP strategy's keyword arguments: the comm-hook options refused (the 1-bit hook is
    the strategy's), ``gradient_as_bucket_view`` True unless the user said otherwise (no copy
    into DDP's buckets and back per step, and the hook can leave the units completed by the
    last bucket to ``step()``: ``onebit_plugin.entry.ddp_hook``)."""
    for taken in hook_options:
        if kwargs.get(taken) is not None:
            raise ValueError(f"the onebit_adam strategy registers its own DDP comm hook; "
                             f"{taken} cannot be set")
    return {"gradient_as_bucket_view": True, **kwargs}


def require_member(optimizers: list, needs: str) -> OneBitOptimizer:
    """The one optimizer of the 1-bit family among ``optimizers`` (unwrapped), else a clear
    error saying what the strategy ``needs``."""
    if len(optimizers) != 1 or not isinstance(optimizers[0], OneBitOptimizer):
        got = ", ".join(type(o).__name__ for o in optimizers) or "nothing"
        several = ("; for several optimizers (a GAN's), wrap each model in torch's "
                   "DistributedDataParallel and call onebit_plugin.register_onebit_hook("
                   "ddp_model, optimizer) for each pair (docs/limits.md)"
                   if len(optimizers) > 1 else "")
        raise ValueError(f"strategy='onebit_adam' needs {needs}; got {got}{several}")
    return optimizers[0]


def pair(model, optimizer: OneBitOptimizer, overlap: bool, comm_timeout: float | None,
         record_timeline: bool = False, local_world_size: int | None = None):
    """Register the 1-bit hook on the DDP ``model`` for ``optimizer``; returns its state.
    ``local_world_size``: the strategy's processes per node (the optimizer's ``topology``)."""
    if local_world_size:
        optimizer.set_local_world_size(local_world_size)
    state = register_onebit_hook(model, optimizer, overlap=overlap,
                                 record_timeline=record_timeline, comm_timeout=comm_timeout)
    settle_before_teardown()
    if not state.overlap:
        log.info("onebit: compressed allreduce runs in optimizer.step() (no overlap)")
    return state


def register_names(cls, strategy_registry, what: str) -> None:
    """``cls`` under every name of :data:`STRATEGY_NAMES` (``what``: its description)."""
    for name, start_method in STRATEGY_NAMES.items():
        strategy_registry.register(
            name, cls, description=f"{what} with start_method {start_method!r}",
            override=True, start_method=start_method)


def say_at_exit_if_uncompressed(optimizer: OneBitOptimizer) -> None:
    """Where nothing marks the end of training (a Fabric or Accelerate script's own loop): at
    the interpreter's exit, ``optimizer.training_ended()`` says whether nothing was compressed
    (a weak reference: the optimizer is not kept alive for it)."""
    ref = weakref.ref(optimizer)

    def at_exit() -> None:
        if (opt := ref()) is not None:
            opt.training_ended()

    atexit.register(at_exit)


_SETTLING: list = []


def settle_before_teardown() -> None:
    """Once per process: a ``gc.collect()`` right before the default process group is
    destroyed (``torch.distributed.destroy_process_group()``, which Lightning calls at exit and
    Accelerate's ``end_training()`` calls, wrapped) and at the interpreter's exit (where nothing
    destroys it and torch's teardown does). gloo now and then aborts a finished job after its
    last line ("terminate called without an active exception", SIGABRT): plain torch too,
    without this package (``benchmarks/exit_abort.py``: 10 of 20 runs on one machine), and 0 of
    20 with a ``gc.collect()`` before ``destroy_process_group()`` (docs/limits.md). The
    collection changes nothing else; a script that destroys a group it imported the function
    for beforehand is not reached (call ``gc.collect()`` first, as examples/train_torchrun.py)."""
    if _SETTLING:
        return
    import torch.distributed as dist

    destroy = dist.destroy_process_group

    @functools.wraps(destroy)
    def destroy_process_group(group=None):
        if group is None:
            gc.collect()
        return destroy(group)

    dist.destroy_process_group = destroy_process_group
    atexit.register(gc.collect)
    _SETTLING.append(destroy)
