"""`paratrain serve estimate | plan | recommend | simulate`: serving capacity, latency and cost."""

from __future__ import annotations

import time
from dataclasses import dataclass

from paratrain.cli import OnSystem, Output, UserError, command, from_options, opt, options_of, show
from paratrain.cost.commands import Prices
from paratrain.cost.compare import Assumptions
from paratrain.cost.inputs import parse_prices
from paratrain.cost.serving import DEFAULT_SYSTEMS, recommend, serving_cost
from paratrain.hardware.catalog import resolve_system
from paratrain.plan import serve
from paratrain.plan import serve_report as report
from paratrain.plan.serve import KV_PRECISIONS, WEIGHT_PRECISIONS, Replica, Target, serving_stacks
from paratrain.sim.serving import Engine, Slo, simulate_deployment, simulate_requests

GROUPS = [("serve", "serving capacity, latency and cost (estimate/plan/recommend/simulate)")]
Latency, OneReplica = options_of(Target, ("ttft_s", "itl_s")), options_of(Replica)  # the schemas' fields
WEIGHTS = tuple(WEIGHT_PRECISIONS)


@dataclass(kw_only=True)
class ServeModel(Output):
    model: str = opt("preset name (or mixtral-8x7b) or model TOML file (with experts/experts_per_token: MoE)",
                     required=True)


@dataclass(kw_only=True)
class ServeOn(ServeModel, OnSystem):
    stack: str | None = opt("serving-stack efficiency table (default: the chip vendor's current engines; "
                            "plan/serving_efficiency.toml)", choices=serving_stacks())


@dataclass(kw_only=True)
class Lengths:
    prompt_tokens: int = opt("input tokens per request", required=True, ge=1)
    output_tokens: int = opt("output tokens per request", required=True, ge=1)


def _load(args):
    system = resolve_system(args.hardware)
    return serve.load_serving_model(args.model), system, serve.serving_efficiency(system, args.stack)


@command("serve estimate", (OneReplica, ServeOn, Lengths), "latency, throughput and memory of one replica at one batch",
         batch=(tuple[int, ...], opt("concurrent sequences on the replica; a comma list (1,8,32,128) prints one "
                                     "row each", (1,), ge=1)))
def cmd_estimate(args) -> None:
    model, system, eff = _load(args)
    ests = [serve.estimate(model, system, from_options(Replica, args), b, args.prompt_tokens, args.output_tokens, eff)
            for b in args.batch]
    if len(ests) == 1:
        return show(args, ests[0].to_dict(), lambda: report.print_estimate(ests[0]))
    show(args, [e.to_dict() for e in ests], lambda: report.print_estimates(ests, args.prompt_tokens,
                                                                           args.output_tokens))


@command("serve plan", (ServeOn, Lengths, Prices, options_of(Target)),
         "the cheapest replica layout and count meeting a latency target at a rate",
         rate=(float, opt("requests per second to serve", required=True, gt=0)),
         weights=(tuple[str, ...], opt("weight precisions to search, comma-separated (bf16,fp8,int8,int4)",
                                       ("bf16",), choices=WEIGHTS)),
         kv=(tuple[str, ...], opt("KV-cache precisions to search, comma-separated", ("bf16",),
                                  choices=tuple(KV_PRECISIONS))),
         top=(int, opt("how many deployments to show", 5, ge=1)),
         simulate=(int, opt("check the best deployment with the request-level simulator: one replica at its share "
                            "of the rate, this many Poisson requests (p50/p99 TTFT and ITL, SLO attainment)", 0,
                            ge=0, metavar="REQUESTS")))
def cmd_plan(args) -> None:
    model, system, eff = _load(args)
    target = from_options(Target, args, prompt=args.prompt_tokens, output=args.output_tokens)
    price = parse_prices(args.price_per_node_hour_usd, system=system.name).get(system.name)
    plans = serve.plan(model, system, target, weights=args.weights, kv=args.kv, top=args.top, eff=eff)
    if not plans:
        raise UserError(f"no replica layout of {model.name} on {system.name} meets the target (the weights do not "
                        "fit, or one replica cannot reach the TTFT/ITL target): try a looser target, fp8/int4 "
                        "weights, or another system")
    costs = [serving_cost(p, system, target, price, args.purchase or Assumptions.purchase) for p in plans]
    check = simulate_deployment(model, system, plans[0], target, args.simulate, eff) if args.simulate else None
    show(args, {"target": vars(target), "simulated": None if check is None else check.to_dict(),
                "deployments": [{**p.to_dict(), "cost": c.to_dict()} for p, c in zip(plans, costs, strict=True)]},
         lambda: report.print_plan(model, system, target, plans, costs, check))


@command("serve recommend", (ServeModel, Latency, Prices),
         "which hardware serves a workload (chat, rag, batch) cheapest, with reasons",
         workload=(str, opt("chat, long-context rag, or batch/offline", positional=True,
                            choices=("chat", "rag", "batch"))),
         rate=(float, opt("requests per second", 10.0, gt=0)),
         prompt_tokens=(int | None, opt("input tokens per request (default per workload)", ge=1)),
         output_tokens=(int | None, opt("output tokens per request (default per workload)", ge=1)),
         systems=(tuple[str, ...] | None, opt("comma-separated systems (default: trn2, trn3, inf2 and GPUs)")),
         weights=(tuple[str, ...], opt("weight precisions allowed, comma-separated", ("bf16",), choices=WEIGHTS)))
def cmd_recommend(args) -> None:
    target, cands = recommend(args.workload, args.model, args.rate, args.systems or DEFAULT_SYSTEMS,
                              weights=args.weights, prices=parse_prices(args.price_per_node_hour_usd),
                              purchase=args.purchase or Assumptions.purchase, prompt=args.prompt_tokens,
                              output=args.output_tokens, ttft_s=args.ttft_s, itl_s=args.itl_s)
    show(args, {"workload": args.workload, "target": vars(target), "candidates": [c.to_dict() for c in cands]},
         lambda: report.print_recommendation(args.workload, args.model, target, cands))


@command("serve simulate", (OneReplica, ServeOn, Latency, options_of(Engine)),
         "request-level simulation: p50/p90/p99 TTFT and ITL, goodput, over rates",
         prompt_tokens=(str | None, opt("input tokens per request: N, or LO:HI (uniform)")),
         output_tokens=(str | None, opt("output tokens per request: N, or LO:HI (uniform)")),
         rate=(str | None, opt("Poisson requests/s: one value, or LO:HI:N for N rates")),
         trace=(str | None, opt("given arrivals instead of --rate: a CSV with columns arrival_s,prompt,output",
                                metavar="CSV")),
         requests=(int, opt("requests per rate", 1000, ge=1)),
         seed=(int, opt("random seed", 0)))
def cmd_simulate(args) -> None:
    model, system, eff = _load(args)
    serve.check_replica(model, system, rep := from_options(Replica, args), eff.head_layout)
    start = time.perf_counter()
    results, requests = simulate_requests(model, system, rep, from_options(Engine, args), Slo(args.ttft_s, args.itl_s),
                                          eff, trace=args.trace, rate=args.rate, prompt=args.prompt_tokens,
                                          output=args.output_tokens, requests=args.requests, seed=args.seed)
    seconds = time.perf_counter() - start
    prompt, output = ("trace", "trace") if args.trace else (args.prompt_tokens, args.output_tokens)
    show(args, {"seconds": seconds, "results": [{"rate": r, **res.to_dict()} for r, res in results]},
         lambda: report.print_sweep(model, system, rep, requests, prompt, output, seconds, results))
