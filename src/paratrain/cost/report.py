"""An HTML report with PNG plots for `paratrain compare --report DIR`."""

from __future__ import annotations

import html
from pathlib import Path

from paratrain.cost.compare import Assumptions, Row, Workload, evaluate_target, pareto_front, ratios_to_first

RATIO_LABELS = {"price_usd_per_node_hour": "$/node-hour", "price_per_chip_hour_usd": "$/chip-hour",
                "price_per_peak_bf16_pflop_hour_usd": "$/peak PFLOP-hour",
                "cost_usd_per_million_tokens": "$/M tokens", "wall_hours": "days", "energy_mwh": "MWh"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(r: Row) -> str:
    return f"{r.system} x{r.nodes}"


def plot_pareto(rows: list[Row], path: Path, sizes: list[Row] = ()) -> list[Row]:
    """Cost vs time to train: the compared clusters (large markers, labelled) and the same systems at other
    sizes (small markers, one colour per system); the Pareto front over all of them (no other point is both
    faster and cheaper) is drawn as a line and its points ringed. Returns the front."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    colours = {name: f"C{i}" for i, name in enumerate(dict.fromkeys(r.system for r in [*rows, *sizes]))}
    for r in sizes:
        if r.cost_usd is not None:
            ax.scatter(r.wall_hours / 24, r.cost_usd / 1e3, s=14, color=colours[r.system], alpha=0.6)
    for r in rows:
        if r.cost_usd is None:
            continue
        ax.scatter(r.wall_hours / 24, r.cost_usd / 1e3, s=60, color=colours[r.system], label=_label(r))
        ax.annotate(_label(r), (r.wall_hours / 24, r.cost_usd / 1e3), textcoords="offset points",
                    xytext=(5, 4), fontsize=8)
    front = pareto_front([*rows, *sizes])
    if front:
        days = [r.wall_hours / 24 for r in front]
        cost = [r.cost_usd / 1e3 for r in front]
        ax.plot(days, cost, "k--", lw=1, label="Pareto front")
        ax.scatter(days, cost, s=140, facecolors="none", edgecolors="k", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("time to train (days, with failures and checkpoints; log scale)")
    purchase = rows[0].purchase if rows else "on-demand"
    ax.set_ylabel(f"cost at the {purchase} price (thousand USD)")
    ax.set_title("Cost vs time to train (small markers: the same systems at other cluster sizes)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return front


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


def size_rows(workload: Workload, targets: list[tuple[str, int]], assumptions: Assumptions,
              progress=None) -> list[Row]:
    """The same workload on each target system at 1/4, 1/2, 2 and 4 times its node count (what fits)."""
    out = []
    for name, nodes in targets:
        for n in sorted({max(1, nodes // 4), max(1, nodes // 2), nodes * 2, nodes * 4} - {nodes}):
            try:
                out.append(evaluate_target(workload, name, n, assumptions))
            except ValueError:  # too small to fit, or no layout divides the batch: no point
                pass
            if progress:
                progress(1)
    return out


def plot_scaling(workload: Workload, rows: list[Row], path: Path) -> None:
    """Throughput and MFU of the best layout vs cluster size, per system."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in dict.fromkeys(r.system for r in rows):
        mine = sorted((r for r in rows if r.system == name), key=lambda r: r.devices)
        xs = [r.devices for r in mine]
        ax1.plot(xs, [r.tokens_per_s for r in mine], "o-", label=name)
        ax2.plot(xs, [r.mfu for r in mine], "o-", label=name)
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


def _price_cell(r: Row) -> str:
    if r.price_usd_per_node_hour is None:
        even = r.break_even_usd_per_node_hour
        return r.price_label + ("" if even is None else f"; break-even ${even:,.2f}/node-hour")
    return f"${r.price_usd_per_node_hour:,.2f}/node-hour ({r.price_label})"


def write_report(out_dir: str | Path, workload: Workload, rows: list[Row], targets: list[tuple[str, int]],
                 assumptions: Assumptions, progress=None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images = {"pareto.png": "Cost vs time to train", "memory.png": "Memory per device",
              "step_time.png": "Step time breakdown", "scaling.png": "Scaling",
              "sensitivity.png": "$ per million tokens by system and purchase option (+-30% price range)"}
    from paratrain.cost.compare import to_item
    from paratrain.cost.sensitivity import format_tables, plot, sensitivity

    items = [to_item(r) for r in rows]
    unpriced = {it.label: f"no public price: break-even ${r.break_even_usd_per_node_hour:,.0f}/node-h"
                for r, it in zip(rows, items, strict=True)
                if all(v is None for v in r.cost_by_purchase_usd.values()) and r.break_even_usd_per_node_hour}
    plot(items, out / "sensitivity.png", f"{workload.model_config().name}, {workload.train_tokens:.3g} tokens", unpriced)
    sens_text = "\n".join(format_tables(sensitivity(items, rows[0].purchase)))
    sizes = size_rows(workload, targets, assumptions, progress)
    front = plot_pareto(rows, out / "pareto.png", sizes)
    plot_memory(rows, out / "memory.png")
    plot_step_time(rows, out / "step_time.png")
    plot_scaling(workload, [*rows, *sizes], out / "scaling.png")
    front_text = ", ".join(f"{r.system} x{r.nodes} ({r.wall_hours / 24:.1f} days, ${r.cost_usd:,.0f})"
                           for r in front)
    assumptions = assumptions.describe()
    head = ["system", "nodes", "layout", "MFU", "days", "goodput", "accelerator-hours", f"cost $ ({rows[0].purchase})",
            "price (option, region, date)", "$/chip-hour", "$/peak PFLOP-hour", "$/M tokens", "MWh", "M tokens/MWh"]

    def fmt(v, spec):
        return "n/a" if v is None else format(v, spec)

    body = []
    for r in rows:
        lay = r.layout
        layout = f"TP{lay['tp']} PP{lay['pp']} DP{lay['dp']}{' SP' if lay['sp'] else ''} mb{lay['microbatch']} {lay['recompute']}"
        body.append([r.system, r.nodes, layout, f"{r.mfu:.1%}", f"{r.wall_hours / 24:.1f}", f"{r.goodput:.1%}",
                     f"{r.accelerator_hours:,.0f}", fmt(r.cost_usd, ",.0f"),
                     _price_cell(r),
                     fmt(r.price_per_chip_hour_usd, ".2f"), fmt(r.price_per_peak_bf16_pflop_hour_usd, ".2f"),
                     fmt(r.cost_usd_per_million_tokens, ".3f"), fmt(r.energy_mwh, ",.1f"),
                     fmt(None if r.tokens_per_mwh is None else r.tokens_per_mwh / 1e6, ",.1f")])
    table = "<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in body) + "</table>"
    ratios = "".join(
        f"<li>{html.escape(r['first'])} / {html.escape(r['other'])}: "
        + ", ".join(f"{name} {'n/a' if r[key] is None else format(r[key], '.2f')}" for key, name in RATIO_LABELS.items())
        + "</li>" for r in ratios_to_first(rows))
    notes = "".join(f"<li>{html.escape(f'{r.system} x{r.nodes}: {n}')}</li>" for r in rows for n in r.notes)
    model = workload.model_config()
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>paratrain compare</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}img{{max-width:100%}}</style></head><body>
<h1>Training {html.escape(model.name)} on {workload.train_tokens:.3g} tokens</h1>
<p>sequence {workload.seq}, global batch {workload.global_batch} sequences, {workload.steps:,} steps;
each cluster with the planner's best layout.</p>
{table}
<h2>Ratios</h2><ul>{ratios or '<li>one target: no ratios</li>'}</ul>
<h2>Notes</h2><ul>{notes}</ul>
<p>Pareto front (no other cluster, at the compared or other sizes, is both faster and cheaper):
{html.escape(front_text or "none (no priced system)")}.</p>
<h2>Sensitivity</h2><pre>{html.escape(sens_text)}</pre>
<h2>Assumptions</h2><ul>{''.join(f'<li>{html.escape(a)}</li>' for a in assumptions)}</ul>
{''.join(f'<h2>{t}</h2><img src="{f}" alt="{t}">' for f, t in images.items())}
</body></html>"""
    path = out / "index.html"
    path.write_text(page)
    return path
