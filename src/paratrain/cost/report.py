"""An HTML report with PNG plots for `paratrain compare --report DIR`."""

from __future__ import annotations

import html
from pathlib import Path

from paratrain.cost.compare import Row, Workload, pareto_front


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(r: Row) -> str:
    return f"{r.system} x{r.nodes}"


def plot_pareto(rows: list[Row], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    priced = [r for r in rows if r.cost_on_demand_usd is not None]
    for r in priced:
        ax.scatter(r.wall_hours / 24, r.cost_on_demand_usd / 1e3, s=40)
        ax.annotate(_label(r), (r.wall_hours / 24, r.cost_on_demand_usd / 1e3), textcoords="offset points",
                    xytext=(5, 4), fontsize=8)
    front = pareto_front(rows)
    if len(front) > 1:
        ax.plot([r.wall_hours / 24 for r in front], [r.cost_on_demand_usd / 1e3 for r in front], "k--", lw=1,
                label="Pareto front")
        ax.legend()
    ax.set_xlabel("time to train (days, with failures and checkpoints)")
    ax.set_ylabel("on-demand cost (thousand USD)")
    ax.set_title("Cost vs time to train")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _stacked(rows: list[Row], parts: dict[str, list[float]], ylabel: str, title: str, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4.5))
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for name, values in parts.items():
        if not any(values):
            continue
        ax.bar(x, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(list(x), [_label(r) for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory(rows: list[Row], path: Path) -> None:
    keys = sorted({k for r in rows for k in r.memory_breakdown_bytes})
    parts = {k: [r.memory_breakdown_bytes.get(k, 0.0) / 2**30 for r in rows] for k in keys}
    _stacked(rows, parts, "GiB per device", "Memory per device (best layout)", path)


def plot_step_time(rows: list[Row], path: Path) -> None:
    # dp_comm is the total; only its exposed part costs time (dp_exposed), so plot that one.
    keys = [k for k in sorted({k for r in rows for k in r.time_breakdown_s}) if k != "dp_comm"]
    parts = {k: [r.time_breakdown_s.get(k, 0.0) for r in rows] for k in keys}
    _stacked(rows, parts, "seconds per step", "Step time breakdown (best layout)", path)


def plot_scaling(workload: Workload, systems: list[tuple[str, int]], path: Path) -> list[dict]:
    """Throughput and MFU of the best layout vs cluster size, per system."""
    from paratrain.plan.api import search

    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    points = []
    for name, nodes in systems:
        counts = sorted({max(1, nodes // 4), max(1, nodes // 2), nodes, nodes * 2, nodes * 4})
        xs, tps, mfus = [], [], []
        for n in counts:
            res = search(workload.model_config(), name, n, workload.seq, workload.global_batch, top=1)
            if not res.candidates:
                continue
            e = res.candidates[0]
            xs.append(e.devices)
            tps.append(e.tokens_per_s)
            mfus.append(e.mfu)
            points.append({"system": name, "nodes": n, "tokens_per_s": e.tokens_per_s, "mfu": e.mfu})
        ax1.plot(xs, tps, "o-", label=name)
        ax2.plot(xs, mfus, "o-", label=name)
    for ax, label in ((ax1, "tokens / s"), (ax2, "MFU")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax1.set_yscale("log")
    ax1.legend(fontsize=8)
    fig.suptitle(f"Scaling of {workload.model_config().name} (seq {workload.seq}, global batch {workload.global_batch})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return points


def write_report(out_dir: str | Path, workload: Workload, rows: list[Row], targets: list[tuple[str, int]],
                 assumptions: list[str]) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images = {"pareto.png": "Cost vs time to train", "memory.png": "Memory per device",
              "step_time.png": "Step time breakdown", "scaling.png": "Scaling"}
    plot_pareto(rows, out / "pareto.png")
    plot_memory(rows, out / "memory.png")
    plot_step_time(rows, out / "step_time.png")
    plot_scaling(workload, targets, out / "scaling.png")
    head = ["system", "nodes", "layout", "MFU", "days", "goodput", "on-demand $", "reserved $", "$/M tokens", "MWh",
            "M tokens/MWh"]

    def fmt(v, spec):
        return "n/a" if v is None else format(v, spec)

    body = []
    for r in rows:
        lay = r.layout
        layout = f"TP{lay['tp']} PP{lay['pp']} DP{lay['dp']}{' SP' if lay['sp'] else ''} mb{lay['microbatch']} {lay['recompute']}"
        body.append([r.system, r.nodes, layout, f"{r.mfu:.1%}", f"{r.wall_hours / 24:.1f}", f"{r.goodput:.1%}",
                     fmt(r.cost_on_demand_usd, ",.0f"), fmt(r.cost_reserved_usd, ",.0f"),
                     fmt(r.cost_usd_per_million_tokens, ".3f"), fmt(r.energy_mwh, ",.1f"),
                     fmt(None if r.tokens_per_mwh is None else r.tokens_per_mwh / 1e6, ",.1f")])
    table = "<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in body) + "</table>"
    model = workload.model_config()
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>paratrain compare</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}img{{max-width:100%}}</style></head><body>
<h1>Training {html.escape(model.name)} on {workload.train_tokens:.3g} tokens</h1>
<p>sequence {workload.seq}, global batch {workload.global_batch} sequences, {workload.steps:,} steps;
each cluster with the planner's best layout.</p>
{table}
<h2>Assumptions</h2><ul>{''.join(f'<li>{html.escape(a)}</li>' for a in assumptions)}</ul>
{''.join(f'<h2>{t}</h2><img src="{f}" alt="{t}">' for f, t in images.items())}
</body></html>"""
    path = out / "index.html"
    path.write_text(page)
    return path
