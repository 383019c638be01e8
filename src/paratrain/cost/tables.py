"""The text tables of `paratrain compare` and `paratrain recommend`, and the sensitivity plot they write."""

from __future__ import annotations


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


def write_recommendation_plot(path: str, rec, kind: str, req) -> str:
    """The sensitivity plot of a recommendation; candidates without a price labelled with their break-even."""
    from paratrain.cost.sensitivity import plot

    unpriced = {it.label: f"no price: break-even ${c['break_even_usd_per_node_hour']:,.0f}/node-h"
                for it, c in zip(rec.items, rec.candidates, strict=True)
                if c["total_usd"] is None and c["break_even_usd_per_node_hour"]}
    plot(rec.items, path, f"$ per million tokens (compute + porting) by system and purchase option: {kind}, "
         f"{req.model}, {req.train_tokens:.3g} tokens", unpriced)
    return path


def print_comparison(out: dict, rows) -> None:
    """`paratrain compare`'s text: the table, the ratios to the first target, the sensitivity, the assumptions."""
    print_table(rows)
    print_ratios(out["ratios_to_first"])
    print_sensitivity(out["sensitivity"])
    print("\nassumptions:\n  " + "\n  ".join(out["assumptions"]))
    for key in ("sensitivity_plot", "report"):
        if key in out:
            print(f"{key.replace('_', ' ')}: {out[key]}")


def print_sensitivity(report: dict) -> None:
    from paratrain.cost.sensitivity import format_tables

    print()
    print("\n".join(format_tables(report)))


def _usd(v, spec=",.0f") -> str:
    return "n/a" if v is None else "$" + format(v, spec)


def layout_label(lay: dict) -> str:
    """TP8PP1DP64+SP/selective, with CP and EP where used (recompute spelled out: 'non' and 'ful' were cut)."""
    extra = "".join(f"{k.upper()}{lay[k]}" for k in ("cp", "ep") if lay.get(k, 1) > 1)
    return f"TP{lay['tp']}PP{lay['pp']}DP{lay['dp']}{extra}{'+SP' if lay['sp'] else ''}/{lay['recompute']}"


def print_table(rows) -> None:
    def f(v, spec):
        return "n/a" if v is None else format(v, spec)

    purchase = rows[0].purchase if rows else "on-demand"
    layouts = [layout_label(r.layout) for r in rows]
    w = max([22, *(len(x) + 2 for x in layouts)])
    # days = wall time with failures; overhead = the share failures, restarts and checkpoints add to it
    print(f"{'system':<18}{'nodes':>6}{'layout':>{w}}{'MFU':>7}{'days':>8}{'overhead':>9}{'accel-h':>11}"
          f"{'cost $':>14}{'$/chip-h':>9}{'$/PF-h':>8}{'$/Mtok':>9}{'MWh':>9}{'Mtok/MWh':>9}  price (option, region, date)")
    for r, layout in zip(rows, layouts, strict=True):
        if r.price_usd_per_node_hour is None:
            even = r.break_even_usd_per_node_hour
            price = r.price_label + ("" if even is None else f": break-even ${even:,.2f}/node-h vs the cheapest")
        else:
            price = f"${r.price_usd_per_node_hour:,.2f}/node-h ({r.price_label})"
        print(f"{r.system:<18}{r.nodes:>6}{layout:>{w}}{r.mfu:>7.1%}{r.wall_hours / 24:>8.1f}"
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


def print_recommendation(kind: str, req, rec, out: dict) -> None:
    print(f"workload: {kind} ({req.model}, {req.train_tokens:.3g} tokens)")
    print(f"recommendation: {rec.choice or 'none'} (compute at the {rec.purchase} price)")
    print("rules:\n  " + "\n  ".join(rec.rules))
    print("reasons:\n  " + "\n  ".join(rec.reasons))
    print_candidates(rec.candidates)
    if rec.sensitivity:
        print_sensitivity(rec.sensitivity)
    print("assumptions:\n  " + "\n  ".join(rec.assumptions))
    if "sensitivity_plot" in out:
        print(f"sensitivity plot: {out['sensitivity_plot']}")


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
