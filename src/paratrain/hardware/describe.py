"""The catalog as `paratrain hardware list | show` shows it: one summary per system, every field of one entry,
and the text forms of both."""

from __future__ import annotations

from dataclasses import asdict

from paratrain.hardware.catalog import System


def system_summary(system: System) -> dict:
    return {
        "name": system.name, "display_name": system.display_name, "chip": system.chip.name,
        "chips_per_node": system.chips_per_node, "devices_per_node": system.devices_per_node,
        "device_unit": system.device_unit, "bf16_tflops_per_node": system.chip.bf16_tflops * system.chips_per_node,
        "hbm_bytes_per_device": system.device_memory_bytes,
        "scale_out_gbytes_per_s": system.tiers[-1].interconnect.bw_gbytes_per_s,
        "on_demand_usd_per_hour": system.prices.on_demand_usd_per_hour,
        "prices_usd_per_node_hour": {k: q.usd_per_node_hour for k, q in system.prices.quotes.items()},
        "no_public_price": system.prices.no_public_price or None,
        "chip_power_w": system.chip.power_w, "status": system.chip.status,
    }


def system_detail(system: System) -> dict:
    tiers = [{"name": t.name, "domain_devices": t.domain_devices or None,
              "per_device_gbytes_per_s": t.per_device_bw_bytes_per_s(system) / 1e9,
              "interconnect": asdict(t.interconnect)} for t in system.tiers]
    return {"kind": "system", **system_summary(system), "devices_per_chip": system.devices_per_chip,
            "tiers": tiers, "prices": asdict(system.prices), "efficiency": asdict(system.efficiency),
            "chip_detail": asdict(system.chip), "source": system.source, "conflicts": list(system.conflicts),
            "file": system.origin}


def chip_rows(catalog) -> list[dict]:
    return [{"name": c.name, "display_name": c.display_name, "bf16_tflops": c.bf16_tflops,
             "fp8_tflops": c.fp8_tflops, "hbm_gib": c.hbm_bytes / 2**30, "hbm_bw_gbytes_per_s": c.hbm_bw_gbytes_per_s,
             "power_w": c.power_w, "status": c.status} for c in catalog.chips.values()]


def describe(catalog, name: str) -> dict:
    """Every field of the system, chip or interconnect called `name`, with its sources."""
    if name in catalog.systems:
        return system_detail(catalog.systems[name])
    if name in catalog.chips:
        return {"kind": "chip", **asdict(catalog.chips[name])}
    if name in catalog.interconnects:
        return {"kind": "interconnect", **asdict(catalog.interconnects[name])}
    known = sorted(catalog.systems) + sorted(catalog.chips)
    raise ValueError(f"hardware show: '{name}' is not a known system or chip; known: {', '.join(known)}")


def print_list(rows: list[dict], chips: list[dict]) -> None:
    w = max([11, *(len(r["chip"]) for r in rows)])  # h100-hbm2e-500w (15) shifted its row
    cw = max([12, *(len(c["name"]) for c in chips)])
    print(f"{'system':<20} {'chip':<{w}} {'chips':>5} {'devices':>7} {'device':<30} {'BF16 TF/node':>12} "
          f"{'GiB/dev':>7} {'scale-out GB/s':>14}  $/node-hour by purchase option (`show` for region, source, date)")
    for r in rows:
        quotes = r["prices_usd_per_node_hour"]
        price = ", ".join(f"{k} {v:.2f}" for k, v in quotes.items()) if quotes else "no public price"
        print(f"{r['name']:<20} {r['chip']:<{w}} {r['chips_per_node']:>5} {r['devices_per_node']:>7} "
              f"{r['device_unit']:<30} {r['bf16_tflops_per_node']:>12,.0f} {r['hbm_bytes_per_device'] / 2**30:>7.1f} "
              f"{r['scale_out_gbytes_per_s']:>14,.0f}  {price}")
    print()
    print(f"{'chip':<{cw}} {'BF16 TF':>8} {'FP8 TF':>8} {'HBM GiB':>8} {'HBM GB/s':>9} {'W':>6}  status")
    for c in chips:
        fp8 = "-" if c["fp8_tflops"] is None else f"{c['fp8_tflops']:.0f}"
        power = "-" if c["power_w"] is None else f"{c['power_w']:.0f}"
        print(f"{c['name']:<{cw}} {c['bf16_tflops']:>8.0f} {fp8:>8} {c['hbm_gib']:>8.1f} "
              f"{c['hbm_bw_gbytes_per_s']:>9.0f} {power:>6}  {c['status']}")


def print_tree(data, indent: int = 0) -> None:
    pad = "  " * indent
    for key, value in data.items():
        if isinstance(value, dict):
            print(f"{pad}{key}:")
            print_tree(value, indent + 1)
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            print(f"{pad}{key}:")
            for item in value:
                print(f"{pad}  -")
                print_tree(item, indent + 2)
        else:
            print(f"{pad}{key}: {value}")
