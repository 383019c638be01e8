"""Fitting the serving model's efficiency parameters (plan/serving_efficiency.toml) to measurements.

A measurement is a dict (stack: the serving_efficiency.toml table it ran under, default the vendor's): kind ("ttft" ms, "tpot" ms, "static_throughput" output tokens/s per device, or "e2e"
ms: end-to-end latency of a static batch, prefill plus output - 1 decode steps, or "itl_concurrency" ms: mean
inter-token latency of a closed loop of `batch` concurrent requests, continuous batching, prefill stalls
included: plan.serve.operating_point's ITL),
value, model_config (ModelConfig), system (System), tp, weights, kv, batch, prompt, output; optionally
prefill_bucket / decode_bucket: the buckets a static-shape engine was configured with and the row's source
states (the prompt runs padded to prefill_bucket tokens, each decode step attends over decode_bucket
positions; itl_concurrency rows ignore them). Published rows
(benchmarks/serving_measurements.csv, benchmarks/serving_accuracy.py) and this machine's own runs
(`paratrain generate --summary-json`, via measurements_from_generate) have the same form, so the same fit
serves both: the one place calibration of the serving model lives. Torch-free.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from paratrain.hardware.catalog import System
from paratrain.model.config import ModelConfig
from paratrain.plan.serve import (
    EFFICIENCY_FIELDS,
    HOST_FIELDS,
    WEIGHT_PRECISIONS,
    Replica,
    ServingEfficiency,
    decode_step_s,
    operating_point,
    prefill_time_s,
    serving_efficiency,
)

KINDS = ("ttft", "tpot", "static_throughput", "e2e", "itl_concurrency")
# The search box of the fit: physical ranges, not free knobs (fractions of a peak, fixed costs in us).
BOUNDS = {"decode_bw_eff": (0.3, 0.9), "kv_bw_eff": (0.05, 0.9), "prefill_flops_eff": (0.1, 0.9),
          "layer_overhead_s": (0.0, 400e-6), "collective_us": (0.0, 100.0), "host_step_s": (0.0, 5e-3)}


def predict(row: dict, eff: ServingEfficiency | None = None) -> float:
    """The model's value for a measurement, in its unit."""
    model, system = row["model_config"], row["system"]
    eff = eff or serving_efficiency(system, row.get("stack"))
    rep = Replica(tp=row["tp"], weights=row["weights"], kv=row["kv"])
    b, p, o = row["batch"], row["prompt"], row["output"]
    if row["kind"] == "itl_concurrency":
        return 1e3 * float(operating_point(model, system, rep, b, p, o, eff)["itl_s"])
    context = row.get("decode_bucket") or p + o / 2
    p = row.get("prefill_bucket") or p
    if row["kind"] == "ttft":
        return 1e3 * float(prefill_time_s(model, system, rep, p, b, eff))
    if row["kind"] == "tpot":
        return 1e3 * float(decode_step_s(model, system, rep, b, context, eff))
    if row["kind"] == "static_throughput":
        total = prefill_time_s(model, system, rep, p, b, eff) + o * decode_step_s(model, system, rep, b, context, eff)
        return float(b * o / total / rep.tp)
    if row["kind"] == "e2e":
        steps = (o - 1) * decode_step_s(model, system, rep, b, context, eff)
        return 1e3 * float(prefill_time_s(model, system, rep, p, b, eff) + steps)
    raise ValueError(f"measurement {row.get('id', '')}: kind = {row['kind']!r}: allowed: {', '.join(KINDS)}")


def errors(rows: list[dict], eff: ServingEfficiency | None = None) -> np.ndarray:
    """Signed relative error (prediction / measurement - 1) per measurement."""
    return np.array([predict(r, eff) / r["value"] - 1 for r in rows])


def loss(rows: list[dict], eff: ServingEfficiency) -> float:
    """Mean |log(predicted / measured)|: symmetric in over- and under-prediction."""
    return float(np.mean(np.abs(np.log1p(errors(rows, eff)))))


def fit(rows: list[dict], start: ServingEfficiency, rounds: int = 2, points: int = 21,
        free: tuple[str, ...] = EFFICIENCY_FIELDS, bounds: dict | None = None) -> ServingEfficiency:
    """Fit the five parameters within BOUNDS to the rows (give it calibration rows only): a coarse
    coordinate search over the whole box (robust to a poor start), then bounded least squares on the log
    errors (scipy's trust-region reflective: coupled parameters, such as a per-layer and a per-collective
    cost, move together along the valley a coordinate search zig-zags in). `free`: the parameters to fit (the
    rest keep start's values: for a stack with too few rows to pin all five). `bounds`: another search box
    (default BOUNDS; calibrate/serving.py widens it for an eager-mode runtime on a CPU host)."""
    from scipy.optimize import least_squares

    bounds = bounds or BOUNDS

    if not rows:
        raise ValueError("fit: no measurements to fit")
    unknown = [n for n in free if n not in EFFICIENCY_FIELDS + HOST_FIELDS]
    if unknown or not free:
        raise ValueError(f"free = {free!r}: allowed: a non-empty subset of {', '.join(EFFICIENCY_FIELDS + HOST_FIELDS)}")
    lo = np.array([bounds[n][0] for n in free])
    hi = np.array([bounds[n][1] for n in free])
    best = replace(start, **{n: float(np.clip(getattr(start, n), *bounds[n])) for n in free})
    best_loss = loss(rows, best)
    for _ in range(rounds):
        for name, a, b in zip(free, lo, hi, strict=True):
            for value in np.linspace(a if a > 0 else b / 200, b, points):
                trial = replace(best, **{name: float(value)})
                trial_loss = loss(rows, trial)
                if trial_loss < best_loss:
                    best, best_loss = trial, trial_loss

    def at(x):  # x in [0, 1]^len(free) -> parameters
        return replace(best, **{n: float(v) for n, v in zip(free, lo + x * (hi - lo), strict=True)})

    def residuals(x):
        return np.log1p(errors(rows, at(x)))

    x0 = np.clip((np.array([getattr(best, n) for n in free]) - lo) / (hi - lo), 0.0, 1.0)
    lower = np.where(np.isin(free, ("layer_overhead_s", "collective_us") + HOST_FIELDS), 0.0, 1e-3)
    solved = least_squares(residuals, np.maximum(x0, lower), bounds=(lower, np.ones(len(free))), x_scale=1.0)
    refined = at(solved.x)
    return refined if loss(rows, refined) <= best_loss else best


def measurements_from_generate(summary: dict, system: System) -> list[dict]:
    """The prefill (TTFT) and mean decode step (TPOT) of one `paratrain generate --summary-json` run, as
    measurements on `system` (e.g. this machine as `paratrain probe` described it)."""
    if summary.get("kind") != "generate":
        raise ValueError(f"summary kind = {summary.get('kind')!r}: expected a `paratrain generate` summary")
    if not summary.get("use_cache", True):
        raise ValueError("summary of a --no-cache run: the serving model describes KV-cache decoding")
    model = ModelConfig(**summary["model_shape"])
    dtype = summary.get("dtype", "fp32")  # the precision the run held weights and KV cache in
    if dtype not in WEIGHT_PRECISIONS:
        raise ValueError(f"summary dtype = {dtype!r}: allowed: {', '.join(WEIGHT_PRECISIONS)}")
    base = {"model_config": model, "system": system, "tp": summary["tp"], "weights": dtype, "kv": dtype,
            "batch": summary["batch"], "prompt": summary["padded_prompt_tokens"]}
    rows = [{**base, "id": "generate-prefill", "kind": "ttft", "output": 1, "value": 1e3 * summary["prefill_s"]}]
    if summary["decode_steps"]:
        rows.append({**base, "id": "generate-decode", "kind": "tpot", "output": summary["decode_steps"],
                     "value": 1e3 * summary["decode_s_per_step"]})
    return rows
