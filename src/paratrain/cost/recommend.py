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
4. Every candidate gets a cluster of the same number of accelerator chips (or the same node count with
   `nodes`). Compute is priced at the chosen purchase option (`Assumptions.purchase`). Systems without a price
   there are planned too but not ranked: instead the price per node-hour
   at which each would tie the choice (its break-even) is reported, which is what a quote must beat; the
   same break-even is given for every losing candidate.

Changing a number that matters (a price, the porting cost, the tokens to train) changes the answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from paratrain.config.options import described
from paratrain.cost.compare import Assumptions, Row, Workload, evaluate_target, to_item
from paratrain.cost.sensitivity import sensitivity
from paratrain.device import CUDA, NEURON
from paratrain.hardware.catalog import System, get_catalog

STACKS = (CUDA, NEURON)  # software stacks: the device type the team's kernels target

KINDS = {
    "pretrain": "pre-training a model from scratch (weeks or more)",
    "finetune": "large fine-tuning (SFT, RLHF), cost-sensitive",
    "research": "research prototyping that needs custom CUDA kernels",
    "experiment": "short, small experiments (hours to days)",
    "multicloud": "must run on several clouds",
    "onprem": "must also run on-premises",
}

# Default workloads per kind, when the user gives only the kind (shapes of the source documents' examples).
# Cluster size is a number of accelerator chips, the same for every candidate (nodes = chips / chips per node,
# rounded up): 512 chips is 64 p5.48xlarge, 32 trn1.32xlarge or 4 Trn3 UltraServers. --nodes overrides it
# with one node count for all.
DEFAULTS = {
    "pretrain": {"model": "llama2-70b", "train_tokens": 2e12, "chips": 512},
    "finetune": {"model": "llama3-70b", "train_tokens": 2e10, "chips": 128},
    "research": {"model": "llama3-8b", "train_tokens": 2e9, "chips": 16},
    "experiment": {"model": "llama3-8b", "train_tokens": 3e8, "chips": 8},
    "multicloud": {"model": "llama3-8b", "train_tokens": 1e11, "chips": 128},
    "onprem": {"model": "llama3-8b", "train_tokens": 1e11, "chips": 128},
}


# A candidate whose device count admits no layout at the requested global batch (e.g. 144-chip Trn3
# UltraServers with a power-of-two batch) is planned at the nearest batch within 15% that it admits, with the
# same tokens to train: a recommendation compares hardware, and teams size the batch to the cluster.
BATCH_TOLERANCE = 0.15


@dataclass
class Request:
    # Each help is the `paratrain recommend` option's (cli.options_of), with its bounds.
    kind: str = described("pretrain, finetune, research, experiment, multicloud or onprem", positional=True)
    model: str | None = None  # default: per kind (KINDS)
    train_tokens: float | None = None
    chips: int | None = described("accelerator chips per candidate cluster, the same for every system (default: per "
                                  "kind; nodes = chips / chips per node, rounded up)", None, ge=1)
    nodes: int | None = described("one node count for every candidate system instead of --chips", None, ge=1)
    seq: int = 4096
    global_batch: int = 1024
    max_days: float | None = described("deadline: drop candidates slower than this", None, gt=0)
    max_usd: float | None = described("budget: drop candidates whose total (compute + porting) is higher", None, gt=0)
    current_stack: str = described(  # a device type: CUDA or NEURON
        "the team's stack today: cuda or neuron; the other stack costs --porting-days", CUDA)
    porting_engineer_days: float = described("engineer-days to move the code base to the other stack (assumption)",
                                             20.0, ge=0)
    engineer_usd_per_day: float = described("loaded cost of an engineer-day (assumption)", 1200.0, ge=0)
    systems: tuple[str, ...] | None = described("comma list of candidate systems (default: every catalog system; those "
                                                "without a price get a break-even price instead of a rank)", None)
    constraints: list[str] = described(  # from CONSTRAINTS, on top of the kind's own
        "a hard constraint on top of the kind's own: cuda-kernels, multicloud or onprem (repeatable), e.g. pretrain "
        "--constraint multicloud", factory=list, metavar="NAME")
    assumptions: Assumptions = field(default_factory=Assumptions)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind='{self.kind}': allowed: {', '.join(KINDS)}")
        if self.current_stack not in STACKS:
            raise ValueError(f"current_stack='{self.current_stack}': allowed: {', '.join(STACKS)}")
        d = DEFAULTS[self.kind]
        self.model = d["model"] if self.model is None else self.model
        self.train_tokens = d["train_tokens"] if self.train_tokens is None else self.train_tokens
        if self.nodes is None and self.chips is None:
            self.chips = d["chips"]
        checks = [("train_tokens", self.train_tokens, self.train_tokens > 0, "> 0"),
                  ("nodes", self.nodes, self.nodes is None or self.nodes >= 1, ">= 1"),
                  ("chips", self.chips, self.chips is None or self.chips >= 1, ">= 1"),
                  ("porting_engineer_days", self.porting_engineer_days, self.porting_engineer_days >= 0, ">= 0"),
                  ("engineer_usd_per_day", self.engineer_usd_per_day, self.engineer_usd_per_day >= 0, ">= 0"),
                  ("max_days", self.max_days, self.max_days is None or self.max_days > 0, "> 0"),
                  ("max_usd", self.max_usd, self.max_usd is None or self.max_usd > 0, "> 0")]
        unknown = [c for c in self.constraints if c not in CONSTRAINTS]
        if unknown:
            raise ValueError(f"constraints = {unknown}: allowed: {', '.join(CONSTRAINTS)}")
        for name, value, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{name} = {value!r}: allowed: {allowed}")
        for name in self.systems or []:
            get_catalog().system(name)  # unknown names fail here, before any work

    def nodes_for(self, system: System) -> int:
        if self.nodes is not None:
            return self.nodes
        return max(1, math.ceil(self.chips / system.chips_per_node))


@dataclass
class Recommendation:
    kind: str
    choice: str | None
    rules: list[str]
    candidates: list[dict]
    reasons: list[str]
    assumptions: list[str]
    purchase: str = "on-demand"
    sensitivity: dict = field(default_factory=dict)  # ranking by purchase option and by +-30% price
    items: list = field(default_factory=list)  # the candidates as sensitivity items (for the plot; not JSON)


def stack_of(system_name: str) -> str:
    chip = get_catalog().system(system_name).chip
    return NEURON if chip.vendor == "aws" else CUDA


CONSTRAINTS = {
    "cuda-kernels": "custom CUDA kernels: only NVIDIA GPUs run them (Trainium kernels are written in NKI, a "
                    "rewrite) -> Trainium excluded",
    "multicloud": "several clouds: Trainium is available only inside AWS; NVIDIA GPUs are sold by every cloud "
                  "-> Trainium excluded",
    "onprem": "on-premises: Trainium is available only inside AWS; NVIDIA GPUs are sold for own data centres "
              "-> Trainium excluded",
}
# The constraint each workload kind implies (the source documents' rows); --constraint adds more to any kind.
KIND_CONSTRAINTS = {"research": "cuda-kernels", "multicloud": "multicloud", "onprem": "onprem"}


def active_constraints(req: Request) -> list[str]:
    implied = [KIND_CONSTRAINTS[req.kind]] if req.kind in KIND_CONSTRAINTS else []
    return list(dict.fromkeys(implied + list(req.constraints)))


def hard_rules(req: Request, systems: list[str]) -> tuple[list[str], list[str]]:
    """Systems that can run the workload at all, and the rules applied (with their reasons). Every
    constraint so far rules out the Neuron stack; each is printed."""
    rules = [CONSTRAINTS[c] for c in active_constraints(req)]
    kept = [s for s in systems if stack_of(s) == CUDA] if rules else list(systems)
    if not rules:
        rules.append("no hard constraint: the cost model decides among all systems with a price")
    return kept, rules


def recommend(req: Request, progress=None) -> Recommendation:
    names = req.systems or list(get_catalog().systems)
    allowed, rules = hard_rules(req, names)
    wl = Workload(req.model, req.train_tokens, req.seq, req.global_batch)
    scored, skipped, items = [], [], {}
    for name in allowed:
        try:
            row = evaluate_target(wl, name, req.nodes_for(get_catalog().system(name)), req.assumptions,
                                  batch_tolerance=BATCH_TOLERANCE)
        except ValueError as exc:
            skipped.append(f"{name}: {exc}")
            continue
        finally:
            if progress:
                progress(1)
        scored.append(_score(req, row))
        items[name] = to_item(row, extra_usd=scored[-1]["porting_usd"])
    if req.max_days is not None:
        slow = [c for c in scored if c["wall_days"] > req.max_days]
        if slow:
            rules.append(f"deadline {req.max_days:g} days: excluded "
                         + ", ".join(f"{c['system']} ({c['wall_days']:.1f} days)" for c in slow))
        scored = [c for c in scored if c["wall_days"] <= req.max_days]
    if req.max_usd is not None:
        costly = [c for c in scored if c["total_usd"] is not None and c["total_usd"] > req.max_usd]
        if costly:
            rules.append(f"budget ${req.max_usd:,.0f}: excluded "
                         + ", ".join(f"{c['system']} (${c['total_usd']:,.0f})" for c in costly))
        scored = [c for c in scored if c not in costly]
    priced = sorted((c for c in scored if c["total_usd"] is not None), key=lambda c: c["total_usd"])
    unpriced = [c for c in scored if c["total_usd"] is None]
    if priced:
        _break_even(priced[0]["total_usd"], priced[1:] + unpriced)
    elif req.max_usd is not None:  # nothing priced within budget: what an unpriced system must cost to fit it
        _break_even(req.max_usd, unpriced)
    reasons = _reasons(req, priced, unpriced, skipped)
    choice = priced[0]["system"] if priced else None
    ranked = [items[c["system"]] for c in priced + unpriced]
    return Recommendation(req.kind, choice, rules, priced + unpriced, reasons, _assumption_lines(req),
                          req.assumptions.purchase, sensitivity(ranked, req.assumptions.purchase, "$ per million tokens (compute + porting)") if ranked else {},
                          ranked)


def _break_even(total_usd: float, others: list[dict]) -> None:
    """The price per node-hour at which each other candidate would cost `total_usd` in total (the best one's
    total, or the budget): what a quote must beat. None where even a free cluster would not (its porting cost
    alone is higher)."""
    for c in others:
        budget = total_usd - c["porting_usd"]
        c["break_even_usd_per_node_hour"] = budget / (c["nodes"] * c["wall_days"] * 24) if budget > 0 else None


def _reasons(req: Request, priced: list[dict], unpriced: list[dict], skipped: list[str]) -> list[str]:
    reasons = []
    if priced:
        best = priced[0]
        reasons.append(f"{best['system']} x {best['nodes']} nodes ({best['chips']} chips): {best['wall_days']:.1f} "
                       f"days, compute ${best['compute_usd']:,.0f} ({best['price_label']}) + porting "
                       f"${best['porting_usd']:,.0f} = ${best['total_usd']:,.0f}, "
                       f"${best['cost_usd_per_million_tokens']:.3f} per million tokens")
        if len(priced) > 1:
            nxt = priced[1]
            reasons.append(f"next: {nxt['system']} at ${nxt['total_usd']:,.0f} ({nxt['price_label']}) "
                           f"({nxt['total_usd'] / best['total_usd'] - 1:+.0%}); compute alone "
                           f"${nxt['compute_usd']:,.0f}; " + _would_win(nxt))
        if best["porting_usd"] == 0 and any(c["porting_usd"] > 0 and c["compute_usd"] < best["compute_usd"]
                                            for c in priced):
            reasons.append("a cheaper-to-run system exists on the other software stack, but the workload is too "
                           "small for the compute saving to pay for porting the code")
        if best["porting_usd"] > 0:
            reasons.append("the compute saving over the team's current stack outweighs the one-off porting cost")
    else:
        reasons.append("no priced candidate can run this workload under the rules above (constraints, deadline, "
                       "budget)" + (": " + "; ".join(skipped) if skipped else ""))
    for c in unpriced:
        reasons.append(f"{c['system']}: {c['price_label']}: {c['wall_days']:.1f} days on {c['nodes']} nodes; "
                       f"{_would_win(c)} (give a quote with --price-per-node-hour-usd {c['system']}=USD)")
    reasons += [f"{c['system']}: {c['notes'][0]}" for c in priced + unpriced
                if c["global_batch"] != req.global_batch]
    return reasons + [f"skipped {s}" for s in skipped]


def _would_win(candidate: dict) -> str:
    value = candidate.get("break_even_usd_per_node_hour")
    if value is None:
        return "it cannot win at any price: porting alone costs more than the choice's total"
    return f"it would win below ${value:,.2f} per node-hour"



def _assumption_lines(req: Request) -> list[str]:
    size = (f"{req.nodes} nodes of each system" if req.nodes is not None
            else f"{req.chips} accelerator chips per system (nodes rounded up)")
    lines = req.assumptions.describe() + [
        f"porting to the other software stack: {req.porting_engineer_days:g} engineer-days x "
        f"${req.engineer_usd_per_day:,.0f}/day (assumption); team's current stack: {req.current_stack}",
        f"workload: {req.model}, {req.train_tokens:.3g} tokens, seq {req.seq}, global batch {req.global_batch}, "
        f"{size}",
        "systems without a price at the purchase option are ranked only with --price-per-node-hour-usd; "
        "otherwise their break-even price is shown",
    ]
    if req.kind == "finetune":
        lines.append("fine-tuning counts training tokens only: RLHF rollouts (generation) are not modelled; add "
                     "their tokens to --train-tokens as a rough equivalent")
    return lines


def _score(req: Request, row: Row) -> dict:
    porting = 0.0 if stack_of(row.system) == req.current_stack else req.porting_engineer_days * req.engineer_usd_per_day
    compute = row.cost_usd
    return {"system": row.system, "nodes": row.nodes, "chips": row.chips, "wall_days": row.wall_hours / 24,
            "purchase": row.purchase, "price_usd_per_node_hour": row.price_usd_per_node_hour,
            "price_label": row.price_label,
            "compute_usd": compute, "porting_usd": porting, "total_usd": None if compute is None else compute + porting,
            "mfu": row.mfu, "goodput": row.goodput, "cost_usd_per_million_tokens": row.cost_usd_per_million_tokens,
            "break_even_usd_per_node_hour": None, "layout": row.layout, "global_batch": row.global_batch,
            "notes": row.notes}
