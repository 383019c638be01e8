"""Expert parallelism (parallel/expert.py) against the single-device MoE block, EP2 and EP4 on the gloo pool.

Each rank routes its own tokens (as data parallelism feeds it); the reference runs the full single-device block
on each rank's tokens. Compared, fp32, rtol 1e-5 / atol 1e-6: every rank's output, input gradient, router and
shared-expert gradients (per rank, before any data-parallel reduction), and each rank's expert-weight gradients
against the slice of the reference gradient summed over all ranks' tokens. Dropless and with capacity 1.0
(which drops on these tiny batches: checked).
"""

from __future__ import annotations

import pytest
import torch

from paratrain.model.config import ModelConfig
from paratrain.model.moe import MoE, router_metrics

SHAPE = dict(layers=1, hidden=16, heads=2, vocab=32, num_experts=8, experts_per_token=2, moe_ffn_hidden=8,
             shared_experts=1, aux_loss_coef=0.1)


def _block(capacity: float | None) -> MoE:
    torch.manual_seed(0)
    block = MoE(ModelConfig(**SHAPE, capacity_factor=capacity))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(2, 6 + 2 * rank, 16, generator=g), torch.randn(2, 6 + 2 * rank, 16, generator=g)


def _step(block, rank: int) -> dict:
    x, weight = _inputs(rank)
    x.requires_grad_(True)
    out = block(x)
    ((out * weight).sum() + block.last_aux_loss).backward()
    grads = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
             for n, p in block.named_parameters()}
    return {"out": out.detach(), "x_grad": x.grad, "grads": grads,
            "dropped": router_metrics(block.last_routing, SHAPE["num_experts"])["dropped_tokens"]}


def _ep_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",))


def _ep_rank(capacity):
    import torch.distributed as dist

    from paratrain.parallel.expert import ExpertParallelMoE

    return _step(ExpertParallelMoE(_block(capacity), _ep_mesh(), ("ep",)), dist.get_rank())


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("capacity", [None, 1.0])
def test_expert_parallel_equals_single_device(dist_run, world, capacity):
    results = dist_run(world, _ep_rank, capacity)
    refs = []
    for rank in range(world):
        refs.append(_step(_block(capacity), rank))
    local = SHAPE["num_experts"] // world
    if capacity is not None:
        assert sum(r["dropped"] for r in refs) > 0  # the capacity case really drops assignments
    for rank, (got, ref) in enumerate(zip(results, refs, strict=True)):
        assert got["dropped"] == ref["dropped"]
        torch.testing.assert_close(got["out"], ref["out"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["x_grad"], ref["x_grad"], rtol=1e-5, atol=1e-6)
        for name, g in got["grads"].items():
            if name.startswith("experts."):
                want = sum(r["grads"][name] for r in refs)[rank * local:(rank + 1) * local]
            else:  # replicated router / shared experts: this rank's tokens only
                want = ref["grads"][name]
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
        assert set(got["grads"]) == set(ref["grads"])


def test_expert_parallel_refuses_an_indivisible_expert_count(dist_run):
    for got in dist_run(2, _ep_odd):
        assert got.startswith("ValueError: model.num_experts=3 with ep=2: ep must divide num_experts"), got


def _ep_odd():
    """The refusal, caught on the rank and returned: a task that raises marks the pool broken, and the next 2-rank
    test would pay a fresh pool's cold start."""
    from paratrain.parallel.expert import ExpertParallelMoE

    torch.manual_seed(0)
    try:
        ExpertParallelMoE(MoE(ModelConfig(**{**SHAPE, "num_experts": 3})), _ep_mesh(), ("ep",))
    except ValueError as exc:
        return f"ValueError: {exc}"
    return "built"


MOE_MODEL = ['model.preset="tiny-moe"', "model.layers=2", "model.aux_loss_coef=0.1"]
DP_CASES = [['parallel.dp=2', 'parallel.dp_kind="ddp"'], ['parallel.dp=2', 'parallel.dp_kind="fsdp"'],
            ['parallel.dp=2', 'parallel.dp_kind="ddp"', "model.capacity_factor=1.0"]]
STEPS = 2  # AdamW steps: the second runs on the optimizer state the first left (as in the other parity tests)


def _dp_cases(cases):
    from parity import parallel_run

    return [parallel_run(MOE_MODEL + c, STEPS) for c in cases]


def test_moe_model_under_data_parallelism_matches_single_device(dist_run):
    """The whole MoE Llama (experts replicated, aux loss trained) under DDP2 / FSDP2 through the parity harness:
    loss, every gradient, 2 optimizer steps (tests/parity.py tolerances: loss rtol 1e-5, gradients 1e-5)."""
    from parity import assert_cases_match, make_config, reference

    per_rank = dist_run(2, _dp_cases, DP_CASES)
    for i, case in enumerate(DP_CASES):
        ref = reference(make_config(MOE_MODEL + [c for c in case if c.startswith("model.")]), STEPS)
        assert_cases_match(ref, [case], [[results[i]] for results in per_rank])


def test_a_resume_keeps_the_layouts_adamw_kernel(tmp_path):
    """Which AdamW kernel a parameter group runs (train.loop.build_optimizer: fused where the group is all
    plain or all DTensors, else the per-parameter loop) belongs to the layout, not to the checkpoint: a
    checkpoint written by fused groups (single process, FSDP, EP x FSDP) resumed where a group mixes DTensor
    and plain parameters (experts under DDP) must not switch the fused kernel on there (it rejects the mix).
    The hyperparameters (lr) and the moments still come from the checkpoint."""
    from paratrain.train.checkpoint import CheckpointManager

    def model_and_optimizer(seed, **kernel):
        torch.manual_seed(seed)
        model = torch.nn.Linear(8, 4)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1 * seed, **kernel)
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        return model, opt

    model, opt = model_and_optimizer(1, fused=True)
    CheckpointManager(tmp_path, keep=1, log=lambda _: None).save(1, [model], opt, {"step": 1})
    fresh, fresh_opt = model_and_optimizer(2, foreach=False)
    assert CheckpointManager(tmp_path, keep=1, log=lambda _: None).resume([fresh], fresh_opt).step == 1
    group = fresh_opt.param_groups[0]
    assert (group["fused"], group["foreach"], group["lr"]) == (None, False, 0.1)
    for a, b in zip(opt.state_dict()["state"].values(), fresh_opt.state_dict()["state"].values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
