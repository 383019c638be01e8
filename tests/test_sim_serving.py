"""The request-level serving simulator (sim/serving.py) against the analytic serving model (plan/serve.py)."""

from __future__ import annotations

import numpy as np
import pytest

from paratrain.hardware.catalog import resolve_system
from paratrain.model.config import PRESETS
from paratrain.plan.serve import Replica, decode_step_s, operating_point, prefill_time_s
from paratrain.sim.serving import Engine, Requests, Slo, simulate, sweep

MODEL = PRESETS["llama3-8b"]
SYSTEM = resolve_system("p5.48xlarge")
REP = Replica(tp=1)
PROMPT, OUTPUT = 512, 128
ENGINE = Engine(max_seqs=64)


def _capacity() -> float:
    """Analytic requests/s of one replica with the engine's max_seqs running."""
    return float(operating_point(MODEL, SYSTEM, REP, ENGINE.max_seqs, PROMPT, OUTPUT)["requests_per_s"])


def test_low_load_matches_the_analytic_model():
    rate = 0.02 * _capacity()
    reqs = Requests.poisson(rate, 300, PROMPT, OUTPUT, seed=1)
    res = simulate(MODEL, SYSTEM, REP, reqs, ENGINE)
    offered = (len(reqs.arrival_s) - 1) / (reqs.arrival_s[-1] - reqs.arrival_s[0])
    assert res.throughput_rps == pytest.approx(offered, rel=0.05)  # everything offered is served
    # a request mostly runs alone: its tokens come at the analytic decode step of one sequence
    step = float(decode_step_s(MODEL, SYSTEM, REP, 1, PROMPT + OUTPUT / 2))
    assert res.tpot_s["p50"] == pytest.approx(step, rel=0.05)
    assert res.mean_batch < 1.5
    prefill = float(prefill_time_s(MODEL, SYSTEM, REP, PROMPT))
    assert prefill * 0.99 <= res.ttft_s["p50"] <= prefill + 2 * step


def test_saturated_throughput_matches_the_analytic_capacity():
    cap = _capacity()
    res = simulate(MODEL, SYSTEM, REP, Requests.poisson(3 * cap, 1500, PROMPT, OUTPUT, seed=2), ENGINE)
    assert res.mean_batch > 0.9 * ENGINE.max_seqs
    analytic = float(operating_point(MODEL, SYSTEM, REP, res.mean_batch, PROMPT, OUTPUT)["requests_per_s"])
    assert res.throughput_rps == pytest.approx(analytic, rel=0.08)


def test_p99_latency_rises_as_the_rate_nears_capacity():
    cap = _capacity()
    results = sweep(MODEL, SYSTEM, REP, [f * cap for f in (0.2, 0.5, 0.8, 0.95)], 800, PROMPT, OUTPUT, ENGINE,
                    Slo(ttft_s=0.2, itl_s=0.03), seed=3)
    p99 = [r.ttft_s["p99"] for _, r in results]
    assert p99 == sorted(p99) and p99[-1] > 2 * p99[0]
    itl = [r.tpot_s["mean"] for _, r in results]
    assert itl == sorted(itl)
    attain = [r.slo_attainment for _, r in results]
    assert attain[0] == 1.0 and attain[-1] < attain[0]
    assert results[0][1].goodput_rps == pytest.approx(results[0][1].throughput_rps)


def test_kv_memory_limits_admission():
    cap = _capacity()
    small = Engine(max_seqs=64, kv_tokens=16 * (PROMPT + OUTPUT))  # room for 16 requests
    res = simulate(MODEL, SYSTEM, REP, Requests.poisson(2 * cap, 300, PROMPT, OUTPUT, seed=4), small)
    assert res.mean_batch <= 16 + 1e-9
    with pytest.raises(ValueError, match="needs more KV cache"):
        simulate(MODEL, SYSTEM, REP, Requests.poisson(1.0, 3, PROMPT, OUTPUT), Engine(kv_tokens=100))


def test_length_distributions_and_bad_input():
    reqs = Requests.poisson(5.0, 200, (100, 900), (10, 300), seed=5)
    assert reqs.prompt.min() >= 100 and reqs.prompt.max() <= 900 and len(np.unique(reqs.output)) > 50
    res = simulate(MODEL, SYSTEM, REP, reqs, ENGINE)
    assert res.requests == 200 and np.isfinite(res.ttft_s["p99"])
    with pytest.raises(ValueError, match="spec_tokens = 2"):
        simulate(MODEL, SYSTEM, Replica(spec_tokens=2, draft="tiny"), reqs, ENGINE)
    with pytest.raises(ValueError, match="prompt = \\(5, 1\\)"):
        Requests.poisson(1.0, 10, (5, 1), 10)


def test_simulate_cli_with_a_trace_and_length_ranges(tmp_path, capsys):
    import json

    from paratrain.cli import main

    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt,output\n0.0,100,20\n0.05,300,50\n0.1,200,10\n0.3,1000,100\n")
    assert main(["serve", "simulate", "--model", "llama3-8b", "--hardware", "p5.48xlarge", "--trace", str(trace),
                 "--json"]) == 0
    (only,) = json.loads(capsys.readouterr().out)["results"]
    assert only["requests"] == 4 and only["ttft_s"]["p50"] > 0
    assert main(["serve", "simulate", "--model", "llama3-8b", "--hardware", "p5.48xlarge", "--rate", "5:10:2",
                 "--prompt-tokens", "100:300", "--output-tokens", "10:20", "--requests", "50", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["results"]) == 2
    assert main(["serve", "simulate", "--model", "llama3-8b", "--hardware", "p5.48xlarge", "--rate", "5",
                 "--prompt-tokens", "9:1", "--output-tokens", "5"]) == 2
    assert "--prompt-tokens = '9:1'" in capsys.readouterr().err
