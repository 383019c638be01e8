"""`paratrain serve estimate | plan | recommend | simulate`: serving capacity, latency and cost."""

from __future__ import annotations

import argparse
import json
import math

SERVE_HELP = """\
Serving: how many chips of which kind serve a request rate at a latency target, and what a million tokens
costs. The model (prefill compute-bound, decode bandwidth-bound, KV cache paged, TP/PP replicas) and its
accuracy against published vLLM / TensorRT-LLM / Neuron measurements: docs/serving.md.

  paratrain serve estimate --model llama3-70b --hardware p5.48xlarge --tp 4 --batch 32 --prompt 1024 --output 256
  paratrain serve plan --model llama3-70b --hardware trn2.48xlarge --rate 20 --prompt 1024 --output 256 \\
      --ttft 1.0 --itl 0.05 --weights bf16,fp8 --price-per-node-hour-usd 40
  paratrain serve recommend chat --model llama3-70b --rate 50
  paratrain serve simulate --model llama3-8b --hardware p5.48xlarge --tp 1 --rate 5:60:20 --prompt 512 --output 128
"""


def _model_hw(p: argparse.ArgumentParser, hardware: bool = True) -> None:
    p.add_argument("--model", required=True,
                   help="preset name (or mixtral-8x7b) or model TOML file (with experts/experts_per_token: MoE)")
    if hardware:
        p.add_argument("--hardware", required=True, help="system name (paratrain hardware list) or TOML file")
    p.add_argument("--json", action="store_true", help="print only JSON")


def _stack_arg(p: argparse.ArgumentParser) -> None:
    from paratrain.plan.serve import serving_stacks

    p.add_argument("--stack", choices=serving_stacks(), default=None,
                   help="serving-stack efficiency table (default: the chip vendor's current engines; "
                        "plan/serving_efficiency.toml)")


def _replica_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, help="tensor parallel degree of a replica")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel degree of a replica")
    p.add_argument("--ep", type=int, default=1, help="expert parallel degree (mixture-of-experts models; divides tp)")
    p.add_argument("--weights", default="bf16", help="weight precision: bf16, fp8, int8, int4 (weight-only)")
    p.add_argument("--kv", default="bf16", help="KV-cache precision: bf16, fp8, int8")
    p.add_argument("--spec-tokens", type=int, default=0, help="speculative decoding: draft tokens per step")
    p.add_argument("--spec-accept", type=float, default=0.7, help="probability a draft token is accepted")
    p.add_argument("--draft", default=None, help="draft model (preset or TOML) for speculative decoding")


def _mix_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--prompt", type=int, required=required, help="input tokens per request")
    p.add_argument("--output", type=int, required=required, help="output tokens per request")


def register(subparsers) -> None:
    serve = subparsers.add_parser("serve", help="serving capacity, latency and cost (estimate/plan/recommend/simulate)",
                                  description=SERVE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = serve.add_subparsers(dest="serve_command", metavar="SUBCOMMAND")

    est = sub.add_parser("estimate", help="latency, throughput and memory of one replica at one batch")
    _model_hw(est)
    _replica_args(est)
    _mix_args(est)
    est.add_argument("--batch", default="1",
                     help="concurrent sequences on the replica; a comma list (1,8,32,128) prints one row each")
    _stack_arg(est)
    est.set_defaults(func=cmd_estimate)

    pl = sub.add_parser("plan", help="the cheapest replica layout and count meeting a latency target at a rate")
    _model_hw(pl)
    _mix_args(pl)
    _target_args(pl)
    pl.add_argument("--weights", default="bf16", help="weight precisions to search, comma-separated (bf16,fp8,int8,int4)")
    pl.add_argument("--kv", default="bf16", help="KV-cache precisions to search, comma-separated")
    pl.add_argument("--top", type=int, default=5, help="how many deployments to show")
    pl.add_argument("--simulate", type=int, default=0, metavar="REQUESTS",
                    help="check the best deployment with the request-level simulator: one replica at its share of "
                         "the rate, this many Poisson requests (p50/p99 TTFT and ITL, SLO attainment)")
    pl.add_argument("--price-per-node-hour-usd", type=float, default=None, dest="price",
                    help="USD per node-hour (overrides the catalog; needed where it has no price)")
    _purchase_arg(pl)
    _stack_arg(pl)
    pl.set_defaults(func=cmd_plan)

    rec = sub.add_parser("recommend", help="which hardware serves a workload (chat, rag, batch) cheapest, with reasons")
    rec.add_argument("workload", choices=["chat", "rag", "batch"], help="chat, long-context rag, or batch/offline")
    _model_hw(rec, hardware=False)
    rec.add_argument("--rate", type=float, default=10.0, help="requests per second (default 10)")
    _mix_args(rec, required=False)
    rec.add_argument("--ttft", type=float, default=None, help="time-to-first-token target, s (default per workload)")
    rec.add_argument("--itl", type=float, default=None, help="inter-token latency target, s (default per workload)")
    rec.add_argument("--systems", default=None, help="comma-separated systems (default: trn2, trn3, inf2 and GPUs)")
    rec.add_argument("--weights", default="bf16", help="weight precisions allowed, comma-separated")
    rec.add_argument("--price-per-node-hour-usd", action="append", default=[], dest="price",
                     metavar="SYSTEM=USD", help="a node-hour price (needed to rank systems without a public price)")
    _purchase_arg(rec)
    rec.set_defaults(func=cmd_recommend)

    sim = sub.add_parser("simulate", help="request-level simulation: p50/p90/p99 TTFT and ITL, goodput, over rates")
    _model_hw(sim)
    _replica_args(sim)
    sim.add_argument("--prompt", default=None, help="input tokens per request: N, or LO:HI (uniform)")
    sim.add_argument("--output", default=None, help="output tokens per request: N, or LO:HI (uniform)")
    sim.add_argument("--rate", default=None, help="Poisson requests/s: one value, or LO:HI:N for N rates")
    sim.add_argument("--trace", default=None, metavar="CSV",
                     help="given arrivals instead of --rate: a CSV with columns arrival_s,prompt,output")
    sim.add_argument("--requests", type=int, default=1000, help="requests per rate (default 1000)")
    sim.add_argument("--token-budget", type=int, default=8192, help="tokens per iteration (chunked prefill)")
    sim.add_argument("--max-seqs", type=int, default=256, help="most sequences running at once")
    sim.add_argument("--ttft", type=float, default=None, help="SLO: time to first token, s (for goodput)")
    sim.add_argument("--itl", type=float, default=None, help="SLO: time per output token, s (for goodput)")
    sim.add_argument("--seed", type=int, default=0)
    _stack_arg(sim)
    sim.set_defaults(func=cmd_simulate)
    serve.set_defaults(func=lambda args: serve.print_help() or 0)


def _purchase_arg(p: argparse.ArgumentParser) -> None:
    from paratrain.hardware.catalog import PURCHASE_OPTIONS

    p.add_argument("--purchase", choices=PURCHASE_OPTIONS, default="on-demand",
                   help="which catalog price to use (default on-demand)")


def _target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, required=True, help="requests per second to serve")
    p.add_argument("--ttft", type=float, default=None, help="time-to-first-token target, s")
    p.add_argument("--itl", type=float, default=None, help="inter-token latency target, s")
    p.add_argument("--max-utilization", type=float, default=0.8,
                   help="share of replica capacity to plan for (default 0.8: queueing headroom)")


def _load(args):
    from paratrain.hardware.catalog import resolve_system
    from paratrain.plan.serve import load_serving_model

    return load_serving_model(args.model), resolve_system(args.hardware) if hasattr(args, "hardware") else None


def _replica(args):
    from paratrain.plan.serve import Replica

    return Replica(tp=args.tp, pp=args.pp, ep=args.ep, weights=args.weights, kv=args.kv, spec_tokens=args.spec_tokens,
                   spec_accept=args.spec_accept, draft=args.draft)


def _list(text: str, name: str, allowed) -> tuple[str, ...]:
    from paratrain.cli import UserError

    items = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise UserError(f"--{name} = {text!r}: allowed: {', '.join(allowed)} (comma-separated)")
    return items


def clean(obj):
    """JSON-safe: NaN/inf become null."""
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [clean(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def cmd_estimate(args) -> int:
    from paratrain.plan.serve import estimate, serving_efficiency

    model, system = _load(args)
    eff = serving_efficiency(system, args.stack)
    ests = [estimate(model, system, _replica(args), b, args.prompt, args.output, eff) for b in _batches(args.batch)]
    if args.json:
        out = [clean(e.to_dict()) for e in ests]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=2))
        return 0
    if len(ests) == 1:
        _print_estimate(ests[0])
        return 0
    print(f"{'batch':>6} {'TTFT ms':>8} {'ITL ms':>7} {'step ms':>8} {'req/s':>7} {'out tok/s':>10} {'KV GiB/dev':>10} fits")
    for e in ests:
        print(f"{e.batch:>6} {e.ttft_s * 1e3:>8.1f} {e.itl_s * 1e3:>7.2f} {e.decode_step_s * 1e3:>8.2f} "
              f"{e.requests_per_s:>7.2f} {e.output_tokens_per_s:>10,.0f} {e.kv_bytes_per_device / 2**30:>10.2f} "
              f"{'yes' if e.fits else 'NO'}")
    print(f"at most {ests[0].max_sequences} sequences of {args.prompt + args.output} tokens fit per replica")
    return 0


def _batches(text: str) -> list[int]:
    from paratrain.cli import UserError

    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UserError(f"--batch = {text!r}: allowed: an integer >= 1 or a comma list of them (1,8,32)")
    return values


def _print_estimate(est) -> None:
    rep = est.replica
    gib = 2**30
    print(f"{est.model} on {est.system}: replica tp {rep.tp} x pp {rep.pp} ({est.devices} devices, {est.chips:g} chips), "
          f"weights {rep.weights}, KV {rep.kv}" + (f", speculative {rep.spec_tokens} x {rep.draft}" if rep.spec_tokens else ""))
    print(f"request          {est.prompt} in + {est.output} out tokens, batch {est.batch}")
    print(f"TTFT             {est.ttft_s * 1e3:.1f} ms (prefill {est.prefill_s * 1e3:.1f} ms + one decode step)")
    print(f"ITL              {est.itl_s * 1e3:.2f} ms (decode step {est.decode_step_s * 1e3:.2f} ms + prefill stalls)")
    print(f"throughput       {est.requests_per_s:.2f} req/s, {est.output_tokens_per_s:,.0f} output tok/s per replica")
    print(f"memory/device    weights {est.weights_bytes_per_device / gib:.2f} GiB + KV {est.kv_bytes_per_device / gib:.2f} GiB "
          f"of {est.memory_capacity_bytes / gib:.1f} GiB usable; at most {est.max_sequences} sequences "
          f"({'fits' if est.fits else 'DOES NOT FIT'})")
    print(f"KV per token     {est.kv_bytes_per_token_per_device / 1024:.1f} KiB per device")
    for note in est.notes:
        print(f"note: {note}")


def cmd_plan(args) -> int:
    from paratrain.cli import UserError
    from paratrain.cost.serving import serving_cost
    from paratrain.plan.serve import KV_PRECISIONS, WEIGHT_PRECISIONS, Target, plan, serving_efficiency

    model, system = _load(args)
    if args.top < 1:
        raise UserError(f"--top = {args.top}: must be >= 1")
    target = Target(rate=args.rate, prompt=args.prompt, output=args.output, ttft_s=args.ttft, itl_s=args.itl,
                    max_utilization=args.max_utilization)
    plans = plan(model, system, target, weights=_list(args.weights, "weights", WEIGHT_PRECISIONS),
                 kv=_list(args.kv, "kv", KV_PRECISIONS), top=args.top, eff=serving_efficiency(system, args.stack))
    if not plans:
        raise UserError(f"no replica layout of {model.name} on {system.name} meets the target (the weights do not "
                        "fit, or one replica cannot reach the TTFT/ITL target): try a looser target, fp8/int4 "
                        "weights, or another system")
    if args.price is not None and not args.price > 0:
        raise UserError(f"--price-per-node-hour-usd = {args.price}: must be > 0")
    costs = [serving_cost(p, system, target, args.price, args.purchase) for p in plans]
    if args.simulate < 0:
        raise UserError(f"--simulate = {args.simulate}: must be >= 0 requests")
    check = _simulate_best(model, system, plans[0], target, args.simulate, serving_efficiency(system, args.stack)) \
        if args.simulate else None
    if args.json:
        print(json.dumps(clean({"target": vars(target), "deployments": [
            {**p.to_dict(), "cost": c.to_dict()} for p, c in zip(plans, costs, strict=True)],
            "simulated": None if check is None else check.to_dict()}), indent=2))
        return 0
    print(f"{model.name} on {system.name}: {target.rate:g} req/s of {target.prompt}+{target.output} tokens, "
          f"TTFT <= {target.ttft_s or '-'} s, ITL <= {target.itl_s or '-'} s, planned at <= {target.max_utilization:.0%} load")
    print(f"{'#':>2} {'tp':>3} {'pp':>3} {'w':>5} {'kv':>5} {'batch':>5} {'replicas':>8} {'chips':>7} {'nodes':>5} "
          f"{'TTFT ms':>8} {'ITL ms':>7} {'$/h':>9} {'$/M out':>8} {'$/M in':>7}")
    for i, (p, c) in enumerate(zip(plans, costs, strict=True), 1):
        e, r = p.estimate, p.estimate.replica
        usd = "-" if c.usd_per_hour is None else f"{c.usd_per_hour:,.0f}"
        out = "-" if c.usd_per_million_output_tokens is None else f"{c.usd_per_million_output_tokens:.3f}"
        inp = "-" if c.usd_per_million_input_tokens is None else f"{c.usd_per_million_input_tokens:.3f}"
        print(f"{i:>2} {r.tp:>3} {r.pp:>3} {r.weights:>5} {r.kv:>5} {e.batch:>5} {p.replicas:>8} {p.chips:>7g} "
              f"{c.nodes:>5} {e.ttft_s * 1e3:>8.0f} {e.itl_s * 1e3:>7.1f} {usd:>9} {out:>8} {inp:>7}")
    best = costs[0]
    print(f"chips per 1,000 req/s: {best.chips_per_1000_rps:,.0f}"
          + ("" if best.output_tokens_per_s_per_mw is None else
             f"; output tokens/s per MW of accelerators: {best.output_tokens_per_s_per_mw:,.0f}"))
    if check is not None:
        print(f"simulated (one replica at {target.rate / plans[0].replicas:.2f} req/s, {check.requests} requests): "
              f"TTFT p50 {check.ttft_s['p50'] * 1e3:.0f} ms p99 {check.ttft_s['p99'] * 1e3:.0f} ms; ITL p50 "
              f"{check.itl_s['p50'] * 1e3:.1f} ms p99 {check.itl_s['p99'] * 1e3:.1f} ms; TPOT mean "
              f"{check.tpot_s['mean'] * 1e3:.1f} ms; SLO met by {check.slo_attainment:.1%} of requests")
    if best.usd_per_hour is None:
        print(f"note: {best.price_source}; pass --price-per-node-hour-usd for costs")
    else:
        print(f"price: {best.price_source}")
    return 0


def _simulate_best(model, system, deployment, target, requests: int, eff):
    """The request-level simulator on one replica of the deployment at its share of the rate, with the
    deployment's batch as the running-sequence limit."""
    from paratrain.sim.serving import Engine, Requests, Slo, simulate

    rep = deployment.estimate.replica
    reqs = Requests.poisson(target.rate / deployment.replicas, requests, target.prompt, target.output)
    return simulate(model, system, rep, reqs, Engine(max_seqs=deployment.estimate.batch),
                    Slo(target.ttft_s, target.itl_s), eff)


def cmd_recommend(args) -> int:
    from paratrain.cost.commands import _prices
    from paratrain.cost.serving import DEFAULT_SYSTEMS, WORKLOADS, recommend
    from paratrain.plan.serve import WEIGHT_PRECISIONS

    systems = DEFAULT_SYSTEMS if args.systems is None else tuple(s.strip() for s in args.systems.split(","))
    target, cands = recommend(args.workload, args.model, args.rate, systems,
                              weights=_list(args.weights, "weights", WEIGHT_PRECISIONS), prices=_prices(args.price),
                              purchase=args.purchase,
                              prompt=args.prompt, output=args.output, ttft_s=args.ttft, itl_s=args.itl)
    if args.json:
        print(json.dumps(clean({"workload": args.workload, "target": vars(target),
                                "candidates": [c.to_dict() for c in cands]}), indent=2))
        return 0
    print(f"{args.workload}: {WORKLOADS[args.workload]['about']}; {target.rate:g} req/s of {args.model}")
    print(f"{'system':<18} {'chips':>6} {'$/h':>9} {'$/M out':>8} {'$/M in':>7} {'$/M tok':>8} {'chips/1k rps':>12}")
    for c in cands:
        if c.cost is None:
            print(f"{c.system:<18} {'-':>6}")
        else:
            k = c.cost
            f = (lambda v, d=3: "-" if v is None else f"{v:,.{d}f}")  # noqa: E731
            print(f"{c.system:<18} {k.chips:>6g} {f(k.usd_per_hour, 0):>9} {f(k.usd_per_million_output_tokens):>8} "
                  f"{f(k.usd_per_million_input_tokens):>7} {f(k.usd_per_million_tokens):>8} {k.chips_per_1000_rps:>12,.0f}")
        for reason in c.reasons:
            print(f"    {reason}")
    return 0


def _rates(text: str) -> list[float]:
    from paratrain.cli import UserError

    try:
        parts = [float(x) for x in text.split(":")]
    except ValueError:
        parts = []
    if len(parts) == 1 and parts[0] > 0:
        return parts
    if len(parts) == 3 and 0 < parts[0] <= parts[1] and parts[2] >= 1 and parts[2] == int(parts[2]):
        import numpy as np

        return [float(r) for r in np.linspace(parts[0], parts[1], int(parts[2]))]
    raise UserError(f"--rate = {text!r}: allowed: a rate > 0, or LO:HI:N (0 < LO <= HI, N >= 1 rates)")


def _length(text: str, name: str):
    """N or LO:HI (uniform) tokens."""
    from paratrain.cli import UserError

    try:
        parts = [int(x) for x in text.split(":")]
    except ValueError:
        parts = []
    if len(parts) == 1 and parts[0] >= 1:
        return parts[0]
    if len(parts) == 2 and 1 <= parts[0] <= parts[1]:
        return tuple(parts)
    raise UserError(f"--{name} = {text!r}: allowed: a token count >= 1, or LO:HI with 1 <= LO <= HI")


def _trace(path: str):
    """Requests from a CSV (arrival_s,prompt,output), sorted by arrival."""
    import csv

    import numpy as np

    from paratrain.cli import UserError
    from paratrain.sim.serving import Requests

    try:
        with open(path, newline="") as fh:
            rows = list(csv.DictReader(fh))
        arrival = np.array([float(r["arrival_s"]) for r in rows])
        prompt = np.array([int(r["prompt"]) for r in rows])
        output = np.array([int(r["output"]) for r in rows])
    except FileNotFoundError:
        raise UserError(f"--trace {path}: no such file") from None
    except (KeyError, ValueError, TypeError) as exc:
        raise UserError(f"--trace {path}: need columns arrival_s (s), prompt, output (tokens >= 1): {exc}") from None
    if len(rows) < 2 or prompt.min() < 1 or output.min() < 1 or arrival.min() < 0:
        raise UserError(f"--trace {path}: need >= 2 requests, arrival_s >= 0, prompt and output >= 1")
    order = np.argsort(arrival, kind="stable")
    return Requests(arrival[order], prompt[order], output[order])


def cmd_simulate(args) -> int:
    import time

    from paratrain.cli import UserError
    from paratrain.plan.serve import check_replica, serving_efficiency
    from paratrain.sim.serving import Engine, Slo, sweep

    model, system = _load(args)
    rep = _replica(args)
    check_replica(model, system, rep)
    engine = Engine(token_budget=args.token_budget, max_seqs=args.max_seqs)
    slo, eff = Slo(args.ttft, args.itl), serving_efficiency(system, args.stack)
    if (args.trace is None) == (args.rate is None):
        raise UserError("give either --rate (Poisson arrivals, with --prompt and --output) or --trace CSV")
    start = time.perf_counter()
    if args.trace:
        from paratrain.sim.serving import simulate

        reqs = _trace(args.trace)
        rate = (len(reqs.arrival_s) - 1) / max(reqs.arrival_s[-1] - reqs.arrival_s[0], 1e-9)
        results = [(rate, simulate(model, system, rep, reqs, engine, slo, eff))]
        args.requests, args.prompt, args.output = len(reqs.arrival_s), "trace", "trace"
    else:
        if args.prompt is None or args.output is None:
            raise UserError("--rate needs --prompt and --output (N or LO:HI tokens)")
        results = sweep(model, system, rep, _rates(args.rate), args.requests, _length(args.prompt, "prompt"),
                        _length(args.output, "output"), engine, slo, args.seed, eff)
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps(clean({"seconds": seconds, "results": [{"rate": r, **res.to_dict()} for r, res in results]}),
                         indent=2))
        return 0
    print(f"{model.name} on {system.name}, tp {rep.tp} pp {rep.pp}: {args.requests} requests of "
          f"{args.prompt}+{args.output} tokens per rate ({seconds:.2f} s)")
    print(f"{'rate':>7} {'thr rps':>8} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'ITL p50':>8} {'p99':>7} "
          f"{'TPOT':>7} {'batch':>6} {'goodput':>8}")
    for rate, r in results:
        print(f"{rate:>7.2f} {r.throughput_rps:>8.2f} {r.ttft_s['p50'] * 1e3:>8.0f}m {r.ttft_s['p90'] * 1e3:>7.0f}m "
              f"{r.ttft_s['p99'] * 1e3:>7.0f}m {r.itl_s['p50'] * 1e3:>7.1f}m {r.itl_s['p99'] * 1e3:>6.1f}m "
              f"{r.tpot_s['mean'] * 1e3:>6.1f}m {r.mean_batch:>6.1f} {r.goodput_rps:>8.2f}")
    return 0
