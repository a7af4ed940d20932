"""``make mutants``: does each test fail when what it names breaks?

Each mutant in ``MUTANTS`` is one deliberate defect (one or more text edits), applied alone to
a temporary copy of the working tree, with the tests that must fail under it. The tests run
unmutated first (they must pass there, or a "killed" would mean nothing), then once per mutant.

    make mutants                                     # all of them
    .venv/bin/python tests/mutants.py --list         # the list, without running
    .venv/bin/python tests/mutants.py NAME [NAME..]  # some of them (make mutants ARGS="NAME")

Verdicts: ``killed`` -- every test the mutant names failed (a parametrized test: at least one
of its cases), or errored in its setup; ``survived`` -- one of them passed; ``skipped`` -- one of
them was skipped (a missing package or compiler: nothing was shown); ``error`` -- pytest could
not run them (a test id that no longer exists, a collection error). The exit status is 1 unless
every mutant was killed.

The list covers the tests once found to stay green with what they name broken (issue 27 of the
project's tracker: a tolerance over a real defect, overlap, error feedback, resume and round-trip
tests, the mask, the Lightning, Fabric and Trainer paths) and at least one row each of
docs/guarantees.md (the ``row`` field; the soak row is a benchmark, not a test). Keep it current
as the code moves: a mutant whose text is no longer in its file stops the run.

Every process a run starts carries ``ONEBITMUTANTS_RUN=<id>`` in its environment (not an
``ONEBIT_`` name: the client-script tests drop those from their launchers' environments) and is
killed after each run, also when the runner is stopped by SIGTERM or SIGHUP.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_TAG = "ONEBITMUTANTS_RUN"
TIMEOUT = 900  # seconds per pytest run; a mutant that hangs a test past it counts as killed
IMPORTS = ".imports"  # in the copied tree: the folder PYTHONPATH names (_copy_tree)


@dataclass(frozen=True)
class Mutant:
    name: str
    row: str  # the finding or docs/guarantees.md row it stands for
    edits: tuple[tuple[str, str, str], ...]  # (path, old text, new text)
    tests: tuple[str, ...]


def _m(name, row, path, old, new, *tests):
    return Mutant(name, row, ((path, old, new),), tests)


OPT = "onebit_plugin/members/onebit_adam.py"
POLICY = "onebit_plugin/core/policy.py"
LOCAL_VARIANCE = "onebit_plugin/members/local_variance.py"
HOOK = "onebit_plugin/entry/ddp_hook.py"
AR = "onebit_plugin/comm/allreduce.py"
COLL = "onebit_plugin/comm/collectives.py"
UNIT = "onebit_plugin/core/momentum.py"
BASE = "onebit_plugin/core/base.py"
CKPT = "onebit_plugin/core/checkpoint.py"
CHECKS = "onebit_plugin/core/rank_checks.py"
MASKS = "onebit_plugin/maths/masks.py"
CONFIG = "onebit_plugin/settings/config.py"
ZERO_ONE = "onebit_plugin/members/zero_one_adam.py"
LOCAL = "onebit_plugin/members/local_steps.py"
AVERAGE = "onebit_plugin/core/gradient_average.py"

MUTANTS = [
    # ---------------------------------------------------------------- issue 27's findings
    _m("hook-warmup-divides", "finding: the hook's warm-up is DDP's average bit for bit",
       AVERAGE,
       "buffer.mul_(1.0 / hook.world_size)", "buffer.div_(hook.world_size)",
       "tests/test_ddp_hook.py::test_warmup_hook_gradients_equal_ddp_default"),
    _m("comm-inline", "finding: the hook overlaps, not blocks", AR,
       "        comm_executor(self.group).submit(job)\n", "        job()\n",
       "tests/test_ddp_hook.py::"
       "test_a_units_average_completes_after_its_hook_returned_and_before_backward_returns"),
    _m("no-server-error-feedback", "finding: error feedback (server side)", AR,
       "            server_compress(w.recv_packed,",
       "            errors[\"server\"].zero_()\n            server_compress(w.recv_packed,",
       "tests/test_optimizer.py::"
       "test_error_feedback_makes_the_running_mean_track_the_exact_momentum"),
    _m("no-worker-error-feedback", "finding: error feedback (worker side)", AR,
       "        worker_compress(tensor, errors[\"worker\"],",
       "        errors[\"worker\"].zero_()\n        worker_compress(tensor, errors[\"worker\"],",
       "tests/test_optimizer.py::"
       "test_error_feedback_makes_the_running_mean_track_the_exact_momentum"),
    _m("units-zeroed-errors", "finding: the units hand their own errors to every call", UNIT,
       "return comm.reduce_(self.fold(grads), self.plan, self.errors, decode=decode)",
       "return comm.reduce_(self.fold(grads), self.plan, self.plan.new_errors(), "
       "decode=decode)",
       "tests/test_optimizer.py::"
       "test_error_feedback_makes_the_running_mean_track_the_exact_momentum"),
    _m("lightning-resume-ignored", "finding: the Lightning warm-up resume is a resume",
       "examples/train_lightning.py", "ckpt_path=args.resume)", "ckpt_path=None)",
       "tests/test_lightning.py::test_resume_in_warm_up_continues_the_uninterrupted_run_bitwise"),
    _m("trainer-resume-ignored", "finding: the Trainer's resume is a resume",
       "examples/train_hf_trainer.py", "trainer.train(resume_from_checkpoint=args.resume)",
       "trainer.train()",
       "tests/test_hf_trainer.py::test_trainer_under_onebit_run_compresses_and_resumes_bitwise"),
    _m("load-state-dict-loads-nothing", "finding: a resume after a fault loads the state", BASE,
       "    def load_state_dict(self, state_dict: dict) -> None:\n",
       "    def load_state_dict(self, state_dict: dict) -> None:\n        return\n",
       "tests/test_faults.py::test_training_resumes_from_the_last_checkpoint_after_a_fault"),
    _m("rank-files-load-nothing", "finding: the per-rank files' round trip",
       "integrations/rank_states.py", "        optimizer.load_onebit_state_dict(state)\n",
       "        pass\n",
       "tests/test_rank_states.py::test_each_ranks_own_errors_come_back_from_its_file"),
    _m("unit-loads-no-errors", "finding: the units' round trip; row: exact resume", UNIT,
       "            e.copy_(state[name])\n", "            pass\n",
       "tests/test_one_path.py::test_units_survive_a_state_dict_round_trip[True]",
       "tests/test_rank_states.py::test_each_ranks_own_errors_come_back_from_its_file",
       "tests/test_optimizer.py::test_resume_in_compression_stage_across_ranks"),
    _m("step-counter-to-device", "finding: step counters stay on the CPU; row: GPU path", CKPT,
       'v.to(device="cpu" if k == "step" else p.device, copy=True))',
       "v.to(device=p.device, copy=True))",
       "tests/test_optimizer.py::test_step_counters_are_never_moved_to_a_device_on_resume"),
    _m("zero-variance-not-masked", "finding: the mask, not only the 0/0; row: no silent stall",
       MASKS, "    if not mask_zero_variance:\n", "    if True:\n",
       "tests/test_nonfinite.py::"
       "test_a_parameter_without_gradients_in_warmup_stays_finite_after_the_freeze"),
    _m("units-twice-ddps-bucket", "finding: the Lightning path equals the plain path", BASE,
       "self._unit_cap_bytes = int(bucket_bytes)", "self._unit_cap_bytes = 2 * int(bucket_bytes)",
       "tests/test_lightning.py::"
       "test_lightning_equals_the_plain_path_and_compress_momentum_false_is_exact[True]"),
    _m("fabric-clips-with-torch", "finding: the Fabric check runs the default settings",
       "integrations/fabric_strategy.py",
       "            if not isinstance(optimizer, OneBitOptimizer):\n"
       "                return super().clip_gradients_norm(",
       "            if True:\n                return super().clip_gradients_norm(",
       "tests/test_fabric.py::test_fabric_with_default_settings_ends_on_the_plain_loops_bits"),
    _m("trainer-length-not-handed", "finding: freeze_step='auto' through a real Trainer",
       "integrations/transformers_trainer.py",
       "                inner.set_total_steps(int(num_training_steps))\n",
       "                pass\n",
       "tests/test_hf_trainer.py::"
       "test_freeze_step_auto_freezes_at_the_ceiling_of_a_real_trainer_run"),
    # -------------------------------------------------------- docs/guarantees.md, row by row
    _m("warmup-bias-correction", "row: warm-up is torch Adam bit for bit",
       "onebit_plugin/maths/update.py", "        torch._foreach_div_(denoms, roots[start:end])\n",
       "        torch._foreach_mul_(denoms, [1 / r for r in roots[start:end]])\n",
       "tests/test_optimizer.py::test_warmup_equals_torch_adam_bitwise"),
    _m("lockstep-sees-nothing", "row: lockstep", "onebit_plugin/entry/lockstep.py",
       "        if torch.equal(other, gathered[0]):\n", "        if True:\n",
       "tests/test_bad_input.py::test_check_lockstep_passes_and_catches_one_ulp"),
    _m("resume-other-world-size", "row: another world size restarts the error feedback", CKPT,
       'if onebit["switch_step"] is not None and saved_world != opt.world_size:',
       'if onebit["switch_step"] is not None and saved_world != opt.world_size and False:',
       "tests/test_optimizer.py::"
       "test_a_compression_stage_state_resumes_on_another_world_size_errors_restarted"),
    _m("no-drain-before-ddp", "row: GPU path (the last bucket drains)", HOOK,
       "            if self.submitted:\n", "            if False:\n",
       "tests/test_ddp_hook.py::test_the_last_buckets_hook_returns_after_every_unit_is_averaged"),
    # The C update pass (the CPU default) gets the bound as this argument.
    _m("unbounded-steps", "row: bounded steps", "onebit_plugin/maths/update.py",
       "None if bounds[i] is None else corrections[i] * bounds[i]))", "None))",
       "tests/test_bounded_steps.py::test_a_rarely_seen_coordinate_moves_at_most_lr_per_step"),
    _m("auto-ceiling-25", "row: freeze_step='auto'", "onebit_plugin/maths/freeze.py",
       "CEILING = 0.20", "CEILING = 0.25",
       "tests/test_auto_freeze.py::test_drifting_gradients_freeze_at_the_ceiling"),
    _m("nonfinite-not-skipped", "row: a non-finite gradient skips the step everywhere", AR,
       "        if not bool(torch.isfinite(w.all_scales).all()):\n            return False\n",
       "        if False:\n            return False\n",
       "tests/test_nonfinite.py::test_nonfinite_gradient_on_one_rank_skips_the_step_on_all"),
    _m("no-own-group-timeout", "row: faults (processes end within comm_timeout)", COLL,
       "        return dist.new_group(ranks=ranks, timeout=timeout, **eager)",
       "        return dist.new_group(ranks=ranks, **eager)",
       "tests/test_faults.py::test_survivor_fails_clearly_and_exits_within_the_timeout"
       "[hang-optimizer-side]"),
    _m("nccl-waits-sleep-a-millisecond", "row: GPU path, what the CPU can show", COLL,
       "        if timeout is not None and _is_nccl(group):",
       "        if False:",
       "tests/test_faults.py::"
       "test_an_nccl_wait_with_comm_timeout_polls_instead_of_sleeping_a_millisecond"),
    _m("every-rank-reads-every-ranks-errors", "row: GPU path, what the CPU can show",
       "integrations/rank_states.py",
       "[r if i == keep else None for i, r in enumerate(ranks)]", "list(ranks)",
       "tests/test_rank_states.py::"
       "test_each_rank_reads_only_its_own_errors_from_a_strategys_checkpoint"),
    _m("strategies-read-the-whole-checkpoint", "row: GPU path, what the CPU can show",
       "integrations/rank_states.py",
       "    if given is not None and not _is_torch_io(given):\n        yield",
       "    if True:\n        yield",
       "tests/test_rank_states.py::"
       "test_the_strategies_read_checkpoints_through_the_own_rank_reader"),
    _m("auto-check-holds-every-root", "row: freeze_step='auto'", "onebit_plugin/maths/freeze.py",
       "        then_step, then = self.snapshots[0]\n",
       "        then_step, then = self.snapshots[0]\n"
       "        now = [lambda t=t: t for t in [r() for r in now]]\n",
       "tests/test_auto_freeze.py::"
       "test_a_check_holds_one_parameters_roots_at_a_time_and_reuses_the_oldest_snapshot"),
    _m("auto-snapshot-memory-not-reused", "row: freeze_step='auto'",
       "onebit_plugin/maths/freeze.py",
       "kept.append(_to_host(r, o))", "kept.append(_to_host(r, None))",
       "tests/test_auto_freeze.py::"
       "test_a_check_holds_one_parameters_roots_at_a_time_and_reuses_the_oldest_snapshot"),
    _m("negligible-root-reads-every-piece", "row: GPU path, what the CPU can show",
       "onebit_plugin/maths/masks.py",
       "    total = sum(torch.stack(pieces).tolist()) if pieces else 0",
       "    total = sum(float(x) for x in pieces)",
       "tests/test_auto_freeze.py::"
       "test_the_masking_threshold_reads_one_number_back_not_one_per_piece"),
    _m("changed-momentum-never-seen", "row: clipping", "onebit_plugin/core/handoff.py",
       "    if not pairs:\n        return []\n", "    return [False] * len(pairs)\n",
       "tests/test_clipping.py::"
       "test_an_unchanged_averaged_momentum_is_not_compared_a_changed_one_is_kept_beside_local"),
    _m("warmup-flags-never-read", "row: warm-up equals torch Adam", AVERAGE,
       "flat[:head].tolist() if missing else [1.0] * head", "[1.0] * head",
       "tests/test_optimizer.py::"
       "test_warmup_allreduce_goes_in_chunks_all_started_before_the_first_wait"),
    _m("sketch-whole-gradient", "row: clipping", "onebit_plugin/maths/norm_sketch.py",
       "SKETCH_PIECE = 1 << 20", "SKETCH_PIECE = 1 << 40",
       "tests/test_clipping.py::test_a_sketch_goes_in_pieces_and_its_signs_may_be_drawn_again"),
    _m("sketch-signs-drawn-again-differ", "row: clipping", "onebit_plugin/maths/norm_sketch.py",
       "        gen = torch.Generator(device=p.device).manual_seed(_SEED + self.index[p])",
       "        gen = torch.Generator(device=p.device).manual_seed(_SEED - self.index[p])",
       "tests/test_clipping.py::test_a_sketch_goes_in_pieces_and_its_signs_may_be_drawn_again"),
    _m("fingerprint-every-gradient-at-once", "row: GPU path, what the CPU can show",
       "onebit_plugin/core/rank_checks.py",
       "    sums = []\n    for p in params:\n",
       "    sums = []\n    held = [q.grad.double() for q in params if q.grad is not None]\n"
       "    for p in params:\n",
       "tests/test_bad_input.py::"
       "test_the_gradient_fingerprint_holds_one_gradient_in_float64_at_a_time"),
    _m("reader-only-before-the-default-io-is-made", "row: GPU path, what the CPU can show",
       "integrations/rank_states.py",
       "    if given is not None and not _is_torch_io(given):", "    if given is not None:",
       "tests/test_rank_states.py::"
       "test_the_strategies_read_checkpoints_through_the_own_rank_reader"),
    _m("backend-per-device-not-nccl", "row: GPU path, what the CPU can show", COLL,
       '    return "nccl" in str(backend)', '    return str(backend) == "nccl"',
       "tests/test_faults.py::test_nccl_watchdog_waits_longer_than_comm_timeout",
       "tests/test_faults.py::"
       "test_an_nccl_wait_with_comm_timeout_polls_instead_of_sleeping_a_millisecond"),
    _m("auto-snapshots-kept-after-the-freeze", "row: freeze_step='auto'",
       "onebit_plugin/maths/freeze.py",
       "            self.snapshots = []  # warm-up only", "            pass  # warm-up only",
       "tests/test_auto_freeze.py::test_stationary_gradients_freeze_at_the_first_settled_check"),
    _m("validation-between-syncs-not-synced", "row: 0/1 Adam",
       "integrations/stage_callback.py",
       "                opt.sync_local_steps()  # every rank validates",
       "                pass  # every rank validates",
       "tests/test_zero_one.py::test_a_validation_between_syncs_is_said_once_or_synced_first"),
    _m("subgroup-made-world-wide", "row: a data-parallel subgroup", COLL,
       "timeout=timeout, use_local_synchronization=True, **eager)",
       "timeout=timeout, **eager)",
       "tests/test_faults.py::test_a_data_parallel_subgroup_makes_its_own_group_alone"),
    _m("restart-from-oldest", "row: restart", "examples/train_torchrun.py",
       'sorted(Path(folder).glob("step*"), reverse=True)', 'sorted(Path(folder).glob("step*"))',
       "tests/test_restart.py::"
       "test_killed_rank_restarts_and_ends_where_the_uninterrupted_run_ends"),
    _m("lightning-every-rank-takes-rank0s-errors",
       "row: restart after a cut link / Lightning fit(ckpt_path='last')",
       "integrations/lightning_strategy.py",
       "            states = [own_rank_state(state, self.global_rank, self.world_size)",
       "            states = [own_rank_state(state, 0, self.world_size)",
       "tests/test_lightning.py::"
       "test_rank_zero_exits_when_its_peer_hangs_and_fit_resumes_from_last"),
    _m("late-rows-never-wake", "row: rows seen late", "onebit_plugin/core/compression_stage.py",
       "    return opt.config.mask_zero_variance and (",
       "    return False and opt.config.mask_zero_variance and (",
       "tests/test_late_rows.py::"
       "test_rows_first_drawn_after_the_freeze_train_alike_on_every_rank_and_path",
       "tests/test_late_rows.py::test_zero_one_adams_rows_wake_between_its_variance_averages"),
    _m("local-steps-note-no-late-rows", "row: rows seen late (0/1 Adam's phase B)",
       "onebit_plugin/members/local_steps.py",
       "                unit.late.note({p: grads.get(p) for p in unit.params})",
       "                unit.late.forget()",
       "tests/test_late_rows.py::test_zero_one_adams_rows_wake_between_its_variance_averages",
       "tests/test_hsdp.py::test_rows_first_drawn_after_the_freeze_wake_on_each_shard"),
    _m("streak-one-late", "row: no silent stall", "onebit_plugin/core/skips.py",
       "        if self.streak >= limit:", "        if self.streak > limit:",
       "tests/test_nonfinite.py::"
       "test_skipped_steps_are_said_each_time_and_a_streak_is_an_error"),
    _m("unfrozen-after-wrap-unseen", "row: a parameter unfrozen after DDP wrapped the model",
       CHECKS, "    outside_ddp = trainable_set - hook_params",
       "    outside_ddp = set() & trainable_set - hook_params",
       "tests/test_ddp_hook.py::"
       "test_a_parameter_unfrozen_after_ddp_wrapped_the_model_is_an_error_on_every_rank"
       "[warmup]"),
    _m("unaveraged-warmup-stepped", "row: a warm-up step on gradients DDP did not average",
       AVERAGE, "            rank_checks.check_reduced(opt.param_groups, opt.trainable(), "
       "opt.handoff.reduced)\n",
       "            pass\n",
       "tests/test_ddp_hook.py::"
       "test_a_warm_up_step_on_gradients_ddp_did_not_average_is_refused[frozen]"),
    _m("unfrozen-after-freeze-unseen", "row: a parameter frozen at the freeze", CHECKS,
       "    outside_units = trainable_set - unit_params if unit_params else set()",
       "    outside_units = set()",
       "tests/test_ddp_hook.py::"
       "test_a_parameter_frozen_at_the_freeze_is_left_out_and_unfreezing_it_is_an_error"
       "[False-False]"),
    _m("other-ranks-errors-taken", "row: another rank's errors are not loaded", CKPT,
       "if errors and saved_by is not None and saved_by != rank:",
       "if errors and saved_by is not None and saved_by != rank and False:",
       "tests/test_optimizer.py::test_another_ranks_errors_are_not_loaded_and_it_is_said"),
    _m("rank-file-of-another-checkpoint", "row: checkpoints (a foreign file is named)",
       "integrations/rank_states.py",
       "        if saved_at != (optimizer.global_step, optimizer.switch_step):",
       "        if False:",
       "tests/test_rank_states.py::test_round_trip_and_every_bad_file_names_itself"),
    _m("rank-file-unpickled-in-full", "row: checkpoints (a file from outside is data)",
       "integrations/rank_states.py", "states = torch.load(path, weights_only=True)",
       "states = torch.load(path, weights_only=False)",
       "tests/test_rank_states.py::test_a_crafted_file_runs_no_code_and_is_named"),
    _m("owned-processes-not-killed", "row: tests own their processes", "tests/procs.py",
       "        for pid in tagged(tag):\n", "        for pid in []:\n",
       "tests/test_faults.py::test_survivor_fails_clearly_and_exits_within_the_timeout"
       "[hang-ddp-hook]"),
    _m("negative-lr-accepted", "row: bad input", CONFIG,
       "if not isinstance(lr, float | int) or not lr >= 0:",
       "if not isinstance(lr, float | int):",
       "tests/test_optimizer.py::test_bad_hyperparameters_raise_value_error"),
    _m("c-block-mean", "row: one reference, three backends (C)", "kernels/cpu_compress.c",
       "float mean = tree_sum(terms, block, tile) / count;",
       "float mean = tree_sum(terms, block, tile) * (1.0f / count);",
       "tests/test_cpu_kernel.py::test_worker_pass_equals_the_reference"),
    _m("triton-block-mean", "row: one reference, three backends (Triton)",
       "kernels/sign_compress.py",
       "scale = tl.div_rn(_tree_sum(tl.abs(c), BYTES, LEVELS), count)",
       "scale = _tree_sum(tl.abs(c), BYTES, LEVELS) * (1.0 / count)",
       "tests/test_kernels.py::test_worker_compress"),
    _m("triton-approximate-divide", "row: one reference, three backends (the GPU's divide)",
       "kernels/sign_compress.py",
       "tl.div_rn(total, world.to(tl.float32))", "total / world",
       "tests/test_kernels.py::test_kernels_compile_for_a_gpu_without_one"),
    _m("clip-coefficient-ignored", "row: clipping with Adam's meaning",
       "onebit_plugin/core/handoff.py",
       "        coef = self.clip_coef if self.clip_coef is not None and self.clip_coef < 1 "
       "else None\n", "        coef = None\n",
       "tests/test_clipping.py::test_single_process_clips_the_gradient_inside_the_momentum"),
    _m("no-master-weights", "row: bf16 master weights", BASE,
       "        if not self.config.master_weights or p.dtype == torch.float32:\n",
       "        if True:\n",
       "tests/test_master_weights.py::test_bf16_master_weights_follow_the_fp32_run_bitwise"),
    _m("hook-copies-the-old-momentum", "row: one momentum path", HOOK,
       "                    unit.average_into(p, grad)",
       "                    grad.copy_(unit.view(p))",
       "tests/test_one_path.py::test_plain_and_hook_paths_are_bitwise_equal_over_several_units"),
    _m("exact-is-1bit", "row: compress_momentum=False is the exact allreduce", OPT,
       "exchange = OneBitMomentum() if config.compress_momentum else ExactMomentum()",
       "exchange = OneBitMomentum()",
       "tests/test_one_path.py::"
       "test_compress_momentum_false_is_the_exact_allreduce_on_every_path"),
    _m("masked-errors-kept-on-load", "row: a changed mask clears masked errors", UNIT,
       "                e.zero_()\n        self.plan.clear_masked_(self.errors)",
       "                e.zero_()",
       "tests/test_one_path.py::test_loading_under_a_changed_mask_clears_masked_errors"),
    Mutant("settings-not-checked-after-resume",
           "row: the settings check runs again after every load_state_dict",
           ((BASE, "        self.handoff.reset()\n        self._settings_checked = False\n",
             "        self.handoff.reset()\n"),),
           ("tests/test_one_path.py::"
            "test_settings_are_checked_again_on_the_first_step_after_a_resume",)),
    _m("strategy-class-not-importable", "row: every Lightning name fits (spawn pickles)",
       "integrations/lightning_strategy.py",
       '    OneBitAdamStrategy.__module__, OneBitAdamStrategy.__qualname__ = module, '
       '"OneBitAdamStrategy"\n', "",
       "tests/test_lightning.py::"
       "test_spawn_and_fork_strategies_fit_on_two_processes[onebit_adam_spawn]"),
    _m("callback-acts-per-micro-batch", "row: the callback acts once per optimizer step",
       "integrations/stage_callback.py",
       "            if opt is None or opt.global_step == self._last_step:\n",
       "            if opt is None:\n",
       "tests/test_lightning.py::"
       "test_bf16_mixed_accumulation_clipping_lockstep_logged_once_per_optimizer_step"),
    _m("accelerate-hook-never-paired", "row: reach (Accelerate under onebit-run)",
       "integrations/accelerate_flag.py",
       "        if self.onebit_hook_state is not None or not self._onebit_models \\\n",
       "        if True or self.onebit_hook_state is not None or not self._onebit_models \\\n",
       "tests/test_accelerate.py::test_unmodified_script_under_onebit_run[joint]"),
    _m("averaged-elsewhere-unsaid", "row: never a silent full allreduce", CHECKS,
       "    if same and not opt.averaged_elsewhere:",
       "    if False:",
       "tests/test_ddp_hook.py::"
       "test_gradients_averaged_before_step_are_said_once_and_no_ratio_is_reported"
       "[ddp-without-hook]"),
    _m("handoff-not-reset-after-step", "issue 28: the per-iteration reset exists once", BASE,
       "            self.handoff.reset()  # nothing of this iteration reaches the next\n",
       "            pass\n",
       "tests/test_clipping.py::test_every_path_clips_to_the_same_bits"),
    _m("key-bias-not-masked", "row: a gradient zero up to rounding is masked", MASKS,
       "        return torch.ge(denom, eps + negligible, out=out)\n",
       "        return torch.ge(denom, eps, out=out)\n",
       "tests/test_optimizer.py::test_attention_key_bias_moves_no_more_than_under_adam"),
    # 0/1 Adam (issue 29)
    _m("zero-one-refresh-counted-as-one-step", "row: 0/1 Adam's phase A", POLICY,
       '            s["frozen_step"] += gap\n', '            s["frozen_step"] += 1.0\n',
       "tests/test_zero_one.py::"
       "test_phase_a_in_one_process_is_adam_whose_variance_moves_only_on_refresh_steps"),
    _m("zero-one-refresh-weighted-as-one-step", "row: 0/1 Adam's phase A", POLICY,
       "            keep = beta2 ** gap\n", "            keep = beta2\n",
       "tests/test_zero_one.py::"
       "test_phase_a_in_one_process_is_adam_whose_variance_moves_only_on_refresh_steps"),
    _m("zero-one-old-refresh-counts-loaded", "row: 0/1 Adam's phase A", CKPT,
       '    if onebit.get("variance_clock") == "steps" or not opt.policy.keeps_variance or \\\n',
       '    if True or not opt.policy.keeps_variance or \\\n',
       "tests/test_zero_one.py::"
       "test_a_phase_a_state_from_before_steps_weighted_refreshes_is_a_clear_error"),
    _m("zero-one-local-bound-is-the-averages", "row: 0/1 Adam's phase B",
       LOCAL, "local_bound=local_bound(opt.world_size))", "local_bound=1.0)",
       "tests/test_zero_one.py::"
       "test_a_local_step_is_bounded_at_sqrt_w_lr_and_the_common_point_at_lr"),
    _m("zero-one-denominators-not-refreshed", "row: 0/1 Adam's phase A",
       "onebit_plugin/core/compression_stage.py",
       "    refresh_denominators(opt.units, opt.state,",
       "    (lambda *a: None)(opt.units, opt.state,",
       "tests/test_zero_one.py::"
       "test_phase_a_in_one_process_is_adam_whose_variance_moves_only_on_refresh_steps"),
    # follow_variance (issue 44)
    _m("follow-sketches-not-averaged", "row: follow_variance",
       "onebit_plugin/core/variance_follow.py", "    if local and world > 1:\n",
       "    if False:\n",
       "tests/test_variance_follow.py::"
       "test_ranks_follow_alike_and_the_following_sends_its_sketches_only_after_the_freeze"),
    _m("follow-scale-without-the-root", "row: follow_variance",
       "onebit_plugin/core/variance_follow.py",
       "(state[_MEAN] / ref.clamp(min=1e-38)).sqrt()", "(state[_MEAN] / ref.clamp(min=1e-38))",
       "tests/test_variance_follow.py::test_one_process_is_adam_frozen_at_the_freeze_whose_"
       "denominator_scales_with_the_gradients"),
    _m("follow-scales-eps-too", "row: follow_variance",
       "onebit_plugin/core/variance_follow.py",
       "        times_blocks(d.sub_(eps), target / state[_APPLIED]).add_(eps)\n",
       "        times_blocks(d, target / state[_APPLIED])\n",
       "tests/test_variance_follow.py::"
       "test_a_resume_masks_the_zero_variance_rows_as_the_uninterrupted_run_did"),
    _m("follow-factors-lost-on-resume", "row: follow_variance",
       "onebit_plugin/core/variance_follow.py",
       '            if "exp_avg_sq" in state and _APPLIED in state:\n',
       "            if False:\n",
       "tests/test_variance_follow.py::test_a_following_run_resumes_bitwise"),
    # 0/1 Adam's local_variance (issue 44)
    _m("local-variance-no-noise-ratio", "row: 0/1 Adam's local_variance", LOCAL_VARIANCE,
       "            times_blocks(square, _ratio(opt, p, blocks_of(p.numel())))\n", "",
       "tests/test_local_variance.py::"
       "test_the_averaged_local_variance_estimates_adams_variance_of_the_averaged_gradients"),
    _m("local-variance-not-averaged", "row: 0/1 Adam's local_variance", LOCAL_VARIANCE,
       "    if opt.world_size > 1:\n        # In the units' layout order",
       "    if False:\n        # In the units' layout order",
       "tests/test_local_variance.py::"
       "test_each_rank_feeds_its_own_variance_and_a_refresh_makes_them_one"),
    _m("local-variance-own-not-saved", "row: 0/1 Adam's local_variance", LOCAL_VARIANCE,
       "    if opt.switch_step is None:\n        return None\n",
       "    if True:\n        return None\n",
       "tests/test_local_variance.py::"
       "test_resume_is_bitwise_across_the_refreshes_and_phase_bs_average"),
    _m("local-variance-folds-a-skipped-step", "row: 0/1 Adam's local_variance",
       LOCAL_VARIANCE,
       "        if opt.skips.total != skipped:  # skipped on every rank: nothing is folded\n"
       "            return\n", "",
       "tests/test_local_variance.py::"
       "test_a_step_skipped_for_a_nonfinite_gradient_folds_nothing"),
    # 0/1 Adam's sparse_rows (issue 44)
    _m("sparse-rows-counts-unseen-rows", "row: 0/1 Adam's sparse_rows",
       "onebit_plugin/maths/sparse_rows.py",
       "    seen = variance.reshape(rows, -1).ne(0).any(dim=1)\n",
       "    seen = torch.ones(rows, dtype=torch.bool, device=variance.device)\n",
       "tests/test_sparse_rows.py::"
       "test_a_tensors_share_counts_its_zero_rows_among_the_rows_its_variance_has_seen"),
    _m("sparse-rows-share-a-unit", "row: 0/1 Adam's sparse_rows", UNIT,
       " or p in alone or current[-1] in alone)", ")",
       "tests/test_sparse_rows.py::"
       "test_the_freeze_gives_a_row_sparse_tensor_a_unit_that_sends_m_over_denom"),
    _m("sparse-rows-sync-sends-m", "row: 0/1 Adam's sparse_rows",
       "onebit_plugin/members/local_steps.py",
       "                if unit.send_bound is None:\n                    y.mul_(",
       "                if True:\n                    y.mul_(",
       "tests/test_sparse_rows.py::"
       "test_the_freeze_gives_a_row_sparse_tensor_a_unit_that_sends_m_over_denom"),
    _m("sparse-rows-not-summed-over-the-host", "row: 0/1 Adam's sparse_rows",
       "onebit_plugin/core/warmup_stage.py",
       "    total = opt.shards.sum_over_host_ if opt.shards is not None else None\n",
       "    total = None\n",
       "tests/test_hsdp.py::"
       "test_zero_one_reads_a_row_sharded_embedding_alike_on_every_rank_and_keeps_replicas_one"),
    _m("sparse-rows-in-one-process", "row: 0/1 Adam's sparse_rows",
       "onebit_plugin/core/compression_stage.py",
       "    return opt.world_size > 1 and p.numel() >= ALONE_MIN and \\\n",
       "    return p.numel() >= ALONE_MIN and \\\n",
       "tests/test_sparse_rows.py::"
       "test_one_process_compresses_nothing_and_so_sends_no_tensor_apart"),
    _m("sparse-rows-empty-shard-alone", "row: 0/1 Adam's sparse_rows",
       "onebit_plugin/core/compression_stage.py",
       "ALONE_MIN = 256 ", "ALONE_MIN = 0 ",
       "tests/test_hsdp.py::"
       "test_zero_one_reads_a_row_sharded_embedding_alike_on_every_rank_and_keeps_replicas_one",
       "tests/test_sparse_rows.py::"
       "test_a_table_too_small_for_a_unit_of_its_own_stays_with_its_neighbours"),
    _m("sparse-rows-not-agreed", "row: 0/1 Adam's sparse_rows",
       "onebit_plugin/members/zero_one_adam.py",
       '                "sparse_rows": int(self.sparse_rows_bound is not None)}',
       "}",
       "tests/test_sparse_rows.py::"
       "test_ranks_that_disagree_on_sparse_rows_are_refused_at_the_first_step"),
    _m("sparse-rows-stale-reads-kept", "row: 0/1 Adam's sparse_rows",
       "onebit_plugin/core/compression_stage.py",
       "        opt.state[p].pop(SHARE, None)\n",
       "        opt.state[p].get(SHARE, None)\n",
       "tests/test_sparse_rows.py::test_resuming_with_the_other_setting_is_said_once_and_goes_on"),
    # Memory (issue 30)
    _m("fold-buffer-made-up-front", "row: memory", UNIT,
       "        self._local = None\n        if local is not None:",
       "        self._local = None\n        self._set_local(torch.empty_like(self.momentum))\n"
       "        if local is not None:",
       "tests/test_memory.py::"
       "test_under_the_ddp_hook_the_compression_stage_holds_errors_wire_and_masks_only"),
    _m("hook-decodes-into-the-fold-buffer", "row: memory", UNIT,
       "        elif out.dtype == torch.float32 and out.is_contiguous() and not out.is_cuda:",
       "        elif False:",
       "tests/test_memory.py::"
       "test_under_the_ddp_hook_the_compression_stage_holds_errors_wire_and_masks_only"),
    _m("variance-kept-beside-the-denominator", "row: memory", UNIT,
       "_denominator(params, state, groups, not keep_variance)",
       "_denominator(params, state, groups, False)",
       "tests/test_memory.py::test_the_frozen_denominator_takes_the_variances_memory"),
    _m("zero-one-variance-kept-in-phase-b", "row: memory", LOCAL,
       '            opt.state[p].pop("exp_avg_sq", None)\n', "",
       "tests/test_memory.py::"
       "test_zero_one_drops_the_variance_when_phase_b_begins_and_keeps_no_fold_buffer"),
    # 1-bit LAMB and DeepSpeed configs (issue 31)
    _m("lamb-no-trust-ratio", "row: 1-bit LAMB", "onebit_plugin/maths/lamb_update.py",
       "        ratio = trust_ratio(p, u, max_coeff=max_coeff, min_coeff=min_coeff)\n",
       "        ratio = 1.0\n", "tests/test_lamb.py::test_the_warm_up_is_lamb"),
    _m("lamb-unbounded", "row: 1-bit LAMB", UNIT,
       "            x.clamp_(-self.send_bound, self.send_bound)\n", "",
       "tests/test_lamb.py::"
       "test_the_bound_keeps_rare_embedding_rows_near_lambs_and_without_it_they_grow",
       "tests/test_lamb.py::test_each_rank_sends_its_momentum_over_the_denominator_clamped_at_3"),
    _m("lamb-sends-the-momentum", "row: 1-bit LAMB", UNIT,
       "        return self.bound_(self.fold(grads).materialize().div_(self.denom))\n",
       "        return self.bound_(self.fold(grads).materialize())\n",
       "tests/test_lamb.py::test_each_rank_sends_its_momentum_over_the_denominator_clamped_at_3"),
    _m("lamb-auto-ceiling-adams", "row: 1-bit LAMB", "onebit_plugin/members/onebit_lamb.py",
       "    auto_ceiling = 0.15\n", "    auto_ceiling = 0.20\n",
       "tests/test_lamb.py::test_auto_freezes_at_15_percent_of_the_run_at_the_latest"),
    _m("lamb-inf-clamped-to-finite", "row: 1-bit LAMB", UNIT,
       "            x.masked_fill_(finite.logical_not(), math.nan)\n", "",
       "tests/test_lamb.py::test_a_non_finite_gradient_skips_the_step_instead_of_being_clamped"),
    _m("lamb-factor-unthresholded", "row: 1-bit LAMB", "onebit_plugin/maths/lamb_update.py",
       "    return min(max(factor, last * (1.0 - factor_threshold)), "
       "last * (1.0 + factor_threshold))", "    return factor",
       "tests/test_lamb.py::test_the_factor_is_clipped_to_its_bounds_and_to_its_relative_change"),
    _m("lamb-frozen-ratio-raw", "row: 1-bit LAMB", "onebit_plugin/members/onebit_lamb.py",
       'state.get("lamb_coeff", 0.0) / weight if weight else 1.0',
       'state.get("lamb_coeff", 0.0) if weight else 1.0',
       "tests/test_lamb.py::"
       "test_the_frozen_ratio_is_the_bias_corrected_average_of_the_warm_up_ratios"),
    _m("deepspeed-unknown-key-accepted", "row: 1-bit LAMB",
       "onebit_plugin/entry/deepspeed_config.py",
       "    unknown = sorted(set(given) - set(accepted))", "    unknown = []",
       "tests/test_deepspeed_config.py::test_bad_configs_are_refused_by_name"),
    _m("deepspeed-mask-dropped", "row: 1-bit LAMB", "onebit_plugin/entry/deepspeed_config.py",
       "    params, masks = _masks_of_groups(list(params))", "    masks = {}",
       "tests/test_deepspeed_config.py::test_deepspeeds_momentum_mask_becomes_a_mask"),
    _m("zero-one-refresh-before-the-units", "row: 0/1 Adam's phase A",
       "onebit_plugin/core/base.py",
       "        self.prepare_stage()\n        self.exchange_for(", "        self.exchange_for(",
       "tests/test_zero_one.py::test_resume_is_bitwise_in_every_phase[paper-9]"),
    _m("zero-one-hook-sends-in-local-steps", "row: a local step sends nothing", LOCAL,
       "        local: torch.futures.Future = torch.futures.Future()\n"
       "        local.set_result(bucket.buffer())\n        return local\n",
       "        return hook.average_units(bucket)\n",
       "tests/test_zero_one.py::"
       "test_a_local_step_sends_nothing_and_a_sync_sends_one_compressed_allreduce_per_unit"),
    _m("zero-one-sync-point-not-decayed", "row: 0/1 Adam's decay is AdamW's", LOCAL,
       "                x.mul_(self.decay[i])\n", "",
       "tests/test_zero_one.py::test_a_parameter_with_zero_gradient_decays_exactly_as_under_adamw"),
    _m("zero-one-no-landing", "row: bit-identical after every sync", LOCAL,
       "                write_back(p, x)\n", "",
       "tests/test_zero_one.py::test_ranks_differ_between_syncs_and_are_bit_identical_after_each"),
    _m("zero-one-own-params-not-saved", "row: 0/1 Adam resumes between syncs", ZERO_ONE,
       "        return local_steps.saved_state(opt)\n", "        return None\n",
       "tests/test_zero_one.py::test_resume_is_bitwise_in_every_phase",
       "tests/test_zero_one.py::"
       "test_between_syncs_each_rank_resumes_its_own_parameters_from_rank_0s_checkpoint"),
    # ------------------------------------------------------------ the seams (issue 43)
    _m("exchange-not-consulted", "issue 43: the policy's exchange is the one that runs",
       "onebit_plugin/core/policy.py", "            return self.warmup\n",
       "            return GradientAverage(warmup_step)\n",
       "tests/test_exchanges.py::"
       "test_the_policys_exchanges_are_called_by_step_clipping_and_the_hook_on_both_paths"),
    _m("hook-ignores-the-steps-exchange", "issue 43: the hook asks the step's exchange", HOOK,
       "    return opt.exchange_for(opt.global_step + 1).in_backward(opt, state, bucket)",
       "    return opt.policy.warmup.in_backward(opt, state, bucket)",
       "tests/test_exchanges.py::"
       "test_the_policys_exchanges_are_called_by_step_clipping_and_the_hook_on_both_paths"),
    _m("import-circle", "issue 43: no import circle, function-level imports included",
       "onebit_plugin/settings/schedule.py", "\n\n__all__ = [\"ZeroOneSchedule\"",
       "\n\n\ndef _late():\n    from onebit_plugin.core import policy  # noqa: F401\n\n\n"
       "__all__ = [\"ZeroOneSchedule\"",
       "tests/test_layout.py::test_no_import_circle_in_the_core"),
    _m("topology-group-not-used", "issue 43: the collectives take the topology's group",
       "onebit_plugin/comm/topology.py",
       "            self._group = new_group(self.process_group, timeout, device)\n",
       "            self._group = new_group(None, timeout, device)\n",
       "tests/test_faults.py::test_a_data_parallel_subgroup_makes_its_own_group_alone"),
    _m("zero-one-interval-counted-from-var-freeze-step", "issue 44: DeepSpeed's counting",
       "onebit_plugin/settings/schedule.py", "    doublings = (t - var_freeze_step - 2) // scaler",
       "    doublings = (t - var_freeze_step - 1) // scaler",
       "tests/test_zero_one.py::test_the_schedule_sends_what_deepspeeds_counters_sent_at_every_step"),
    _m("zero-one-phase-a-ends-at-var-freeze-step", "issue 44: DeepSpeed's counting",
       "onebit_plugin/settings/schedule.py", "        return self.var_freeze_step + 1\n",
       "        return self.var_freeze_step\n",
       "tests/test_zero_one.py::test_the_schedule_sends_what_deepspeeds_counters_sent_at_every_step"),
    _m("validation-sync-off-by-default", "issue 44: validation evaluates the common point",
       "integrations/stage_callback.py", "sync_before_validation: bool = True):",
       "sync_before_validation: bool = False):",
       "tests/test_zero_one.py::test_a_validation_between_syncs_is_said_once_or_synced_first"),
    # issue 45: warmup_bits
    _m("int8-padding-not-rezeroed", "issue 45: a non-finite step skipped everywhere",
       "onebit_plugin/comm/quantized.py", "        rows.values[n:].zero_()\n", "",
       "tests/test_warmup_bits.py::"
       "test_a_nonfinite_gradient_on_one_rank_skips_the_8_bit_step_everywhere"),
    _m("int8-c-pass-truncates", "issue 45: the passes' bits on every backend",
       "kernels/cpu_quantize.c", "        float r = (y + ROUNDER) - ROUNDER;\n",
       "        float r = truncf(y);\n",
       "tests/test_warmup_bits.py::test_the_three_passes_give_the_same_bits_on_every_backend",
       "tests/test_warmup_bits.py::"
       "test_quantization_is_round_to_nearest_within_a_254th_of_the_block_maximum"),
    _m("int8-triton-divides-approximately", "issue 45: the passes' bits on every backend",
       "kernels/int8_quantize.py", "    total = tl.div_rn(total, world.to(tl.float32))\n",
       "    total = total / world.to(tl.float32)\n",
       "tests/test_warmup_bits.py::"
       "test_the_int8_kernels_compile_for_a_gpu_with_correctly_rounded_divisions"),
    _m("warmup-bits-ignored-without-ddp", "issue 45: fewer bytes on every path", AVERAGE,
       "            self.quantizer(opt), opt.topology.levels(opt.comm_timeout, opt._device()))\n",
       "            None, opt.topology.levels(opt.comm_timeout, opt._device()))\n",
       "tests/test_warmup_bits.py::"
       "test_8_bit_warmup_keeps_the_ranks_identical_and_sends_a_quarter"),
    _m("a-rank-decodes-other-values", "issue 45: ranks identical",
       "onebit_plugin/comm/quantized.py",
       "        if self.bits == 8:\n            self._decode_int8(rows)\n",
       "        if self.bits == 8:\n            self._decode_int8(rows)\n"
       "            lay = rows.layout\n            if dist.get_rank(group) == 0:\n"
       "                rows.values[:lay.chunk] += 1e-3\n",
       "tests/test_warmup_bits.py::"
       "test_every_rank_decodes_the_same_average_at_a_quarter_or_half_of_fp32s_bytes"),
    # issue 43: a new user's trial
    Mutant("entry-module-read-half-made-by-its-frameworks-hook",  # what the hook did before
           "issue 43: entry modules import first",
           (("integrations/lightning.py",
             '            if f"onebit_plugin.integrations.{module}" not in sys.modules:\n'
             '                importlib.import_module(f"onebit_plugin.integrations.{module}")\n',
             "            if namespace in FABRIC_MODULES:\n"
             "                fabric_strategy_for(namespace)\n"
             "            else:\n                classes_for(namespace)\n"),),
           ("tests/test_lightning.py::test_each_entry_module_imports_first_in_a_new_process",)),
    _m("misspelt-argument-nearest-of-family-only", "issue 43: misspelt member arguments", CONFIG,
       "get_close_matches(key, [*own, *FamilyOptions.__annotations__], n=1)",
       "get_close_matches(key, list(FamilyOptions.__annotations__), n=1)",
       "tests/test_bad_input.py::test_a_misspelt_member_argument_names_the_members_own_nearest"),
    # issue 44: refresh_interval
    _m("refresh-weighs-one-step", "issue 44: refresh_interval", "onebit_plugin/core/policy.py",
       '            gap = max(float(s["step"]) + 1.0 - s["frozen_step"], 1.0)\n',
       "            gap = 1.0\n",
       "tests/test_refresh_interval.py::test_a_refresh_weighs_the_steps_it_stands_for"),
    _m("refresh-on-the-wrong-steps", "issue 44: refresh_interval", "onebit_plugin/core/policy.py",
       "t % self.refresh_interval == 0:", "t % self.refresh_interval == 1:",
       "tests/test_refresh_interval.py::"
       "test_refreshes_keep_ranks_identical_and_send_a_warmup_step_every_interval"),
    # issue 46: two levels
    _m("host-mean-not-divided", "issue 46: two levels", "onebit_plugin/comm/hierarchical.py",
       "        part.div_(local * hosts)\n", "        part.div_(hosts)\n",
       "tests/test_topology.py::"
       "test_the_exact_two_level_mean_sums_in_host_then_local_rank_order"),
    _m("hierarchical-skip-not-told-to-the-host", "issue 46: two levels",
       "onebit_plugin/comm/hierarchical.py",
       "        flag = torch.tensor([float(ok)], device=plan.device)\n",
       "        flag = torch.tensor([1.0], device=plan.device)\n",
       "tests/test_topology.py::"
       "test_the_two_level_1_bit_average_is_the_same_everywhere_and_unbiased_over_calls"),
    _m("shard-grads-pulled-once", "issue 47: sharded (HSDP)",
       "onebit_plugin/comm/shards.py",
       "            proxy.grad = None if p.grad is None else _local(p.grad)\n",
       "            if proxy.grad is None:\n"
       "                proxy.grad = None if p.grad is None else _local(p.grad)\n",
       "tests/test_hsdp.py::test_warmup_is_native_hsdp_with_torch_adam_bit_for_bit"),
    _m("dtensor-grads-not-zeroed", "issue 47: sharded (HSDP)",
       "onebit_plugin/comm/shards.py",
       "            if set_to_none:\n                p.grad = None\n",
       "            if set_to_none:\n                pass\n",
       "tests/test_hsdp.py::test_warmup_is_native_hsdp_with_torch_adam_bit_for_bit"),
    _m("sharded-checkpoint-drops-errors", "issue 47: sharded (HSDP)",
       "onebit_plugin/entry/sharded_checkpoint.py",
       '    rest = {"param_groups": groups, "state": state, "onebit": sd["onebit"],\n',
       '    rest = {"param_groups": groups, "state": state,\n'
       '            "onebit": dict(sd["onebit"], units=None),\n',
       "tests/test_hsdp.py::test_dcp_checkpoint_resumes_every_shard_bit_for_bit"),
    _m("replicate-group-not-checked", "issue 47: sharded (HSDP)",
       "onebit_plugin/comm/shards.py",
       "        if len(both) <= 1 and len(ranks) > 1:\n",
       "        if len(ranks) > 1:\n",
       "tests/test_hsdp.py::test_what_cannot_be_stepped_is_refused_by_name"),
    _m("checkpoint-metadata-unpickled-freely", "issue 47: sharded (HSDP)",
       "onebit_plugin/entry/sharded_checkpoint.py",
       "        obj = None\n        if module.startswith(_ALLOWED_MODULES)",
       "        return super().find_class(module, name)\n"
       "        obj = None\n        if module.startswith(_ALLOWED_MODULES)",
       "tests/test_hsdp.py::test_a_crafted_checkpoint_runs_no_code"),
    _m("lamb-ratio-of-the-shard", "issue 47: sharded (HSDP)",
       "onebit_plugin/members/onebit_lamb.py",
       "    def use_shards(self, shards) -> None:\n        self.host = shards\n",
       "    def use_shards(self, shards) -> None:\n        self.host = None\n",
       "tests/test_hsdp.py::test_onebit_lamb_takes_whole_parameters_norms_on_shards"),
    _m("lamb-factor-of-the-shards-largest", "issue 47: sharded (HSDP)",
       "onebit_plugin/comm/shards.py",
       "            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)\n",
       "            pass\n",
       "tests/test_hsdp.py::test_onebit_lamb_takes_whole_parameters_norms_on_shards"),
]

def _copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked, not ignored), and the package
    layout the editable install maps: onebit_plugin.kernels and onebit_plugin.integrations."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    for sub in ("kernels", "integrations"):
        (dest / "onebit_plugin" / sub).symlink_to(dest / sub, target_is_directory=True)
    # What PYTHONPATH names: the package alone. The tree's root would also put its kernels/
    # and integrations/ folders first on every process's path, over the PyPI packages of those
    # names (transformers imports Hugging Face's kernels, 0.19.1 on this machine, 2026-12-03:
    # the Trainer tests' ranks failed on an ImportError from the tree's kernels/).
    (dest / IMPORTS).mkdir()
    (dest / IMPORTS / "onebit_plugin").symlink_to(dest / "onebit_plugin",
                                                  target_is_directory=True)


def _check(mutants: list[Mutant], tree: Path) -> None:
    for m in mutants:
        for path, old, _ in m.edits:
            count = (tree / path).read_text().count(old)
            if count != 1:
                raise SystemExit(f"mutant {m.name}: its text occurs {count} times in {path} "
                                 f"(expected once): update tests/mutants.py")


def _kill_tagged(tag: str) -> None:
    needle = f"{RUN_TAG}={tag}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    os.kill(int(entry), signal.SIGKILL)


def _outcomes(report: Path) -> dict[str, tuple[str, str]]:
    """pytest's junit report as {node id: (outcome, first line of the message)}."""
    found = {}
    if not report.exists():
        return found
    for case in ET.parse(report).getroot().iter("testcase"):
        node = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or "").strip().splitlines()[:1]
                message = message[0][:160] if message else ""
                break
        found[node] = (outcome, message)
    return found


def _verdict(tests: tuple[str, ...], outcomes: dict, code: int) -> tuple[str, str]:
    """The mutant's verdict and, when killed, which case failed and how."""
    if code == -1:
        return "killed (timeout)", f"pytest ran past {TIMEOUT} s"
    shown = []
    for test in tests:
        cases = {n: o for n, o in outcomes.items() if n == test or n.startswith(test + "[")}
        if not cases:
            return f"error (pytest exit {code})", f"{test}: no result"
        bad = [(n, o) for n, o in cases.items() if o[0] in ("failed", "error")]
        if not bad:
            kind = "skipped" if any(o[0] == "skipped" for o in cases.values()) else "survived"
            return kind, f"{test}: {kind}"
        node, (outcome, message) = bad[0]
        shown.append(f"{node.split('::', 1)[1]} {outcome}: {message}")
    return "killed", "; ".join(shown)


def _pytest(tree: Path, tests: list[str], extra: list[str]) -> tuple[int, float, str, dict]:
    tag = uuid.uuid4().hex
    # No bytecode: a mutated file and its restored original may share a size and an mtime.
    env = dict(os.environ, PYTHONPATH=str(tree / IMPORTS), PYTHONDONTWRITEBYTECODE="1",
               **{RUN_TAG: tag})
    env.pop("PYTEST_ADDOPTS", None)
    report = tree / f"report-{tag}.xml"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            f"--junitxml={report}", *extra, *tests]
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        output, code = f"timed out after {TIMEOUT} s", -1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        _kill_tagged(tag)
    outcomes = _outcomes(report)
    report.unlink(missing_ok=True)
    return code, time.monotonic() - started, output, outcomes


def _stop(signum, frame):
    # The default action would end the runner without its cleanup: its pytest (a session of
    # its own) and the temporary copy would stay.
    raise SystemExit(f"stopped by signal {signum}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help="mutants to run (default: all)")
    p.add_argument("--list", action="store_true", help="print the list and exit")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the unmutated run of the tests (for iterating on one mutant)")
    args = p.parse_args(argv)
    known = {m.name: m for m in MUTANTS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        raise SystemExit(f"unknown mutants {unknown}; --list shows them")
    mutants = [known[n] for n in args.names] if args.names else MUTANTS
    if args.list:
        _check(mutants, ROOT)
        for m in mutants:
            print(f"{m.name:42} {m.row}\n{'':42} must fail: {', '.join(m.tests)}")
        return 0
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _stop)
    failed = False
    with tempfile.TemporaryDirectory(prefix="onebit-mutants-") as tmp:
        tree = Path(tmp)
        _copy_tree(tree)
        _check(mutants, tree)
        tests = sorted({t for m in mutants for t in m.tests})
        if not args.no_baseline:
            print(f"unmutated: {len(tests)} tests ...", flush=True)
            code, seconds, output, _ = _pytest(tree, tests, ["-n", "2", "--dist", "loadfile"])
            if code != 0:
                print(output[-6000:])
                print(f"unmutated: the tests do not pass (pytest exit {code}); a mutant's "
                      "failure would mean nothing")
                return 1
            print(f"unmutated: passed in {seconds:.0f} s", flush=True)
        rows = []
        for m in mutants:
            originals = {}
            for path, old, new in m.edits:
                target = tree / path
                originals.setdefault(target, target.read_text())
                text = target.read_text()
                if text.count(old) != 1:  # an earlier edit of this mutant took it
                    raise SystemExit(f"mutant {m.name}: its edits overlap in {path}")
                target.write_text(text.replace(old, new, 1))
            try:
                code, seconds, output, outcomes = _pytest(tree, list(m.tests), [])
            finally:
                for target, text in originals.items():
                    target.write_text(text)
            verdict, how = _verdict(m.tests, outcomes, code)
            if not verdict.startswith("killed"):
                failed = True
                print(output[-3000:])
            rows.append((m.name, verdict, seconds, m.tests))
            print(f"{m.name:42} {verdict:18} {seconds:6.0f} s  {how}", flush=True)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'mutant':{width}}  {'result':18}  {'s':>5}  tests that must fail")
    for name, verdict, seconds, tests in rows:
        shown = ", ".join(t.split("::", 1)[1] if "::" in t else t for t in tests)
        print(f"{name:{width}}  {verdict:18}  {seconds:5.0f}  {shown}")
    killed = sum(r[1].startswith("killed") for r in rows)
    print(f"\n{killed} of {len(rows)} mutants killed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
