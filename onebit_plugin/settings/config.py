"""The family's settings in one place: :class:`OneBitConfig`, validated once when it is made,
and :func:`settings_from_env`, the one reader of the ``ONEBIT_*`` variables.

An optimizer of the family takes its settings as keyword arguments and makes its config from
them; the Accelerate flag and ``onebit-run`` make theirs from the environment. Both go through
``OneBitConfig.__post_init__``, so a value is checked by the same code whichever way it came,
and an error from the environment names the variable instead of the argument. Nothing writes a
setting after construction: what an integration decides later (the DDP hook's ``comm_timeout``)
it passes to ``register_onebit_hook``, which checks that it is not too late for it.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
from dataclasses import dataclass
from typing import TypedDict, get_type_hints

from onebit_plugin.settings.registry import member_named
from onebit_plugin.settings.schedule import exact_steps

__all__ = ["EnvSettings", "FamilyOptions", "OneBitConfig", "check_hparams", "check_settings",
           "changed", "flag", "member_config", "settings_from_env"]

SCALE_RULES = ("rms", "mean")
ERROR_DTYPES = ("float32", "bfloat16")
# Bits per value of the full-precision step kinds (the warm-up, 0/1 Adam's Adam steps and
# variance refreshes): 32 the paper's fp32 average, 16 bf16, 8 blockwise int8
# (onebit_plugin.comm.quantized).
WARMUP_BITS = (32, 16, 8)
# How the ranks are laid out for the exchanges (onebit_plugin.comm.topology).
TOPOLOGIES = ("auto", "flat", "hierarchical")
# A Triton program holds one block: compile time grows with it (2**17 values took 129 s to
# compile for sm_90, 2**21 did not compile), and blocks past a few thousand values buy nothing.
MAX_BLOCK = 16384
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def _is_int(value, low: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= low


# Per checked setting: the test, and what it must be as an argument and as a variable (whose
# value is already a number: "an int" goes without saying there).
_RULES = {
    "freeze_step": (lambda v: v == "auto" or _is_int(v, 1), "an int >= 1 or 'auto'",
                    ">= 1 or auto"),
    "total_steps": (lambda v: v is None or _is_int(v, 1), "an int >= 1", ">= 1"),
    "max_block": (lambda v: _is_int(v, 8) and v % 8 == 0 and v <= MAX_BLOCK,
                  f"a positive multiple of 8 up to {MAX_BLOCK}",
                  f"a multiple of 8 in [8, {MAX_BLOCK}]"),
    "scale": (lambda v: v in SCALE_RULES, f"one of {SCALE_RULES}", f"one of {SCALE_RULES}"),
    "error_dtype": (lambda v: v in ERROR_DTYPES, f"one of {ERROR_DTYPES}",
                    f"one of {ERROR_DTYPES}"),
    "warmup_bits": (lambda v: _is_int(v, 8) and v in WARMUP_BITS,
                    f"one of {WARMUP_BITS}", f"one of {WARMUP_BITS}"),
    "refresh_interval": (lambda v: v is None or _is_int(v, 1), "an int >= 1 or None",
                         ">= 1"),
    "topology": (lambda v: v in TOPOLOGIES, f"one of {TOPOLOGIES}", f"one of {TOPOLOGIES}"),
    "local_world_size": (lambda v: v is None or _is_int(v, 1), "an int >= 1 or None", ">= 1"),
    "comm_timeout": (lambda v: v is None or v > 0, "> 0 seconds", "> 0 seconds"),
    "max_skipped_steps": (lambda v: _is_int(v, 1), "an int >= 1", ">= 1"),
    "bucket_cap_mb": (lambda v: v is None or v > 0, "> 0", "> 0"),
    # On/off settings: a bool (or 0/1), never a string ("false" is truthy: it would turn on).
    **dict.fromkeys(("mask_zero_variance", "average_grads", "compress_momentum",
                     "bound_update", "master_weights", "follow_variance"),
                    (lambda v: not isinstance(v, str) and v in (True, False),
                     "True or False", "1 or 0")),
}


def check_settings(values: dict, variables: dict | None = None) -> None:
    """The one check of the settings in ``values``: a ``ValueError`` naming the first bad one,
    by its variable when ``variables`` maps it to one."""
    for name, value in values.items():
        if name not in _RULES:
            continue
        test, as_argument, as_variable = _RULES[name]
        try:
            ok = test(value)
        except TypeError:  # "soon" > 0
            ok = False
        if not ok:
            if variables and name in variables:
                raise ValueError(f"{variables[name]} must be {as_variable}, got {value!r}")
            raise ValueError(f"{name} must be {as_argument}, got {value!r}")


def changed(config: OneBitConfig, member_defaults: dict) -> dict:
    """``config``'s fields away from their defaults (``member_defaults`` overriding
    ``OneBitConfig``'s, a member's own), by name, in field order; ``freeze_step`` and
    ``total_steps``, which a launcher's line says apart, left out. Give the config as the
    optimizer was made: the DDP hook sets ``average_grads=False`` and an integration's
    ``comm_timeout`` itself."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)} | member_defaults
    return {name: value for name, value in dataclasses.asdict(config).items()
            if name not in ("freeze_step", "total_steps") and value != defaults[name]}


@dataclass(frozen=True)
class OneBitConfig:
    """What every member of the 1-bit family takes beside its hyperparameters (the optimizers'
    docstrings say what each means). Frozen and checked when made: an invalid value is a
    ``ValueError`` naming the setting."""

    freeze_step: int | str | None = None
    total_steps: int | None = None
    max_block: int = 2048
    scale: str = "rms"
    mask_zero_variance: bool = True
    average_grads: bool = True
    compress_momentum: bool = True
    bound_update: bool = True
    comm_timeout: float | None = None
    bucket_cap_mb: float | None = None
    max_skipped_steps: int = 20
    master_weights: bool = False
    error_dtype: str = "float32"
    warmup_bits: int = 32
    refresh_interval: int | None = None
    follow_variance: bool = True
    topology: str = "auto"
    local_world_size: int | None = None

    def __post_init__(self) -> None:
        if self.freeze_step is None:
            raise ValueError(
                "freeze_step is required: the number of uncompressed warm-up steps (Adam, or "
                "LAMB for OneBitLamb) "
                "(an int >= 1; 15-25% of the run is typical), or 'auto' (with total_steps, "
                "frozen at 20% of the run at the latest, 15% for OneBitLamb)"
            )
        check_settings(dataclasses.asdict(self))
        for name in ("mask_zero_variance", "average_grads", "compress_momentum",
                     "bound_update", "master_weights", "follow_variance"):
            object.__setattr__(self, name, bool(getattr(self, name)))

    def agreement(self, total_steps: int | None) -> dict[str, int]:
        """The settings every rank must share, as integers (``rank_checks``): ``freeze_step``
        -1 for ``"auto"``, whose ``total_steps`` (known by now, or 0) must agree too."""
        auto = self.freeze_step == "auto"
        return {"freeze_step": -1 if auto else self.freeze_step,
                "total_steps": (total_steps or 0) if auto else 0,
                "max_block": self.max_block, "scale": SCALE_RULES.index(self.scale),
                "mask_zero_variance": int(self.mask_zero_variance),
                "compress_momentum": int(self.compress_momentum),
                "bound_update": int(self.bound_update),
                "master_weights": int(self.master_weights),
                "error_dtype": ERROR_DTYPES.index(self.error_dtype),
                "warmup_bits": self.warmup_bits,
                "refresh_interval": self.refresh_interval or 0,
                "follow_variance": int(self.follow_variance),
                "topology asked": TOPOLOGIES.index(self.topology)}

    def replace(self, **changes) -> OneBitConfig:
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)

    def options(self) -> dict:
        """The settings as keyword arguments of an optimizer of the family."""
        return dataclasses.asdict(self)


# The family's shared keyword arguments, declared once: OneBitConfig's fields but freeze_step,
# which each member spells its own way (0/1 Adam's exact stage comes from its schedule). A member
# takes them as ``**options: Unpack[FamilyOptions]``, which jsonargparse (LightningCLI) and
# typing.get_type_hints read as the keyword arguments they are; member_config checks their names.
FamilyOptions = TypedDict("FamilyOptions", {  # noqa: UP013 - the names come from the dataclass
    f.name: get_type_hints(OneBitConfig)[f.name]
    for f in dataclasses.fields(OneBitConfig) if f.name != "freeze_step"}, total=False)


def member_config(member: type, freeze_step, options: dict,
                  refused: dict[str, str] | None = None) -> OneBitConfig:
    """The config of ``member`` (the optimizer's class) from its exact stage and the family's
    ``options``: an option neither the family nor ``member``'s own constructor has is the
    ``TypeError`` Python raises for a misspelt keyword argument, with the nearest name of
    either; one in ``refused`` (``{name: why}``) is a ``TypeError`` saying why."""
    name = member.__name__
    own = [p for p in inspect.signature(member.__init__).parameters
           if p not in ("self", "params", "options")]
    for key in options:
        if refused and key in refused:
            raise TypeError(f"{name}() takes no {key!r}: {refused[key]}")
        if key not in FamilyOptions.__annotations__:
            near = difflib.get_close_matches(key, [*own, *FamilyOptions.__annotations__], n=1)
            meant = f" (did you mean {near[0]!r}?)" if near else ""
            raise TypeError(f"{name}() got an unexpected keyword argument {key!r}{meant}")
    return OneBitConfig(freeze_step=freeze_step, **options)


def check_hparams(lr, betas, eps, weight_decay) -> None:
    """Adam's hyperparameters, as torch's Adam checks them."""
    # lr = 0 is allowed, as in torch's Adam: a warm-up LR schedule starts there.
    if not isinstance(lr, float | int) or not lr >= 0:
        raise ValueError(f"lr must be >= 0, got {lr!r}")
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for name, b in zip(("betas[0]", "betas[1]"), betas, strict=True):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {b!r}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")


# ------------------------------------------------------------------------- the environment
def flag(name: str, default: str) -> bool:
    """The one reading of an on/off ``ONEBIT_*`` variable: 1/true/yes/on or 0/false/no/off
    (any case; unset or empty is ``default``: an empty variable, as a container's template
    leaves one, must not turn a default-on setting off), anything else a ``ValueError``
    naming it."""
    value = os.environ.get(name, "").strip().lower() or default
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    raise ValueError(f"{name} must be 1 or 0 (or true/false, yes/no, on/off), got {value!r}")


VARIABLES = ("ONEBIT_ADAM", "ONEBIT_OPTIMIZER", "ONEBIT_FREEZE_STEP", "ONEBIT_VAR_FREEZE_STEP",
             "ONEBIT_LOCAL_STEP_SCALER", "ONEBIT_TOTAL_STEPS", "ONEBIT_MAX_BLOCK",
             "ONEBIT_SCALE", "ONEBIT_OVERLAP", "ONEBIT_TIMEOUT", "ONEBIT_BOUND_UPDATE",
             "ONEBIT_MASTER_WEIGHTS", "ONEBIT_ERROR_DTYPE", "ONEBIT_WARMUP_BITS",
             "ONEBIT_REFRESH_INTERVAL", "ONEBIT_FOLLOW_VARIANCE", "ONEBIT_LOCAL_VARIANCE",
             "ONEBIT_SPARSE_ROWS", "ONEBIT_TOPOLOGY", "ONEBIT_CPU_KERNEL")
# The variable of each config field it sets: a ValueError about the field names the variable.
_FIELD_VARIABLES = {"freeze_step": "ONEBIT_FREEZE_STEP", "total_steps": "ONEBIT_TOTAL_STEPS",
                    "max_block": "ONEBIT_MAX_BLOCK", "scale": "ONEBIT_SCALE",
                    "comm_timeout": "ONEBIT_TIMEOUT", "bound_update": "ONEBIT_BOUND_UPDATE",
                    "master_weights": "ONEBIT_MASTER_WEIGHTS",
                    "error_dtype": "ONEBIT_ERROR_DTYPE", "warmup_bits": "ONEBIT_WARMUP_BITS",
                    "refresh_interval": "ONEBIT_REFRESH_INTERVAL",
                    "topology": "ONEBIT_TOPOLOGY"}


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        also = " or auto" if name == "ONEBIT_FREEZE_STEP" else ""
        raise ValueError(f"{name} must be an integer{also}, got {raw!r}") from None


def _env_steps(name: str) -> int | str:
    """An ``ONEBIT_*`` variable of 0/1 Adam's schedule: an int >= 1 or ``auto`` (default)."""
    raw = os.environ.get(name, "").strip()
    if raw in ("", "auto"):
        return "auto"
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} must be an integer >= 1 or auto, got {raw!r}")
    return value


def _env_seconds(name: str) -> float | None:
    raw = os.environ.get(name, "").strip()
    try:
        return float(raw) if raw else None
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None


@dataclass(frozen=True)
class EnvSettings:
    """What the ``ONEBIT_*`` variables say (``settings_from_env``): the member that replaces
    Adam (``optimizer``, a name of ``onebit_plugin.settings.registry.MEMBERS``), its settings
    (:attr:`config`, and 0/1 Adam's schedule) and the DDP hook's ``overlap``. Checked when
    made, by ``OneBitConfig``."""

    freeze_step: int | str
    total_steps: int | None = None
    max_block: int = 2048
    scale: str = "rms"
    overlap: bool = True
    timeout: float | None = None
    bound_update: bool = True
    master_weights: bool = False
    error_dtype: str = "float32"
    warmup_bits: int = 32
    refresh_interval: int | None = None
    follow_variance: bool = True
    topology: str = "auto"
    optimizer: str = "onebit_adam"
    var_freeze_step: int | str = "auto"
    local_step_scaler: int | str = "auto"
    local_variance: bool = True
    sparse_rows: bool = True

    def __post_init__(self) -> None:
        _ = self.config  # OneBitConfig checks every field as it is made: a bad one raises here

    def member_options(self, total_steps: int | None) -> dict:
        """The keyword arguments of the member's constructor beside its hyperparameters (0/1
        Adam's are its schedule and the family's options; its exact stage is its own)."""
        options = self.config.replace(total_steps=total_steps).options()
        if self.optimizer != "onebit_adam":  # 1-bit Adam's alone (None: settings_from_env)
            del options["refresh_interval"]
        if self.optimizer == "onebit_lamb":  # the Adam members' (settings_from_env)
            del options["follow_variance"]
        if self.optimizer == "zero_one_adam":
            del options["freeze_step"], options["compress_momentum"]
            options.update(var_freeze_step=self.var_freeze_step,
                           local_step_scaler=self.local_step_scaler,
                           local_variance=self.local_variance, sparse_rows=self.sparse_rows)
        return options

    @property
    def config(self) -> OneBitConfig:
        return OneBitConfig(freeze_step=self.freeze_step, total_steps=self.total_steps,
                            max_block=self.max_block, scale=self.scale,
                            comm_timeout=self.timeout, bound_update=self.bound_update,
                            master_weights=self.master_weights, error_dtype=self.error_dtype,
                            warmup_bits=self.warmup_bits,
                            refresh_interval=self.refresh_interval,
                            follow_variance=self.follow_variance, topology=self.topology)

    @classmethod
    def from_env(cls) -> EnvSettings | None:
        return settings_from_env()


def settings_from_env() -> EnvSettings | None:
    """The settings when ``ONEBIT_ADAM`` is on, else None. A misspelt ``ONEBIT_*`` name or a
    bad value is a ``ValueError`` naming the variable."""
    if not flag("ONEBIT_ADAM", "0"):
        return None
    unknown = sorted(k for k in os.environ if k.startswith("ONEBIT_") and k not in VARIABLES)
    if unknown:
        meant = [f"{k} (did you mean {near[0]}?)" if (near := difflib.get_close_matches(
            k, VARIABLES, n=1)) else k for k in unknown]
        raise ValueError(f"unknown setting(s) {', '.join(meant)}: the ONEBIT_ variables "
                         f"are {', '.join(VARIABLES)}")
    # ONEBIT_OPTIMIZER: the member that replaces Adam/AdamW (onebit_plugin.settings.registry).
    member = member_named(os.environ.get("ONEBIT_OPTIMIZER", "").strip() or "onebit_adam").name
    freeze = os.environ.get("ONEBIT_FREEZE_STEP", "").strip()
    schedule = {}
    if member == "zero_one_adam":
        if freeze:
            raise ValueError(
                "ONEBIT_FREEZE_STEP is 1-bit Adam's warm-up; with ONEBIT_OPTIMIZER=zero_one_adam "
                "the variance is refreshed instead: ONEBIT_VAR_FREEZE_STEP (phase A runs to "
                "that step + 1, as in DeepSpeed; default auto) and ONEBIT_LOCAL_STEP_SCALER set "
                "0/1 Adam's schedule")
        schedule = dict(var_freeze_step=_env_steps("ONEBIT_VAR_FREEZE_STEP"),
                        local_step_scaler=_env_steps("ONEBIT_LOCAL_STEP_SCALER"),
                        local_variance=flag("ONEBIT_LOCAL_VARIANCE", "1"),
                        sparse_rows=flag("ONEBIT_SPARSE_ROWS", "1"))
        if schedule["local_variance"] and flag("ONEBIT_FOLLOW_VARIANCE", "0"):
            raise ValueError("ONEBIT_FOLLOW_VARIANCE=1 follows 0/1 Adam's variance of the "
                             "refreshes alone; ONEBIT_LOCAL_VARIANCE (1, the default) feeds it "
                             "from every step instead: set ONEBIT_LOCAL_VARIANCE=0 with it")
        # The family's config holds the member's exact stage.
        freeze = str(exact_steps(schedule["var_freeze_step"], 16))
    theirs = sorted(k for k in ("ONEBIT_VAR_FREEZE_STEP", "ONEBIT_LOCAL_STEP_SCALER",
                                "ONEBIT_LOCAL_VARIANCE", "ONEBIT_SPARSE_ROWS")
                    if os.environ.get(k, "").strip())
    if member != "zero_one_adam" and theirs:
        raise ValueError(f"{' and '.join(theirs)} {'is' if len(theirs) == 1 else 'are'} 0/1 "
                         f"Adam's, and the optimizer is {member}: unset it, or choose 0/1 Adam "
                         "(ONEBIT_OPTIMIZER=zero_one_adam; onebit-run --optimizer "
                         "zero_one_adam)")
    if not freeze:
        raise ValueError(
            "ONEBIT_ADAM=1 needs ONEBIT_FREEZE_STEP (or onebit-run --freeze-step N): the number "
            "of uncompressed warm-up steps (an int >= 1, typically 15-25% of the optimizer "
            "steps), or auto")
    fields = dict(
        freeze_step=("auto" if freeze == "auto" else int(freeze) if schedule
                     else _env_int("ONEBIT_FREEZE_STEP")),
        total_steps=_env_int("ONEBIT_TOTAL_STEPS"),
        max_block=2048 if (block := _env_int("ONEBIT_MAX_BLOCK")) is None else block,
        scale=os.environ.get("ONEBIT_SCALE", "").strip() or "rms",
        comm_timeout=_env_seconds("ONEBIT_TIMEOUT"),
        bound_update=flag("ONEBIT_BOUND_UPDATE", "1"),
        master_weights=flag("ONEBIT_MASTER_WEIGHTS", "0"),
        error_dtype=os.environ.get("ONEBIT_ERROR_DTYPE", "").strip() or "float32",
        warmup_bits=32 if (bits := _env_int("ONEBIT_WARMUP_BITS")) is None else bits,
        refresh_interval=_env_int("ONEBIT_REFRESH_INTERVAL"),
        # 0/1 Adam's own default is off (members.zero_one_adam says why).
        follow_variance=flag("ONEBIT_FOLLOW_VARIANCE", "0" if member == "zero_one_adam" else "1"),
        topology=os.environ.get("ONEBIT_TOPOLOGY", "").strip() or "auto",
    )
    if os.environ.get("ONEBIT_FOLLOW_VARIANCE", "").strip() and member == "onebit_lamb":
        raise ValueError("ONEBIT_FOLLOW_VARIANCE is the Adam members' (1-bit LAMB's fresh "
                         "variance sets its trust ratio's factor instead); unset it")
    if fields["refresh_interval"] is not None and member != "onebit_adam":
        why = ("0/1 Adam's refreshes follow its own schedule, ONEBIT_VAR_FREEZE_STEP"
               if member == "zero_one_adam" else "1-bit LAMB's frozen variance has no "
               "refreshes")
        raise ValueError(f"ONEBIT_REFRESH_INTERVAL is 1-bit Adam's (ONEBIT_OPTIMIZER="
                         f"onebit_adam): {why}; unset it")
    overlap = flag("ONEBIT_OVERLAP", "1")
    flag("ONEBIT_CPU_KERNEL", "1")  # read when the CPU kernel is first used; checked here
    check_settings(fields, _FIELD_VARIABLES)  # the same check, naming the variables
    fields["timeout"] = fields.pop("comm_timeout")
    return EnvSettings(overlap=overlap, optimizer=member, **schedule, **fields)
