"""parallel.ep in parallelize(): the tiny MoE Llama under EP2, EP4, EP2 x TP2, EP2 x FSDP2 and PP2 x EP2 against
the single-device model through the parity harness (tests/parity.py: first loss, every gradient after one
backward, the losses of 3 AdamW steps with clipping; fp32, fixed seeds; loss rtol 1e-5 / atol 1e-6, gradients
within 1e-5 relative norm), dropless and with capacity factor 1.0 (which drops assignments on these batches).
Also: each rank materialises only its expert slice, and a DCP checkpoint saved under EP2 x FSDP2 loads under EP4.
"""

from __future__ import annotations

import pytest
import torch

# layers=3: layer 0 dense (first_dense_layers=1), 1-2 MoE, so each pipeline stage of PP2 holds a MoE layer
MOE = ['model.preset="tiny-moe"', "model.layers=3", "model.aux_loss_coef=0.1", "train.steps=3"]
CAPACITY = "model.capacity_factor=1.0"
EP2 = [['parallel.ep=2', 'parallel.dp_kind="ddp"'], ['parallel.ep=2', 'parallel.dp_kind="fsdp"', CAPACITY]]
WORLD4 = [['parallel.ep=4', 'parallel.dp_kind="ddp"'],
          ['parallel.ep=4', 'parallel.dp_kind="fsdp"', CAPACITY],
          ['parallel.ep=2', 'parallel.tp=2', 'parallel.etp=2', 'parallel.dp_kind="ddp"', CAPACITY],
          ['parallel.ep=2', 'parallel.tp=2', 'parallel.etp=2', 'parallel.dp_kind="fsdp"'],
          ['parallel.ep=2', 'parallel.dp=4', 'parallel.dp_kind="fsdp"'],  # EP2 x FSDP2: dp_mod_ep = 2
          ['parallel.ep=2', 'parallel.dp=4', 'parallel.dp_kind="ddp"', CAPACITY],
          ['parallel.ep=2', 'parallel.pp=2', 'parallel.dp_kind="ddp"', CAPACITY],
          ['parallel.ep=2', 'parallel.pp=2', 'parallel.dp_kind="fsdp"']]


def _cases(cases):
    from parity import parallel_run

    return [parallel_run(MOE + c) for c in cases]


def _check(dist_run, world, cases):
    from parity import assert_cases_match, make_config, reference

    per_rank = dist_run(world, _cases, cases)
    refs = {}
    for i, case in enumerate(cases):
        model = tuple(c for c in case if c.startswith("model."))
        if model not in refs:
            refs[model] = reference(make_config(MOE + list(model)))
        assert_cases_match(refs[model], [case], [[results[i]] for results in per_rank])


def test_ep2_matches_single_device(dist_run):
    _check(dist_run, 2, EP2)


def test_ep4_tp_fsdp_pp_compositions_match_single_device(dist_run):
    _check(dist_run, 4, WORLD4)


def _norms(cases):
    """The gradient norm `clip_grad_norm_` computes after the first backward, per layout (no clipping)."""
    from parity import global_batch, make_config

    from paratrain.parallel.mesh import init_distributed
    from paratrain.train.loop import build_runner

    env, norms = init_distributed("cpu"), []
    for case in cases:
        cfg = make_config(MOE + case)
        runner = build_runner(cfg, env)
        x, y = global_batch(cfg, 0)
        per = cfg.train.global_batch // runner.dp_size
        runner.forward_backward(x[runner.dp_rank * per:(runner.dp_rank + 1) * per],
                                y[runner.dp_rank * per:(runner.dp_rank + 1) * per])
        norms.append(float(runner.clip_grad_norm_(0.0)))
    return norms


def test_gradient_norm_counts_each_expert_shard_once(dist_run):
    """parallel/grad_norm.py over the expert DTensors: squares summed over ep and tp (and the pp stages), never
    over the dp_mod_ep replicas; equal to the single-device norm within 1e-5 (the parity runs clip at 1.0 with
    this norm above 1, so a wrong norm would also change their later losses)."""
    from parity import global_batch, make_config

    from paratrain.parallel.mesh import DistEnv
    from paratrain.train.loop import build_runner

    cases = [['parallel.ep=2', 'parallel.dp=4', 'parallel.dp_kind="ddp"'],
             ['parallel.ep=2', 'parallel.tp=2', 'parallel.etp=2', 'parallel.dp_kind="fsdp"'],
             ['parallel.ep=2', 'parallel.pp=2', 'parallel.dp_kind="ddp"']]
    per_rank = dist_run(4, _norms, cases)
    cfg = make_config(MOE)
    runner = build_runner(cfg, DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    x, y = global_batch(cfg, 0)
    runner.forward_backward(x, y)
    want = float(runner.clip_grad_norm_(0.0))
    assert want > 1.0  # so grad_clip=1.0 in the parity runs really clips
    for rank, norms in enumerate(per_rank):
        for case, got in zip(cases, norms, strict=True):
            assert abs(got - want) <= 1e-5 * want, (rank, case, got, want)


def _local_expert_shapes():
    from parity import make_config

    from paratrain.parallel.mesh import init_distributed
    from paratrain.train.loop import build_runner

    runner = build_runner(make_config(MOE + ['parallel.ep=2', 'parallel.tp=2', 'parallel.etp=2']),
                          init_distributed("cpu"))
    return {n: (tuple(p.shape), tuple(p.to_local().shape)) for part in runner.parts
            for n, p in part.named_parameters() if ".experts." in n}


def test_each_rank_materialises_only_its_expert_slice(dist_run):
    shapes = dist_run(4, _local_expert_shapes)[0]
    assert shapes  # (E, ffn, h) = (8, 96, 128): 4 experts per ep rank, half of each expert's width per tp rank
    assert shapes["layers.1.feed_forward.experts.w1"] == ((8, 96, 128), (4, 48, 128))
    assert shapes["layers.1.feed_forward.experts.w2"] == ((8, 128, 96), (4, 128, 48))


def test_the_config_names_the_field_of_a_bad_expert_layout():
    from parity import make_config

    from paratrain.config import resolve_degrees

    for overrides, match in ((['parallel.ep=3'], "parallel.ep=3 must divide model.num_experts=8"),
                             (['parallel.tp=2'], "parallel.etp=1 with parallel.tp=2"),
                             (['parallel.cp=2'], "parallel.cp=2 with model.num_experts=8"),
                             (['parallel.ep=2', 'parallel.dp_kind="hsdp"'], "dp_kind='hsdp'")):
        with pytest.raises(ValueError, match=match):
            make_config(MOE + overrides)
    with pytest.raises(ValueError, match="ep=2"):
        make_config(['parallel.ep=2'])  # a dense model
    with pytest.raises(ValueError, match="parallel.ep=4 must divide the data-parallel size 2"):
        resolve_degrees(make_config(MOE + ['parallel.ep=4']).parallel, 2)


def _save_then_load(folder: str):
    """Train one step under EP2 x DP2 (world 4), save with DCP; load under EP4 and compare every parameter."""
    import torch.distributed.checkpoint as dcp
    from parity import full_tensor, global_batch, make_config
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from paratrain.parallel.mesh import init_distributed
    from paratrain.train.checkpoint import state_module
    from paratrain.train.loop import build_optimizer, build_runner

    env = init_distributed("cpu")
    cfg = make_config(MOE + ['parallel.ep=2', 'parallel.dp=4', 'parallel.dp_kind="fsdp"'])
    runner = build_runner(cfg, env)
    opt = build_optimizer(runner, cfg.optim)
    x, y = global_batch(cfg, 0)
    runner.forward_backward(x[env.rank * 2:env.rank * 2 + 2], y[env.rank * 2:env.rank * 2 + 2])
    opt.step()
    saved = {k: full_tensor(v).clone() for k, v in get_model_state_dict(state_module(runner.parts)).items()}
    dcp.save(get_model_state_dict(state_module(runner.parts)), checkpoint_id=folder)
    other = build_runner(make_config(MOE + ['parallel.ep=4', 'parallel.dp_kind="ddp"']), env)
    state = get_model_state_dict(state_module(other.parts))
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(state_module(other.parts), state)
    loaded = {k: full_tensor(v) for k, v in get_model_state_dict(state_module(other.parts)).items()}
    return {k: bool(torch.equal(saved[k], loaded[k])) for k in saved} if set(saved) == set(loaded) else None


def test_dcp_checkpoint_saved_under_ep2_loads_under_ep4(dist_run, tmp_path):
    result = dist_run(4, _save_then_load, str(tmp_path / "ckpt"))[0]
    assert result is not None, "parameter names differ between the EP2 and EP4 layouts"
    assert any(".experts." in k for k in result)
    assert all(result.values()), [k for k, ok in result.items() if not ok]
