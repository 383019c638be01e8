"""The `paratrain` command.

Each part of the project registers its own subcommands from `<part>/commands.py` (a `register(subparsers)`
function), so the CLI mirrors the architecture: train/data in `train/`, hardware in `hardware/`, plan/estimate
in `plan/`, simulate in `sim/`. This file only wires them together.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# (module, one-line summary shown by `paratrain --help`). Order = order in the help text.
COMMAND_MODULES = [
    "paratrain.train.commands",
    "paratrain.train.checkpoint_commands",
    "paratrain.train.verify",
    "paratrain.train.export_commands",
    "paratrain.hardware.commands",
    "paratrain.plan.commands",
    "paratrain.plan.serve_commands",
    "paratrain.infer.commands",
    "paratrain.cost.commands",
    "paratrain.sim.commands",
    "paratrain.launch.commands",
    "paratrain.calibrate.commands",
]

EPILOG = """\
typical workflow:
  paratrain data prepare                         # tokenize the embedded default corpus
  paratrain train --config configs/tiny.toml     # train (torchrun --nproc-per-node N for parallel layouts)
  paratrain hardware list                        # the accelerator catalog
  paratrain plan --model llama2-7b --hardware trn1.32xlarge --nodes 128 --seq 4096 --global-batch 1024
  paratrain simulate --help                      # failures, checkpoints and goodput at cluster scale

Every subcommand has its own --help with examples.
"""


class UserError(Exception):
    """An error in the user's input: printed as one line, exit code 2, no traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paratrain",
        description="Plan, run and survive large-scale LLM training (Trainium and GPU).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a part not built yet must not break the others
            if exc.name == name:
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except (UserError, ValueError) as exc:
        # ValueError covers pydantic's ValidationError and our own config checks: bad input, not a bug.
        print(f"paratrain {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`paratrain ... | head`): stop quietly, as Unix tools do. Point stdout at devnull so
        # the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by a closed pipe


if __name__ == "__main__":
    sys.exit(main())
