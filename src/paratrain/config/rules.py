"""Every layout rule, written once, as a predicate that works on one layout (scalars: the config loader, the
launcher, `estimate`) or on many at once (numpy arrays: the planner's search grid), plus the one-line error for
a layout that breaks it (torch-free).

A rule's `ok(v)` reads a `View`: the parallel degrees, the schedule, the DP kind and canonical ZeRO stage
(paratrain.config.dp.zero_stage_of), the batch numbers and the model shape. `needs_dp` rules wait for the
data-parallel size (known once the world size is), `needs_batch` rules the global batch too; `runtime_only` rules
are what paratrain's runtime does not implement (yet) although the planner models it (ZeRO-1/2 on DDP, tied
embeddings under PP, hsdp with ep across replicas).

Expert parallelism (parallel.ep / parallel.etp, MoE models): the one fold of torchtitan's and Megatron-Core's "MoE
parallel folding" (Liu et al. 2025), for the trainer and the planner alike. The dp x cp x tp ranks of one pipeline
stage, in mesh order (tp innermost), are refolded for the routed experts as edp x ep x etp (etp innermost): ep
consecutive groups of etp ranks exchange tokens, each holding E/ep experts (each split etp ways); edp replicas of
every expert shard. etp = tp: experts TP-sharded like the dense MLP, ep borrows cp and dp ranks; etp = 1 (the
default, torchtitan's expert_tensor_parallel_degree = 1): experts keep their full width, ep also borrows tp ranks
and each tp rank routes its 1/tp of the tokens. Rules: ep divides num_experts and dp*cp*tp/etp, etp in {1, tp}
divides moe_ffn_hidden; ep = etp = 1 without experts.
Predicates use numpy's element-wise functions only (no `and`/`or`/`if`), so one definition serves both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from paratrain.config.names import (
    DP_KINDS,
    MULTI_STAGE_SCHEDULES,
    PP_SCHEDULES,
    RECOMPUTE,
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
)
from paratrain.config.ranks import DEFAULT_RANK_ORDER, order_dims, valid_order

_and, _or, _not = np.logical_and, np.logical_or, np.logical_not


@dataclass
class View:
    """One layout (scalars) or many (arrays of one length). zero: the canonical ZeRO stage; dp: None = unknown."""

    tp: object
    pp: object
    cp: object
    sp: object
    schedule: object  # a name of PP_SCHEDULES, or (arrays) indices into it
    virtual_stages: object
    dp_kind: object  # a name of DP_KINDS, or (arrays) indices into it
    zero: object
    seq: object
    model: object  # paratrain.model.config.ModelConfig
    dp: object = None
    microbatch: object = 1
    global_batch: object = None
    ep: object = 1
    etp: object = 1
    dp_replicate: object = 1  # hsdp's replica groups (dp = dp_replicate x dp_shard)
    rank_order: str = DEFAULT_RANK_ORDER  # one for all layouts of a View (paratrain.config.ranks)
    offload: object = 0  # parallel.offload_layers: blocks per stage whose activations wait in host memory
    recompute: object = "none"  # a name of RECOMPUTE, or (arrays) indices into it

    @property
    def chunks(self):
        """Model chunks per pipeline rank: 1 (gpipe, 1f1b), virtual_stages (interleaved_1f1b), 2 (V schedules)."""
        single = _is(self, SINGLE_STAGE_SCHEDULES)
        return np.where(single, 1, np.where(_is(self, V_SCHEDULES), 2, self.virtual_stages))

    @property
    def microbatches(self):
        """Microbatches per step on one dp rank (0 where the batch does not divide: a rule reports that)."""
        per_rank = self.global_batch // np.maximum(self.dp, 1)
        return per_rank // np.maximum(self.microbatch, 1)


@dataclass(frozen=True)
class Rule:
    name: str
    ok: Callable
    message: Callable
    needs_dp: bool = False
    runtime_only: bool = False
    needs_batch: bool = False


def _divides(tp, n):
    return n % np.maximum(tp, 1) == 0


def _pipelined(v):
    return v.pp > 1


def fewest_stage_layers(stage, stages):
    """The fewest transformer layers pipeline stage `stage` of `stages` may hold: 0 for the first and the last
    stage (they still run the embedding, or the norm, the output head and the loss: Llama 3 405B's pipeline left
    its first chunk with only the embedding and its last with only the output and the loss, Dubey et al. 2024
    sec. 3.3.2), 1 for every inner stage (a stage with no work). The one rule behind both the stage count
    (`fewest_layers`, rule stages_le_layers) and explicit splits (config.pipeline.check_pp_layers)."""
    stage, stages = np.asarray(stage), np.asarray(stages)
    return np.where((stage == 0) | (stage == stages - 1), 0, 1)


def fewest_layers(stages):
    """The fewest layers that fill `stages` pipeline stages: the sum of fewest_stage_layers over them (every
    inner stage one layer, the two ends none), so 126 layers fill 16 x 8 = 128 stages as [0, 1 x 126, 0]."""
    return np.maximum(np.asarray(stages) - 2, 0)


def _coded(value, names: tuple, table: tuple):
    """value in names, for a name (one layout) or an array of indices into `table` (the planner's grid: small
    integer codes instead of strings, so a grid of millions of layouts stays cheap)."""
    if isinstance(value, str):
        return value in names
    return np.isin(value, [table.index(n) for n in names])


def _is(v, names):
    return _coded(v.schedule, tuple(names), PP_SCHEDULES)


def _ddp(v):
    return _coded(v.dp_kind, ("ddp",), DP_KINDS)


def _tp_divides(key: str, attr: str) -> Rule:
    def ok(v):
        return _divides(v.tp, getattr(v.model, attr))

    def message(v):
        n = getattr(v.model, attr)
        return f"parallel.tp={v.tp} must divide model.{key}={n}; allowed tp: divisors of {n}"

    return Rule(f"tp_divides_{key}", ok, message)


def _kind_zero_ok(v):
    ddp = _and(_ddp(v), np.isin(v.zero, (0, 1, 2)))
    sharded = _and(_not(_ddp(v)), np.isin(v.zero, (2, 3)))
    # hsdp with zero_stage 1: the optimizer state sharded inside a shard group, replicated across the groups
    # (InternLM's HybridZeroOptimizer, zero1 = the shard group; paratrain.config.dp)
    hybrid_zero1 = _and(_coded(v.dp_kind, ("hsdp",), DP_KINDS), v.zero == 1)
    return _or(_or(ddp, sharded), hybrid_zero1)


def _interleaved_rounds_ok(v):
    m = v.microbatches
    rounds = np.maximum(m // np.maximum(v.pp, 1), 1)
    return m % rounds == 0


RULES: tuple[Rule, ...] = (
    # -- tensor / sequence parallelism ------------------------------------------------------------------------
    Rule("sp_needs_tp", lambda v: _or(_not(v.sp), v.tp > 1),
         lambda v: "parallel.sp=true needs parallel.tp > 1 (sequence parallelism shards the TP regions)"),
    *(_tp_divides(key, attr) for key, attr in (("heads", "heads"), ("ffn_hidden", "ffn"), ("vocab", "vocab"))),
    Rule("tp_divides_shared_experts",
         lambda v: _or(v.model.shared_experts == 0, _divides(v.tp, v.model.shared_experts * v.model.moe_ffn)),
         lambda v: f"parallel.tp={v.tp} must divide the shared experts' width model.shared_experts x moe_ffn_hidden = "
                   f"{v.model.shared_experts * v.model.moe_ffn} (split over tp like the dense MLP); allowed: tp "
                   f"dividing {v.model.shared_experts * v.model.moe_ffn}"),
    Rule("tp_kv_heads", lambda v: _or(_divides(v.tp, v.model.n_kv_heads), v.tp % v.model.n_kv_heads == 0),
         lambda v: f"parallel.tp={v.tp} and model.kv_heads={v.model.n_kv_heads}: tp must divide kv_heads, or "
                   f"kv_heads must divide tp (then each kv head is replicated on tp/kv_heads ranks)"),
    Rule("sp_seq", lambda v: _or(_not(_and(v.sp, v.tp > 1)), _divides(v.tp, v.seq)),
         lambda v: f"parallel.sp=true: train.seq_len={v.seq} must be divisible by parallel.tp={v.tp}"),
    # -- context parallelism ----------------------------------------------------------------------------------
    Rule("cp_seq", lambda v: _or(v.cp == 1, v.seq % (2 * v.cp) == 0),
         lambda v: f"parallel.cp={v.cp}: train.seq_len={v.seq} must be divisible by 2*cp={2 * v.cp} "
                   f"(the zig-zag layout cuts the sequence into 2*cp equal chunks)"),
    Rule("cp_sp_seq", lambda v: _or(_or(v.cp == 1, _not(v.sp)), _divides(v.tp, v.seq // v.cp)),
         lambda v: f"parallel.cp={v.cp} with parallel.sp=true: the local sequence train.seq_len/cp="
                   f"{v.seq // v.cp} must be divisible by parallel.tp={v.tp}"),
    # -- data parallelism (paratrain.config.dp) ---------------------------------------------------------------
    Rule("dp_kind_zero", _kind_zero_ok,
         lambda v: f"parallel.zero_stage={v.zero} with parallel.dp_kind='{v.dp_kind}': ddp takes 0-2 (replicated "
                   f"parameters), fsdp/hsdp take 2 (reshard_after_forward=false) or 3 (fully sharded), hsdp also 1 "
                   f"(the optimizer state sharded inside each shard group)"),
    Rule("hsdp_sharded_optimizer", lambda v: _or(_not(_coded(v.dp_kind, ("hsdp",), DP_KINDS)), v.zero != 1),
         lambda v: "parallel.zero_stage=1 with parallel.dp_kind='hsdp' (ZeRO-1 inside each shard group, InternLM's "
                   "HybridZeroOptimizer) is not implemented by the runtime; allowed: zero_stage 2 or 3 with hsdp",
         runtime_only=True),
    Rule("ddp_sharded_optimizer", lambda v: _or(_not(_ddp(v)), v.zero == 0),
         lambda v: f"parallel.zero_stage={v.zero} with parallel.dp_kind='ddp' (ZeRO-{v.zero} on replicated "
                   f"parameters: DeepSpeed, Megatron's distributed optimizer) is not implemented by the runtime; "
                   f"allowed: zero_stage=0 with ddp, or dp_kind='fsdp' with zero_stage=2 (FSDP2 "
                   f"reshard_after_forward=false: the same sharded gradients and optimizer state) or 3",
         runtime_only=True),
    Rule("v_schedule_resharding",
         lambda v: _not(_and(_and(_pipelined(v), _is(v, V_SCHEDULES)), _and(_not(_ddp(v)), v.zero == 3))),
         lambda v: f"parallel.pp_schedule='{v.schedule}' with parallel.dp_kind='{v.dp_kind}' and "
                   f"reshard_after_forward=true / zero_stage=3: the zero-bubble weight-gradient pass needs the parameters "
                   f"gathered from forward to backward; allowed: reshard_after_forward=false / zero_stage=2 (the "
                   f"default under this schedule), dp_kind='ddp', or pp_schedule gpipe / 1f1b / interleaved_1f1b"),
    # -- pipeline stages (paratrain.config.pipeline) ----------------------------------------------------------
    Rule("single_stage_chunks", lambda v: _or(_not(_and(_pipelined(v), _is(v, SINGLE_STAGE_SCHEDULES))),
                                              v.virtual_stages == 1),
         lambda v: f"parallel.virtual_stages={v.virtual_stages} with parallel.pp_schedule='{v.schedule}': "
                   f"'{v.schedule}' runs one stage per rank; allowed: virtual_stages=1, or "
                   f"pp_schedule='interleaved_1f1b' for several chunks per rank"),
    Rule("interleaved_chunks", lambda v: _or(_not(_and(_pipelined(v), _is(v, ("interleaved_1f1b",)))),
                                             v.virtual_stages >= 2),
         lambda v: "parallel.virtual_stages=1 with parallel.pp_schedule='interleaved_1f1b': interleaving "
                   "needs several chunks per rank; allowed: virtual_stages >= 2 (or pp_schedule='1f1b')"),
    Rule("v_chunks", lambda v: _or(_not(_and(_pipelined(v), _is(v, V_SCHEDULES))), np.isin(v.virtual_stages, (1, 2))),
         lambda v: f"parallel.virtual_stages={v.virtual_stages} with parallel.pp_schedule='{v.schedule}': the V "
                   f"schedules place exactly 2 chunks per rank; allowed: virtual_stages 1 (means 2) or 2"),
    Rule("stages_le_layers", lambda v: _or(_not(_pipelined(v)), fewest_layers(v.pp * v.chunks) <= v.model.layers),
         lambda v: f"parallel.pp={v.pp} x {v.chunks} chunk(s) per rank = {v.pp * v.chunks} pipeline stages need "
                   f"at least {fewest_layers(v.pp * v.chunks)} layers (one per inner stage; the first and last may "
                   f"hold none) but the model has {v.model.layers}; allowed: stages <= model.layers + 2 (a smaller "
                   f"pp or virtual_stages)"),
    # -- activation offloading (parallel.offload_layers) ------------------------------------------------------
    Rule("offload_stage_layers", lambda v: v.offload <= stage_layers(v),
         lambda v: f"parallel.offload_layers={v.offload}: more blocks than a pipeline stage holds (model.layers="
                   f"{v.model.layers} over pp={v.pp} x {v.chunks} chunk(s) per rank: {stage_layers(v)} per stage); "
                   f"allowed: 0 to {stage_layers(v)}"),
    Rule("offload_full_recompute", lambda v: _or(v.offload == 0, _not(_coded(v.recompute, ("full",), RECOMPUTE))),
         lambda v: f"parallel.offload_layers={v.offload} with parallel.recompute='full': a fully recomputed block "
                   f"keeps only its input, held by the checkpoint itself, so there is nothing to move to host memory; "
                   f"allowed: offload_layers=0, or recompute 'none' or 'selective'"),
    # -- planner-only model shapes (DeepSeek-V3): the trainer's reference modules have no MLA and no MTP ----------
    Rule("model_mla", lambda v: getattr(v.model, "mla", None) is None,
         lambda v: "model.mla is set: multi-head latent attention is a planner-only shape (plan.layer times it as "
                   "Megatron-Core runs it); paratrain's trainer implements grouped-query attention only; allowed: "
                   "mla unset", runtime_only=True),
    Rule("model_mtp", lambda v: getattr(v.model, "mtp_layers", 0) == 0,
         lambda v: f"model.mtp_layers={v.model.mtp_layers}: multi-token prediction is a planner-only shape (timed on "
                   f"the last pipeline stage); paratrain's trainer has no MTP module; allowed: mtp_layers=0",
         runtime_only=True),
    Rule("model_router_groups", lambda v: getattr(v.model, "router_groups", 1) == 1,
         lambda v: f"model.router_groups={v.model.router_groups}: group-limited routing is a planner-only shape (the "
                   f"nodes a token's dispatch reaches, plan.moe.node_hit_fraction); paratrain's router takes a plain "
                   f"top-k; allowed: router_groups=1", runtime_only=True),
    Rule("pp_tied_embeddings", lambda v: _or(_not(_pipelined(v)), not v.model.tie_embeddings),
         lambda v: "model.tie_embeddings=true with parallel.pp > 1: the embedding and the output head sit "
                   "on different stages; allowed: tie_embeddings=false for pipeline parallelism", runtime_only=True),
    # -- expert parallelism (MoE; the fold is in the module docstring) ------------------------------------------
    Rule("ep_needs_experts", lambda v: _or(v.model.num_experts > 0, _and(v.ep == 1, v.etp == 1)),
         lambda v: f"parallel.ep={v.ep}, parallel.etp={v.etp} with model.num_experts=0: expert parallelism needs a "
                   f"mixture-of-experts model; allowed: ep = etp = 1"),
    Rule("etp_one_or_tp", lambda v: _or(v.model.num_experts == 0, _etp_valid(v)),
         lambda v: f"parallel.etp={v.etp} with parallel.tp={v.tp}: allowed: etp=1 (experts keep their full width, "
                   f"ep borrows the tp ranks) or "
                   + (f"etp={v.tp} = tp (experts split over tp like the dense MLP)" if v.tp > 1 else
                      "etp = tp with parallel.tp > 1 (experts split over tp like the dense MLP)")),
    Rule("ep_divides_experts", lambda v: _or(v.model.num_experts == 0, v.model.num_experts % np.maximum(v.ep, 1) == 0),
         lambda v: f"parallel.ep={v.ep} must divide model.num_experts={v.model.num_experts}; allowed: "
                   f"{_divisors(v.model.num_experts)}"),
    Rule("etp_divides_moe_ffn", lambda v: _or(v.model.num_experts == 0, v.model.moe_ffn % np.maximum(v.etp, 1) == 0),
         lambda v: f"parallel.etp={v.etp} must divide model.moe_ffn_hidden={v.model.moe_ffn} (each expert is split "
                   f"over etp ranks); allowed: etp=1, or a tp dividing {v.model.moe_ffn}"),
    Rule("ep_fold", lambda v: _or(_not(_etp_valid(v)), _stage_ranks(v) % np.maximum(v.ep, 1) == 0),
         lambda v: f"parallel.ep={v.ep} must divide the ranks of a pipeline stage refolded for the experts, "
                   f"dp*cp*tp/etp = {v.dp}*{v.cp}*{v.tp}/{v.etp} = {_stage_ranks(v)}; allowed: divisors of "
                   f"{_stage_ranks(v)} (that also divide model.num_experts)", needs_dp=True),
    Rule("etp_split_seq", lambda v: _or(_or(v.model.num_experts == 0, v.tp == 1),
                                        _or(v.etp != 1, _divides(v.tp, v.seq // np.maximum(v.cp, 1)))),
         lambda v: f"parallel.etp=1 with parallel.tp={v.tp}: each tp rank routes its slice of the sequence, so "
                   f"train.seq_len/cp = {v.seq // v.cp} must be divisible by tp={v.tp}; allowed: such a seq_len, "
                   f"or etp={v.tp}"),
    # what paratrain's runtime does not run with experts (the planner models it)
    # hsdp: ep borrows ranks of one shard group, never across replicas (torchtitan's dp_shard_in_ep, mesh.py)
    Rule("ep_hsdp", lambda v: _or(_not(_coded(v.dp_kind, ("hsdp",), DP_KINDS)), _shard_ranks(v) % np.maximum(v.ep, 1) == 0),
         lambda v: f"parallel.ep={v.ep} with parallel.dp_kind='hsdp': ep must divide the ranks of one shard group "
                   f"refolded for the experts, dp/dp_replicate*cp*tp/etp = {_shard_ranks(v)}; allowed: divisors of "
                   f"{_shard_ranks(v)}", needs_dp=True, runtime_only=True),
    # -- rank order (paratrain.config.ranks) -------------------------------------------------------------------
    Rule("rank_order_names", lambda v: valid_order(v.rank_order),
         lambda v: f"parallel.rank_order='{v.rank_order}': allowed: tp, cp, dp, pp each once, '-'-separated, "
                   f"innermost first, tp first (TP exchanges activations in every layer on the compute's path and "
                   f"keeps the fastest links), e.g. {DEFAULT_RANK_ORDER} (the default; Megatron-Core's, torchtitan's) "
                   f"or tp-cp-pp-dp (Megatron's --use-tp-pp-dp-mapping, Llama 3's [TP, CP, PP, DP])"),
    Rule("rank_order_experts", lambda v: _or(v.model.num_experts == 0, _default_order(v)),
         lambda v: f"parallel.rank_order='{v.rank_order}' with model.num_experts={v.model.num_experts}: the "
                   f"experts refold a stage's dp x cp x tp ranks as one block, pp outside it (Megatron-Core also "
                   f"refuses pp inside the expert groups); allowed: rank_order='{DEFAULT_RANK_ORDER}'"),
    Rule("rank_order_hsdp", lambda v: _or(_or(_not(_coded(v.dp_kind, ("hsdp",), DP_KINDS)), v.cp == 1),
                                          _dp_cp_adjacent(v)),
         lambda v: f"parallel.rank_order='{v.rank_order}' with parallel.dp_kind='hsdp' and parallel.cp={v.cp}: "
                   f"HSDP shards over dp_shard x cp, which this order splits apart (another dimension between dp "
                   f"and cp); allowed: an order with dp next to cp (e.g. {DEFAULT_RANK_ORDER}), or cp=1"),
    # -- batch and microbatches (need dp) ---------------------------------------------------------------------
    Rule("global_batch_dp", lambda v: v.global_batch % np.maximum(v.dp, 1) == 0,
         lambda v: f"train.global_batch={v.global_batch} must be divisible by the data-parallel size {v.dp}; "
                   f"allowed: a multiple of {v.dp}", needs_dp=True, needs_batch=True),
    Rule("microbatch_divides", lambda v: (v.global_batch // np.maximum(v.dp, 1)) % v.microbatch == 0,
         lambda v: f"train.microbatch={v.microbatch} must divide the per-rank batch global_batch/dp = "
                   f"{v.global_batch // v.dp}; allowed: "
                   f"{', '.join(str(d) for d in range(1, v.global_batch // v.dp + 1) if v.global_batch // v.dp % d == 0)}",
         needs_dp=True, needs_batch=True),
    Rule("1f1b_microbatches", lambda v: _or(_not(_and(_pipelined(v), _is(v, ("1f1b",)))), v.microbatches >= v.pp),
         lambda v: f"{_where(v)}: 1f1b needs microbatches >= pp={v.pp}; allowed: a larger global_batch or a "
                   f"smaller microbatch, or pp_schedule='gpipe'", needs_dp=True, needs_batch=True),
    Rule("interleaved_microbatches", lambda v: _or(_not(_and(_pipelined(v), _is(v, ("interleaved_1f1b",)))),
                                                   v.microbatches >= v.pp),
         lambda v: f"{_where(v)}: interleaved_1f1b needs microbatches >= pp={v.pp}; allowed: a larger "
                   f"global_batch or a smaller microbatch, or pp_schedule='gpipe'", needs_dp=True, needs_batch=True),
    Rule("interleaved_rounds", lambda v: _or(_not(_and(_pipelined(v), _is(v, ("interleaved_1f1b",)))),
                                             _interleaved_rounds_ok(v)),
         lambda v: f"{_where(v)}: interleaved_1f1b runs microbatches in rounds of m // pp = "
                   f"{v.microbatches // v.pp}; allowed: microbatch counts divisible by {v.microbatches // v.pp} "
                   f"(e.g. a multiple of pp={v.pp})", needs_dp=True, needs_batch=True),
    Rule("v_microbatches", lambda v: _or(_not(_and(_pipelined(v), _is(v, V_SCHEDULES))), v.microbatches >= 2 * v.pp),
         lambda v: f"{_where(v)}: {v.schedule} needs microbatches >= 2*pp = {2 * v.pp} (its V holds 2 stages per "
                   f"rank); allowed: a larger global_batch or a smaller microbatch", needs_dp=True, needs_batch=True),
)


def _default_order(v) -> bool:
    return order_dims(v.rank_order) == order_dims(DEFAULT_RANK_ORDER)


def _dp_cp_adjacent(v) -> bool:
    dims = order_dims(v.rank_order)
    return "dp" in dims and "cp" in dims and abs(dims.index("dp") - dims.index("cp")) == 1


def stage_layers(v):
    """The layers of one pipeline stage (model chunk) of the runtime's balanced split, rounded up: the most
    parallel.offload_layers may name (a stage holding fewer offloads all of its blocks)."""
    stages = np.where(v.pp > 1, v.pp * v.chunks, 1)  # one stage without a pipeline, whatever the schedule says
    return -(-v.model.layers // stages)


def _etp_valid(v):
    return _or(v.etp == 1, v.etp == v.tp)


def _stage_ranks(v):
    """The dp x cp x tp ranks of one pipeline stage over etp: what ep must divide."""
    return v.dp * v.cp * v.tp // np.maximum(v.etp, 1)


def edp_degree(tp, cp, dp, ep, etp):
    """Expert data parallelism: the replicas (or FSDP shards) of each expert shard, tp*cp*dp / (ep*etp) by the
    fold (at least 1; scalars or arrays, as float)."""
    return np.maximum(1.0, np.asarray(tp, dtype=float) * cp * dp / (np.asarray(ep, dtype=float) * etp))


def _shard_ranks(v):
    """hsdp: the ranks of one shard group (dp / dp_replicate x cp x tp) over etp."""
    return _stage_ranks(v) // np.maximum(v.dp_replicate, 1)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _not_yet(v, what: str, allowed: str) -> str:
    return (f"{what} with model.num_experts={v.model.num_experts}: not implemented by paratrain's runtime for "
            f"mixture-of-experts models yet (the planner models it; docs/moe.md); allowed: {allowed}")


def expert_view(model, tp, cp, dp, ep, etp, sp=False, dp_kind="fsdp") -> View:
    """A View for the expert-parallel rules alone (the planner's (ep, etp) axes; `check(..., groups=EXPERT)`):
    the fields those rules do not read hold neutral values."""
    return View(tp=tp, pp=1, cp=cp, sp=sp, schedule="1f1b", virtual_stages=1, dp_kind=dp_kind, zero=3, seq=0,
                model=model, dp=dp, ep=ep, etp=etp)


EXPERT = ("ep", "etp")  # the groups of the expert-parallel rules


def _where(v: View) -> str:
    return (f"parallel.pp_schedule='{v.schedule}' with {v.microbatches} microbatches (train.global_batch="
            f"{v.global_batch} / (dp={v.dp} x train.microbatch={v.microbatch}))")


def _applies(rule: Rule, v: View, runtime: bool, groups) -> bool:
    if rule.runtime_only and not runtime:
        return False
    if (rule.needs_dp and v.dp is None) or (rule.needs_batch and v.global_batch is None):
        return False
    return groups is None or rule.name.split("_")[0] in groups or rule.name in groups


def check(v: View, runtime: bool = True, groups=None) -> None:
    """One layout: raise the first broken rule's error (ValueError). runtime=False: the planner's view (it models
    what the runtime does not implement). groups: only rules whose name starts with one of these words."""
    for rule in RULES:
        if _applies(rule, v, runtime, groups) and not bool(rule.ok(v)):
            raise ValueError(rule.message(v))


def mask(v: View, runtime: bool = False, groups=None):
    """Many layouts (arrays): True where every rule (of `groups`, as in `check`) holds."""
    ok = np.ones(np.broadcast(v.tp, v.cp, v.ep, v.etp).shape, bool)
    for rule in RULES:
        if _applies(rule, v, runtime, groups):
            ok &= np.asarray(rule.ok(v), bool)
    return ok


__all__ = ["EXPERT", "MULTI_STAGE_SCHEDULES", "RULES", "Rule", "View", "check", "expert_view", "mask"]
