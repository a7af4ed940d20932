"""Lightning callback that reports the stage switch of an optimizer of the 1-bit family
(OneBitAdam, ZeroOneAdam), its progress and what the compression saves."""

from __future__ import annotations

from typing import Any

from onebit_plugin import OneBitOptimizer, check_lockstep


def make_callback_class(pl, module: str):
    """The callback of one Lightning namespace (``pytorch_lightning`` or ``lightning.pytorch``:
    their ``Callback`` base classes are distinct), to be bound at the top level of ``module``."""
    # The namespace's own rank_zero_info logs to its logger, which Lightning shows at INFO.
    rank_zero_info = pl.utilities.rank_zero_info
    rank_zero_warn = pl.utilities.rank_zero_warn

    class OneBitAdamCallback(pl.Callback):
        """Logs OneBitAdam's stage switch once, and per logging step the stage and bytes.

        * the switch: one rank-zero info line, and the metric ``onebit/switch_step`` (the last
          warm-up step) through every logger of the trainer, exactly once per run (resumes
          included: the callback's state is checkpointed);
        * once per optimizer step (not per micro-batch), every ``log_every_n_steps`` steps,
          through ``trainer.loggers``: ``onebit/stage``
          (0 warm-up, 1 compression), ``onebit/bytes_sent`` (this rank, cumulative),
          ``onebit/dense_bytes`` (what an fp32 allreduce would have sent) and
          ``onebit/compression_ratio`` (their ratio);
        * the progress bar shows ``onebit_stage`` (0 warm-up, 1 compression).
        * a member's own progress (``optimizer.progress()``) goes with them: for ZeroOneAdam
          ``onebit/phase`` (0 Adam, 1 phase A, 2 phase B), ``onebit/variance_refreshes``,
          ``onebit/local_interval`` (0 before phase B) and ``onebit/syncs``.

        Lockstep checks are made only where the ranks must agree: not between the syncs of
        ZeroOneAdam's local steps, where they differ by design. A validation that starts
        between those syncs is synced first by default, so that it evaluates the common point;
        with ``sync_before_validation=False`` it evaluates each rank's own parameters
        (``sync_dist`` averages their metrics), said once.

        Args:
            progress_bar: show ``onebit_stage`` in the progress bar.
            check_lockstep_every_n_steps: every N optimizer steps, verify that all ranks hold
                bit-identical parameters and the same optimizer stage
                (``onebit_plugin.check_lockstep``; one small all-gather), raising
                ``LockstepError`` otherwise. 0 (default) never checks.
            sync_before_validation: a validation that starts between ZeroOneAdam's syncs
                first calls ``sync_local_steps()`` on every rank (one 1-bit allreduce; the
                schedule goes on as it was), so that it evaluates the common point (default).
                False: the run's trajectory stays the one without validations, each rank
                validates its own point, and the first such validation is said.
        """

        def __init__(self, progress_bar: bool = True, check_lockstep_every_n_steps: int = 0,
                     sync_before_validation: bool = True):
            if check_lockstep_every_n_steps < 0:
                raise ValueError("check_lockstep_every_n_steps must be >= 0, got "
                                 f"{check_lockstep_every_n_steps}")
            self.progress_bar = progress_bar
            self.check_every = check_lockstep_every_n_steps
            self.sync_before_validation = sync_before_validation
            self._said_between_syncs = False
            self.switch_logged = False
            self.switch_step: int | None = None
            self._last_step = 0  # the optimizer's step count last acted on
            self.lockstep_checks = 0  # run in this process

        def on_train_start(self, trainer, pl_module) -> None:
            opt = self._optimizer(trainer)
            self._last_step = opt.global_step if opt is not None else 0  # resumed: restored

        @staticmethod
        def _optimizer(trainer) -> OneBitOptimizer | None:
            for opt in trainer.optimizers:
                opt = getattr(opt, "_optimizer", opt)  # a LightningOptimizer wraps it
                if isinstance(opt, OneBitOptimizer):
                    return opt
            return None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            opt = self._optimizer(trainer)
            # With accumulate_grad_batches=k only every k-th micro-batch stepped the optimizer.
            if opt is None or opt.global_step == self._last_step:
                return
            self._last_step = opt.global_step
            step = trainer.global_step
            compressing = opt.switch_step is not None
            if compressing and not self.switch_logged:
                self.switch_logged = True
                self.switch_step = opt.switch_step
                rank_zero_info(opt.switch_message())
                for logger in trainer.loggers:
                    logger.log_metrics({"onebit/switch_step": float(opt.switch_step)}, step=step)
            if self.progress_bar:
                pl_module.log("onebit_stage", float(compressing), prog_bar=True, logger=False,
                              on_step=True, on_epoch=False)
            if self.check_every and step % self.check_every == 0 and not opt.between_syncs:
                check_lockstep(pl_module.parameters(), opt)
                self.lockstep_checks += 1
            every = max(1, trainer.log_every_n_steps)
            if step % every == 0:
                metrics = {
                    **{f"onebit/{k}": v for k, v in opt.progress().items()},
                    "onebit/bytes_sent": float(opt.bytes_sent),
                    "onebit/dense_bytes": float(opt.dense_bytes),
                }
                if opt.bytes_sent:
                    metrics["onebit/compression_ratio"] = opt.dense_bytes / opt.bytes_sent
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=step)

        def on_validation_start(self, trainer, pl_module) -> None:
            opt = self._optimizer(trainer)
            if opt is None or not opt.between_syncs:
                return
            if self.sync_before_validation:
                opt.sync_local_steps()  # every rank validates, so every rank is here
                return
            if not self._said_between_syncs:
                self._said_between_syncs = True
                rank_zero_warn(
                    f"onebit: the validation at step {trainer.global_step} runs between "
                    "ZeroOneAdam's syncs: each rank evaluates its own parameters (sync_dist "
                    "averages their metrics), not the common point the next sync lands on, "
                    "which is better (on benchmarks/fidelity.py's GPT, 2,000 steps: rank 0's "
                    "own point +4.69% above Adam's loss, the common point two steps later "
                    "+0.55%). OneBitAdamCallback(sync_before_validation=True), the default, "
                    "syncs first.")

        def state_dict(self) -> dict[str, Any]:
            return {"switch_logged": self.switch_logged, "switch_step": self.switch_step}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.switch_logged = bool(state_dict["switch_logged"])
            self.switch_step = state_dict["switch_step"]

    OneBitAdamCallback.__module__, OneBitAdamCallback.__qualname__ = module, "OneBitAdamCallback"
    return OneBitAdamCallback
