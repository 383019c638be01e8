"""Which infrastructure for which workload, with every reason shown.

The source documents give a table (pre-training for weeks -> Trainium3 UltraServer; cost-sensitive SFT/RLHF
-> Trainium3/2; research needing custom CUDA kernels -> NVIDIA; short experiments -> NVIDIA for flexibility;
multi-cloud or on-premises -> NVIDIA). Here the answer is derived, not asserted:

1. Hard rules remove what cannot run the workload (each rule printed with its reason):
   custom CUDA kernels run only on NVIDIA GPUs; Trainium exists only in AWS, so multi-cloud and on-premises
   deployments need hardware sold everywhere.
2. For what remains, the cost model decides: time and dollars to train from the planner and the simulator
   (`compare`), plus the one-off cost of moving the code base to a different software stack (porting
   engineer-days, an explicit assumption). That one number is what makes short experiments stay on the stack
   the team has and long pre-training runs move to the cheapest hardware per token.
3. A deadline (max days) removes targets too slow for it.

Changing a number that matters (a price, the porting cost, the tokens to train) changes the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paratrain.cost.compare import Assumptions, Row, Workload, evaluate_target
from paratrain.hardware.catalog import get_catalog

KINDS = {
    "pretrain": "pre-training a model from scratch (weeks or more)",
    "finetune": "large fine-tuning (SFT, RLHF), cost-sensitive",
    "research": "research prototyping that needs custom CUDA kernels",
    "experiment": "short, small experiments (hours to days)",
    "multicloud": "must run on several clouds",
    "onprem": "must also run on-premises",
}

# Default workloads per kind, when the user gives only the kind (shapes of the source documents' examples).
DEFAULTS = {
    "pretrain": {"model": "llama2-70b", "train_tokens": 2e12, "nodes": 64},
    "finetune": {"model": "llama3-8b", "train_tokens": 5e9, "nodes": 4},
    "research": {"model": "llama3-8b", "train_tokens": 2e9, "nodes": 2},
    "experiment": {"model": "llama3-8b", "train_tokens": 3e8, "nodes": 1},
    "multicloud": {"model": "llama3-8b", "train_tokens": 1e11, "nodes": 16},
    "onprem": {"model": "llama3-8b", "train_tokens": 1e11, "nodes": 16},
}


@dataclass
class Request:
    kind: str
    model: str | None = None
    train_tokens: float | None = None
    nodes: int | None = None
    seq: int = 4096
    global_batch: int = 1024
    current_stack: str = "cuda"  # what the team's code runs on today: "cuda" or "neuron"
    porting_engineer_days: float = 20.0  # assumption: moving a training code base to the other stack
    engineer_usd_per_day: float = 1200.0  # assumption: loaded cost of an ML engineer-day
    max_days: float | None = None
    systems: list[str] | None = None  # candidates; default: every catalog system with a price
    assumptions: Assumptions = field(default_factory=Assumptions)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind='{self.kind}': allowed: {', '.join(KINDS)}")
        if self.current_stack not in ("cuda", "neuron"):
            raise ValueError(f"current_stack='{self.current_stack}': allowed: cuda, neuron")
        d = DEFAULTS[self.kind]
        self.model = self.model or d["model"]
        self.train_tokens = self.train_tokens or d["train_tokens"]
        self.nodes = self.nodes or d["nodes"]


@dataclass
class Recommendation:
    kind: str
    choice: str | None
    rules: list[str]
    candidates: list[dict]
    reasons: list[str]
    assumptions: list[str]


def stack_of(system_name: str) -> str:
    chip = get_catalog().system(system_name).chip
    return "neuron" if chip.vendor == "aws" else "cuda"


def hard_rules(req: Request, systems: list[str]) -> tuple[list[str], list[str]]:
    """Systems that can run the workload at all, and the rules applied (with their reasons)."""
    rules, kept = [], list(systems)
    if req.kind == "research":
        kept = [s for s in kept if stack_of(s) == "cuda"]
        rules.append("custom CUDA kernels: only NVIDIA GPUs run them (Trainium kernels are written in NKI, a "
                     "rewrite) -> Trainium excluded")
    if req.kind in ("multicloud", "onprem"):
        kept = [s for s in kept if stack_of(s) == "cuda"]
        where = "several clouds" if req.kind == "multicloud" else "on-premises"
        rules.append(f"{where}: Trainium is available only inside AWS; NVIDIA GPUs are sold by every cloud and "
                     f"for own data centres -> Trainium excluded")
    if not rules:
        rules.append("no hard constraint: the cost model decides among all priced systems")
    return kept, rules


def recommend(req: Request, progress=None) -> Recommendation:
    catalog = get_catalog()
    names = req.systems or [n for n, s in catalog.systems.items()
                            if s.prices.on_demand_usd_per_hour is not None or n in req.assumptions.prices]
    allowed, rules = hard_rules(req, names)
    wl = Workload(req.model, req.train_tokens, req.seq, req.global_batch)
    scored, skipped = [], []
    for name in allowed:
        try:
            row = evaluate_target(wl, name, req.nodes, req.assumptions)
        except ValueError as exc:
            skipped.append(f"{name}: {exc}")
            continue
        finally:
            if progress:
                progress(1)
        scored.append(_score(req, row))
    if req.max_days is not None:
        slow = [c for c in scored if c["wall_days"] > req.max_days]
        if slow:
            rules.append(f"deadline {req.max_days:g} days: excluded {', '.join(c['system'] for c in slow)}")
        scored = [c for c in scored if c["wall_days"] <= req.max_days]
    scored.sort(key=lambda c: c["total_usd"])
    reasons = []
    choice = scored[0]["system"] if scored else None
    if scored:
        best = scored[0]
        reasons.append(f"{best['system']} x {req.nodes} nodes: {best['wall_days']:.1f} days, compute "
                       f"${best['compute_usd']:,.0f} + porting ${best['porting_usd']:,.0f} = ${best['total_usd']:,.0f}")
        if len(scored) > 1:
            nxt = scored[1]
            reasons.append(f"next: {nxt['system']} at ${nxt['total_usd']:,.0f} "
                           f"({nxt['total_usd'] / best['total_usd'] - 1:+.0%}); compute alone "
                           f"${nxt['compute_usd']:,.0f}")
        if best["porting_usd"] == 0 and any(c["porting_usd"] > 0 and c["compute_usd"] < best["compute_usd"]
                                            for c in scored):
            reasons.append("a cheaper-to-run system exists on the other software stack, but the workload is too "
                           "small for the compute saving to pay for porting the code")
        if best["porting_usd"] > 0:
            reasons.append("the compute saving over the team's current stack outweighs the one-off porting cost")
    else:
        reasons.append("no candidate can run this workload under the rules above: " + "; ".join(skipped))
    reasons += [f"skipped {s}" for s in skipped]
    assumptions = req.assumptions.describe() + [
        f"porting to the other software stack: {req.porting_engineer_days:g} engineer-days x "
        f"${req.engineer_usd_per_day:,.0f}/day (assumption); team's current stack: {req.current_stack}",
        f"workload: {req.model}, {req.train_tokens:.3g} tokens, seq {req.seq}, global batch {req.global_batch}, "
        f"{req.nodes} nodes",
        "candidates without a public price are left out unless --price gives one",
    ]
    return Recommendation(req.kind, choice, rules, scored, reasons, assumptions)


def _score(req: Request, row: Row) -> dict:
    porting = 0.0 if stack_of(row.system) == req.current_stack else req.porting_engineer_days * req.engineer_usd_per_day
    compute = row.cost_on_demand_usd
    return {"system": row.system, "nodes": row.nodes, "wall_days": row.wall_hours / 24, "compute_usd": compute,
            "porting_usd": porting, "total_usd": compute + porting, "mfu": row.mfu, "goodput": row.goodput,
            "cost_usd_per_million_tokens": row.cost_usd_per_million_tokens, "layout": row.layout}
