"""onebit-plugin: 1-bit Adam (Tang et al., ICML 2021), 0/1 Adam (Lu et al., ICLR 2023) and 1-bit
LAMB (Li et al., 2021) for PyTorch.

``OneBitAdam`` is a ``torch.optim.Optimizer``: Adam during a warm-up, then Adam with a frozen
variance whose momentum is averaged across ranks by ``compressed_allreduce`` -- 1-bit signs with
error feedback on the worker and the server side, about 1/32 of an fp32 allreduce's bytes.
``ZeroOneAdam`` refreshes the variance on a few full-precision steps instead of freezing it
after a long warm-up, then takes local steps between 1-bit syncs. ``OneBitLamb`` is LAMB with
the same compressed momentum. ``from_deepspeed_config`` builds any of them from a DeepSpeed
config. Every member steps FSDP2 shards too (HSDP: ``onebit_plugin.comm.shards``), with
``save_sharded``/``load_sharded`` for their checkpoints.
"""

from onebit_plugin.comm.allreduce import ExactAllreduce, OneBitAllreduce
from onebit_plugin.comm.collectives import CommunicationError, group_timeout, uses_nccl
from onebit_plugin.core.base import OneBitOptimizer
from onebit_plugin.core.momentum import MomentumUnit
from onebit_plugin.core.policy import AdamPolicy, ExactMomentum, Exchange, OneBitMomentum, Policy
from onebit_plugin.entry.ddp_hook import OneBitHookState, onebit_hook, register_onebit_hook
from onebit_plugin.entry.deepspeed_config import from_deepspeed_config
from onebit_plugin.entry.lockstep import LockstepError, check_lockstep
from onebit_plugin.entry.sharded_checkpoint import load as load_sharded
from onebit_plugin.entry.sharded_checkpoint import save as save_sharded
from onebit_plugin.entry.standalone import CompressedAllreduce, compressed_allreduce
from onebit_plugin.maths.update import adam_update_, frozen_denominator, frozen_update_
from onebit_plugin.members.onebit_adam import OneBitAdam
from onebit_plugin.members.onebit_lamb import LambPolicy, OneBitLamb
from onebit_plugin.members.zero_one_adam import ZeroOneAdam, ZeroOnePolicy
from onebit_plugin.settings.config import EnvSettings, OneBitConfig, settings_from_env
from onebit_plugin.settings.registry import MEMBERS, Member
from onebit_plugin.wire.compression import ChunkLayout
from onebit_plugin.wire.deferred import fold_gradient_

__all__ = [
    "AdamPolicy",
    "ChunkLayout",
    "CommunicationError",
    "CompressedAllreduce",
    "EnvSettings",
    "ExactAllreduce",
    "ExactMomentum",
    "Exchange",
    "LambPolicy",
    "LockstepError",
    "MEMBERS",
    "Member",
    "MomentumUnit",
    "OneBitAdam",
    "OneBitAllreduce",
    "OneBitConfig",
    "OneBitHookState",
    "OneBitLamb",
    "OneBitMomentum",
    "OneBitOptimizer",
    "Policy",
    "ZeroOneAdam",
    "ZeroOnePolicy",
    "adam_update_",
    "check_lockstep",
    "compressed_allreduce",
    "fold_gradient_",
    "from_deepspeed_config",
    "frozen_denominator",
    "frozen_update_",
    "group_timeout",
    "load_sharded",
    "onebit_hook",
    "register_onebit_hook",
    "save_sharded",
    "settings_from_env",
    "uses_nccl",
]
__version__ = "0.1.0"

# Trainer(strategy="onebit_adam") and Fabric(strategy="onebit_adam") after `import onebit_plugin`,
# registered when (if ever) a Lightning package loads: the core's one arrow to the integrations.
from onebit_plugin.integrations.lightning import register_when_imported  # noqa: E402

register_when_imported()
