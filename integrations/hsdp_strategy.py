"""Lightning strategy ``"onebit_hsdp"``: Lightning's ``ModelParallelStrategy`` laid out for
HSDP under the 1-bit family (``onebit_plugin.comm.shards``).

The device mesh is ``("replicate", "shard")``: a host's ranks along ``"shard"`` (Lightning's
devices per node, or ``shard_size``), the hosts along ``"replicate"``. The LightningModule
shards in ``configure_model`` over ``self.device_mesh["shard"]`` and gives its optimizer the
replicate group::

    def configure_model(self):
        for block in self.blocks:
            fully_shard(block, mesh=self.device_mesh["shard"])
        fully_shard(self, mesh=self.device_mesh["shard"])

    def configure_optimizers(self):
        return OneBitAdam(self.parameters(), lr=1e-3, freeze_step="auto",
                          process_group=self.device_mesh["replicate"].get_group())

Every rank reads its own batches (the sampler's replicas are the ranks, not the hosts), and
checkpoints are DCP folders written by ``onebit_plugin.save_sharded`` (the model, the
optimizer's sharded state, each rank's error buffers), read back by ``load_sharded``: a resumed
fit continues every shard bit for bit on the same mesh.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from onebit_plugin import OneBitOptimizer, load_sharded, save_sharded
from onebit_plugin.integrations.lightning_strategy import route_clipping

# Lightning's own pieces of a checkpoint (loops, callbacks, ...) beside the DCP folder.
META = "lightning.pt"


def make_hsdp_strategy_class(pl, callback_cls, module: str):
    """The strategy of one Lightning namespace, to be bound at the top level of ``module``."""
    from typing_extensions import override

    ModelParallelStrategy = pl.strategies.ModelParallelStrategy
    TrainerFn = pl.trainer.states.TrainerFn

    class OneBitHSDPStrategy(ModelParallelStrategy):
        """FSDP2 inside each host, the optimizer's 1-bit exchange across hosts.

        Args:
            shard_size: ranks per host, over which FSDP2 shards (default ``"auto"``: the
                devices per node); the hosts are the world size over it.
            add_callback: add ``OneBitAdamCallback`` (the stage switch logged, the progress
                metrics, 0/1 Adam synced before a validation between syncs) unless the trainer
                has one.
            **kwargs: ``ModelParallelStrategy``'s ``process_group_backend`` and ``timeout``.
                Checkpoints are always sharded (``save_distributed_checkpoint=False`` is
                refused: a full checkpoint would gather every shard on rank 0 and leave out the
                ranks' error buffers).

        ``configure_optimizers`` returns one optimizer of the family built over
        ``self.parameters()`` with ``process_group=self.device_mesh["replicate"].get_group()``
        (an LR scheduler beside it is fine). ``gradient_clip_val`` goes through the optimizer's
        ``clip_grad_norm_`` (over whole parameters: each shard's squares summed over the host),
        as under ``"onebit_adam"``; clipping by value is an error.
        """

        strategy_name = "onebit_hsdp"

        def __init__(self, shard_size: int | str = "auto", add_callback: bool = True,
                     **kwargs):
            for name in ("data_parallel_size", "tensor_parallel_size"):
                if name in kwargs:
                    raise TypeError(f"OneBitHSDPStrategy lays its mesh out as (hosts, "
                                    f"shard_size): {name} has no meaning here")
            if kwargs.pop("save_distributed_checkpoint", True) is not True:
                raise ValueError("OneBitHSDPStrategy writes sharded checkpoints only "
                                 "(onebit_plugin.save_sharded): save_distributed_checkpoint="
                                 "False is not supported")
            super().__init__(**kwargs)
            if shard_size != "auto" and (not isinstance(shard_size, int) or shard_size < 1):
                raise ValueError(f"shard_size must be 'auto' or an int >= 1, got {shard_size!r}")
            self._shard_size = shard_size
            self.add_callback = add_callback

        @override
        def setup_environment(self) -> None:
            from torch.distributed.device_mesh import init_device_mesh
            self._setup_distributed()
            shard = self.num_processes if self._shard_size == "auto" else self._shard_size
            if self.world_size % shard:
                raise ValueError(f"shard_size={shard} does not divide the world size "
                                 f"{self.world_size}")
            self._device_mesh = init_device_mesh(
                self.root_device.type, (self.world_size // shard, shard),
                mesh_dim_names=("replicate", "shard"))
            self.lightning_module._device_mesh = self._device_mesh
            trainer = self.lightning_module.trainer
            if self.add_callback and trainer is not None and \
                    not any(isinstance(c, callback_cls) for c in trainer.callbacks):
                trainer.callbacks.append(callback_cls())

        @property
        @override
        def distributed_sampler_kwargs(self) -> dict:
            # Every rank its own batches: a host's ranks shard the model, not the data.
            return {"num_replicas": self.world_size, "rank": self.global_rank}

        def _member(self) -> OneBitOptimizer:
            inner = [getattr(o, "_optimizer", o) for o in self.optimizers]
            if len(inner) != 1 or not isinstance(inner[0], OneBitOptimizer) or \
                    inner[0].shards is None:
                raise TypeError(
                    "strategy='onebit_hsdp' needs configure_optimizers() to return one optimizer "
                    "of the 1-bit family over the model's FSDP2 shards, e.g. `return OneBitAdam("
                    "self.parameters(), lr=1e-3, freeze_step='auto', process_group=self."
                    "device_mesh['replicate'].get_group())`; got "
                    f"{[type(o).__name__ for o in inner]} (shard in configure_model with "
                    "fully_shard(..., mesh=self.device_mesh['shard']))")
            return inner[0]

        @override
        def setup(self, trainer) -> None:
            super().setup(trainer)
            if trainer.state.fn != TrainerFn.FITTING:
                return
            optimizer = self._member()
            total = trainer.estimated_stepping_batches
            if math.isfinite(total):
                optimizer.set_total_steps(int(total))
            replicate = self.device_mesh["replicate"].get_group()
            if torch.distributed.get_process_group_ranks(optimizer.process_group or
                                                         torch.distributed.group.WORLD) != \
                    torch.distributed.get_process_group_ranks(replicate) and \
                    not optimizer.shards.alone:
                raise ValueError("the optimizer's process_group is not this strategy's "
                                 "self.device_mesh['replicate'].get_group()")
            route_clipping(self.precision_plugin)

        @override
        def on_train_end(self) -> None:
            super().on_train_end()
            for optimizer in self.optimizers:
                inner = getattr(optimizer, "_optimizer", optimizer)
                if isinstance(inner, OneBitOptimizer):
                    inner.training_ended()

        @override
        def optimizer_state(self, optimizer) -> dict:
            return {}  # written by save_sharded, in save_checkpoint

        @override
        def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
            if storage_options is not None:
                raise TypeError("OneBitHSDPStrategy.save_checkpoint takes no storage_options")
            path = Path(self.broadcast(filepath))
            if path.is_file():
                path.unlink()
            path.mkdir(parents=True, exist_ok=True)
            checkpoint.pop("state_dict", None)
            checkpoint.pop("optimizer_states", None)
            save_sharded(path, self.model, self._member())
            if self.global_rank == 0:
                torch.save(checkpoint, path / META)
            self.barrier()

        @override
        def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
            path = Path(self.broadcast(checkpoint_path))
            if not (path / META).is_file():
                raise ValueError(f"{path} is not a checkpoint of strategy='onebit_hsdp' (no "
                                 f"{META} in it)")
            load_sharded(path, self.model, self._member())
            # Lightning's loops and callbacks' state: read as data (numbers, strings, tensors)
            # whatever ``weights_only`` Lightning passes (it defaults to False, which unpickles
            # whatever a crafted file names).
            return torch.load(path / META, weights_only=True)

        @classmethod
        @override
        def register_strategies(cls, strategy_registry) -> None:
            strategy_registry.register("onebit_hsdp", cls, override=True,
                                       description="FSDP2 inside hosts, 1-bit across them")

    OneBitHSDPStrategy.__module__, OneBitHSDPStrategy.__qualname__ = module, "OneBitHSDPStrategy"
    return OneBitHSDPStrategy
