"""Failure processes: causes, per-device-hour rates, and what each cause costs to recover from.

Default rates come from the Llama 3 405B pre-training interruption table (Dubey et al. 2024, "The Llama 3
Herd of Models", Table 5; copied in ../shared/reference/llama3_table5_interruptions.csv): 419 unexpected
interruptions in a 54-day snapshot on 16,384 H100 GPUs.

Assumptions used to turn that table into rates (stated because they decide every number downstream):
- the job ran on all 16,384 GPUs for the whole 54 days, so the exposure is 16,384 * 54 * 24 = 21,233,664
  GPU-hours and a cause with count n has rate n / 21,233,664 per device-hour (419 in total: 1.97e-5 per
  device-hour, one job interruption every 3.09 h at that scale);
- failures are independent and memoryless (Poisson), so a job of N devices sees the superposed process with
  rate N * sum(rates): no per-device simulation is needed;
- every failure of any component interrupts the whole synchronous job (true for TP/PP/DP with collectives);
- the 47 planned interruptions of the same table (firmware upgrades, config changes) are not failures and are
  left out, as Meta's "419 unexpected" count does;
- hardware causes (GPU, host, network, maintenance) take a node out of the job: it is replaced from the hot
  spares and goes to repair. Software causes (software bug, dependency, NCCL watchdog timeout) restart in
  place on the same nodes.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

# Llama 3 Table 5 exposure (see module docstring).
LLAMA3_DEVICES = 16_384
LLAMA3_DAYS = 54
LLAMA3_DEVICE_HOURS = LLAMA3_DEVICES * LLAMA3_DAYS * 24

# (component, category, count) as printed in Llama 3 Table 5. The printed percentages are not reproduced:
# 148/419 is 35.3%, not the printed 30.1% (noted in ../shared/reference/README.md).
LLAMA3_TABLE5: tuple[tuple[str, str, int], ...] = (
    ("Faulty GPU", "GPU", 148),
    ("GPU HBM3 Memory", "GPU", 72),
    ("Software Bug", "Dependency", 54),
    ("Network Switch/Cable", "Network", 35),
    ("Host Maintenance", "Unplanned Maintenance", 32),
    ("GPU SRAM Memory", "GPU", 19),
    ("GPU System Processor", "GPU", 17),
    ("NIC", "Host", 7),
    ("NCCL Watchdog Timeouts", "Unknown", 7),
    ("Silent Data Corruption", "GPU", 6),
    ("GPU Thermal Interface + Sensor", "GPU", 6),
    ("SSD", "Host", 3),
    ("Power Supply", "Host", 3),
    ("Server Chassis", "Host", 2),
    ("IO Expansion Board", "Host", 2),
    ("Dependency", "Dependency", 2),
    ("CPU", "Host", 2),
    ("System Memory", "Host", 2),
)

# Categories whose failures take a node out of the job (replaced from spares, sent to repair).
HARDWARE_CATEGORIES = frozenset({"GPU", "Host", "Network", "Unplanned Maintenance", "Accelerator"})

# A hung collective is only noticed when the watchdog fires: PyTorch's default NCCL process-group timeout is
# 10 minutes (torch.distributed.constants.default_pg_nccl_timeout). Other causes use the job's detect_s.
NCCL_WATCHDOG_DETECT_S = 600.0


@dataclass(frozen=True)
class FailureCause:
    """One independent failure process, with its rate per device-hour and how recovery from it works.

    replaces_node: the failed node (or UltraServer) leaves the job and a spare takes its place.
    detect_s: time from the failure to the job noticing it; None means the simulation's default detect_s.
    """

    name: str
    category: str
    rate_per_device_hour: float
    replaces_node: bool
    detect_s: float | None = None

    def __post_init__(self) -> None:
        if not self.rate_per_device_hour >= 0:
            raise ValueError(
                f"failure cause {self.name!r}: rate_per_device_hour={self.rate_per_device_hour!r} must be >= 0"
            )
        if self.detect_s is not None and not self.detect_s >= 0:
            raise ValueError(f"failure cause {self.name!r}: detect_s={self.detect_s!r} must be >= 0")


def llama3_causes() -> tuple[FailureCause, ...]:
    """The default failure model: Llama 3 Table 5 counts divided by the 16,384 x 54-day exposure."""
    causes = []
    for name, category, count in LLAMA3_TABLE5:
        detect = NCCL_WATCHDOG_DETECT_S if name == "NCCL Watchdog Timeouts" else None
        causes.append(
            FailureCause(
                name=name,
                category=category,
                rate_per_device_hour=count / LLAMA3_DEVICE_HOURS,
                replaces_node=category in HARDWARE_CATEGORIES,
                detect_s=detect,
            )
        )
    return tuple(causes)


def total_rate_per_device_hour(causes: tuple[FailureCause, ...]) -> float:
    return float(sum(c.rate_per_device_hour for c in causes))


def scale_rates(causes: tuple[FailureCause, ...], factor: float) -> tuple[FailureCause, ...]:
    """All rates times `factor` (e.g. 0.5 for hardware that fails half as often as H100 did in 2024)."""
    if not factor >= 0:
        raise ValueError(f"rate_scale={factor!r} must be >= 0")
    return tuple(replace(c, rate_per_device_hour=c.rate_per_device_hour * factor) for c in causes)


def load_causes_toml(path: str | Path) -> tuple[FailureCause, ...]:
    """Read a failure model from TOML.

    Format (rates either per device-hour, or as a count over an exposure):

        [[cause]]
        name = "Faulty GPU"
        category = "GPU"
        rate_per_device_hour = 6.97e-6      # or: count = 148, device_hours = 21233664
        replaces_node = true                # optional; default: true for hardware categories
        detect_s = 60                       # optional
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"failure model file {str(path)!r} does not exist")
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"failure model {str(path)!r} is not valid TOML: {exc}") from None
    entries = data.get("cause")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"failure model {str(path)!r}: needs at least one [[cause]] table")
    return tuple(_cause_from_table(entry, path) for entry in entries)


def _cause_from_table(entry: dict, path: Path) -> FailureCause:
    allowed = {"name", "category", "rate_per_device_hour", "count", "device_hours", "replaces_node", "detect_s"}
    unknown = set(entry) - allowed
    if unknown:
        raise ValueError(f"failure model {str(path)!r}: unknown field(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"failure model {str(path)!r}: every [[cause]] needs a name")
    category = str(entry.get("category", "Unknown"))
    for key in ("rate_per_device_hour", "count", "device_hours", "detect_s"):
        value = entry.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"failure cause {name!r}: {key}={value!r} is not allowed: must be a number")
    if "replaces_node" in entry and not isinstance(entry["replaces_node"], bool):
        raise ValueError(f"failure cause {name!r}: replaces_node={entry['replaces_node']!r} is not allowed: "
                         "must be true or false")
    if "rate_per_device_hour" in entry:
        rate = float(entry["rate_per_device_hour"])
    elif "count" in entry and "device_hours" in entry:
        if not float(entry["device_hours"]) > 0:
            raise ValueError(f"failure cause {name!r}: device_hours={entry['device_hours']!r} must be > 0")
        rate = float(entry["count"]) / float(entry["device_hours"])
    else:
        raise ValueError(
            f"failure cause {name!r}: give rate_per_device_hour, or count and device_hours"
        )
    replaces = entry.get("replaces_node", category in HARDWARE_CATEGORIES)
    detect = entry.get("detect_s")
    return FailureCause(name, category, rate, replaces, None if detect is None else float(detect))
