"""parallel.ep in parallelize(): the tiny MoE Llama under EP2, EP4, EP2 x TP2 (etp 2, and etp 1: ep borrowing the tp
ranks), EP2 x FSDP2, PP2 x EP2, HSDP x EP, sequence parallelism with either etp, CP x EP, against
the single-device model through the parity harness (tests/parity.py: first loss, every gradient after one
backward, the losses of 2 AdamW steps with clipping; fp32, fixed seeds; loss rtol 1e-5 / atol 1e-6, gradients
within 1e-5 relative norm), dropless and with capacity factor 1.0 (which drops assignments on these batches).
Two AdamW steps, as the dense layouts (tests/test_parallel.py, test_pipeline.py): the second runs on the optimizer
state the first left, sharded as the layout shards it; a third checked nothing more. Two layers (layer 0 dense,
layer 1 MoE: gradients cross a MoE layer into a dense one) except under PP2, which needs a MoE layer on each stage.
Also: the gradient norm of each layout, and a DCP checkpoint saved under EP2 x FSDP2 loads under EP2 x TP2, where
each rank holds only its expert slice.
"""

from __future__ import annotations

import pytest
import torch

# layers=2: layer 0 dense (first_dense_layers=1), layer 1 MoE; PP3 (3 layers: 1-2 MoE) for PP2, so that each
# pipeline stage holds a MoE layer. A third layer elsewhere cost a third more CPU and checked nothing more.
MOE = ['model.preset="tiny-moe"', "model.layers=2", "model.aux_loss_coef=0.1", "train.steps=3"]
PP3 = "model.layers=3"
CAPACITY = "model.capacity_factor=1.0"
MB4 = "train.microbatch=4"  # without dp: 2 microbatches of 4 rows (accumulation still runs), not 4 of 2
STEPS = 2
EP2 = [['parallel.ep=2', 'parallel.dp_kind="ddp"'], ['parallel.ep=2', 'parallel.dp_kind="fsdp"', CAPACITY]]
BF16 = [['parallel.ep=2', 'parallel.dp_kind="ddp"', 'train.dtype="bf16"'],  # autocast
        ['parallel.ep=2', 'parallel.dp_kind="fsdp"', 'train.dtype="bf16"']]  # FSDP2 bf16 policy, expert units too
WORLD4 = [['parallel.ep=4', 'parallel.dp_kind="ddp"'],
          ['parallel.ep=4', 'parallel.dp_kind="fsdp"', CAPACITY],
          ['parallel.ep=2', 'parallel.tp=2', 'parallel.etp=2', 'parallel.dp_kind="ddp"', CAPACITY],
          ['parallel.ep=2', 'parallel.tp=2', 'parallel.etp=2', 'parallel.dp_kind="fsdp"'],
          ['parallel.ep=2', 'parallel.dp=4', 'parallel.dp_kind="fsdp"'],  # EP2 x FSDP2: edp = 2
          ['parallel.ep=2', 'parallel.dp=4', 'parallel.dp_kind="ddp"', CAPACITY],
          ['parallel.ep=2', 'parallel.pp=2', 'parallel.dp_kind="ddp"', PP3, CAPACITY],
          ['parallel.ep=2', 'parallel.pp=2', 'parallel.dp_kind="fsdp"', PP3],
          # HSDP x EP: dense weights (dp_replicate 2) x (dp_shard 2 = ep); experts on the 2-D (edp_replicate 2,
          # edp 1) mesh. The 8-rank layout with both above 1 is checked once by hand (docs/moe.md).
          ['parallel.ep=2', 'parallel.dp=4', 'parallel.dp_kind="hsdp"', 'parallel.dp_replicate=2', CAPACITY]]


def _cases(cases):
    from parity import parallel_run

    return [parallel_run(MOE + c, STEPS) for c in cases]


def _references(*models):
    """The single-device run of each model section (MOE plus `models` entries, each a tuple of model.* keys, and
    train.* keys where a case sets its microbatch: capacity and the aux loss are per microbatch)."""
    from parity import make_config, reference

    refs = {model: reference(make_config(MOE + list(model)), STEPS) for model in models or ((), (CAPACITY,))}
    assert all(ref["grad_norms"][0] > 1.0 for ref in refs.values())
    return refs


def _assert_layouts_match(refs, cases, per_rank):
    """Each case on every rank against the reference of its model section; the first step's gradient norm too."""
    from parity import assert_cases_match

    for i, case in enumerate(cases):
        ref = refs[tuple(c for c in case if c.startswith(("model.", "train.")))]
        assert_cases_match(ref, [case], [[results[i]] for results in per_rank])
        for results in per_rank:
            got = results[i]["grad_norms"][0]
            assert abs(got - ref["grad_norms"][0]) <= 1e-5 * ref["grad_norms"][0], (case, got)


def test_expert_layouts_match_single_device(dist_run):
    """EP2 on 2 ranks, the rest on 4, each against the single-device run of its model section; the gradient norm
    of the first step too (parallel/grad_norm.py: expert shards' squares summed over ep, tp and the pp stages,
    never over the edp replicas; within 1e-5). The reference norm is above 1, so clipping at 1.0 is active
    and a wrong norm would also change the later losses; dropping the expert gradients' 1/dp fails both."""
    from parity import make_config, reference

    refs = _references((), (CAPACITY,), (PP3,), (PP3, CAPACITY))
    for model in ((), (PP3,)):  # capacity 1.0 really drops assignments
        assert refs[model]["losses"][0] != refs[(*model, CAPACITY)]["losses"][0]
    for world, cases in ((2, EP2 + BF16), (4, WORLD4)):
        per_rank = dist_run(world, _cases, cases)
        if world == 2:  # bf16 through the dispatch: the losses of the bf16 single-device run, within 1e-3
            bf16 = reference(make_config(MOE + BF16[0][-1:]), STEPS)["losses"]
            for results in per_rank:
                for got in results[len(EP2):]:
                    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(bf16), rtol=1e-3, atol=0)
            per_rank = [results[:len(EP2)] for results in per_rank]
        _assert_layouts_match(refs, cases[:len(per_rank[0])], per_rank)


# etp = 1 with tp = 2: ep borrows the tp ranks, each tp rank routes its half of every sequence (capacity and the
# aux loss still over the whole microbatch); sequence parallelism with either etp; context parallelism: ep borrows
# the cp ranks (each routes its zig-zag half of every sequence), and cp x tp with etp = 1 under SP (capacity over
# the microbatch, its expert ids gathered over cp x tp). Two layers (one MoE): these layouts have no pp.
SPLIT = [['parallel.ep=2', 'parallel.tp=2', 'parallel.etp=1', 'parallel.dp_kind="fsdp"', CAPACITY],
         ['parallel.ep=2', 'parallel.tp=2', 'parallel.etp=2', 'parallel.sp=true', 'parallel.dp_kind="fsdp"', CAPACITY],
         ['parallel.cp=2', 'parallel.ep=2', 'parallel.dp_kind="ddp"', CAPACITY],
         ['parallel.cp=2', 'parallel.tp=2', 'parallel.etp=1', 'parallel.ep=4', 'parallel.sp=true',
          'parallel.dp_kind="fsdp"', CAPACITY, MB4]]


def test_expert_layouts_with_tp_or_cp_ranks_borrowed_and_sp_match_single_device(dist_run):
    """EP2 borrowing TP2 (etp=1, FSDP, capacity), EP2 x TP2 with SP (etp=2, FSDP, capacity), CP2 x EP2 borrowing CP (DDP, capacity), EP4 over CP2 x TP2 with SP (etp=1, FSDP,
    capacity): the parity harness on 4 ranks, as above. Making the aux loss's reduction over cp differentiate
    like tp's (identity) fails the CP2 x EP2 case; ranking capacity per rank instead of over the microbatch fails
    the capacity cases."""
    refs = _references((), (CAPACITY,), (CAPACITY, MB4))  # the first two as the test above (cached per session)
    _assert_layouts_match(refs, SPLIT, dist_run(4, _cases, SPLIT))


def test_the_config_names_the_field_of_a_bad_expert_layout():
    from parity import make_config

    from paratrain.config import resolve_degrees

    for overrides, match in ((['parallel.ep=3'], "parallel.ep=3 must divide model.num_experts=8"),
                             (['parallel.tp=4', 'train.seq_len=30'], "train.seq_len/cp = 30 must be divisible by tp=4"),
                             (['parallel.cp=2', 'parallel.tp=4', 'train.seq_len=36'],
                              "train.seq_len/cp = 18 must be divisible by tp=4")):
        with pytest.raises(ValueError, match=match):
            make_config(MOE + overrides)
    with pytest.raises(ValueError, match="ep=2"):
        make_config(['parallel.ep=2'])  # a dense model
    with pytest.raises(ValueError, match="parallel.ep=4 must divide the ranks of a pipeline stage .* = 2"):
        resolve_degrees(make_config(MOE + ['parallel.ep=4']).parallel, 2)
    hsdp = make_config(MOE + ['parallel.ep=4', 'parallel.dp_kind="hsdp"', 'parallel.dp_replicate=2']).parallel
    with pytest.raises(ValueError, match="parallel.ep=4 with parallel.dp_kind=.hsdp.: ep must divide the ranks of one shard group .* = 2"):
        resolve_degrees(hsdp, 4)  # ep borrows ranks of one shard group, never across replicas


def _full_state(state: dict) -> dict:
    from parity import full_tensor

    return {k: full_tensor(v).clone() for part in state.values() for k, v in part.items()
            if isinstance(v, torch.Tensor)}


def _save_then_load(folder: str):
    """Train one step under EP2 x FSDP2 (world 4: experts FSDP-sharded over dp_mod_ep 2), save model and AdamW
    state with DCP as the CheckpointManager does; load under EP4 x FSDP (another ep; model and optimizer) and
    under EP2 x TP2 (model) and compare every tensor; and the (global, local) shapes of each layout's expert weights."""
    import torch.distributed.checkpoint as dcp
    from parity import global_batch, make_config
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    from paratrain.parallel.mesh import init_distributed
    from paratrain.train.checkpoint import FORMAT_VERSION, state_dict_options, state_module
    from paratrain.train.loop import build_optimizer, build_runner

    def shapes(runner):
        return {n: (tuple(p.shape), tuple(p.to_local().shape)) for part in runner.parts
                for n, p in part.named_parameters() if ".experts." in n}

    env = init_distributed("cpu")
    model = MOE[:1] + ["model.layers=2"]  # layer 1 MoE: enough to reshard
    cfg = make_config(model + ['parallel.ep=2', 'parallel.dp=4', 'parallel.dp_kind="fsdp"'])
    runner = build_runner(cfg, env)
    opt = build_optimizer(runner, cfg.optim)
    x, y = global_batch(cfg, 0)
    runner.forward_backward(x[env.rank * 2:env.rank * 2 + 2], y[env.rank * 2:env.rank * 2 + 2])
    opt.step()
    options = state_dict_options(FORMAT_VERSION)
    model_sd, optim_sd = get_state_dict(state_module(runner.parts), opt, options=options)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    saved = _full_state({"model": model_sd, "optim": optim_sd})
    out = {"saved": shapes(runner)}
    # EP4 with its optimizer (another ep: every tensor moves); EP2 x TP2 the model only (each expert split in two)
    for name, layout, with_optim in (("ep4", ['parallel.ep=4', 'parallel.dp_kind="fsdp"'], True),
                                     ("ep2_tp2", ['parallel.ep=2', 'parallel.tp=2', 'parallel.etp=2'], False)):
        other_cfg = make_config(model + layout)
        other = build_runner(other_cfg, env)
        if with_optim:
            other_opt = build_optimizer(other, other_cfg.optim)
            model_sd, optim_sd = get_state_dict(state_module(other.parts), other_opt, options=options)
            state = {"model": model_sd, "optim": optim_sd}
        else:
            state = {"model": get_model_state_dict(state_module(other.parts))}
        dcp.load(state, checkpoint_id=folder)
        if with_optim:
            set_state_dict(state_module(other.parts), other_opt, model_state_dict=state["model"],
                           optim_state_dict=state["optim"], options=options)
            model_sd, optim_sd = get_state_dict(state_module(other.parts), other_opt, options=options)
            loaded = _full_state({"model": model_sd, "optim": optim_sd})
        else:
            set_model_state_dict(state_module(other.parts), state["model"])
            loaded = _full_state({"model": get_model_state_dict(state_module(other.parts))})
        want = {k: v for k, v in saved.items() if with_optim or k in loaded}
        same = {k: bool(torch.equal(want[k], loaded[k])) for k in want} if set(want) == set(loaded) else None
        out[name] = (same, shapes(other))
    return out


def test_dcp_checkpoint_reshards_expert_weights_and_ranks_hold_their_slice(dist_run, tmp_path):
    """Saved under EP2 x FSDP2 (dp 4), loaded under EP4 x FSDP (every parameter and AdamW moment bitwise) and
    under EP2 x TP2 (every parameter bitwise). Each rank holds only its slice: under EP2 x FSDP2 2 of the 8 experts (4 per ep rank,
    FSDP-sharded over the 2 dp_mod_ep replicas, not replicated); under EP4 2; under EP2 x TP2 4 of the 8 experts,
    half of each expert's width (w1 (E, ffn, h) = (8, 96, 128))."""
    out = dist_run(4, _save_then_load, str(tmp_path / "ckpt"))[0]
    for name in ("ep4", "ep2_tp2"):
        same, _ = out[name]
        assert same is not None, f"{name}: parameter names differ between the two layouts"
        assert any(".experts." in k for k in same), sorted(same)[:5]
        assert all(same.values()), (name, [k for k, ok in same.items() if not ok])
    assert any(k.startswith("state.") and ".experts." in k for k in out["ep4"][0])  # the AdamW moments too
    w1, w2 = "layers.1.feed_forward.experts.w1", "layers.1.feed_forward.experts.w2"
    assert out["saved"][w1] == ((8, 96, 128), (2, 96, 128))
    assert out["ep4"][1][w1] == ((8, 96, 128), (2, 96, 128))
    assert out["ep2_tp2"][1][w1] == ((8, 96, 128), (4, 48, 128))
    assert out["ep2_tp2"][1][w2] == ((8, 128, 96), (4, 128, 48))
