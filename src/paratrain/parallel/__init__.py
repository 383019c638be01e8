"""Parallel techniques, applied to the single-device model by `parallelize()` in a fixed order.

Order (as torchtitan): pipeline split -> tensor/sequence parallel -> context parallel -> activation
recomputation (-> torch.compile) -> data parallel (FSDP2/DDP/HSDP, or stale-gradient DP). Why this order:
- the pipeline split first, so every later technique sees only the layers this rank owns;
- TP before recompute, so a recomputed region replays its TP collectives in backward;
- recompute before FSDP, so FSDP's per-block hooks (unshard before backward) wrap the recomputed forward;
- DP last: FSDP shards the parameters TP has already distributed (2-D DTensors over dp x tp), and the DDP
  reducer hooks the final parameters.
Each technique lives in its own file: pipeline.py, tensor.py (TP/SP/loss parallel), context.py (ring
attention), recompute.py, compile.py, data.py (FSDP/DDP/HSDP), stale_dp.py (bounded staleness / time budget);
mesh.py builds the device mesh, layout.py checks a layout before anything is built, runner.py drives a step.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from paratrain.config import TrainConfig
from paratrain.config.layout import check_parallel_config, effective_dp
from paratrain.parallel.compile import apply_compile
from paratrain.parallel.materialize import SourceOf, on_meta, place, random_init
from paratrain.parallel.mesh import DistEnv, resolve_degrees
from paratrain.parallel.precision import Precision
from paratrain.parallel.recompute import apply_recompute
from paratrain.parallel.runner import ParallelRunner, Runner


def check_layout(cfg: TrainConfig, world_size: int) -> dict[str, int]:
    """Every layout check, before anything is built; returns the mesh degrees."""
    degrees = resolve_degrees(cfg.parallel, world_size)
    check_parallel_config(cfg.model_shape(), cfg.parallel, cfg.train.seq_len)  # TP, SP, CP, DP kinds
    if cfg.staleness.policy != "sync":
        from paratrain.parallel.stale_dp import check_staleness_layout

        check_staleness_layout(cfg, degrees)
    return degrees


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

    `model` may be built on the meta device (`build_runner` does): the layout is then applied to the meta
    parameters and each rank materialises only its shards at the end, filled from `source_of(name, shape)`
    (default: the layout-independent random init of cfg.train.seed; parallel/materialize.py). A model that
    already holds weights is moved to the device first instead (the old path)."""
    pcfg = cfg.parallel
    degrees = check_layout(cfg, env.world_size)
    meta = on_meta([model])
    if source_of is None:
        source_of = random_init(cfg)
    stale = cfg.staleness.policy != "sync"  # bounded staleness / time budget: parallel/stale_dp.py
    if stale:
        from paratrain.parallel.stale_dp import build_stale_runner
    if mesh is None:  # one process: recompute and compile still apply; the stale runner works here too
        place([model], env.device, meta, source_of)
        apply_recompute(model, pcfg.recompute)
        apply_compile(model, cfg.train.compile)
        if stale:
            return build_stale_runner(model, cfg, mesh, env, degrees)
        return Runner(model, cfg.train.microbatch, env.device, cfg.train.dtype)
    if degrees["pp"] > 1:
        # 0. pipeline split first; pipeline.py then applies steps 1-4 below (CP included) to each stage module,
        #    materialises only this rank's stages, and drives a schedule.
        from paratrain.parallel.pipeline import parallelize_pipeline

        return parallelize_pipeline(model, cfg, mesh, env, source_of)
    if not meta:
        model.to(env.device)
    parts = [model]
    if degrees["tp"] > 1:  # 1. tensor (+ sequence, loss) parallelism
        from paratrain.parallel.tensor import apply_tp

        for part in parts:
            apply_tp(part, mesh["tp"], sp=pcfg.sp, loss_parallel=True)
    if degrees["cp"] > 1:  # 2. context parallelism: ring attention over the cp group
        from paratrain.parallel.context import apply_context_parallel

        apply_context_parallel(parts, mesh["cp"].get_group(), pcfg.cp_attention,
                               device=env.device)
    for part in parts:  # 3. activation recomputation, then compilation of what runs
        apply_recompute(part, pcfg.recompute)
        apply_compile(part, cfg.train.compile)
    if stale:  # 4a. stale gradients: its own asynchronous all-reduce over dp replaces DDP/FSDP
        place(parts, env.device, meta, source_of)
        return build_stale_runner(model, cfg, mesh, env, degrees)
    dp = None  # 4. data parallelism over dp (x cp): FSDP2 / HSDP / bucketed DDP
    dp_mesh = dp_mesh_of(mesh, cfg)
    if dp_mesh.size() > 1:
        from paratrain.parallel.data import apply_dp

        kind, reshard = effective_dp(pcfg)
        dp = apply_dp(parts, dp_mesh, kind, reshard, bucket_bytes=pcfg.ddp_bucket_bytes,
                      precision=Precision.from_train(cfg.train))
    place(parts, env.device, meta, source_of, dp)  # 5. this rank's shards only, now that the layout is known
    runner_cls, runner_extra = ParallelRunner, {}
    if degrees["cp"] > 1:  # the runner shards each batch along the sequence (zig-zag)
        from paratrain.parallel.context import ContextParallelRunner

        runner_cls, runner_extra = ContextParallelRunner, {"cp_group": mesh["cp"].get_group()}
    runner = runner_cls(model, cfg.train.microbatch, env.device, cfg.train.dtype,
                        dp_rank=mesh["dp"].get_local_rank(), dp_size=degrees["dp"], dp=dp,
                        loss_parallel=degrees["tp"] > 1, **runner_extra)
    runner.parts = parts
    return runner

