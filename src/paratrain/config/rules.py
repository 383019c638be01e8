"""Every layout rule, written once, as a predicate that works on one layout (scalars: the config loader, the
launcher, `estimate`) or on many at once (numpy arrays: the planner's search grid), plus the one-line error for
a layout that breaks it (torch-free).

A rule's `ok(v)` reads a `View`: the parallel degrees, the schedule, the DP kind and canonical ZeRO stage
(paratrain.config.dp.zero_stage_of), the batch numbers and the model shape. `needs_dp` rules wait for the
data-parallel size (known once the world size is); `runtime_only` rules are what paratrain's runtime does not
implement (yet) although the planner models it (ZeRO-1/2 on DDP, tied embeddings under PP). The expert-parallel
rules (parallel.ep / etp) are paratrain.config.layout.check_expert_layout's (the planner has its own EP view:
plan/moe.py).
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
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
)

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


def _divides(tp, n):
    return n % np.maximum(tp, 1) == 0


def _pipelined(v):
    return v.pp > 1


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
    return _or(ddp, sharded)


def _interleaved_rounds_ok(v):
    m = v.microbatches
    rounds = np.maximum(m // np.maximum(v.pp, 1), 1)
    return m % rounds == 0


RULES: tuple[Rule, ...] = (
    # -- tensor / sequence parallelism ------------------------------------------------------------------------
    Rule("sp_needs_tp", lambda v: _or(_not(v.sp), v.tp > 1),
         lambda v: "parallel.sp=true needs parallel.tp > 1 (sequence parallelism shards the TP regions)"),
    *(_tp_divides(key, attr) for key, attr in (("heads", "heads"), ("ffn_hidden", "ffn"), ("vocab", "vocab"))),
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
                   f"parameters), fsdp/hsdp take 2 (reshard_after_forward=false) or 3 (fully sharded)"),
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
    Rule("stages_le_layers", lambda v: _or(_not(_pipelined(v)), v.pp * v.chunks <= v.model.layers),
         lambda v: f"parallel.pp={v.pp} x {v.chunks} chunk(s) per rank = {v.pp * v.chunks} pipeline stages, but "
                   f"the model has {v.model.layers} layers; allowed: stages <= model.layers (a smaller pp or "
                   f"virtual_stages)"),
    Rule("pp_tied_embeddings", lambda v: _or(_not(_pipelined(v)), not v.model.tie_embeddings),
         lambda v: "model.tie_embeddings=true with parallel.pp > 1: the embedding and the output head sit "
                   "on different stages; allowed: tie_embeddings=false for pipeline parallelism", runtime_only=True),
    # -- batch and microbatches (need dp) ---------------------------------------------------------------------
    Rule("global_batch_dp", lambda v: v.global_batch % np.maximum(v.dp, 1) == 0,
         lambda v: f"train.global_batch={v.global_batch} must be divisible by the data-parallel size {v.dp}; "
                   f"allowed: a multiple of {v.dp}", needs_dp=True),
    Rule("microbatch_divides", lambda v: (v.global_batch // np.maximum(v.dp, 1)) % v.microbatch == 0,
         lambda v: f"train.microbatch={v.microbatch} must divide the per-rank batch global_batch/dp = "
                   f"{v.global_batch // v.dp}; allowed: "
                   f"{', '.join(str(d) for d in range(1, v.global_batch // v.dp + 1) if v.global_batch // v.dp % d == 0)}",
         needs_dp=True),
    Rule("1f1b_microbatches", lambda v: _or(_not(_and(_pipelined(v), _is(v, ("1f1b",)))), v.microbatches >= v.pp),
         lambda v: f"{_where(v)}: 1f1b needs microbatches >= pp={v.pp}; allowed: a larger global_batch or a "
                   f"smaller microbatch, or pp_schedule='gpipe'", needs_dp=True),
    Rule("interleaved_microbatches", lambda v: _or(_not(_and(_pipelined(v), _is(v, ("interleaved_1f1b",)))),
                                                   v.microbatches >= v.pp),
         lambda v: f"{_where(v)}: interleaved_1f1b needs microbatches >= pp={v.pp}; allowed: a larger "
                   f"global_batch or a smaller microbatch, or pp_schedule='gpipe'", needs_dp=True),
    Rule("interleaved_rounds", lambda v: _or(_not(_and(_pipelined(v), _is(v, ("interleaved_1f1b",)))),
                                             _interleaved_rounds_ok(v)),
         lambda v: f"{_where(v)}: interleaved_1f1b runs microbatches in rounds of m // pp = "
                   f"{v.microbatches // v.pp}; allowed: microbatch counts divisible by {v.microbatches // v.pp} "
                   f"(e.g. a multiple of pp={v.pp})", needs_dp=True),
    Rule("v_microbatches", lambda v: _or(_not(_and(_pipelined(v), _is(v, V_SCHEDULES))), v.microbatches >= 2 * v.pp),
         lambda v: f"{_where(v)}: {v.schedule} needs microbatches >= 2*pp = {2 * v.pp} (its V holds 2 stages per "
                   f"rank); allowed: a larger global_batch or a smaller microbatch", needs_dp=True),
)


def _where(v: View) -> str:
    return (f"parallel.pp_schedule='{v.schedule}' with {v.microbatches} microbatches (train.global_batch="
            f"{v.global_batch} / (dp={v.dp} x train.microbatch={v.microbatch}))")


def _applies(rule: Rule, v: View, runtime: bool, groups) -> bool:
    if rule.runtime_only and not runtime:
        return False
    if rule.needs_dp and (v.dp is None or v.global_batch is None):
        return False
    return groups is None or rule.name.split("_")[0] in groups or rule.name in groups


def check(v: View, runtime: bool = True, groups=None) -> None:
    """One layout: raise the first broken rule's error (ValueError). runtime=False: the planner's view (it models
    what the runtime does not implement). groups: only rules whose name starts with one of these words."""
    for rule in RULES:
        if _applies(rule, v, runtime, groups) and not bool(rule.ok(v)):
            raise ValueError(rule.message(v))


def mask(v: View, runtime: bool = False):
    """Many layouts (arrays): True where every rule holds."""
    ok = np.ones(np.shape(v.tp), bool)
    for rule in RULES:
        if _applies(rule, v, runtime, None):
            ok &= np.asarray(rule.ok(v), bool)
    return ok


__all__ = ["MULTI_STAGE_SCHEDULES", "RULES", "Rule", "View", "check", "mask"]
