"""Planner API: `estimate` one layout, `search` all valid layouts. Used by the CLI, the cost model, the simulator
and calibration. No torch imports.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from paratrain.hardware.catalog import System, resolve_system
from paratrain.model.config import ModelConfig, load_model_config
from paratrain.plan.model import DP_KINDS, RECOMPUTE, SCHEDULES, STAGE_SPLITS, Options, evaluate
from paratrain.plan.moe import check_expert_layout, expert_axes
from paratrain.plan.stages import (
    Loads,
    balanced_layers,
    check_pp_layers,
    describe,
    is_balanced,
    rank_loads,
    stage_split,
)


@dataclass(frozen=True)
class Layout:
    """A parallel layout. dp=None means 'all remaining devices'. zero_stage 0-2 go with dp_kind "ddp"
    (ZeRO-1/2 = distributed optimizer), 3 with "fsdp" (fully sharded) or "hsdp" (sharded inside a node,
    replicated across nodes).

    pp_layers: layers per (virtual) pipeline stage, in stage order (pp x virtual_stages entries, the runtime's
    parallel.pp_layers); None or "balanced": the runtime's default, equal counts; "auto": the planner chooses
    the split that minimises the slowest stage (fewer layers where the output head or embedding sits). An
    Estimate's layout always holds the concrete split used (None when pp = 1).

    ep, etp (MoE models, plan/moe.py): expert-parallel degree (divides num_experts) and expert tensor parallel
    (1 or tp); the tp x cp x dp ranks of a stage are refolded as etp x ep x edp for the expert layers, so ep
    borrows from dp and cp (and from tp when etp = 1), as torchtitan's expert_parallel_degree does."""

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    cp: int = 1
    sp: bool = False
    microbatch: int = 1
    recompute: str = "none"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    zero_stage: int = 1
    dp_kind: str = "ddp"
    pp_layers: tuple[int, ...] | str | None = None
    ep: int = 1
    etp: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.pp_layers, list):  # from JSON / TOML: keep the layout hashable
            object.__setattr__(self, "pp_layers", tuple(self.pp_layers))

    def to_dict(self) -> dict:
        data = asdict(self)
        if isinstance(self.pp_layers, tuple):  # JSON/TOML-friendly, as the runtime's config spells it
            data["pp_layers"] = list(self.pp_layers)
        return data


@dataclass
class Estimate:
    model: str
    system: str
    nodes: int
    devices: int
    seq: int
    global_batch: int
    layout: Layout
    step_time_s: float
    tokens_per_s: float
    mfu: float
    hfu: float
    model_flops_per_step: float
    hardware_flops_per_step: float
    microbatches: int
    memory_per_device_bytes: float
    memory_capacity_bytes: float
    fits: bool
    memory_breakdown_bytes: dict[str, float]
    time_breakdown_s: dict[str, float]
    comm_bytes_per_device: dict[str, float]
    bubble_fraction: float
    cost_usd_per_hour: float | None
    cost_usd_per_million_tokens: float | None
    time_to_train_s: float | None = None
    cost_usd_per_run: float | None = None
    energy_kwh_per_run: float | None = None
    notes: list[str] = field(default_factory=list)
    # step time with the runtime's balanced split, when the layout's split is not balanced (for comparison)
    balanced_step_time_s: float | None = None
    # MFU/HFU count attention FLOPs causally (half the s x s square, what flash attention computes and what the
    # timing model times); the *_full_attention fields count the full square (Narayanan et al. 2021, PaLM) for
    # comparison with papers
    attention_flops_convention: str = "causal"
    mfu_full_attention: float | None = None
    hfu_full_attention: float | None = None
    model_flops_full_attention_per_step: float | None = None

    def to_dict(self) -> dict:
        data = asdict(self)
        data["layout"] = self.layout.to_dict()
        return data


def _check_layout(model: ModelConfig, system: System, nodes: int, seq: int, global_batch: int, lay: Layout) -> Layout:
    """Validate a layout up front; return it with dp filled in. One ValueError naming field, value, allowed."""
    devices = nodes * system.devices_per_node
    for name in ("tp", "pp", "cp", "microbatch", "virtual_stages"):
        if getattr(lay, name) < 1:
            raise ValueError(f"{name} = {getattr(lay, name)}: must be >= 1")
    if lay.recompute not in RECOMPUTE:
        raise ValueError(f"recompute = {lay.recompute!r}: allowed: {', '.join(RECOMPUTE)}")
    if lay.schedule not in SCHEDULES:
        raise ValueError(f"schedule = {lay.schedule!r}: allowed: {', '.join(SCHEDULES)}")
    if lay.dp_kind not in DP_KINDS:
        raise ValueError(f"dp_kind = {lay.dp_kind!r}: allowed: {', '.join(DP_KINDS)}")
    if lay.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage = {lay.zero_stage}: allowed: 0, 1, 2, 3")
    if (lay.dp_kind == "ddp") != (lay.zero_stage < 3):
        raise ValueError(f"zero_stage = {lay.zero_stage} with dp_kind = {lay.dp_kind!r}: ddp takes 0-2, fsdp/hsdp take 3")
    model_par = lay.tp * lay.pp * lay.cp
    if devices % model_par:
        raise ValueError(f"tp*pp*cp = {model_par}: must divide the {devices} devices "
                         f"({nodes} x {system.devices_per_node} {system.device_unit})")
    dp = lay.dp if lay.dp is not None else devices // model_par
    if dp * model_par != devices:
        raise ValueError(f"dp = {lay.dp}: tp*pp*cp*dp = {dp * model_par} must equal the {devices} devices "
                         f"({nodes} x {system.devices_per_node} {system.device_unit}); dp = {devices // model_par} fits")
    checks = [
        (model.heads % lay.tp == 0, f"tp = {lay.tp}: must divide heads = {model.heads}"),
        (model.n_kv_heads % lay.tp == 0 or lay.tp % model.n_kv_heads == 0,
         f"tp = {lay.tp}: must divide or be a multiple of kv_heads = {model.n_kv_heads}"),
        (model.ffn % lay.tp == 0, f"tp = {lay.tp}: must divide ffn_hidden = {model.ffn}"),
        (model.layers >= lay.pp * lay.virtual_stages,
         f"pp*virtual_stages = {lay.pp * lay.virtual_stages}: must be <= layers = {model.layers}"),
        (seq % (2 * lay.cp) == 0 or lay.cp == 1, f"cp = {lay.cp}: seq = {seq} must be divisible by 2*cp"),
        (not (lay.sp and lay.tp == 1), "sp = true needs tp > 1"),
        (not lay.sp or lay.cp == 1 or (seq // lay.cp) % lay.tp == 0,
         f"sp = true with cp = {lay.cp}: seq/cp = {seq // lay.cp} must be divisible by tp = {lay.tp}"),
        (lay.schedule != "zbv" or lay.zero_stage < 3,
         "schedule = zbv with zero_stage = 3: the zero-bubble schedule computes weight gradients after the "
         "forward, when FSDP would have resharded the weights; allowed: zero_stage 0-2 with zbv"),
        (lay.schedule != "interleaved_1f1b" or (lay.virtual_stages > 1 and lay.pp > 1),
         "schedule = interleaved_1f1b: needs pp > 1 and virtual_stages > 1"),
        (lay.schedule != "zbv" or (lay.virtual_stages == 2 and lay.pp > 1),
         "schedule = zbv: needs pp > 1 and virtual_stages = 2"),
        (lay.schedule in ("interleaved_1f1b", "zbv") or lay.virtual_stages == 1,
         f"virtual_stages = {lay.virtual_stages}: only interleaved_1f1b and zbv use more than 1"),
        (global_batch % (dp * lay.microbatch) == 0,
         f"microbatch = {lay.microbatch}: global_batch = {global_batch} must be divisible by dp*microbatch = {dp * lay.microbatch}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    check_expert_layout(model, lay.tp, lay.cp, dp, lay.ep, lay.etp)
    if isinstance(lay.pp_layers, str):
        if lay.pp_layers not in STAGE_SPLITS:
            raise ValueError(f"pp_layers = {lay.pp_layers!r}: allowed: {', '.join(STAGE_SPLITS)}, or one layer "
                             f"count per stage")
    elif lay.pp_layers is not None:
        check_pp_layers(lay.pp_layers, model.layers, lay.pp, lay.virtual_stages)
    microbatches = global_batch // (dp * lay.microbatch)
    if lay.schedule in ("interleaved_1f1b", "zbv") and microbatches < lay.pp:
        raise ValueError(f"schedule = {lay.schedule}: needs microbatches per replica ({microbatches}) >= pp ({lay.pp})")
    return Layout(**{**lay.to_dict(), "dp": dp})


def _resolve(model, system) -> tuple[ModelConfig, System]:
    model = model if isinstance(model, ModelConfig) else load_model_config(model)
    return model, resolve_system(system)


def estimate(model: ModelConfig | str, system: System | str, nodes: int, seq: int, global_batch: int,
             layout: Layout, options: Options | None = None, train_tokens: float | None = None,
             stack: str | None = None) -> Estimate:
    """Step time, MFU/HFU, memory and cost of one layout. Raises ValueError for an invalid layout; a layout that
    does not fit in memory is still estimated (fits=False). stack (plan.stacks): time it as that stack runs it
    (when no options are given) and note a choice the stack does not support."""
    model, system = _resolve(model, system)
    _check_scalars(nodes, seq, global_batch)
    layout = _check_layout(model, system, nodes, seq, global_batch, layout)
    from paratrain.plan.stacks import STACKS, check_stack

    opts = options or Options.for_system(system, stack=stack and check_stack(stack))
    res = _evaluate_one(model, system, nodes, seq, global_batch, layout, opts, **_split_args(model, layout))
    split = _concrete_split(model, layout, res)
    balanced = None
    if split is not None and not is_balanced(split, model.layers):  # what the runtime's default would give
        balanced = _evaluate_one(model, system, nodes, seq, global_batch, layout, opts)["step_time_s"]
    return _to_estimate(model, system, nodes, seq, global_batch, replace(layout, pp_layers=split), res,
                        train_tokens, balanced, STACKS[stack] if stack else system.stack)


def _evaluate_one(model, system, nodes, seq, global_batch, layout: Layout, opts, **split) -> dict:
    res = evaluate(model, system, seq, global_batch, nodes=nodes, tp=layout.tp, pp=layout.pp, dp=layout.dp,
                   cp=layout.cp, microbatch=layout.microbatch, sp=layout.sp,
                   recompute=RECOMPUTE.index(layout.recompute), schedule=SCHEDULES.index(layout.schedule),
                   virtual_stages=layout.virtual_stages, zero_stage=layout.zero_stage,
                   dp_kind=DP_KINDS.index(layout.dp_kind), opts=opts, ep=layout.ep, etp=layout.etp, **split)
    return {k: np.asarray(v).item() for k, v in res.items()}


def _split_args(model: ModelConfig, layout: Layout) -> dict:
    """evaluate's stage arguments for the layout's pp_layers: a given split as layers per rank, else the mode."""
    if layout.pp_layers is None or isinstance(layout.pp_layers, str):
        return {"split": layout.pp_layers or "balanced"}
    first, last, inner = rank_loads(layout.pp_layers, layout.pp, layout.schedule == "zbv")
    balanced = is_balanced(layout.pp_layers, model.layers)
    return {"stage_loads": Loads(*(np.array(float(n)) for n in (first, last, inner)), np.array(balanced))}


def _concrete_split(model: ModelConfig, layout: Layout, row: dict) -> tuple[int, ...] | None:
    """The per-stage layer counts evaluate used for this layout (row: its results)."""
    if layout.pp == 1:
        return None
    if isinstance(layout.pp_layers, tuple):
        return layout.pp_layers
    stages = layout.pp * layout.virtual_stages
    if row["stage_balanced"]:
        return tuple(balanced_layers(model.layers, stages))
    return stage_split(model.layers, layout.pp, layout.virtual_stages, layout.schedule == "zbv",
                       int(round(row["stage_layers_first"])), int(round(row["stage_layers_last"])))


def check_seq(model: ModelConfig, seq: int) -> None:
    """A sequence beyond the model's max_seq is refused (its positions were never trained), unless the user
    says it goes that far (--max-seq, or a model TOML with a longer max_seq: RoPE scaling). The CLI applies it;
    the API estimates what it is asked (published long-context runs extend their models' context)."""
    if seq > model.max_seq:
        raise ValueError(f"--seq {seq} exceeds {model.name}'s max_seq = {model.max_seq}; allowed: --seq <= "
                         f"{model.max_seq}, or --max-seq {seq} (a longer context by RoPE scaling, as Llama 3.1's "
                         f"rope_scaling factor 8 takes 8192 to 131072)")


def _check_scalars(nodes: int, seq: int, global_batch: int) -> None:
    for name, value in (("nodes", nodes), ("seq", seq), ("global_batch", global_batch)):
        if not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name} = {value!r}: must be an integer >= 1")


def _to_estimate(model, system, nodes, seq, global_batch, layout, r: dict, train_tokens,
                 balanced_step_time_s: float | None = None, stack=None) -> Estimate:
    price = r["cost_usd_per_hour"]
    price = None if price is None or math.isnan(price) else float(price)
    per_m = None if price is None else price / 3600.0 / r["tokens_per_s"] * 1e6
    est = Estimate(
        model=model.name, system=system.name, nodes=int(nodes), devices=int(r["devices"]), seq=seq,
        global_batch=global_batch, layout=layout, step_time_s=r["step_time_s"], tokens_per_s=r["tokens_per_s"],
        mfu=r["mfu"], hfu=r["hfu"], model_flops_per_step=r["model_flops_per_step"],
        hardware_flops_per_step=r["hardware_flops_per_step"], microbatches=int(round(r["microbatches"])),
        memory_per_device_bytes=r["memory_per_device_bytes"], memory_capacity_bytes=r["memory_capacity_bytes"],
        fits=bool(r["fits"]),
        memory_breakdown_bytes={k[len("memory_"):-len("_bytes")]: r[k] for k in
                                ("memory_weights_bytes", "memory_grads_bytes", "memory_optimizer_bytes",
                                 "memory_activations_bytes")},
        time_breakdown_s={k[len("time_"):-len("_s")]: r[k] for k in r if k.startswith("time_")},
        comm_bytes_per_device={k[len("comm_"):-len("_bytes")]: r[k] for k in r if k.startswith("comm_")},
        bubble_fraction=r["bubble_fraction"], cost_usd_per_hour=price, cost_usd_per_million_tokens=per_m,
        balanced_step_time_s=balanced_step_time_s, mfu_full_attention=r["mfu_full_attention"],
        hfu_full_attention=r["hfu_full_attention"],
        model_flops_full_attention_per_step=r["model_flops_full_attention_per_step"],
    )
    if train_tokens:
        est.time_to_train_s = train_tokens / est.tokens_per_s
        if price is not None:
            est.cost_usd_per_run = price * est.time_to_train_s / 3600.0
        if system.node_power_w is not None:
            est.energy_kwh_per_run = system.node_power_w * nodes * est.time_to_train_s / 3.6e6
    if not est.fits:
        est.notes.append(f"does not fit: {est.memory_per_device_bytes / 2**30:.1f} GiB needed per device, "
                         f"{est.memory_capacity_bytes / 2**30:.1f} GiB usable")
    if balanced_step_time_s is not None:
        change = est.step_time_s / balanced_step_time_s - 1  # negative: this split is faster
        est.notes.append(f"pipeline stages {describe(layout.pp_layers)} layers: step time {change:+.1%} vs the "
                         f"balanced {describe(balanced_layers(model.layers, len(layout.pp_layers)))} "
                         f"({balanced_step_time_s:.4f} s)")
    elif est.layout.pp > 1 and model.layers % (layout.pp * layout.virtual_stages):
        est.notes.append(f"{model.layers} layers do not split evenly over pp*virtual_stages = "
                         f"{layout.pp * layout.virtual_stages}: the busiest stage sets the pace")
    if stack is not None and (layout.dp_kind not in stack.dp_kinds or layout.zero_stage not in stack.zero_stages
                              or (layout.pp > 1 and layout.schedule not in stack.schedules)):
        est.notes.append(f"{stack.name} on {system.name} does not support this choice "
                         f"(dp_kind {layout.dp_kind}, zero {layout.zero_stage}, schedule {layout.schedule})")
    if price is None:
        est.notes.append(f"no public price for {system.name}: cost fields are null")
    return est


# ---- search ---------------------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass
class SearchResult:
    """candidates: the best `top`, ranked. combinations: the raw grid (tp x pp x cp x microbatch x sp x
    recompute x schedule/v x ZeRO/dp kind per node count); valid: layouts passing the divisibility and stack
    rules, each run through the full model; fitting: those that fit in memory."""

    candidates: list[Estimate]
    combinations: int
    valid: int
    fitting: int
    seconds: float

    @property
    def configs_per_s(self) -> float:
        """Layouts evaluated by the full model per second (the valid ones; filtering is not counted)."""
        return self.valid / self.seconds if self.seconds > 0 else float("inf")


def _grid(model: ModelConfig, system: System, nodes: int, seq: int, global_batch: int,
          max_microbatch: int, cp_options: list[int], stack,
          constraints: dict | None = None) -> dict[str, np.ndarray]:
    """All combinations of the discrete choices that are structurally valid (divisibility), as arrays."""
    devices = nodes * system.devices_per_node
    tps = [t for t in _divisors(devices) if model.heads % t == 0 and model.ffn % t == 0
           and (model.n_kv_heads % t == 0 or t % model.n_kv_heads == 0)]
    # any pipeline degree that divides the devices and leaves every stage a layer: uneven counts (126 layers on
    # 32 stages) are split as the runtime splits them (plan/stages.py), and the slowest stage sets the pace
    pps = [p for p in _divisors(devices) if p <= model.layers]
    cps = [c for c in cp_options if devices % c == 0 and seq % (2 * c) == 0 or c == 1]
    mbs = [b for b in _divisors(global_batch) if b <= max_microbatch]
    # (schedule, virtual stages) pairs
    sched_v = [(0, 1), (1, 1)] + [(2, v) for v in (2, 3, 4, 5, 6, 8)] + [(3, 2)]
    # (zero stage, dp kind) pairs
    zero_kind = [(0, 0), (1, 0), (2, 0), (3, 1), (3, 2)]
    # (tp, pp, cp) triples that divide the devices and leave a data-parallel degree dividing the global batch,
    # first: the rest of the grid is expanded only for those (uneven pipeline degrees make pp long)
    t3, p3, c3 = (a.ravel() for a in np.meshgrid(np.array(tps), np.array(pps), np.array(cps), indexing="ij"))
    par = t3 * p3 * c3
    keep = (devices % par == 0) & (global_batch % np.maximum(devices // par, 1) == 0)
    combinations = int(t3.size) * len(mbs) * 2 * 3 * len(sched_v) * len(zero_kind)
    t3, p3, c3 = t3[keep], p3[keep], c3[keep]
    axes = np.meshgrid(np.arange(t3.size), np.array(mbs), np.array([0, 1]), np.arange(3), np.arange(len(sched_v)),
                       np.arange(len(zero_kind)), indexing="ij")
    i3, b, sp, rc, sv, zk = (a.ravel() for a in axes)
    tp, pp, cp = t3[i3], p3[i3], c3[i3]
    sv_arr, zk_arr = np.array(sched_v), np.array(zero_kind)
    sched, v = sv_arr[sv, 0], sv_arr[sv, 1]
    zero, kind = zk_arr[zk, 0], zk_arr[zk, 1]
    model_par = tp * pp * cp
    dp = devices // model_par
    m = global_batch // np.maximum(dp * b, 1)
    ok = (devices % model_par == 0) & (dp >= 1)
    ok &= global_batch % np.maximum(dp * b, 1) == 0
    ok &= (sp == 0) | (tp > 1)
    ok &= model.layers >= pp * v  # the runtime's rule: every (virtual) stage holds at least one layer
    ok &= np.where(pp == 1, sched == 1, True)  # one stage: no schedule to choose
    ok &= np.where(sched >= 2, m >= pp, True)
    ok &= (dp > 1) | (zk == 1) | (zk == 0)  # with one replica the ZeRO choices coincide: keep 0 and 1 only
    local_dp = system.devices_per_node // tp  # HSDP shards over dp x cp ranks inside a node, replicas across nodes
    ok &= (kind != 2) | ((local_dp >= 2) & (dp * cp > local_dp))
    ok &= (sp == 0) | (cp == 1) | ((seq // cp) % tp == 0)  # SP splits each cp rank's sequence over tp
    ok &= (sched != 3) | (zero < 3)  # ZB-V computes weight gradients after FSDP would reshard (runtime refuses)
    if stack is not None:
        ok &= np.isin(zero, stack.zero_stages) & np.isin(kind, [DP_KINDS.index(k) for k in stack.dp_kinds])
        ok &= (pp == 1) | np.isin(sched, [SCHEDULES.index(k) for k in stack.schedules])
    tp, pp, cp, dp, b, sp, rc, sched, v, zero, kind, ep, etp, ok = expert_axes(
        model, (tp, pp, cp, dp, b, sp, rc, sched, v, zero, kind), ok)  # MoE: every valid (ep, etp) per layout
    named = {"tp": tp, "pp": pp, "cp": cp, "dp": dp, "microbatch": b, "sp": sp, "recompute": rc, "schedule": sched,
             "virtual_stages": v, "zero_stage": zero, "dp_kind": kind, "ep": ep, "etp": etp}
    for key, allowed in (constraints or {}).items():
        if key not in named:
            raise ValueError(f"constraint '{key}': unknown; allowed: {', '.join(named)}")
        codes = {"recompute": RECOMPUTE, "schedule": SCHEDULES, "dp_kind": DP_KINDS}.get(key)
        values = [codes.index(a) if codes else int(a) for a in allowed]
        ok &= np.isin(named[key], values)
    sel = np.nonzero(ok)[0]
    return {"tp": tp[sel], "pp": pp[sel], "cp": cp[sel], "dp": dp[sel], "microbatch": b[sel], "sp": sp[sel] == 1,
            "recompute": rc[sel], "schedule": sched[sel], "virtual_stages": v[sel], "zero_stage": zero[sel],
            "dp_kind": kind[sel], "ep": ep[sel], "etp": etp[sel], "raw": np.int64(combinations)}


def search(model: ModelConfig | str, system: System | str, nodes: int, seq: int, global_batch: int, *,
           top: int = 10, objective: str = "time", options: Options | None = None, max_microbatch: int = 64,
           cp_options: list[int] | None = None, train_tokens: float | None = None,
           node_counts: list[int] | None = None, any_stack: bool = False,
           constraints: dict[str, list] | None = None, max_time_s: float | None = None,
           stack: str | None = None) -> SearchResult:
    """Evaluate every valid layout that fits in memory and rank by step time (objective "time") or by cost per
    token (objective "cost"; node_counts, default the powers of two up to `nodes`, are then searched too,
    since on a fixed cluster cost per token ranks exactly like time). Only the choices the system's training
    stack supports are searched unless any_stack. constraints: {"tp": [8], "recompute": ["full"], ...} keeps
    only layouts whose field is in the list. max_time_s (with train_tokens): drop layouts that would train longer.
    stack (plan.stacks: nxd, megatron, fsdp2, deepspeed): search only what that stack supports, with its
    Options defaults (instead of the system's own stack)."""
    model, system = _resolve(model, system)
    _check_scalars(nodes, seq, global_batch)
    if objective not in ("time", "cost"):
        raise ValueError(f"objective = {objective!r}: allowed: time, cost")
    if objective == "cost" and system.prices.on_demand_usd_per_hour is None:
        raise ValueError(f"objective = cost: system {system.name} has no public price in the catalog")
    from paratrain.plan.stacks import STACKS, check_stack

    if stack is not None:
        check_stack(stack)
    opts = options or Options.for_system(system, stack=stack)
    searched = STACKS[stack] if stack is not None else (None if any_stack else system.stack)
    if cp_options is None:
        cp_options = [1] if seq < 16384 else [1, 2, 4, 8, 16, 32]
    if node_counts is None:
        node_counts = [nodes]
        if objective == "cost":
            node_counts = sorted({nodes} | {nodes // 2**k for k in range(1, 30) if nodes // 2**k >= 1})
    start = time.perf_counter()
    grids, combinations = [], 0
    for n in node_counts:
        grid = _grid(model, system, n, seq, global_batch, max_microbatch, cp_options, searched, constraints)
        combinations += int(grid.pop("raw"))
        grid["nodes"] = np.full(grid["tp"].shape, n)
        grids.append(grid)
    grid = {k: np.concatenate([g[k] for g in grids]) for k in grids[0]}
    res = evaluate(model, system, seq, global_batch, opts=opts, split="auto", **grid)
    fits = res["fits"]
    score = res["step_time_s"] if objective == "time" else res["cost_usd_per_hour"] / res["tokens_per_s"]
    allowed = fits
    if max_time_s is not None:
        if not train_tokens:
            raise ValueError("max_time_s needs train_tokens (the run length) to be set")
        allowed = allowed & (train_tokens / res["tokens_per_s"] <= max_time_s)
    score = np.where(allowed, score, np.inf)
    if score.size > top:  # the best `top` without sorting the whole grid, then those in order (stable)
        cut = np.partition(score, top - 1)[top - 1]
        head = np.nonzero(score <= cut)[0]
        order = head[np.argsort(score[head], kind="stable")][:top]
    else:
        order = np.argsort(score, kind="stable")[:top]
    order = order[np.isfinite(score[order])]
    elapsed = time.perf_counter() - start
    # the ranked layouts again with the runtime's balanced split, to report what the chosen split gains
    balanced = evaluate(model, system, seq, global_batch, opts=opts,
                        **{k: v[order] for k, v in grid.items()}) if order.size else {}
    candidates = []
    for rank, i in enumerate(order):
        layout = Layout(tp=int(grid["tp"][i]), pp=int(grid["pp"][i]), dp=int(grid["dp"][i]), cp=int(grid["cp"][i]),
                        sp=bool(grid["sp"][i]), microbatch=int(grid["microbatch"][i]),
                        recompute=RECOMPUTE[grid["recompute"][i]], schedule=SCHEDULES[grid["schedule"][i]],
                        virtual_stages=int(grid["virtual_stages"][i]), zero_stage=int(grid["zero_stage"][i]),
                        dp_kind=DP_KINDS[grid["dp_kind"][i]], pp_layers="auto", ep=int(grid["ep"][i]),
                        etp=int(grid["etp"][i]))
        row = {k: float(np.asarray(v)[i]) if np.ndim(v) else float(v) for k, v in res.items()}
        layout = replace(layout, pp_layers=_concrete_split(model, layout, row))
        even = layout.pp_layers is None or is_balanced(layout.pp_layers, model.layers)
        candidates.append(_to_estimate(model, system, int(grid["nodes"][i]), seq, global_batch, layout, row,
                                       train_tokens, None if even else float(balanced["step_time_s"][rank]),
                                       searched))
    return SearchResult(candidates=candidates, combinations=combinations, valid=int(grid["tp"].size),
                        fitting=int(fits.sum()), seconds=elapsed)
