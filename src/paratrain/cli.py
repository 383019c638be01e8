"""The `paratrain` command, and the small generator its subcommands are built with.

Each part declares its subcommands in `<part>/commands.py` (`@command(...)` on the function that runs one), so
the CLI mirrors the architecture. A command's options are a dataclass whose fields carry their help (`opt`): the flag,
its type, choices, default, bounds and unit come from the field (name, annotation, metadata), so one option means
one thing and is checked one way everywhere. The shared groups (`ConfigArgs`, `Output`, `Workload`, ...) are
defined once, below. Config-driven commands (train, data prepare, config, verify, export, generate, launch) also
get one `--SECTION.KEY VALUE` flag per key of the training schema (the same as `--set SECTION.KEY=VALUE`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import operator
import os
import sys
import types
import typing
from dataclasses import MISSING, dataclass, field

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

Every subcommand has its own --help with examples. Units are in the flag names (-s seconds, -usd dollars,
-gib/-gb sizes, -days), and a flag means the same in every command that has it (docs/cli.md).
"""

# the unit a field's name ends in, printed in its help
UNITS = {"_s": "seconds", "_usd": "USD", "_days": "days", "_gib": "GiB", "_gb": "GB", "_gbps": "GB/s"}


class UserError(Exception):
    """An error in the user's input: printed as one line, exit code 2, no traceback."""


def opt(help: str, default=None, **meta):
    """A command option as a dataclass field. meta: flag, short (or another spelling), choices, metavar, nargs, const, required,
    positional, group, exclusive (a name: at most one option of that name), ge/gt/le/lt (bounds checked before the
    command runs; of each item of a tuple[X, ...] option, a comma-separated list), factory (a mutable default), env
    (an environment variable that, set when the parser is built, is the default), refused (an old flag, hidden:
    given, it is refused with this pointer to what replaced it)."""
    factory = meta.pop("factory", None)
    meta["help"] = argparse.SUPPRESS if "refused" in meta else help
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _kind(hint) -> tuple[str, typing.Any, tuple | None]:
    """(kind, element type, choices) of an annotation: bool flag, list (repeatable), or one value."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]
    if typing.get_origin(hint) is typing.Literal:
        return "value", type(typing.get_args(hint)[0]), typing.get_args(hint)
    if typing.get_origin(hint) is list:
        return "list", typing.get_args(hint)[0], None
    if typing.get_origin(hint) is tuple:  # tuple[X, ...]: one comma-separated value, split after parsing
        base = typing.get_args(hint)[0]
        literal = typing.get_origin(base) is typing.Literal
        return "csv", str if literal else base, typing.get_args(base) if literal else None
    return ("flag", None, None) if hint is bool else ("value", hint, None)


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def _help(f: dataclasses.Field, default) -> str:
    text = f.metadata["help"]
    if text is argparse.SUPPRESS:
        return text
    unit = next((u for suffix, u in UNITS.items() if f.name.endswith(suffix)), None)
    if unit and unit not in text:
        text += f" ({unit})"
    if default not in (None, False, [], "") and "default" not in text:
        text += f" (default {default})"
    return text.replace("%", "%%")


def add_options(parser: argparse.ArgumentParser, cls) -> None:
    """One argparse option per field of the dataclass `cls` (in field order, in its `group`)."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, typing.Any] = {}
    for f in dataclasses.fields(cls):
        m = f.metadata
        where = parser if "group" not in m else groups.get(m["group"]) or groups.setdefault(
            m["group"], parser.add_argument_group(m["group"]))
        if "exclusive" in m:  # one of these options at most (argparse's mutually exclusive group)
            key = ("exclusive", m["exclusive"])
            where = groups.get(key) or groups.setdefault(key, where.add_mutually_exclusive_group())
        kind, base, choices = _kind(hints[f.name])
        default = f.default_factory() if f.default is MISSING else f.default
        default = os.environ.get(m["env"], default) if "env" in m else default  # e.g. torchrun's PET_NNODES
        kw = {"help": _help(f, default)}
        if kind == "csv":  # the text is split (and its items checked) by check_options
            default = ",".join(map(str, default)) if isinstance(default, tuple) else default
            kw.update(type=str, default=default, metavar=m.get("metavar", "A,B,..."))
        elif kind == "flag":
            kw["action"] = "store_true"
        else:
            kw.update(type=base, default=default)
            if kind == "list" and "nargs" not in m:  # repeatable; with nargs, one option takes several values
                kw["action"] = "append"
        if kind != "csv" and (choices or "choices" in m):
            kw["choices"] = m.get("choices", choices)
        kw.update({k: m[k] for k in ("metavar", "nargs", "const", "required") if k in m})
        if m.get("positional"):
            where.add_argument(f.name, **kw)
        else:
            where.add_argument(flag_of(f), *([m["short"]] if "short" in m else []), dest=f.name, **kw)


BOUNDS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<="), "lt": (operator.lt, "<")}


def _split(f: dataclasses.Field, base, choices, text: str) -> tuple:
    """A tuple[X, ...] option's comma-separated text as items; a bad one names the flag and what is allowed."""
    allowed = ", ".join(map(str, choices)) if choices else f"{base.__name__} values" + (
        f" >= {f.metadata['ge']}" if "ge" in f.metadata else "")
    try:
        items = tuple(base(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        items = ()
    if not items or any(choices and x not in choices or "ge" in f.metadata and x < f.metadata["ge"] for x in items):
        raise UserError(f"{flag_of(f)} = {text!r}: allowed: {allowed} (comma-separated)")
    return items


def check_options(cls, args) -> typing.Any:
    """The options as an instance of `cls`: comma lists split, and the ge/gt bounds of every option given
    checked; one line naming the flag, its value and the bound."""
    hints, values = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        value = values[f.name] = getattr(args, f.name)
        kind, base, choices = _kind(hints[f.name])
        if "refused" in f.metadata and value is not None:
            raise UserError(f"{flag_of(f)} {value!r}: {f.metadata['refused']}")
        if kind == "csv" and isinstance(value, str):
            values[f.name] = _split(f, base, f.metadata.get("choices", choices), value)
        elif value is not None and not isinstance(value, bool | list | str):
            for key, (holds, sign) in BOUNDS.items():
                if key in f.metadata and not holds(value, f.metadata[key]):
                    raise UserError(f"{flag_of(f)} = {value}: must be {sign} {f.metadata[key]}")
    return cls(**values)


def command(name: str, cls, help: str):
    """Declares the function below it as the subcommand `name` (`plan`; `serve plan` under the module's GROUPS
    entry `serve`), run with the checked options (an instance of the dataclass `cls`); `help` is its line in the
    list of commands, its long help the section `## name` of cli_help.md. A command with the training config's
    options (`ConfigArgs`) also gets one flag per config key."""
    def declare(run):
        run.cli_command = dict(name=name, cls=cls, help=help)
        return run
    return declare


def command_help() -> dict[str, list[str]]:
    """The long help of each command, from the package's cli_help.md (also the commands' documentation):
    `## COMMAND` sections, each with one or two ```text blocks (the text above the options, and below them)."""
    from importlib.resources import files

    sections: dict[str, list[str]] = {}
    blocks, inside = None, False  # the current section's blocks; within a block
    for line in files("paratrain").joinpath("cli_help.md").read_text(encoding="utf-8").splitlines(keepends=True):
        if inside:  # verbatim up to the closing fence
            inside = line.rstrip() != "```"
            blocks[-1] += line if inside else ""
        elif line.startswith("## "):
            blocks = sections.setdefault(line[3:].strip(), [])
        elif line.rstrip() == "```text" and blocks is not None:
            inside = True
            blocks.append("")
    return sections


def _add_command(sub, run, name: str, cls, help: str, text: list[str]):
    config_keys = issubclass(cls, ConfigArgs)
    usage = "%(prog)s [options] [--SECTION.KEY VALUE ...]" if config_keys else None  # not 100 keys in the usage
    description, epilog = (text + ["", None])[:2]
    p = sub.add_parser(name.split()[-1], help=help, description=description, usage=usage, epilog=epilog,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(p, cls)
    if config_keys:
        add_config_keys(p)
    p.set_defaults(func=lambda args: run(check_options(cls, args)))


def options_of(cls, names=None, group: str | None = None, **per_field):
    """The options of a part's own schema dataclass `cls`: one per field with a help text (in its metadata, with
    any other `opt` keyword: bounds, env, ...), same name, type and default, so nothing is restated
    (`from_options` builds the object back); a dataclass to inherit from. `names`: only these fields; `group`:
    their help section; `per_field`: more `opt` keywords for one field, e.g. chips={"exclusive": "size"}."""
    hints, fields = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        if "help" in f.metadata and (names is None or f.name in names):
            kw = {k: v for k, v in f.metadata.items() if k != "help"} | per_field.get(f.name, {})
            kw |= {"group": group} if group else {}
            if f.default is MISSING and f.default_factory is not MISSING:
                kw["factory"] = f.default_factory
            default = None if f.default is MISSING else f.default
            fields.append((f.name, hints[f.name], opt(f.metadata["help"], default, **kw)))
    return dataclasses.make_dataclass(f"{cls.__name__}Options", fields, kw_only=True)


def from_options(cls, opts, **given):
    """An instance of the dataclass `cls` (a part's own schema) from the options of the same names; `given` wins."""
    names = {f.name for f in dataclasses.fields(cls)} & vars(opts).keys()
    return cls(**{name: getattr(opts, name) for name in names} | given)


def _group(sub, name: str, help: str, text: list[str]):
    """A command with subcommands (`hardware list|show`): prints its help when given none."""
    p = sub.add_parser(name, help=help, description="".join(text),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=lambda args: p.print_help() or 0)
    return p.add_subparsers(dest=f"{name}_command", metavar="ACTION")


# ---- the shared option groups --------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Output:
    json: bool = opt("print only JSON on stdout (logs and progress go to stderr)")


@dataclass(kw_only=True)
class ConfigArgs:
    config: str | None = opt("training config TOML (default: built-in defaults = tiny model)", short="-c",
                             metavar="FILE")
    set: list[str] = opt("override one config key (repeatable); the value is parsed as TOML; every key is also a "
                         "flag: --parallel.tp 2 = --set parallel.tp=2", factory=list, metavar="SECTION.KEY=VALUE")


@dataclass(kw_only=True)
class RunFiles:
    """The files of one training run beside its config (`train`; `launch` passes them on)."""
    resume_from: str | None = opt("resume from this checkpoint folder (.../step_00000100) or checkpoint directory "
                                  "(its newest complete one); local, shared filesystem or s3://bucket/prefix. "
                                  "Default: checkpoint.resume (\"auto\": the newest complete one in checkpoint.dir)",
                                  metavar="PATH")
    summary_json: str | None = opt("write the run summary as JSON to this file (main rank)", metavar="FILE")


@dataclass(kw_only=True)
class Workload:
    """What the planner, the cost model and the simulator plan for: one meaning, one default everywhere."""
    model: str | None = opt("model preset (llama2-7b, llama3-70b, ...) or model TOML file")
    seq: int = opt("sequence length in tokens", 4096, ge=1)
    global_batch: int = opt("sequences per optimizer step", 1024, ge=1)


def section_options(section: str, keys, group: str) -> list[tuple]:
    """Options for keys of a training config section, for `dataclasses.make_dataclass`: each spelled as the
    trainer's key (`--pp-schedule`, also `--parallel.pp_schedule`), with its type, bounds and help; unset (None)
    unless given, so the schema's own defaults and derived values apply (the default is in the help)."""
    from paratrain.config import FIELD_HELP, TrainConfig

    fields = TrainConfig.model_fields[section].annotation.model_fields
    out = []
    for key in keys:
        f = fields[key]
        about = f.description or FIELD_HELP.get(f"{section}.{key}", key)
        bounds = {k: getattr(m, k) for m in f.metadata for k in BOUNDS if hasattr(m, k)}
        help = f"{about} ({section}.{key}, default {f.default!r})"
        meta = {"metavar": "N"} if f.annotation is int else {}
        out.append((key, f.annotation | None, opt(help, short=f"--{section}.{key}", group=group, **bounds, **meta)))
    return out


class _ConfigKey(argparse.Action):
    """--SECTION.KEY VALUE: appended to --set in command-line order, so the later of the two wins."""

    def __call__(self, parser, namespace, value, option_string=None):
        namespace.set = [*(namespace.set or []), f"{option_string[2:]}={value}"]


def add_config_keys(parser: argparse.ArgumentParser) -> None:
    from paratrain.config import TrainConfig

    g = parser.add_argument_group("config keys (each the same as --set SECTION.KEY=VALUE; docs/config.md)")
    for section, sfield in TrainConfig.model_fields.items():
        for key, kfield in sfield.annotation.model_fields.items():
            about = (kfield.description or "").split(";")[0].split(". ")[0][:60]
            default = kfield.get_default(call_default_factory=True)
            g.add_argument(f"--{section}.{key}", action=_ConfigKey, metavar="V", dest="set", default=argparse.SUPPRESS,
                           help=f"{about} (default {default!r})".lstrip().replace("%", "%%"))


def json_safe(obj):
    """NaN and inf become null (JSON has neither); tuples become lists."""
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return None if isinstance(obj, float) and not math.isfinite(obj) else obj


def _plain(value):
    """numpy scalars as numbers; anything else JSON lacks (paths, dates) as its text."""
    return value.item() if hasattr(value, "item") else str(value)


def print_json(obj) -> None:
    """The whole of stdout for --json: one JSON document."""
    print(json.dumps(json_safe(obj), indent=2, default=_plain))


def show(opts, data, text) -> None:
    """A command's result: with --json, `data` as the one JSON document; else `text` (a function printing it)."""
    print_json(data) if opts.json else text()


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("paratrain")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


# ---- the command ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paratrain", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="Plan, run and survive large-scale LLM training (Trainium, GPU).")
    parser.add_argument("--version", action="version", version=f"paratrain {version()}")
    subs, texts = {(): parser.add_subparsers(dest="command", metavar="COMMAND")}, command_help()
    for module in map(importlib.import_module, COMMAND_MODULES):
        groups = dict(getattr(module, "GROUPS", ()))  # (name, help)
        for run in vars(module).values():  # in the order the module defines them
            if getattr(run, "__module__", None) == module.__name__ and hasattr(run, "cli_command"):
                above = tuple(run.cli_command["name"].split()[:-1])  # () or ("serve",)
                if above not in subs:
                    subs[above] = _group(subs[()], above[0], groups[above[0]], texts.get(above[0], []))
                _add_command(subs[above], run, **run.cli_command, text=texts.get(run.cli_command["name"], []))
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
