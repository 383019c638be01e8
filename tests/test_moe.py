"""The single-device MoE block (model/moe.py) against a per-token loop, its config, presets and router metrics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from paratrain.model.config import PRESETS, ModelConfig
from paratrain.model.llama import Llama, aux_loss, cross_entropy_loss
from paratrain.model.moe import MoE, route, router_metrics

TINY = dict(layers=2, hidden=16, heads=2, vocab=64, max_seq=32, num_experts=4, experts_per_token=2,
            moe_ffn_hidden=8)


def _moe(seed: int = 0, **over) -> MoE:
    cfg = ModelConfig(**{**TINY, **over})
    torch.manual_seed(seed)
    block = MoE(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


def _loop_reference(block: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: score, top-k, renormalise, capacity in token order, dense SwiGLU of each chosen expert."""
    cfg, ex = block.cfg, block.experts
    logits = x @ block.router.weight.T
    scores = logits.softmax(-1) if cfg.router_score == "softmax" else logits.sigmoid()
    cap = math.inf if cfg.capacity_factor is None else math.ceil(
        cfg.capacity_factor * x.shape[0] * cfg.experts_per_token / cfg.num_experts)
    taken = [0] * cfg.num_experts
    out = []
    for t in range(x.shape[0]):
        w, idx = scores[t].topk(cfg.experts_per_token)
        w = w / w.sum() if cfg.router_norm_topk else w
        y = torch.zeros_like(x[t])
        for wi, e in zip(w, idx.tolist(), strict=True):
            taken[e] += 1
            if taken[e] <= cap:
                y = y + wi * ((F.silu(ex.w1[e] @ x[t]) * (ex.w3[e] @ x[t])) @ ex.w2[e].T)
        if block.shared_experts is not None:
            y = y + block.shared_experts(x[t])
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("over", [{}, {"capacity_factor": 0.5}, {"router_score": "sigmoid", "shared_experts": 1},
                                  {"router_norm_topk": False, "capacity_factor": 1.0, "experts_per_token": 1}])
def test_moe_block_equals_per_token_loop(over):
    block = _moe(**over)
    x = torch.randn(3, 10, 16, generator=torch.Generator().manual_seed(1))
    got = block(x)
    want = _loop_reference(block, x.reshape(-1, 16)).view_as(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if over.get("capacity_factor") == 0.5:  # the cap really drops: cap = ceil(0.5 * 30 * 2 / 4) = 8 of 60
        assert router_metrics(block.last_routing, 4)["dropped_tokens"] > 0


def test_aux_loss_is_transformers_load_balancing_loss():
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    cfg = ModelConfig(**TINY)
    logits = torch.randn(40, 4, generator=torch.Generator().manual_seed(2))
    want = mixtral.load_balancing_loss_func((logits,), num_experts=4, top_k=2)
    torch.testing.assert_close(route(logits, cfg).aux_loss, want, rtol=1e-6, atol=0)


def test_llama_builds_moe_after_first_dense_layers_and_trains():
    cfg = PRESETS["tiny-moe"].model_copy(update={"vocab": 128, "layers": 3})
    model = Llama(cfg)
    model.init_weights(seed=3)
    kinds = [type(model.layers[str(i)].feed_forward).__name__ for i in range(3)]
    assert kinds == ["FeedForward", "MoE", "MoE"]
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    aux = aux_loss(model)
    assert aux is None  # no forward yet
    loss = cross_entropy_loss(model(tokens)[:, :-1], tokens[:, 1:])
    aux = aux_loss(model)
    assert aux is not None and float(aux.detach()) > 0
    (loss + aux).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing
    # Layout-independent init covers the stacked expert weights; the residual projection is scaled down.
    w2 = model.layers["1"].feed_forward.experts.w2
    assert 0.5 * 0.02 / math.sqrt(6) < float(w2.std()) < 1.5 * 0.02 / math.sqrt(6)


def test_router_metrics():
    block = _moe()
    block(torch.randn(1, 20, 16, generator=torch.Generator().manual_seed(5)))
    m = router_metrics(block.last_routing, 4)
    assert sum(m["tokens_per_expert"]) == 40 and m["dropped_tokens"] == 0
    assert m["load_imbalance"] == max(m["tokens_per_expert"]) / 10
    assert 0 < m["router_entropy"] <= math.log(4)


@pytest.mark.parametrize("over, field", [({"experts_per_token": 5}, "experts_per_token"),
                                         ({"first_dense_layers": 2}, "first_dense_layers"),
                                         ({"router_score": "relu"}, "router_score"),
                                         ({"capacity_factor": 0.0}, "capacity_factor")])
def test_bad_moe_config_names_the_field(over, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**{**TINY, **over})


# (preset, published total, published active, relative tolerance, why that tolerance)
PUBLISHED = [("mixtral-8x7b", 46.7e9, 12.9e9, 0.01, "rounding of the published numbers"),
             ("qwen3-30b-a3b", 30.5e9, 3.3e9, 0.02, "3.3B is rounded to 0.1B (1.5%)"),
             ("deepseek-v3", 671e9, 37e9, 0.02, "671.03B; 37B is 37.55B rounded down (1.5%)")]


@pytest.mark.parametrize("name, total, active, tol, why", PUBLISHED)
def test_moe_preset_parameter_counts(name, total, active, tol, why):
    cfg = PRESETS[name]
    assert cfg.num_params() == pytest.approx(total, rel=tol), why
    assert cfg.active_params() == pytest.approx(active, rel=tol), why


def test_mla_and_mtp_are_planner_only_shapes():
    """DeepSeek-V3's MLA (187.1M a layer) and its MTP depth (11.6B of its own; 684.5B with the checkpoint's copies of
    the embedding and head, the report's 671B + 14B) are counted, and a training config is refused naming the field."""
    from paratrain.config.rules import View, check
    cfg = PRESETS["deepseek-v3"]
    assert cfg.mla.attention_params(cfg.hidden, cfg.heads) == 187_107_328
    assert cfg.num_params() + cfg.mtp_params() + 2 * cfg.vocab * cfg.hidden == pytest.approx(684.5e9, rel=1e-3)
    view = dict(tp=1, pp=1, cp=1, sp=False, schedule="1f1b", virtual_stages=1, dp_kind="ddp", zero=0, seq=4096)
    check(View(**view, model=cfg), runtime=False)  # the planner's view accepts it
    for over, field in (({"mtp_layers": 0}, "model.mla"), ({"mla": None}, "model.mtp_layers")):
        with pytest.raises(ValueError, match=field):
            check(View(**view, model=cfg.model_copy(update=over)))


def test_moe_param_count_matches_the_module():
    cfg = PRESETS["tiny-moe"]
    assert cfg.num_params() == sum(p.numel() for p in Llama(cfg).parameters())


def test_runner_trains_the_aux_loss_and_reports_the_lm_loss():
    from parity import make_config, reference

    base = ['model.preset="tiny-moe"', "model.layers=2", "train.global_batch=2"]
    with_aux = reference(make_config(base + ["model.aux_loss_coef=0.5"]), steps=1)
    without = reference(make_config(base + ["model.aux_loss_coef=0.0"]), steps=1)
    # Same weights and batch: the same reported (language-model) loss, a different router gradient only.
    assert with_aux["losses"] == without["losses"]
    router = "layers.1.feed_forward.router.weight"
    assert not torch.allclose(with_aux["grads"][router], without["grads"][router])
    torch.testing.assert_close(with_aux["grads"]["layers.1.feed_forward.experts.w1"],
                               without["grads"]["layers.1.feed_forward.experts.w1"], rtol=0, atol=0)


def test_paratrain_train_logs_router_metrics(tmp_path, capsys):
    import json

    from paratrain.cli import main

    sets = ['model.preset="tiny-moe"', "model.layers=2", "model.vocab=320", "data.vocab_size=300",
            "data.max_source_bytes=60000", f'data.prepared_dir="{tmp_path / "data"}"', "train.steps=2",
            "train.log_every=1", "train.global_batch=4", "train.microbatch=2", "train.seq_len=32",
            "train.progress=false", f'metrics.run_dir="{tmp_path / "run"}"', "checkpoint.save_final=false"]
    assert main(["train", *[a for s in sets for a in ("--set", s)], "--json"]) == 0
    capsys.readouterr()
    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(steps) == 2
    for r in steps:  # the step's 2 microbatches: 4 x 32 tokens, top 2, one MoE layer (layer 0 dense), dropless
        assert sum(r["moe_tokens_per_expert"]) == 4 * 32 * 2 and r["moe_dropped_tokens"] == 0
        assert r["moe_load_imbalance"] >= 1 and 0 < r["moe_router_entropy"] <= math.log(8)


@pytest.mark.parametrize("overrides, message", [
    (['parallel.vocab_parallel="dp"'], "parallel.vocab_parallel='dp' with model.num_experts=8"),
    (['staleness.policy="bounded_staleness"', 'parallel.dp_kind="ddp"'], "staleness.policy='bounded_staleness' with"),
])
def test_train_config_refuses_what_moe_does_not_compose_with_yet(overrides, message):
    from paratrain.config import load_config

    with pytest.raises(ValueError, match=message):
        load_config(None, ['model.preset="tiny-moe"', *overrides])
