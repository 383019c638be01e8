"""Pipeline x context parallelism (PP x CP) against the single-device model (CPU, gloo, fp32), and its layout rules.

Every stage runs ring attention over its cp group on the zig-zag slice of each sequence; the activations passed
between stages are those s/cp slices (s/(cp*tp) with SP); gradients are reduced over the flattened (dp, cp) mesh.
Each parity case goes through the real entry point (build_runner -> parallelize -> PipelineRunner) and is
checked as the other pipeline cases (tests/test_pipeline.py `_check`): loss of the first forward on every rank,
every gradient this rank holds (the union over ranks covers every parameter), the global clipping norm of each of
2 AdamW steps (clip 0.5, active every step), their losses, and the forward-only eval loss afterwards.
Tolerance: the same as every other layout -- losses/norms/eval rtol 1e-5 (atol 1e-6), per-parameter gradient
relative L2 error 1e-5 (fp32; the ring only reorders fp32 sums).
"""

import pytest
import torch
from parity import make_config
from test_pipeline import (
    ONE_BLOCK_PER_STAGE,
    PP2_TP2_DP2,
    TWO_MICROBATCHES,
    _check,
    _steps_with_norms,
    sched,
)

from paratrain.parallel.mesh import init_distributed
from paratrain.train.loop import build_runner

# Single-chunk schedules: one block per stage and 2 microbatches (the CPU of a case grows with blocks x
# microbatches; several blocks per stage: test_pipeline.PP2 and PP2_MIXED). The 2-chunk schedules need 4 blocks.
ONE_CHUNK = [*ONE_BLOCK_PER_STAGE, TWO_MICROBATCHES]
PP2_CP2 = [
    ["parallel.pp=2", "parallel.cp=2", *ONE_CHUNK, *sched("1f1b")],  # fsdp over (dp, cp) = 2 ranks
    ["parallel.pp=2", "parallel.cp=2", 'parallel.dp_kind="ddp"', *ONE_CHUNK, *sched("gpipe")],
    ["parallel.pp=2", "parallel.cp=2", *sched("interleaved_1f1b", "parallel.virtual_stages=2")],
    ["parallel.pp=2", "parallel.cp=2", *sched("zbv")],  # split backward: input grads, then weight grads
    ["parallel.pp=2", "parallel.cp=2", 'parallel.dp_kind="ddp"', 'parallel.recompute="full"', *sched("dualpipev")],
]
PP2_CP2_8 = [
    ["parallel.pp=2", "parallel.cp=2", "parallel.tp=2", "parallel.sp=true", *ONE_CHUNK, *sched("1f1b")],
    # shards over (dp_shard, cp); 2 microbatches per rank (interleaved with more is PP2_CP2's, on 4 ranks)
    ["parallel.pp=2", "parallel.cp=2", "parallel.dp=2", 'parallel.dp_kind="hsdp"', "parallel.dp_replicate=2",
     *sched("interleaved_1f1b", "parallel.virtual_stages=2")],
]
# Not on 8 ranks (~7 CPU-s a case on 2 cores): PP2 x CP2 x DP2 (zbv, FSDP over dp x cp = 4 ranks). Its parts are
# covered on 4 ranks: zbv with FSDP over cp under PP2 (PP2_CP2 above), FSDP over the flattened (dp, cp) mesh with
# dp 2 (test_context_parallel.py, cp2 x dp2 fsdp), FSDP under zbv with dp 2 (test_pipeline.PP2_MIXED).


def _run_cases_with_shapes(cases: list[list[str]]) -> list[dict]:
    """On every rank: parity results, plus the shape of the activation each stage received from the previous
    stage (inferred by the schedule on the first step: what crosses the pp links)."""
    env = init_distributed("cpu")
    results = []
    for overrides in cases:
        cfg = make_config(overrides + ["optim.grad_clip=0.5"])
        runner = build_runner(cfg, env)
        out = _steps_with_norms(cfg, runner)
        stages = runner.schedule._stages if hasattr(runner.schedule, "_stages") else [runner.schedule._stage]
        shapes = {st.stage_index: tuple(st._stage_meta.inputs[0].shape) for st in stages if st.stage_index > 0}
        results.append({**out, "runner": type(runner).__name__, "stage_inputs": shapes})
    return results


def _check_stage_inputs(cases, per_rank_results):
    """Hidden states between stages hold s/cp tokens (s/(cp*tp) with SP), not the whole sequence."""
    for overrides, *results in zip(cases, *per_rank_results, strict=True):
        cfg = make_config(overrides)
        p = cfg.parallel
        local_seq = cfg.train.seq_len // p.cp // (p.tp if p.sp else 1)
        want = (cfg.train.microbatch, local_seq, cfg.model_shape().hidden)
        seen = [shape for got in results for shape in got["stage_inputs"].values()]
        assert seen and all(shape == want for shape in seen), (overrides, seen, want)


def test_pp2_cp2_every_schedule_matches_single_device(dist_run):
    results = dist_run(4, _run_cases_with_shapes, PP2_CP2)
    _check(PP2_CP2, results)
    _check_stage_inputs(PP2_CP2, results)


def test_8_rank_pipeline_compositions_match_single_device(dist_run):
    """PP2 x TP2+SP x DP2 (fsdp), PP2 x HSDP 2x2 (test_pipeline.PP2_TP2_DP2) and PP2 x CP2 with TP2+SP or HSDP, in
    one task on one 8-rank pool: a fresh 8-rank pool costs ~10 CPU-s of cold start on 2 cores."""
    cases = PP2_TP2_DP2 + PP2_CP2_8
    results = dist_run(8, _run_cases_with_shapes, cases)
    _check(cases, results)
    n = len(PP2_TP2_DP2)
    _check_stage_inputs(PP2_CP2_8, [r[n:] for r in results])


# ---------------------------------------------------------------------------------------------------------
# Layout rules (no processes)
# ---------------------------------------------------------------------------------------------------------
def test_pp_with_cp_is_accepted_when_the_sequence_splits():
    from paratrain.parallel.pipeline import check_pipeline_layout

    cfg = make_config(["parallel.pp=2", "parallel.cp=4", "parallel.tp=2", "parallel.sp=true"])
    assert check_pipeline_layout(cfg, 1).num_stages == 2


@pytest.mark.parametrize("overrides, message", [
    (["parallel.pp=2", "parallel.cp=4", "train.seq_len=36"],
     r"parallel.cp=4: train.seq_len=36 must be divisible by 2\*cp=8"),
    (["parallel.pp=2", "parallel.cp=2", "parallel.tp=4", "parallel.sp=true", "train.seq_len=20"],
     r"train.seq_len/cp=10 must be divisible by parallel.tp=4"),
])
def test_pp_cp_layouts_that_cannot_split_are_refused_at_load_time(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_config(overrides)


def test_zero_bubble_schedules_refuse_explicit_resharding_under_fsdp():
    """zbv/dualpipev + FSDP keep parameters gathered between forward and backward (see
    pipeline.stage_reshard_after_forward); an explicit request for ZeRO-3 resharding is one clear error."""
    from paratrain.parallel.pipeline import check_pipeline_layout, stage_reshard_after_forward

    base = ["parallel.pp=2", "parallel.cp=2", *sched("zbv")]
    assert stage_reshard_after_forward(make_config(base).parallel) is False
    assert stage_reshard_after_forward(make_config(["parallel.pp=2", *sched("1f1b")]).parallel) is True
    for extra in (["parallel.reshard_after_forward=true"], ['parallel.zero_stage=3']):
        with pytest.raises(ValueError, match=r"pp_schedule='zbv' with parallel.dp_kind='fsdp' and "
                                             r"reshard_after_forward=true / zero_stage=3"):
            check_pipeline_layout(make_config(base + extra), 1)
    # DDP never shards parameters: the setting does not apply and is not refused.
    check_pipeline_layout(make_config(base + ['parallel.dp_kind="ddp"', "parallel.reshard_after_forward=true"]), 1)


def test_positions_hook_gives_every_stage_the_global_zigzag_positions():
    """A stage without the embedding gets hidden states of s/cp tokens (s/(cp*tp) with SP): its RoPE positions
    must be the global zig-zag positions of the s/cp tokens its attention sees, whatever SP's own hook says."""
    from paratrain.parallel.context import _zigzag_positions_hook, zigzag_positions
    from paratrain.parallel.tensor import _full_sequence_positions

    seq, cp, tp, rank = 32, 2, 2, 1
    hidden = torch.zeros(2, seq // (cp * tp), 8)
    args, kwargs = _zigzag_positions_hook(cp, rank, gathered=tp)(None, (hidden,), {})
    args, kwargs = _full_sequence_positions(tp)(None, args, kwargs)  # runs after: must leave them alone
    assert torch.equal(kwargs["positions"], zigzag_positions(seq, cp, rank))


# ---------------------------------------------------------------------------------------------------------
# End to end, as users run it
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # a single-process run and a 4-rank torchrun, with tokenizer training: > 20 s on 2 cores
def test_torchrun_pp2_cp2_matches_single_process(tmp_path):
    """`torchrun --nproc-per-node 4 ... paratrain train --set parallel.pp=2 --set parallel.cp=2` (with eval) against
    one process on the same prepared data: losses per step within 1e-5 relative. torchrun forks its 4 workers from
    a warm agent (tests/torchrun_fork.py); the plain `-m paratrain` worker path stays covered by
    test_context_parallel_torchrun.py and test_multinode_netns.py."""
    from e2e import assert_losses_close, run_single, run_torchrun, train_args

    run = {"train__steps": 3, "train__eval_every": 2, "train__eval_batches": 1}
    ref = run_single(train_args(tmp_path, "single", **run))
    got = run_torchrun(4, train_args(tmp_path, "pp2cp2", **run, parallel__pp=2, parallel__cp=2), fork=True)
    assert got["layout"] == {"pp": 2, "dp": 1, "cp": 2, "tp": 1} and got["world_size"] == 4
    assert len(got["losses"]) == 3
    assert_losses_close(got["losses"], ref["losses"])
