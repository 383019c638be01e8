"""`paratrain simulate` output: the text report, the plots (sweeps around the configuration) and Daly's check."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from paratrain.sim.config import DAY_S, HOUR_S, SimConfig


def write_plots(cfg: SimConfig, out_dir: Path, json_mode: bool) -> dict:
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

    progress = progress_bars(json_mode)
    causes = build_cause_table(cfg, eviction_rate_per_s(cfg.stragglers, cfg.devices, cfg.step_time_s))
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


def progress_bars(json_mode: bool):
    """label -> a wrapper drawing a tqdm bar over an iterable on a terminal (none with --json)."""
    def wrap(label: str):
        def bar(items):
            if json_mode or not sys.stderr.isatty():
                return items
            from tqdm import tqdm

            return tqdm(items, desc=label, leave=False)

        return bar

    return wrap


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


def print_daly_check(rows: list[dict]) -> None:
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
