"""Fit the planner's efficiency parameters of one hardware entry to measured training runs.

The planner predicts step time from a few physical efficiency parameters (docs/planner.md); calibration
chooses them so that its predictions match runs measured on the machine. Only these parameters move, never
a per-layout constant, so what is learnt transfers to layouts that were not measured:

    chip.matmul_eff_max     fraction of peak a large matmul reaches
    chip.kernel_overhead_s  fixed cost per kernel (what makes small matmuls slow)
    chip.memory_bw_eff      fraction of memory bandwidth that memory-bound ops reach
    link.bw_eff             fraction of the link's bandwidth a large collective reaches (all links scaled alike)
    link.latency_us         per-step latency of a collective, with the time-sharing term the probe measured
                            (timeshare_step_us; all links scaled alike)
    link.collective_overhead_us  fixed software cost of one collective call (framework dispatch: DTensor
                            redistribution, FSDP's copy-in/out; the probe times bare collectives)
    system.dp_overlap       fraction of data-parallel communication hidden behind backward compute

On a machine described by `paratrain probe` (chip status "measured") memory_bw_eff stays at the probe's
value: the bandwidth is measured, not fitted.

The fit minimises the squared log ratio of predicted to measured step time (relative error, so fast and
slow layouts weigh alike) with bounded least squares (scipy).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paratrain.hardware.catalog import System
from paratrain.model.config import ModelConfig

# name -> (lower, upper, log-scaled)
PARAMETERS: dict[str, tuple[float, float, bool]] = {
    "matmul_eff_max": (0.05, 1.0, False),
    "kernel_overhead_s": (1e-7, 1e-2, True),
    "memory_bw_eff": (0.02, 1.0, False),
    "link_bw_scale": (0.02, 5.0, True),
    "link_latency_scale": (0.05, 100.0, True),
    "collective_overhead_s": (1e-7, 0.05, True),
    "dp_overlap": (0.0, 1.0, False),
}


@dataclass
class Measurement:
    """One measured run: what the planner needs to predict it, and what was measured."""

    model: ModelConfig
    seq: int
    global_batch: int
    layout: dict
    world_size: int
    step_time_s: float
    name: str = ""
    options: dict = dataclasses.field(default_factory=dict)  # planner Options fields of the run (bucket, eager)

    @classmethod
    def from_summary(cls, data: dict, name: str = "") -> Measurement:
        for key in ("model_shape", "seq_len", "global_batch", "planner_layout", "world_size", "step_time_s_median"):
            if key not in data:
                raise ValueError(f"run summary {name or ''}: missing '{key}' (write it with paratrain train "
                                 f"--summary-json)")
        return cls(model=ModelConfig(**data["model_shape"]), seq=data["seq_len"], global_batch=data["global_batch"],
                   layout=data["planner_layout"], world_size=data["world_size"],
                   step_time_s=data["step_time_s_median"], name=name, options=data.get("planner_options", {}))


def load_measurements(paths: list[str | Path]) -> list[Measurement]:
    out = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise ValueError(f"run summary '{p}': no such file")
        out.append(Measurement.from_summary(json.loads(path.read_text()), name=path.stem))
    if not out:
        raise ValueError("calibrate: no run summaries given")
    return out


def current_parameters(system: System) -> dict[str, float]:
    eff = system.chip.efficiency
    return {"matmul_eff_max": eff.matmul_eff_max, "kernel_overhead_s": max(eff.kernel_overhead_s, 1e-7),
            "memory_bw_eff": eff.memory_bw_eff, "link_bw_scale": 1.0, "link_latency_scale": 1.0,
            "collective_overhead_s": max(system.tiers[0].interconnect.collective_overhead_us * 1e-6, 1e-7),
            "dp_overlap": system.efficiency.dp_overlap}


def apply_parameters(system: System, params: dict[str, float]) -> System:
    """A copy of `system` with the efficiency parameters replaced (links scaled, bw_eff capped at 1)."""
    chip = dataclasses.replace(system.chip, efficiency=dataclasses.replace(
        system.chip.efficiency, matmul_eff_max=params["matmul_eff_max"],
        kernel_overhead_s=params["kernel_overhead_s"], memory_bw_eff=params["memory_bw_eff"]))
    tiers = tuple(dataclasses.replace(t, interconnect=dataclasses.replace(
        t.interconnect, bw_eff=min(t.interconnect.bw_eff * params["link_bw_scale"], 1.0),
        # bandwidth beyond bw_eff = 1 is carried by the nominal bandwidth, so a scale > 1 still counts
        bw_gbytes_per_s=t.interconnect.bw_gbytes_per_s * max(t.interconnect.bw_eff * params["link_bw_scale"], 1.0),
        latency_us=t.interconnect.latency_us * params["link_latency_scale"],
        timeshare_step_us=t.interconnect.timeshare_step_us * params["link_latency_scale"],
        collective_overhead_us=params["collective_overhead_s"] * 1e6)) for t in system.tiers)
    eff = dataclasses.replace(system.efficiency, dp_overlap=params["dp_overlap"])
    return dataclasses.replace(system, chip=chip, tiers=tiers, efficiency=eff)


def sized_for(system: System, world_size: int) -> System:
    """The system as one node running `world_size` ranks. Ranks beyond the node's chips share a chip, as two
    NeuronCores share a Trainium1: on a CPU host whose "chips" are its cores (what `paratrain probe` writes),
    4 ranks on 2 cores each get half a core's FLOP/s and memory bandwidth. That sharing is physics the
    planner must see, not something to fit."""
    chips = min(world_size, system.chips_per_node)
    while world_size % chips:
        chips -= 1
    return dataclasses.replace(system, chips_per_node=chips, devices_per_chip=world_size // chips)


def predict(system: System, m: Measurement):
    from paratrain.plan.api import Layout, estimate
    from paratrain.plan.model import Options

    layout = Layout(**{k: v for k, v in m.layout.items() if k in Layout.__dataclass_fields__})
    sized = sized_for(system, m.world_size)
    return estimate(m.model, sized, 1, m.seq, m.global_batch, layout, Options.for_system(sized, **m.options))


def _to_unit(params: dict[str, float]) -> np.ndarray:
    x = []
    for name, (lo, hi, log) in PARAMETERS.items():
        v = min(max(params[name], lo), hi)
        x.append(math.log(v) if log else v)
    return np.array(x)


def _from_unit(x: np.ndarray) -> dict[str, float]:
    return {name: (math.exp(v) if log else float(v)) for (name, (_, _, log)), v in zip(PARAMETERS.items(), x,
                                                                                        strict=True)}


def fit(system: System, measurements: list[Measurement], fixed: dict[str, float] | None = None) -> tuple[System, dict]:
    """Least-squares fit of the parameters (those in `fixed` are held); returns the fitted system and a report."""
    from scipy.optimize import least_squares

    fixed = dict(fixed or {})
    if system.chip.status == "measured":
        # `paratrain probe` measured the streaming bandwidth itself (memory_bw_eff = 1 of it, what a long
        # memory-bound op like the optimizer step reaches); small elementwise ops are slower through their
        # per-kernel cost, which is fitted. Letting both move trades one for the other and mispredicts the
        # optimizer step (it matters: it separates DDP from FSDP on few ranks).
        fixed.setdefault("memory_bw_eff", system.chip.efficiency.memory_bw_eff)
    start = {**current_parameters(system), **fixed}
    names = [n for n in PARAMETERS if n not in fixed]
    x0 = _to_unit(start)
    free = np.array([n in names for n in PARAMETERS])
    lo = _to_unit({n: PARAMETERS[n][0] for n in PARAMETERS})
    hi = _to_unit({n: PARAMETERS[n][1] for n in PARAMETERS})

    def residuals(xf: np.ndarray) -> np.ndarray:
        x = x0.copy()
        x[free] = xf
        sys_ = apply_parameters(system, _from_unit(x))
        return np.array([math.log(predict(sys_, m).step_time_s / m.step_time_s) for m in measurements])

    # Several starts: the step-time model is piecewise (max of overlapped terms), so one start can stall.
    best = None
    for shift in (0.0, -0.3, 0.3):
        start_x = np.clip(x0[free] + shift * (hi[free] - lo[free]) / 4, lo[free] + 1e-9, hi[free] - 1e-9)
        res = least_squares(residuals, start_x, bounds=(lo[free], hi[free]), diff_step=1e-3, max_nfev=400)
        if best is None or res.cost < best.cost:
            best = res
    x = x0.copy()
    x[free] = best.x
    params = _from_unit(x)
    fitted = apply_parameters(system, params)
    return fitted, {"parameters": params, "fixed": sorted(fixed), "rms_log_error": float(np.sqrt(np.mean(best.fun**2)))}


def mape(system: System, measurements: list[Measurement]) -> tuple[float, list[dict]]:
    rows = []
    for m in measurements:
        pred = predict(system, m).step_time_s
        rows.append({"run": m.name, "layout": m.layout, "world_size": m.world_size, "measured_s": m.step_time_s,
                     "predicted_s": pred, "error": pred / m.step_time_s - 1})
    return float(np.mean([abs(r["error"]) for r in rows])), rows


def write_back(hardware_file: str | Path, system_name: str, params: dict[str, float], note: str) -> None:
    """Rewrite the efficiency values of `system_name` (its chip, links and system tables) in a hardware TOML."""
    import tomllib

    import tomli_w

    path = Path(hardware_file)
    doc = tomllib.loads(path.read_text())
    systems = doc.get("systems", {})
    if system_name not in systems:
        raise ValueError(f"hardware file '{path}': has no [systems.{system_name}] to calibrate")
    sysd = systems[system_name]
    chip = doc.get("chips", {}).get(sysd["chip"])
    if chip is None:
        raise ValueError(f"hardware file '{path}': chip '{sysd['chip']}' of {system_name} is not in this file")
    chip["efficiency"].update({k: params[k] for k in ("matmul_eff_max", "kernel_overhead_s", "memory_bw_eff")})
    chip["efficiency"]["source"] = note
    for tier in sysd["tiers"]:
        link = doc.get("interconnects", {}).get(tier["interconnect"])
        if link is None or link.get("_calibrated"):
            continue
        scaled = link["bw_eff"] * params["link_bw_scale"]
        link["bw_gbytes_per_s"] = link["bw_gbytes_per_s"] * max(scaled, 1.0)
        link["bw_eff"] = min(scaled, 1.0)
        link["latency_us"] = link["latency_us"] * params["link_latency_scale"]
        link["timeshare_step_us"] = link.get("timeshare_step_us", 0.0) * params["link_latency_scale"]
        link["collective_overhead_us"] = params["collective_overhead_s"] * 1e6
        link["source"] = link.get("source", "") + f"; {note}"
        link["_calibrated"] = True
    for link in doc.get("interconnects", {}).values():
        link.pop("_calibrated", None)
    eff = sysd.setdefault("efficiency", {"tp_overlap": 0.0, "memory_usable_fraction": 0.9})
    eff["dp_overlap"] = params["dp_overlap"]
    eff["source"] = note
    path.write_text(tomli_w.dumps(doc))
