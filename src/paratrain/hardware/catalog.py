"""The hardware catalog: chips, interconnects and systems read from TOML, with every number's source.

The built-in files live in `hardware/catalog/*.toml`. Users add or override entries by dropping TOML files of
the same shape into `$PARATRAIN_HARDWARE_DIR` (every `*.toml` there) or by passing a file path where a
system name is expected. A malformed file is rejected before any work with one line naming the file, the
field, the value and what is allowed.

No torch here: the planner imports this at startup.
"""

from __future__ import annotations

import functools
import os
import re
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BUILTIN_DIR = Path(__file__).parent / "catalog"
ENV_DIR = "PARATRAIN_HARDWARE_DIR"
ENDPOINTS = ("device", "chip", "node")


class CatalogError(ValueError):
    """A malformed hardware file or an unknown name (a user error: printed as one line)."""


# ---- data -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChipEfficiency:
    """Physical efficiency parameters of the compute model (fitted by calibration, not per workload).

    matmul_eff_max: fraction of peak a large matmul reaches. kernel_overhead_s: fixed cost per kernel
    (launch, pipeline fill, tail wave), what makes small matmuls inefficient. memory_bw_eff: fraction of HBM
    bandwidth that memory-bound ops (norms, activations, softmax, optimizer) reach. flash_attention_eff: fraction of
    peak the fused (flash) attention kernel's matmuls reach where its non-matmul engines, not the matrix engine,
    bound it (None: as matmul_eff_max). block_scaled_matmul_eff: a block-scaled (MXFP8) GEMM's throughput over a
    per-tensor-scaled FP8 GEMM's of the same shapes at the same listed peak (the scale factors the tensor cores load
    per 32-element block of K; 1: no difference known).
    """

    matmul_eff_max: float
    kernel_overhead_s: float
    memory_bw_eff: float
    source: str
    flash_attention_eff: float | None = None
    block_scaled_matmul_eff: float = 1.0


@dataclass(frozen=True)
class Chip:
    name: str
    display_name: str
    vendor: str
    status: str
    bf16_tflops: float
    hbm_bytes: int
    hbm_bw_gbytes_per_s: float
    cores_per_chip: int
    efficiency: ChipEfficiency
    source: str
    fp8_tflops: float | None = None
    fp4_tflops: float | None = None
    # the FP8/FP4 rates are those of block-scaled (MX) formats, one scale per 32 elements (Trainium3: "2,517
    # MXFP8/MXFP4 TFLOPS"): what the planner assumes its low-precision matmuls use unless told otherwise
    fp8_block_scaled: bool = False
    # the matrix engines run the OCP MX block-scaled formats at all (MXFP8 / MXFP4 operands with one E8M0 scale per 32
    # elements): Blackwell (Transformer Engine check_mxfp8_support: compute capability >= 10.0) and Trainium3 on;
    # Hopper and Ampere do not, so an MXFP8 recipe there is refused, not timed (plan.api check_precision)
    mx_formats: bool = False
    # per-tensor FP8 GEMMs run in any operand layout (cuBLASLt on Blackwell; Transformer Engine's
    # nvte_is_non_tn_fp8_gemm_supported), so TE keeps no transposed FP8 copy of a per-tensor-scaled tensor for the
    # backward's GEMMs (quantizer.cpp: create_transpose = columnwise_usage && !nvte_is_non_tn_fp8_gemm_supported());
    # Hopper runs FP8 GEMMs only as TN and writes the transpose. Block-scaled tensors need their column-wise copy
    # either way (plan.kernels.fp8_copies)
    fp8_any_layout: bool = False
    # A systolic matrix engine's tile (Trainium's TensorEngine: 128 x 128 PEs, a matmul instruction contracts <= 128
    # partitions against a stationary tile of <= 128 columns and streams <= 512 moving columns): a GEMM dimension
    # that is not a multiple of it runs in whole tiles (plan.kernels.matmul_tile_factor). 0: not modelled (GPUs)
    matmul_tile: int = 0
    matmul_moving_tile: int = 0
    # The key blocks a causal flash-attention kernel works in (queries in matmul_tile rows): it skips a block only
    # where the whole block lies above the diagonal, so the diagonal's blocks run whole (plan.kernels.
    # flash_causal_fraction); forward and backward may block differently. 0: a fine-grained kernel, half the square
    flash_fwd_key_tile: int = 0
    flash_bwd_key_tile: int = 0
    # The rate at which one device reduces a collective's data (all-reduce, reduce-scatter: bytes of reduced output
    # per second) where that, not the links, bounds them (plan.collectives.reduction_bound_s). 0: the links bound them
    reduce_gbytes_per_s: float = 0.0
    power_w: float | None = None
    sources: dict[str, str] = field(default_factory=dict)
    conflicts: tuple[str, ...] = ()
    origin: str = ""

    def source_of(self, key: str) -> str:
        return self.sources.get(key, self.source)


@dataclass(frozen=True)
class Interconnect:
    name: str
    display_name: str
    endpoint: str
    bw_gbytes_per_s: float
    latency_us: float
    bw_eff: float
    source: str
    collective_overhead_us: float = 0.0
    # Extra latency per collective step for each further rank time-sharing one core: CPU hosts running more
    # ranks than cores (`paratrain probe` measures it); 0 for accelerators, whose devices never time-share.
    timeshare_step_us: float = 0.0
    # Links per chip of a 2D-torus fabric (Trainium's NeuronLink), 0 for a switched one. bw_gbytes_per_s is all
    # of them together: a ring collective gets it only where its group covers the whole torus, which has two
    # edge-disjoint Hamiltonian cycles (plan.collectives.torus_link_fraction)
    torus_links_per_chip: int = 0
    # Per-step latency of NCCL's LL128 protocol on this link (src/graph/tuning.cc hwLat[..][Ring][LL128]), which NCCL's
    # tuner may pick over Simple (latency_us) for a ring all-gather / reduce-scatter; 0: the link does not run it
    # (not an NVIDIA link, or a network whose NCCL plugin forces NCCL_PROTO=simple)
    ll128_latency_us: float = 0.0
    # NVLink SHARP (NVLS): the NVSwitch reduces in the switch (multimem loads / stores), so a one-domain all-reduce
    # moves each byte once each way instead of the ring's twice, at NCCL's nvlsEfficiency of the link
    # (src/graph/tuning.cc, per compute capability); 0: the switch has no NVLS (NVSwitch before NVLink 4, not NVIDIA)
    nvls_bw_eff: float = 0.0
    sources: dict[str, str] = field(default_factory=dict)
    conflicts: tuple[str, ...] = ()
    origin: str = ""


@dataclass(frozen=True)
class Tier:
    name: str
    interconnect: Interconnect
    domain_devices: int  # 0 = unbounded scale-out network

    def per_device_bw_bytes_per_s(self, system: System) -> float:
        """Achieved one-direction bandwidth per device when every device of the endpoint communicates."""
        sharing = {"device": 1, "chip": system.devices_per_chip, "node": system.devices_per_node}
        link = self.interconnect
        return link.bw_gbytes_per_s * 1e9 * link.bw_eff / sharing[link.endpoint]


@dataclass(frozen=True)
class SystemEfficiency:
    dp_overlap: float
    tp_overlap: float
    memory_usable_fraction: float
    source: str
    # device memory the runtime holds before the training job allocates anything (Neuron: microcode per physical
    # NeuronCore; GPUs: the CUDA context); the usable fraction applies to the rest
    runtime_reserved_bytes: int = 0
    # device memory each communicator (process group) a rank communicates in holds for its buffers (NCCL's
    # channels x buffers; plan.memory.process_groups counts the groups); 0 where the runtime's collectives need
    # no sizeable buffers of their own (Neuron: DMA rings of a few KB, device-memory.rst)
    comm_buffer_bytes_per_group: int = 0


@dataclass(frozen=True)
class Stack:
    """What the usual training software on this system supports: the planner searches only these choices
    (the user can lift the restriction with `plan --any-stack`)."""

    name: str
    dp_kinds: tuple[str, ...]
    zero_stages: tuple[int, ...]
    schedules: tuple[str, ...]
    source: str
    attention: str = "flash"
    # the planner stack (plan.stacks key) this software is timed as when no --stack is named; None: generic timing
    runs_as: str | None = None
    # activation offloading (parallel.offload_layers: blocks whose activations wait in host memory): whether the
    # software has it at all, and whether it allows it with pipeline parallelism and with (selective) recompute;
    # full recompute never offloads (config.rules offload_full_recompute). The defaults are paratrain's own runtime.
    activation_offload: bool = True
    offload_with_pp: bool = True
    offload_with_recompute: bool = True


# How a node-hour is bought (prices.toml documents each). The order is the order tables and plots use.
PURCHASE_OPTIONS = ("on-demand", "capacity-block", "savings-1y", "savings-3y", "spot")
PURCHASE_HELP = "which catalog price the cost uses: on-demand, capacity-block, savings-1y, savings-3y or spot"
PURCHASE_LABELS = {"on-demand": "on demand", "capacity-block": "EC2 Capacity Block", "savings-1y": "1-year commitment",
                   "savings-3y": "3-year commitment", "spot": "spot"}


@dataclass(frozen=True)
class PriceQuote:
    """One published price of one node-hour: its purchase option, region, source and the date it was read or
    published (YYYY-MM-DD or YYYY-MM)."""

    purchase: str
    usd_per_node_hour: float
    region: str
    source: str
    date: str
    note: str = ""

    def label(self) -> str:
        """'on-demand, us-east-1, 2026-11-30': what is printed beside every dollar figure made from it."""
        return f"{self.purchase}, {self.region}, {self.date}"


@dataclass(frozen=True)
class Prices:
    """A system's prices by purchase option, or why it has none (`no_public_price`)."""

    quotes: dict[str, PriceQuote] = field(default_factory=dict)
    no_public_price: str = ""
    conflicts: tuple[str, ...] = ()

    def quote(self, purchase: str) -> PriceQuote | None:
        return self.quotes.get(purchase)

    def _usd(self, purchase: str) -> float | None:
        quote = self.quotes.get(purchase)
        return None if quote is None else quote.usd_per_node_hour

    @property
    def on_demand_usd_per_hour(self) -> float | None:
        return self._usd("on-demand")

    @property
    def reserved_1yr_usd_per_hour(self) -> float | None:
        return self._usd("savings-1y")

    @property
    def reserved_3yr_usd_per_hour(self) -> float | None:
        return self._usd("savings-3y")

    @property
    def capacity_block_usd_per_hour(self) -> float | None:
        return self._usd("capacity-block")

    @property
    def source(self) -> str:
        """Every quote's source in one line, or the reason there is none."""
        if not self.quotes:
            return self.no_public_price or "no public price"
        return "; ".join(f"{q.purchase}: {q.source} ({q.date})" for q in self.quotes.values())


@dataclass(frozen=True)
class System:
    name: str
    display_name: str
    chip: Chip
    chips_per_node: int
    devices_per_chip: int
    device_unit: str
    tiers: tuple[Tier, ...]
    efficiency: SystemEfficiency
    prices: Prices
    source: str
    stack: Stack | None = None
    conflicts: tuple[str, ...] = ()
    origin: str = ""
    # [systems.X.serving]: the serving model's efficiency table measured on this system (`paratrain calibrate`
    # on `paratrain generate` summaries); plan.serve.serving_efficiency prefers it to the vendor's stack table.
    # (field, value) pairs: the System stays hashable
    serving: tuple[tuple[str, Any], ...] = ()
    # One direction of the link between one device and host memory, GB/s: what activation offloading
    # (parallel.offload_layers) copies over. host_link_kind "pcie": the device's own PCIe x16 link at its
    # generation; what the host side carries when every device copies at once is the uplink and memory terms below
    # (plan.step.host_copy_gbytes_per_s). "nvlink-c2c": GB200's NVLink-C2C, already the device's share of its
    # superchip's link when both GPUs copy (its own path: no PCIe uplink or memory term). None: no published
    # figure, so the planner refuses to offload on this system. host_link_source: where the number comes from
    host_link_gbytes_per_s: float | None = None
    host_link_source: str = ""
    host_link_kind: str = "pcie"
    # The PCIe switch's upstream link to the CPU (one direction, GB/s, at the narrower of the switch's and the CPU
    # root port's generation) and how many devices sit behind one such uplink; host_uplink_unpublished: why the
    # catalog has no figure (then the term is not applied). One of the two on every PCIe host with a host link.
    host_uplink_gbytes_per_s: float | None = None
    host_uplink_devices: int | None = None
    host_uplink_source: str = ""
    host_uplink_unpublished: str = ""
    # The node's host DRAM bandwidth (all sockets, GB/s, the datasheet peak) and the fraction of it copies reach;
    # host_memory_unpublished: why the catalog has no figure. One of the two on every PCIe host with a host link
    host_memory_gbytes_per_s: float | None = None
    host_memory_efficiency: float | None = None
    host_memory_source: str = ""
    host_memory_unpublished: str = ""

    @property
    def devices_per_node(self) -> int:
        return self.chips_per_node * self.devices_per_chip

    @property
    def device_memory_bytes(self) -> int:
        return self.chip.hbm_bytes // self.devices_per_chip

    @property
    def device_peak_flops(self) -> float:
        return self.chip.bf16_tflops * 1e12 / self.devices_per_chip

    @property
    def device_hbm_bw_bytes_per_s(self) -> float:
        return self.chip.hbm_bw_gbytes_per_s * 1e9 / self.devices_per_chip

    @property
    def node_power_w(self) -> float | None:
        """Accelerator power of one node (chips only; host CPUs, NICs and cooling are not included)."""
        return None if self.chip.power_w is None else self.chip.power_w * self.chips_per_node


@dataclass
class Catalog:
    chips: dict[str, Chip]
    interconnects: dict[str, Interconnect]
    systems: dict[str, System]

    def system(self, name: str) -> System:
        if name in self.systems:
            return self.systems[name]
        raise CatalogError(f"hardware '{name}': unknown system; known: {', '.join(sorted(self.systems))} "
                           f"(or a TOML file path, or a file in ${ENV_DIR})")

    def chip(self, name: str) -> Chip:
        if name in self.chips:
            return self.chips[name]
        raise CatalogError(f"unknown chip '{name}'; known: {', '.join(sorted(self.chips))}")


# ---- schema ---------------------------------------------------------------------------------------------
# field -> (kind, required). Kinds: "str", "pos" (number > 0), "frac" (0 < x <= 1), "frac0" (0 <= x <= 1),
# "nonneg", "posint", "strlist", "strdict", "endpoint", "tiers", "table".
CHIP_FIELDS = {
    "display_name": ("str", False), "vendor": ("str", True), "status": ("str", False),
    "bf16_tflops": ("pos", True), "fp8_tflops": ("pos", False), "fp4_tflops": ("pos", False),
    "fp8_block_scaled": ("bool", False), "mx_formats": ("bool", False), "fp8_any_layout": ("bool", False), "matmul_tile": ("nonneg_int", False), "matmul_moving_tile": ("nonneg_int", False),
    "flash_fwd_key_tile": ("nonneg_int", False), "flash_bwd_key_tile": ("nonneg_int", False),
    "reduce_gbytes_per_s": ("nonneg", False),
    "hbm_bytes": ("posint", True), "hbm_bw_gbytes_per_s": ("pos", True), "cores_per_chip": ("posint", True),
    "power_w": ("pos", False), "source": ("str", True), "sources": ("strdict", False),
    "conflicts": ("strlist", False), "efficiency": ("table", True),
}
CHIP_EFF_FIELDS = {
    "matmul_eff_max": ("frac", True), "kernel_overhead_s": ("nonneg", True),
    "memory_bw_eff": ("frac", True), "source": ("str", True), "flash_attention_eff": ("frac", False),
    "block_scaled_matmul_eff": ("frac", False),
}
LINK_FIELDS = {
    "display_name": ("str", False), "endpoint": ("endpoint", True), "bw_gbytes_per_s": ("pos", True),
    "latency_us": ("nonneg", True), "bw_eff": ("frac", True), "source": ("str", True),
    "collective_overhead_us": ("nonneg", False), "timeshare_step_us": ("nonneg", False),
    "torus_links_per_chip": ("nonneg_int", False), "ll128_latency_us": ("nonneg", False), "nvls_bw_eff": ("frac0", False), "sources": ("strdict", False),
    "conflicts": ("strlist", False),
}
SYSTEM_FIELDS = {
    "display_name": ("str", False), "chip": ("str", True), "chips_per_node": ("posint", True),
    "devices_per_chip": ("posint", True), "device_unit": ("str", True), "tiers": ("tiers", True),
    "source": ("str", True), "conflicts": ("strlist", False), "prices": ("table", False),
    "efficiency": ("table", True), "stack": ("table", False), "serving": ("table", False),
    "host_link_gbytes_per_s": ("pos", False), "host_link_source": ("str", False), "host_link_kind": ("str", False),
    "host_uplink_gbytes_per_s": ("pos", False), "host_uplink_devices": ("posint", False),
    "host_uplink_source": ("str", False), "host_uplink_unpublished": ("str", False),
    "host_memory_gbytes_per_s": ("pos", False), "host_memory_efficiency": ("frac", False),
    "host_memory_source": ("str", False), "host_memory_unpublished": ("str", False),
}
HOST_LINK_KINDS = ("pcie", "nvlink-c2c")
# the host side of a PCIe host link when every device copies at once: (fields that go together, the reason field)
HOST_PATH_GROUPS = {
    "uplink": (("host_uplink_gbytes_per_s", "host_uplink_devices", "host_uplink_source"), "host_uplink_unpublished"),
    "memory": (("host_memory_gbytes_per_s", "host_memory_efficiency", "host_memory_source"),
               "host_memory_unpublished"),
}
# The serving model's parameters (plan/serving_efficiency.toml documents each) as `paratrain calibrate` fits
# them for one system
SERVING_FIELDS = {
    "decode_bw_eff": ("frac", True), "kv_bw_eff": ("frac", True), "prefill_flops_eff": ("frac", True),
    "layer_overhead_s": ("nonneg", True), "collective_us": ("nonneg", True), "attention": ("attention", False),
    "host_step_s": ("nonneg", False), "source": ("str", True),
    # facts about the serving software; plan.serve.ServingEfficiency checks their values (HEAD_LAYOUTS, GQA_DECODE)
    "head_layout": ("str", False), "buckets": ("bool", False), "gqa_decode": ("str", False),
}
STACK_FIELDS = {
    "name": ("str", True), "dp_kinds": ("dp_kinds", True), "zero_stages": ("zero_stages", True),
    "schedules": ("schedules", True), "source": ("str", True), "attention": ("attention", False),
    "runs_as": ("str", False), "activation_offload": ("bool", False), "offload_with_pp": ("bool", False),
    "offload_with_recompute": ("bool", False),
}
SYSTEM_EFF_FIELDS = {
    "dp_overlap": ("frac0", True), "tp_overlap": ("frac0", True), "memory_usable_fraction": ("frac", True),
    "source": ("str", True), "runtime_reserved_bytes": ("nonneg_int", False),
    "comm_buffer_bytes_per_group": ("nonneg_int", False),
}
# The older form, a [systems.X.prices] table inside a system (still read from user files): each field becomes
# one quote of the matching purchase option.
PRICE_FIELDS = {
    "on_demand_usd_per_hour": ("pos", False), "reserved_1yr_usd_per_hour": ("pos", False),
    "reserved_3yr_usd_per_hour": ("pos", False), "capacity_block_usd_per_hour": ("pos", False),
    "source": ("str", True), "conflicts": ("strlist", False), "region": ("str", False), "date": ("date", False),
}
LEGACY_PRICE_KEYS = {"on_demand_usd_per_hour": "on-demand", "reserved_1yr_usd_per_hour": "savings-1y",
                     "reserved_3yr_usd_per_hour": "savings-3y", "capacity_block_usd_per_hour": "capacity-block"}
# What a system with no price table at all says (the built-in catalog has a [prices.X] table for every system).
NO_PRICE_TABLE = "no public price (no [prices.X] table in the catalog)"
# [prices.SYSTEM] (prices.toml): one table per purchase option, or no_public_price.
PRICE_ENTRY_FIELDS = {**{option: ("table", False) for option in PURCHASE_OPTIONS},
                      "no_public_price": ("str", False), "conflicts": ("strlist", False)}
QUOTE_FIELDS = {"usd_per_node_hour": ("pos", True), "region": ("str", True), "source": ("str", True),
                "date": ("date", True), "note": ("str", False)}
TIER_FIELDS = {"name": ("str", True), "interconnect": ("str", True), "domain_devices": ("nonneg_int", True)}

ALLOWED = {
    "str": "a non-empty string", "pos": "a number > 0", "frac": "a number in (0, 1]",
    "frac0": "a number in [0, 1]", "nonneg": "a number >= 0", "posint": "an integer > 0",
    "nonneg_int": "an integer >= 0", "bool": "true or false", "strlist": "a list of strings", "strdict": "a table of strings",
    "endpoint": f"one of {', '.join(ENDPOINTS)}", "tiers": "a non-empty list of tier tables",
    "table": "a table", "dp_kinds": "a list from ddp, fsdp, hsdp", "zero_stages": "a list from 0, 1, 2, 3",
    "schedules": "a list from gpipe, 1f1b, interleaved_1f1b, zbv", "attention": "one of flash, unfused",
    "date": "a date YYYY-MM-DD or YYYY-MM (when the price was read or published), or 'not given'",
}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _valid(kind: str, value: Any) -> bool:
    checks = {
        "str": lambda v: isinstance(v, str) and v.strip() != "",
        "pos": lambda v: _is_number(v) and v > 0,
        "frac": lambda v: _is_number(v) and 0 < v <= 1,
        "frac0": lambda v: _is_number(v) and 0 <= v <= 1,
        "nonneg": lambda v: _is_number(v) and v >= 0,
        "posint": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
        "bool": lambda v: isinstance(v, bool),
        "nonneg_int": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        "strlist": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        "strdict": lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
        "endpoint": lambda v: v in ENDPOINTS,
        "tiers": lambda v: isinstance(v, list) and len(v) > 0 and all(isinstance(x, dict) for x in v),
        "table": lambda v: isinstance(v, dict),
        "attention": lambda v: v in ("flash", "unfused"),
        "date": lambda v: isinstance(v, str) and (v == "not given" or re.fullmatch(r"\d{4}-\d{2}(-\d{2})?", v) is not None),
        "dp_kinds": lambda v: isinstance(v, list) and v and all(x in ("ddp", "fsdp", "hsdp") for x in v),
        "zero_stages": lambda v: isinstance(v, list) and v and all(x in (0, 1, 2, 3) for x in v),
        "schedules": lambda v: isinstance(v, list) and v and all(
            x in ("gpipe", "1f1b", "interleaved_1f1b", "zbv") for x in v),
    }
    return checks[kind](value)


def _check(origin: str, where: str, data: Any, schema: dict[str, tuple[str, bool]]) -> dict:
    if not isinstance(data, dict):
        raise CatalogError(f"{origin}: {where} = {data!r}: must be a table")
    for key in data:
        if key not in schema:
            raise CatalogError(f"{origin}: {where}.{key}: unknown field; allowed: {', '.join(schema)}")
    for key, (kind, required) in schema.items():
        if key not in data:
            if required:
                raise CatalogError(f"{origin}: {where}.{key}: missing; must be {ALLOWED[kind]}")
            continue
        if not _valid(kind, data[key]):
            raise CatalogError(f"{origin}: {where}.{key} = {data[key]!r}: must be {ALLOWED[kind]}")
    return data


# ---- building entries -----------------------------------------------------------------------------------
def _chip(origin: str, name: str, raw: dict) -> Chip:
    where = f"chips.{name}"
    _check(origin, where, raw, CHIP_FIELDS)
    eff = _check(origin, f"{where}.efficiency", raw["efficiency"], CHIP_EFF_FIELDS)
    fields = {k: v for k, v in raw.items() if k not in ("efficiency", "conflicts")}
    fields.setdefault("display_name", name)
    fields.setdefault("status", "available")
    return Chip(name=name, efficiency=ChipEfficiency(**eff), conflicts=tuple(raw.get("conflicts", ())),
                origin=origin, **fields)


def _link(origin: str, name: str, raw: dict) -> Interconnect:
    _check(origin, f"interconnects.{name}", raw, LINK_FIELDS)
    fields = {k: v for k, v in raw.items() if k != "conflicts"}
    fields.setdefault("display_name", name)
    return Interconnect(name=name, conflicts=tuple(raw.get("conflicts", ())), origin=origin, **fields)


def _tiers(origin: str, where: str, raw: list, links: dict[str, Interconnect]) -> tuple[Tier, ...]:
    tiers = []
    for i, tier in enumerate(raw):
        _check(origin, f"{where}.tiers[{i}]", tier, TIER_FIELDS)
        if tier["interconnect"] not in links:
            raise CatalogError(f"{origin}: {where}.tiers[{i}].interconnect = {tier['interconnect']!r}: "
                               f"unknown; allowed: {', '.join(sorted(links))}")
        tiers.append(Tier(tier["name"], links[tier["interconnect"]], tier["domain_devices"]))
    sizes = [t.domain_devices for t in tiers]
    bounded = sizes[:-1]
    if sizes[-1] != 0 or any(s == 0 for s in bounded) or any(b <= a for a, b in zip(bounded, bounded[1:], strict=False)):
        raise CatalogError(f"{origin}: {where}.tiers domain_devices = {sizes}: must grow from the innermost "
                           "tier outwards and end with exactly one 0 (the scale-out network)")
    for a, b in zip(bounded, bounded[1:], strict=False):
        if b % a:
            raise CatalogError(f"{origin}: {where}.tiers domain_devices = {sizes}: each must divide the next")
    return tuple(tiers)


def _legacy_quotes(origin: str, where: str, raw: dict) -> dict[str, PriceQuote]:
    """A [systems.X.prices] table (the older form) as quotes; region and date 'not given' when absent."""
    table = _check(origin, f"{where}.prices", raw, PRICE_FIELDS)
    return {option: PriceQuote(option, table[key], table.get("region", "not given"), table["source"],
                               table.get("date", "not given"))
            for key, option in LEGACY_PRICE_KEYS.items() if key in table}


def _price_quotes(origin: str, name: str, raw: dict) -> tuple[dict[str, PriceQuote], str, tuple[str, ...]]:
    """One [prices.SYSTEM] table: its quotes by purchase option, the no-public-price reason, its conflicts."""
    where = f"prices.{name}"
    _check(origin, where, raw, PRICE_ENTRY_FIELDS)
    quotes = {}
    for option in PURCHASE_OPTIONS:
        if option in raw:
            q = _check(origin, f"{where}.{option}", raw[option], QUOTE_FIELDS)
            quotes[option] = PriceQuote(option, q["usd_per_node_hour"], q["region"], q["source"], q["date"],
                                        q.get("note", ""))
    if quotes and "no_public_price" in raw:
        raise CatalogError(f"{origin}: {where}: has both prices ({', '.join(quotes)}) and no_public_price; "
                           "allowed: one or the other")
    if not quotes and "no_public_price" not in raw:
        raise CatalogError(f"{origin}: {where}: no price; allowed: at least one of {', '.join(PURCHASE_OPTIONS)}, "
                           "or no_public_price = \"why\"")
    return quotes, raw.get("no_public_price", ""), tuple(raw.get("conflicts", ()))


def _system_prices(origin: str, name: str, raw: dict, price_entries: list[tuple[str, dict]]) -> Prices:
    """Quotes from the system's own [systems.X.prices] table (older form), then every [prices.X] table in file
    order, a later quote replacing an earlier one of the same purchase option."""
    quotes = _legacy_quotes(origin, f"systems.{name}", raw["prices"]) if "prices" in raw else {}
    conflicts = tuple(raw.get("prices", {}).get("conflicts", ()))
    reason = ""
    for entry_origin, entry in price_entries:
        more, why, more_conflicts = _price_quotes(entry_origin, name, entry)
        quotes.update(more)
        reason = why or reason
        conflicts += more_conflicts
    return Prices(quotes=quotes, no_public_price="" if quotes else (reason or NO_PRICE_TABLE), conflicts=conflicts)


def _system(origin: str, name: str, raw: dict, chips: dict[str, Chip], links: dict[str, Interconnect],
            price_entries: list[tuple[str, dict]] = ()) -> System:
    where = f"systems.{name}"
    _check(origin, where, raw, SYSTEM_FIELDS)
    if raw["chip"] not in chips:
        raise CatalogError(f"{origin}: {where}.chip = {raw['chip']!r}: unknown; allowed: {', '.join(sorted(chips))}")
    eff = _check(origin, f"{where}.efficiency", raw["efficiency"], SYSTEM_EFF_FIELDS)
    prices = _system_prices(origin, name, raw, list(price_entries))
    tiers = _tiers(origin, where, raw["tiers"], links)
    stack = None
    if "stack" in raw:
        st = _check(origin, f"{where}.stack", raw["stack"], STACK_FIELDS)
        stack = Stack(st["name"], tuple(st["dp_kinds"]), tuple(st["zero_stages"]), tuple(st["schedules"]), st["source"],
                      st.get("attention", "flash"), st.get("runs_as"), st.get("activation_offload", True),
                      st.get("offload_with_pp", True), st.get("offload_with_recompute", True))
    serving = tuple(_check(origin, f"{where}.serving", raw["serving"], SERVING_FIELDS).items()) \
        if "serving" in raw else ()
    if ("host_link_gbytes_per_s" in raw) != bool(raw.get("host_link_source")):
        raise CatalogError(f"{origin}: {where}.host_link_gbytes_per_s and host_link_source: each needs the other "
                           f"(every number names its source); allowed: both, or neither")
    per_node = raw["chips_per_node"] * raw["devices_per_chip"]
    _host_path(origin, where, raw, per_node)
    inner = [t.domain_devices for t in tiers[:-1]]
    if inner and per_node % inner[-1] and inner[-1] % per_node:
        raise CatalogError(f"{origin}: {where}.tiers: innermost-to-node domain sizes {inner} do not nest with "
                           f"{per_node} devices per node")
    return System(
        name=name, display_name=raw.get("display_name", name), chip=chips[raw["chip"]],
        chips_per_node=raw["chips_per_node"], devices_per_chip=raw["devices_per_chip"],
        device_unit=raw["device_unit"], tiers=tiers, efficiency=SystemEfficiency(**eff),
        prices=prices, source=raw["source"], stack=stack, conflicts=tuple(raw.get("conflicts", ())), origin=origin,
        serving=serving, host_link_gbytes_per_s=raw.get("host_link_gbytes_per_s"),
        host_link_source=raw.get("host_link_source", ""), host_link_kind=raw.get("host_link_kind", "pcie"),
        host_uplink_gbytes_per_s=raw.get("host_uplink_gbytes_per_s"), host_uplink_devices=raw.get("host_uplink_devices"),
        host_uplink_source=raw.get("host_uplink_source", ""),
        host_uplink_unpublished=raw.get("host_uplink_unpublished", ""),
        host_memory_gbytes_per_s=raw.get("host_memory_gbytes_per_s"),
        host_memory_efficiency=raw.get("host_memory_efficiency"), host_memory_source=raw.get("host_memory_source", ""),
        host_memory_unpublished=raw.get("host_memory_unpublished", ""),
    )


def _host_path(origin: str, where: str, raw: dict, per_node: int) -> None:
    """The host side of a system's host link, one clear error for each way it can be wrong: a PCIe host link
    needs its uplink and its memory, each as all its fields (numbers with their source) or a reason why the
    catalog has none; NVLink-C2C is its own path and takes neither; neither exists without a host link."""
    kind = raw.get("host_link_kind", "pcie")
    if kind not in HOST_LINK_KINDS:
        raise CatalogError(f"{origin}: {where}.host_link_kind = {kind!r}: unknown; allowed: {', '.join(HOST_LINK_KINDS)}")
    given = [k for fields, why in HOST_PATH_GROUPS.values() for k in (*fields, why) if k in raw]
    if "host_link_gbytes_per_s" not in raw or kind != "pcie":
        extra = given + (["host_link_kind"] if "host_link_kind" in raw and "host_link_gbytes_per_s" not in raw else [])
        if extra:
            reason = ("no host_link_gbytes_per_s" if "host_link_gbytes_per_s" not in raw
                      else f"host_link_kind = {kind!r} is its own path (the link is already the device's share)")
            raise CatalogError(f"{origin}: {where}.{extra[0]}: not used with {reason}; allowed: these fields only with "
                               "a PCIe host link (host_link_gbytes_per_s, host_link_kind = \"pcie\")")
        return
    for name, (fields, why) in HOST_PATH_GROUPS.items():
        have = [k for k in fields if k in raw]
        if why in raw and have:
            raise CatalogError(f"{origin}: {where}.{why} and {have[0]}: both given; allowed: {', '.join(fields)} "
                               f"(the {name} figure with its source) or {why} (why there is none), not both")
        if why not in raw and len(have) < len(fields):
            missing = [k for k in fields if k not in raw]
            raise CatalogError(f"{origin}: {where}.{missing[0]}: missing; the host link copies over the {name} when "
                               f"every device of the node copies at once, so a PCIe host link needs "
                               f"{', '.join(fields)} (every number names its source), or {why} = \"why\"")
    if raw.get("host_uplink_devices", 1) > per_node:
        raise CatalogError(f"{origin}: {where}.host_uplink_devices = {raw['host_uplink_devices']}: more than the node's "
                           f"{per_node} devices; allowed: 1 to {per_node}")


# ---- loading --------------------------------------------------------------------------------------------
def _read(path: Path) -> dict:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise CatalogError(f"{path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise CatalogError(f"{path}: cannot read: {exc.strerror}") from None
    for key in data:
        if key not in ("chips", "interconnects", "systems", "prices"):
            raise CatalogError(f"{path}: top-level table [{key}]: unknown; allowed: chips, interconnects, systems, "
                               "prices")
    return data


def catalog_files(extra: list[Path] | None = None) -> list[Path]:
    """Built-in files, then every *.toml in $PARATRAIN_HARDWARE_DIR, then explicit extra files (later wins)."""
    files = sorted(BUILTIN_DIR.glob("*.toml"))
    user_dir = os.environ.get(ENV_DIR)
    if user_dir:
        if not Path(user_dir).is_dir():
            raise CatalogError(f"${ENV_DIR} = {user_dir!r}: not a directory")
        files += sorted(Path(user_dir).glob("*.toml"))
    return files + list(extra or [])


def load_catalog(extra: list[Path] | None = None) -> Catalog:
    raw_chips: dict[str, tuple[str, dict]] = {}
    raw_links: dict[str, tuple[str, dict]] = {}
    raw_systems: dict[str, tuple[str, dict]] = {}
    raw_prices: dict[str, list[tuple[str, dict]]] = {}  # every file's entry, merged option by option
    for path in catalog_files(extra):
        data = _read(path)
        for table, target in (("chips", raw_chips), ("interconnects", raw_links), ("systems", raw_systems),
                              ("prices", None)):
            entries = data.get(table, {})
            if not isinstance(entries, dict):
                raise CatalogError(f"{path}: [{table}] must be a table of named entries")
            for name, entry in entries.items():
                if target is None:
                    raw_prices.setdefault(name, []).append((str(path), entry))
                else:
                    target[name] = (str(path), entry)
    unknown = sorted(set(raw_prices) - set(raw_systems))
    if unknown:
        origin = raw_prices[unknown[0]][0][0]
        raise CatalogError(f"{origin}: prices.{unknown[0]}: no such system; known: {', '.join(sorted(raw_systems))}")
    chips = {name: _chip(origin, name, raw) for name, (origin, raw) in raw_chips.items()}
    links = {name: _link(origin, name, raw) for name, (origin, raw) in raw_links.items()}
    systems = {name: _system(origin, name, raw, chips, links, raw_prices.get(name, []))
               for name, (origin, raw) in raw_systems.items()}
    return Catalog(chips, links, systems)


def get_catalog(extra: list[Path] | None = None) -> Catalog:
    """The catalog, memoised on the files' names and modification times: a pure function of the files, so a
    file added, removed or changed gives a new load (no cache the caller manages)."""
    files = catalog_files(extra)
    return _load_files(tuple((str(p), p.stat().st_mtime_ns if p.exists() else 0) for p in files),
                       tuple(extra or ()))


@functools.lru_cache(maxsize=16)
def _load_files(files_and_mtimes: tuple, extra: tuple[Path, ...]) -> Catalog:
    return load_catalog(list(extra) or None)


def resolve_system(spec: str | System) -> System:
    """A system name from the catalog, or a TOML file path holding exactly one [systems.X] (plus its parts)."""
    if isinstance(spec, System):
        return spec
    path = Path(spec)
    if spec.endswith(".toml"):
        if not path.is_file():
            raise CatalogError(f"hardware '{spec}': no such file")
        names = list(_read(path).get("systems", {}))
        if len(names) != 1:
            raise CatalogError(f"{spec}: holds {len(names)} [systems.X] tables; --hardware FILE needs exactly one")
        return get_catalog([path]).system(names[0])
    return get_catalog().system(spec)


# ---- writing entries back (calibration) ------------------------------------------------------------------
def _drop_empty(table: dict) -> dict:
    return {k: v for k, v in table.items() if v is not None and v != {} and v != () and v != []}


def _entry_table(entry: Chip | Interconnect) -> dict:
    """A chip or link as its TOML table: every field but the name (the table's key) and origin (the file)."""
    data = asdict(entry)
    for key in ("name", "origin"):
        data.pop(key)
    data["conflicts"] = list(entry.conflicts)
    if isinstance(data.get("efficiency"), dict):  # a chip's optional efficiency fields left unset (None)
        data["efficiency"] = _drop_empty(data["efficiency"])
    return _drop_empty(data)


def chip_table(chip: Chip) -> dict:
    return _entry_table(chip)


def interconnect_table(link: Interconnect) -> dict:
    return _entry_table(link)


def system_table(system: System) -> dict:
    data = {
        "display_name": system.display_name, "chip": system.chip.name, "chips_per_node": system.chips_per_node,
        "devices_per_chip": system.devices_per_chip, "device_unit": system.device_unit,
        "tiers": [{"name": t.name, "interconnect": t.interconnect.name, "domain_devices": t.domain_devices}
                  for t in system.tiers],
        "source": system.source, "conflicts": list(system.conflicts),
        "efficiency": asdict(system.efficiency),
    }
    if system.host_link_gbytes_per_s is not None:
        data.update(host_link_gbytes_per_s=system.host_link_gbytes_per_s, host_link_source=system.host_link_source)
        if system.host_link_kind != "pcie":
            data["host_link_kind"] = system.host_link_kind
        for key in (k for fields, why in HOST_PATH_GROUPS.values() for k in (*fields, why)):
            value = getattr(system, key)
            if value not in (None, ""):
                data[key] = value
    if system.stack is not None:
        stack = asdict(system.stack)
        data["stack"] = {k: list(v) if isinstance(v, tuple) else v for k, v in stack.items()}
    if system.serving:
        data["serving"] = dict(system.serving)
    return _drop_empty(data)


def price_table(prices: Prices) -> dict:
    """A system's prices as its [prices.X] table."""
    table = {option: _drop_empty({k: v for k, v in asdict(q).items() if k != "purchase" and v != ""})
             for option, q in prices.quotes.items()}
    if not prices.quotes:
        table["no_public_price"] = prices.no_public_price or "no public price"
    if prices.conflicts:
        table["conflicts"] = list(prices.conflicts)
    return table


def write_catalog_file(path: str | Path, chips: list[Chip] = (), interconnects: list[Interconnect] = (),
                       systems: list[System] = ()) -> Path:
    """Write entries (e.g. with calibrated efficiency values, via dataclasses.replace) as a catalog TOML file.

    Put it in $PARATRAIN_HARDWARE_DIR: entries there replace built-in entries of the same name. The file is
    validated by loading it back before it is kept."""
    import tomli_w

    data: dict[str, dict] = {}
    if chips:
        data["chips"] = {c.name: chip_table(c) for c in chips}
    if interconnects:
        data["interconnects"] = {i.name: interconnect_table(i) for i in interconnects}
    if systems:
        data["systems"] = {s.name: system_table(s) for s in systems}
        data["prices"] = {s.name: price_table(s.prices) for s in systems}
    path = Path(path)
    text = "# Written by paratrain (catalog entries; every number keeps its `source`).\n" + tomli_w.dumps(data)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    try:
        load_catalog([tmp])
    except CatalogError:
        tmp.unlink()
        raise
    tmp.replace(path)
    return path
