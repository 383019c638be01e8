"""Tensor/sequence/data parallelism and recomputation against the single-device model (CPU, gloo, fp32).

Each case runs the same model (tiny shape, 2 layers, heads=4, kv_heads=2, vocab 256) on the same global batch
as the single-device reference and compares: the loss of the first forward, every parameter's gradient after
the first backward (relative L2 error per parameter, from the full tensor gathered out of its shards), and the
losses of 2 AdamW steps (grad clipping on; the second step runs on the optimizer state the first left, sharded
as the layout shards it; a third step checked nothing more and cost a fifth of the file's CPU). Tolerance: loss rtol 1e-5 (atol 1e-6), gradient relative error 1e-5.

Cases are grouped per world size and recompute mode and run in one call to the persistent gloo pool.
TP4 on this model has kv_heads=2 < tp=4, so it also covers the replicated-kv-head path.
"""

import pytest
import torch
import torch.distributed as dist
from parity import (
    assert_cases_match,
    assert_matches_reference,
    global_batch,
    make_config,
    parallel_run,
    reference,
)

from paratrain.cli import main
from paratrain.config import effective_dp, load_config
from paratrain.parallel import check_layout

LOSS_RTOL, LOSS_ATOL, GRAD_RTOL = 1e-5, 1e-6, 1e-5
SHAPE = ["model.layers=2"]  # two blocks: SP's sharded residual crosses a block boundary; half the cost of 4
STEPS = 2
TWO_MICROBATCHES = "train.microbatch=4"  # without dp: 2 microbatches of 4 rows (accumulation still runs), not 4 of 2

LAYOUTS = {
    2: [
        ["parallel.tp=2", TWO_MICROBATCHES],
        ["parallel.tp=2", "parallel.sp=true", TWO_MICROBATCHES],
        ["parallel.dp=2", "parallel.dp_kind=\"fsdp\""],
        ["parallel.dp=2", "parallel.dp_kind=\"ddp\""],
    ],
    4: [
        ["parallel.tp=4", TWO_MICROBATCHES],
        ["parallel.tp=4", "parallel.sp=true", TWO_MICROBATCHES],
        ["parallel.tp=2", "parallel.dp=2", "parallel.sp=true", "parallel.dp_kind=\"fsdp\""],
        ["parallel.tp=2", "parallel.dp=2", "parallel.sp=true", "parallel.dp_kind=\"ddp\""],
    ],
}


@pytest.fixture(scope="module")
def ref():
    return reference(make_config(SHAPE), STEPS)


def _run_cases(cases, steps=STEPS):
    return [parallel_run(SHAPE + overrides, steps) for overrides in cases]


def _case_reference(overrides, steps=STEPS):
    """The single-device run with this case's train settings (its microbatch size; cached per config)."""
    return reference(make_config(SHAPE + [o for o in overrides if o.startswith("train.")]), steps)


def _check_all(cases, per_rank_results):
    """Each case against its reference (parity.assert_cases_match), and the global gradient norm before clipping of
    every step on every rank: the clipping norm counts every shard once (TP shards, FSDP shards, replicated norm
    weights, replicated kv heads). The first step's within 1e-6 relative (same weights, gradients that differ by
    fp32 reduction order only), the second's within the loss tolerance (weights one AdamW step apart by rounding)."""
    failures = []
    for i, overrides in enumerate(cases):
        ref = _case_reference(overrides)
        try:
            assert_cases_match(ref, [overrides], [[r[i]] for r in per_rank_results], LOSS_RTOL, LOSS_ATOL,
                               GRAD_RTOL)
            for rank, results in enumerate(per_rank_results):
                norms = results[i]["grad_norms"]
                assert norms[0] == pytest.approx(ref["grad_norms"][0], rel=1e-6), (rank, norms, ref["grad_norms"])
                assert norms == pytest.approx(ref["grad_norms"], rel=LOSS_RTOL), (rank, norms, ref["grad_norms"])
        except AssertionError as exc:
            failures.append(f"{' '.join(overrides)}: {exc}")
    assert not failures, "\n".join(failures)


# Recomputation wraps each block the same way whatever the layout: on 4 ranks it runs with the two layouts where
# it meets sharded activations and sharded weights (TP4 + SP, TP2 + SP x FSDP2). TP without SP and DDP are
# recomputed on 2 ranks (both modes) and, on 4 ranks, in test_context_parallel.py (CP2 x DDP2, full) and
# test_parallel_torchrun.py (TP4 + SP full, HSDP selective); each 4-rank case costs ~2 CPU-s on 2 cores.
RECOMPUTED = {2: LAYOUTS[2], 4: [LAYOUTS[4][1], LAYOUTS[4][2]]}


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("world", [2, 4])
def test_layouts_match_single_device(dist_run, world, recompute):
    layouts = LAYOUTS[world] if recompute == "none" else RECOMPUTED[world]
    cases = [layout + [f"parallel.recompute=\"{recompute}\""] for layout in layouts]
    _check_all(cases, dist_run(world, _run_cases, cases))


def test_zero2_and_hsdp_match_single_device(dist_run):
    zero2 = ["parallel.dp=4", "parallel.dp_kind=\"fsdp\"", "parallel.reshard_after_forward=false"]
    # parallel.zero_stage=2 is the same runtime layout (parallelize reads the pair effective_dp returns): checked
    # here instead of a second, identical 4-rank run
    assert effective_dp(make_config(["parallel.dp=4", "parallel.zero_stage=2"]).parallel) == ("fsdp", False)
    assert effective_dp(make_config(zero2).parallel) == ("fsdp", False)
    cases = [
        zero2,
        ["parallel.dp=4", "parallel.dp_kind=\"hsdp\"", "parallel.dp_replicate=2"],
        ["parallel.tp=2", "parallel.dp=2", "parallel.dp_kind=\"hsdp\"", "parallel.dp_replicate=2",
         "parallel.sp=true"],
        ["parallel.tp=2", "parallel.dp=2", "parallel.dp_kind=\"fsdp\""],  # TP without SP: plain norm weights
        ["parallel.tp=2", "parallel.dp=2", "parallel.dp_kind=\"ddp\""],
    ]
    _check_all(cases, dist_run(4, _run_cases, cases))


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.tp=3"], 3, r"parallel.tp=3 must divide model.heads=4"),
    (["parallel.tp=2", "model.ffn_hidden=351"], 2, r"parallel.tp=2 must divide model.ffn_hidden=351"),
    (["parallel.tp=2", "model.vocab=255"], 2, r"parallel.tp=2 must divide model.vocab=255"),
    (["parallel.tp=4", "model.heads=12", "model.kv_heads=6", "model.hidden=192"], 4, r"tp must divide kv_heads, or kv_heads must divide tp"),
    (["parallel.tp=2", "parallel.vocab_parallel=\"off\""], 2, r"always shards the vocabulary over tp"),
    (["parallel.tp=2", "parallel.sp=true", "train.seq_len=33"], 2, r"seq_len=33 must be divisible"),
    (["parallel.sp=true"], 1, r"parallel.sp=true needs parallel.tp > 1"),
    (["parallel.zero_stage=1"], 2, r"zero_stage=1 .* not implemented"),
    (["parallel.zero_stage=3", "parallel.dp_kind=\"ddp\""], 2, r"zero_stage=3 with parallel.dp_kind=.ddp.: ddp takes 0-2"),
    (["parallel.dp_kind=\"hsdp\"", "parallel.dp_replicate=3"], 4, r"dp_replicate=3 must divide"),
    (["parallel.tp=2", "parallel.dp=3"], 4, r"world size 4 != pp\*dp\*cp\*tp"),
])
def test_invalid_layouts_fail_before_building(overrides, world, message):
    with pytest.raises(ValueError, match=message):
        check_layout(make_config(overrides), world)


def test_cli_rejects_bad_layout_in_one_line(capsys):
    assert main(["train", "--set", "parallel.tp=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.tp=3 must divide model.heads=4" in err[0]


@pytest.mark.parametrize("world, overrides, message", [
    # dp=-1 (the default) already infers dp: the hint is about the other degrees, not "set parallel.dp=-1"
    ("3", ["parallel.tp=2"], "parallel: world size 3 is not a multiple of pp*cp*tp = 1*1*2 = 2"),
    ("4", ["train.global_batch=6"], "train.global_batch=6 must be divisible by the data-parallel size 4; "
                                    "allowed: a multiple of 4"),
    ("2", ["train.global_batch=16", "train.microbatch=16"],  # the demo config's batch on 2 data-parallel ranks
     "train.microbatch=16 must divide the per-rank batch global_batch/dp = 8; allowed: 1, 2, 4, 8"),
])
def test_each_torchrun_rank_refuses_a_bad_layout_before_joining(monkeypatch, capsys, world, overrides, message):
    """Under torchrun (WORLD_SIZE set, no rendezvous reachable here) the layout is refused before the rank
    joins a process group: one line, exit code 2."""
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("RANK", "0")
    assert main(["train", *[a for o in overrides for a in ("--set", o)]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_valid_gqa_replication_layout_accepted():
    cfg = load_config(None, ["parallel.tp=4"])  # tiny: kv_heads=2 < tp=4, replicated kv heads
    assert check_layout(cfg, 8) == {"pp": 1, "dp": 2, "cp": 1, "tp": 4}


def _ddp_bucket_launch_points():
    """Per bucket: how many parameters still had no final gradient when the bucket's all-reduce was launched
    (gradients are bucket views from the start, so "final" is told by a post-accumulate hook, not by .grad)."""
    from paratrain.parallel.mesh import init_distributed
    from paratrain.train.loop import build_runner

    cfg = make_config(["parallel.dp=2", "parallel.dp_kind=\"ddp\"", "parallel.ddp_bucket_mb=0.05",
                       "train.microbatch=4"])
    runner = build_runner(cfg, init_distributed("cpu"))
    reducer = runner.dp.reducer
    params = list(runner.parameters())
    done: set[int] = set()
    for p in params:
        p.register_post_accumulate_grad_hook(lambda q: done.add(id(q)))
    pending_at_launch = []
    launch = reducer._launch

    def recording_launch(i):
        pending_at_launch.append(sum(id(p) not in done for p in params))
        launch(i)

    reducer._launch = recording_launch
    x, y = global_batch(cfg, 0)
    rank = dist.get_rank()
    runner.forward_backward(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
    return len(reducer.buckets), pending_at_launch


def test_ddp_reduction_starts_during_backward(dist_run):
    buckets, pending = dist_run(2, _ddp_bucket_launch_points)[0]
    assert buckets > 4 and len(pending) == buckets
    # all but the last bucket launch while other gradients are still being computed: overlap with backward
    assert all(n > 0 for n in pending[:-1]) and pending == sorted(pending, reverse=True)


def _ddp_gradient_storages():
    from paratrain.parallel.mesh import init_distributed
    from paratrain.train.loop import build_runner

    cfg = make_config(["parallel.dp=2", "parallel.dp_kind=\"ddp\"", "parallel.ddp_bucket_mb=0.05"])
    runner = build_runner(cfg, init_distributed("cpu"))
    x, y = global_batch(cfg, 0)
    rank = dist.get_rank()
    out = []
    for _ in range(2):  # the second step after zero_grad(set_to_none=True): views are installed again
        runner.forward_backward(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
        buffers = {flat.untyped_storage().data_ptr() for flat in runner.dp.reducer._flats}
        out.append(all(p.grad.untyped_storage().data_ptr() in buffers for p in runner.parameters()))
        for p in runner.parameters():
            p.grad = None
    return out


def test_ddp_gradients_are_views_into_the_buckets(dist_run):
    """No copy into a bucket and back: every gradient lives in its bucket's buffer, step after step."""
    assert dist_run(2, _ddp_gradient_storages) == [[True, True], [True, True]]


def _sp_gathers_started_ahead():
    """Under SP, for each re-gather of a saved activation in backward: was it started ahead (by the hook on the
    region's output) or only when the linear needed it?"""
    from paratrain.parallel import tensor
    from paratrain.parallel.mesh import init_distributed
    from paratrain.train.loop import build_runner

    cfg = make_config(["parallel.tp=2", "parallel.sp=true"])
    runner = build_runner(cfg, init_distributed("cpu"))
    ahead = []
    original = tensor._ShardHolder.gathered

    def recording(holder, group, tp):
        if holder.full is None:
            ahead.append(holder._gather is not None)
        return original(holder, group, tp)

    tensor._ShardHolder.gathered = recording
    try:
        x, y = global_batch(cfg, 0)
        runner.forward_backward(x, y)
    finally:
        tensor._ShardHolder.gathered = original
    return ahead


def test_sp_backward_all_gathers_start_before_they_are_needed(dist_run):
    """Two TP regions per block, each re-gathered once in backward, each launched by the gradient hook on the
    region's output, i.e. before the region's own backward work that hides it."""
    for ahead in dist_run(2, _sp_gathers_started_ahead):
        assert len(ahead) == 2 * 4 * 4 and all(ahead), ahead  # 2 regions x 4 layers x 4 microbatches


def _hsdp_mesh_groups():
    from paratrain.parallel import dp_mesh_of
    from paratrain.parallel.mesh import build_mesh, init_distributed

    cfg = make_config(["parallel.dp=4", "parallel.dp_kind=\"hsdp\"", "parallel.dp_replicate=2"])
    mesh = build_mesh(cfg.parallel, init_distributed("cpu"))
    dp = dp_mesh_of(mesh, cfg)
    ranks = lambda group: dist.get_process_group_ranks(group)  # noqa: E731
    return dp.mesh_dim_names, ranks(dp["dp_shard"].get_group()), ranks(dp["dp_replicate"].get_group()), \
        ranks(mesh["dp"].get_group())


def test_hsdp_mesh_shards_within_and_replicates_across(dist_run):
    out = dist_run(4, _hsdp_mesh_groups)
    names, shard, replicate, whole = out[0]
    assert names == ("dp_replicate", "dp_shard") and shard == [0, 1] and replicate == [0, 2]
    assert whole == [0, 1, 2, 3] and out[3][1:3] == ([2, 3], [1, 3])


# The global gradient norm of every layout above (TP4, TP4 + SP, FSDP4, TP2 + SP x FSDP2, TP2 x DDP2, ...) is
# compared with the single device's at every parity step in _check_all (it was a separate 4-rank run of 5 layouts).


def _block_collectives(sp: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from paratrain.model.config import ModelConfig
    from paratrain.model.llama import Llama
    from paratrain.parallel.tensor import apply_tp

    shape = ModelConfig(name="m", layers=1, hidden=128, heads=4, kv_heads=2, ffn_hidden=256, vocab=256, max_seq=64)
    model = Llama(shape)
    model.init_weights(0)
    apply_tp(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), sp=sp)
    block = model.layers["0"]
    x = torch.randn(2, 32 // (2 if sp else 1), 128, requires_grad=True)
    counts = {}
    for phase in ("forward", "backward"):
        with CommDebugMode() as comm:
            if phase == "forward":
                out = block(x, model.rope_cos[:32], model.rope_sin[:32])
            else:
                out.sum().backward()
        counts[phase] = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    return counts


def test_collectives_per_block_are_megatrons(dist_run):
    """Without SP: one all-reduce per block half in forward and one in backward (Megatron's g and f). With SP:
    all-gather in / reduce-scatter out in forward, the reverse in backward, plus SP's re-gather of the kept
    input shards (2 plain all-gathers)."""
    no_sp = dist_run(2, _block_collectives, False)[0]
    assert no_sp == {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}
    sp = dist_run(2, _block_collectives, True)[0]
    assert sp["forward"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
    assert sp["backward"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2, "_allgather_base_": 2}


def _losses(cases):
    return [parallel_run(overrides, STEPS)["losses"] for overrides in cases]


def test_bf16_autocast_composes_with_tp_sp_and_dp(dist_run):
    """bf16 autocast (fp32 master weights) under TP2 x DDP2: losses follow the single-device bf16 run; the
    tolerance is bf16's (matmul roundings differ with the split), not fp32's. TP2 + SP x FSDP2 in bf16 is
    tests/test_precision.py's (CASES_4, against the fp32 reference with the derived bf16 tolerance)."""
    bf16 = SHAPE + ["train.dtype=\"bf16\""]
    ref = reference(make_config(bf16), STEPS)["losses"]
    cases = [bf16 + ["parallel.tp=2", "parallel.dp=2", "parallel.dp_kind=\"ddp\""]]
    for losses in dist_run(4, _losses, cases)[0]:
        assert losses == pytest.approx(ref, rel=1e-3)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_on_one_device_matches(ref, mode):
    from parity import run_steps

    from paratrain.parallel.mesh import DistEnv
    from paratrain.train.loop import build_runner

    cfg = make_config(SHAPE + [f"parallel.recompute=\"{mode}\""])
    runner = build_runner(cfg, DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    block = runner.model.layers["0"]
    target = block if mode == "full" else block.attention.core
    assert getattr(target, "_paratrain_recompute", False)
    assert_matches_reference(ref, run_steps(cfg, runner, STEPS), LOSS_RTOL, LOSS_ATOL, GRAD_RTOL)


def _mesh_groups(overrides):
    from paratrain.parallel.mesh import build_mesh, init_distributed

    mesh = build_mesh(make_config(overrides).parallel, init_distributed("cpu"))
    return {dim: dist.get_process_group_ranks(mesh[dim].get_group()) for dim in mesh.mesh_dim_names
            if mesh[dim].size() > 1}


def test_mesh_puts_tp_innermost(dist_run):
    """Consecutive ranks form a TP group (the fastest links: one NeuronLink ring / NVLink island); dp and pp
    stride over them. The mesh comes from the config's degrees."""
    tp_dp = dist_run(4, _mesh_groups, ["parallel.tp=2", "parallel.dp=2"])
    assert [r["tp"] for r in tp_dp] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp"] for r in tp_dp] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    pp_tp = dist_run(4, _mesh_groups, ["parallel.tp=2", "parallel.pp=2", "model.layers=4"])
    assert [r["tp"] for r in pp_tp] == [[0, 1], [0, 1], [2, 3], [2, 3]] and pp_tp[0]["pp"] == [0, 2]
    # parallel.rank_order tp-cp-pp-dp (Llama 3's [TP, CP, PP, DP]): the stages adjacent, dp outermost, in the
    # gloo groups the mesh really creates (paratrain.config.ranks; tests/test_rank_order.py checks Megatron's)
    pp_dp = dist_run(4, _mesh_groups, ["parallel.pp=2", "parallel.dp=2", "model.layers=4",
                                       "parallel.rank_order=\"tp-cp-pp-dp\""])
    assert [r["pp"] for r in pp_dp] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp"] for r in pp_dp] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def _head_and_loss(overrides):
    from torch.distributed.tensor.debug import CommDebugMode

    from paratrain.parallel.mesh import init_distributed
    from paratrain.train.loop import build_runner

    cfg = make_config(SHAPE + overrides)
    runner = build_runner(cfg, init_distributed("cpu"))
    x, y = global_batch(cfg, 0)
    with runner.step_context(), CommDebugMode() as comm:
        logits = runner.model(x[:2])
        runner.loss_fn(logits, y[:2]).backward()
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    return str(logits.placements), tuple(logits.to_local().shape), counts


def test_loss_parallel_never_gathers_logits(dist_run):
    """The head's logits stay sharded on the vocabulary (local (b, s, vocab/t)) through the cross-entropy and
    its backward: without SP no all-gather runs at all in the step (only all-reduces)."""
    for rank_out in dist_run(2, _head_and_loss, ["parallel.tp=2"]):
        placements, local_shape, counts = rank_out
        assert placements == "(Shard(dim=2),)" and local_shape == (2, 32, 128)  # vocab 256 / tp 2
        assert set(counts) == {"all_reduce"}, counts
    placements, local_shape, _ = dist_run(2, _head_and_loss, ["parallel.tp=2", "parallel.sp=true"])[0]
    assert placements == "(Shard(dim=2),)" and local_shape == (2, 32, 128)


def _block_weight_after_forward(reshard: str):
    from paratrain.parallel.mesh import init_distributed
    from paratrain.train.loop import build_runner

    cfg = make_config(SHAPE + ["parallel.dp=2", "parallel.dp_kind=\"fsdp\"", f"parallel.reshard_after_forward={reshard}"])
    runner = build_runner(cfg, init_distributed("cpu"))
    x, _ = global_batch(cfg, 0)
    runner.model(x[:2])  # forward only: what stays in memory until backward
    weight = runner.model.layers["0"].attention.wq.weight
    return type(weight).__name__, tuple(getattr(weight, "_local_tensor", weight).shape)


def test_zero2_like_keeps_block_parameters_gathered_until_backward(dist_run):
    """reshard_after_forward=true (ZeRO-3): after a block's forward its parameters are sharded again (a local
    half at DP2); false (ZeRO-2-like): they stay gathered, whole, until backward (no second all-gather)."""
    assert dist_run(2, _block_weight_after_forward, "true")[0] == ("DTensor", (64, 128))
    assert dist_run(2, _block_weight_after_forward, "false")[0] == ("Parameter", (128, 128))


def _worst_errors(ref: dict, per_rank: list[dict]) -> tuple[float, float]:
    """Worst relative error over ranks: of the losses, and of any parameter's gradient (L2, as asserted)."""
    loss = max(abs(g - r) / abs(r) for got in per_rank for g, r in zip(got["losses"], ref["losses"], strict=True))
    grad = max(float((g - ref["grads"][n]).norm() / ref["grads"][n].norm()) for got in per_rank
               for n, g in got["grads"].items())
    return loss, grad


if __name__ == "__main__":  # print the table of docs/parallelism.md: .venv/bin/python tests/test_parallel.py
    import os
    import sys

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, os.path.dirname(__file__))
    import dist_pool

    try:
        print("| layout | worst loss rel. error (3 steps) | worst gradient rel. error |\n|---|---:|---:|")
        for world, layouts in LAYOUTS.items():
            for recompute in ("none", "selective", "full"):
                cases = [layout + [f"parallel.recompute=\"{recompute}\""] for layout in layouts]
                per_rank = dist_pool.get_pool(world).run(_run_cases, cases, 3)
                for i, overrides in enumerate(cases):
                    loss_err, grad_err = _worst_errors(_case_reference(overrides, 3), [r[i] for r in per_rank])
                    name = " ".join(o.removeprefix("parallel.") for o in overrides)
                    print(f"| {name} | {loss_err:.1e} | {grad_err:.1e} |", flush=True)
    finally:
        dist_pool.close_all()


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_offload_on_one_device_matches(ref, recompute):
    """parallel.offload_layers=1 (of 2 blocks), alone and with selective recompute: the loss and every gradient as
    the same run without offloading, exactly (tolerance 0: the saved tensors are copied, not changed, and the same
    kernels run), and within this file's tolerances of the single-device reference. The tensors block 0 saves for
    backward come back from host copies (a hook counter: some, all on the host, none from block 1)."""
    from parity import run_steps

    from paratrain.device import is_host
    from paratrain.parallel.mesh import DistEnv
    from paratrain.parallel.offload import observe_offloaded
    from paratrain.train.loop import build_runner

    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    plain = make_config(SHAPE + [f"parallel.recompute=\"{recompute}\""])
    cfg = make_config(SHAPE + [f"parallel.recompute=\"{recompute}\"", "parallel.offload_layers=1"])
    runner = build_runner(cfg, env)
    blocks = runner.model.layers
    assert getattr(blocks["0"], "_paratrain_offload", False) and not hasattr(blocks["1"], "_paratrain_offload")
    moved = []
    with observe_offloaded(lambda module, t: moved.append((module, t))):
        got = run_steps(cfg, runner, STEPS)
    assert moved and all(module is blocks["0"] and is_host(t.device) for module, t in moved)
    same = run_steps(plain, build_runner(plain, env), STEPS)
    assert got["losses"] == same["losses"]
    assert all(torch.equal(g, same["grads"][name]) for name, g in got["grads"].items())
    assert_matches_reference(ref, got, LOSS_RTOL, LOSS_ATOL, GRAD_RTOL)
