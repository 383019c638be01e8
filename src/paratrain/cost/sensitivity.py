"""How a cost ranking changes with the purchase option and with each price moved by up to +-30%.

The planner's time to train does not depend on the price, so the sensitivity needs no new planning: each
candidate's cost at every purchase option the catalog publishes is already in its row (`cost_by_purchase_usd`).
Two views, as tables and one plot:

- by purchase option: every candidate's cost per million tokens at each option, and the ranking per option
  (candidates without a price at that option are left out of that ranking, never filled in);
- by price: each candidate's own price scaled by 0.7 ... 1.3 with the others fixed, and the rank it then has;
  `ties_at` is the factor on its price at which it would tie the best other candidate.

An `Item` is what both `compare` (cost only) and `recommend` (cost + one-off porting, `extra_usd`) rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paratrain.hardware.catalog import PURCHASE_OPTIONS

SCALES = (0.7, 0.85, 1.0, 1.15, 1.3)


@dataclass(frozen=True)
class Item:
    label: str
    tokens: float
    cost_by_purchase_usd: dict  # purchase option -> compute cost in USD, None where no price is published
    price_dates: dict = field(default_factory=dict)  # purchase option -> "region, date" of the price used
    extra_usd: float = 0.0  # a cost that does not scale with the price (porting the code base)

    def usd_per_mtok(self, purchase: str, scale: float = 1.0) -> float | None:
        cost = self.cost_by_purchase_usd.get(purchase)
        return None if cost is None else (cost * scale + self.extra_usd) / self.tokens * 1e6


def by_purchase(items: list[Item]) -> list[dict]:
    """Per purchase option: each item's $/M tokens (None: no price) and the ranking of those priced."""
    out = []
    for option in PURCHASE_OPTIONS:
        values = {it.label: it.usd_per_mtok(option) for it in items}
        ranking = sorted((k for k, v in values.items() if v is not None), key=lambda k: values[k])
        out.append({"purchase": option, "usd_per_million_tokens": values, "ranking": ranking,
                    "cheapest": ranking[0] if ranking else None,
                    "price_dates": {it.label: it.price_dates.get(option) for it in items}})
    return out


def price_range(items: list[Item], purchase: str, scales: tuple[float, ...] = SCALES) -> list[dict]:
    """Per item priced at `purchase`: its rank (1 = cheapest) with its own price times each scale, the others
    unchanged, and the factor on its price at which it ties the best other item (None: no other priced item,
    or it cannot tie at any price because its fixed extra cost alone is higher)."""
    priced = [it for it in items if it.usd_per_mtok(purchase) is not None]
    out = []
    for it in priced:
        others = [o.usd_per_mtok(purchase) for o in priced if o is not it]
        ranks = {}
        for scale in scales:
            own = it.usd_per_mtok(purchase, scale)
            ranks[f"{scale:.2f}"] = 1 + sum(1 for v in others if v < own)
        ties_at = None
        if others:
            compute_per_mtok = it.cost_by_purchase_usd[purchase] / it.tokens * 1e6
            budget = min(others) - it.extra_usd / it.tokens * 1e6
            ties_at = budget / compute_per_mtok if budget > 0 else None
        out.append({"label": it.label, "ranks": ranks, "ties_at": ties_at})
    return out


def sensitivity(items: list[Item], purchase: str, metric: str = "$ per million tokens") -> dict:
    """Both views, for the JSON output and the printed tables."""
    return {"purchase": purchase, "metric": metric, "scales": list(SCALES), "by_purchase": by_purchase(items),
            "price_range": price_range(items, purchase)}


def format_tables(report: dict) -> list[str]:
    """The two small tables as lines of text; every dollar figure carries its price's region and date."""
    rows = report["by_purchase"]
    labels = list(rows[0]["usd_per_million_tokens"]) if rows else []
    width = max([len(x) for x in labels] + [12]) + 2
    lines = [f"sensitivity 1: {report.get('metric', '$ per million tokens')} by purchase option (price region, "
             "date; '-' = none published)"]
    shown = [r for r in rows if r["ranking"]]
    for label in labels:
        cells = []
        for r in shown:
            v = r["usd_per_million_tokens"][label]
            cells.append("-" if v is None else f"{v:.3f} ({r['price_dates'][label]})")
        lines.append(f"  {label:<{width}}" + "".join(f"{c:<36}" for c in cells))
    lines.insert(1, f"  {'':<{width}}" + "".join(f"{r['purchase']:<36}" for r in shown))
    for r in shown:
        lines.append(f"  {r['purchase']}: " + " < ".join(r["ranking"]))
    scales = report["scales"]
    lines.append(f"sensitivity 2: rank at {report['purchase']} with only its own price scaled (1 = cheapest)")
    head = "".join(f"{f'{s - 1:+.0%}':>7}" for s in scales)
    lines.append(f"  {'':<{width}}{head}  ties the best other at")
    for r in report["price_range"]:
        ties = "n/a" if r["ties_at"] is None else f"x{r['ties_at']:.2f} its price"
        lines.append(f"  {r['label']:<{width}}" + "".join(f"{r['ranks'][f'{s:.2f}']:>7}" for s in scales)
                     + f"  {ties}")
    if not report["price_range"]:
        lines.append(f"  (no candidate has a {report['purchase']} price)")
    return lines


def plot(items: list[Item], path, title: str, unpriced: dict | None = None) -> None:
    """Grouped bars: $/M tokens by candidate (x) and purchase option (colour), each with a +-30% price range
    as an error bar. `unpriced`: label -> text (e.g. its break-even price) for candidates without any price,
    written where their bars would be."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    options = [o for o in PURCHASE_OPTIONS if any(it.usd_per_mtok(o) is not None for it in items)]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.3 * len(items)), 4.8))
    width = 0.8 / max(len(options), 1)
    tallest = max((it.usd_per_mtok(o) or 0.0 for it in items for o in options), default=1.0) or 1.0
    for j, option in enumerate(options):
        dates = sorted({it.price_dates.get(option, "").split(", ")[-1] for it in items
                        if it.usd_per_mtok(option) is not None})
        xs, ys, lo, hi = [], [], [], []
        for i, it in enumerate(items):
            v = it.usd_per_mtok(option)
            if v is None:
                continue
            xs.append(i - 0.4 + width * (j + 0.5))
            ys.append(v)
            lo.append(v - it.usd_per_mtok(option, 0.7))
            hi.append(it.usd_per_mtok(option, 1.3) - v)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, color=f"C{j}",
               label=f"{option} (prices of {', '.join(dates)})")
    for i, it in enumerate(items):
        if unpriced and it.label in unpriced:
            ax.text(i, tallest * 0.02, unpriced[it.label], rotation=90, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(items)), [it.label for it in items], rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("USD per million tokens (error bar: price -30% .. +30%)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
