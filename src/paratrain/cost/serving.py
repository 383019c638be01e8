"""What serving costs: $/M input and output tokens, tokens per MW, chips per 1,000 requests/s; and which
hardware to serve a workload on (chat, long-context RAG, batch/offline), with the reasons.

Prices come from the catalog (us-east-1 node-hours, each with its source); a deployment rents whole nodes.
Input and output tokens are priced by the share of the replicas' time each takes: prefill time for input,
decode time for output (the analytic operating point of plan/serve.py). Power: the accelerator chips only
(the catalog's chip power_w), as for training (hardware/catalog.py System.node_power_w).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from paratrain.hardware.catalog import PURCHASE_OPTIONS, System, resolve_system
from paratrain.model.config import ModelConfig
from paratrain.plan.serve import ServePlan, Target, load_serving_model, plan

# Serving workloads when the user names only the kind. Assumptions (stated, not measured): a chat turn of
# ~1k tokens of history and a ~250-token answer streamed faster than reading speed; RAG prompts of 8k
# retrieved tokens; batch/offline jobs care about cost only (a loose ITL bound keeps batches finite).
WORKLOADS = {
    "chat": {"prompt": 1024, "output": 256, "ttft_s": 1.0, "itl_s": 0.05, "max_utilization": 0.8,
             "about": "interactive chat: 1k-token prompts, 256-token answers, TTFT <= 1 s, ITL <= 50 ms"},
    "rag": {"prompt": 8192, "output": 256, "ttft_s": 3.0, "itl_s": 0.05, "max_utilization": 0.8,
            "about": "long-context RAG: 8k-token prompts, 256-token answers, TTFT <= 3 s, ITL <= 50 ms"},
    "batch": {"prompt": 1024, "output": 512, "ttft_s": None, "itl_s": 1.0, "max_utilization": 0.95,
              "about": "batch/offline: 1k-token prompts, 512-token outputs, no latency target (ITL <= 1 s)"},
}
DEFAULT_SYSTEMS = ("trn2.48xlarge", "trn3-ultraserver", "inf2.48xlarge", "p4de.24xlarge", "p5.48xlarge",
                   "p5en.48xlarge", "p6-b200.48xlarge")


def node_price(system: System, purchase: str = "on-demand") -> tuple[float | None, str]:
    """The catalog's price of one node-hour for a purchase option and what it is ('on-demand, us-east-1,
    2026-11-30: source'), or None and why there is none."""
    if purchase not in PURCHASE_OPTIONS:
        raise ValueError(f"purchase = {purchase!r}: allowed: {', '.join(PURCHASE_OPTIONS)}")
    quote = system.prices.quote(purchase)
    if quote is None:
        return None, f"no {purchase} price for {system.name}: {system.prices.source}"
    return quote.usd_per_node_hour, f"{quote.label()}: {quote.source}"


@dataclass
class ServingCost:
    usd_per_hour: float | None
    usd_per_million_output_tokens: float | None
    usd_per_million_input_tokens: float | None
    usd_per_million_tokens: float | None  # input and output together
    nodes: int
    chips: float  # rented: whole nodes
    chips_per_1000_rps: float
    power_kw: float | None
    output_tokens_per_s_per_mw: float | None
    price_source: str

    def to_dict(self) -> dict:
        return asdict(self)


def serving_cost(deployment: ServePlan, system: System, target: Target, node_usd_per_hour: float | None = None,
                 purchase: str = "on-demand") -> ServingCost:
    """Cost of a deployment at the target's request rate (node_usd_per_hour overrides the catalog)."""
    price, source = node_price(system, purchase)
    if node_usd_per_hour is not None:
        price, source = node_usd_per_hour, "given by the user"
    nodes = deployment.nodes
    per_hour = None if price is None else price * nodes
    out_per_h = target.rate * target.output * 3600
    in_per_h = target.rate * target.prompt * 3600
    share = deployment.estimate.prefill_time_share
    power_kw = None if system.chip.power_w is None else system.chip.power_w * nodes * system.chips_per_node / 1e3
    return ServingCost(
        usd_per_hour=per_hour,
        usd_per_million_output_tokens=None if per_hour is None else per_hour * (1 - share) / out_per_h * 1e6,
        usd_per_million_input_tokens=None if per_hour is None else per_hour * share / in_per_h * 1e6,
        usd_per_million_tokens=None if per_hour is None else per_hour / (out_per_h + in_per_h) * 1e6,
        nodes=nodes, chips=nodes * system.chips_per_node,
        chips_per_1000_rps=nodes * system.chips_per_node / target.rate * 1000,
        power_kw=power_kw,
        output_tokens_per_s_per_mw=None if not power_kw else target.rate * target.output / (power_kw / 1e3),
        price_source=source)


def workload_target(kind: str, rate: float, **overrides) -> Target:
    if kind not in WORKLOADS:
        raise ValueError(f"workload = {kind!r}: allowed: {', '.join(WORKLOADS)}")
    spec = {k: v for k, v in WORKLOADS[kind].items() if k != "about"}
    spec.update({k: v for k, v in overrides.items() if v is not None})
    return Target(rate=rate, **spec)


@dataclass
class Candidate:
    system: str
    deployment: ServePlan | None
    cost: ServingCost | None
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"system": self.system, "deployment": None if self.deployment is None else self.deployment.to_dict(),
                "cost": None if self.cost is None else self.cost.to_dict(), "reasons": self.reasons}


def recommend(kind: str, model: ModelConfig | str, rate: float, systems: tuple[str, ...] = DEFAULT_SYSTEMS,
              weights: tuple[str, ...] = ("bf16",), prices: dict[str, float] | None = None,
              purchase: str = "on-demand", **overrides) -> tuple[Target, list[Candidate]]:
    """Every system's cheapest deployment for the workload, ranked by $/M tokens; systems without a price are
    planned but not ranked (their break-even node price against the winner is given instead)."""
    model = load_serving_model(model)
    target = workload_target(kind, rate, **overrides)
    prices = prices or {}
    cands = []
    for name in systems:
        system = resolve_system(name)
        kv = ("bf16", "fp8") if system.chip.fp8_tflops else ("bf16",)
        usable = tuple(w for w in weights if w != "fp8" or system.chip.fp8_tflops)
        plans = plan(model, system, target, weights=usable or ("bf16",), kv=kv, top=1)
        if not plans:
            cands.append(Candidate(name, None, None, [f"no replica layout of {model.name} on {name} meets "
                                                      f"{_slo(target)} (the weights do not fit, or the latency "
                                                      "target is below what one replica reaches)"]))
            continue
        best = plans[0]
        cost = serving_cost(best, system, target, prices.get(name), purchase)
        cands.append(Candidate(name, best, cost, _reasons(best, cost, system)))
    priced = sorted((c for c in cands if c.cost and c.cost.usd_per_million_tokens is not None),
                    key=lambda c: c.cost.usd_per_million_tokens)
    rest = [c for c in cands if c not in priced]
    if priced:
        win = priced[0]
        win.reasons.insert(0, f"lowest cost per token of the {len(priced)} priced systems for {kind}")
        for c in priced[1:]:
            ratio = c.cost.usd_per_million_tokens / win.cost.usd_per_million_tokens
            c.reasons.insert(0, f"{ratio:.2f}x the cost per token of {win.system}")
        for c in rest:
            if c.cost is not None:
                even = win.cost.usd_per_million_tokens * (target.rate * (target.prompt + target.output) * 3600) / 1e6
                c.reasons.insert(0, f"no {purchase} price in the catalog: it would tie {win.system} at "
                                    f"${even / c.cost.nodes:,.2f} per node-hour")
    return target, priced + rest


def _slo(target: Target) -> str:
    parts = [f"{target.rate:g} req/s of {target.prompt}+{target.output} tokens"]
    if target.ttft_s is not None:
        parts.append(f"TTFT <= {target.ttft_s:g} s")
    if target.itl_s is not None:
        parts.append(f"ITL <= {target.itl_s * 1e3:g} ms")
    return ", ".join(parts)


def _reasons(dep: ServePlan, cost: ServingCost, system: System) -> list[str]:
    est = dep.estimate
    rep = est.replica
    out = [f"{dep.replicas} replica(s) of tp {rep.tp} x pp {rep.pp} ({rep.weights} weights, {rep.kv} KV) at "
           f"batch {est.batch}: TTFT {est.ttft_s * 1e3:.0f} ms, ITL {est.itl_s * 1e3:.1f} ms, "
           f"{dep.utilization:.0%} of capacity",
           f"{cost.nodes} x {system.name} = {cost.chips:g} chips ({cost.chips_per_1000_rps:,.0f} chips per 1,000 req/s)"]
    if est.weights_bytes_per_device > 0.5 * est.memory_capacity_bytes:
        out.append(f"weights take {est.weights_bytes_per_device / est.memory_capacity_bytes:.0%} of usable memory "
                   "per device: little room for KV cache")
    return out
