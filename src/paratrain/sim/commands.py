"""`paratrain simulate`: failures, checkpoints, restarts, spares and stragglers over a whole training run."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from paratrain.sim.config import (
    DAY_S,
    HOUR_S,
    REPAIR_DISTRIBUTIONS,
    STRAGGLER_POLICIES,
    SimConfig,
    StragglerConfig,
)

DESCRIPTION = """\
Simulate a whole training run on a cluster with failures (by cause), checkpoints, detection, restart and
restore, hot spares and repairs, and stragglers; report goodput, effective training time, interruptions by
cause, lost work, time and cost, each with a Monte-Carlo 95% confidence interval, beside Young's and Daly's
analytic checkpoint models.

Failure rates default to the Llama 3 405B table (Dubey et al. 2024, Table 5: 419 unexpected interruptions in
54 days on 16,384 H100), read as a rate per device-hour = count / (16,384 * 54 * 24); --rate-scale and
--failures change them. Precedence: built-in defaults < --config TOML < --hardware/--model (catalog,
planner) < flags.
"""

EXAMPLES = """\
examples:
  # Llama 3's 54-day snapshot: ~419 interruptions, effective training time and goodput
  paratrain simulate --devices 16384 --step-time 10s --duration 54d --checkpoint-gb 6500 --write-gbps 2000

  # time and cost to train 1.2M steps on 65,536 chips, checkpoint interval from Daly, 2% spares
  paratrain simulate --devices 65536 --step-time 6s --steps 1200000 --spare-nodes 160 --price-per-device-hour-usd 2.5 --json

  # stragglers: 1e-4 episodes per device-hour, 30 min each, compare policies
  paratrain simulate --devices 16384 --step-time 10s --duration 30d --straggler-rate 1e-4 \\
      --straggler-policy bounded_staleness --staleness-steps 4

  # plots: goodput vs checkpoint interval and vs cluster size (PNG files)
  paratrain simulate --devices 16384 --step-time 10s --duration 54d --plot sim-plots/

  # Daly's published examples, analytic and simulated
  paratrain simulate --daly-check

straggler policies:
  wait               synchronous: every step waits for the slowest rank (job speed = 1 / max slowdown)
  bounded_staleness  a slow data-parallel rank may lag up to --staleness-steps steps before the job slows
  evict_replace      a straggler persisting for --evict-after is evicted at the next checkpoint and its node
                     replaced from the spares (one restart, no lost work)

durations accept s, m, h, d suffixes (90s, 20m, 2.5h, 54d); --interval also takes daly, young or 500steps.
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate", help="failures, checkpoints, spares and stragglers at cluster scale (goodput, time, cost)",
        description=DESCRIPTION, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="TOML file with SimConfig fields (see docs/simulator.md)")
    g = p.add_argument_group("cluster")
    g.add_argument("--devices", type=int,
                   help="devices in the job: accelerator packages that fail as a unit (GPUs, Trainium chips)")
    g.add_argument("--devices-per-node", type=int, help="devices per node (default 8)")
    g.add_argument("--nodes-per-domain", type=int,
                   help="nodes replaced together, e.g. 4 for a Trn2 UltraServer (default 1)")
    g.add_argument("--hardware", help="catalog system (e.g. p5.48xlarge, trn2.48xlarge): fills chips per node and "
                   "the price per chip-hour")
    from paratrain.hardware.catalog import PURCHASE_OPTIONS  # torch-free; only the flag's choices

    g.add_argument("--purchase", choices=PURCHASE_OPTIONS, default="on-demand",
                   help="which catalog price --hardware fills in (default on-demand)")
    g = p.add_argument_group("workload (give --steps, or --duration for a fixed window)")
    g.add_argument("--step-time", help="fault-free time of one training step, e.g. 8.5s")
    g.add_argument("--steps", type=int, help="steps to train: report time and cost to train")
    g.add_argument("--duration", help="fixed wall-clock window, e.g. 54d: report what it achieves")
    g.add_argument("--model", help="model preset or TOML: step time from the planner, checkpoint size from params")
    g.add_argument("--seq", type=int, help="sequence length for the planner (with --model; default 4096)")
    g.add_argument("--global-batch", type=int, help="global batch in sequences for the planner (with --model; default 1024)")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-gb", type=float, help="checkpoint size in GB (default 1000)")
    g.add_argument("--write-gbps", type=float, help="aggregate storage write bandwidth, GB/s (default 100)")
    g.add_argument("--read-gbps", type=float, help="aggregate storage read bandwidth, GB/s (default 100)")
    g.add_argument("--async-fraction", type=float,
                   help="share of each write overlapped with compute, in [0,1) (default 0: blocking)")
    g.add_argument("--interval", help="daly (default), young, a duration (20m) or a step count (500steps)")
    g = p.add_argument_group("failures and recovery")
    g.add_argument("--failures", help="TOML failure model ([[cause]] tables) instead of the Llama 3 table")
    g.add_argument("--rate-scale", type=float, help="multiply every failure rate (default 1)")
    g.add_argument("--detect", help="time to notice a failure (default 60s; NCCL watchdog causes: 10m)")
    g.add_argument("--restart", help="relaunch and initialise the job (default 3m)")
    g.add_argument("--swap", help="extra time to bring a spare node in (default 1m)")
    g.add_argument("--spare-nodes", type=int, help="hot spare nodes (default 1%% of the job's nodes)")
    g.add_argument("--repair", help="mean time to repair a failed node (default 24h)")
    g.add_argument("--repair-dist", choices=REPAIR_DISTRIBUTIONS, help="repair time distribution (default lognormal)")
    g = p.add_argument_group("stragglers")
    g.add_argument("--straggler-rate", type=float, help="slow episodes per device-hour (default 0)")
    g.add_argument("--straggler-duration", help="mean episode length (default 30m)")
    g.add_argument("--straggler-slowdown", type=float, help="median slowdown factor, > 1 (default 1.5)")
    g.add_argument("--straggler-sigma", type=float, help="lognormal spread of the slowdown excess (default 0.5)")
    g.add_argument("--straggler-policy", choices=STRAGGLER_POLICIES, help="default wait")
    g.add_argument("--staleness-steps", type=int, help="bounded_staleness tolerance in steps (default 4)")
    g.add_argument("--evict-after", help="evict_replace: persistence before eviction (default 5m)")
    g = p.add_argument_group("cost and Monte Carlo")
    g.add_argument("--price-per-device-hour-usd", type=float, metavar="USD",
                   help="USD per device-hour, a device being one GPU or Trainium chip (spares are paid for too)")
    # The old flag: per device-hour here but per node-hour in `compare`. Refused with a pointer to the named one.
    g.add_argument("--price", help=argparse.SUPPRESS)
    g.add_argument("--samples", type=int, help="Monte-Carlo replicas (default 100)")
    g.add_argument("--seed", type=int, help="random seed (default 0)")
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print the full report as JSON")
    g.add_argument("--plot", metavar="DIR",
                   help="write PNGs of goodput vs checkpoint interval, vs cluster size and vs spare nodes")
    g.add_argument("--daly-check", action="store_true",
                   help="reproduce Daly's published examples analytically and by simulation, then exit")
    p.set_defaults(func=run_simulate)


def run_simulate(args) -> int:
    from paratrain.cli import UserError

    if args.daly_check:
        return _daly_check(args)
    cfg = config_from_args(args)
    from paratrain.sim.engine import simulate
    from paratrain.sim.results import summarize

    started = time.perf_counter()
    run = simulate(cfg)
    report = summarize(run)
    report["elapsed_s"] = time.perf_counter() - started
    if args.plot:
        try:
            report["plots"] = _plots(cfg, Path(args.plot), json_mode=args.json)
        except OSError as exc:
            raise UserError(f"--plot {args.plot!r}: cannot write there ({exc.strerror})") from None
    if args.json:
        json.dump(report, sys.stdout, indent=2, default=_json_default)
        print()
    else:
        print(format_report(report))
    return 0


# ---- building the config: defaults < TOML < catalog < flags ------------------------------------------------
def config_from_args(args) -> SimConfig:
    from paratrain.sim.config import load_sim_toml, parse_duration_s, parse_interval
    from paratrain.sim.failures import llama3_causes, load_causes_toml, scale_rates

    if args.price is not None:
        raise ValueError(f"--price {args.price!r}: ambiguous (USD per device-hour here, per node-hour in `paratrain "
                         "compare`); use --price-per-device-hour-usd USD")
    kwargs: dict = load_sim_toml(args.config) if args.config else {}
    if args.hardware or args.model:
        from paratrain.sim.catalog import fill_from_catalog

        kwargs.update(fill_from_catalog(hardware=args.hardware, model=args.model, devices=args.devices or
                                        kwargs.get("devices"), seq=args.seq, global_batch=args.global_batch,
                                        purchase=args.purchase))
    straggler = dict(vars(kwargs.pop("stragglers", StragglerConfig())))
    flags = {
        "devices": args.devices, "devices_per_node": args.devices_per_node,
        "nodes_per_domain": args.nodes_per_domain, "steps": args.steps,
        "async_fraction": args.async_fraction, "spare_nodes": args.spare_nodes,
        "repair_distribution": args.repair_dist, "price_per_device_hour_usd": args.price_per_device_hour_usd,
        "samples": args.samples, "seed": args.seed,
    }
    for name, text in (("step_time_s", args.step_time), ("duration_s", args.duration), ("detect_s", args.detect),
                       ("restart_s", args.restart), ("swap_s", args.swap), ("repair_mean_s", args.repair)):
        if text is not None:
            flags[name] = parse_duration_s(text, FLAG_OF_FIELD[name])
    for name, gb in (("checkpoint_bytes", args.checkpoint_gb), ("write_bytes_per_s", args.write_gbps),
                     ("read_bytes_per_s", args.read_gbps)):
        if gb is not None:
            flags[name] = gb * 1e9
    kwargs.update({k: v for k, v in flags.items() if v is not None})
    if args.steps is not None:
        kwargs.pop("duration_s", None)
    if args.duration is not None:
        kwargs.pop("steps", None)
    _require_inputs(kwargs)
    if args.interval is not None:
        kwargs["checkpoint_interval"] = parse_interval(args.interval, kwargs["step_time_s"])
    elif isinstance(kwargs.get("checkpoint_interval"), str) and kwargs["checkpoint_interval"] not in ("daly", "young"):
        kwargs["checkpoint_interval"] = parse_interval(kwargs["checkpoint_interval"], kwargs["step_time_s"])
    if args.failures:
        kwargs["causes"] = load_causes_toml(args.failures)
    if args.rate_scale is not None:
        kwargs["causes"] = scale_rates(kwargs.get("causes", llama3_causes()), args.rate_scale)
    straggler_flags = {
        "rate_per_device_hour": args.straggler_rate, "slowdown_median": args.straggler_slowdown,
        "slowdown_sigma": args.straggler_sigma, "policy": args.straggler_policy,
        "staleness_steps": args.staleness_steps,
    }
    for name, flag, text in (("mean_duration_s", "--straggler-duration", args.straggler_duration),
                             ("evict_after_s", "--evict-after", args.evict_after)):
        if text is not None:
            straggler_flags[name] = parse_duration_s(text, flag)
    straggler.update({k: v for k, v in straggler_flags.items() if v is not None})
    try:
        kwargs["stragglers"] = StragglerConfig(**straggler)
        return SimConfig(**kwargs)
    except ValueError as exc:
        raise ValueError(with_flag(str(exc))) from None


# The flag that sets each field named in SimConfig's and StragglerConfig's errors (TOML uses the field names).
FLAG_OF_FIELD = {
    "devices": "--devices", "devices_per_node": "--devices-per-node", "nodes_per_domain": "--nodes-per-domain",
    "step_time_s": "--step-time", "steps": "--steps", "duration_s": "--duration",
    "checkpoint_bytes": "--checkpoint-gb", "write_bytes_per_s": "--write-gbps", "read_bytes_per_s": "--read-gbps",
    "async_fraction": "--async-fraction", "checkpoint_interval": "--interval", "detect_s": "--detect",
    "restart_s": "--restart", "swap_s": "--swap", "spare_nodes": "--spare-nodes", "repair_mean_s": "--repair",
    "repair_distribution": "--repair-dist", "repair_sigma": None,
    "price_per_device_hour_usd": "--price-per-device-hour-usd",
    "samples": "--samples", "straggler_rate_per_device_hour": "--straggler-rate",
    "straggler_mean_duration_s": "--straggler-duration", "straggler_slowdown_median": "--straggler-slowdown",
    "straggler_slowdown_sigma": "--straggler-sigma", "straggler_policy": "--straggler-policy",
    "staleness_steps": "--staleness-steps", "evict_after_s": "--evict-after",
}


def with_flag(message: str) -> str:
    """'step_time_s=0.0 is not allowed: ...' -> the same, then '(flag --step-time)': the user may have typed either
    the flag or the TOML field."""
    field = message.split("=", 1)[0]
    flag = FLAG_OF_FIELD.get(field)
    return f"{message} (flag {flag})" if flag and "=" in message else message


def _require_inputs(kwargs: dict) -> None:
    from paratrain.cli import UserError

    missing = [flag for key, flag in (("devices", "--devices"), ("step_time_s", "--step-time")) if key not in kwargs]
    if missing:
        raise UserError(f"missing {' and '.join(missing)} (or give them in --config, or use --hardware/--model)")
    if "steps" not in kwargs and "duration_s" not in kwargs:
        raise UserError("give --steps N (time to train) or --duration D (a fixed window such as 54d)")
    if "steps" in kwargs and "duration_s" in kwargs:
        raise UserError("give only one of --steps and --duration")


# ---- plots -------------------------------------------------------------------------------------------------
def _plots(cfg: SimConfig, out_dir: Path, json_mode: bool) -> dict:
    from paratrain.sim.analytic import daly_interval, young_interval
    from paratrain.sim.engine import build_cause_table
    from paratrain.sim.plots import plot_cluster_sweep, plot_interval_sweep, plot_spare_sweep
    from paratrain.sim.stragglers import eviction_rate_per_s
    from paratrain.sim.sweeps import (
        analytic_optimum,
        default_cluster_sizes,
        default_spare_counts,
        interval_grid,
        simulated_optimum,
        sweep_cluster,
        sweep_interval,
        sweep_spares,
    )

    progress = _progress(json_mode)
    causes = build_cause_table(cfg, eviction_rate_per_s(cfg.stragglers, cfg.devices))
    grid = interval_grid(analytic_optimum(cfg), 0.2, 5.0, 25, cfg.step_time_s, cfg.checkpoint_async_s)
    points = sweep_interval(cfg, grid, progress("interval sweep"))
    optimum, _ = simulated_optimum(cfg, points)
    analytic_ok = math.isfinite(causes.mtbf_s) and cfg.checkpoint_block_s > 0
    young = young_interval(cfg.checkpoint_block_s, causes.mtbf_s) if analytic_ok else None
    daly = daly_interval(cfg.checkpoint_block_s, causes.mtbf_s) if analytic_ok else None
    title = (f"{cfg.devices:,} devices, job MTBF {causes.mtbf_s / HOUR_S:.2f} h, checkpoint stall "
             f"{cfg.checkpoint_block_s:.0f} s, mean restart {causes.mean_restart_s / 60:.1f} min ({cfg.samples} samples)")
    interval_png = plot_interval_sweep(points, out_dir / "goodput_vs_interval.png", young_s=young, daly_s=daly,
                                       simulated_opt_s=optimum, title=title)
    window = cfg.duration_s or 30 * DAY_S
    cluster = sweep_cluster(cfg, default_cluster_sizes(cfg.devices), window, progress("cluster sweep"))
    cluster_png = plot_cluster_sweep(cluster, out_dir / "goodput_vs_cluster_size.png",
                                     title=f"{window / DAY_S:.0f}-day window, interval rule "
                                           f"{cfg.checkpoint_interval if isinstance(cfg.checkpoint_interval, str) else 'fixed'}, "
                                           f"checkpoint stall {cfg.checkpoint_block_s:.0f} s ({cfg.samples} samples)")
    spares = sweep_spares(cfg, default_spare_counts(cfg), progress("spares sweep"))
    spares_png = plot_spare_sweep(spares, out_dir / "goodput_vs_spares.png",
                                  title=f"{cfg.devices:,} devices, repair mean {cfg.repair_mean_s / HOUR_S:.0f} h "
                                        f"({cfg.repair_distribution}), replacement unit {cfg.nodes_per_domain} node(s)")
    return {
        "goodput_vs_interval": str(interval_png),
        "goodput_vs_cluster_size": str(cluster_png),
        "goodput_vs_spares": str(spares_png),
        "spare_sweep": [{"spare_nodes": p.spare_nodes, "goodput": p.goodput, "spare_wait_hours": p.spare_wait_hours}
                        for p in spares],
        "simulated_optimum_interval_s": optimum,
        "interval_sweep": [{"interval_s": p.interval_s, "goodput": p.goodput, "daly_goodput": p.daly_goodput}
                           for p in points],
        "cluster_sweep": [{"devices": p.devices, "interval_s": p.interval_s, "goodput": p.goodput,
                           "interruptions": p.interruptions_mean, "daly_goodput": p.daly_goodput} for p in cluster],
    }


def _progress(json_mode: bool):
    def wrap(label: str):
        def bar(items):
            if json_mode or not sys.stderr.isatty():
                return items
            from tqdm import tqdm

            return tqdm(items, desc=label, leave=False)

        return bar

    return wrap


# ---- Daly check --------------------------------------------------------------------------------------------
DALY_EXAMPLES = ((24 * HOUR_S, 300.0, 117 * 60.0), (6 * HOUR_S, 300.0, 57 * 60.0), (15 * 60.0, 300.0, 9.1 * 60.0))


def daly_check(samples: int = 200, restart_s: float = 600.0, seed: int = 0, progress=None) -> list[dict]:
    """Daly's three published examples: his formula, the exact optimum of his model, and the simulation.

    Daly's figures use T_s = 500 h, R = 10 min, delta = 5 min. The optimum does not depend on R in his model
    (R only scales the wall time); the goodput measured near the optimum is reported beside Daly's."""
    from paratrain.sim.analytic import daly_exact_optimum, daly_interval, daly_wall_time, young_interval
    from paratrain.sim.sweeps import daly_case_config, simulated_optimum

    rows = []
    for mtbf, delta, published in (progress(DALY_EXAMPLES) if progress else DALY_EXAMPLES):
        # `samples` replicas for M = 24 h (21 failures each in 500 h); shorter MTBFs see proportionally more
        # failures per replica, so fewer replicas give the same statistical weight.
        replicas = max(10, round(samples * mtbf / (24 * HOUR_S)))
        cfg = daly_case_config(mtbf, delta, restart_s, samples=replicas, seed=seed)
        simulated, points = simulated_optimum(cfg)
        best = min(points, key=lambda p: abs(p.interval_s - simulated))
        failures = replicas * daly_wall_time(cfg.work_s, best.interval_s, delta, restart_s, mtbf) / mtbf
        daly = daly_interval(delta, mtbf)
        rows.append({
            "mtbf_s": mtbf, "delta_s": delta, "restart_s": restart_s, "solve_time_s": cfg.work_s,
            "replicas": replicas, "failures_per_interval": failures,
            "published_s": published, "daly_s": daly, "daly_exact_s": daly_exact_optimum(delta, mtbf),
            "young_s": young_interval(delta, mtbf), "simulated_s": simulated,
            "simulated_vs_daly": simulated / daly - 1.0,
            "simulated_goodput_near_optimum": best.goodput, "daly_goodput_near_optimum": best.daly_goodput,
            "goodput_interval_s": best.interval_s,
        })
    return rows


def _daly_check(args) -> int:
    samples = args.samples or 200
    rows = daly_check(samples=samples, seed=args.seed or 0, progress=_progress(args.json)("Daly cases"))
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return 0
    print("Daly (2006) examples (his Figs. 3-5): delta = 5 min, R = 10 min, T_s = 500 h; simulated with "
          "exponential failures, 25 intervals per case")
    print(f"{'MTBF':>8} {'published':>10} {'Daly':>8} {'exact':>8} {'Young':>8} {'simulated':>10} {'sim/Daly':>9}"
          f" {'goodput sim':>12} {'Daly':>7} {'replicas':>9}")
    for r in rows:
        print(f"{_fmt_minutes(r['mtbf_s']):>8} {r['published_s'] / 60:>9.1f}m {r['daly_s'] / 60:>7.1f}m "
              f"{r['daly_exact_s'] / 60:>7.1f}m {r['young_s'] / 60:>7.1f}m {r['simulated_s'] / 60:>9.1f}m "
              f"{r['simulated_vs_daly'] * 100:>+8.2f}% {r['simulated_goodput_near_optimum']['mean'] * 100:>11.2f}% "
              f"{r['daly_goodput_near_optimum'] * 100:>6.2f}% {r['replicas']:>9}")
    few = [r for r in rows if r["failures_per_interval"] < 2000]
    if few:
        print(f"note: {', '.join(_fmt_minutes(r['mtbf_s']) for r in few)}: under 2000 failures per interval; "
              "the simulated optimum is noisy (raise --samples; 200 is the default)")
    return 0


# ---- text report -------------------------------------------------------------------------------------------
def format_report(report: dict) -> str:
    i, m, a = report["inputs"], report["metrics"], report["analytic"]
    lines = [
        f"cluster      {i['devices']:,} devices = {i['nodes']:,} nodes x {i['devices_per_node']}"
        f" (replacement unit {i['nodes_per_domain']} node(s)), {i['spare_nodes']} spare nodes,"
        f" repair mean {i['repair_mean_hours']:.1f} h",
        f"failures     {i['failure_rate_per_device_hour']:.3g} per device-hour"
        + (f" + {i['eviction_rate_per_hour']:.2f} straggler evictions per hour" if i["eviction_rate_per_hour"] else "")
        + f" -> job MTBF {i['job_mtbf_hours']:.2f} h, mean restart {i['mean_restart_s'] / 60:.1f} min",
        f"checkpoint   write {i['checkpoint_write_s']:.1f} s (stall {i['checkpoint_block_s']:.1f} s),"
        f" restore {i['restore_s']:.1f} s, every {i['checkpoint_interval_s'] / 60:.1f} min"
        f" ({i['checkpoint_interval_steps']} steps, rule {i['checkpoint_interval_rule']})",
    ]
    if "young_interval_s" in a:
        lines.append(f"analytic     Young {a['young_interval_s'] / 60:.1f} min, Daly {a['daly_interval_s'] / 60:.1f} min;"
                     f" Daly-model goodput at this interval {a['daly_goodput_at_interval'] * 100:.2f}%")
    if i["straggler_rate_per_device_hour"] > 0:
        lines.append(f"stragglers   {i['straggler_rate_per_device_hour']:.3g} episodes per device-hour, policy"
                     f" {i['straggler_policy']}: {i['straggler_lost_share_mean'] * 100:.2f}% of compute time lost")
    mode = "time to train" if report["mode"] == "time_to_train" else f"fixed window of {i['duration_days']:.1f} days"
    lines += [f"source       {note}" for note in i.get("notes", [])]
    lines += ["", f"results over {report['samples']} Monte-Carlo replicas ({mode}): mean [95% CI of mean] (p5-p95 of runs)"]
    rows = [("goodput", "goodput", 100, "%"), ("effective training time", "effective_training_fraction", 100, "%"),
            ("wall time", "wall_days", 1, " days"), ("useful compute", "useful_compute_days", 1, " days"),
            ("interruptions", "interruptions", 1, ""), ("lost work", "lost_work_hours", 1, " h"),
            ("restarts", "restart_hours", 1, " h"), ("checkpoint stalls", "checkpoint_stall_hours", 1, " h"),
            ("waiting for spares", "spare_wait_hours", 1, " h"), ("straggler slowdown", "straggler_hours", 1, " h")]
    if "cost_usd" in m:
        rows.append(("cost", "cost_usd", 1e-6, " M USD"))
    for label, key, scale, unit in rows:
        s = m[key]
        lines.append(f"  {label:<24} {s['mean'] * scale:>12.3f}{unit}  [{s['ci95'][0] * scale:.3f}, "
                     f"{s['ci95'][1] * scale:.3f}]  ({s['p5'] * scale:.3f}-{s['p95'] * scale:.3f})")
    lines += ["", "interruptions by cause: simulated mean (expected from rates over the exposure)"]
    for row in report["interruptions_by_cause"]:
        if row["expected"] > 0 or row["simulated"] > 0:
            lines.append(f"  {row['cause']:<32} {row['simulated']:>10.1f}  ({row['expected']:.1f})")
    if "plots" in report:
        plots = report["plots"]
        lines += ["", f"plots: {plots['goodput_vs_interval']}, {plots['goodput_vs_cluster_size']}, {plots['goodput_vs_spares']}",
                  f"simulated optimum interval {report['plots']['simulated_optimum_interval_s'] / 60:.1f} min"]
    return "\n".join(lines)


def _fmt_minutes(seconds: float) -> str:
    return f"{seconds / HOUR_S:.0f}h" if seconds >= HOUR_S else f"{seconds / 60:.0f}m"


def _json_default(value):
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
