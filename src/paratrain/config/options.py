"""How a field of a part's own dataclass (SimConfig, LaunchSpec, the cost Request, ...) describes the command-line
option made from it: `described(help, default, **meta)` is `dataclasses.field` with the option's help and
keywords (bounds, choices, flag, group, env, metavar, ...: those of `paratrain.cli.opt`) in its metadata, which
`cli.options_of` and `sim.config.sim_options` read. One line per field, and the schema stays free of the CLI."""

from __future__ import annotations

from dataclasses import MISSING, field


def described(help: str, default=MISSING, factory=None, **meta):
    """A dataclass field with its option's help and keywords; factory: a mutable default's factory."""
    meta["help"] = help
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)
