"""What the simulator takes: a cluster, a step time, checkpointing, recovery, spares, stragglers, price.

Everything is a plain number so the simulator runs without the hardware catalog or the planner;
`paratrain.sim.catalog` fills these numbers from them when they are available.

Time unit: seconds everywhere. "Work" is fault-free compute time (steps * step_time_s).
Every default that is an assumption rather than a published number says so.
"""

from __future__ import annotations

import math
import re
import tomllib
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from pathlib import Path

from paratrain.config.options import described
from paratrain.sim.failures import FailureCause, llama3_causes, load_causes_toml, scale_rates
from paratrain.stragglers import DEFAULT_THRESHOLD, DEFAULT_WINDOW

STRAGGLER_POLICIES = ("wait", "bounded_staleness", "evict_replace")
INTERVAL_RULES = ("daly", "young")
REPAIR_DISTRIBUTIONS = ("lognormal", "exponential", "fixed")

HOUR_S = 3600.0
DAY_S = 86400.0


@dataclass(frozen=True)
class StragglerConfig:
    """Slow devices: episodes start at `rate_per_device_hour` per device, last an exponential time with mean
    `mean_duration_s`, and slow their device by a factor f = 1 + (slowdown_median - 1) * lognormal(0, sigma).

    Policies (names used by the CLI and the TOML file):
      wait               synchronous training: every step waits for the slowest rank, so the job runs at
                         1 / max(f) of full speed while any straggler is active.
      bounded_staleness  a slow data-parallel rank may fall up to `staleness_steps` steps behind (its gradients
                         applied late); the job only slows once an episode's lag exceeds that tolerance.
                         The lag is dropped when the episode ends (the rank discards its stale steps).
      evict_replace      like wait, but an episode the runtime's straggler detector flags (paratrain.stragglers:
                         slowdown above `detect_threshold` over a `detect_window`-step window) and that has
                         persisted for `evict_after_s` is evicted at the next checkpoint: the job stops there,
                         swaps the node for a spare and restarts from that checkpoint (no lost work, one restart,
                         one spare consumed). Milder episodes are never flagged, so never evicted.
    The default rate is 0 (no stragglers): there is no public per-device straggler rate to default to.
    """

    # metadata: `paratrain simulate`'s option of the field (its help; the flag where not the field's name)
    rate_per_device_hour: float = described("slow episodes per device-hour", 0.0, flag="--straggler-rate")
    mean_duration_s: float = described("mean episode length", 1800.0, flag="--straggler-duration")
    slowdown_median: float = described("median slowdown factor, > 1", 1.5, flag="--straggler-slowdown")
    slowdown_sigma: float = described("lognormal spread of the slowdown excess", 0.5, flag="--straggler-sigma")
    policy: str = described("what the job does about a slow rank, one of the policies below", "wait",
                            flag="--straggler-policy", choices=STRAGGLER_POLICIES)
    staleness_steps: int = described("bounded_staleness tolerance in steps", 4)
    evict_after_s: float = described("evict_replace: persistence before eviction", 300.0)
    detect_threshold: float = DEFAULT_THRESHOLD  # the trainer's staleness.straggler_threshold
    detect_window: int = DEFAULT_WINDOW  # the trainer's staleness.straggler_window (steps)

    def validate(self) -> None:
        _require(_finite(self.rate_per_device_hour) and self.rate_per_device_hour >= 0,
                 "straggler_rate_per_device_hour", self.rate_per_device_hour, ">= 0")
        _require(_finite(self.mean_duration_s) and self.mean_duration_s > 0, "straggler_mean_duration_s",
                 self.mean_duration_s, "> 0")
        _require(_finite(self.slowdown_median) and self.slowdown_median > 1, "straggler_slowdown_median",
                 self.slowdown_median, "> 1 (a factor)")
        _require(_finite(self.slowdown_sigma) and self.slowdown_sigma >= 0, "straggler_slowdown_sigma",
                 self.slowdown_sigma, ">= 0")
        _require(self.policy in STRAGGLER_POLICIES, "straggler_policy", self.policy, f"one of {STRAGGLER_POLICIES}")
        _require(_is_int(self.staleness_steps) and self.staleness_steps >= 0, "staleness_steps",
                 self.staleness_steps, "an integer >= 0")
        _require(_finite(self.evict_after_s) and self.evict_after_s >= 0, "evict_after_s", self.evict_after_s,
                 ">= 0")
        _require(_finite(self.detect_threshold) and self.detect_threshold > 1, "detect_threshold",
                 self.detect_threshold, "> 1 (a factor)")
        _require(_is_int(self.detect_window) and self.detect_window > 0, "detect_window", self.detect_window,
                 "an integer > 0")


@dataclass(frozen=True)
class SimConfig:
    """One training run to simulate. Give exactly one of `steps` (time to train) or `duration_s` (what a
    fixed wall-clock window achieves, e.g. Llama 3's 54-day snapshot)."""

    # metadata: `paratrain simulate`'s option of the field: its help, its --help group, its flag where not the
    # field's name in the flag's unit (sim/commands.py: detect_s -> --detect 60s, checkpoint_bytes -> --checkpoint-gb)
    devices: int = described("devices in the job: accelerator packages that fail as a unit (GPUs, Trainium chips)",
                             group="cluster")
    step_time_s: float = described("fault-free time of one training step, e.g. 8.5s", group="workload")
    steps: int | None = described("steps to train: report time and cost to train", None, group="workload")
    duration_s: float | None = described("fixed wall-clock window, e.g. 54d: report what it achieves", None,
                                         group="workload")
    devices_per_node: int = described("devices per node", 8, group="cluster")
    nodes_per_domain: int = described("nodes replaced together (the replacement unit), e.g. 4 for a Trn2 UltraServer",
                                      1, group="cluster")
    # Checkpointing. Sizes and bandwidths are aggregate over the job (assumption defaults: 1 TB, 100 GB/s).
    checkpoint_bytes: float = described("checkpoint size", 1e12, group="checkpoints")
    write_bytes_per_s: float = described("aggregate storage write bandwidth", 100e9, group="checkpoints")
    read_bytes_per_s: float = described("aggregate storage read bandwidth", 100e9, group="checkpoints")
    async_fraction: float = described("share of each write overlapped with compute, in [0,1); 0 = blocking", 0.0,
                                      group="checkpoints")
    checkpoint_interval: str | float = described(  # or compute seconds between checkpoints
        "daly, young, a duration (20m) or a step count (500steps)", "daly", group="checkpoints", flag="--interval")
    # Recovery (assumptions: a health check notices a dead rank within a minute; relaunch + init 3 min;
    # a node swap adds a minute for the scheduler to bring the spare in).
    detect_s: float = described("time to notice a failure; NCCL watchdog causes: 10m", 60.0, group="failures")
    restart_s: float = described("relaunch and initialise the job", 180.0, group="failures")
    swap_s: float = described("extra time to bring a spare node in", 60.0, group="failures")
    # Hot spares, counted in nodes; None = 1% of the job's nodes, at least one replacement unit (assumption).
    spare_nodes: int | None = described("hot spare nodes (default 1% of the job's nodes)", None, group="failures")
    repair_mean_s: float = described(  # assumption: a day to diagnose, reseat or RMA-swap
        "mean time to repair a failed node", 24 * HOUR_S, group="failures", flag="--repair")
    repair_distribution: str = described("repair time distribution", "lognormal", group="failures", flag="--repair-dist",
                                         choices=REPAIR_DISTRIBUTIONS)
    repair_sigma: float = 1.0
    causes: tuple[FailureCause, ...] = field(default_factory=llama3_causes)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    price_per_device_hour_usd: float | None = described(
        "USD per device-hour, a device being one GPU or Trainium chip (spares are paid for too)", None, group="cost",
        metavar="USD")
    samples: int = described("Monte-Carlo replicas", 100, group="cost")
    seed: int = described("random seed", 0, group="cost")
    notes: tuple[str, ...] = ()  # where the numbers came from (catalog, planner), shown in reports

    def __post_init__(self) -> None:
        self.validate()

    # ---- validation: one clear error per bad field, before any work ----------------------------------
    def validate(self) -> None:
        _require(_is_int(self.devices) and self.devices >= 1, "devices", self.devices, "an integer >= 1")
        _require(_is_int(self.devices_per_node) and self.devices_per_node >= 1, "devices_per_node",
                 self.devices_per_node, "an integer >= 1")
        _require(self.devices % self.devices_per_node == 0, "devices", self.devices,
                 f"a multiple of devices_per_node={self.devices_per_node}")
        _require(_is_int(self.nodes_per_domain) and self.nodes_per_domain >= 1, "nodes_per_domain",
                 self.nodes_per_domain, "an integer >= 1")
        _require(self.nodes % self.nodes_per_domain == 0, "nodes_per_domain", self.nodes_per_domain,
                 f"a divisor of the job's {self.nodes} nodes")
        _require(_finite(self.step_time_s) and self.step_time_s > 0, "step_time_s", self.step_time_s, "> 0")
        if (self.steps is None) == (self.duration_s is None):
            raise ValueError("give exactly one of steps (time to train) or duration_s (a fixed wall-clock window)")
        if self.steps is not None:
            _require(_is_int(self.steps) and self.steps >= 1, "steps", self.steps, "an integer >= 1")
        if self.duration_s is not None:
            _require(_finite(self.duration_s) and self.duration_s > 0, "duration_s", self.duration_s, "> 0")
        _require(_finite(self.checkpoint_bytes) and self.checkpoint_bytes >= 0, "checkpoint_bytes", self.checkpoint_bytes, ">= 0")
        _require(_finite(self.write_bytes_per_s) and self.write_bytes_per_s > 0, "write_bytes_per_s", self.write_bytes_per_s, "> 0")
        _require(_finite(self.read_bytes_per_s) and self.read_bytes_per_s > 0, "read_bytes_per_s", self.read_bytes_per_s, "> 0")
        _require(_finite(self.async_fraction) and 0 <= self.async_fraction < 1, "async_fraction", self.async_fraction, "in [0, 1)")
        self._validate_interval()
        for name in ("detect_s", "restart_s", "swap_s"):
            _require(_finite(getattr(self, name)) and getattr(self, name) >= 0, name, getattr(self, name), ">= 0")
        if self.spare_nodes is not None:
            _require(_is_int(self.spare_nodes) and self.spare_nodes >= 0, "spare_nodes", self.spare_nodes,
                     "an integer >= 0")
        _require(_finite(self.repair_mean_s) and self.repair_mean_s > 0, "repair_mean_s", self.repair_mean_s, "> 0")
        _require(self.repair_distribution in REPAIR_DISTRIBUTIONS, "repair_distribution",
                 self.repair_distribution, f"one of {REPAIR_DISTRIBUTIONS}")
        _require(_finite(self.repair_sigma) and self.repair_sigma >= 0, "repair_sigma", self.repair_sigma, ">= 0")
        _require(len(self.causes) > 0, "causes", "()", "at least one failure cause")
        self.stragglers.validate()
        if self.price_per_device_hour_usd is not None:
            _require(_finite(self.price_per_device_hour_usd) and self.price_per_device_hour_usd >= 0, "price_per_device_hour_usd",
                     self.price_per_device_hour_usd, ">= 0")
        _require(_is_int(self.samples) and self.samples >= 2, "samples", self.samples, "an integer >= 2")

    def _validate_interval(self) -> None:
        interval = self.checkpoint_interval
        if isinstance(interval, str):
            _require(interval in INTERVAL_RULES, "checkpoint_interval", interval,
                     f"one of {INTERVAL_RULES} or a number of seconds")
            return
        _require(_finite(interval) and interval > 0, "checkpoint_interval", interval, "> 0 seconds")
        async_write = self.async_fraction * self.checkpoint_write_s
        _require(interval >= async_write, "checkpoint_interval", interval,
                 f">= the asynchronous part of the write ({async_write:.1f} s): one write at a time")

    # ---- derived quantities -----------------------------------------------------------------------
    @property
    def nodes(self) -> int:
        return self.devices // self.devices_per_node

    @property
    def domains(self) -> int:
        return self.nodes // self.nodes_per_domain

    @property
    def spare_node_count(self) -> int:
        if self.spare_nodes is not None:
            return self.spare_nodes
        units = max(1, math.ceil(0.01 * self.domains))
        return units * self.nodes_per_domain

    @property
    def spare_slots(self) -> int:
        """Spares in replacement units: a failure in an UltraServer needs a whole spare UltraServer."""
        return self.spare_node_count // self.nodes_per_domain

    @property
    def checkpoint_write_s(self) -> float:
        return self.checkpoint_bytes / self.write_bytes_per_s

    @property
    def checkpoint_block_s(self) -> float:
        """Time the job is stopped per checkpoint (delta in Daly's notation)."""
        return (1.0 - self.async_fraction) * self.checkpoint_write_s

    @property
    def checkpoint_async_s(self) -> float:
        """Time after the stop until the checkpoint is durable (a failure before then loses it)."""
        return self.async_fraction * self.checkpoint_write_s

    @property
    def restore_s(self) -> float:
        return self.checkpoint_bytes / self.read_bytes_per_s

    @property
    def work_s(self) -> float | None:
        return None if self.steps is None else self.steps * self.step_time_s

    def with_updates(self, **changes) -> SimConfig:
        return replace(self, **changes)


def _require(ok: bool, name: str, value, allowed: str) -> None:
    if not ok and isinstance(value, str) and allowed.startswith((">", "in [")):
        allowed = "a number " + allowed  # e.g. checkpoint_bytes = "1TB" in a TOML file
    if not ok:
        raise ValueError(f"{name}={value!r} is not allowed: must be {allowed}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# ---- parsing of human-friendly values (CLI and TOML) ----------------------------------------------------
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*(s|sec|m|min|h|d)?\s*$", re.IGNORECASE)
_UNIT_S = {None: 1.0, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": HOUR_S, "d": DAY_S}


def parse_duration_s(text: str | float, name: str) -> float:
    """'90s', '30m', '2.5h', '54d' or a bare number of seconds."""
    if isinstance(text, int | float):
        return float(text)
    match = _DURATION.match(str(text))
    if not match:
        raise ValueError(f"{name}={text!r} is not a duration: use e.g. 90s, 30m, 2.5h, 54d")
    unit = match.group(2).lower() if match.group(2) else None
    return float(match.group(1)) * _UNIT_S[unit]


def parse_interval(text: str | float, step_time_s: float) -> str | float:
    """'daly', 'young', a duration ('20m'), or a number of steps ('500steps')."""
    if isinstance(text, int | float):
        return float(text)
    value = str(text).strip().lower()
    if value in INTERVAL_RULES:
        return value
    if value.endswith("steps"):
        count = value[: -len("steps")].strip()
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"checkpoint_interval={text!r}: a step count must be a positive integer, e.g. 500steps")
        return int(count) * step_time_s
    try:
        return parse_duration_s(value, "checkpoint_interval")
    except ValueError:
        raise ValueError(
            f"checkpoint_interval={text!r} is not allowed: use daly, young, a duration (20m) or a step count (500steps)"
        ) from None


# ---- TOML -------------------------------------------------------------------------------------------------
_TOML_FIELDS = {f.name for f in fields(SimConfig)} - {"causes", "stragglers", "notes"}
# Fields in seconds that a TOML file may also give as a duration string ("10s", "54d").
_DURATION_FIELDS = ("step_time_s", "duration_s", "repair_mean_s", "detect_s", "restart_s", "swap_s")


def read_toml(path: Path, what: str) -> dict:
    """A TOML file as a dict; a syntax error names the file (tomllib's message has only line and column)."""
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{what} {str(path)!r} is not valid TOML: {exc}") from None
_STRAGGLER_FIELDS = {f.name for f in fields(StragglerConfig)}


def load_sim_toml(path: str | Path) -> dict:
    """Read a simulation TOML into keyword arguments for SimConfig (validated when the config is built).

    Top-level keys are SimConfig fields (durations may be strings like "54d"); optional tables:
    [stragglers] (StragglerConfig fields), failures = "file.toml" or [[cause]] tables, rate_scale = 0.5.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"simulation config {str(path)!r} does not exist")
    data = read_toml(path, "simulation config")
    kwargs: dict = {}
    stragglers = data.pop("stragglers", None)
    failures = data.pop("failures", None)
    cause_tables = data.pop("cause", None)
    rate_scale = data.pop("rate_scale", 1.0)
    if not _finite(rate_scale):
        raise ValueError(f"{str(path)!r}: rate_scale={rate_scale!r} is not allowed: must be a number >= 0")
    unknown = set(data) - _TOML_FIELDS
    if unknown:
        raise ValueError(f"{str(path)!r}: unknown field(s) {sorted(unknown)}; allowed: {sorted(_TOML_FIELDS)}")
    for key, value in data.items():
        kwargs[key] = parse_duration_s(value, key) if key in _DURATION_FIELDS and isinstance(value, str) else value
    if stragglers is not None:
        if not isinstance(stragglers, dict):
            raise ValueError(f"{str(path)!r}: stragglers must be a [stragglers] table")
        bad = set(stragglers) - _STRAGGLER_FIELDS
        if bad:
            raise ValueError(f"{str(path)!r} [stragglers]: unknown field(s) {sorted(bad)}; allowed: {sorted(_STRAGGLER_FIELDS)}")
        stragglers = {k: parse_duration_s(v, k) if k.endswith("_s") and isinstance(v, str) else v
                      for k, v in stragglers.items()}
        kwargs["stragglers"] = StragglerConfig(**stragglers)
    causes = _causes_from_toml_parts(path, failures, cause_tables)
    kwargs["causes"] = scale_rates(causes, rate_scale)
    return kwargs


def _causes_from_toml_parts(path: Path, failures, cause_tables) -> tuple[FailureCause, ...]:
    if failures is not None and cause_tables is not None:
        raise ValueError(f"{str(path)!r}: give either failures = \"file.toml\" or [[cause]] tables, not both")
    if failures is not None:
        if not isinstance(failures, str):  # a [failures] table: read as a file name it was not
            raise ValueError(f"{str(path)!r}: failures = {failures!r}: allowed: failures = \"file.toml\" (a failure "
                             f"model file, beside this one) or [[cause]] tables")
        return load_causes_toml(path.parent / failures)
    if cause_tables is not None:
        return load_causes_toml_tables(path, cause_tables)
    return llama3_causes()


def load_causes_toml_tables(path: Path, tables: list) -> tuple[FailureCause, ...]:
    from paratrain.sim.failures import _cause_from_table

    if not isinstance(tables, list) or not tables:
        raise ValueError(f"{str(path)!r}: [[cause]] must be a non-empty array of tables")
    return tuple(_cause_from_table(t, path) for t in tables)


# ---- `paratrain simulate`'s options -> SimConfig: defaults < TOML < catalog < flags ---------------------------
def _gb(value: float, _flag: str) -> float:  # a flag in GB or GB/s to the field's bytes or bytes/s
    return value * 1e9


# a field's unit suffix -> its flag's suffix, the conversion of the flag's value and the unit shown in its help
# (a duration flag's value carries its unit: 90s, 20m, 2.5h, 54d)
FLAG_UNITS = {"_bytes_per_s": ("_gbps", _gb, "GB/s"), "_bytes": ("_gb", _gb, "GB"), "_s": ("", parse_duration_s, "")}
TITLES = {"workload": "workload (give --steps, or --duration for a fixed window)", "failures": "failures and recovery",
          "cost": "cost and Monte Carlo"}


def _shown(value, conv) -> str:
    """A default in its flag's unit: 1e12 bytes -> 1000 (GB), 180 s -> 3m, 1.5 -> 1.5."""
    if conv is not parse_duration_s:
        return f"{value / 1e9:g}" if conv else f"{value:g}" if isinstance(value, float) else str(value)
    size, unit = next(((n, u) for n, u in ((DAY_S, "d"), (HOUR_S, "h"), (60, "m")) if value >= n and value % n == 0),
                      (1, "s"))
    return f"{value / size:g}{unit}"


def sim_options(cls=None, prefix: str = "") -> list[tuple]:
    """`paratrain simulate`'s options (`dataclasses.make_dataclass` fields) of SimConfig's (and StragglerConfig's)
    fields with a help: help, choices and default from the field, the flag in the field's unit (detect_s ->
    --detect 60s, checkpoint_bytes -> --checkpoint-gb); None unless given, so --config and the catalog fill the
    rest (config_from_options, by `to`)."""
    from paratrain.cli import opt

    cls = cls or SimConfig
    hints, out = typing.get_type_hints(cls), []
    for f in fields(cls):
        if is_dataclass(hints[f.name]):  # stragglers: StragglerConfig's, where SimConfig has them
            out += sim_options(hints[f.name], f"{prefix}{f.name}.")
        if "help" not in f.metadata:
            continue
        meta, suffix = dict(f.metadata), next((s for s in FLAG_UNITS if f.name.endswith(s)), "")
        flag_suffix, conv, unit = FLAG_UNITS.get(suffix, ("", None, ""))
        name = meta.pop("flag", "--" + f.name.removesuffix(suffix) + flag_suffix)[2:].replace("-", "_")
        shown = None if f.default in (None, MISSING) else f"default {_shown(f.default, conv)}"
        notes = "; ".join(x for x in (unit, shown) if x)
        kinds = [t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None)]
        kind = str if conv is parse_duration_s or len(kinds) > 1 else float if conv else kinds[0]  # str | float: str
        group = meta.pop("group", "stragglers")
        meta |= {"group": TITLES.get(group, group), "to": prefix + f.name} | ({"conv": conv} if conv else {})
        out.append((name, kind | None, opt(meta.pop("help") + (f" ({notes})" if notes else ""), **meta)))
    return out


def config_from_options(args) -> SimConfig:
    """The simulation's inputs: built-in defaults < --config TOML < --hardware/--model (catalog, planner) < flags;
    `args` is the command's options (sim/commands.py): each flag's SimConfig field is named by its option
    (`to`, with `conv` its unit), so an error names both."""
    from paratrain.cli import flag_of  # the generator's one rule for an option's flag

    kwargs: dict = load_sim_toml(args.config) if args.config else {}
    if args.hardware or args.model:  # --seq and --global-batch matter only to the planner, with --model
        from paratrain.sim.catalog import fill_from_catalog

        kwargs.update(fill_from_catalog(hardware=args.hardware, model=args.model, devices=args.devices or
                                        kwargs.get("devices"), seq=args.seq, global_batch=args.global_batch,
                                        purchase=args.purchase))
    straggler = dict(vars(kwargs.pop("stragglers", StragglerConfig())))
    for f in fields(args):
        if "to" in f.metadata and (value := getattr(args, f.name)) is not None:
            value = f.metadata["conv"](value, flag_of(f)) if "conv" in f.metadata else value
            section, _, name = f.metadata["to"].rpartition(".")
            (straggler if section else kwargs)[name] = value
    if args.steps is not None and args.duration is not None:
        raise ValueError("give only one of --steps and --duration")
    kwargs.pop("duration_s" if args.steps is not None else "steps" if args.duration is not None else "", None)
    _require_inputs(kwargs)
    if isinstance(kwargs.get("checkpoint_interval"), str) and kwargs["checkpoint_interval"] not in ("daly", "young"):
        kwargs["checkpoint_interval"] = parse_interval(kwargs["checkpoint_interval"], kwargs["step_time_s"])
    if args.failures_file:
        kwargs["causes"] = load_causes_toml(args.failures_file)
    if args.rate_scale is not None:
        kwargs["causes"] = scale_rates(kwargs.get("causes", llama3_causes()), args.rate_scale)
    try:
        kwargs["stragglers"] = StragglerConfig(**straggler)
        return SimConfig(**kwargs)
    except ValueError as exc:
        raise ValueError(with_flag(str(exc), args)) from None


def with_flag(message: str, args) -> str:
    """'step_time_s=0.0 is not allowed: ...' -> the same, then '(flag --step-time)': the user may have typed either
    the flag or the TOML field (StragglerConfig's errors name its fields with a straggler_ prefix)."""
    from paratrain.cli import flag_of

    field = message.split("=", 1)[0]
    flags = {f.metadata["to"].rpartition(".")[2]: flag_of(f) for f in fields(args)
             if "to" in f.metadata}
    flag = flags.get(field) or flags.get(field.removeprefix("straggler_"))
    return f"{message} (flag {flag})" if flag and "=" in message else message


def _require_inputs(kwargs: dict) -> None:
    missing = [flag for key, flag in (("devices", "--devices"), ("step_time_s", "--step-time")) if key not in kwargs]
    if missing:
        raise ValueError(f"missing {' and '.join(missing)} (or give them in --config, or use --hardware/--model)")
    if "steps" not in kwargs and "duration_s" not in kwargs:
        raise ValueError("give --steps N (time to train) or --duration D (a fixed window such as 54d)")
    if "steps" in kwargs and "duration_s" in kwargs:
        raise ValueError("give only one of --steps and --duration")
