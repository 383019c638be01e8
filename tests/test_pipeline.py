"""Pipeline parallelism against the single-device model (CPU, gloo, fp32), and layout refusals.

Each parity case runs the same model on the same global batch as the single-device reference and compares,
on every rank: the loss of the first forward (reported on every rank, not only the last stage), every
gradient this rank holds after the first backward (relative L2 error of the full tensor gathered out of its
TP/FSDP shards; the union over ranks must cover every parameter), the global gradient norm used for clipping
(over all stages and shards) at each of 2 AdamW steps, the losses of those steps, and the forward-only eval
loss afterwards. Clipping is set low (0.5) so that it scales every step. The norm is compared directly:
AdamW is nearly invariant to a uniform gradient scale, so a wrong clipping norm barely moves the losses
(this is how a TP x FSDP norm bug, _StridedShard placements not reduced over dp, was found).

Tolerance: losses, norms and eval loss rtol 1e-5 (atol 1e-6); gradient relative error 1e-5 (fp32; the
measured errors are ~1e-7).

Cases are grouped per world size and run in one call each to the persistent gloo pool. The model is the tiny
Llama with 4 blocks (8 under PP4's 2-chunk schedules) where a schedule needs that many stages or a case checks
several blocks per stage (PP2, PP2_MIXED's 1f1b cases); the other single-chunk cases run one block per stage and
2 microbatches (4 under PP4): a case's CPU grows with blocks x microbatches, and halving either halved it.
"""

import functools

import pytest
import torch
from parity import assert_matches_reference, global_batch, make_config, parallel_run, reference, run_steps

from paratrain.config import TrainConfig, load_config
from paratrain.parallel.mesh import DistEnv, init_distributed
from paratrain.parallel.pipeline import PipelineLayout, balanced_layers, carve_stage, plan_pipeline
from paratrain.train.loop import _build_model, build_runner

RTOL, ATOL, GRAD_RTOL = 1e-5, 1e-6, 1e-5
CLIP = ["optim.grad_clip=0.5"]
STEPS = 2  # the second step runs on the optimizer state the first left on each stage


def sched(name: str, *extra: str) -> list[str]:
    return [f'parallel.pp_schedule="{name}"', *extra]


PP2 = [["parallel.pp=2", *sched(s)] for s in ("gpipe", "1f1b", "zbv", "dualpipev")] + [
    ["parallel.pp=2", *sched("interleaved_1f1b", "parallel.virtual_stages=2")],
    ["parallel.pp=2", *sched("1f1b"), "parallel.pp_layers=[1, 3]", 'parallel.recompute="full"'],
    ["parallel.pp=2", *sched("interleaved_1f1b", "parallel.virtual_stages=2"), 'parallel.recompute="selective"'],
    ["parallel.pp=2", *sched("gpipe"), "parallel.pp_layers=[0, 4]"],  # first stage: embedding only
]
# Each stage holds one block (several blocks per stage: PP2 above, and PP2_MIXED's 1f1b cases). The CPU of a
# case grows with the blocks a rank runs times the microbatches (measured: halving either halves the case).
PP4_MODEL = ["model.layers=8", "train.microbatch=1"]  # 8 stages for the 2-chunk schedules; 8 microbatches
ONE_CHUNK_PP4 = ["model.layers=4", "train.microbatch=2"]  # 4 stages of one block; 4 microbatches (1f1b: m >= pp)
PP4 = [["parallel.pp=4", *ONE_CHUNK_PP4, *sched(s)] for s in ("gpipe", "1f1b")] + [
    ["parallel.pp=4", *PP4_MODEL, *sched(s)] for s in ("zbv", "dualpipev")] + [
    ["parallel.pp=4", *PP4_MODEL, *sched("interleaved_1f1b", "parallel.virtual_stages=2")],
]
ONE_BLOCK_PER_STAGE = ["model.layers=2"]  # a single-chunk PP2 layout: one block per stage
TWO_MICROBATCHES = "train.microbatch=4"  # without dp: 2 microbatches of 4 rows (1f1b and gpipe need m >= pp = 2)
PP2_MIXED = [
    # two blocks per stage under TP+SP (the residual stays sequence-sharded across a block boundary in a stage)
    ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true", TWO_MICROBATCHES, *sched("1f1b")],
    ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true", *sched("zbv")],
    ["parallel.pp=2", "parallel.dp=2", 'parallel.dp_kind="fsdp"', *sched("1f1b")],  # two FSDP units per stage
    # FSDP under the split (input/weight) backward: before stage_reshard_after_forward, the last stage's block
    # got no gradient and inner stages' gradients were 54-88% off.
    ["parallel.pp=2", "parallel.dp=2", 'parallel.dp_kind="fsdp"', "train.microbatch=1", *sched("zbv")],
    ["parallel.pp=2", "parallel.dp=2", 'parallel.dp_kind="ddp"',  # 2 microbatches per rank: m = pp
     *sched("interleaved_1f1b", "parallel.virtual_stages=2")],
]
# On 8 ranks: one block per stage (2 microbatches per rank): blocks per stage are PP2_MIXED's matter
PP2_TP2_DP2 = [
    ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "parallel.dp=2", 'parallel.dp_kind="fsdp"',
     *ONE_BLOCK_PER_STAGE, *sched("1f1b"), 'parallel.recompute="selective"'],
    ["parallel.pp=2", "parallel.dp=4", 'parallel.dp_kind="hsdp"', "parallel.dp_replicate=2", "train.microbatch=1",
     *ONE_BLOCK_PER_STAGE, *sched("1f1b")],
]
# Not on 8 ranks (an 8-rank case of 4 blocks cost ~7 CPU-s on 2 cores): PP2 x TP2+SP x DP2 with DDP under dualpipev. Its parts
# are covered on 4 ranks: TP2+SP under PP2 (PP2_MIXED, 1f1b and zbv), DDP under PP2 (PP2_MIXED interleaved_1f1b;
# test_pipeline_context.PP2_CP2 gpipe, and dualpipev with full recompute), TP2+SP x DDP (test_parallel.py).


def _steps_with_norms(cfg, runner) -> dict:
    """parity.run_steps, also recording the clipping norm of each step and the eval loss after the steps."""
    norms = []
    clip = runner.clip_grad_norm_

    def recording_clip(max_norm):
        norms.append(float(clip(max_norm)))
        return norms[-1]

    runner.clip_grad_norm_ = recording_clip
    out = run_steps(cfg, runner, STEPS)
    inputs, targets = global_batch(cfg, STEPS)  # a batch no step trained on
    per_rank = cfg.train.global_batch // runner.dp_size
    sl = slice(runner.dp_rank * per_rank, (runner.dp_rank + 1) * per_rank)
    out.update(norms=norms, eval=float(runner.eval_loss(inputs[sl], targets[sl])))
    return out


def _reference(overrides: list[str]) -> dict:
    """The single-device run, once per distinct config (most pipeline layouts share one)."""
    cfg = make_config(overrides + CLIP)
    single = cfg.model_copy(update={"parallel": type(cfg.parallel)()})
    return _single_reference(single.model_dump_json())


@functools.cache
def _single_reference(single_json: str) -> dict:
    single = TrainConfig.model_validate_json(single_json)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    return _steps_with_norms(single, build_runner(single, env))


def _run_cases(cases: list[list[str]]) -> list[dict]:
    """On every rank of the pool: each layout through the real entry point (parallelize -> PipelineRunner)."""
    env = init_distributed("cpu")
    results = []
    for overrides in cases:
        cfg = make_config(overrides + CLIP)
        runner = build_runner(cfg, env)
        results.append({**_steps_with_norms(cfg, runner), "runner": type(runner).__name__})
    return results


def _check(cases, per_rank_results):
    failures = []
    for i, overrides in enumerate(cases):
        ref = _reference(overrides)
        if min(ref["norms"]) <= 0.5:  # the norm is only tested if clipping scales the gradients
            failures.append(f"{' '.join(overrides)}: clipping inactive in the reference: {ref['norms']}")
        covered = set()
        for rank, results in enumerate(per_rank_results):
            got = results[i]
            label = f"{' '.join(overrides)} (rank {rank})"
            try:
                assert got["runner"] == "PipelineRunner"
                assert_matches_reference(ref, got, RTOL, ATOL, GRAD_RTOL)
                torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=RTOL,
                                           atol=ATOL)
                assert abs(got["eval"] - ref["eval"]) <= RTOL * abs(ref["eval"]), (got["eval"], ref["eval"])
            except AssertionError as exc:
                failures.append(f"{label}: {exc}")
            covered |= set(got["grads"])
        if covered != set(ref["grads"]):
            failures.append(f"{' '.join(overrides)}: parameters without a gradient on any rank: "
                            f"{sorted(set(ref['grads']) - covered)}")
    assert not failures, "\n".join(failures)


def test_clipping_is_active_in_the_parity_cases():
    """The parity cases only test the global norm if clipping actually scales the gradients."""
    assert min(_reference(PP2[0])["norms"]) > 0.5


def test_pp2_every_schedule_matches_single_device(dist_run):
    _check(PP2, dist_run(2, _run_cases, PP2))


def test_pp4_every_schedule_matches_single_device(dist_run):
    _check(PP4, dist_run(4, _run_cases, PP4))


def test_pp2_with_tp_sp_and_dp_matches_single_device(dist_run):
    _check(PP2_MIXED, dist_run(4, _run_cases, PP2_MIXED))


# PP2_TP2_DP2 runs on 8 ranks in tests/test_pipeline_context.py, in the same pool task as the 8-rank PP x CP
# cases (one 8-rank pool start instead of two; test_8_rank_pipeline_compositions_match_single_device).


def _losses_of(cases):
    return [parallel_run(c, STEPS)["losses"] for c in cases]


def test_bf16_autocast_pipeline_close_to_single_device(dist_run):
    """bf16 autocast runs around the whole schedule step (and the TP loss-parallel context with it). Not
    bitwise: stated tolerance rtol 1e-3 on the losses (measured differences ~1e-5 relative)."""
    bf16 = ['train.dtype="bf16"']
    cases = [bf16 + ["parallel.pp=2", *sched("zbv")],
             bf16 + ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true", *ONE_BLOCK_PER_STAGE, TWO_MICROBATCHES]]
    got = dist_run(2, _losses_of, cases[:1])[0] + dist_run(4, _losses_of, cases[1:])[0]
    for case, losses in zip(cases, got, strict=True):
        ref = reference(make_config([c for c in case if c.startswith(("model.", "train."))]), STEPS)["losses"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-3, atol=0, msg=lambda m, c=case:
                                   f"{' '.join(c)}: {m}")


# ---------------------------------------------------------------------------------------------------------
# Layout: split, placement, refusals (no processes)
# ---------------------------------------------------------------------------------------------------------
def _plan(overrides: list[str], dp: int = 1) -> PipelineLayout:
    return plan_pipeline(make_config(overrides), dp)


def test_balanced_split_gives_remainder_to_inner_stages_first():
    assert balanced_layers(8, 4) == [2, 2, 2, 2]
    assert balanced_layers(10, 4) == [2, 3, 3, 2]
    assert balanced_layers(11, 4) == [3, 3, 3, 2]
    assert balanced_layers(5, 2) == [3, 2]
    assert sum(balanced_layers(61, 7)) == 61


def test_looped_and_v_placement():
    looped = _plan(["parallel.pp=2", "model.layers=8", *sched("interleaved_1f1b", "parallel.virtual_stages=2")])
    assert looped.num_stages == 4 and looped.stages_of_rank(0) == [0, 2] and looped.stages_of_rank(1) == [1, 3]
    assert [looped.layer_ids(s) for s in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    v = _plan(["parallel.pp=4", "model.layers=8", "train.microbatch=1", *sched("zbv")])
    assert [v.stages_of_rank(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert v.rank_of_stage(7) == 0  # the loss is computed on pp rank 0 in a V
    explicit = _plan(["parallel.pp=2", *sched("1f1b"), "parallel.pp_layers=[1, 3]"])
    assert explicit.layer_ids(0) == [0] and explicit.layer_ids(1) == [1, 2, 3]
    assert _plan(["parallel.pp=2"], dp=2).microbatches == 2  # global_batch 8 / (dp 2 x microbatch 2)


def test_stage_keeps_global_layer_names_and_only_its_parts():
    cfg = make_config(["model.layers=4"])
    model = _build_model(cfg, cfg.model_shape())
    middle = carve_stage(model, [1, 2], first=False, last=False)
    last = carve_stage(model, [3], first=False, last=True)
    assert {n.split(".")[1] for n, _ in middle.named_parameters()} == {"1", "2"}
    assert all(n.startswith("layers.") for n, _ in middle.named_parameters())
    assert {n for n, _ in last.named_parameters() if not n.startswith("layers.")} == {"norm.weight", "output.weight"}
    assert middle.layers["1"] is model.layers["1"]  # shared, not copied
    h = torch.randn(2, 8, cfg.model_shape().hidden)
    assert middle(h).shape == h.shape  # a middle stage maps hidden states to hidden states


@pytest.mark.parametrize("overrides, message", [
    (["parallel.pp=8"], r"parallel.pp=8 x 1 chunk\(s\) per rank = 8 pipeline stages need at least 6 layers "
                       r"\(one per inner stage; the first and last may hold none\) but the model has 4; allowed: "
                       r"stages <= model.layers \+ 2"),
    (["parallel.pp=2", "model.layers=4", *sched("interleaved_1f1b", "parallel.virtual_stages=4")],
     r"parallel.pp=2 x 4 chunk\(s\) per rank = 8 pipeline stages"),
    (["parallel.pp=4", "train.global_batch=4", "train.microbatch=2", *sched("1f1b")],
     r"1f1b needs microbatches >= pp=4"),
    (["parallel.pp=4", "train.global_batch=4", "train.microbatch=2", *sched("interleaved_1f1b",
                                                                              "parallel.virtual_stages=1")],
     r"virtual_stages=1 .* interleaving needs several chunks"),
    (["parallel.pp=2", "train.global_batch=2", "train.microbatch=2",
      *sched("interleaved_1f1b", "parallel.virtual_stages=2")],
     r"interleaved_1f1b needs microbatches >= pp=2; allowed: a larger global_batch"),
    (["parallel.pp=2", "train.global_batch=10", "train.microbatch=2",
      *sched("interleaved_1f1b", "parallel.virtual_stages=2")], r"rounds of m // pp = 2; allowed: .* divisible by 2"),
    (["parallel.pp=2", "train.global_batch=6", "train.microbatch=2", *sched("zbv")],
     r"zbv needs microbatches >= 2\*pp = 4"),
    (["parallel.pp=2", "train.global_batch=6", "train.microbatch=2", *sched("dualpipev")],
     r"dualpipev needs microbatches >= 2\*pp = 4"),
    (["parallel.pp=2", *sched("zbv", "parallel.virtual_stages=3")], r"exactly 2 chunks per rank"),
    (["parallel.pp=2", *sched("gpipe", "parallel.virtual_stages=2")], r"'gpipe' runs one stage per rank"),
    (["parallel.pp=2", "parallel.pp_layers=[1, 2, 1]"], r"pp_layers=\[1, 2, 1\]: 3 entries .* 2 \(virtual\)"),
    (["parallel.pp=2", "parallel.pp_layers=[1, 2]"], r"sums to 3 but the model has 4 layers; allowed: .* to 4"),
    (["parallel.pp=4", "parallel.pp_layers=[2, 0, 1, 1]"], r"stage\(s\) \[1\] would hold no work"),
    (["parallel.pp=2", "model.tie_embeddings=true"], r"tie_embeddings=true with parallel.pp > 1"),
])
def test_impossible_layouts_are_refused_with_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        _plan(overrides)


def test_refused_by_the_batch_check_that_runs_before_any_work():
    """train() and `paratrain launch` call check_batch_layout before data preparation or model building."""
    from paratrain.train.loop import check_batch_layout

    cfg = make_config(["parallel.pp=2", 'parallel.pp_schedule="1f1b"', "train.global_batch=2"])
    with pytest.raises(ValueError, match=r"train.global_batch=2 .*1f1b needs microbatches >= pp=2"):
        check_batch_layout(cfg, 1)


def test_paratrain_config_checks_the_pipeline_layout(capsys):
    """`paratrain config` (check a config only) refuses what train would refuse: the stage checks always, the
    microbatch checks when parallel.dp is given (with dp=-1 they wait for the number of ranks)."""
    from paratrain.cli import main

    assert main(["config", "--set", "parallel.pp=8", "--set", "model.layers=4"]) == 2
    assert "parallel.pp=8 x 1 chunk(s) per rank = 8 pipeline stages" in capsys.readouterr().err
    pp4 = ["--set", "parallel.pp=4", "--set", "train.global_batch=8", "--set", "train.microbatch=2"]
    assert main(["config", *pp4, "--set", "parallel.dp=2"]) == 2  # m = 8 / (2 x 2) = 2 < pp
    assert "with 2 microbatches (train.global_batch=8 / (dp=2 x train.microbatch=2)): 1f1b needs microbatches " \
           ">= pp=4" in capsys.readouterr().err
    assert main(["config", *pp4, "--set", "parallel.dp=1"]) == 0  # m = 4
    assert main(["config", *pp4]) == 0  # dp=-1: inferred from the number of ranks, checked at launch


def test_pp_layers_with_pp1_and_zero_edge_stages():
    with pytest.raises(ValueError, match="pp_layers=.* needs parallel.pp > 1"):
        from paratrain.parallel.pipeline import check_pipeline_layout

        check_pipeline_layout(make_config(["parallel.pp_layers=[4]"]), 1)
    layout = _plan(["parallel.pp=2", "parallel.pp_layers=[0, 4]"])  # embedding-only first stage is allowed
    assert layout.layer_ids(0) == [] and layout.layer_ids(1) == [0, 1, 2, 3]
    assert load_config(None, ["parallel.pp=2"]).parallel.pp_schedule == "1f1b"


# ---------------------------------------------------------------------------------------------------------
# Bubble theory vs the action lists the schedules execute (no processes; fake process group)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"])
@pytest.mark.parametrize("p", [2, 4])
def test_schedule_action_lists_attain_the_closed_form_bubble(schedule, p):
    """Replaying each schedule's actions with F = 1, B = 2 (split I = W = 1 for zero-bubble), per rank and
    microbatch, gives exactly (p-1)/(m+p-1), (p-1)/(v m+p-1) interleaved, (p-1)/(6m+p-1) for the V schedules."""
    from paratrain.parallel.pipeline import ideal_idle_fraction, schedule_action_lists, theory_idle_fraction

    chunks = 1 if schedule in ("gpipe", "1f1b") else 2
    for m in (p, 2 * p, 4 * p):
        if schedule in ("zbv", "dualpipev") and m < 2 * p:
            continue
        layout = PipelineLayout(pp=p, chunks_per_rank=chunks, layers_per_stage=(1,) * (p * chunks),
                                microbatches=m, pp_schedule=schedule)
        cost = {"F": 1 / chunks, "B": 2 / chunks, "I": 1 / chunks, "W": 1 / chunks}
        simulated = ideal_idle_fraction(schedule_action_lists(layout), layout.num_stages, cost)
        assert simulated == pytest.approx(theory_idle_fraction(layout), abs=1e-12), (m, simulated)


@pytest.mark.parametrize("p", [2, 4])
def test_dualpipev_pairs_are_split_so_forward_outputs_leave_before_the_backward(p):
    """torch's DualPipeV pairs a forward with a backward (OVERLAP_F_B) and sends the forward's output only after
    the pair: replayed as torch runs a pair, the bubble is about twice the theory. paratrain's split schedule has
    the same compute order on every rank and attains the theory."""
    from torch.distributed.pipelining import ScheduleDualPipeV

    from paratrain.parallel import pipeline
    from paratrain.parallel.pipeline import ideal_idle_fraction, schedule_action_lists, theory_idle_fraction

    layout = PipelineLayout(pp=p, chunks_per_rank=2, layers_per_stage=(1,) * (2 * p), microbatches=4 * p,
                            pp_schedule="dualpipev")
    cost = {"F": 0.5, "B": 1.0, "I": 0.5, "W": 0.5}
    split = schedule_action_lists(layout)
    assert not any(a.sub_actions for acts in split.values() for a in acts)
    paired = schedule_action_lists(layout, ScheduleDualPipeV)  # torch's own
    assert any(a.sub_actions for acts in paired.values() for a in acts)
    flat = {r: pipeline.split_paired_actions(acts) for r, acts in paired.items()}
    assert flat == split  # same compute, same order on every rank
    theory = theory_idle_fraction(layout)
    assert ideal_idle_fraction(split, layout.num_stages, cost) == pytest.approx(theory, abs=1e-12)
    assert ideal_idle_fraction(paired, layout.num_stages, cost) > 1.5 * theory


def test_bubble_simulation_detects_a_deadlocking_order():
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    from paratrain.parallel.pipeline import ideal_idle_fraction

    f, b = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
    lists = {0: [_Action(0, b, 0), _Action(0, f, 0)], 1: [_Action(1, f, 0), _Action(1, b, 0)]}
    with pytest.raises(RuntimeError, match="deadlock"):
        ideal_idle_fraction(lists, 2, {"F": 1, "B": 2})


# ---------------------------------------------------------------------------------------------------------
# Bitwise: pipeline stages hold whole parameters, so the arithmetic can be exactly the single process's
# ---------------------------------------------------------------------------------------------------------
BITWISE_CASES = [["parallel.pp=2", f'parallel.pp_schedule="{s}"'] for s in ("gpipe", "1f1b", "zbv", "dualpipev")] + [
    ["parallel.pp=2", 'parallel.pp_schedule="interleaved_1f1b"', "parallel.virtual_stages=2"]]


def _final_params(cases: list[list[str]], steps: int) -> list[dict]:
    from parity import clean_name, full_tensor

    from paratrain.train.checkpoint import state_module

    out = []
    for overrides in cases:
        cfg = make_config(overrides)
        runner = build_runner(cfg, init_distributed("cpu"))
        run_steps(cfg, runner, steps)
        out.append({clean_name(n): full_tensor(p.detach()).clone()
                    for n, p in state_module(runner.parts).named_parameters()})
    return out


def test_pipeline_runs_end_bitwise_equal_to_the_single_process(dist_run):
    """6 AdamW steps with clipping (grad_clip 1.0 is active: the old fp64 stage-sum norm ended 4 of 19 tensors
    bitwise): every schedule's weights are bitwise
    the single process's. Needs the gradients bitwise (stages run the same kernels on whole parameters) and the
    clipping norm summed in the single-device parameter order (parallel/grad_norm.py)."""
    from parity import _single_env

    cfg = make_config()
    single = build_runner(cfg, _single_env())
    run_steps(cfg, single, 6)
    expected = {n: p.detach().clone() for n, p in single.model.named_parameters()}
    for rank, results in enumerate(dist_run(2, _final_params, BITWISE_CASES, 6)):
        for overrides, params in zip(BITWISE_CASES, results, strict=True):
            differ = [n for n, p in params.items() if not torch.equal(p, expected[n])]
            assert params and not differ, f"{overrides} rank {rank}: not bitwise: {differ[:4]}"
