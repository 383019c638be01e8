"""`paratrain compare` and `paratrain recommend`."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.cli import Output, UserError, Workload, command, from_options, opt, options_of, show
from paratrain.cost import compare, tables
from paratrain.cost.claims import run_claims
from paratrain.cost.compare import Assumptions
from paratrain.cost.inputs import assumptions_from
from paratrain.cost.recommend import Request, recommend
from paratrain.cost.report import write_report
from paratrain.cost.serving import WORKLOADS  # serving workloads are planned by `serve recommend`
from paratrain.hardware.catalog import PURCHASE_HELP, PURCHASE_OPTIONS, get_catalog


@dataclass(kw_only=True)
class Prices:
    """What a node-hour costs: one meaning in compare, recommend and serve plan/recommend."""
    purchase: str | None = opt(f"{PURCHASE_HELP} (default {Assumptions.purchase}; compare/recommend: the --config "
                               "file's cost.purchase first)", choices=PURCHASE_OPTIONS)
    price_per_node_hour_usd: list[str] = opt("your price for one node-hour of a system (a quote; overrides the "
                                             "catalog at every purchase option; needed to rank systems without a "
                                             "public price; serve plan: a bare USD is the --hardware system's)",
                                             factory=list, metavar="SYSTEM=USD")


@dataclass(kw_only=True)
class CostArgs(options_of(Assumptions, ("pue", "failures"), unset=True), Prices, Workload, Output):
    train_tokens: float | None = opt("tokens to train, e.g. 1e12", gt=0, exclusive="length")
    price: str | None = opt("", refused="ambiguous (it meant USD per node-hour here but per device-hour in "
                            "`paratrain simulate`); use --price-per-node-hour-usd SYSTEM=USD")
    config: str | None = opt("TOML file with a [cost] table: purchase, pue, failures, price_per_node_hour_usd = "
                             "{SYSTEM = USD} (flags override it)", metavar="FILE")
    sensitivity_plot: str | None = opt("write the plot of $ per million tokens by system and purchase option (with "
                                       "the +-30% price range) to this file", metavar="PNG", writes="file")


def _progress(total: int, quiet: bool):
    from tqdm import tqdm

    return None if quiet else tqdm(total=total, unit="cluster", leave=False).update


@command("compare", CostArgs, "time, cost and energy to train a workload across clusters",
         model=(str | None, opt("model preset or model TOML file (required unless --claims)")),
         steps=(int | None, opt("optimizer steps to train (tokens = steps x seq x global batch)", ge=1,
                                exclusive="length")),
         targets=(str | None, opt("SYSTEM:NODES,... e.g. trn1.32xlarge:16,p4d.24xlarge:16")),
         report=(str | None, opt("write an HTML report with plots to DIR", metavar="DIR", writes="dir")),
         fp8=(bool, opt("layer matmuls in FP8 at each chip's FP8 peak (the planner's FP8 model; Trainium3's FP8 "
                        "peak is MXFP8)")),
         claims=(bool, opt("run the source documents' cost claims (trn1 vs p4d on 7B; Trn2/Trn3 vs H100/H200/B200 "
                           "on 70B and 405B; tokens per MWh across Trainium generations) and print each claim, the "
                           "seed's number, ours and why they differ")),
         markdown=(bool, opt("with --claims: print the claims as the Markdown table of docs/cost.md")))
def run_compare(args) -> int | None:
    if args.claims:
        return run_claims(args, assumptions_from(args), _progress)
    missing = [flag for flag, value in (("--model", args.model), ("--train-tokens or --steps", args.train_tokens or
                                        args.steps), ("--targets", args.targets)) if value is None]
    if missing:
        raise UserError(f"compare needs {', '.join(missing)} (or --claims)")
    targets, assumptions = compare.parse_targets(args.targets), assumptions_from(args)
    workload = compare.Workload.from_steps(args.model, args.steps, args.seq, args.global_batch, args.fp8) \
        if args.steps else from_options(compare.Workload, args)
    out, rows, items = compare.comparison(workload, targets, assumptions, progress=_progress(len(targets), args.json))
    if args.sensitivity_plot:
        out["sensitivity_plot"] = tables.write_sensitivity_plot(
            args.sensitivity_plot, rows, items, f"{out['workload']['model']}, {workload.train_tokens:.3g} tokens")
    if args.report:
        # the report plans each system at 1/4 to 4x its size too (Pareto and scaling plots)
        bar = _progress(4 * len(targets), args.json)
        out["report"] = str(write_report(args.report, workload, rows, targets, assumptions, progress=bar))
    show(args, out, lambda: tables.print_comparison(out, rows))


@command("recommend", (CostArgs, options_of(Request, chips={"exclusive": "size"}, nodes={"exclusive": "size"},
                                            porting_engineer_days={"flag": "--porting-days", "metavar": "DAYS"},
                                            constraints={"flag": "--constraint"})),
         "which infrastructure for a workload, with the reasons",  # the cost Request's fields (cost/recommend.py)
         model=(str | None, opt("model preset or model TOML file (default: per kind)")),
         train_tokens=(float | None, opt("tokens to train (default: per kind)", gt=0, exclusive="length")))
def run_recommend(args) -> None:
    if args.kind in WORKLOADS:
        raise UserError(f"recommend {args.kind}: a serving workload; run `paratrain serve recommend {args.kind} "
                        "--model M --rate REQ_PER_S` (chips, latency and $/M tokens per system, docs/serving.md)")
    req = from_options(Request, args, assumptions=assumptions_from(args))
    rec = recommend(req, progress=_progress(len(req.systems or get_catalog().systems), args.json))
    out = {k: v for k, v in rec.__dict__.items() if k != "items"}
    if args.sensitivity_plot and rec.items:
        out["sensitivity_plot"] = tables.write_recommendation_plot(args.sensitivity_plot, rec, args.kind, req)
    show(args, out, lambda: tables.print_recommendation(args.kind, req, rec, out))
