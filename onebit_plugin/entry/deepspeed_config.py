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

from onebit_plugin.settings.registry import MEMBERS, member_of_deepspeed_type

__all__ = ["from_deepspeed_config"]

log = logging.getLogger("onebit_plugin")

# DeepSpeed's values of two unused keys: another value would look active, so it is a warning.
_UNUSED_DEFAULTS = {"eps_inside_sqrt": False, "max_grad_norm": 0.0}
# Taken by DeepSpeed's optimizers and unused by them, or about its transport: accepted, said.
_UNUSED = {
    "cuda_aware": "the transport is torch.distributed's (any backend)",
    "comm_backend_name": "the transport is torch.distributed's (any backend)",
    "bias_correction": "DeepSpeed's 1-bit optimizers stored it and applied no bias correction "
                       "either way; here Adam's bias corrections always apply (the steps differ "
                       "in the first few hundred steps)",
    "eps_inside_sqrt": "DeepSpeed's 1-bit optimizers ignored it too; eps is added to the "
                       "square root",
    "max_grad_norm": "DeepSpeed's 1-bit optimizers ignored it too; clip with the "
                     "integration's clipping (gradient_clip_val, clip_grad_norm_)",
    "legacy_fusion": "a DeepSpeed engine setting",
}
# The config's sections that change training and that the engine applied: said as warnings.
_ENGINE = {
    "fp16": "fp16 with dynamic loss scaling: use your trainer's precision (bf16 runs as is; "
            "fp16 loss scaling is not supported, docs/limits.md)",
    "bf16": "your trainer's precision (bf16 parameters: master_weights=True)",
    "scheduler": "your trainer's learning-rate scheduler over this optimizer",
    "gradient_clipping": "your trainer's clipping (Trainer(gradient_clip_val=...), "
                         "accelerator.clip_grad_norm_, optimizer.clip_grad_norm_)",
}


def _say(level: int, message: str, *args) -> None:
    """Once per job: rank 0 of the default group (every rank loads the same config)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        log.log(level, message, *args)


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


def _masks_of_groups(params: list) -> tuple[list, dict]:
    """DeepSpeed's momentum masks: a param group's ``"exp_avg_mask"`` (each of its parameters'
    momentum multiplied by it, flattened) becomes ``masks={param: bool}`` (0: masked); the
    groups handed on are copies without the key (torch would keep it there, unused; the
    caller's dicts are left as they were)."""
    import torch

    masks, out = {}, []
    for group in params:
        if not isinstance(group, dict) or "exp_avg_mask" not in group:
            out.append(group)
            continue
        group = dict(group)
        mask = group.pop("exp_avg_mask")
        out.append(group)
        for p in group["params"]:
            if mask.numel() != p.numel():
                raise ValueError(f"an exp_avg_mask of {mask.numel()} values is given for a "
                                 f"parameter of shape {tuple(p.shape)}")
            masks[p] = torch.as_tensor(mask).reshape(p.shape) != 0
    return out, masks


def from_deepspeed_config(params, config, **options):
    """The optimizer a DeepSpeed config's ``"optimizer"`` section describes (module
    docstring), over ``params``; ``options``: the family's own options beside it
    (``total_steps``, ``process_group``, ``master_weights``, ...)."""
    config = _load(config)
    section = config.get("optimizer", config) if "type" not in config else config
    if not isinstance(section, dict) or "type" not in section:
        raise ValueError("the DeepSpeed config has no \"optimizer\" section with a \"type\"")
    others = sorted(set(config) - {"optimizer"}) if section is not config else []
    for key in others:
        if key in _ENGINE and config[key] and (not isinstance(config[key], dict) or
                                               config[key].get("enabled", True)):
            _say(logging.WARNING, "onebit: the DeepSpeed config's \"%s\" is the engine's and "
                 "is not applied by from_deepspeed_config: set %s", key, _ENGINE[key])
    rest = [k for k in others if k not in _ENGINE]
    if rest:
        _say(logging.INFO, "onebit: from_deepspeed_config reads the \"optimizer\" section "
             "only; %s belong to the DeepSpeed engine and are not applied (batch sizes are "
             "the trainer's)", ", ".join(rest))
    unknown_top = set(section) - {"type", "params", "legacy_fusion"}
    if unknown_top:
        raise ValueError(f"the optimizer section has unknown key(s) {sorted(unknown_top)}: it "
                         "holds \"type\" and \"params\"")
    kind = str(section["type"])
    member = member_of_deepspeed_type(kind)  # the types and their keys: settings.registry
    if member is None:
        raise ValueError(f"optimizer type {kind!r} is not one of DeepSpeed's 1-bit optimizers "
                         f"({', '.join(m.class_name for m in MEMBERS.values())})")
    name, accepted = member.class_name, member.deepspeed_params
    if not isinstance(section.get("params", {}), dict):
        raise ValueError(f"{kind}: \"params\" must be an object of parameter names, got "
                         f"{section['params']!r}")
    given = dict(section.get("params", {}))
    amsgrad = given.pop("amsgrad", False)
    if amsgrad is not False:
        raise ValueError(f"{kind}: \"amsgrad\": {json.dumps(amsgrad)} is not supported (only "
                         "false; nor was it by DeepSpeed's 1-bit optimizers)")
    placeholders = sorted(k for k, v in given.items() if v == "auto" and k != "freeze_step"
                          and not (name == "ZeroOneAdam" and k in ("var_freeze_step",
                                                                   "local_step_scaler")))
    if placeholders:
        raise ValueError(f"{kind}: {placeholders} are \"auto\", the placeholder transformers' "
                         "DeepSpeed integration fills in from its TrainingArguments: give the "
                         "numbers")
    unused = {k: given.pop(k) for k in list(given) if k in _UNUSED}
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        # A key of another member (follow_variance under OneBitLamb, say) says whose it is.
        owners = {k: [m.class_name for m in MEMBERS.values() if k in m.deepspeed_params]
                  for k in unknown}
        whose = "; ".join(f"{k} is a parameter of {' and '.join(v)} only"
                          for k, v in owners.items() if v)
        raise ValueError(f"{kind}: unknown parameter(s) {unknown}"
                         + (f" ({whose})" if whose else "") + f"; {name} takes "
                         f"{', '.join(accepted)} (and {', '.join(_UNUSED)}, which are unused)")
    for key, value in unused.items():
        # A value that would look active (max_grad_norm > 0, eps_inside_sqrt) is a warning.
        loud = key in _UNUSED_DEFAULTS and value != _UNUSED_DEFAULTS[key]
        _say(logging.WARNING if loud else logging.INFO,
             "onebit: %s's %r (%r) is accepted and not used: %s", kind, key, value,
             _UNUSED[key])
    if "betas" in given:
        given["betas"] = tuple(given["betas"])
    for key in sorted(set(options) & set(given)):
        _say(logging.INFO, "onebit: %s=%r given to from_deepspeed_config replaces the config's "
             "%r", key, options[key], given.pop(key))
    params, masks = _masks_of_groups(list(params))
    if masks:
        options = {**options, "masks": {**options.get("masks", {}), **masks}}
    for key, value in member.deepspeed_defaults.items():
        if key not in given and key not in options:
            given[key] = value
    return member.load()(params, **given, **options)
