"""The serving model (plan/serve.py), its cost (cost/serving.py), the `serve` CLI, and its accuracy against
published serving measurements (benchmarks/serving_accuracy.py; docs/serving.md)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from paratrain.cli import main
from paratrain.cost.serving import recommend, serving_cost
from paratrain.hardware.catalog import resolve_system
from paratrain.model.config import PRESETS, ModelConfig
from paratrain.plan.serve import (
    PAGE_TOKENS,
    Replica,
    Target,
    decode_step_s,
    estimate,
    heads_per_device,
    inter_token_s,
    kv_bytes_per_token,
    max_sequences,
    operating_point,
    plan,
    prefill_time_s,
    serving_efficiency,
    serving_stacks,
    weight_bytes_per_device,
)

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "serving_accuracy.py"
L70 = PRESETS["llama3-70b"]
H100 = "p5.48xlarge"

# Evaluation rows the model misses by more than 20%, and why (docs/serving.md "Where it misses"). The test
# fails if one of them starts to pass (remove it here) or any other evaluation row misses.
KNOWN_MISSES = {
    # transformers-neuronx long-prompt prefill (4k-8k tokens) of Llama-2-13B / CodeLlama-13B / Mistral-7B on trn1
    # (TP 32): 2.4-2.6x slower than the same SDK's inf2.48xlarge rows (TP 24, the same NeuronCore-v2), which
    # the model predicts within 20%: not the chip (fewer cores beat more), an unpublished setting of those runs
    "neuron-trn1-llama-2-13b-ttft-8192-8192", "neuron-trn1-mistral-7b-ttft-8192-8192",
    "neuron-trn1-codellama-13b-ttft-4096-4096", "neuron-trn1-codellama-13b-ttft-8192-8192",
    # Mistral-7B decode at a 12k-token context (16k bucket): the decode step grows ~0.4 us per bucket position
    # in every trn1 model, more than its KV bytes say (1 kv head per core here, 2 in the 13B/70B rows)
    "neuron-trn1-mistral-7b-tpot-8192-8192",
    # 128-token prompts on trn1: fixed costs (~15 ms) the per-layer overhead fitted on 70B does not reach
    "neuron-trn1-llama-3-8b-ttft-128-8064", "neuron-trn1-llama-3-8b-ttft-128-3968",
    "neuron-trn1-llama-2-7b-ttft-128-8064",
    # TensorRT-LLM v0.6.1 Llama-2-70B at 2048+2048: with the pre-XQA kernel's K/V read per query head the
    # decode is now predicted 22% slow (an upper bound on that traffic: L2 serves part of the re-reads)
    "trtllm-h100-70b-thr-2048-2048",
    # the same tables' Falcon-180B rows (added 2026-12-02): 2048+2048 at TP4 -25%, the same per-query-head bound
    # with 29 query heads per kv head; its v0.5 first-token latency at TP8 (+25% at 128 tokens, -27% at 2048 on
    # H100 FP8, +21% at 2048 on A100 FP16): H100 FP8 is only 2.5x A100 FP16 at 2048 tokens where FP8 peak says
    # ~6x (the v0.5 FP8 prefill rate docs/serving.md "Tried and not kept" could not pin)
    "trtllm-h100-falcon180b-thr-2048-2048", "trtllm-h100-falcon180b-ttft-128", "trtllm-h100-falcon180b-ttft-2048",
    "trtllm-a100-falcon180b-ttft-2048",
    # inf2.48xlarge (the same Neuron 2.18 transformers-neuronx table, TP 24; evaluation only). 128-token prompts
    # of 7B-13B models take ~26 ms whatever the model (trn1: 13-17 ms): a per-request floor the model lacks
    "neuron-inf2-llama-3-8b-ttft-128-8064", "neuron-inf2-llama-3-8b-ttft-128-3968",
    "neuron-inf2-llama-2-7b-ttft-128-3968", "neuron-inf2-llama-2-7b-ttft-128-8064",
    "neuron-inf2-llama-2-13b-ttft-128-3968", "neuron-inf2-mistral-7b-ttft-128-3968",
    "neuron-inf2-codellama-13b-ttft-128-3968",
    # mid-length prompts predicted 21-56% slow: measured prefill grows super-linearly (70B: 1024 -> 2048 tokens
    # costs 2.9-3.0x on trn1 and inf2) where the model is near-linear; the trn1 fit averages the two ends
    "neuron-inf2-llama-3-8b-ttft-4096-4096", "neuron-inf2-llama-3-8b-ttft-2048-2048",
    "neuron-inf2-llama-3-70b-ttft-1024-2048", "neuron-inf2-llama-3-70b-ttft-1024-1024",
    "neuron-inf2-llama-3-70b-ttft-256-256", "neuron-inf2-llama-2-70b-ttft-256-256",
    "neuron-inf2-llama-2-70b-ttft-1024-1024", "neuron-inf2-llama-2-70b-ttft-1024-2048",
    # the source's Mistral-7B 4096-token TTFT (558 ms) exceeds its own 8192-token row (540 ms, predicted +2%)
    "neuron-inf2-mistral-7b-ttft-4096-4096",
    # the same SDK's throughput tables (batch 4-8, added 2026-12-02; the trn1 Llama-2-70B / 13B-4k rows calibrate).
    # Long-prompt prefill of 13B / CodeLlama / Mistral at batch 4-8 is 2.4-3x slow on BOTH chips (inf2 at batch 8
    # runs as slowly per prompt as trn1 at batch 1: the slow regime above is not trn1-only)
    "neuron-inf2-codellama-13b-b4-ttft-8192-8192", "neuron-inf2-codellama-13b-b8-ttft-4096-4096",
    "neuron-inf2-llama-2-13b-b4-ttft-8192-8192", "neuron-inf2-llama-2-13b-b8-ttft-4096-4096",
    "neuron-inf2-mistral-7b-b8-ttft-4096-4096", "neuron-inf2-mistral-7b-b8-ttft-8192-8192",
    "neuron-trn1-codellama-13b-b4-ttft-8192-8192", "neuron-trn1-codellama-13b-b8-ttft-4096-4096",
    "neuron-trn1-llama-2-13b-b4-ttft-8192-8192", "neuron-trn1-mistral-7b-b8-ttft-8192-8192",
    # 8 prompts of 128 tokens on 7B-13B: per token ~2x what the 70B rows' prefill rate says (the floor above,
    # growing with the batch: not a fixed per-request cost)
    "neuron-inf2-codellama-13b-b8-ttft-128-3968", "neuron-inf2-llama-2-7b-b8-ttft-128-3968",
    "neuron-inf2-llama-2-7b-b8-ttft-128-8064", "neuron-inf2-mistral-7b-b8-ttft-128-3968",
    "neuron-trn1-llama-2-7b-b8-ttft-128-8064",
    # predicted slow: Llama-3-70B at batch 4 (+23-47%, where Llama-2-70B's same rows are within 12%) and
    # Llama-3-8B at 8 x 2048 tokens (+27%, the mid-length super-linearity above)
    "neuron-trn1-llama-3-70b-b4-ttft-128-1024", "neuron-trn1-llama-3-70b-b4-ttft-128-128",
    "neuron-trn1-llama-3-70b-b4-ttft-2048-2048", "neuron-inf2-llama-3-8b-b8-ttft-2048-2048",
    # Mistral-7B decode at batch 8 over a 12k context (16k bucket) on inf2: +37% (its trn1 batch-1 row: -24%)
    "neuron-inf2-mistral-7b-b8-tpot-8192-8192",
}


def _bench():
    spec = importlib.util.spec_from_file_location("serving_accuracy", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kv_cache_bytes_gqa_mqa_and_tp():
    # Llama 3 70B: 80 layers x 8 kv heads x 128 x (K and V) x 2 bytes = 320 KiB per token
    assert kv_bytes_per_token(L70, "bf16") == 80 * 8 * 128 * 2 * 2
    assert kv_bytes_per_token(L70, "fp8") == kv_bytes_per_token(L70, "bf16") / 2
    assert kv_bytes_per_token(L70, "bf16", tp=8) == kv_bytes_per_token(L70, "bf16") / 8
    # tp 16 > 8 kv heads: each device keeps one kv head, so no further saving
    assert kv_bytes_per_token(L70, "bf16", tp=16) == kv_bytes_per_token(L70, "bf16", tp=8)
    mqa = ModelConfig(name="mqa", layers=4, hidden=512, heads=8, kv_heads=1, vocab=1000)
    mha = ModelConfig(name="mha", layers=4, hidden=512, heads=8, vocab=1000)
    assert kv_bytes_per_token(mha, "bf16") == 8 * kv_bytes_per_token(mqa, "bf16")
    assert kv_bytes_per_token(L70, "bf16", pp=4) == kv_bytes_per_token(L70, "bf16") / 4


def test_mla_caches_the_latent_and_rope_key_unsplit_by_tp():
    # DeepSeek-V3 report sec. 2.1.1: per token and layer only c_KV (kv_lora_rank 512) and k_R (qk_rope_head_dim 64)
    ds = PRESETS["deepseek-v3"]
    for tp in (1, 8, 16):
        assert kv_bytes_per_token(ds, "bf16", tp=tp) == ds.layers * (512 + 64) * 2
    assert kv_bytes_per_token(ds, "fp8", tp=8, pp=2) == ds.layers / 2 * (512 + 64)
    # the shared down-projections are held whole on every TP rank, the rest split
    full, split = weight_bytes_per_device(ds, Replica(tp=1)), weight_bytes_per_device(ds, Replica(tp=8))
    assert split - full / 8 == pytest.approx(ds.layers * ds.mla.latent_params(ds.hidden) * 7 / 8 * 2)


def test_stack_head_layout_buckets_and_gqa_decode():
    """The software facts of serving_efficiency.toml: transformers-neuronx's head padding / K/V replication and
    power-of-two buckets, TensorRT-LLM's pre-XQA per-query-head K/V reads."""
    l13 = PRESETS["llama2-13b"]  # 40 heads (MHA): at tp 32 padded to 64, two per NeuronCore
    assert heads_per_device(l13, 32, "pad") == (2.0, 2.0) and heads_per_device(l13, 32) == (1.25, 1.25)
    assert heads_per_device(L70, 32, "pad") == (2.0, 2.0)  # 8 kv heads, tp 32: K/V replicated per query head
    assert heads_per_device(L70, 32) == (2.0, 1.0) and heads_per_device(L70, 8, "pad") == (8.0, 1.0)
    assert kv_bytes_per_token(L70, "bf16", tp=32, layout="pad") == 2 * kv_bytes_per_token(L70, "bf16", tp=32)
    trn1 = resolve_system("trn1.32xlarge")
    tnx = serving_efficiency(trn1, "aws-tnx-2024")
    assert (tnx.head_layout, tnx.buckets, tnx.attention) == ("pad", True, "unfused")
    even = replace(tnx, head_layout="shard")
    rep = Replica(tp=32)
    assert weight_bytes_per_device(l13, rep, "pad") > weight_bytes_per_device(l13, rep)
    assert prefill_time_s(l13, trn1, rep, 4096, 1, tnx) > prefill_time_s(l13, trn1, rep, 4096, 1, even)
    # a 1000-token prompt runs in the 1024 bucket; decode at 3000 tokens attends over the 4096 bucket
    assert prefill_time_s(L70, trn1, rep, 1000, 1, tnx) == prefill_time_s(L70, trn1, rep, 1024, 1, tnx)
    assert decode_step_s(L70, trn1, rep, 1, 3000, tnx) == decode_step_s(L70, trn1, rep, 1, 4096, tnx)
    free = replace(even, buckets=False)
    assert prefill_time_s(L70, trn1, rep, 1000, 1, free) < prefill_time_s(L70, trn1, rep, 1024, 1, free)
    # per-query-head K/V reads: a GQA decode slows by the KV term only, an MHA decode not at all
    h100 = resolve_system(H100)
    grouped = serving_efficiency(h100, "nvidia-trtllm-2023")
    assert grouped.gqa_decode == "per_query_head"
    grouped = replace(grouped, gqa_decode="grouped")
    per_q = replace(grouped, gqa_decode="per_query_head")
    rep2 = Replica(tp=2, weights="fp8", kv="fp8")
    slow = decode_step_s(L70, h100, rep2, 64, 3072, per_q) - decode_step_s(L70, h100, rep2, 64, 3072, grouped)
    kv_s = 64 * 3072 * kv_bytes_per_token(L70, "fp8", tp=2) / (h100.device_hbm_bw_bytes_per_s * grouped.kv_bw_eff)
    assert slow == pytest.approx(7 * kv_s, rel=0.1)  # 8 query heads per kv head: 7 more reads (soft roofline)
    l7 = PRESETS["llama2-7b"]
    assert decode_step_s(l7, h100, rep2, 64, 3072, per_q) == decode_step_s(l7, h100, rep2, 64, 3072, grouped)
    with pytest.raises(ValueError, match="head_layout = 'odd'"):
        replace(tnx, head_layout="odd")
    # padded heads run any tp (the published Llama-2-13B rows: tp 24 on inf2); an even split needs a divisor
    inf2 = resolve_system("inf2.48xlarge")
    assert estimate(l13, inf2, Replica(tp=24), 1, 4096, 256, tnx).kv_bytes_per_token_per_device == 40 * 2 * 128 * 2 * 2
    with pytest.raises(ValueError, match="tp = 24: must divide heads = 40"):
        estimate(l13, inf2, Replica(tp=24), 1, 4096, 256)
    # a row's stated buckets (NxD Inference tutorials): the prompt runs padded, decode attends over the bucket
    from paratrain.plan.serve_fit import predict

    trn2 = resolve_system("trn2.48xlarge")
    row = {"model_config": L70, "system": trn2, "stack": "aws", "tp": 64, "weights": "bf16", "kv": "bf16",
           "batch": 1, "prompt": 10000, "output": 1500}
    for kind in ("ttft", "tpot"):
        stated = predict({**row, "kind": kind, "prefill_bucket": 12288, "decode_bucket": 12800})
        assert stated == predict({**row, "kind": kind, "prompt": 12288, "output": 2 * (12800 - 12288)})
        assert stated > predict({**row, "kind": kind})


def test_host_step_time_is_paid_once_per_engine_step():
    """vLLM V0's host time per step (host_step_s, serving_efficiency.toml [vllm-2024]): every decode step and the
    prefill (one step) pay it once, whatever the batch or tp; chunked prefill riding on decode steps does not
    pay it again (the operating point's marginal prefill), and the other stacks have none."""
    h100 = resolve_system(H100)
    base = serving_efficiency(h100)
    host = replace(base, host_step_s=1.5e-3)
    assert base.host_step_s == 0 and serving_efficiency(h100, "vllm-2024").host_step_s > 0
    for rep, batch in ((Replica(tp=1), 1), (Replica(tp=4), 32)):
        model = PRESETS["llama3-8b"] if rep.tp == 1 else L70
        step = decode_step_s(model, h100, rep, batch, 1024, host) - decode_step_s(model, h100, rep, batch, 1024, base)
        pre = prefill_time_s(model, h100, rep, 1024, 1, host) - prefill_time_s(model, h100, rep, 1024, 1, base)
        assert step == pytest.approx(1.5e-3) and pre == pytest.approx(1.5e-3)
    op, op_host = (operating_point(L70, h100, Replica(tp=4), 16, 1024, 256, e) for e in (base, host))
    assert op_host["itl_s"] - op["itl_s"] == pytest.approx(1.5e-3)  # per output token: once per step
    with pytest.raises(ValueError, match="host_step_s"):
        replace(base, host_step_s=-1.0)


def test_weights_and_capacity_follow_memory():
    h100 = resolve_system(H100)
    rep = Replica(tp=4)
    assert weight_bytes_per_device(L70, Replica(tp=4, weights="fp8")) == pytest.approx(
        weight_bytes_per_device(L70, rep) / 2)
    seqs = max_sequences(L70, h100, rep, 2048)
    more = max_sequences(L70, h100, Replica(tp=4, kv="fp8"), 2048)
    assert 1.9 * seqs <= more <= 2.1 * seqs + 1  # half the bytes per token: about twice the sequences
    # paged: a sequence of 17 tokens takes two 16-token pages, as many as 32 tokens
    assert max_sequences(L70, h100, rep, PAGE_TOKENS + 1) == max_sequences(L70, h100, rep, 2 * PAGE_TOKENS)
    assert max_sequences(L70, h100, Replica(tp=1), 2048) == 0  # 141 GB of weights on one 80 GB GPU
    # pipeline stages: every device holds its layers' KV of every sequence, and what it holds must fit
    from paratrain.plan.serve import kv_budget_bytes, kv_pages_bytes_per_sequence

    for rep in (Replica(tp=4), Replica(tp=4, pp=2), Replica(tp=2, pp=4)):
        n = float(max_sequences(L70, h100, rep, 2048))
        per_seq = float(kv_pages_bytes_per_sequence(L70, rep, 2048))
        assert n * per_seq <= kv_budget_bytes(L70, h100, rep) < (n + 1) * per_seq


def test_decode_is_bandwidth_bound_prefill_compute_bound():
    h100 = resolve_system(H100)
    rep = Replica(tp=4)
    eff = serving_efficiency(h100)
    one = float(decode_step_s(L70, h100, rep, 1, 1024))
    weights_s = weight_bytes_per_device(L70, rep) / (h100.device_hbm_bw_bytes_per_s * eff.decode_bw_eff)
    # a lone sequence: the weight read plus fixed costs (per layer, and two latency-bound all-reduces per
    # layer of at most 100 us each)
    assert weights_s < one < weights_s + L70.layers * (eff.layer_overhead_s + 2 * 100e-6)
    # more sequences cost little until compute or KV reads take over; longer contexts cost KV reads
    assert float(decode_step_s(L70, h100, rep, 8, 1024)) < 1.1 * one
    extra_kv_s = 64 * 7168 * kv_bytes_per_token(L70, "bf16", tp=4) / (h100.device_hbm_bw_bytes_per_s * eff.kv_bw_eff)
    grown = float(decode_step_s(L70, h100, rep, 64, 8192)) - float(decode_step_s(L70, h100, rep, 64, 1024))
    assert 0.8 * extra_kv_s < grown <= 1.0001 * extra_kv_s
    saved = one - float(decode_step_s(L70, h100, Replica(tp=4, weights="fp8"), 1, 1024))
    assert saved == pytest.approx(weights_s / 2, rel=0.1)  # fp8 halves the bytes streamed
    # prefill: time grows with tokens (compute), fp8 doubles the H100 peak
    p2k, p8k = (float(prefill_time_s(L70, h100, rep, s)) for s in (2048, 8192))
    assert 3.8 * p2k < p8k < 6 * p2k  # linear matmuls plus the quadratic attention
    assert float(prefill_time_s(L70, h100, Replica(tp=4, weights="fp8"), 8192)) < 0.65 * p8k


def test_speculative_decoding_helps_only_when_drafts_are_accepted():
    h100 = resolve_system(H100)
    base = float(inter_token_s(L70, h100, Replica(tp=4), 1, 1024))
    good = float(inter_token_s(L70, h100, Replica(tp=4, spec_tokens=4, spec_accept=0.8, draft="llama3-8b"), 1, 1024))
    bad = float(inter_token_s(L70, h100, Replica(tp=4, spec_tokens=4, spec_accept=0.0, draft="llama3-8b"), 1, 1024))
    assert good < 0.75 * base and bad > base


def test_bad_replica_and_target_fail_clearly():
    with pytest.raises(ValueError, match="weights = 'fp4'"):
        Replica(weights="fp4")
    with pytest.raises(ValueError, match="tp = 3: must divide heads = 64"):
        estimate(L70, H100, Replica(tp=3), 1, 128, 128)
    with pytest.raises(ValueError, match="rate = 0"):
        Target(rate=0, prompt=1, output=1)
    with pytest.raises(ValueError, match="spec_tokens > 0 needs a draft"):
        Replica(spec_tokens=2)


def test_plan_meets_the_target_and_scales_with_rate():
    target = Target(rate=10, prompt=1024, output=256, ttft_s=1.0, itl_s=0.05)
    plans = plan(L70, H100, target, weights=("bf16", "fp8"))
    assert plans
    best = plans[0]
    assert best.estimate.itl_s <= 0.05 and best.estimate.ttft_s <= 1.0
    assert best.utilization <= target.max_utilization + 1e-9
    assert best.replicas * best.estimate.requests_per_s >= target.rate / target.max_utilization - 1e-9
    double = plan(L70, H100, Target(rate=40, prompt=1024, output=256, ttft_s=1.0, itl_s=0.05), weights=("bf16", "fp8"))
    assert double[0].devices > best.devices
    cost = serving_cost(best, resolve_system(H100), target)
    assert cost.usd_per_hour == pytest.approx(55.04 * best.nodes)
    total = cost.usd_per_million_output_tokens * 256 + cost.usd_per_million_input_tokens * 1024
    assert total == pytest.approx(cost.usd_per_hour / (10 * 3600) * 1e6, rel=1e-9)  # every dollar attributed


def test_recommend_ranks_priced_systems_and_prices_the_rest():
    target, cands = recommend("chat", "llama3-8b", 5.0, systems=("p5.48xlarge", "p4de.24xlarge", "trn2.48xlarge"))
    priced = [c for c in cands if c.cost and c.cost.usd_per_million_tokens is not None]
    assert [c.cost.usd_per_million_tokens for c in priced] == sorted(c.cost.usd_per_million_tokens for c in priced)
    assert "lowest cost per token" in priced[0].reasons[0]
    trn2 = next(c for c in cands if c.system == "trn2.48xlarge")
    assert trn2.cost is not None and "no on-demand price" in trn2.reasons[0]


def test_serve_cli_json_and_errors(capsys):
    assert main(["serve", "estimate", "--model", "llama3-8b", "--hardware", H100, "--batch", "8", "--prompt-tokens", "512",
                 "--output-tokens", "128", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["ttft_s"] > data["prefill_s"] > 0
    assert main(["serve", "plan", "--model", "llama3-8b", "--hardware", H100, "--rate", "5", "--prompt-tokens", "512",
                 "--output-tokens", "128", "--weights", "bf16,fp4"]) == 2
    assert "--weights = 'bf16,fp4'" in capsys.readouterr().err
    assert main(["serve", "estimate", "--model", "llama3-8b", "--hardware", H100, "--batch", "1,16", "--prompt-tokens",
                 "512", "--output-tokens", "128", "--json"]) == 0
    one, sixteen = json.loads(capsys.readouterr().out)
    assert sixteen["requests_per_s"] > one["requests_per_s"] and sixteen["itl_s"] > one["itl_s"]
    assert main(["serve", "plan", "--model", "llama3-8b", "--hardware", H100, "--rate", "5", "--prompt-tokens", "512",
                 "--output-tokens", "128", "--ttft-s", "0.5", "--itl-s", "0.05", "--top", "1", "--simulate", "200", "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)["simulated"]
    assert sim["requests"] == 200 and 0 <= sim["slo_attainment"] <= 1
    assert main(["recommend", "chat"]) == 2  # the training recommender points at `serve recommend`
    assert "paratrain serve recommend chat" in capsys.readouterr().err


def test_evaluation_rows_within_20_percent():
    bench = _bench()
    rows = bench.load_rows()
    assert len(rows) >= 15 and all(r["source"] and r["split"] in ("calibration", "evaluation") for r in rows)
    evaluation = [r for r in rows if r["split"] == "evaluation"]
    errs = bench.errors(evaluation)
    misses = {r["id"] for r, e in zip(evaluation, errs, strict=True) if abs(e) > 0.20}
    assert misses - KNOWN_MISSES == set(), f"new misses: {sorted(misses - KNOWN_MISSES)}"
    assert KNOWN_MISSES - misses == set(), f"now within 20%, drop from KNOWN_MISSES: {sorted(KNOWN_MISSES - misses)}"
    within = [r for r in evaluation if r["id"] not in misses]
    assert len(within) >= 8 and {r["kind"] for r in within} >= {"ttft", "tpot", "static_throughput"}
    # the efficiency tables say they came from the calibration rows
    for system in ("p5.48xlarge", "trn1.32xlarge"):
        assert "calibration rows" in serving_efficiency(resolve_system(system)).source
    assert {r["stack"] for r in within} == set(serving_stacks())  # every stack's table passes held-out rows
    assert np.isfinite(errs).all()


def test_published_serving_tables_fit_only_what_their_rows_identify():
    """Each table's source names what its calibration rows fitted (at most one fewer than the rows) and where
    every other parameter is held; the default GPU table [nvidia] (3 rows) is what the rule gives from its
    parent, and its leave-one-out error is reported beside the fit's own."""
    import re

    from paratrain.plan.serve import EFFICIENCY_FIELDS, efficiency_tables

    bench = _bench()
    rows = bench.load_rows()
    tables = efficiency_tables()
    cal = {fam: [r for r in rows if r["stack"] == fam and r["split"] == "calibration"] for fam in tables}
    for fam, table in tables.items():
        fitted = re.match(r"fitted (.+?) on the (\d+) ", table.source)
        names = fitted.group(1).split(", ")
        assert int(fitted.group(2)) == len(cal[fam]) and 1 <= len(names) <= max(1, len(cal[fam]) - 1), fam
        for name in set(EFFICIENCY_FIELDS) - set(names):  # each other one held, and where from
            assert re.search(rf"held {name} at |{name}[a-z_, ]* from \[", table.source), (fam, name)
        assert "leave-one-out" in table.source
    nvidia, parent = tables["nvidia"], tables["nvidia-trtllm-2023"]
    eff, report = bench.fit_stack("nvidia", cal["nvidia"], {"nvidia-trtllm-2023": parent})
    assert report["fitted"] == ["decode_bw_eff", "prefill_flops_eff"] and len(cal["nvidia"]) == 3
    for name in EFFICIENCY_FIELDS:
        assert getattr(nvidia, name) == pytest.approx(getattr(eff, name), rel=5e-3, abs=1e-9), name
    assert (nvidia.kv_bw_eff, nvidia.collective_us) == (parent.kv_bw_eff, parent.collective_us)
    assert nvidia.layer_overhead_s == 0.0  # the CUDA-graph prior, not the parent's 121 us
    assert report["mape_leave_one_out"] > report["mape_fit"]  # 2 parameters on 3 rows: the fit checks nothing


def test_fit_recovers_known_efficiencies_and_reads_generate_summaries():
    from dataclasses import replace

    from paratrain.plan.serve import ServingEfficiency
    from paratrain.plan.serve_fit import fit, loss, measurements_from_generate, predict

    h100 = resolve_system(H100)
    truth = ServingEfficiency(decode_bw_eff=0.72, kv_bw_eff=0.475, prefill_flops_eff=0.5,
                              layer_overhead_s=41.8e-6, collective_us=15.425, source="test")
    rows = []
    for model, tp in ((PRESETS["llama3-8b"], 1), (PRESETS["llama3-8b"], 8), (L70, 4), (L70, 8)):
        for kind, batch, prompt, output in (("tpot", 1, 128, 2), ("tpot", 64, 4096, 2048), ("ttft", 1, 4096, 1),
                                            ("tpot", 8, 1024, 256)):
            row = {"kind": kind, "model_config": model, "system": h100, "tp": tp, "weights": "bf16", "kv": "bf16",
                   "batch": batch, "prompt": prompt, "output": output}
            rows.append({**row, "value": predict({**row, "value": 1.0}, truth)})
    start = replace(truth, decode_bw_eff=0.5, kv_bw_eff=0.8, prefill_flops_eff=0.3, layer_overhead_s=200e-6,
                    collective_us=60.0)
    got = fit(rows, start)
    assert loss(rows, got) < 0.01 < loss(rows, start)
    for name in ("decode_bw_eff", "kv_bw_eff", "prefill_flops_eff", "layer_overhead_s", "collective_us"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=0.15), name
    summary = {"kind": "generate", "model_shape": PRESETS["tiny"].model_dump(), "tp": 1, "batch": 2,
               "padded_prompt_tokens": 64, "prefill_s": 0.01, "decode_steps": 31, "decode_s_per_step": 0.002,
               "use_cache": True, "dtype": "fp32"}
    ttft, tpot = measurements_from_generate(summary, h100)
    assert (ttft["kind"], ttft["value"], tpot["kind"], tpot["value"]) == ("ttft", 10.0, "tpot", 2.0)
    assert tpot["weights"] == "fp32" and predict(tpot) > 0
    with pytest.raises(ValueError, match="--no-cache"):
        measurements_from_generate({**summary, "use_cache": False}, h100)


def test_mixture_of_experts_reads_the_experts_its_tokens_route_to():
    from paratrain.plan.serve import load_serving_model

    mix = load_serving_model("mixtral-8x7b")
    assert mix is PRESETS["mixtral-8x7b"] and 46e9 < mix.num_params() < 47.5e9  # Mixtral 8x7B: 46.7B
    assert 12e9 < mix.layer_params(active=True) + mix.vocab * mix.hidden < 13.5e9  # 12.9B active
    h200 = resolve_system("p5en.48xlarge")
    one, eight, many = (float(decode_step_s(mix, h200, Replica(tp=2), b, 160)) for b in (1, 8, 256))
    # batch 1 reads 2 of 8 experts per layer, batch 8 about 7.2 (1 - (6/8)^8), then all 8: weights dominate
    assert one < 0.5 * eight and many > eight
    ep = float(decode_step_s(mix, h200, Replica(tp=2, ep=2), 8, 160))
    assert ep != eight  # all-to-all instead of all-reduce
    with pytest.raises(ValueError, match="ep = 2: needs a mixture-of-experts model"):
        estimate(L70, H100, Replica(tp=2, ep=2), 1, 128, 128)
    with pytest.raises(ValueError, match="ep = 3"):
        estimate(mix, h200, Replica(tp=2, ep=3), 1, 128, 128)
    plans = plan(mix, h200, Target(rate=5, prompt=512, output=128, itl_s=0.05))
    assert plans and plans[0].estimate.itl_s <= 0.05


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b"])
def test_training_schema_moe_presets_hold_every_expert_and_multiply_the_active_ones(name):
    """The MoE presets (model.config: dense first layers, shared experts, router) served:
    the devices of a replica hold all the parameters (DeepSeek-V3's 671B, not its 37B active: a replica of 2
    H100s was once offered), a token multiplies with the active ones, and batch 1 reads about the active ones."""
    from paratrain.plan.serve import _matmul_params_stage, _streamed_weight_bytes, load_serving_model

    cfg = load_serving_model(name)
    rep = Replica(tp=8)
    # MLA's down-projections sit whole on every TP rank (tp - 1 extra copies over the replica)
    copies = cfg.layers * cfg.mla.latent_params(cfg.hidden) * (rep.tp - 1) if cfg.mla is not None else 0
    held = weight_bytes_per_device(cfg, rep) * rep.tp / 2  # bf16 bytes -> parameters, over the replica
    assert held == pytest.approx(cfg.num_params() + copies, rel=0.01)
    active = _matmul_params_stage(cfg, rep) * rep.tp
    assert active == pytest.approx(cfg.num_matmul_params() + copies, rel=0.01)
    one_token = _streamed_weight_bytes(cfg, rep, tokens=1.0) * rep.tp / 2
    assert cfg.num_matmul_params() * 0.95 < one_token < 1.3 * cfg.num_matmul_params()
    two_h100 = estimate(cfg, H100, Replica(tp=2), 1, 1024, 256)
    assert two_h100.fits == (cfg.num_params() * 2 / 2 < 2 * 80e9)  # bf16 weights alone against 2 x 80 GB


def test_a_serving_model_toml_with_the_older_expert_names_reads_as_the_schemas_moe(tmp_path):
    """`experts` / `expert_ffn` (the serving model's own names before it used model.config's MoE) are read as
    num_experts / moe_ffn_hidden: the same model as the preset."""
    from paratrain.plan.serve import load_serving_model

    mix = PRESETS["mixtral-8x7b"]
    keys = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "max_seq", "experts_per_token")
    path = tmp_path / "mix.toml"
    path.write_text("\n".join(f"{k} = {getattr(mix, k)}" for k in keys) + "\nexperts = 8\nexpert_ffn = 14336\n")
    cfg = load_serving_model(str(path))
    assert (cfg.name, cfg.num_experts, cfg.moe_ffn) == ("mix", 8, 14336)
    assert cfg.num_params() == mix.num_params() and cfg.active_params() == mix.active_params()
