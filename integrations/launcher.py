"""``onebit-run``: 1-bit Adam (or 0/1 Adam, 1-bit LAMB) for an unmodified Accelerate or
``transformers.Trainer`` script, turned on at launch.

Examples::

    ONEBIT_FREEZE_STEP=100 onebit-run accelerate launch train.py ...
    onebit-run --freeze-step 100 torchrun --nproc_per_node 8 train.py ...
    onebit-run --optimizer zero_one_adam torchrun --nproc_per_node 8 train.py ...

It sets ``ONEBIT_ADAM=1`` (and ``ONEBIT_FREEZE_STEP``, ``ONEBIT_OPTIMIZER``,
``ONEBIT_VAR_FREEZE_STEP``, ``ONEBIT_LOCAL_STEP_SCALER`` from its options), checks the
settings, puts ``bootstrap/`` first on ``PYTHONPATH`` and runs the command; every Python process
the command starts inherits both and patches ``accelerate`` and ``transformers`` as they load
(``autoload``). The other settings are the ``ONEBIT_*`` variables of ``accelerate_flag``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from onebit_plugin.settings.registry import MEMBERS

BOOTSTRAP = Path(__file__).resolve().parent / "bootstrap"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="onebit-run", description=__doc__.split("\n\n")[0],
        usage="onebit-run [--optimizer onebit_adam|zero_one_adam|onebit_lamb] "
              "[--freeze-step N|auto] "
              "[--var-freeze-step N|auto] [--local-step-scaler N|auto] [--total-steps N] "
              "COMMAND [ARGS ...]")
    parser.add_argument("--optimizer", choices=list(MEMBERS),
                        help="the member that replaces Adam/AdamW: onebit_adam (default), "
                             "zero_one_adam (0/1 Adam) or onebit_lamb (1-bit LAMB); else "
                             "ONEBIT_OPTIMIZER")
    parser.add_argument("--freeze-step",
                        help="uncompressed warm-up steps (1-bit Adam, 1-bit LAMB), or auto "
                             "(else ONEBIT_FREEZE_STEP)")
    parser.add_argument("--var-freeze-step",
                        help="0/1 Adam: phase A (variance refreshes) runs to this step + 1, "
                             "as in DeepSpeed; or auto (default)")
    parser.add_argument("--local-step-scaler",
                        help="0/1 Adam: steps before the local interval doubles, or auto "
                             "(default)")
    parser.add_argument("--total-steps", type=int,
                        help="the run's optimizer steps, for --freeze-step auto (a "
                             "transformers.Trainer gives its own; else ONEBIT_TOTAL_STEPS)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("give the command to run, e.g. onebit-run accelerate launch train.py")
    env = os.environ
    env.setdefault("ONEBIT_ADAM", "1")
    for value, name in ((args.optimizer, "ONEBIT_OPTIMIZER"),
                        (args.freeze_step, "ONEBIT_FREEZE_STEP"),
                        (args.var_freeze_step, "ONEBIT_VAR_FREEZE_STEP"),
                        (args.local_step_scaler, "ONEBIT_LOCAL_STEP_SCALER")):
        if value is not None:
            env[name] = str(value)
    if args.total_steps is not None:
        env["ONEBIT_TOTAL_STEPS"] = str(args.total_steps)
    from onebit_plugin.integrations.accelerate_flag import OneBitSettings

    try:
        if OneBitSettings.from_env() is None:
            print(f"onebit-run: ONEBIT_ADAM={env['ONEBIT_ADAM']!r} turns 1-bit Adam off; "
                  "running the command unchanged", file=sys.stderr)
    except ValueError as exc:
        parser.error(str(exc))
    env["PYTHONPATH"] = os.pathsep.join(
        [str(BOOTSTRAP), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    try:
        os.execvp(args.command[0], args.command)
    except FileNotFoundError:
        parser.error(f"command not found: {args.command[0]}")


if __name__ == "__main__":
    main()
