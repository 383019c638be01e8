"""`paratrain compare` and `paratrain recommend`."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.cli import Output, UserError, Workload, command, from_options, opt, options_of, show
from paratrain.cost.inputs import parse_prices  # noqa: F401  (serve plan/recommend parse the same flag)
from paratrain.cost.recommend import Request
from paratrain.hardware.catalog import PURCHASE_HELP, PURCHASE_OPTIONS

COMPARE_HELP = """\
Time, dollars and energy to train one workload on several clusters, each with the planner's best layout;
failures and checkpoints from the simulator (or Daly's formula with --failures daly).

  paratrain compare --model llama2-7b --train-tokens 1e12 --seq 4096 --global-batch 1024 \\
      --targets trn1.32xlarge:16,p4d.24xlarge:16 --report runs/compare
  paratrain compare --model llama3-70b --train-tokens 15e12 --targets p5.48xlarge:128,trn2-ultraserver:32 \\
      --price-per-node-hour-usd trn2-ultraserver=180 --json
  paratrain compare --model llama3-8b --steps 20000 --seq 8192 --global-batch 512 \\
      --targets p5.48xlarge:16,p6-b200.48xlarge:8 --failures daly --purchase capacity-block
  paratrain compare --claims          # the source documents' cost claims, each beside ours (docs/cost.md)

The run length is --train-tokens or --steps (tokens = steps x seq x global batch). Per target: the planner's best
layout, MFU, days to train including failures, restarts and checkpoints (`overhead` = the share they add),
accelerator-hours (chips x wall hours), the cost at --purchase (on-demand, capacity-block, savings-1y,
savings-3y or spot; the catalog's price per node-hour, its region and the date it was read are printed beside
it), price per chip-hour and per peak BF16 PFLOP-hour, cost per million tokens, energy (accelerators + host
share, x PUE) and tokens per MWh. A system without a price at that option (Trn2/Trn3 UltraServers publish
none) gets, in place of its cost, the break-even price per node-hour at which it would tie the cheapest
priced target; --price-per-node-hour-usd SYSTEM=USD gives it one. Then the sensitivity: $ per million tokens
at every purchase option, and each target's rank with its own price -30% .. +30% (--sensitivity-plot PNG).
--config FILE reads the same choices from a [cost] table (flags win):

  [cost]
  purchase = "capacity-block"
  pue = 1.2
  failures = "daly"
  price_per_node_hour_usd = { trn3-ultraserver = 400.0 }

Every assumption is printed with the table; --json has every field, --report DIR an HTML page with plots.
"""

RECOMMEND_HELP = """\
Recommend an infrastructure for a workload, with every rule and number that decided it. Kinds:
  pretrain    pre-training from scratch (weeks or more)
  finetune    large fine-tuning (SFT, RLHF), cost-sensitive
  research    research prototyping that needs custom CUDA kernels
  experiment  short, small experiments (hours to days)
  multicloud  must run on several clouds
  onprem      must also run on-premises

How it decides (all printed): rules first (custom CUDA kernels, multi-cloud and on-premises need NVIDIA);
then, among what remains, the lowest total of compute (planner's best layout x simulator's goodput x the price
at --purchase, default on-demand; its option, region and date are printed beside it) plus porting the code to
the other software stack (--porting-days x --engineer-usd-per-day, paid only by systems on the stack the team
does not use, --current-stack). Every candidate gets the same number of accelerator chips (--chips; --nodes
for equal node counts). Systems without a price at that option (Trn2/Trn3 UltraServers publish none) are
planned but not ranked: their break-even price per node-hour is shown, as for every losing candidate;
--price-per-node-hour-usd SYSTEM=USD ranks them. The sensitivity tables show the ranking at every purchase
option and with each price -30% .. +30% (--sensitivity-plot PNG); --config FILE reads a [cost] table.

  paratrain recommend pretrain --model llama2-70b --train-tokens 2e12 --chips 512 --max-days 60
  paratrain recommend experiment
  paratrain recommend finetune --current-stack neuron
  paratrain recommend pretrain --constraint multicloud
  paratrain recommend pretrain --price-per-node-hour-usd trn3-ultraserver=500 --porting-days 30 --json
  paratrain recommend pretrain --purchase savings-3y --sensitivity-plot runs/rec.png
"""


@dataclass(kw_only=True)
class CostArgs(Workload, Output):
    train_tokens: float | None = opt("tokens to train, e.g. 1e12", gt=0, exclusive="length")
    purchase: str | None = opt(PURCHASE_HELP + " (default on-demand; config key cost.purchase)",
                               choices=PURCHASE_OPTIONS)
    price_per_node_hour_usd: list[str] = opt("your price for one node-hour of a system (a quote; overrides the "
                                             "catalog at every purchase option; needed to rank systems without a "
                                             "public price)", factory=list, metavar="SYSTEM=USD")
    price: str | None = opt("", refused="ambiguous (it meant USD per node-hour here but per device-hour in "
                            "`paratrain simulate`); use --price-per-node-hour-usd SYSTEM=USD")
    pue: float | None = opt("power usage effectiveness (default 1.2, assumption)")
    failures: str | None = opt("failure/checkpoint overhead: Monte-Carlo simulation (default), Daly's formula, or "
                               "none", choices=("simulate", "daly", "none"))
    config: str | None = opt("TOML file with a [cost] table: purchase, pue, failures, price_per_node_hour_usd = "
                             "{SYSTEM = USD} (flags override it)", metavar="FILE")
    sensitivity_plot: str | None = opt("write the plot of $ per million tokens by system and purchase option (with "
                                       "the +-30% price range) to this file", metavar="PNG")


@dataclass(kw_only=True)
class CompareArgs(CostArgs):
    model: str | None = opt("model preset or model TOML file (required unless --claims)")
    steps: int | None = opt("optimizer steps to train (tokens = steps x seq x global batch)", ge=1,
                            exclusive="length")
    targets: str | None = opt("SYSTEM:NODES,... e.g. trn1.32xlarge:16,p4d.24xlarge:16")
    report: str | None = opt("write an HTML report with plots to DIR", metavar="DIR")
    fp8: bool = opt("layer matmuls in FP8 at each chip's FP8 peak (the planner's FP8 model; Trainium3's FP8 peak "
                    "is MXFP8)")
    claims: bool = opt("run the source documents' cost claims (trn1 vs p4d on 7B; Trn2/Trn3 vs H100/H200/B200 on "
                       "70B and 405B; tokens per MWh across Trainium generations) and print each claim, the seed's "
                       "number, ours and why they differ")
    markdown: bool = opt("with --claims: print the claims as the Markdown table of docs/cost.md")


@dataclass(kw_only=True)
class RecommendArgs(CostArgs, options_of(Request, chips={"exclusive": "size"}, nodes={"exclusive": "size"},
                                          porting_engineer_days={"flag": "--porting-days", "metavar": "DAYS"},
                                          constraints={"flag": "--constraint"})):
    """recommend's options: the cost Request's fields (cost/recommend.py), the kind, and the defaults per kind."""
    kind: str = opt("pretrain, finetune, research, experiment, multicloud or onprem", positional=True)
    model: str | None = opt("model preset or model TOML file (default: per kind)")
    train_tokens: float | None = opt("tokens to train (default: per kind)", gt=0, exclusive="length")
    systems: tuple[str, ...] | None = opt("comma list of candidate systems (default: every catalog system; those "
                                          "without a price get a break-even price instead of a rank)")


def _progress(total: int, quiet: bool):
    if quiet:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="cluster", leave=False).update


@command("compare", CompareArgs, "time, cost and energy to train a workload across clusters", COMPARE_HELP)
def run_compare(args) -> int | None:
    from paratrain.cost.compare import Workload, comparison, parse_targets
    from paratrain.cost.inputs import assumptions_from
    from paratrain.cost.tables import print_comparison, write_sensitivity_plot

    if args.claims:
        from paratrain.cost.claims import run_claims

        return run_claims(args, assumptions_from(args), _progress)
    missing = [flag for flag, value in (("--model", args.model), ("--train-tokens or --steps", args.train_tokens or
                                        args.steps), ("--targets", args.targets)) if value is None]
    if missing:
        raise UserError(f"compare needs {', '.join(missing)} (or --claims)")
    targets, assumptions = parse_targets(args.targets), assumptions_from(args)
    workload = Workload.from_steps(args.model, args.steps, args.seq, args.global_batch, args.fp8) if args.steps \
        else from_options(Workload, args)
    out, rows, items = comparison(workload, targets, assumptions, progress=_progress(len(targets), args.json))
    if args.sensitivity_plot:
        out["sensitivity_plot"] = write_sensitivity_plot(args.sensitivity_plot, rows, items,
                                                         f"{out['workload']['model']}, {workload.train_tokens:.3g} tokens")
    if args.report:
        from paratrain.cost.report import write_report

        # the report plans each system at 1/4 to 4x its size too (Pareto and scaling plots)
        bar = _progress(4 * len(targets), args.json)
        out["report"] = str(write_report(args.report, workload, rows, targets, assumptions, progress=bar))
    show(args, out, lambda: print_comparison(out, rows))


@command("recommend", RecommendArgs, "which infrastructure for a workload, with the reasons", RECOMMEND_HELP)
def run_recommend(args) -> None:
    from paratrain.cost.inputs import assumptions_from
    from paratrain.cost.recommend import recommend
    from paratrain.cost.serving import WORKLOADS  # serving workloads are planned by `serve recommend`
    from paratrain.cost.tables import print_recommendation, write_recommendation_plot
    from paratrain.hardware.catalog import get_catalog

    if args.kind in WORKLOADS:
        raise UserError(f"recommend {args.kind}: a serving workload; run `paratrain serve recommend {args.kind} "
                        "--model M --rate REQ_PER_S` (chips, latency and $/M tokens per system, docs/serving.md)")
    systems = list(args.systems) if args.systems else None
    req = from_options(Request, args, systems=systems, assumptions=assumptions_from(args))
    rec = recommend(req, progress=_progress(len(systems or get_catalog().systems), args.json))
    out = {k: v for k, v in rec.__dict__.items() if k != "items"}
    if args.sensitivity_plot and rec.items:
        out["sensitivity_plot"] = write_recommendation_plot(args.sensitivity_plot, rec, args.kind, req)
    show(args, out, lambda: print_recommendation(args.kind, req, rec, out))
