"""Reading and writing the configuration: TOML files, `--set section.key=value` overrides, one-line errors."""

from __future__ import annotations

import tomllib
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
        shown = "" if isinstance(value, dict) else f"={value!r}"
        lines.append(f"{key}{shown}: {msg}")
    return "invalid config: " + "; ".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """'section.key=value' -> (['section', 'key'], value), the value parsed as a TOML value when it can be."""
    if "=" not in text:
        raise ValueError(f"--set '{text}': expected section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare string
    return key.strip().split("."), value


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
