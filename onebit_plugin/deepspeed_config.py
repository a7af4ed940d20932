"""``from_deepspeed_config(params, config)``: the family's optimizer from a DeepSpeed config's
``"optimizer"`` section, so that DeepSpeed's 1-bit Adam, 0/1 Adam and 1-bit LAMB configs keep
working after DeepSpeed deleted those optimizers (docs/api.md has the mapping).

A config is a dict or a path to a JSON file: a whole DeepSpeed config (its ``"optimizer"``
section is read) or the section itself. DeepSpeed's type names (any case) and parameter names are
taken as they are. Keys DeepSpeed's optimizers took but never used are accepted and said once
(``cuda_aware``, ``comm_backend_name``: the transport is torch.distributed's; ``bias_correction``,
``eps_inside_sqrt``, ``max_grad_norm``: stored and ignored by DeepSpeed too); an unknown key, an
unknown type, and ``amsgrad`` (refused by DeepSpeed as well) are a ``ValueError`` naming them.
The config's other sections (batch sizes, ``fp16``, ``gradient_clipping``, ...) are the DeepSpeed
engine's: they are named once, not applied.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

__all__ = ["DEEPSPEED_TYPES", "from_deepspeed_config"]

log = logging.getLogger("onebit_plugin")

_COMMON = ("lr", "betas", "eps", "weight_decay")
# DeepSpeed's type name (lowercased, as its engine compares it): our class and its parameters.
DEEPSPEED_TYPES = {
    "onebitadam": ("OneBitAdam", _COMMON + ("freeze_step",)),
    "zerooneadam": ("ZeroOneAdam", _COMMON + ("var_freeze_step", "var_update_scaler",
                                              "local_step_scaler", "local_step_clipper")),
    "onebitlamb": ("OneBitLamb", _COMMON + ("freeze_step", "max_coeff", "min_coeff",
                                            "coeff_beta", "factor_max", "factor_min",
                                            "factor_threshold")),
}
# What a config without the key meant to DeepSpeed (its constructors' defaults), and what
# DeepSpeed's weight decay was: added to the update, as AdamW's (decoupled).
_DEFAULTS = {"onebitadam": {"freeze_step": 100000, "decoupled_weight_decay": True},
             "zerooneadam": {"var_freeze_step": 100000, "local_step_scaler": 32678},
             "onebitlamb": {"freeze_step": 100000}}
# DeepSpeed's values of the unused keys: another one is said as a warning (it changes nothing).
_UNUSED_DEFAULTS = {"bias_correction": True, "eps_inside_sqrt": False, "max_grad_norm": 0.0}
# Taken by DeepSpeed's optimizers and unused by them, or about its transport: accepted, said.
_UNUSED = {
    "cuda_aware": "the transport is torch.distributed's (any backend)",
    "comm_backend_name": "the transport is torch.distributed's (any backend)",
    "bias_correction": "DeepSpeed's 1-bit optimizers ignored it too; Adam's bias corrections "
                       "apply here",
    "eps_inside_sqrt": "DeepSpeed's 1-bit optimizers ignored it too; eps is added to the "
                       "square root",
    "max_grad_norm": "DeepSpeed's 1-bit optimizers ignored it too; clip with the "
                     "integration's clipping (gradient_clip_val, clip_grad_norm_)",
}


def _load(config) -> dict:
    if isinstance(config, str | Path):
        path = Path(config)
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a JSON DeepSpeed config ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"a DeepSpeed config is a dict or a JSON file's path, got "
                         f"{type(config).__name__}")
    return config


def _masks_of_groups(params: list) -> dict:
    """DeepSpeed's momentum masks: a param group's ``"exp_avg_mask"`` (each of its parameters'
    momentum multiplied by it, flattened) becomes ``masks={param: bool}`` (0: masked), and the
    key leaves the group (torch would keep it there, unused)."""
    import torch

    masks = {}
    for group in params:
        if not isinstance(group, dict) or "exp_avg_mask" not in group:
            continue
        mask = group.pop("exp_avg_mask")
        for p in group["params"]:
            if mask.numel() != p.numel():
                raise ValueError(f"an exp_avg_mask of {mask.numel()} values is given for a "
                                 f"parameter of shape {tuple(p.shape)}")
            masks[p] = torch.as_tensor(mask).reshape(p.shape) != 0
    return masks


def from_deepspeed_config(params, config, **options):
    """The optimizer a DeepSpeed config's ``"optimizer"`` section describes (module
    docstring), over ``params``; ``options``: the family's own options beside it
    (``total_steps``, ``process_group``, ``master_weights``, ...)."""
    import onebit_plugin

    config = _load(config)
    section = config.get("optimizer", config) if "type" not in config else config
    if not isinstance(section, dict) or "type" not in section:
        raise ValueError("the DeepSpeed config has no \"optimizer\" section with a \"type\"")
    others = sorted(set(config) - {"optimizer"}) if section is not config else []
    if others:
        log.info("onebit: from_deepspeed_config reads the \"optimizer\" section only; %s "
                 "belong to the DeepSpeed engine and are not applied (batch sizes, precision "
                 "and clipping are the trainer's)", ", ".join(others))
    unknown_top = set(section) - {"type", "params"}
    if unknown_top:
        raise ValueError(f"the optimizer section has unknown key(s) {sorted(unknown_top)}: it "
                         "holds \"type\" and \"params\"")
    kind = str(section["type"])
    if kind.lower() not in DEEPSPEED_TYPES:
        raise ValueError(f"optimizer type {kind!r} is not one of DeepSpeed's 1-bit optimizers "
                         f"({', '.join(('OneBitAdam', 'ZeroOneAdam', 'OneBitLamb'))})")
    name, accepted = DEEPSPEED_TYPES[kind.lower()]
    given = dict(section.get("params", {}))
    if given.pop("amsgrad", False):
        raise ValueError(f"{kind}: \"amsgrad\": true is not supported (nor was it by "
                         "DeepSpeed's 1-bit optimizers)")
    unused = {k: given.pop(k) for k in list(given) if k in _UNUSED}
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        raise ValueError(f"{kind}: unknown parameter(s) {unknown}; {name} takes "
                         f"{', '.join(accepted)} (and {', '.join(_UNUSED)}, which are unused)")
    for key, value in unused.items():
        say = log.warning if key in _UNUSED_DEFAULTS and value != _UNUSED_DEFAULTS[key] \
            else log.info
        say("onebit: %s's %r (%r) is accepted and not used: %s", kind, key, value,
            _UNUSED[key])
    if config.get("gradient_clipping"):
        log.warning("onebit: the DeepSpeed config's \"gradient_clipping\": %s is the "
                    "engine's and is not applied by from_deepspeed_config: set your trainer's "
                    "clipping (Trainer(gradient_clip_val=...), accelerator.clip_grad_norm_, "
                    "optimizer.clip_grad_norm_)", config["gradient_clipping"])
    if "betas" in given:
        given["betas"] = tuple(given["betas"])
    params = list(params)
    masks = _masks_of_groups(params)
    if masks:
        options = {**options, "masks": {**options.get("masks", {}), **masks}}
    for key, value in _DEFAULTS[kind.lower()].items():
        if key not in given and key not in options:
            given[key] = value
    return getattr(onebit_plugin, name)(params, **given, **options)
