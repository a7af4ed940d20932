"""``transformers.Trainer`` checkpoints with each rank's OneBitAdam error buffers.

The Trainer saves ``optimizer.pt`` from the main process only and loads that one file on every
rank, which would give every rank rank 0's error buffers. Under ``onebit-run`` its optimizer
save and load also write and read ``onebit_rank<R>.pt`` in the checkpoint folder
(``rank_states``): the resumed run continues the uninterrupted one. Its ``max_steps`` reaches
the optimizer as the run's length, and a ``train()`` that never compressed says so.
"""

from __future__ import annotations

import functools
import logging

from onebit_plugin import OneBitOptimizer
from onebit_plugin.integrations.rank_states import load_rank_states, save_rank_states

log = logging.getLogger("onebit_plugin")

# Trainer methods that save and load the optimizer state (transformers 4.x and 5.x).
SAVE, LOAD = "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler"


def _onebit(trainer) -> list[OneBitOptimizer]:
    optimizer = getattr(trainer, "optimizer", None)
    optimizer = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper
    return [optimizer] if isinstance(optimizer, OneBitOptimizer) else []


def patch_trainer(trainer_cls) -> None:
    if getattr(trainer_cls, "_onebit_patched", False):
        return
    save, load = getattr(trainer_cls, SAVE, None), getattr(trainer_cls, LOAD, None)
    if save is None or load is None:
        log.warning(
            "onebit: this transformers.Trainer has no %s/%s: its checkpoints will hold rank "
            "0's OneBitAdam error buffers only, and a resumed run gives them to every rank. "
            "Resume from a checkpoint saved in warm-up, or pin transformers 4.x/5.x.",
            SAVE, LOAD)
        return

    @functools.wraps(save)
    def save_with_ranks(self, output_dir, *args, **kwargs):
        save(self, output_dir, *args, **kwargs)
        if optimizers := _onebit(self):
            save_rank_states(output_dir, self.args.process_index, self.args.world_size,
                             optimizers)

    @functools.wraps(load)
    def load_with_ranks(self, checkpoint, *args, **kwargs):
        load(self, checkpoint, *args, **kwargs)
        if checkpoint is not None and (optimizers := _onebit(self)):
            load_rank_states(checkpoint, self.args.process_index, self.args.world_size,
                             optimizers)

    create_scheduler = getattr(trainer_cls, "create_scheduler", None)
    if create_scheduler is not None:
        @functools.wraps(create_scheduler)
        def create_scheduler_with_total(self, num_training_steps, optimizer=None, *args,
                                        **kwargs):
            # The run's length (freeze_step="auto"'s ceiling; a fixed one past it is said). The
            # scheduler is made before prepare()
            # (then to_member reads the attribute from the optimizer it replaces) or,
            # in transformers 5.x, after it (then the optimizer is the member already).
            target = optimizer if optimizer is not None else self.optimizer
            inner = getattr(target, "optimizer", target)  # Accelerate's wrapper
            if isinstance(inner, OneBitOptimizer):
                inner.set_total_steps(int(num_training_steps))
            elif target is not None:
                target.onebit_total_steps = int(num_training_steps)
            return create_scheduler(self, num_training_steps, optimizer, *args, **kwargs)

        trainer_cls.create_scheduler = create_scheduler_with_total
    train = getattr(trainer_cls, "train", None)
    if train is not None:
        @functools.wraps(train)
        def train_and_say(self, *args, **kwargs):
            output = train(self, *args, **kwargs)
            for optimizer in _onebit(self):  # a run that never compressed says so
                optimizer.training_ended()
            return output

        trainer_cls.train = train_and_say
    setattr(trainer_cls, SAVE, save_with_ranks)
    setattr(trainer_cls, LOAD, load_with_ranks)
    trainer_cls._onebit_patched = True
