"""Time, dollars and energy to train one workload on several clusters, each with the planner's best layout.

For every (system, nodes) target: the planner searches the layouts the system's training stack supports and
keeps the fastest that fits; from its step time follow time to train, accelerator-hours, the cost at the chosen
purchase option (on-demand, capacity block, 1- or 3-year commitment, spot: `Assumptions.purchase`) and at every
other option the catalog publishes, cost per million tokens, energy and tokens per MWh. A system without a
price for the chosen option gets, in place of a cost, the break-even price per node-hour at which it would tie
the cheapest priced target per token. Failures and checkpoints stretch the run:
the simulator (Monte-Carlo, Llama 3 interruption rates per device-hour, Daly-optimal checkpoint interval)
gives the goodput, and wall time, cost and energy are divided by it. Every assumption is in `Assumptions`,
printed with the results.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from paratrain.config.options import described
from paratrain.hardware.catalog import PURCHASE_OPTIONS, System, resolve_system
from paratrain.model.config import ModelConfig, load_model_config

HOUR_S = 3600.0


@dataclass(frozen=True)
class Workload:
    model: str | ModelConfig
    train_tokens: float
    seq: int = 4096
    global_batch: int = 1024  # sequences per step
    fp8: bool = False  # layer matmuls in FP8 at the chip's FP8 peak (the planner's Options.fp8)

    def __post_init__(self) -> None:
        if not self.train_tokens > 0:
            raise ValueError(f"train_tokens = {self.train_tokens!r}: must be > 0")
        for name in ("seq", "global_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} = {value!r}: must be an integer >= 1")

    @classmethod
    def from_steps(cls, model: str | ModelConfig, steps: int, seq: int = 4096, global_batch: int = 1024,
                   fp8: bool = False) -> Workload:
        """A run given as optimizer steps instead of tokens (steps x seq x global batch tokens)."""
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps = {steps!r}: must be an integer >= 1")
        return cls(model, float(steps) * seq * global_batch, seq, global_batch, fp8)

    def model_config(self) -> ModelConfig:
        return self.model if isinstance(self.model, ModelConfig) else load_model_config(self.model)

    @property
    def steps(self) -> int:
        return max(1, math.ceil(self.train_tokens / (self.seq * self.global_batch)))


FAILURE_MODELS = ("simulate", "daly", "none")  # the failure/checkpoint overhead: Monte Carlo, closed form, none


@dataclass(frozen=True)
class Assumptions:
    """Numbers the result depends on that no catalog entry holds; each is printed with the results."""

    # described: `paratrain compare/recommend`'s options (unset: the --config [cost] table's, else these defaults);
    # pue: an assumption, typical of large cloud data centres (1.1-1.2)
    pue: float = described("power usage effectiveness, assumption", 1.2, ge=1)
    host_power_fraction: float = 0.25  # host CPUs, memory, NICs, fans on top of the accelerators: assumption
    checkpoint_write_gbytes_per_s_per_node: float = 2.0  # to a parallel FS / S3: assumption
    checkpoint_bytes_per_param: float = 16.0  # bf16 weights + fp32 master + Adam m, v (Rajbhandari et al. 2020)
    failures: str = described("failure/checkpoint overhead: Monte-Carlo simulation, Daly's formula, or none",
                              FAILURE_MODELS[0], choices=FAILURE_MODELS)
    sim_samples: int = 30
    prices: dict[str, float] = field(default_factory=dict)  # system -> USD per node-hour, overriding the catalog
    purchase: str = "on-demand"  # which catalog price the cost is computed at (PURCHASE_OPTIONS)

    def __post_init__(self) -> None:
        if self.purchase not in PURCHASE_OPTIONS:
            raise ValueError(f"purchase = {self.purchase!r}: allowed: {', '.join(PURCHASE_OPTIONS)}")
        for name, value in self.prices.items():
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"price for {name} = {value!r} USD per node-hour: allowed: a number > 0")

    def describe(self) -> list[str]:
        spot = (["spot: the cost assumes the nodes are not reclaimed; spot interruptions (two minutes' notice) "
                 "are not in the failure model, so a many-node run on spot costs more than shown"]
                if self.purchase == "spot" else [])
        return [
            f"purchase option: {self.purchase} (catalog price per node-hour, region and date beside every figure)",
            f"PUE {self.pue} (assumption: typical large cloud data centre)",
            f"host power = {self.host_power_fraction:.0%} of accelerator power (assumption)",
            f"checkpoint = {self.checkpoint_bytes_per_param:g} bytes/parameter (weights + Adam state), written at "
            f"{self.checkpoint_write_gbytes_per_s_per_node:g} GB/s per node (assumption)",
            f"failures: {self.failures} (Llama 3 interruption rates per device-hour, Dubey et al. 2024 Table 5)",
        ] + (["spares (simulate): 1% of the job's nodes, at least one, each failed node repaired in 24 h on average "
              "(simulator defaults, assumptions); an UltraServer is one node, so a cluster of few large nodes waits "
              "for repairs once its spare is in use (compare --failures daly, which has no repair queue)"]
             if self.failures == "simulate" else []) + spot + [f"price given: {k} = {v:.2f} USD per node-hour (user input, not a published price)"
                    for k, v in self.prices.items()]


@dataclass
class Row:
    system: str
    nodes: int
    devices: int
    chips: int
    layout: dict
    step_time_s: float
    tokens_per_s: float
    mfu: float
    memory_per_device_bytes: float
    memory_breakdown_bytes: dict
    time_breakdown_s: dict
    bubble_fraction: float
    compute_hours: float  # failure-free time to train
    goodput: float
    wall_hours: float  # with failures, restarts and checkpoints
    accelerator_hours: float  # chips x wall hours
    purchase: str  # the purchase option every cost below is computed at (unless named otherwise)
    price_usd_per_node_hour: float | None
    price_label: str  # "on-demand, us-east-1, 2026-11-30", "given by the user" or "no spot price published"
    price_source: str
    cost_usd: float | None  # at `purchase`
    cost_on_demand_usd: float | None
    cost_by_purchase_usd: dict  # every purchase option the catalog prices (None where it publishes none)
    price_label_by_purchase: dict  # purchase option -> "region, date" of its price ("given": a user price)
    cost_usd_per_million_tokens: float | None
    energy_mwh: float | None
    tokens_per_mwh: float | None
    price_per_chip_hour_usd: float | None
    price_per_peak_bf16_pflop_hour_usd: float | None
    notes: list[str] = field(default_factory=list)
    global_batch: int | None = None  # sequences per step the row was planned with
    tokens: float = 0.0  # trained tokens (steps x seq x global batch)
    # the price per node-hour at which this row's cost per token ties the cheapest priced row (set by compare)
    break_even_usd_per_node_hour: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def price_for(system: System, purchase: str, assumptions: Assumptions) -> tuple[float | None, str, str]:
    """(USD per node-hour, label, source) of one system at one purchase option: a user price wins over the
    catalog; no published price gives None and says so (never a stand-in from another option)."""
    if system.name in assumptions.prices:
        return assumptions.prices[system.name], "given by the user", "user input (--price-per-node-hour-usd)"
    quote = system.prices.quote(purchase)
    if quote is not None:
        return quote.usd_per_node_hour, quote.label(), quote.source
    if system.prices.no_public_price:
        return None, "no public price", system.prices.no_public_price
    published = ", ".join(system.prices.quotes)
    return None, f"no {purchase} price published", f"the catalog has {published} for {system.name}"


def failure_goodput(system: System, nodes: int, step_time_s: float, steps: int, model: ModelConfig,
                    assumptions: Assumptions) -> tuple[float, str]:
    """Fraction of wall time that is useful work, with failures, restarts and checkpoint stalls."""
    if assumptions.failures == "none":
        return 1.0, "failures ignored"
    from paratrain.sim.analytic import daly_goodput, daly_interval
    from paratrain.sim.config import SimConfig

    ckpt_bytes = model.num_params() * assumptions.checkpoint_bytes_per_param
    write_bps = assumptions.checkpoint_write_gbytes_per_s_per_node * 1e9 * nodes
    cfg = SimConfig(devices=nodes * system.chips_per_node, devices_per_node=system.chips_per_node,
                    step_time_s=step_time_s, steps=steps, checkpoint_bytes=ckpt_bytes, write_bytes_per_s=write_bps,
                    read_bytes_per_s=write_bps, samples=max(assumptions.sim_samples, 2))
    if assumptions.failures == "daly":
        from paratrain.sim.engine import build_cause_table

        mtbf = build_cause_table(cfg, 0.0).mtbf_s
        delta = cfg.checkpoint_block_s
        tau = daly_interval(delta, mtbf)
        return daly_goodput(tau, delta, cfg.restart_s + cfg.detect_s + cfg.restore_s, mtbf), "Daly closed form"
    from paratrain.sim.engine import simulate
    from paratrain.sim.results import summarize

    report = summarize(simulate(cfg))
    # the spares and repair time decide a cluster of few large nodes: say them with the goodput
    spares = (f"{cfg.spare_node_count} spare node(s) of {system.chips_per_node} chips, mean repair "
              f"{cfg.repair_mean_s / HOUR_S:g} h")
    return report["metrics"]["goodput"]["mean"], f"simulated, {cfg.samples} Monte-Carlo samples; {spares}"


def nearby_global_batch(devices: int, global_batch: int, tolerance: float) -> int | None:
    """The global batch within `tolerance` (relative) of the given one that shares the device count's odd
    factor, with as many factors of two as possible: every data-parallel degree must divide the global batch,
    and a cluster of 2,304 devices (4 Trn3 UltraServers) has no layout at all for a power-of-two batch with
    power-of-two heads and layers (1152 = 9 x 128 works where 1024 cannot)."""
    odd = devices
    while odd % 2 == 0:
        odd //= 2
    if odd == 1:
        return None  # the batch's factors of two are not what is missing
    for twos in range(int(math.log2(max(global_batch, 1))) + 1, -1, -1):
        step = odd * 2**twos
        nearest = round(global_batch / step) * step
        if nearest > 0 and abs(nearest - global_batch) <= tolerance * global_batch:
            return nearest
    return None


def evaluate_target(workload: Workload, system_name: str, nodes: int, assumptions: Assumptions,
                    search_kw: dict | None = None, batch_tolerance: float = 0.0) -> Row:
    """The planner's best layout on `nodes` x the system, and what the run costs with it. batch_tolerance > 0:
    where no layout exists at the workload's global batch, use the nearest one within that relative distance
    that the device count admits (same tokens to train; noted in the row)."""
    from paratrain.plan.api import no_price_note, search

    system = resolve_system(system_name)
    model = workload.model_config()
    kw = dict(search_kw or {})
    if workload.fp8 and "options" not in kw:
        from paratrain.plan.options import Options

        kw["options"] = Options.for_system(system, fp8=True)
    result = search(model, system, nodes, workload.seq, workload.global_batch, top=1, **kw)
    if not result.candidates:
        devices = nodes * system.devices_per_node
        other = nearby_global_batch(devices, workload.global_batch, batch_tolerance) if result.valid == 0 else None
        if other is None:
            raise ValueError(no_layout_reason(model, system, nodes, workload, result.valid))
        adjusted = Workload(workload.model, workload.train_tokens, workload.seq, other, workload.fp8)
        row = evaluate_target(adjusted, system_name, nodes, assumptions, search_kw)
        row.notes.insert(0, f"global batch {other} instead of {workload.global_batch}: no layout of {devices} "
                            f"devices divides {workload.global_batch} (same tokens to train)")
        return row
    est = result.candidates[0]
    compute_s = workload.steps * est.step_time_s
    goodput, how = failure_goodput(system, nodes, est.step_time_s, workload.steps, model, assumptions)
    wall_h = compute_s / goodput / HOUR_S
    chips = nodes * system.chips_per_node
    price, price_label, price_src = price_for(system, assumptions.purchase, assumptions)
    by_purchase, labels = {}, {}
    for option in PURCHASE_OPTIONS:
        usd, label, _ = price_for(system, option, assumptions)
        by_purchase[option] = None if usd is None else usd * nodes * wall_h
        labels[option] = None if usd is None else ("given" if system.name in assumptions.prices
                                                   else label.split(", ", 1)[1])
    on_demand = price_for(system, "on-demand", assumptions)[0]
    power_w = None if system.node_power_w is None else system.node_power_w * (1 + assumptions.host_power_fraction)
    energy_mwh = None if power_w is None else power_w * nodes * wall_h * assumptions.pue / 1e6
    peak_pflops_node = system.chip.bf16_tflops * system.chips_per_node / 1e3
    tokens = workload.steps * workload.seq * workload.global_batch
    row = Row(
        system=system.name, nodes=nodes, devices=est.devices, chips=chips, layout=est.layout.to_dict(),
        step_time_s=est.step_time_s, tokens_per_s=est.tokens_per_s, mfu=est.mfu,
        memory_per_device_bytes=est.memory_per_device_bytes, memory_breakdown_bytes=est.memory_breakdown_bytes,
        time_breakdown_s=est.time_breakdown_s, bubble_fraction=est.bubble_fraction,
        compute_hours=compute_s / HOUR_S, goodput=goodput, wall_hours=wall_h, accelerator_hours=chips * wall_h,
        purchase=assumptions.purchase, price_usd_per_node_hour=price, price_label=price_label,
        price_source=price_src, cost_usd=None if price is None else price * nodes * wall_h,
        cost_on_demand_usd=None if on_demand is None else on_demand * nodes * wall_h,
        cost_by_purchase_usd=by_purchase, price_label_by_purchase=labels,
        cost_usd_per_million_tokens=None if price is None else price * nodes * wall_h / tokens * 1e6,
        energy_mwh=energy_mwh, tokens_per_mwh=None if not energy_mwh else tokens / energy_mwh,
        price_per_chip_hour_usd=None if price is None else price / system.chips_per_node,
        price_per_peak_bf16_pflop_hour_usd=None if price is None else price / peak_pflops_node,
        # the planner's notes, less its on-demand price note: this row is priced at the purchase option
        notes=[f"goodput {goodput:.1%} ({how})"] + [n for n in est.notes if n != no_price_note(system)]
        + ([no_price_note(system, assumptions.purchase)] if price is None else []), global_batch=workload.global_batch,
        tokens=float(tokens),
    )
    if system.chip.power_w is None:
        row.notes.append(f"no chip power for {system.chip.name} in the catalog: energy unknown")
    elif "power_w" in system.chip.sources:  # not from the chip's main (vendor) source: say how weak it is
        row.notes.append(f"energy uses {system.chip.power_w:g} W per {system.chip.name}: "
                         f"{system.chip.sources['power_w']}")
    return row


def no_layout_reason(model: ModelConfig, system: System, nodes: int, workload: Workload, valid: int) -> str:
    """Why the planner found nothing: no layout divides the devices and the batch, or none fits in memory."""
    devices = nodes * system.devices_per_node
    where = f"{model.name} on {nodes} x {system.name} ({devices} {system.device_unit})"
    if valid == 0:
        return (f"no valid layout for {where} at global batch {workload.global_batch}: tp x pp x dp must equal "
                f"{devices} with dp x microbatch dividing the global batch and tp, pp dividing the model's heads "
                f"and layers; try a global batch sharing more factors with {devices}")
    return f"none of the {valid} valid layouts for {where} fits in memory (seq {workload.seq}); try more nodes"


def compare(workload: Workload, targets: list[tuple[str, int]], assumptions: Assumptions | None = None,
            search_kw: dict | None = None, progress=None) -> list[Row]:
    assumptions = assumptions or Assumptions()
    rows = []
    for system, nodes in targets:
        rows.append(evaluate_target(workload, system, nodes, assumptions, search_kw))
        if progress:
            progress(1)
    set_break_even(rows)
    return rows


def comparison(workload: Workload, targets: list[tuple[str, int]], assumptions: Assumptions,
               progress=None) -> tuple[dict, list[Row], list]:
    """`paratrain compare`'s result: (its JSON document, the rows, their sensitivity items)."""
    from paratrain.cost.sensitivity import sensitivity

    name = workload.model_config().name  # an unknown model fails here, before any search
    rows = compare(workload, targets, assumptions, progress=progress)
    items = [to_item(r) for r in rows]
    out = {"workload": {"model": name, "train_tokens": workload.train_tokens, "seq": workload.seq,
                        "global_batch": workload.global_batch, "steps": workload.steps, "fp8": workload.fp8},
           "purchase": assumptions.purchase, "assumptions": assumptions.describe(),
           "rows": [r.to_dict() for r in rows], "ratios_to_first": ratios_to_first(rows),
           "sensitivity": sensitivity(items, assumptions.purchase)}
    return out, rows, items


def break_even_price(row: Row, usd_per_million_tokens: float) -> float:
    """The price per node-hour at which `row` costs `usd_per_million_tokens`: cost per token is price x nodes x
    wall hours / tokens, so the price follows from the row's own time to train."""
    return usd_per_million_tokens * row.tokens / 1e6 / (row.nodes * row.wall_hours)


def cheapest(rows: list[Row]) -> Row | None:
    priced = [r for r in rows if r.cost_usd_per_million_tokens is not None]
    return min(priced, key=lambda r: r.cost_usd_per_million_tokens) if priced else None


def set_break_even(rows: list[Row]) -> None:
    """Every row but the cheapest priced one gets the price per node-hour at which it would tie it per token:
    for a system without a published price this stands in place of its cost; for a priced one it is the cut
    it would need."""
    best = cheapest(rows)
    for row in rows:
        row.break_even_usd_per_node_hour = (None if best is None or row is best
                                            else break_even_price(row, best.cost_usd_per_million_tokens))


def parse_targets(text: str) -> list[tuple[str, int]]:
    """'trn1.32xlarge:16,p4d.24xlarge:16' -> [(system, nodes), ...]. The node count is required: a bare name
    silently meaning one node compared a one-node cluster with what the user had in mind."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, colon, nodes = item.partition(":")
        if not colon or not nodes:
            raise ValueError(f"--targets item '{item}': give the node count, SYSTEM:NODES, e.g. {name}:16")
        try:
            n = int(nodes)
        except ValueError:
            raise ValueError(f"--targets item '{item}': nodes must be an integer, e.g. trn1.32xlarge:16") from None
        if n < 1:
            raise ValueError(f"--targets item '{item}': nodes must be >= 1")
        resolve_system(name)  # unknown names fail here, before any work
        out.append((name, n))
    if not out:
        raise ValueError("--targets: give at least one SYSTEM:NODES")
    return out


def pareto_front(rows: list[Row]) -> list[Row]:
    """Rows not beaten on both wall time and cost (at the chosen purchase option) by another row."""
    priced = [r for r in rows if r.cost_usd is not None]
    front = []
    for r in priced:
        dominated = any(o.wall_hours <= r.wall_hours and o.cost_usd <= r.cost_usd
                        and (o.wall_hours < r.wall_hours or o.cost_usd < r.cost_usd)
                        for o in priced)
        if not dominated:
            front.append(r)
    return sorted(front, key=lambda r: r.wall_hours)


RATIO_FIELDS = ("price_usd_per_node_hour", "price_per_chip_hour_usd", "price_per_peak_bf16_pflop_hour_usd",
                "cost_usd_per_million_tokens", "wall_hours", "energy_mwh")


def ratios_to_first(rows: list[Row]) -> list[dict]:
    """The first target divided by each other one, field by field (None where either side is unknown):
    e.g. trn1.32xlarge / p4d.24xlarge price per chip-hour, per peak PFLOP-hour and per million tokens."""
    first = rows[0]
    out = []
    for row in rows[1:]:
        ratio = {"first": f"{first.system} x{first.nodes}", "other": f"{row.system} x{row.nodes}"}
        for name in RATIO_FIELDS:
            a, b = getattr(first, name), getattr(row, name)
            ratio[name] = None if a is None or not b else a / b
        out.append(ratio)
    return out


def to_item(row: Row, extra_usd: float = 0.0):
    """The row as a sensitivity item (paratrain.cost.sensitivity)."""
    from paratrain.cost.sensitivity import Item

    return Item(label=f"{row.system} x{row.nodes}", tokens=row.tokens, cost_by_purchase_usd=row.cost_by_purchase_usd,
                price_dates=row.price_label_by_purchase, extra_usd=extra_usd)
