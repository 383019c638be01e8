"""Uneven pipeline stages: the planner's choice of layers per stage (parallel.pp_layers), its step-time and memory
accounting, and the runtime accepting what `--write-config` writes."""

from __future__ import annotations

import itertools
import json
import tomllib

import numpy as np
import pytest

from paratrain.cli import main
from paratrain.model.config import PRESETS, ModelConfig
from paratrain.plan.api import Layout, estimate, search
from paratrain.plan.memory import activation_bytes_per_token
from paratrain.plan.options import Options
from paratrain.plan.stages import (
    MIN_GAIN,
    Loads,
    balanced_layers,
    balanced_loads,
    best_loads,
    check_pp_layers,
    rank_loads,
    rank_times,
    stage_ranks,
    stage_split,
)


def _slowest(loads: Loads, pp: int, v_shape: bool, c: float, e: float, h: float) -> float:
    return float(np.max(rank_times(loads, np.array(pp), np.array(v_shape), c, e, h)))


def _slowest_split(counts, ranks: list[int], pp: int, v_shape: bool, c: float, e: float, h: float) -> float:
    """Plain-Python slowest rank of a per-stage split (for brute force): layers x c, the embedding on stage 0's
    rank, the head on the last stage's rank."""
    times = [0.0] * pp
    for n, r in zip(counts, ranks, strict=True):
        times[r] += n * c
    times[ranks[0]] += e
    times[ranks[-1]] += h
    return max(times)


def _loads(counts, pp, v_shape) -> Loads:
    return Loads(*(np.array(float(n)) for n in rank_loads(counts, pp, v_shape)), np.array(False))


def _best(layers, pp, v, v_shape, c, e, h) -> Loads:
    bal = balanced_loads(layers, np.array(pp), np.array(v), np.array(v_shape))
    return best_loads(layers, np.array(float(pp)), np.array(float(v)), np.array(v_shape), np.array(c), e, h, bal)


# ---- the runtime's rules, restated torch-free ---------------------------------------------------------------
def test_balanced_split_and_stage_placement_are_the_runtimes():
    from paratrain.parallel import pipeline

    assert pipeline.balanced_layers is balanced_layers  # one implementation, shared (plan/ stays torch-free)
    for pp, chunks, schedule in [(4, 1, "1f1b"), (3, 3, "interleaved_1f1b"), (4, 2, "zbv")]:
        lay = pipeline.PipelineLayout(pp=pp, chunks_per_rank=chunks, layers_per_stage=(1,) * (pp * chunks),
                                      microbatches=8, pp_schedule=schedule)
        ours = stage_ranks(pp, chunks, schedule == "zbv")
        assert ours == [lay.rank_of_stage(s) for s in range(pp * chunks)], schedule


@pytest.mark.parametrize("split,ok", [((0, 5, 5, 6), True), ((4, 4, 4, 4), True), ((6, 5, 5, 0), True),
                                      ((4, 0, 6, 6), False), ((4, 4, 4), False), ((4, 4, 4, 5), False),
                                      ((-1, 6, 6, 5), False)])
def test_explicit_split_checked_like_the_runtime(split, ok):
    from paratrain.config import load_config
    from paratrain.parallel.pipeline import check_stages

    cfg = load_config(None, ['model.preset="tiny"', "model.layers=16", "model.vocab=256", "parallel.pp=4",
                             f"parallel.pp_layers={list(split)}"])
    if ok:
        assert check_pp_layers(split, 16, 4, 1) == split
        assert check_stages(cfg)[1] == list(split)
        return
    with pytest.raises(ValueError, match=r"pp_layers=\[") as ours:
        check_pp_layers(split, 16, 4, 1)
    assert "allowed" in str(ours.value)
    with pytest.raises(ValueError, match="pp_layers"):
        check_stages(cfg)


def test_estimate_refuses_bad_splits_naming_field_value_and_allowed():
    base = dict(tp=8, pp=4, sp=True)
    with pytest.raises(ValueError, match=r"pp_layers=\[8, 8, 8\]: 3 entries .* allowed"):
        estimate("llama3-8b", "p5.48xlarge", 4, 8192, 256, Layout(**base, pp_layers=(8, 8, 8)))
    with pytest.raises(ValueError, match=r"sums to 31 .* 32 layers"):
        estimate("llama3-8b", "p5.48xlarge", 4, 8192, 256, Layout(**base, pp_layers=(8, 8, 8, 7)))
    with pytest.raises(ValueError, match="pp_layers = 'even': allowed: balanced, auto"):
        estimate("llama3-8b", "p5.48xlarge", 4, 8192, 256, Layout(**base, pp_layers="even"))
    with pytest.raises(ValueError, match="needs parallel.pp > 1"):
        estimate("llama3-8b", "p5.48xlarge", 4, 8192, 256, Layout(tp=8, pp_layers=(32,)))


# ---- the choice ---------------------------------------------------------------------------------------------
def test_hand_computed_split():
    """16 layers on 4 ranks, a layer costs 1, the embedding 0.1, the head 2.5 (per microbatch).
    Balanced [4, 4, 4, 4]: the last rank takes 4 + 2.5 = 6.5. Within T = 5 the ranks hold at most 4 (first:
    floor(4.9)), 5, 5 and 2 (floor(2.5)) layers = 16: feasible. Within any T < 5 the two inner ranks hold at
    most 4 each and the first and last 4 and floor(T - 2.5) <= 2: 14 < 16. So T = 5, split [4, 5, 5, 2]."""
    loads = _best(16, 4, 1, False, 1.0, 0.1, 2.5)
    assert (float(loads.first), float(loads.last), float(loads.inner), bool(loads.balanced)) == (4, 2, 5, False)
    assert _slowest(loads, 4, False, 1.0, 0.1, 2.5) == pytest.approx(5.0)
    assert stage_split(16, 4, 1, False, 4, 2) == (4, 5, 5, 2)
    # a head cheaper than one layer: moving a whole layer off the last rank cannot help; balanced stays
    cheap = _best(16, 4, 1, False, 1.0, 0.1, 0.8)
    assert bool(cheap.balanced) and float(cheap.last) == 4


def _all_splits(layers: int, stages: int):
    """Every split the runtime accepts: inner stages >= 1 layer, the first and last >= 0."""
    for cuts in itertools.combinations_with_replacement(range(layers + 1), stages - 1):
        counts = np.diff((0, *cuts, layers))
        if all(n >= 1 for n in counts[1:-1]):
            yield tuple(int(n) for n in counts)


@pytest.mark.parametrize("layers,pp,v,v_shape", [(10, 2, 1, False), (12, 3, 1, False), (11, 4, 1, False),
                                                 (9, 3, 2, False), (12, 2, 3, False), (10, 3, 2, True),
                                                 (8, 2, 2, True)])
def test_choice_is_the_exact_optimum(layers, pp, v, v_shape):
    """Against brute force over every split the runtime accepts, for random per-layer, embedding and head
    costs: an uneven choice is the optimum; balanced is kept only when the optimum gains less than MIN_GAIN;
    never slower than balanced; the per-stage split built from the choice is valid and has its per-rank loads."""
    rng = np.random.default_rng(layers * 100 + pp * 10 + v)
    splits = list(_all_splits(layers, pp * v))
    for _ in range(25):
        c, e, h = rng.uniform(0.5, 2.0), rng.uniform(0.0, 1.0), rng.uniform(0.0, 6.0)
        ranks = stage_ranks(pp, v, v_shape)
        brute = min(_slowest_split(s, ranks, pp, v_shape, c, e, h) for s in splits)
        loads = _best(layers, pp, v, v_shape, c, e, h)
        got = _slowest(loads, pp, v_shape, c, e, h)
        balanced = _slowest(_loads(balanced_layers(layers, pp * v), pp, v_shape), pp, v_shape, c, e, h)
        assert got <= balanced + 1e-12
        if loads.balanced:
            assert got == balanced and brute >= balanced * (1 - MIN_GAIN) - 1e-12, (c, e, h)
        else:
            assert got == pytest.approx(brute, rel=1e-12), (c, e, h)
            split = stage_split(layers, pp, v, v_shape, int(loads.first), int(loads.last))
            check_pp_layers(split, layers, pp, v)
            assert rank_loads(split, pp, v_shape) == (loads.first, loads.last, loads.inner)


# ---- end to end: the planner's own costs -------------------------------------------------------------------
def _shape(vocab: int) -> ModelConfig:
    """llama3-8b's blocks (16 of them) with a chosen vocabulary: the head costs ~vocab / 52k layers' matmuls."""
    return PRESETS["llama3-8b"].model_copy(update={"name": f"v{vocab}", "layers": 16, "vocab": vocab})


def test_huge_vocabulary_gets_a_lighter_last_stage_tiny_one_stays_balanced():
    layout = Layout(tp=8, pp=4, sp=True, recompute="selective", pp_layers="auto")
    huge = estimate(_shape(512_000), "p5.48xlarge", 4, 8192, 64, layout)
    assert huge.layout.pp_layers[-1] < 4 and sum(huge.layout.pp_layers) == 16
    assert huge.step_time_s < huge.balanced_step_time_s
    assert any("step time -" in n and "vs the balanced [4 x 4]" in n for n in huge.notes), huge.notes
    tiny = estimate(_shape(256), "p5.48xlarge", 4, 8192, 64, layout)
    assert tiny.layout.pp_layers == (4, 4, 4, 4) and tiny.balanced_step_time_s is None


CASES = [("llama3-8b", 8, 8, "1f1b", 1), ("llama3-8b", 4, 4, "interleaved_1f1b", 2), ("llama3-8b", 4, 4, "zbv", 2),
         ("llama3-70b", 8, 8, "1f1b", 1), ("llama3-70b", 8, 4, "zbv", 2), ("llama3.1-405b", 32, 16, "1f1b", 1),
         ("llama2-13b", 4, 4, "gpipe", 1)]


@pytest.mark.parametrize("model,nodes,pp,schedule,v", CASES)
def test_chosen_split_is_never_slower_and_estimate_reproduces_it(model, nodes, pp, schedule, v):
    base = dict(tp=8, pp=pp, sp=True, recompute="selective", pp_schedule=schedule, virtual_stages=v)
    balanced = estimate(model, "p5.48xlarge", nodes, 8192, 256, Layout(**base))
    auto = estimate(model, "p5.48xlarge", nodes, 8192, 256, Layout(**base, pp_layers="auto"))
    assert auto.step_time_s <= balanced.step_time_s * (1 + 1e-12)
    again = estimate(model, "p5.48xlarge", nodes, 8192, 256, Layout(**base, pp_layers=auto.layout.pp_layers))
    assert again.step_time_s == pytest.approx(auto.step_time_s, rel=1e-12)
    assert again.memory_per_device_bytes == pytest.approx(auto.memory_per_device_bytes, rel=1e-12)


def test_v_schedule_unloads_the_rank_with_embedding_and_head():
    """zbv puts stage 0 (embedding) and stage 2p-1 (head) on rank 0: that rank gets fewer layers."""
    est = estimate("llama3-8b", "p5.48xlarge", 4, 8192, 256, Layout(tp=8, pp=4, sp=True, pp_schedule="zbv",
                                                                   virtual_stages=2, pp_layers="auto"))
    split = est.layout.pp_layers
    assert split[0] + split[-1] < 8 and est.step_time_s < est.balanced_step_time_s


def test_faster_split_that_would_not_fit_falls_back_to_balanced():
    """llama3-8b, TP 4 x PP 8, microbatch 4, no recompute: the chosen [4, 5, 4 x 5, 3] needs more memory than
    balanced (an inner rank holds 5 layers of 8 in-flight microbatches). With the usable memory between the
    two, the planner keeps the balanced split, which fits."""
    import dataclasses

    from paratrain.hardware.catalog import resolve_system

    p5 = resolve_system("p5.48xlarge")
    layout = dict(tp=4, pp=8, sp=True, microbatch=4)
    auto = estimate("llama3-8b", p5, 4, 8192, 256, Layout(**layout, pp_layers="auto"))
    even = estimate("llama3-8b", p5, 4, 8192, 256, Layout(**layout))
    assert auto.layout.pp_layers != even.layout.pp_layers
    assert auto.memory_per_device_bytes > even.memory_per_device_bytes and auto.fits
    room = auto.memory_capacity_bytes / p5.efficiency.memory_usable_fraction  # HBM less the runtime's reservations
    middle = (auto.memory_per_device_bytes + even.memory_per_device_bytes) / 2 / room
    tight = dataclasses.replace(p5, efficiency=dataclasses.replace(p5.efficiency, memory_usable_fraction=middle))
    kept = estimate("llama3-8b", tight, 4, 8192, 256, Layout(**layout, pp_layers="auto"))
    assert kept.layout.pp_layers == even.layout.pp_layers and kept.fits
    assert kept.step_time_s == pytest.approx(even.step_time_s, rel=1e-12)


def test_memory_counts_the_most_loaded_rank(box_system):
    """An explicit split [2, 14, 14, 2] of llama2-7b: the inner ranks hold 14 layers' activations (the second
    rank 3 microbatches in flight under 1F1B at pp 4: p - r) and no logits; that rank is the one reported."""
    model = PRESETS["llama2-7b"]
    est = estimate(model, box_system, 4, 4096, 32, Layout(tp=8, pp=4, dp=1, sp=True, microbatch=1,
                                                          pp_layers=(2, 14, 14, 2)), Options())
    sp_part, tp_part, core = activation_bytes_per_token(model, 4096, "flash")
    full_layer = 4096 * (sp_part + tp_part + core) / 8
    assert est.memory_breakdown_bytes["activations"] == pytest.approx(14 * full_layer * 3)
    params = 14 * model.params_per_layer() / 8
    assert est.memory_breakdown_bytes["weights"] == pytest.approx(2 * params)


def test_search_ranks_with_the_chosen_split():
    """The search ranks each pipelined layout with its best split; estimate of the returned layout agrees."""
    res = search("llama3-8b", "p5.48xlarge", 4, 8192, 256, top=5, constraints={"pp": [8], "tp": [4]})
    assert res.candidates
    for cand in res.candidates:
        assert len(cand.layout.pp_layers) == 8 * cand.layout.virtual_stages
        again = estimate("llama3-8b", "p5.48xlarge", 4, 8192, 256, cand.layout)
        assert again.step_time_s == pytest.approx(cand.step_time_s, rel=1e-12)
    assert any(c.balanced_step_time_s is not None for c in res.candidates)


# ---- CLI and the written config ----------------------------------------------------------------------------
EIGHT_B = ["--model", "llama3-8b", "--hardware", "p5.48xlarge", "--nodes", "4", "--seq", "8192",
           "--global-batch", "256", "--tp", "4", "--pp", "8", "--sp", "--recompute", "selective"]


def test_estimate_cli_reports_the_split(capsys):
    assert main(["estimate", *EIGHT_B, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    split = data["layout"]["pp_layers"]
    assert isinstance(split, list) and sum(split) == 32 and split != [4] * 8
    assert data["balanced_step_time_s"] > data["step_time_s"]
    assert main(["estimate", *EIGHT_B, "--pp-layers", "balanced"]) == 0
    assert "layers per stage [4 x 8] (balanced)" in capsys.readouterr().out
    assert main(["estimate", *EIGHT_B, "--pp-layers", "4,4,x"]) == 2
    assert "--pp-layers = '4,4,x': allowed: auto, balanced" in capsys.readouterr().err


def test_written_split_is_accepted_by_the_runtime(tmp_path, capsys):
    from paratrain.config import load_config
    from paratrain.parallel.pipeline import check_pipeline_layout

    path = tmp_path / "planned.toml"
    assert main(["estimate", *EIGHT_B, "--write-config", str(path), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    written = tomllib.loads(path.read_text())["parallel"]["pp_layers"]
    assert written == planned["layout"]["pp_layers"]
    cfg = load_config(path)
    layout = check_pipeline_layout(cfg, planned["layout"]["dp"])
    assert list(layout.layers_per_stage) == written
    # a balanced plan writes no pp_layers (the runtime's default)
    assert main(["estimate", *EIGHT_B, "--pp-layers", "balanced", "--write-config", str(path)]) == 0
    assert "pp_layers" not in tomllib.loads(path.read_text())["parallel"]


@pytest.fixture()
def box_system(tmp_path):
    from test_hardware_catalog import USER_SYSTEM  # tests/ is on sys.path (pytest rootdir import)

    from paratrain.hardware.catalog import resolve_system

    path = tmp_path / "box.toml"
    path.write_text(USER_SYSTEM)
    return resolve_system(str(path))


def test_search_finds_pipeline_degrees_that_do_not_divide_the_layers():
    """126 layers at PP 32 and a 70-layer model at PP 12 (uneven stages, as the runtime accepts them)."""
    from paratrain.model.config import load_model_config
    from paratrain.plan.api import search

    res = search("llama3.1-405b", "p5.48xlarge", 128, 8192, 512, top=1, constraints={"pp": [32]})
    assert res.candidates, "no 405B layout at PP 32"
    best = res.candidates[0].layout
    assert best.pp == 32 and sum(best.pp_layers) == 126 and len(set(best.pp_layers)) > 1
    seventy = load_model_config("llama3-70b").model_copy(update={"layers": 70, "name": "llama-70-layers"})
    res = search(seventy, "p5.48xlarge", 12, 8192, 96, top=1, constraints={"pp": [12]})
    assert res.candidates and res.candidates[0].layout.pp == 12
    assert sum(res.candidates[0].layout.pp_layers) == 70


# ---- empty end stages: one rule for the stage count and for explicit splits ----------------------------------
def test_stage_count_rule_is_the_sum_of_the_per_stage_minimum():
    """stages_le_layers and check_pp_layers read one rule (config.rules.fewest_stage_layers): the fewest layers
    that fill S stages is what every stage may hold at least, summed, and the runtime's balanced split of that
    many layers is the split the rule describes (inner stages one layer, the ends none)."""
    from paratrain.config.rules import fewest_layers, fewest_stage_layers

    for stages in (2, 3, 4, 34, 128):
        fewest = int(fewest_layers(stages))
        assert fewest == sum(int(fewest_stage_layers(i, stages)) for i in range(stages))
        assert balanced_layers(fewest, stages) == [0] + [1] * (stages - 2) + [0]
        assert check_pp_layers(balanced_layers(fewest, stages), fewest, stages, 1) == (0,) + (1,) * (stages - 2) + (0,)


# 32 layers on 2 ranks x 17 chunks = 34 stages: the first and the last chunk hold only the embedding / the head
META_ENDS = ["--model", "llama3-8b", "--hardware", "p5.48xlarge", "--nodes", "4", "--seq", "8192",
             "--global-batch", "256", "--tp", "4", "--pp", "2", "--sp", "--recompute", "selective",
             "--pp-schedule", "interleaved_1f1b"]


def test_empty_end_chunks_are_accepted_and_too_many_stages_refused(capsys):
    from paratrain.config import load_config
    from paratrain.parallel.pipeline import check_stages

    ends = ",".join(["0"] + ["1"] * 32 + ["0"])
    assert main(["estimate", *META_ENDS, "--virtual-stages", "17", "--pp-layers", ends, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["pp_layers"] == [0] + [1] * 32 + [0]
    # the balanced split of 32 layers over 34 stages is the same one
    est = estimate("llama3-8b", "p5.48xlarge", 4, 8192, 256,
                   Layout(tp=4, pp=2, sp=True, recompute="selective", pp_schedule="interleaved_1f1b",
                          virtual_stages=17, pp_layers="balanced"))
    explicit = estimate("llama3-8b", "p5.48xlarge", 4, 8192, 256,
                        Layout(tp=4, pp=2, sp=True, recompute="selective", pp_schedule="interleaved_1f1b",
                               virtual_stages=17, pp_layers=(0,) + (1,) * 32 + (0,)))
    assert list(est.layout.pp_layers) == [0] + [1] * 32 + [0]
    assert est.step_time_s == pytest.approx(explicit.step_time_s, rel=1e-12)
    # the trainer reads the same layout the same way
    cfg = load_config(None, ['model.preset="tiny"', "model.layers=32", "model.vocab=256", "parallel.pp=2",
                             'parallel.pp_schedule="interleaved_1f1b"', "parallel.virtual_stages=17",
                             f"parallel.pp_layers=[{ends}]"])
    assert check_stages(cfg) == (17, [0] + [1] * 32 + [0])
    # 36 stages cannot be filled by 32 layers; an empty inner stage is refused too
    assert main(["estimate", *META_ENDS, "--virtual-stages", "18"]) == 2
    err = capsys.readouterr().err
    assert "parallel.pp=2 x 18 chunk(s) per rank = 36 pipeline stages need at least 34 layers" in err
    assert "but the model has 32; allowed: stages <= model.layers + 2" in err
    inner_empty = ",".join(["1", "0"] + ["1"] * 31 + ["0"])
    assert main(["estimate", *META_ENDS, "--virtual-stages", "17", "--pp-layers", inner_empty]) == 2
    assert "stage(s) [1] would hold no work; allowed: >= 1 layer per inner stage" in capsys.readouterr().err
