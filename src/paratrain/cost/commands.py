"""`paratrain compare` and `paratrain recommend`."""

from __future__ import annotations

import argparse
import json

COMPARE_HELP = """\
Time, dollars and energy to train one workload on several clusters, each with the planner's best layout;
failures and checkpoints from the simulator (or Daly's formula with --failures daly).

  paratrain compare --model llama2-7b --tokens 1e12 --seq 4096 --global-batch 1024 \\
      --targets trn1.32xlarge:16,p4d.24xlarge:16 --report runs/compare
  paratrain compare --model llama3-70b --tokens 15e12 --targets p5.48xlarge:128,trn2-ultraserver:32 \\
      --price trn2-ultraserver=180 --json

Cost per million tokens, energy (accelerators + host share, x PUE) and tokens per MWh are reported; every
assumption is printed with the table.
"""

RECOMMEND_HELP = """\
Recommend an infrastructure for a workload, with every rule and number that decided it. Kinds:
  pretrain    pre-training from scratch (weeks or more)
  finetune    large fine-tuning (SFT, RLHF), cost-sensitive
  research    research prototyping that needs custom CUDA kernels
  experiment  short, small experiments (hours to days)
  multicloud  must run on several clouds
  onprem      must also run on-premises

  paratrain recommend pretrain --model llama2-70b --tokens 2e12 --nodes 64
  paratrain recommend experiment
  paratrain recommend pretrain --price trn2-ultraserver=150 --porting-days 30
"""


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    p.add_argument("--global-batch", type=int, default=1024, help="sequences per step (default 1024)")
    p.add_argument("--price", action="append", default=[], metavar="SYSTEM=USD_PER_NODE_HOUR",
                   help="a price for a system (overrides the catalog; needed for systems without a public price)")
    p.add_argument("--pue", type=float, default=1.2, help="power usage effectiveness (default 1.2, assumption)")
    p.add_argument("--failures", choices=("simulate", "daly", "none"), default="simulate",
                   help="failure/checkpoint overhead: Monte-Carlo simulation, Daly's formula, or none")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def register(sub) -> None:
    c = sub.add_parser("compare", help="time, cost and energy to train a workload across clusters",
                       description=COMPARE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--model", required=True, help="preset name or model TOML file")
    c.add_argument("--tokens", type=float, required=True, help="tokens to train, e.g. 1e12")
    c.add_argument("--targets", required=True, help="SYSTEM:NODES,... e.g. trn1.32xlarge:16,p4d.24xlarge:16")
    c.add_argument("--report", metavar="DIR", help="write an HTML report with plots to DIR")
    _add_common(c)
    c.set_defaults(func=run_compare)

    r = sub.add_parser("recommend", help="which infrastructure for a workload, with the reasons",
                       description=RECOMMEND_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("kind", help="pretrain, finetune, research, experiment, multicloud or onprem")
    r.add_argument("--model", help="preset or model TOML (default: per kind)")
    r.add_argument("--tokens", type=float, help="tokens to train (default: per kind)")
    r.add_argument("--nodes", type=int, help="nodes of each candidate system (default: per kind)")
    r.add_argument("--max-days", type=float, help="deadline: drop candidates slower than this")
    r.add_argument("--current-stack", default="cuda", help="the team's stack today: cuda or neuron")
    r.add_argument("--porting-days", type=float, default=20.0,
                   help="engineer-days to move the code base to the other stack (default 20, assumption)")
    r.add_argument("--engineer-usd-per-day", type=float, default=1200.0,
                   help="loaded cost of an engineer-day (default 1200, assumption)")
    r.add_argument("--systems", help="comma list of candidate systems (default: every priced system)")
    _add_common(r)
    r.set_defaults(func=run_recommend)


def _prices(items: list[str]) -> dict[str, float]:
    from paratrain.hardware.catalog import resolve_system

    out = {}
    for item in items:
        name, _, value = item.partition("=")
        try:
            price = float(value)
        except ValueError:
            raise ValueError(f"--price '{item}': expected SYSTEM=USD_PER_NODE_HOUR, e.g. trn2.48xlarge=40") from None
        if price <= 0:
            raise ValueError(f"--price '{item}': the price must be > 0")
        resolve_system(name)
        out[name] = price
    return out


def _assumptions(args):
    from paratrain.cost.compare import Assumptions

    if args.pue < 1:
        raise ValueError(f"--pue {args.pue}: allowed: >= 1")
    return Assumptions(pue=args.pue, failures=args.failures, prices=_prices(args.price))


def _progress(total: int, quiet: bool):
    if quiet:
        return None
    from tqdm import tqdm

    bar = tqdm(total=total, unit="cluster", leave=False)
    return bar.update


def run_compare(args) -> int:
    from paratrain.cost.compare import Workload, compare, parse_targets

    if args.tokens <= 0:
        raise ValueError(f"--tokens {args.tokens}: must be > 0")
    targets = parse_targets(args.targets)
    assumptions = _assumptions(args)
    workload = Workload(args.model, args.tokens, args.seq, args.global_batch)
    rows = compare(workload, targets, assumptions, progress=_progress(len(targets), args.json))
    out = {"workload": {"model": workload.model_config().name, "train_tokens": args.tokens, "seq": args.seq,
                        "global_batch": args.global_batch, "steps": workload.steps},
           "assumptions": assumptions.describe(), "rows": [r.to_dict() for r in rows]}
    if args.report:
        from paratrain.cost.report import write_report

        out["report"] = str(write_report(args.report, workload, rows, targets, assumptions.describe()))
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print_table(rows)
    print("\nassumptions:\n  " + "\n  ".join(assumptions.describe()))
    if args.report:
        print(f"report: {out['report']}")
    return 0


def print_table(rows) -> None:
    def f(v, spec):
        return "n/a" if v is None else format(v, spec)

    print(f"{'system':<18}{'nodes':>6}{'layout':>22}{'MFU':>7}{'days':>8}{'goodput':>9}{'on-demand $':>14}"
          f"{'$/chip-h':>10}{'$/PF-h':>8}{'$/Mtok':>9}{'MWh':>9}{'Mtok/MWh':>10}")
    for r in rows:
        lay = r.layout
        layout = f"TP{lay['tp']}PP{lay['pp']}DP{lay['dp']}{'+SP' if lay['sp'] else ''}/{lay['recompute'][:3]}"
        print(f"{r.system:<18}{r.nodes:>6}{layout:>22}{r.mfu:>7.1%}{r.wall_hours / 24:>8.1f}{r.goodput:>9.1%}"
              f"{f(r.cost_on_demand_usd, ',.0f'):>14}{f(r.price_per_chip_hour_usd, '.2f'):>10}"
              f"{f(r.price_per_peak_bf16_pflop_hour_usd, '.2f'):>8}{f(r.cost_usd_per_million_tokens, '.3f'):>9}"
              f"{f(r.energy_mwh, ',.1f'):>9}{f(None if r.tokens_per_mwh is None else r.tokens_per_mwh / 1e6, ',.0f'):>10}")


def run_recommend(args) -> int:
    from paratrain.cost.recommend import Request, recommend

    systems = [s.strip() for s in args.systems.split(",")] if args.systems else None
    req = Request(kind=args.kind, model=args.model, train_tokens=args.tokens, nodes=args.nodes, seq=args.seq,
                  global_batch=args.global_batch, current_stack=args.current_stack,
                  porting_engineer_days=args.porting_days, engineer_usd_per_day=args.engineer_usd_per_day,
                  max_days=args.max_days, systems=systems, assumptions=_assumptions(args))
    rec = recommend(req, progress=_progress(len(systems or []) or 8, args.json))
    if args.json:
        print(json.dumps(rec.__dict__, indent=2, default=str))
        return 0
    print(f"workload: {args.kind} ({req.model}, {req.train_tokens:.3g} tokens, {req.nodes} nodes)")
    print(f"recommendation: {rec.choice or 'none'}")
    print("rules:\n  " + "\n  ".join(rec.rules))
    print("reasons:\n  " + "\n  ".join(rec.reasons))
    print("candidates (total = compute + porting):")
    for c in rec.candidates:
        print(f"  {c['system']:<18} {c['wall_days']:>7.1f} days  compute ${c['compute_usd']:>12,.0f}  porting "
              f"${c['porting_usd']:>8,.0f}  total ${c['total_usd']:>12,.0f}")
    print("assumptions:\n  " + "\n  ".join(rec.assumptions))
    return 0
