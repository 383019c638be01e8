"""Request-level serving simulator: continuous batching with a token budget, chunked prefill, admission by
KV-cache memory, Poisson (or given) arrivals and prompt/output length distributions.

Each engine iteration runs every admitted decoding sequence for one token plus up to `token_budget` minus
that many prompt tokens of waiting requests, first come first served (vLLM's scheduler with chunked prefill;
Sarathi-Serve). A request is admitted when the KV cache can hold its prompt and its whole output (paged
blocks, reserved up front, so nothing is ever preempted) and fewer than `max_seqs` run. Its first token comes
out of the iteration that finishes its prompt.

Iteration times come from the analytic model (plan/serve.py) so the two agree by construction at the same
batch: a decode step of b sequences at their mean context, plus the marginal cost of each prefill chunk
(prefill of its tokens minus a one-token pass: the weights are read once per iteration). Both are tabulated
once per run. Between events (an arrival that can be admitted, a completion) the batch does not change, so
the loop jumps over whole runs of identical decode iterations at once: the event count, not the token count,
sets the run time, and a sweep of 20 rates takes seconds.

Known simplifications: a prefill chunk's attention covers the chunk only (not the prompt before it); the KV of
a request is reserved for its whole output (vLLM allocates as it grows and preempts when full).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import asdict, dataclass, field

import numpy as np

from paratrain.config.options import described
from paratrain.hardware.catalog import System
from paratrain.model.config import ModelConfig
from paratrain.plan.serve import (
    PAGE_TOKENS,
    Replica,
    ServingEfficiency,
    decode_step_s,
    kv_budget_bytes,
    kv_bytes_per_token,
    prefill_time_s,
    serving_efficiency,
)


@dataclass
class Engine:
    """Scheduler limits: token_budget tokens per iteration (vLLM max_num_batched_tokens), max_seqs running
    sequences (max_num_seqs); kv_tokens: KV-cache capacity in tokens per replica (None: from memory)."""

    token_budget: int = described("tokens per iteration (chunked prefill)", 8192, ge=1)
    max_seqs: int = described("most sequences running at once", 256, ge=1)
    kv_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("token_budget", "max_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}: must be >= 1")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ValueError(f"kv_tokens = {self.kv_tokens}: must be >= 1")


@dataclass
class Requests:
    """Arrival times (s), prompt and output lengths (tokens), one entry per request."""

    arrival_s: np.ndarray
    prompt: np.ndarray
    output: np.ndarray

    @classmethod
    def poisson(cls, rate: float, n: int, prompt: int | tuple[int, int], output: int | tuple[int, int],
                seed: int = 0) -> Requests:
        """n requests arriving as a Poisson process of `rate` per second. A length is fixed (an int) or
        uniform in [lo, hi] (a pair)."""
        if not rate > 0:
            raise ValueError(f"rate = {rate}: must be > 0 requests/s")
        if n < 1:
            raise ValueError(f"requests = {n}: must be >= 1")
        rng = np.random.default_rng(seed)
        arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
        return cls(arrivals, _lengths(rng, prompt, n, "prompt"), _lengths(rng, output, n, "output"))

    @classmethod
    def from_csv(cls, path: str) -> Requests:
        """Requests from a CSV (arrival_s,prompt,output), sorted by arrival."""
        import csv

        try:
            with open(path, newline="") as fh:
                rows = list(csv.DictReader(fh))
            arrival = np.array([float(r["arrival_s"]) for r in rows])
            prompt = np.array([int(r["prompt"]) for r in rows])
            output = np.array([int(r["output"]) for r in rows])
        except FileNotFoundError:
            raise ValueError(f"--trace {path}: no such file") from None
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"--trace {path}: need columns arrival_s (s), prompt, output (tokens >= 1): {exc}") from None
        if len(rows) < 2 or prompt.min() < 1 or output.min() < 1 or arrival.min() < 0:
            raise ValueError(f"--trace {path}: need >= 2 requests, arrival_s >= 0, prompt and output >= 1")
        order = np.argsort(arrival, kind="stable")
        return cls(arrival[order], prompt[order], output[order])


def _lengths(rng, spec, n: int, name: str) -> np.ndarray:
    lo, hi = (spec, spec) if isinstance(spec, int | np.integer) else spec
    if lo < 1 or hi < lo:
        raise ValueError(f"{name} = {spec!r}: must be a length >= 1 or a range (lo, hi) with 1 <= lo <= hi")
    return rng.integers(lo, hi + 1, n)


@dataclass
class Slo:
    ttft_s: float | None = None
    itl_s: float | None = None  # per request: mean time per output token after the first (TPOT)


@dataclass
class SimResult:
    requests: int
    duration_s: float
    throughput_rps: float
    output_tokens_per_s: float
    ttft_s: dict[str, float]
    itl_s: dict[str, float]  # per token gaps
    tpot_s: dict[str, float]  # per request mean gap
    mean_batch: float
    goodput_rps: float
    slo_attainment: float
    iterations: int
    events: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


class _Tables:
    """Iteration time tables from the analytic model (one evaluation per run, then lookups)."""

    def __init__(self, model, system, rep, eff, max_seqs, max_context, budget):
        batches = np.arange(1, max_seqs + 1, dtype=float)
        contexts = np.unique(np.geomspace(1, max(2, max_context), 48).round())
        decode = decode_step_s(model, system, rep, batches[:, None], contexts[None, :], eff)
        tokens = np.arange(0, budget + 1, dtype=float)
        full = prefill_time_s(model, system, rep, np.maximum(tokens, 1), 1, eff)
        extra = np.maximum(full - full[1], 0.0)
        extra[0] = 0.0
        # plain lists: the event loop looks up scalars, where numpy's per-call overhead dominates
        self.contexts = contexts.tolist()
        self.decode = decode.tolist()
        self.prefill_alone = full.tolist()
        self.prefill_extra = extra.tolist()

    def step(self, b: int, mean_context: float, chunks: list[int] = ()) -> float:
        """One iteration: b decoding sequences at their mean context plus prefill chunks (tokens each; each
        costed as its own prompt, so attention grows with the chunk, not with the whole budget)."""
        extra = sum(self.prefill_extra[t] for t in chunks)
        if b == 0:
            return self.prefill_alone[chunks[0]] + extra - self.prefill_extra[chunks[0]]
        return self._lerp(self.decode[b - 1], mean_context) + extra

    def _lerp(self, row: list[float], x: float) -> float:
        """np.interp for one point (clamped at the ends)."""
        xs = self.contexts
        i = bisect.bisect_right(xs, x)
        if i <= 0:
            return row[0]
        if i >= len(xs):
            return row[-1]
        x0, x1 = xs[i - 1], xs[i]
        return row[i - 1] + (row[i] - row[i - 1]) * (x - x0) / (x1 - x0)


def _percentiles(values: np.ndarray, weights: np.ndarray | None = None) -> dict[str, float]:
    if len(values) == 0:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    if weights is None:
        weights = np.ones_like(values, dtype=float)
    order = np.argsort(values)
    v, w = values[order], weights[order]
    cum = np.cumsum(w) / w.sum()
    pick = {f"p{q}": float(v[min(np.searchsorted(cum, q / 100.0), len(v) - 1)]) for q in (50, 90, 99)}
    return {"mean": float(np.average(values, weights=weights)), **pick}


def simulate(model: ModelConfig, system: System, rep: Replica, requests: Requests, engine: Engine | None = None,
             slo: Slo | None = None, eff: ServingEfficiency | None = None) -> SimResult:
    """Run the requests through one replica; latency percentiles, throughput and goodput under the SLO."""
    if rep.spec_tokens:
        raise ValueError(f"spec_tokens = {rep.spec_tokens}: the serving simulator does not model speculative "
                         "decoding; allowed: 0 (use `serve estimate` for its analytic effect)")
    engine = engine or Engine()
    slo = slo or Slo()
    eff = eff or serving_efficiency(system)
    n = len(requests.arrival_s)
    prompt = np.asarray(requests.prompt, dtype=np.int64)
    output = np.asarray(requests.output, dtype=np.int64)
    arrival = np.asarray(requests.arrival_s, dtype=float)
    kv_cap = engine.kv_tokens
    if kv_cap is None:
        kv_cap = int(max(kv_budget_bytes(model, system, rep, layout=eff.head_layout), 0)
                     // kv_bytes_per_token(model, rep.kv, rep.tp, rep.pp, eff.head_layout))
    need = (np.ceil((prompt + output) / PAGE_TOKENS) * PAGE_TOKENS).astype(np.int64)
    if need.max() > kv_cap:
        raise ValueError(f"a request of {int(need.max())} tokens needs more KV cache than the replica holds "
                         f"({kv_cap} tokens): raise tp/pp or shorten the requests")
    tables = _Tables(model, system, rep, eff, engine.max_seqs, int((prompt + output).max()), engine.token_budget)

    first = np.full(n, np.nan)
    done = np.full(n, np.nan)
    gaps_v: list[float] = []
    gaps_w: list[float] = []
    run_idx = np.empty(0, dtype=np.int64)
    run_left = np.empty(0, dtype=np.int64)
    run_ctx = np.empty(0, dtype=np.int64)
    waiting: deque[int] = deque()
    prefill: deque[list[int]] = deque()  # [request, prompt tokens left]
    now, next_arrival, kv_used = 0.0, 0, 0
    ctx_sum = 0  # sum of run_ctx, kept up to date (the mean is needed every event)
    iterations = events = 0
    batch_time = 0.0

    def admit() -> None:
        nonlocal kv_used
        while waiting and len(run_idx) + len(prefill) < engine.max_seqs and kv_used + need[waiting[0]] <= kv_cap:
            r = waiting.popleft()
            kv_used += int(need[r])
            prefill.append([r, int(prompt[r])])

    while next_arrival < n or waiting or prefill or len(run_idx):
        while next_arrival < n and arrival[next_arrival] <= now:
            waiting.append(next_arrival)
            next_arrival += 1
        admit()
        events += 1
        b = len(run_idx)
        if b == 0 and not prefill:
            now = arrival[next_arrival]  # idle until the next request
            continue
        mean_ctx = ctx_sum / b if b else 0.0
        budget = engine.token_budget - b
        chunks = []
        for item in prefill:
            if budget <= 0:
                break
            take = min(item[1], budget)
            chunks.append((item, take))
            budget -= take
        p_tokens = sum(t for _, t in chunks)
        if p_tokens:
            k = 1
            dt = tables.step(b, mean_ctx, [t for _, t in chunks])
        else:  # pure decode: identical iterations until the next completion or admissible arrival
            k = int(run_left.min())
            t1 = tables.step(b, mean_ctx)
            can_admit = len(run_idx) < engine.max_seqs
            if next_arrival < n and can_admit:
                k = max(1, min(k, math.ceil((arrival[next_arrival] - now) / t1)))
            dt = tables.step(b, mean_ctx + (k - 1) / 2.0)
        now += k * dt
        iterations += k
        batch_time += k * dt * b
        if b:
            gaps_v.append(dt)
            gaps_w.append(float(b * k))
            run_left -= k
            run_ctx += k
            ctx_sum += b * k
        for item, take in chunks:
            item[1] -= take
        while prefill and prefill[0][1] == 0:
            r = prefill.popleft()[0]
            first[r] = now
            if output[r] <= 1:
                done[r] = now
                kv_used -= int(need[r])
            else:
                run_idx = np.append(run_idx, r)
                run_left = np.append(run_left, output[r] - 1)
                run_ctx = np.append(run_ctx, prompt[r] + 1)
                ctx_sum += int(prompt[r]) + 1
        finished = run_left <= 0
        if finished.any():
            for r in run_idx[finished]:
                done[r] = now
                kv_used -= int(need[r])
            ctx_sum -= int(run_ctx[finished].sum())
            keep = ~finished
            run_idx, run_left, run_ctx = run_idx[keep], run_left[keep], run_ctx[keep]

    ttft = first - arrival
    tpot = np.where(output > 1, (done - first) / np.maximum(output - 1, 1), 0.0)
    duration = float(done.max() - arrival.min())
    ok = np.ones(n, dtype=bool)
    if slo.ttft_s is not None:
        ok &= ttft <= slo.ttft_s
    if slo.itl_s is not None:
        ok &= tpot <= slo.itl_s
    return SimResult(
        requests=n, duration_s=duration, throughput_rps=n / duration,
        output_tokens_per_s=float(output.sum()) / duration, ttft_s=_percentiles(ttft),
        itl_s=_percentiles(np.array(gaps_v), np.array(gaps_w)), tpot_s=_percentiles(tpot[output > 1]),
        mean_batch=batch_time / max(now - float(arrival.min()), 1e-12), goodput_rps=float(ok.sum()) / duration,
        slo_attainment=float(ok.mean()), iterations=iterations, events=events)


def sweep(model: ModelConfig, system: System, rep: Replica, rates, requests: int, prompt, output,
          engine: Engine | None = None, slo: Slo | None = None, seed: int = 0,
          eff: ServingEfficiency | None = None) -> list[tuple[float, SimResult]]:
    """simulate() at each arrival rate (the same seed: common random numbers across rates)."""
    return [(float(r), simulate(model, system, rep, Requests.poisson(float(r), requests, prompt, output, seed),
                                engine, slo, eff)) for r in rates]


def simulate_deployment(model, system, deployment, target, requests: int, eff):
    """The request-level simulator on one replica of a planned deployment (plan.serve.plan) at its share of the
    rate, with the deployment's batch as the running-sequence limit (`serve plan --simulate N`)."""
    reqs = Requests.poisson(target.rate / deployment.replicas, requests, target.prompt, target.output)
    return simulate(model, system, deployment.estimate.replica, reqs, Engine(max_seqs=deployment.estimate.batch),
                    Slo(target.ttft_s, target.itl_s), eff)


# ---- the command line's request shapes (`paratrain serve simulate`) -------------------------------------
def simulate_requests(model, system, rep: Replica, engine: Engine, slo: Slo, eff, *, trace: str | None = None,
                      rate: str | None = None, prompt: str | None = None, output: str | None = None,
                      requests: int = 1000, seed: int = 0) -> tuple[list[tuple[float, SimResult]], int]:
    """`serve simulate`: the arrivals of a CSV trace (at its mean rate), or Poisson arrivals at each rate of
    `rate` ('R' or 'LO:HI:N') with `prompt`/`output` tokens ('N' or 'LO:HI'); (rate, result) pairs and the
    requests per rate. Bad input names the flag."""
    if (trace is None) == (rate is None):
        raise ValueError("give either --rate (Poisson arrivals, with --prompt-tokens and --output-tokens) or "
                         "--trace CSV")
    if trace is not None:
        reqs = Requests.from_csv(trace)
        mean_rate = (len(reqs.arrival_s) - 1) / max(reqs.arrival_s[-1] - reqs.arrival_s[0], 1e-9)
        return [(mean_rate, simulate(model, system, rep, reqs, engine, slo, eff))], len(reqs.arrival_s)
    if prompt is None or output is None:
        raise ValueError("--rate needs --prompt-tokens and --output-tokens (N or LO:HI tokens)")
    lengths = parse_length(prompt, "--prompt-tokens"), parse_length(output, "--output-tokens")
    return sweep(model, system, rep, parse_rates(rate, "--rate"), requests, *lengths, engine, slo, seed, eff), requests


def _numbers(text: str, flag: str, cast, shapes: str) -> list:
    """'N' or 'A:B[:C]' as numbers; a bad one names the flag and `shapes`, what is allowed."""
    try:
        return [cast(x) for x in text.split(":")]
    except ValueError:
        raise ValueError(f"{flag} = {text!r}: allowed: {shapes}") from None


def parse_rates(text: str, flag: str) -> list[float]:
    """One rate, or LO:HI:N for N rates from LO to HI (the simulator's sweep)."""
    shapes = "a rate > 0, or LO:HI:N (0 < LO <= HI, N >= 1 rates)"
    p = _numbers(text, flag, float, shapes)
    if len(p) == 1 and p[0] > 0:
        return p
    if len(p) == 3 and 0 < p[0] <= p[1] and p[2] >= 1 and p[2] == int(p[2]):
        return [float(r) for r in np.linspace(p[0], p[1], int(p[2]))]
    raise ValueError(f"{flag} = {text!r}: allowed: {shapes}")


def parse_length(text: str, flag: str):
    """Tokens per request: N, or LO:HI (uniform)."""
    shapes = "a token count >= 1, or LO:HI with 1 <= LO <= HI"
    p = _numbers(text, flag, int, shapes)
    if len(p) == 1 and p[0] >= 1:
        return p[0]
    if len(p) == 2 and 1 <= p[0] <= p[1]:
        return tuple(p)
    raise ValueError(f"{flag} = {text!r}: allowed: {shapes}")
