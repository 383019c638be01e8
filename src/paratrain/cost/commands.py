"""`paratrain compare` and `paratrain recommend`."""

from __future__ import annotations

import argparse
import json

from paratrain.device import CUDA

COMPARE_HELP = """\
Time, dollars and energy to train one workload on several clusters, each with the planner's best layout;
failures and checkpoints from the simulator (or Daly's formula with --failures daly).

  paratrain compare --model llama2-7b --tokens 1e12 --seq 4096 --global-batch 1024 \\
      --targets trn1.32xlarge:16,p4d.24xlarge:16 --report runs/compare
  paratrain compare --model llama3-70b --tokens 15e12 --targets p5.48xlarge:128,trn2-ultraserver:32 \\
      --price-per-node-hour-usd trn2-ultraserver=180 --json
  paratrain compare --model llama3-8b --steps 20000 --seq 8192 --global-batch 512 \\
      --targets p5.48xlarge:16,p6-b200.48xlarge:8 --failures daly --purchase capacity-block
  paratrain compare --claims          # the source documents' cost claims, each beside ours (docs/cost.md)

The run length is --tokens or --steps (tokens = steps x seq x global batch). Per target: the planner's best
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

  paratrain recommend pretrain --model llama2-70b --tokens 2e12 --chips 512 --max-days 60
  paratrain recommend experiment
  paratrain recommend finetune --current-stack neuron
  paratrain recommend pretrain --constraint multicloud
  paratrain recommend pretrain --price-per-node-hour-usd trn3-ultraserver=500 --porting-days 30 --json
  paratrain recommend pretrain --purchase savings-3y --sensitivity-plot runs/rec.png
"""


def _add_common(p: argparse.ArgumentParser) -> None:
    from paratrain.hardware.catalog import PURCHASE_OPTIONS

    p.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    p.add_argument("--global-batch", type=int, default=1024, help="sequences per step (default 1024)")
    p.add_argument("--purchase", choices=PURCHASE_OPTIONS,
                   help="which catalog price the cost uses (default on-demand; config key cost.purchase)")
    p.add_argument("--price-per-node-hour-usd", action="append", default=[], metavar="SYSTEM=USD",
                   help="your price for one node-hour of a system (a quote; overrides the catalog at every purchase "
                        "option; needed to rank systems without a public price)")
    # The old flag: per node-hour here but per device-hour in `simulate`. Refused with a pointer to the named one.
    p.add_argument("--price", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--pue", type=float, help="power usage effectiveness (default 1.2, assumption)")
    p.add_argument("--failures", choices=("simulate", "daly", "none"),
                   help="failure/checkpoint overhead: Monte-Carlo simulation (default), Daly's formula, or none")
    p.add_argument("--config", metavar="FILE", help="TOML file with a [cost] table: purchase, pue, failures, "
                   "price_per_node_hour_usd = {SYSTEM = USD} (flags override it)")
    p.add_argument("--sensitivity-plot", metavar="PNG", help="write the plot of $ per million tokens by system and "
                   "purchase option (with the +-30%% price range) to this file")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def register(sub) -> None:
    c = sub.add_parser("compare", help="time, cost and energy to train a workload across clusters",
                       description=COMPARE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--model", help="preset name or model TOML file (required unless --claims)")
    length = c.add_mutually_exclusive_group()
    length.add_argument("--tokens", type=float, help="tokens to train, e.g. 1e12")
    length.add_argument("--steps", type=int, help="optimizer steps to train (tokens = steps x seq x global batch)")
    c.add_argument("--targets", help="SYSTEM:NODES,... e.g. trn1.32xlarge:16,p4d.24xlarge:16")
    c.add_argument("--report", metavar="DIR", help="write an HTML report with plots to DIR")
    c.add_argument("--fp8", action="store_true", help="layer matmuls in FP8 at each chip's FP8 peak (the planner's "
                   "FP8 model; Trainium3's FP8 peak is MXFP8)")
    c.add_argument("--claims", action="store_true", help="run the source documents' cost claims (trn1 vs p4d on "
                   "7B; Trn2/Trn3 vs H100/H200/B200 on 70B and 405B; tokens per MWh across Trainium generations) "
                   "and print each claim, the seed's number, ours and why they differ")
    c.add_argument("--markdown", action="store_true", help="with --claims: print the claims as the Markdown table "
                   "of docs/cost.md")
    _add_common(c)
    c.set_defaults(func=run_compare)

    r = sub.add_parser("recommend", help="which infrastructure for a workload, with the reasons",
                       description=RECOMMEND_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("kind", help="pretrain, finetune, research, experiment, multicloud or onprem")
    r.add_argument("--model", help="preset or model TOML (default: per kind)")
    r.add_argument("--tokens", type=float, help="tokens to train (default: per kind)")
    size = r.add_mutually_exclusive_group()
    size.add_argument("--chips", type=int,
                      help="accelerator chips per candidate cluster, the same for every system (default: per kind; "
                           "nodes = chips / chips per node, rounded up)")
    size.add_argument("--nodes", type=int, help="one node count for every candidate system instead of --chips")
    r.add_argument("--max-days", type=float, help="deadline: drop candidates slower than this")
    r.add_argument("--max-usd", type=float, help="budget: drop candidates whose total (compute + porting) is higher")
    r.add_argument("--current-stack", default=CUDA, help="the team's stack today: cuda (default) or neuron; "
                   "the other stack costs --porting-days")
    r.add_argument("--porting-days", type=float, default=20.0,
                   help="engineer-days to move the code base to the other stack (default 20, assumption)")
    r.add_argument("--engineer-usd-per-day", type=float, default=1200.0,
                   help="loaded cost of an engineer-day (default 1200, assumption)")
    r.add_argument("--constraint", action="append", default=[], metavar="NAME",
                   help="a hard constraint on top of the kind's own: cuda-kernels, multicloud or onprem "
                        "(repeatable), e.g. pretrain --constraint multicloud")
    r.add_argument("--systems", help="comma list of candidate systems (default: every catalog system; those "
                   "without a price get a break-even price instead of a rank)")
    _add_common(r)
    r.set_defaults(func=run_recommend)


def _prices(items: list[str], flag: str = "--price-per-node-hour-usd") -> dict[str, float]:
    from paratrain.hardware.catalog import resolve_system

    out = {}
    for item in items:
        name, _, value = item.partition("=")
        try:
            price = float(value)
        except ValueError:
            raise ValueError(f"{flag} '{item}': expected SYSTEM=USD (per node-hour), e.g. trn2.48xlarge=40") from None
        if not price > 0 or price == float("inf"):
            raise ValueError(f"{flag} '{item}': the price must be a number > 0")
        resolve_system(name)
        out[name] = price
    return out


COST_KEYS = ("purchase", "pue", "failures", "price_per_node_hour_usd")


def load_cost_config(path: str) -> dict:
    """The [cost] table of a TOML file, checked: unknown keys and bad values fail naming the key."""
    import tomllib

    from paratrain.hardware.catalog import PURCHASE_OPTIONS

    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ValueError(f"--config {path!r}: cannot read ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path!r}: not valid TOML: {exc}") from None
    table = data.get("cost")
    if not isinstance(table, dict):
        raise ValueError(f"--config {path!r}: no [cost] table; allowed keys: {', '.join(COST_KEYS)}")
    for key in table:
        if key not in COST_KEYS:
            raise ValueError(f"{path}: cost.{key}: unknown key; allowed: {', '.join(COST_KEYS)}")
    if "purchase" in table and table["purchase"] not in PURCHASE_OPTIONS:
        raise ValueError(f"{path}: cost.purchase = {table['purchase']!r}: allowed: {', '.join(PURCHASE_OPTIONS)}")
    if "failures" in table and table["failures"] not in ("simulate", "daly", "none"):
        raise ValueError(f"{path}: cost.failures = {table['failures']!r}: allowed: simulate, daly, none")
    if "pue" in table and not (isinstance(table["pue"], int | float) and table["pue"] >= 1):
        raise ValueError(f"{path}: cost.pue = {table['pue']!r}: allowed: a number >= 1")
    prices = table.get("price_per_node_hour_usd", {})
    if not isinstance(prices, dict):
        raise ValueError(f"{path}: cost.price_per_node_hour_usd = {prices!r}: allowed: a table SYSTEM = USD")
    table = dict(table)
    table["price_per_node_hour_usd"] = _prices([f"{k}={v}" for k, v in prices.items()],
                                               f"{path}: cost.price_per_node_hour_usd")
    return table


def _assumptions(args):
    from paratrain.cost.compare import Assumptions

    if args.price:
        raise ValueError(f"--price {args.price[0]!r}: ambiguous (it meant USD per node-hour here but per device-hour "
                         "in `paratrain simulate`); use --price-per-node-hour-usd SYSTEM=USD")
    conf = load_cost_config(args.config) if args.config else {}
    pue = args.pue if args.pue is not None else conf.get("pue", 1.2)
    if pue < 1:
        raise ValueError(f"--pue {pue}: allowed: >= 1")
    prices = {**conf.get("price_per_node_hour_usd", {}), **_prices(args.price_per_node_hour_usd)}
    return Assumptions(pue=pue, failures=args.failures or conf.get("failures", "simulate"), prices=prices,
                       purchase=args.purchase or conf.get("purchase", "on-demand"))


def _check_shape(args) -> None:
    for flag, value in (("--seq", args.seq), ("--global-batch", args.global_batch)):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be >= 1")


def _progress(total: int, quiet: bool):
    if quiet:
        return None
    from tqdm import tqdm

    bar = tqdm(total=total, unit="cluster", leave=False)
    return bar.update


def run_compare(args) -> int:
    from paratrain.cost.compare import Workload, compare, parse_targets, ratios_to_first, to_item
    from paratrain.cost.sensitivity import sensitivity

    if args.claims:
        from paratrain.cost.claims import run_claims

        return run_claims(args, _assumptions(args), _progress)
    missing = [flag for flag, value in (("--model", args.model), ("--tokens or --steps", args.tokens or args.steps),
                                        ("--targets", args.targets)) if value is None]
    if missing:
        raise ValueError(f"compare needs {', '.join(missing)} (or --claims)")
    if args.tokens is not None and not args.tokens > 0:
        raise ValueError(f"--tokens {args.tokens}: must be > 0")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps {args.steps}: must be >= 1")
    _check_shape(args)
    targets = parse_targets(args.targets)
    assumptions = _assumptions(args)
    if args.steps is not None:
        workload = Workload.from_steps(args.model, args.steps, args.seq, args.global_batch, args.fp8)
    else:
        workload = Workload(args.model, args.tokens, args.seq, args.global_batch, args.fp8)
    workload.model_config()  # an unknown model fails here, before any search
    rows = compare(workload, targets, assumptions, progress=_progress(len(targets), args.json))
    items = [to_item(r) for r in rows]
    out = {"workload": {"model": workload.model_config().name, "train_tokens": workload.train_tokens,
                        "seq": args.seq,
                        "global_batch": args.global_batch, "steps": workload.steps, "fp8": workload.fp8},
           "purchase": assumptions.purchase, "assumptions": assumptions.describe(),
           "rows": [r.to_dict() for r in rows], "ratios_to_first": ratios_to_first(rows),
           "sensitivity": sensitivity(items, assumptions.purchase)}
    if args.sensitivity_plot:
        out["sensitivity_plot"] = write_sensitivity_plot(args.sensitivity_plot, rows, items,
                                                         f"{workload.model_config().name}, "
                                                         f"{workload.train_tokens:.3g} tokens")
    if args.report:
        from paratrain.cost.report import write_report

        # the report plans each system at 1/4 to 4x its size too (Pareto and scaling plots)
        bar = _progress(4 * len(targets), args.json)
        out["report"] = str(write_report(args.report, workload, rows, targets, assumptions, progress=bar))
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print_table(rows)
    print_ratios(out["ratios_to_first"])
    print_sensitivity(out["sensitivity"])
    print("\nassumptions:\n  " + "\n  ".join(assumptions.describe()))
    for key in ("sensitivity_plot", "report"):
        if key in out:
            print(f"{key.replace('_', ' ')}: {out[key]}")
    return 0


def write_sensitivity_plot(path: str, rows, items, title: str) -> str:
    from paratrain.cli import UserError
    from paratrain.cost.sensitivity import plot

    unpriced = {it.label: f"no public price: break-even ${r.break_even_usd_per_node_hour:,.0f}/node-h"
                for r, it in zip(rows, items, strict=True)
                if all(v is None for v in r.cost_by_purchase_usd.values()) and r.break_even_usd_per_node_hour}
    try:
        plot(items, path, f"$ per million tokens by system and purchase option: {title}", unpriced)
    except OSError as exc:
        raise UserError(f"--sensitivity-plot {path!r}: cannot write there ({exc.strerror})") from None
    return str(path)


def print_sensitivity(report: dict) -> None:
    from paratrain.cost.sensitivity import format_tables

    print()
    print("\n".join(format_tables(report)))


def _usd(v, spec=",.0f") -> str:
    return "n/a" if v is None else "$" + format(v, spec)


def print_table(rows) -> None:
    def f(v, spec):
        return "n/a" if v is None else format(v, spec)

    purchase = rows[0].purchase if rows else "on-demand"
    # days = wall time with failures; overhead = the share failures, restarts and checkpoints add to it
    print(f"{'system':<18}{'nodes':>6}{'layout':>22}{'MFU':>7}{'days':>8}{'overhead':>9}{'accel-h':>11}"
          f"{'cost $':>14}{'$/chip-h':>9}{'$/PF-h':>8}{'$/Mtok':>9}{'MWh':>9}{'Mtok/MWh':>9}  price (option, region, date)")
    for r in rows:
        lay = r.layout
        layout = f"TP{lay['tp']}PP{lay['pp']}DP{lay['dp']}{'+SP' if lay['sp'] else ''}/{lay['recompute'][:3]}"
        if r.price_usd_per_node_hour is None:
            even = r.break_even_usd_per_node_hour
            price = r.price_label + ("" if even is None else f": break-even ${even:,.2f}/node-h vs the cheapest")
        else:
            price = f"${r.price_usd_per_node_hour:,.2f}/node-h ({r.price_label})"
        print(f"{r.system:<18}{r.nodes:>6}{layout:>22}{r.mfu:>7.1%}{r.wall_hours / 24:>8.1f}"
              f"{1 / r.goodput - 1:>9.1%}{r.accelerator_hours:>11,.0f}"
              f"{f(r.cost_usd, ',.0f'):>14}{f(r.price_per_chip_hour_usd, '.2f'):>9}"
              f"{f(r.price_per_peak_bf16_pflop_hour_usd, '.2f'):>8}{f(r.cost_usd_per_million_tokens, '.3f'):>9}"
              f"{f(r.energy_mwh, ',.1f'):>9}{f(None if r.tokens_per_mwh is None else r.tokens_per_mwh / 1e6, ',.0f'):>9}"
              f"  {price}")
    print(f"cost $ = at the {purchase} price; the sensitivity below gives every other purchase option")
    for r in rows:
        for note in r.notes:
            print(f"note ({r.system} x{r.nodes}): {note}")


def print_ratios(ratios: list[dict]) -> None:
    labels = {"price_usd_per_node_hour": "$/node-h", "price_per_chip_hour_usd": "$/chip-h",
              "price_per_peak_bf16_pflop_hour_usd": "$/peak-PF-h", "cost_usd_per_million_tokens": "$/Mtok",
              "wall_hours": "days", "energy_mwh": "MWh"}
    for r in ratios:
        parts = [f"{label} {'n/a' if r[key] is None else format(r[key], '.2f')}" for key, label in labels.items()]
        print(f"{r['first']} / {r['other']}: " + "  ".join(parts))


def run_recommend(args) -> int:
    from paratrain.cost.recommend import Request, recommend
    from paratrain.cost.serving import WORKLOADS  # serving workloads are planned by `serve recommend`
    from paratrain.hardware.catalog import get_catalog

    if args.kind in WORKLOADS:
        raise ValueError(f"recommend {args.kind}: a serving workload; run `paratrain serve recommend {args.kind} "
                         "--model M --rate REQ_PER_S` (chips, latency and $/M tokens per system, docs/serving.md)")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()] if args.systems else None
    _check_shape(args)
    req = Request(kind=args.kind, model=args.model, train_tokens=args.tokens, nodes=args.nodes, chips=args.chips,
                  seq=args.seq,
                  global_batch=args.global_batch, current_stack=args.current_stack,
                  porting_engineer_days=args.porting_days, engineer_usd_per_day=args.engineer_usd_per_day,
                  max_days=args.max_days, max_usd=args.max_usd, systems=systems, constraints=args.constraint,
                  assumptions=_assumptions(args))
    rec = recommend(req, progress=_progress(len(systems or get_catalog().systems), args.json))
    out = {k: v for k, v in rec.__dict__.items() if k != "items"}
    if args.sensitivity_plot and rec.items:
        from paratrain.cost.sensitivity import plot

        unpriced = {it.label: f"no price: break-even ${c['break_even_usd_per_node_hour']:,.0f}/node-h"
                    for it, c in zip(rec.items, rec.candidates, strict=True)
                    if c["total_usd"] is None and c["break_even_usd_per_node_hour"]}
        plot(rec.items, args.sensitivity_plot, f"$ per million tokens (compute + porting) by system and purchase "
             f"option: {args.kind}, {req.model}, {req.train_tokens:.3g} tokens", unpriced)
        out["sensitivity_plot"] = args.sensitivity_plot
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    print(f"workload: {args.kind} ({req.model}, {req.train_tokens:.3g} tokens)")
    print(f"recommendation: {rec.choice or 'none'} (compute at the {rec.purchase} price)")
    print("rules:\n  " + "\n  ".join(rec.rules))
    print("reasons:\n  " + "\n  ".join(rec.reasons))
    print_candidates(rec.candidates)
    if rec.sensitivity:
        print_sensitivity(rec.sensitivity)
    print("assumptions:\n  " + "\n  ".join(rec.assumptions))
    if "sensitivity_plot" in out:
        print(f"sensitivity plot: {out['sensitivity_plot']}")
    return 0


def print_candidates(candidates: list[dict]) -> None:
    def usd(v, width):
        return f"{'n/a':>{width}}" if v is None else f"${v:>{width - 1},.0f}"

    print("candidates (total = compute + porting; break-even = the price per node-hour at which it would tie "
          "the choice):")
    for c in candidates:
        even = c.get("break_even_usd_per_node_hour")
        price = (c["price_label"] if c["price_usd_per_node_hour"] is None
                 else f"${c['price_usd_per_node_hour']:,.2f}/node-h, {c['price_label']}")
        print(f"  {c['system']:<18} {c['nodes']:>5} nodes {c['wall_days']:>7.1f} days  compute "
              f"{usd(c['compute_usd'], 13)}  porting {usd(c['porting_usd'], 9)}  total {usd(c['total_usd'], 13)}"
              f"  ({price})" + ("" if even is None else f"  break-even ${even:,.2f}/node-h"))
