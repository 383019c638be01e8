"""Parallel techniques, applied to the single-device model by `parallelize()` in one fixed order.

`parallelize` splits the model into the parts this rank holds (one part when pp = 1; this rank's pipeline stages
otherwise, pipeline.py), applies `apply_techniques` -- the one place the order of techniques is written -- to
those parts, materialises this rank's shards, and builds the runner the training loop drives.

Each technique lives in its own file: pipeline.py (stage split, schedule runner), tensor.py (TP/SP/loss
parallel), context.py (ring attention), expert.py (MoE experts), recompute.py, offload.py, compile.py, data.py
(FSDP/DDP/HSDP), stale_dp.py (bounded staleness / time budget); mesh.py builds the device mesh, runner.py drives
a step; the layout rules (which layouts are allowed) are in the torch-free `paratrain.config`.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from paratrain.config import TrainConfig
from paratrain.config.layout import (
    check_parallel_config,
    check_vocab_parallel,
    effective_dp,
    vocab_parallel_mode,
)
from paratrain.config.pipeline import stage_reshard_after_forward
from paratrain.parallel.compile import apply_compile
from paratrain.parallel.materialize import SourceOf, on_meta, place, random_init
from paratrain.parallel.mesh import DistEnv, resolve_degrees
from paratrain.parallel.offload import apply_offload
from paratrain.parallel.precision import Precision
from paratrain.parallel.recompute import apply_recompute
from paratrain.parallel.runner import ParallelRunner, Runner


def check_layout(cfg: TrainConfig, world_size: int) -> dict[str, int]:
    """Every layout check, before anything is built; returns the mesh degrees."""
    degrees = resolve_degrees(cfg.parallel, world_size)
    check_parallel_config(cfg.model_shape(), cfg.parallel, cfg.train.seq_len)  # TP, SP, CP, DP kinds
    check_vocab_parallel(cfg.model_shape(), cfg.parallel, degrees["dp"])  # with the resolved dp size
    if is_stale(cfg) and vocab_parallel_mode(cfg.parallel) == "dp":
        raise ValueError(f"parallel.vocab_parallel='dp' with staleness.policy='{cfg.staleness.policy}': the "
                         f"stale-gradient runner reduces every parameter itself; allowed: vocab_parallel auto or off")
    if is_stale(cfg):
        from paratrain.parallel.stale_dp import check_staleness_layout

        check_staleness_layout(cfg, degrees)
    return degrees


def is_stale(cfg: TrainConfig) -> bool:
    """Stale-gradient data parallelism (parallel/stale_dp.py) instead of synchronous DDP/FSDP."""
    return cfg.staleness.policy != "sync"


def vocab_mesh_of(mesh: DeviceMesh | None, cfg: TrainConfig) -> DeviceMesh | None:
    """The dp mesh the embedding and head are sharded over by vocabulary (parallel.vocab_parallel='dp'), or None."""
    if mesh is None or vocab_parallel_mode(cfg.parallel) != "dp" or mesh["dp"].size() == 1:
        return None
    return mesh["dp"]


def dp_mesh_of(mesh: DeviceMesh, cfg: TrainConfig) -> DeviceMesh:
    """The mesh gradients are averaged over: dp (2-D replicate x shard for hsdp), times cp when cp > 1
    (context-parallel ranks see different tokens of the same sequences, so they are data-parallel for weights)."""
    if cfg.parallel.dp_kind == "hsdp":
        if cfg.parallel.cp > 1:
            mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            return mesh["dp_replicate", "dp_shard_cp"]
        return mesh["dp_replicate", "dp_shard"]
    if cfg.parallel.cp > 1:
        return mesh["dp", "cp"]._flatten("dp_cp")
    return mesh["dp"]


def parallelize(model: nn.Module, cfg: TrainConfig, mesh: DeviceMesh | None, env: DistEnv,
                source_of: SourceOf | None = None) -> Runner:
    """Wrap `model` for the layout in cfg.parallel and return the runner the training loop drives.

    1. split: the parts this rank holds (the whole model, or its pipeline stages: pipeline.split_model);
    2. `apply_techniques` to those parts (the fixed order);
    3. materialise this rank's shards (`place`): a meta model (as `build_runner` makes it) allocates only what
       this rank holds, filled from `source_of(name, shape)` (default: the layout-independent random init of
       cfg.train.seed; parallel/materialize.py); a model that already holds weights is moved to the device;
    4. the runner for the layout (`make_runner`).
    Every rank must call this (pipeline stage setup and DDP's replica check talk to the other ranks)."""
    degrees = check_layout(cfg, env.world_size)
    meta = on_meta([model])
    stages, layout = [(0, model)], None
    if degrees["pp"] > 1:  # carve first: only this rank's stages reach the device, not the whole model
        from paratrain.parallel.pipeline import check_pipeline_layout, split_model

        layout = check_pipeline_layout(cfg, mesh["dp"].size())
        stages = split_model(model, layout, mesh["pp"].get_local_rank())
    parts = [part for _, part in stages]
    if not meta:
        for part in parts:
            part.to(env.device)
    dp = apply_techniques(parts, cfg, mesh, env)
    place(parts, env.device, meta, source_of or random_init(cfg), dp)
    return make_runner(stages, layout, cfg, mesh, env, degrees, dp)


def apply_techniques(parts: list[nn.Module], cfg: TrainConfig, mesh: DeviceMesh | None, env: DistEnv):
    """Apply the layout's techniques to every model part this rank holds, in the one fixed order; returns the
    data-parallel handle (parallel/data.py `DataParallel`) or None.

    Order (as torchtitan's parallelize_llama):
      1. tensor (+ sequence, loss) parallelism      tensor.py
         or vocabulary parallelism over dp          vocab.py (embedding/head only; left out of step 6)
      2. context parallelism (ring attention)       context.py
      3. expert parallelism (MoE)                   expert.py
      4. activation recomputation                   recompute.py
         then activation offloading to the host     offload.py (parallel.offload_layers)
      5. torch.compile of what runs                 compile.py
      6. data parallelism: FSDP2 / HSDP / DDP       data.py  (stale-gradient DP: its runner reduces, stale_dp.py)
    Why this order:
    - the pipeline split comes before all of them (parallelize), so every technique sees only this rank's layers;
    - TP before CP: the ring runs on each TP rank's own heads; CP's position hook goes ahead of SP's stage hook;
    - TP before EP: the shared experts are TP-sharded like the dense MLP, EP shards the routed experts over
      (ep, tp) itself; EP before DP, which must leave the expert weights to EP's reducer;
    - TP (and EP) before recompute, so a recomputed region replays its collectives in backward;
    - recompute before FSDP, so FSDP's per-block hooks (unshard before backward) wrap the recomputed forward;
    - offload after recompute, so a checkpoint inside an offloaded block keeps its own saved-tensor hooks
      innermost (what it keeps stays on the device; the rest of the block moves), and after TP, so what moves
      is this rank's shard;
    - compile after recompute, so the compiled region is what runs, checkpointing included;
    - DP last: FSDP shards the parameters TP has already distributed (2-D DTensors over dp x tp), and the DDP
      reducer hooks the final parameters (of every part: one set of buckets for all of this rank's stages)."""
    pcfg = cfg.parallel
    tp = mesh["tp"].size() if mesh is not None else 1
    cp = mesh["cp"].size() if mesh is not None else 1
    if tp > 1:  # 1.
        from paratrain.parallel.tensor import apply_tp

        for part in parts:
            apply_tp(part, mesh["tp"], sp=pcfg.sp, loss_parallel=True)
    vocab_params = set()
    if (vocab_mesh := vocab_mesh_of(mesh, cfg)) is not None:  # 1. (pp = 1: one part, the whole model)
        from paratrain.parallel.vocab import apply_vocab_dp

        vocab_params = apply_vocab_dp(parts[0], vocab_mesh)
    if cp > 1:  # 2. a stage without the embedding gets s/(cp*tp) tokens with SP: positions scaled by sp_tp
        from paratrain.parallel.context import apply_context_parallel

        apply_context_parallel(parts, mesh["cp"].get_group(), pcfg.cp_attention, sp_tp=tp if pcfg.sp else 1,
                               device=env.device)
    experts = apply_expert_parallel(parts, cfg, mesh)  # 3.
    for part in parts:
        apply_recompute(part, pcfg.recompute)  # 4.
        apply_offload(part, pcfg.offload_layers)  # 4. (then)
        apply_compile(part, cfg.train.compile)  # 5.
    return apply_data_parallel(parts, cfg, mesh, ignored=vocab_params, experts=experts)  # 6.


def apply_expert_parallel(parts: list[nn.Module], cfg: TrainConfig, mesh: DeviceMesh | None):
    """Step 3 (MoE models): the routed experts sharded over (ep, etp) as DTensors on the expert mesh, the
    (edp, ep, etp) refold of dp x cp x tp (parallel/expert.py; the shared experts were TP-sharded in step 1 like
    the dense MLP); routing over the whole microbatch when tp (etp = 1) or cp split its tokens; a pipeline
    schedule, which differentiates only the LM loss, gets each layer's aux loss through the layer's output.
    Returns the reducer of the expert gradients that step 6 leaves them to (None: experts left to DDP/FSDP)."""
    if mesh is None or not cfg.model_shape().num_experts:
        return None
    from paratrain.parallel import expert

    params, emesh = expert.shard_experts(parts, mesh, cfg.parallel)
    if cfg.parallel.pp > 1:  # after sharding: the hooks go on the modules that run
        expert.attach_aux_to_backward(parts)
    return expert.expert_reducer(params, emesh, mesh["dp"].size() * mesh["cp"].size())


def apply_data_parallel(parts: list[nn.Module], cfg: TrainConfig, mesh: DeviceMesh | None, ignored=None,
                        experts=None):
    """Step 6: FSDP2 / HSDP / bucketed DDP over dp (x cp); None with one data-parallel rank, and for stale
    gradients (their asynchronous all-reduce over dp replaces DDP/FSDP: `make_runner` builds it). `ignored`
    parameters are left alone (already sharded over dp, gradients complete: parallel/vocab.py); `experts`
    (step 3's reducer): the expert weights, left out of DDP/FSDP and reduced over their own group."""
    if mesh is None or is_stale(cfg):
        return None
    dp_mesh = dp_mesh_of(mesh, cfg)
    if dp_mesh.size() == 1:
        return None
    from paratrain.parallel.data import apply_dp

    pcfg = cfg.parallel
    kind, _ = effective_dp(pcfg)
    # the zero-bubble schedules need the parameters gathered from forward to backward (config/pipeline.py)
    return apply_dp(parts, dp_mesh, kind, stage_reshard_after_forward(pcfg), bucket_bytes=pcfg.ddp_bucket_bytes,
                    precision=Precision.from_train(cfg.train), ignored=ignored, experts=experts,
                    expert_shards=expert_shards_of(experts, cfg, dp_mesh.size()) if experts is not None else None)


def expert_shards_of(experts, cfg: TrainConfig, divide: int):
    """How fsdp/hsdp shards the experts (parallel/data.py ExpertShards): over the expert-data-parallel ranks that
    hold the same expert shards (the expert mesh's edp: dp x cp x tp / (ep x etp), parallel/expert.py; with hsdp
    edp_replicate x edp), even when that is one rank (the unit then still divides the gradients and applies the mixed-precision policy)."""
    from paratrain.parallel.data import ExpertShards
    from paratrain.parallel.expert import expert_data_mesh

    edp = expert_data_mesh(experts.mesh)
    # torchtitan's rule: dim-0 sharding leaves ranks empty once edp x ep exceeds the number of experts
    dim = 1 if edp.size() * cfg.parallel.ep > cfg.model_shape().num_experts else 0
    return ExpertShards(edp, divide, dim)


def make_runner(stages: list[tuple[int, nn.Module]], layout, cfg: TrainConfig, mesh: DeviceMesh | None,
                env: DistEnv, degrees: dict[str, int], dp) -> Runner:
    """The runner for the layout: stale-gradient DP, a pipeline schedule, context parallel (batches sharded
    along the sequence), or the plain (tensor/data-)parallel one."""
    model = stages[0][1]
    t = cfg.train
    if is_stale(cfg):
        from paratrain.parallel.stale_dp import build_stale_runner

        return build_stale_runner(model, cfg, mesh, env, degrees)
    if mesh is None:  # one process
        return Runner(model, t.microbatch, env.device, t.dtype)
    if layout is not None:
        from paratrain.parallel.pipeline import PipelineRunner

        return PipelineRunner(stages, layout, mesh, cfg, env, dp=dp)
    runner_cls, runner_extra = ParallelRunner, {}
    if degrees["cp"] > 1:
        from paratrain.parallel.context import ContextParallelRunner

        runner_cls, runner_extra = ContextParallelRunner, {"cp_group": mesh["cp"].get_group()}
    vocab_mesh = vocab_mesh_of(mesh, cfg)
    return runner_cls(model, t.microbatch, env.device, t.dtype, dp_rank=mesh["dp"].get_local_rank(),
                      dp_size=degrees["dp"], dp=dp, loss_parallel=degrees["tp"] > 1 or vocab_mesh is not None,
                      vocab_mesh=vocab_mesh, **runner_extra)
