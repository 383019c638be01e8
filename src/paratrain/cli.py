"""The `paratrain` command, generated from dataclasses (docs/cli.md).

Each part declares its subcommands in its commands.py (`@command` on the function that runs one). A command's
options are a dataclass: each field is one flag, its name, type, choices, default, bounds and unit from the field,
so a flag means one thing and is checked one way everywhere; a part's own schema becomes options as it is
(`options_of`), the training schema's keys become flags (`--SECTION.KEY V` = `--set`); long help: cli_help.md.
Our own small generator rather than tyro or jsonargparse: those print their own multi-line errors, and our
one-line bound errors, comma lists, refused old flags, environment defaults and config-key flags would need
adapters about as long as this.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import json
import math
import operator
import os
import re
import sys
import textwrap
import types
import typing
from dataclasses import MISSING, dataclass
from importlib.resources import files
from pathlib import Path

from paratrain.config import FIELD_HELP, TrainConfig
from paratrain.config.options import described

COMMAND_MODULES = [f"paratrain.{m}" for m in (  # in the order `paratrain --help` lists their commands
    "train.commands", "train.verify", "hardware.commands", "plan.commands", "plan.serve_commands",
    "infer.commands", "cost.commands", "sim.commands", "launch.commands", "calibrate.commands")]
UNITS = {"_s": "seconds", "_usd": "USD", "_days": "days", "_gib": "GiB", "_gb": "GB", "_gbps": "GB/s"}  # in the help
BOUNDS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<="), "lt": (operator.lt, "<")}
ARGPARSE_KEYS = ("metavar", "nargs", "const", "required", "choices")  # metadata passed on to add_argument as is


class UserError(Exception):
    """An error in the user's input: printed as one line, exit code 2, no traceback."""


def opt(help: str, default=None, **meta):
    """A command option as a dataclass field. meta: flag (another spelling), short (a second one), the argparse
    keywords of ARGPARSE_KEYS, positional, group (its help section), exclusive (a name: at most one option of that
    name), ge/gt/le/lt (bounds checked before the command runs, on each item of a tuple[X, ...] comma list),
    factory (a mutable default), env (an environment variable that, set, is the default), refused (an old flag,
    hidden: given, it is refused with this pointer to what replaced it)."""
    return described(argparse.SUPPRESS if "refused" in meta else help, default, **meta)


def _kind(hint) -> tuple[str, typing.Any, tuple | None]:
    """(kind, element type, choices) of an annotation: flag (bool), list (repeatable), csv (tuple[X, ...]: one
    comma-separated value) or value."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    hint = args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1 else hint
    origin, args = typing.get_origin(hint), typing.get_args(hint)  # X | None: X
    if origin is typing.Literal:
        return "value", type(args[0]), args
    if origin is tuple:
        literal = typing.get_origin(args[0]) is typing.Literal
        return "csv", str if literal else args[0], typing.get_args(args[0]) if literal else None
    if origin is list:
        return "list", args[0], None
    return ("flag", None, None) if hint is bool else ("value", hint, None)


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def _help(f: dataclasses.Field, default) -> str:
    text, unit = f.metadata["help"], next((u for s, u in UNITS.items() if f.name.endswith(s)), None)
    if text is argparse.SUPPRESS:
        return text
    text += f" ({unit})" if unit and unit not in text else ""
    text += f" (default {default})" if default not in (None, False, [], "") and "default" not in text else ""
    return text.replace("%", "%%")


def _checked(f: dataclasses.Field, kind: str, base, choices):
    """argparse's `type` for an option with bounds, a comma list or a refusal: the text converted and checked as it
    is parsed. A bad value raises UserError (argparse lets it through, where it would reword a ValueError): one
    line naming the flag, the value and what is allowed."""
    m, flag = f.metadata, flag_of(f)
    bounds = [(holds, sign, m[k]) for k, (holds, sign) in BOUNDS.items() if k in m]

    def check(text: str):
        if "refused" in m:
            raise UserError(f"{flag} {text!r}: {m['refused']}")
        if kind != "csv":
            value = base(text)  # not a number: argparse's own message
            for holds, sign, bound in bounds:
                if not holds(value, bound):
                    raise UserError(f"{flag} = {value}: must be {sign} {bound}")
            return value
        try:
            items = tuple(base(x.strip()) for x in text.split(",") if x.strip())
        except ValueError:
            items = ()
        if not items or any(choices and x not in choices or not all(holds(x, b) for holds, _, b in bounds) for x in items):
            allowed = ", ".join(map(str, choices)) if choices else " ".join(
                [f"{base.__name__} values", *(f"{sign} {bound}" for _, sign, bound in bounds)])
            raise UserError(f"{flag} = {text!r}: allowed: {allowed} (comma-separated)")
        return items
    check.__name__ = base.__name__  # argparse's "invalid int value"
    return check


def add_options(parser: argparse.ArgumentParser, cls) -> None:
    """One argparse option per field of the dataclass `cls`, in field order, each in its `group`."""
    hints, groups = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        m, where = f.metadata, parser
        if "group" in m:
            where = groups.get(m["group"]) or groups.setdefault(m["group"], parser.add_argument_group(m["group"]))
        if "exclusive" in m:  # argparse's mutually exclusive group
            key = ("exclusive", m["exclusive"])
            where = groups.get(key) or groups.setdefault(key, where.add_mutually_exclusive_group())
        kind, base, choices = _kind(hints[f.name])
        choices = m.get("choices", choices)
        default = f.default_factory() if f.default is MISSING else f.default
        default = os.environ.get(m["env"], default) if "env" in m else default  # e.g. torchrun's PET_NNODES
        default = ",".join(map(str, default)) if kind == "csv" and isinstance(default, tuple) else default
        checked = kind == "csv" or "refused" in m or any(k in m for k in BOUNDS)
        kw = {"help": _help(f, default), "default": default, "type": _checked(f, kind, base, choices) if checked
              else base} | ({"metavar": "A,B,..."} if kind == "csv" else {"choices": choices} if choices else {})
        if kind == "flag":
            kw = {"help": kw["help"], "action": "store_true"}
        elif kind == "list" and "nargs" not in m:  # repeatable; with nargs, one option takes several values
            kw["action"] = "append"
        kw |= {k: m[k] for k in ARGPARSE_KEYS if m.get(k) is not None and k != "choices"}
        names = [f.name] if m.get("positional") else [flag_of(f), *([m["short"]] if "short" in m else [])]
        where.add_argument(*names, **kw, **({} if m.get("positional") else {"dest": f.name}))


def check_options(cls, args) -> typing.Any:
    """The parsed options (each checked as it was parsed) as an instance of `cls`; an option declared with
    writes="file" / "dir" (what the command writes) must be writable, before the command does any work."""
    for f in dataclasses.fields(cls):
        if f.metadata.get("writes") and getattr(args, f.name, None):
            check_writable(flag_of(f), getattr(args, f.name), f.metadata["writes"])
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def check_writable(flag: str, path: str, kind: str) -> None:
    """A file (its folder) or a folder we can create and write in; else one line (an unwritable --out used to be
    a FileNotFoundError traceback after the work: a probe's measurements, a compare, a whole training run)."""
    import tempfile

    if "://" in path:
        return  # a remote location: its own storage layer checks and retries
    folder = Path(path).absolute() if kind == "dir" else Path(path).absolute().parent
    while not folder.exists():  # created by the command later: nothing is created here
        folder = folder.parent
    try:
        if not folder.is_dir():
            raise NotADirectoryError(f"{folder} is a file")
        with tempfile.TemporaryFile(dir=folder):  # root passes os.access everywhere: try a write
            pass
    except OSError as exc:
        raise UserError(f"{flag} {path!r}: cannot write there ({exc.strerror or exc}); allowed: a path in a folder "
                        f"this user can create and write") from None


def command(name: str, cls, help: str, /, **fields):
    """Declares the function below it as the subcommand `name` (`plan`; `serve plan` under the module's GROUPS
    entry `serve`), run with its checked options: an instance of the dataclass `cls` (a tuple: these combined),
    with `fields` more of them (NAME=(TYPE, opt(...))), its `.options`. `help` is its line in the list of
    commands, its long help the section `## name` of cli_help.md. Options with `ConfigArgs` also get one flag
    per config key."""
    if fields or isinstance(cls, tuple):
        cls = dataclasses.make_dataclass(name.title().replace(" ", "") + "Args", [
            (k, t, f) for k, (t, f) in fields.items()], bases=cls if isinstance(cls, tuple) else (cls,), kw_only=True)

    def declare(run):
        run.cli_command, run.options = dict(name=name, cls=cls, help=help), cls
        return run
    return declare


def options_of(cls, names=None, group: str | None = None, unset: bool = False, **per_field):
    """The options of a part's own schema dataclass `cls`: one per field with a help (in its metadata, with any
    other `opt` keyword), the same name, type and default, so nothing is restated (`from_options` builds the
    object back); a dataclass to inherit from. `names`: only these fields; `group`: their help section; `unset`:
    None unless given (another source, e.g. a config file, comes first), the help naming the field's default;
    `per_field`: more `opt` keywords for one field, e.g. chips={"exclusive": "size"}."""
    hints, fields = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        if "help" in f.metadata and (names is None or f.name in names):
            kw = dict(f.metadata) | per_field.get(f.name, {}) | ({"group": group} if group else {})
            kw |= {"factory": f.default_factory} if f.default is MISSING and f.default_factory is not MISSING else {}
            default, about = None if f.default is MISSING else f.default, kw.pop("help")
            fields.append((f.name, hints[f.name] | None if unset else hints[f.name], opt(
                f"{about} (default {default})" if unset else about, None if unset else default, **kw)))
    return dataclasses.make_dataclass(f"{cls.__name__}Options", fields, kw_only=True)


def from_options(cls, opts, **given):
    """An instance of the dataclass `cls` (a part's own schema) from the options of the same names; `given` wins."""
    names = {f.name for f in dataclasses.fields(cls)} & vars(opts).keys()
    return cls(**{name: getattr(opts, name) for name in names} | given)


def key_help(section: str, key: str, short: bool = False) -> str:
    """A training config key's description, the same for its flag, its shortcut flag and docs/config.md."""
    f = TrainConfig.model_fields[section].annotation.model_fields[key]
    about = f.description or FIELD_HELP.get(f"{section}.{key}", key)
    about = textwrap.shorten(about.split(";")[0].split(". ")[0], 64, placeholder="...") if short else about
    return f"{about} ({'' if short else f'{section}.{key}, '}default {f.get_default(call_default_factory=True)!r})"


def section_options(section: str, keys, group: str) -> list[tuple]:
    """Shortcut options for keys of a training config section (`dataclasses.make_dataclass` fields), each spelled
    as the trainer's key (`--pp-schedule`, also `--parallel.pp_schedule`), with its type, bounds and help; unset
    (None) unless given, so the schema's defaults and derived values apply."""
    fields = TrainConfig.model_fields[section].annotation.model_fields
    return [(key, f.annotation | None, opt(key_help(section, key), short=f"--{section}.{key}", group=group,
                                           metavar="N" if f.annotation is int else None,
                                           **{k: getattr(m, k) for m in f.metadata for k in BOUNDS if hasattr(m, k)}))
            for key, f in ((key, fields[key]) for key in keys)]


def add_config_keys(parser: argparse.ArgumentParser) -> None:
    """One flag per training config key, --SECTION.KEY VALUE: appended to --set as SECTION.KEY=VALUE in
    command-line order, so the later of the two wins."""
    g = parser.add_argument_group("config keys (each the same as --set SECTION.KEY=VALUE; docs/config.md)")
    for section, sfield in TrainConfig.model_fields.items():
        for key in sfield.annotation.model_fields:
            g.add_argument(f"--{section}.{key}", action="append", dest="set", metavar="V", default=argparse.SUPPRESS,
                           type=lambda value, key=f"{section}.{key}": f"{key}={value}",
                           help=key_help(section, key, short=True).replace("%", "%%"))


def command_help() -> dict[str, list[str]]:
    """The long help of each command, from the package's cli_help.md (also the commands' documentation):
    `## COMMAND` sections, each with one or two ```text blocks (the text above the options, and below them)."""
    text = files("paratrain").joinpath("cli_help.md").read_text(encoding="utf-8")
    return {name.strip(): re.findall(r"^```text\n(.*?)^```$", body, re.S | re.M)
            for name, body in re.findall(r"^## ([^\n]+)\n(.*?)(?=^## |\Z)", text, re.S | re.M)}


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
    summary_json: str | None = opt("write the run summary as JSON to this file (main rank)", metavar="FILE",
                                   writes="file")


@dataclass(kw_only=True)
class Workload:
    """What the planner, the cost model and the simulator plan for: one meaning, one default everywhere."""
    model: str | None = opt("model preset (llama2-7b, llama3-70b, ...) or model TOML file")
    seq: int = opt("sequence length in tokens", 4096, ge=1)
    global_batch: int = opt("sequences per optimizer step", 1024, ge=1)


@dataclass(kw_only=True)
class OnSystem:
    hardware: str = opt("system name (paratrain hardware list) or hardware TOML file", required=True)


# ---- output ----------------------------------------------------------------------------------------------------
def json_safe(obj):
    """NaN and inf become null (JSON has neither); tuples become lists."""
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return None if isinstance(obj, float) and not math.isfinite(obj) else obj


def print_json(obj, indent: int | None = 2) -> None:
    """The whole of stdout for --json: one JSON document (numpy scalars as numbers, paths and dates as text)."""
    print(json.dumps(json_safe(obj), indent=indent, default=lambda v: v.item() if hasattr(v, "item") else str(v)))


def show(opts, data, text) -> None:
    """A command's result: with --json, `data` as the one JSON document; else `text` (a function printing it)."""
    print_json(data) if opts.json else text()


def version() -> str:
    try:
        return importlib.metadata.version("paratrain")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


# ---- the command ---------------------------------------------------------------------------------------------
class OneLineParser(argparse.ArgumentParser):
    """argparse's own errors (an unknown flag, a bad choice, a missing value) in one line, like ours: argparse
    prints the whole usage first, up to 30 lines above the one that matters; `--help` still shows it all."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists every option)\n")


def _parser(sub, name: str, help: str, text: list[str], **kw) -> argparse.ArgumentParser:
    description, epilog = (text + ["", None])[:2]
    return sub.add_parser(name, help=help, description=description, epilog=epilog,
                          formatter_class=argparse.RawDescriptionHelpFormatter, **kw)


def chosen_commands(argv: list[str]) -> set[str]:
    """The command `argv` names, as `build_parser(only=...)` takes it: its first word ('train', or a group: 'serve')
    and its first two ('serve plan'). The root parser's options take no values, so the first word that is not an
    option is the command."""
    words = [a for a in argv if a[:1] != "-"][:2]
    return {words[0], " ".join(words)} if words else set()


def build_parser(only: set[str] | None = None) -> argparse.ArgumentParser:
    """The whole CLI. With `only` (main: the command its argv names), only those commands get their options and
    config-key flags; the others are listed with their help line (what `paratrain --help` and a bad command's
    error show): 7 commands' ~107 config-key flags each cost ~40 ms per call, and tests call main ~200 times."""
    texts = command_help()
    parser = OneLineParser(prog="paratrain", epilog=texts["paratrain"][0], description=(
        "Plan, run and survive large-scale LLM training (Trainium, GPU)."),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"paratrain {version()}")
    subs = {(): parser.add_subparsers(dest="command", metavar="COMMAND")}
    for module in map(importlib.import_module, COMMAND_MODULES):
        for run in vars(module).values():  # in the order the module defines them
            if getattr(run, "__module__", None) != module.__name__ or not hasattr(run, "cli_command"):
                continue
            name, cls, help = run.cli_command.values()
            above = tuple(name.split()[:-1])  # () or ("serve",): a group of subcommands, its line from GROUPS
            if above not in subs:
                group = _parser(subs[()], above[0], dict(module.GROUPS)[above[0]], texts.get(above[0], []))
                group.set_defaults(func=lambda args, group=group: group.print_help() or 0)  # given no subcommand
                subs[above] = group.add_subparsers(dest=f"{above[0]}_command", metavar="ACTION")
            configured = issubclass(cls, ConfigArgs)  # not 100 config keys in the usage line
            p = _parser(subs[above], name.split()[-1], help, texts.get(name, texts.get(" ".join(above), [])),
                        usage="%(prog)s [options] [--SECTION.KEY VALUE ...]" if configured else None)
            if only is not None and name not in only:
                continue
            add_options(p, cls)
            add_config_keys(p) if configured else None
            p.set_defaults(func=lambda args, run=run, cls=cls: run(check_options(cls, args)))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(only=chosen_commands(argv))
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # argparse's own error would name only the root parser, not the command they were given to
            command = " ".join(a for a in argv[:2] if a[:1] != "-" and a not in unknown)
            raise UserError(f"unrecognized arguments: {' '.join(unknown)} (`paratrain {command} --help` lists "
                            f"every option)")
        if not getattr(args, "func", None):
            return parser.print_help() or 0
        return int(args.func(args) or 0)
    except (UserError, ValueError) as exc:
        # ValueError covers pydantic's ValidationError and our own config checks: bad input, not a bug.
        print(f"paratrain {next((a for a in argv if a[:1] != '-'), '')}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`paratrain ... | head`): stop quietly, as Unix tools do. Point stdout at devnull so
        # the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by a closed pipe


if __name__ == "__main__":
    sys.exit(main())
