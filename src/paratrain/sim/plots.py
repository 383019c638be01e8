"""Pictures of the two questions a team asks: which checkpoint interval, and how big a cluster still pays."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from paratrain.sim.sweeps import ClusterPoint, IntervalPoint  # noqa: E402


def plot_interval_sweep(points: list[IntervalPoint], path: Path, *, young_s: float | None, daly_s: float | None,
                        simulated_opt_s: float | None, title: str) -> Path:
    minutes = [p.interval_s / 60 for p in points]
    mean = [p.goodput["mean"] * 100 for p in points]
    lo = [p.goodput["ci95"][0] * 100 for p in points]
    hi = [p.goodput["ci95"][1] * 100 for p in points]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ax.fill_between(minutes, lo, hi, alpha=0.25, color="C0", label="simulated, 95% CI of the mean")
    ax.plot(minutes, mean, "o-", color="C0", ms=3, label="simulated goodput")
    if all(p.daly_goodput is not None for p in points):
        ax.plot(minutes, [p.daly_goodput * 100 for p in points], "--", color="C1", label="Daly model (analytic: no spare waits, no stragglers)")
    for value, name, color in ((young_s, "Young", "C2"), (daly_s, "Daly", "C1"), (simulated_opt_s, "simulated optimum", "C3")):
        if value is not None:
            ax.axvline(value / 60, color=color, ls=":", lw=1.5, label=f"{name}: {value / 60:.1f} min")
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (minutes of compute between checkpoints)")
    ax.set_ylabel("goodput (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_cluster_sweep(points: list[ClusterPoint], path: Path, *, title: str) -> Path:
    devices = [p.devices for p in points]
    mean = [p.goodput["mean"] * 100 for p in points]
    lo = [p.goodput["ci95"][0] * 100 for p in points]
    hi = [p.goodput["ci95"][1] * 100 for p in points]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ax.fill_between(devices, lo, hi, alpha=0.25, color="C0", label="simulated, 95% CI of the mean")
    ax.plot(devices, mean, "o-", color="C0", ms=3, label="simulated goodput (interval rule at each size)")
    if all(p.daly_goodput is not None for p in points):
        ax.plot(devices, [p.daly_goodput * 100 for p in points], "--", color="C1", label="Daly model (analytic: no spare waits, no stragglers)")
    ax.set_xscale("log")
    ax.set_ylim(0, 100)
    ax.set_xlabel("devices in the job")
    ax.set_ylabel("goodput (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_spare_sweep(points, path: Path, *, title: str) -> Path:
    spares = [p.spare_nodes for p in points]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    mean = [p.goodput["mean"] * 100 for p in points]
    ax.fill_between(spares, [p.goodput["ci95"][0] * 100 for p in points], [p.goodput["ci95"][1] * 100 for p in points],
                    alpha=0.25, color="C0")
    ax.plot(spares, mean, "o-", color="C0", ms=3, label="goodput (95% CI band)")
    ax.set_xscale("symlog", linthresh=max(1, spares[1] if len(spares) > 1 else 1))
    ax.set_xlabel("hot spare nodes")
    ax.set_ylabel("goodput (%)")
    ax.grid(True, which="both", alpha=0.3)
    right = ax.twinx()
    right.plot(spares, [p.spare_wait_hours["mean"] for p in points], "s--", color="C3", ms=3,
               label="idle waiting for a repaired node (h per run)")
    right.set_ylabel("hours waiting for spares per run")
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14),
              ncol=2, frameon=False)
    ax.set_title(title, fontsize=10)
    return _save(fig, path)
