"""Reading and writing the configuration: TOML files, `--set section.key=value` overrides, one-line errors."""

from __future__ import annotations

import difflib
import re
import tomllib
import typing
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from paratrain.config.schema import TrainConfig


def format_validation_error(err: ValidationError) -> str:
    """One message per problem: the dotted key, the value given, and what is allowed."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "config"
        value = e.get("input")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":  # pydantic's "Extra inputs are not permitted" names nothing allowed
            msg = _unknown_key(e["loc"])
        shown = "" if isinstance(value, dict) else f"={value!r}"
        lines.append(f"{key}{shown}: {msg}")
    return "invalid config: " + "; ".join(lines)


def _unknown_key(loc: tuple) -> str:
    """'unknown key; allowed: ...' for the section at loc[:-1] (a typo gets its closest keys first)."""
    model = TrainConfig
    for part in loc[:-1]:
        if isinstance(part, int):  # an entry of a list of sections (data.mix): its element type is `model` already
            continue
        field = model.model_fields.get(str(part))
        kinds = [getattr(field, "annotation", None)]
        while kinds and not (isinstance(kinds[0], type) and hasattr(kinds[0], "model_fields")):
            kinds = [*typing.get_args(kinds[0]), *kinds[1:]]  # X | None, list[X]: X
        if not kinds:
            return "unknown key"
        model = kinds[0]
    names = list(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), names, n=2, cutoff=0.6)
    what = "section" if len(loc) == 1 else "key"
    return (f"unknown {what}" + (f" (did you mean {' or '.join(close)}?)" if close else "")
            + f"; allowed: {', '.join(names)}")


# The commonest override values, read without a TOML parse (tomllib: ~10 us a value; a config is ~15 overrides
# and the suite loads thousands): exactly these TOML forms, with the value tomllib gives them. Anything else
# (floats, arrays, escapes, spaces, comments) goes to tomllib as before.
_TOML_INT = re.compile(r"[+-]?(?:0|[1-9][0-9]*)")  # decimal, no underscores or leading zeros
_TOML_PLAIN_STRING = re.compile(r'"[^"\\\x00-\x1f\x7f]*"')  # a basic string without escapes or control chars
_TOML_BOOLS = {"true": True, "false": False}


def _toml_value(raw: str) -> Any:
    """`raw` as a TOML value (tomllib.loads(f"v = {raw}")["v"]), or raw itself when it is not one."""
    if raw in _TOML_BOOLS:
        return _TOML_BOOLS[raw]
    if _TOML_INT.fullmatch(raw):
        return int(raw)
    if _TOML_PLAIN_STRING.fullmatch(raw):
        return raw[1:-1]
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare string


def parse_override(text: str) -> tuple[list[str], Any]:
    """'section.key=value' -> (['section', 'key'], value), the value parsed as a TOML value when it can be."""
    if "=" not in text:
        raise ValueError(f"--set '{text}': expected section.key=value")
    key, raw = text.split("=", 1)
    if not all(key.strip().split(".")):
        raise ValueError(f"--set '{text}': expected section.key=value (e.g. train.steps=50)")
    return key.strip().split("."), _toml_value(raw)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"--config '{path}': no such file")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"--config '{path}': not valid TOML: {exc}") from None
    for item in overrides or []:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set '{item}': '{k}' is not a section")
        node[keys[-1]] = value
    try:
        return TrainConfig(**data)
    except ValidationError as err:
        raise ValueError(format_validation_error(err)) from None


def dump_config(cfg: TrainConfig) -> str:
    import tomli_w

    return tomli_w.dumps(cfg.model_dump(exclude_none=True))


def resolved_config(cfg: TrainConfig) -> str:
    """`paratrain config`'s output: the config with every default filled in, after the checks that need no world
    size (pipeline stages vs layers, schedule, microbatches), and the model's size as a comment."""
    from paratrain.config.pipeline import check_pipeline_layout

    if cfg.parallel.pp > 1 or cfg.parallel.pp_layers is not None:
        check_pipeline_layout(cfg, cfg.parallel.dp if cfg.parallel.dp > 0 else None)  # dp=-1: known at launch
    shape = cfg.model_shape()
    return dump_config(cfg) + f"# model: {shape.name}, {shape.num_params() / 1e6:,.2f}M parameters\n"
