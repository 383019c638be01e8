"""Planner API: `estimate` one layout, `search` all valid layouts. Used by the CLI, the cost model, the simulator
and calibration. No torch imports.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np
from pydantic import ValidationError

from paratrain.config import (
    V_SCHEDULES,
    ParallelSection,
    TrainSection,
    check_pp_layers,
    chunks_per_rank,
    format_validation_error,
    resolve_degrees,
    view_of,
    zero_stage_of,
)
from paratrain.config.dp import check_dp_fields
from paratrain.config.names import DP_KINDS, RECOMPUTE
from paratrain.config.ranks import DEFAULT_RANK_ORDER
from paratrain.config.rules import EXPERT, View, check, mask
from paratrain.hardware.catalog import Stack, System, resolve_system
from paratrain.model.config import ModelConfig, load_model_config
from paratrain.plan.moe import expert_axes
from paratrain.plan.options import Options
from paratrain.plan.stages import (
    Loads,
    balanced_layers,
    describe,
    is_balanced,
    rank_loads,
    stage_split,
)
from paratrain.plan.step import SCHEDULES, STAGE_SPLITS, check_host_link, evaluate


@dataclass(frozen=True)
class Layout:
    """A parallel layout: the trainer's [parallel] section (paratrain.config.ParallelSection) plus
    train.microbatch, with the same meanings, defaults and allowed values; `layout_from_parallel` and
    `Layout.to_parallel` convert, and the rules of paratrain.config.rules decide what is valid. One spelling
    differs: dp=None is parallel.dp=-1 ('all remaining devices').

    dp_kind / zero_stage: DeepSpeed's ZeRO numbering (paratrain.config.dp): ddp with 0 (replicated), 1 (sharded
    optimizer state) or 2 (+ gradients); fsdp/hsdp with 2 (reshard_after_forward=false) or 3 (fully sharded, the
    default). Unset, each follows the other as in the trainer: dp_kind None -> ddp for zero_stage 0/1, else fsdp;
    zero_stage None -> 0 for ddp, 3 for fsdp/hsdp (2 under zbv/dualpipev). An Estimate's layout holds both.
    dp_replicate (hsdp): replica groups; None = one per node (the devices of a node shard).

    pp_layers: layers per (virtual) pipeline stage, in stage order (pp x chunks entries, the runtime's
    parallel.pp_layers); None or "balanced": the runtime's default, equal counts; "auto": the planner chooses
    the split that minimises the slowest stage (fewer layers where the output head or embedding sits). An
    Estimate's layout always holds the concrete split used (None when pp = 1).

    ep, etp (MoE models): expert-parallel degree and expert tensor parallelism (1, the default, or tp), the
    trainer's parallel.ep / parallel.etp; the tp x cp x dp ranks of a stage are refolded as etp x ep x edp for
    the expert layers, so ep borrows from dp and cp (and from tp when etp = 1), as torchtitan's
    expert_parallel_degree does. Valid values: paratrain.config.rules (the trainer's rules); timed in plan/moe.py.

    rank_order: how ranks map onto tp, cp, dp, pp, innermost first (the trainer's parallel.rank_order, Megatron-Core's
    `order`; paratrain.config.ranks): what decides which groups share a node or a pod. search keeps the default."""

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    cp: int = 1
    sp: bool = False
    microbatch: int = TrainSection.model_fields["microbatch"].default  # the trainer's train.microbatch
    recompute: str = "none"
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    zero_stage: int | None = None
    dp_kind: str | None = None
    pp_layers: tuple[int, ...] | str | None = None
    ep: int = 1
    etp: int = 1
    dp_replicate: int | None = None
    rank_order: str = DEFAULT_RANK_ORDER  # the trainer's parallel.rank_order (paratrain.config.ranks)
    offload_layers: int = 0  # the trainer's parallel.offload_layers (activations of that many blocks per stage on the host)

    def __post_init__(self) -> None:
        if isinstance(self.pp_layers, list):  # from JSON / TOML: keep the layout hashable
            object.__setattr__(self, "pp_layers", tuple(self.pp_layers))

    def to_dict(self) -> dict:
        data = asdict(self)
        if isinstance(self.pp_layers, tuple):  # JSON/TOML-friendly, as the runtime's config spells it
            data["pp_layers"] = list(self.pp_layers)
        return data

    def to_parallel(self) -> ParallelSection:
        """The trainer's [parallel] section of this layout (the one conversion; ValueError naming the field)."""
        fields = {"dp": -1 if self.dp is None else self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp,
                  "sp": self.sp, "recompute": self.recompute, "pp_schedule": self.pp_schedule,
                  "virtual_stages": self.virtual_stages}
        if self.offload_layers:  # written only where set (as ep/etp), so a planned config without it is unchanged
            fields["offload_layers"] = self.offload_layers
        if self.dp_kind is not None:
            fields["dp_kind"] = self.dp_kind
        if self.zero_stage is not None:
            fields["zero_stage"] = self.zero_stage
        if isinstance(self.pp_layers, tuple):
            fields["pp_layers"] = list(self.pp_layers)
        if self.dp_replicate is not None:
            fields["dp_replicate"] = self.dp_replicate
        if self.ep > 1 or self.etp > 1:  # MoE expert layout (plan/moe.py; the trainer's parallel.ep / etp)
            fields.update(ep=self.ep, etp=self.etp)
        if self.rank_order != DEFAULT_RANK_ORDER:
            fields["rank_order"] = self.rank_order
        return parallel_section(fields)


def parallel_section(keys: dict) -> ParallelSection:
    """The trainer's [parallel] section of these keys: its checks, its defaults for the rest (one-line ValueError)."""
    try:
        return ParallelSection(**keys)
    except ValidationError as err:
        raise ValueError(re.sub("invalid config: (config: )?", "layout: ", format_validation_error(err))) from None


def layout_of(keys: dict, microbatch: int | None = None, pp_layers: str = "auto") -> Layout:
    """The Layout of the trainer's parallel.* keys given and train.microbatch, read as the trainer reads them;
    pp_layers: auto, balanced or counts per stage ("8,9,8,7"; `paratrain estimate --pp-layers`)."""
    try:
        split = pp_layers if pp_layers in STAGE_SPLITS else tuple(int(n) for n in pp_layers.strip("[] ").split(","))
    except ValueError:
        raise ValueError(f"--pp-layers = {pp_layers!r}: allowed: auto, balanced, or layer counts per stage such as "
                         "8,9,8,7") from None
    pcfg = parallel_section(keys)
    return replace(layout_from_parallel(pcfg, Layout.microbatch if microbatch is None else microbatch), pp_layers=split)


def layout_from_parallel(pcfg: ParallelSection, microbatch: int, dp: int | None = None) -> Layout:
    """The planner's Layout of a trainer [parallel] section (dp: the resolved size, else pcfg.dp / None)."""
    return Layout(tp=pcfg.tp, pp=pcfg.pp, dp=dp if dp is not None else (None if pcfg.dp == -1 else pcfg.dp),
                  cp=pcfg.cp, sp=pcfg.sp, microbatch=microbatch, recompute=pcfg.recompute, pp_schedule=pcfg.pp_schedule,
                  virtual_stages=pcfg.virtual_stages, zero_stage=pcfg.zero_stage, dp_kind=pcfg.dp_kind,
                  pp_layers=tuple(pcfg.pp_layers) if pcfg.pp_layers else None,
                  dp_replicate=pcfg.dp_replicate if pcfg.dp_kind == "hsdp" and pcfg.dp_replicate > 1 else None,
                  ep=pcfg.ep, etp=pcfg.etp, rank_order=pcfg.rank_order, offload_layers=pcfg.offload_layers)


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
    # selective recompute that also replays the MLP block (Options.recompute_mlp; NxD's
    # activations_checkpoint_recompute_mlp): `plan --stack nxd` searches it beside plain selective recompute
    recompute_mlp: bool = False
    mfu_full_attention: float | None = None
    hfu_full_attention: float | None = None
    model_flops_full_attention_per_step: float | None = None

    def to_dict(self) -> dict:
        data = asdict(self)
        data["layout"] = self.layout.to_dict()
        return data


def _check_layout(model: ModelConfig, system: System, nodes: int, seq: int, global_batch: int, lay: Layout) -> Layout:
    """Validate a layout up front with the trainer's rules (paratrain.config.rules; what the planner models beyond
    paratrain's runtime is allowed); return it with dp and zero_stage filled in. One ValueError naming the field."""
    devices = nodes * system.devices_per_node
    pcfg = lay.to_parallel()
    TrainSection(seq_len=max(seq, 2), global_batch=global_batch, microbatch=max(lay.microbatch, 1))
    if lay.microbatch < 1:
        raise ValueError(f"train.microbatch={lay.microbatch}: allowed: >= 1")
    check(view_of(model, pcfg, seq), runtime=False, groups=EXPERT)  # ep vs the model before ep vs the ranks
    try:
        dp = resolve_degrees(pcfg, devices)["dp"]
    except ValueError as exc:
        raise ValueError(f"{exc} ({devices} devices: {nodes} x {system.devices_per_node} {system.device_unit})") from None
    check_dp_fields(pcfg)
    check_host_link(system, lay.offload_layers)
    check(view_of(model, pcfg, seq, global_batch, lay.microbatch, dp), runtime=False)  # expert layout included
    if isinstance(lay.pp_layers, str):
        if lay.pp_layers not in STAGE_SPLITS:
            raise ValueError(f"pp_layers = {lay.pp_layers!r}: allowed: {', '.join(STAGE_SPLITS)}, or one layer "
                             f"count per stage")
    elif lay.pp_layers is not None:
        check_pp_layers(lay.pp_layers, model.layers, lay.pp, chunks_per_rank(lay.pp_schedule, lay.virtual_stages),
                        "parallel.pp_layers")
    return replace(lay, dp=dp, zero_stage=zero_stage_of(pcfg), dp_kind=pcfg.dp_kind)


def _internal(layout: Layout) -> dict:
    """The physics' codes of a checked layout (plan.step.evaluate): schedule index and chunks per rank; one
    stage (pp = 1) has no schedule (the runtime ignores it: coded as 1f1b)."""
    if layout.pp == 1:
        return {"pp_schedule": SCHEDULES.index("1f1b"), "virtual_stages": 1}
    return {"pp_schedule": SCHEDULES.index(layout.pp_schedule),
            "virtual_stages": chunks_per_rank(layout.pp_schedule, layout.virtual_stages)}


def _v_shape(layout: Layout) -> bool:
    return layout.pp > 1 and layout.pp_schedule in V_SCHEDULES


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
    return estimate_checked(model, system, nodes, seq, global_batch, layout, options, train_tokens, stack)


def check_layout(model: ModelConfig | str, system: System | str, nodes: int, seq: int, global_batch: int,
                 layout: Layout) -> Layout:
    """estimate's validation alone: the layout with dp and zero_stage filled in (a ValueError naming the field
    otherwise), for estimate_checked. A caller that times one layout on many systems of one size (calibration's
    fits: ~10^3 estimates per run, the systems differing only in efficiencies) checks it once; the check was a
    fifth of an estimate's time."""
    model, system = _resolve(model, system)
    _check_scalars(nodes, seq, global_batch)
    return _check_layout(model, system, nodes, seq, global_batch, layout)


def estimate_checked(model: ModelConfig | str, system: System | str, nodes: int, seq: int, global_batch: int,
                     layout: Layout, options: Options | None = None, train_tokens: float | None = None,
                     stack: str | None = None) -> Estimate:
    """estimate of a layout check_layout returned for the same model, size of system (devices per node), nodes,
    seq and global_batch: the same result, without checking it again."""
    model, system = _resolve(model, system)
    from paratrain.plan.stacks import STACKS, check_stack

    opts = options or Options.for_system(system, stack=stack and check_stack(stack))
    check_precision(system, opts)
    res = _evaluate_one(model, system, nodes, seq, global_batch, layout, opts, **_split_args(model, layout))
    split = _concrete_split(model, layout, res)
    balanced = None
    if split is not None and not is_balanced(split, model.layers):  # what the runtime's default would give
        balanced = _evaluate_one(model, system, nodes, seq, global_batch, layout, opts)["step_time_s"]
    est = _to_estimate(model, system, nodes, seq, global_batch, replace(layout, pp_layers=split), res,
                       train_tokens, balanced, STACKS[stack] if stack else system.stack)
    est.recompute_mlp = opts.recompute_mlp and layout.recompute == "selective"
    return est


def _evaluate_one(model, system, nodes, seq, global_batch, layout: Layout, opts, **split) -> dict:
    res = evaluate(model, system, seq, global_batch, nodes=nodes, tp=layout.tp, pp=layout.pp, dp=layout.dp,
                   cp=layout.cp, microbatch=layout.microbatch, sp=layout.sp,
                   recompute=RECOMPUTE.index(layout.recompute), zero_stage=layout.zero_stage,
                   dp_kind=DP_KINDS.index(layout.dp_kind), dp_replicate=layout.dp_replicate, opts=opts,
                   ep=layout.ep, etp=layout.etp, rank_order=layout.rank_order, offload=layout.offload_layers,
                   **_internal(layout), **split)
    return {k: np.asarray(v).item() for k, v in res.items()}


def _split_args(model: ModelConfig, layout: Layout) -> dict:
    """evaluate's stage arguments for the layout's pp_layers: a given split as layers per rank, else the mode."""
    if layout.pp_layers is None or isinstance(layout.pp_layers, str):
        return {"split": layout.pp_layers or "balanced"}
    first, last, inner = rank_loads(layout.pp_layers, layout.pp, _v_shape(layout))
    balanced = is_balanced(layout.pp_layers, model.layers)
    return {"stage_loads": Loads(*(np.array(float(n)) for n in (first, last, inner)), np.array(balanced))}


def _concrete_split(model: ModelConfig, layout: Layout, row: dict) -> tuple[int, ...] | None:
    """The per-stage layer counts evaluate used for this layout (row: its results)."""
    if layout.pp == 1:
        return None
    if isinstance(layout.pp_layers, tuple):
        return layout.pp_layers
    chunks = _internal(layout)["virtual_stages"]
    if row["stage_balanced"]:
        return tuple(balanced_layers(model.layers, layout.pp * chunks))
    return stage_split(model.layers, layout.pp, chunks, _v_shape(layout),
                       int(round(row["stage_layers_first"])), int(round(row["stage_layers_last"])))


def check_seq(model: ModelConfig, seq: int) -> None:
    """A sequence beyond the model's max_seq is refused (its positions were never trained), unless the user
    says it goes that far (--max-seq, or a model TOML with a longer max_seq: RoPE scaling). The CLI applies it;
    the API estimates what it is asked (published long-context runs extend their models' context)."""
    if seq > model.max_seq:
        raise ValueError(f"--seq {seq} exceeds {model.name}'s max_seq = {model.max_seq}; allowed: --seq <= "
                         f"{model.max_seq}, or --max-seq {seq} (a longer context by RoPE scaling, as Llama 3.1's "
                         f"rope_scaling factor 8 takes 8192 to 131072)")


def check_precision(system: System, opts: Options) -> None:
    """Refuse a matmul format the system's chip cannot run, before anything is timed (a BF16 rate under an FP8
    label would be a silently wrong number): FP8 needs an FP8 rate in the catalog (chips.X.fp8_tflops: Ampere has
    none), the MX block-scaled formats (an MXFP8 recipe, FP4) need chips.X.mx_formats (Blackwell, Trainium3 on)."""
    chip = system.chip
    if opts.fp8 and chip.fp8_tflops is None:
        raise ValueError(f"--fp8 on {system.name}: {chip.name} has no FP8 matmul rate (chips.{chip.name}.fp8_tflops "
                         f"unset: its matrix engines run no FP8); allowed: BF16 (no --fp8 / --fp8-recipe), or a chip "
                         f"with an FP8 rate")
    if (opts.fp4 or (opts.fp8 and opts.block_scaling)) and not chip.mx_formats:
        what = "FP4" if opts.fp4 else "--fp8-recipe mxfp8"
        why = ("Transformer Engine's MXFP8 needs compute capability 10.0" if chip.vendor == "nvidia"
               else "the MX formats start with Trainium3's NeuronCore-v4")
        raise ValueError(f"{what} on {system.name}: {chip.name} runs no MX block-scaled matmuls "
                         f"(chips.{chip.name}.mx_formats false; {why}); allowed: --fp8-recipe current or delayed "
                         f"(per-tensor FP8), or a chip with mx_formats")


def _check_scalars(nodes: int, seq: int, global_batch: int) -> None:
    for name, value in (("nodes", nodes), ("seq", seq), ("global_batch", global_batch)):
        if not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name} = {value!r}: must be an integer >= 1")


def _to_estimate(model, system, nodes, seq, global_batch, layout, r: dict, train_tokens,
                 balanced_step_time_s: float | None = None, stack=None) -> Estimate:
    from paratrain.plan.stacks import offload_allowed

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
    elif est.layout.pp > 1 and model.layers % (stages := layout.pp * _internal(layout)["virtual_stages"]):
        est.notes.append(f"{model.layers} layers do not split evenly over {stages} pipeline stages (pp x chunks "
                         f"per rank): the busiest stage sets the pace")
    if stack is not None and (layout.dp_kind not in stack.dp_kinds or layout.zero_stage not in stack.zero_stages
                              or (layout.pp > 1 and layout.pp_schedule not in stack.schedules)):
        est.notes.append(f"{stack.name} on {system.name} does not support this choice "
                         f"(dp_kind {layout.dp_kind}, zero {layout.zero_stage}, schedule {layout.pp_schedule})")
    if layout.offload_layers and not offload_allowed(stack, layout.pp, layout.recompute == "none"):
        est.notes.append(f"{stack.name} on {system.name} does not offload activations with this layout "
                         f"(offload_layers {layout.offload_layers}, pp {layout.pp}, recompute {layout.recompute})")
    if price is None:
        est.notes.append(no_price_note(system))
    return est


def no_price_note(system: System, purchase: str = "on-demand") -> str:
    """Why the cost fields are null: no `purchase` price; the options it does have (`hardware list` shows them,
    so "no public price" beside a listed spot price read as a contradiction)."""
    others = [f"{option} ${q.usd_per_node_hour:.2f}" for option, q in system.prices.quotes.items()
              if option != purchase and q.usd_per_node_hour is not None]
    if not system.prices.quotes:
        return f"no public price for {system.name}: cost fields are null"
    return (f"no {purchase} price for {system.name}: cost fields are null"
            + (f" (it has {', '.join(others)} per node-hour: compare/recommend --purchase)" if others else ""))


# ---- search ---------------------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


# Two layouts whose predicted step times (or costs per token) are within this fraction are a tie for the planner: the
# published layouts of one job measured this close are not ordered by it (benchmarks/planner_accuracy.py's layout
# decisions count pairs only beyond it), and one layout's measured spread across software releases is 2-27%
# (its version-spread floor table); `plan` says so instead of presenting #1 as the answer
TIE_FRACTION = 0.05


def near_ties(candidates: list[Estimate], objective: str = "time") -> list[int]:
    """Ranks (1-based, from 2) of the candidates within TIE_FRACTION of the first by the search's objective."""
    if not candidates:
        return []
    def score(c):
        return c.step_time_s if objective == "time" else (c.cost_usd_per_million_tokens or math.inf)
    best = score(candidates[0])
    return [i for i, c in enumerate(candidates[1:], 2) if score(c) <= best * (1 + TIE_FRACTION)]


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
    """All combinations of the discrete choices that the trainer's rules allow (paratrain.config.rules, the
    planner's view: also what paratrain's runtime does not implement), as arrays."""
    devices = nodes * system.devices_per_node

    def rules_ok(**fields) -> np.ndarray:
        n = np.shape(next(iter(fields.values())))
        base = {"tp": np.ones(n, int), "pp": np.ones(n, int), "cp": np.ones(n, int), "sp": np.zeros(n, bool),
                "schedule": SCHEDULES.index("1f1b"), "virtual_stages": 1, "dp_kind": 0, "zero": 0, "seq": seq,
                "model": model}
        return mask(View(**{**base, **fields}))

    # one-dimensional prefilters by the same rules (the grid is expanded only for what passes)
    divisors = np.array(_divisors(devices))
    tps = [int(t) for t in divisors[rules_ok(tp=divisors)]]
    # any pipeline degree that divides the devices and leaves every stage a layer: uneven counts (126 layers on
    # 32 stages) are split as the runtime splits them (config.pipeline), and the slowest stage sets the pace
    pps = [int(p) for p in divisors[rules_ok(pp=divisors)]]
    cp_arr = np.array([c for c in cp_options if devices % c == 0 or c == 1])
    cps = [int(c) for c in cp_arr[rules_ok(cp=cp_arr)]]
    mbs = [b for b in _divisors(global_batch) if b <= max_microbatch]
    # (schedule, chunks per rank) pairs: codes of SCHEDULES (V schedules: 2 chunks)
    sched_v = [(0, 1), (1, 1)] + [(2, v) for v in (2, 3, 4, 5, 6, 8)] + [(3, 2), (4, 2)]
    # (zero stage, dp kind) pairs (paratrain.config.dp): ddp 0-2, fsdp/hsdp 3 and 2 (reshard_after_forward=false)
    zero_kind = [(0, 0), (1, 0), (2, 0), (3, 1), (3, 2), (2, 1), (2, 2)]
    # (tp, pp, cp) triples that divide the devices and leave a data-parallel degree dividing the global batch,
    # first: the rest of the grid is expanded only for those (uneven pipeline degrees make pp long)
    t3, p3, c3 = (a.ravel() for a in np.meshgrid(np.array(tps), np.array(pps), np.array(cps), indexing="ij"))
    par = t3 * p3 * c3
    keep = (devices % par == 0) & (global_batch % np.maximum(devices // par, 1) == 0)
    combinations = int(t3.size) * len(mbs) * 2 * 3 * len(sched_v) * len(zero_kind)
    t3, p3, c3 = t3[keep], p3[keep], c3[keep]
    # the rules do not depend on recompute: they are evaluated on the grid without it, which is then broadcast
    # over the three recompute choices (in the same order as the full grid)
    # and first on the (tp, pp, cp, microbatch) pairs alone with the least demanding other choices (gpipe, one
    # chunk, no SP, plain DDP): a pair that fails there fails with every choice, so only the rest is expanded
    mb_arr = np.array(mbs)
    pair3, pair_b = (a.ravel() for a in np.meshgrid(np.arange(t3.size), np.arange(mb_arr.size), indexing="ij"))
    pair_dp = devices // (t3[pair3] * p3[pair3] * c3[pair3])
    pairs = np.flatnonzero(rules_ok(tp=t3[pair3], pp=p3[pair3], cp=c3[pair3], dp=pair_dp, microbatch=mb_arr[pair_b],
                                    global_batch=global_batch, schedule=SCHEDULES.index("gpipe")))
    shape5 = (pairs.size, 2, len(sched_v), len(zero_kind))
    pi, sp, sv, zk = (a.ravel() for a in np.meshgrid(*(np.arange(n) for n in shape5), indexing="ij"))
    sv_arr, zk_arr = np.array(sched_v), np.array(zero_kind)
    i3, b_i = pair3[pairs[pi]], pair_b[pairs[pi]]
    tp, pp, cp, b = t3[i3], p3[i3], c3[i3], mb_arr[b_i]
    sched, v, zero, kind = sv_arr[sv, 0], sv_arr[sv, 1], zk_arr[zk, 0], zk_arr[zk, 1]
    dp = devices // (tp * pp * cp)
    ok = mask(View(tp=tp, pp=pp, cp=cp, sp=sp == 1, schedule=sched, virtual_stages=v, dp_kind=kind, zero=zero,
                   seq=seq, model=model, dp=dp, microbatch=b, global_batch=global_batch))
    # search policy, not validity: one stage has no schedule to choose; with one replica the ZeRO choices
    # coincide (keep ddp 0 and 1); HSDP only where it shards inside a node and replicates across nodes
    ok &= np.where(pp == 1, sched == 1, True)
    ok &= (dp * cp > 1) | (zk == 1) | (zk == 0)
    local_dp = system.devices_per_node // tp  # HSDP shards over dp x cp ranks inside a node, replicas across nodes
    ok &= (kind != 2) | ((local_dp >= 2) & (dp * cp > local_dp))
    if stack is not None:
        ok &= np.isin(zero, stack.zero_stages) & np.isin(kind, [DP_KINDS.index(k) for k in stack.dp_kinds])
        ok &= (pp == 1) | np.isin(sched, [SCHEDULES.index(k) for k in stack.schedules])
    rc_ok = np.ones(3, bool)
    named = {"tp": tp, "pp": pp, "cp": cp, "dp": dp, "microbatch": b, "sp": sp, "recompute": None, "pp_schedule": sched,
             "virtual_stages": v, "zero_stage": zero, "dp_kind": kind, "ep": None, "etp": None}
    later = {}  # constraints on the expert axes, applied once they exist
    for key, allowed in (constraints or {}).items():
        if key not in named:
            raise ValueError(f"constraint '{key}': unknown; allowed: {', '.join(named)}")
        codes = {"recompute": RECOMPUTE, "pp_schedule": SCHEDULES, "dp_kind": DP_KINDS}.get(key)
        values = [codes.index(a) if codes else int(a) for a in allowed]
        if key == "recompute":
            rc_ok &= np.isin(np.arange(3), values)
        elif key in ("ep", "etp"):
            later[key] = values
        else:
            ok &= np.isin(named[key], values)
    ok6 = ok.reshape(shape5)[:, :, None, :, :] & rc_ok[None, None, :, None, None]
    pi, sp, rc, sv, zk = np.unravel_index(np.flatnonzero(ok6), shape5[:2] + (3,) + shape5[2:])
    i3, b_i = pair3[pairs[pi]], pair_b[pairs[pi]]
    tp, pp, cp = t3[i3], p3[i3], c3[i3]
    arrays = (tp, pp, cp, devices // (tp * pp * cp), mb_arr[b_i], sp == 1, rc, sv_arr[sv, 0], sv_arr[sv, 1],
              zk_arr[zk, 0], zk_arr[zk, 1])
    *arrays, ep, etp, ok = expert_axes(model, arrays, np.ones(tp.shape, bool))  # MoE: every valid (ep, etp)
    for key, values in later.items():
        ok = ok & np.isin({"ep": ep, "etp": etp}[key], values)
    sel = np.flatnonzero(ok)
    keys = ("tp", "pp", "cp", "dp", "microbatch", "sp", "recompute", "pp_schedule", "virtual_stages", "zero_stage",
            "dp_kind")
    return {**{k: a[sel] for k, a in zip(keys, arrays, strict=True)}, "ep": ep[sel], "etp": etp[sel],
            "raw": np.int64(combinations)}


def _with_mlp_recompute(model, system, seq, global_batch, opts, stack, grid, res):
    """(grid, results, recompute_mlp flags): for a stack whose selective recompute can also replay the MLP block
    (plan.stacks.MLP_RECOMPUTE_STACKS, NxD), its selective layouts once more with Options.recompute_mlp, appended."""
    from paratrain.plan.stacks import MLP_RECOMPUTE_STACKS

    n = grid["tp"].size
    sel = np.flatnonzero(grid["recompute"] == RECOMPUTE.index("selective"))
    if stack not in MLP_RECOMPUTE_STACKS or opts.recompute_mlp or not sel.size:
        return grid, res, np.zeros(n, bool)
    sub = {k: v[sel] for k, v in grid.items()}
    more = evaluate(model, system, seq, global_batch, opts=replace(opts, recompute_mlp=True), split="auto", **sub)
    join = lambda a, b, m: np.concatenate([np.broadcast_to(np.asarray(a), (n,)), np.broadcast_to(np.asarray(b), (m,))])  # noqa: E731
    grid = {k: np.concatenate([grid[k], sub[k]]) for k in grid}
    res = {k: join(res[k], more[k], sel.size) for k in res}
    return grid, res, np.concatenate([np.zeros(n, bool), np.ones(sel.size, bool)])


def _with_offload(model, system, seq, global_batch, opts, grid, res, mlp, stack: Stack | None = None):
    """(grid, results, recompute_mlp flags) with, where the system's host link is in the catalog, every layout that
    does not fit once more with the fewest offloaded blocks per stage that make it fit (plan.memory's
    offload_min_layers; parallel.offload_layers), appended: 0 and that one count are what is searched. Fully
    recomputed layouts are not offloaded (config.rules offload_full_recompute), nor layouts the searched software
    cannot offload (plan.stacks.offload_allowed: torchtitan and DeepSpeed keep activations on the device,
    Megatron-Core offloads only without pipeline parallelism and recompute)."""
    from paratrain.plan.stacks import offload_allowed

    sel = np.flatnonzero(~np.asarray(res["fits"], bool) & np.isfinite(res["offload_min_layers"])
                         & (grid["recompute"] != RECOMPUTE.index("full"))
                         & offload_allowed(stack, grid["pp"], grid["recompute"] == RECOMPUTE.index("none")))
    if system.host_link_gbytes_per_s is None or not sel.size:
        return grid, res, mlp
    n = grid["tp"].size
    sub = {k: v[sel] for k, v in grid.items()}
    sub["offload"] = np.asarray(res["offload_min_layers"])[sel]
    more = {}
    for flag in (False, True):  # each with its own Options (MLP replayed or not)
        rows = np.flatnonzero(mlp[sel] == flag)
        if rows.size:
            part = evaluate(model, system, seq, global_batch, split="auto",
                            opts=replace(opts, recompute_mlp=opts.recompute_mlp or flag),
                            **{k: v[rows] for k, v in sub.items()})
            for k, v in part.items():
                more.setdefault(k, np.zeros(sel.size, np.asarray(v).dtype))[rows] = v
    join = lambda a, b: np.concatenate([np.broadcast_to(np.asarray(a), (n,)), np.broadcast_to(np.asarray(b), (sel.size,))])  # noqa: E731
    return ({k: np.concatenate([grid[k], sub[k]]) for k in grid}, {k: join(res[k], more[k]) for k in res},
            np.concatenate([mlp, mlp[sel]]))


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
        # the note that names the prices it does have (trn2.48xlarge lists a spot price: "no public price" beside
        # it in `hardware list` read as a contradiction)
        raise ValueError(f"objective = cost: {no_price_note(system).replace(': cost fields are null', '')}; "
                         f"allowed: --objective time, or a system with an on-demand price")
    from paratrain.plan.stacks import STACKS, check_stack

    if stack is not None:
        check_stack(stack)
    opts = options or Options.for_system(system, stack=stack, system_stack=not any_stack)
    check_precision(system, opts)
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
        grid["offload"] = np.zeros(grid["tp"].shape, int)
        grids.append(grid)
    grid = {k: np.concatenate([g[k] for g in grids]) for k in grids[0]}
    res = evaluate(model, system, seq, global_batch, opts=opts, split="auto", **grid)
    grid, res, mlp = _with_mlp_recompute(model, system, seq, global_batch, opts, stack, grid, res)
    grid, res, mlp = _with_offload(model, system, seq, global_batch, opts, grid, res, mlp, searched)
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
    balanced = {"step_time_s": np.zeros(order.size)}
    for flag in (False, True):  # each ranked layout with its own Options (MLP replayed or not)
        rows = np.flatnonzero(mlp[order] == flag)
        if rows.size:
            balanced["step_time_s"][rows] = evaluate(
                model, system, seq, global_batch, opts=replace(opts, recompute_mlp=opts.recompute_mlp or flag),
                **{k: v[order[rows]] for k, v in grid.items()})["step_time_s"]
    candidates = []
    for rank, i in enumerate(order):
        layout = Layout(tp=int(grid["tp"][i]), pp=int(grid["pp"][i]), dp=int(grid["dp"][i]), cp=int(grid["cp"][i]),
                        sp=bool(grid["sp"][i]), microbatch=int(grid["microbatch"][i]),
                        recompute=RECOMPUTE[grid["recompute"][i]], pp_schedule=SCHEDULES[grid["pp_schedule"][i]],
                        virtual_stages=int(grid["virtual_stages"][i]), zero_stage=int(grid["zero_stage"][i]),
                        dp_kind=DP_KINDS[grid["dp_kind"][i]], pp_layers="auto", ep=int(grid["ep"][i]),
                        etp=int(grid["etp"][i]), offload_layers=int(grid["offload"][i]))
        row = {k: float(np.asarray(v)[i]) if np.ndim(v) else float(v) for k, v in res.items()}
        layout = replace(layout, pp_layers=_concrete_split(model, layout, row))
        even = layout.pp_layers is None or is_balanced(layout.pp_layers, model.layers)
        est = _to_estimate(model, system, int(grid["nodes"][i]), seq, global_batch, layout, row, train_tokens,
                           None if even else float(balanced["step_time_s"][rank]), searched)
        est.recompute_mlp = bool(mlp[i]) or (opts.recompute_mlp and layout.recompute == "selective")
        candidates.append(est)
    return SearchResult(candidates=candidates, combinations=combinations, valid=int(grid["tp"].size),
                        fitting=int(fits.sum()), seconds=elapsed)
