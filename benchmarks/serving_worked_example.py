"""docs/serving.md's worked example: Llama 3 70B chat traffic on trn2.48xlarge vs p5.48xlarge (H100).

Request mix: 1,024 prompt + 256 output tokens, TTFT <= 1 s and ITL <= 50 ms (analytic, planned at <= 80% of
capacity), bf16 weights, bf16 or fp8 KV cache (the search picks). For each system and request rate: the
cheapest deployment `paratrain serve plan` finds, its chips, and $/M tokens at the catalog's prices (spot for
both, the one option both have a published price for; on-demand for p5; for trn2, which has no public
on-demand price, the on-demand price at which it would tie p5). Writes docs/serving/worked_example.png.

    python benchmarks/serving_worked_example.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from paratrain.cost.serving import serving_cost  # noqa: E402
from paratrain.hardware.catalog import resolve_system  # noqa: E402
from paratrain.model.config import load_model_config  # noqa: E402
from paratrain.plan.serve import Target, plan  # noqa: E402

MODEL = "llama3-70b"
SYSTEMS = ("trn2.48xlarge", "p5.48xlarge")
RATES = (5, 10, 20, 50, 100, 200)
MIX = {"prompt": 1024, "output": 256, "ttft_s": 1.0, "itl_s": 0.05}


def rows():
    model = load_model_config(MODEL)
    out = []
    for name in SYSTEMS:
        system = resolve_system(name)
        for rate in RATES:
            target = Target(rate=rate, **MIX)
            best = plan(model, system, target, weights=("bf16",), kv=("bf16", "fp8"), top=1)[0]
            spot = serving_cost(best, system, target, purchase="spot")
            demand = serving_cost(best, system, target, purchase="on-demand")
            out.append({"system": name, "rate": rate, "plan": best, "spot": spot, "on_demand": demand})
    return out


def main() -> int:
    data = rows()
    print(f"{MODEL}: {MIX['prompt']}+{MIX['output']} tokens, TTFT <= {MIX['ttft_s']} s, ITL <= {MIX['itl_s'] * 1e3:.0f} ms")
    print(f"{'system':<15} {'req/s':>5} {'replica':>12} {'batch':>5} {'replicas':>8} {'nodes':>5} {'chips':>5} "
          f"{'TTFT ms':>7} {'ITL ms':>6} {'spot $/h':>8} {'spot $/M tok':>12} {'on-demand $/M tok':>17}")
    for r in data:
        p, e = r["plan"], r["plan"].estimate
        od = r["on_demand"].usd_per_million_tokens
        print(f"{r['system']:<15} {r['rate']:>5} {f'tp{e.replica.tp} pp{e.replica.pp} {e.replica.kv}':>12} "
              f"{e.batch:>5} {p.replicas:>8} {p.nodes:>5} {r['spot'].chips:>5g} {e.ttft_s * 1e3:>7.0f} "
              f"{e.itl_s * 1e3:>6.1f} {r['spot'].usd_per_hour:>8.1f} {r['spot'].usd_per_million_tokens:>12.3f} "
              f"{'-' if od is None else f'{od:.3f}':>17}")
    by = {(r["system"], r["rate"]): r for r in data}
    for rate in RATES:
        trn2, p5 = by[("trn2.48xlarge", rate)], by[("p5.48xlarge", rate)]
        tie = p5["on_demand"].usd_per_hour / trn2["on_demand"].nodes
        print(f"{rate:>4} req/s: trn2 ties p5 on-demand at ${tie:.2f} per trn2.48xlarge-hour "
              f"({trn2['spot'].chips:g} Trainium2 vs {p5['spot'].chips:g} H100)")
    plot(data, ROOT / "docs" / "serving" / "worked_example.png")
    return 0


def plot(data, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, color in zip(SYSTEMS, ("tab:orange", "tab:green"), strict=True):
        rs = [r for r in data if r["system"] == name]
        rates = [r["rate"] for r in rs]
        ax1.plot(rates, [r["spot"].chips for r in rs], "o-", color=color, label=name)
        ax2.plot(rates, [r["spot"].usd_per_million_tokens for r in rs], "o-", color=color, label=f"{name} spot")
        if rs[0]["on_demand"].usd_per_million_tokens is not None:
            ax2.plot(rates, [r["on_demand"].usd_per_million_tokens for r in rs], "s--", color=color,
                     label=f"{name} on-demand")
    ax1.set(xscale="log", yscale="log", xlabel="requests/s", ylabel="accelerator chips (whole nodes)",
            title="chips to serve the rate")
    ax2.set(xscale="log", xlabel="requests/s", ylabel="$ per million tokens (in + out)", title="cost per token")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{MODEL}, {MIX['prompt']}+{MIX['output']} tokens, TTFT <= 1 s, ITL <= 50 ms (paratrain serve plan)",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
