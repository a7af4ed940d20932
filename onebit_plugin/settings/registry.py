"""The family's one registry: each member's name (``ONEBIT_OPTIMIZER``, ``onebit-run
--optimizer``), its class, and what a DeepSpeed config of its type holds and meant.

In the lowest layer (it imports nothing of the package), so that the env reader
(``onebit_plugin.settings.config``) below the members can read it as well as onebit-run's
launcher, ``from_deepspeed_config`` and the Accelerate flag above them; a member's class is
imported when it is asked for (:meth:`Member.load`), as an entry point is. A new member is one
row here.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass, field

__all__ = ["MEMBERS", "Member", "member_named", "member_of_deepspeed_type"]

# DeepSpeed's hyperparameters of every member, and this package's keys beside them:
# "warmup_bits", the bits per value of the full-precision steps (DeepSpeed sent them in the
# engine's fp32 or fp16 allreduce; a config without it means 32), and the topology's
# (DeepSpeed's exchange was flat).
_COMMON = ("lr", "betas", "eps", "weight_decay", "warmup_bits", "topology", "local_world_size")


@dataclass(frozen=True)
class Member:
    """One member of the family.

    Args:
        name: its name for ``ONEBIT_OPTIMIZER`` and ``onebit-run --optimizer``.
        path: ``"module:Class"``, where its class is.
        deepspeed_type: DeepSpeed's ``"type"`` of it, lowercased (as DeepSpeed's engine
            compares it).
        deepspeed_params: the ``"params"`` of a DeepSpeed config of that type it takes (and
            ``warmup_bits``, this package's).
        deepspeed_defaults: what a DeepSpeed config without a key meant (its constructors'
            defaults, and its weight decay's kind).
    """

    name: str
    path: str
    deepspeed_type: str
    deepspeed_params: tuple[str, ...]
    deepspeed_defaults: dict = field(default_factory=dict)

    @property
    def class_name(self) -> str:
        return self.path.rpartition(":")[2]

    def load(self) -> type:
        """The member's class (imported now, if it was not)."""
        module, _, name = self.path.partition(":")
        return getattr(importlib.import_module(module), name)


MEMBERS: dict[str, Member] = {m.name: m for m in (
    Member("onebit_adam", "onebit_plugin.members.onebit_adam:OneBitAdam", "onebitadam",
           (*_COMMON, "freeze_step", "refresh_interval", "follow_variance"),
           # DeepSpeed's weight decay was added to the update, as AdamW's (decoupled).
           {"freeze_step": 100000, "decoupled_weight_decay": True}),
    Member("zero_one_adam", "onebit_plugin.members.zero_one_adam:ZeroOneAdam", "zerooneadam",
           (*_COMMON, "var_freeze_step", "var_update_scaler", "local_step_scaler",
            "local_step_clipper", "follow_variance", "local_variance", "sparse_rows"),
           {"var_freeze_step": 100000, "local_step_scaler": 32678}),
    Member("onebit_lamb", "onebit_plugin.members.onebit_lamb:OneBitLamb", "onebitlamb",
           (*_COMMON, "freeze_step", "max_coeff", "min_coeff", "coeff_beta", "factor_max",
            "factor_min", "factor_threshold"),
           {"freeze_step": 100000}),
)}


def member_named(name: str, what: str = "ONEBIT_OPTIMIZER") -> Member:
    """The member called ``name`` (any case); a ValueError naming ``what`` and the nearest
    name otherwise."""
    member = MEMBERS.get(name.strip().lower())
    if member is None:
        near = difflib.get_close_matches(name.strip().lower(), MEMBERS, n=1)
        raise ValueError(f"{what} must be one of {', '.join(MEMBERS)}, got {name!r}"
                         + (f" (did you mean {near[0]}?)" if near else ""))
    return member


def member_of_deepspeed_type(kind: str) -> Member | None:
    """The member of DeepSpeed's optimizer type ``kind`` (any case), None for another type."""
    return next((m for m in MEMBERS.values() if m.deepspeed_type == kind.lower()), None)
