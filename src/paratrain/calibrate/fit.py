"""Fit the planner's efficiency parameters of one hardware entry to measured training runs.

The planner predicts step time from a few physical efficiency parameters (docs/planner.md); calibration
chooses them so that its predictions match runs measured on the machine. Only these parameters move, never
a per-layout constant, so what is learnt transfers to layouts that were not measured:

    chip.matmul_eff_max     fraction of peak a large matmul reaches
    chip.kernel_overhead_s  fixed cost per kernel (what makes small matmuls slow)
    chip.memory_bw_eff      fraction of memory bandwidth that memory-bound ops reach
    link.bw_eff             fraction of the link's bandwidth a large collective reaches (all links scaled alike)
    link.latency_us         per-step latency of a collective, with the time-sharing term the probe measured
                            (timeshare_step_us; NCCL's LL128 step, ll128_latency_us; all links scaled alike)
    link.collective_overhead_us  fixed software cost of one collective call (framework dispatch: DTensor
                            redistribution, FSDP's copy-in/out; the probe times bare collectives)
    system.dp_overlap       fraction of data-parallel communication hidden behind backward compute

On a machine described by `paratrain probe` (chip status "measured") memory_bw_eff stays at the probe's
value: the bandwidth is measured, not fitted.

The fit minimises the squared log ratio of predicted to measured step time (relative error, so fast and
slow layouts weigh alike) with bounded least squares (scipy).

Few runs cannot identify seven parameters: one run fitted with seven parameters is matched exactly and
says nothing. `calibrate` therefore fits only the parameters the runs identify (`select_parameters`): the
sensitivity of every run's log step time to one "meaningful step" of each parameter (x1.25 for a scale or a
time, +-0.1 for a fraction), evaluated at a first fit of all parameters, and a column-pivoted QR of that
matrix: a parameter enters in the order of what it explains beyond those already chosen, while its share is
at least `MIN_SENSITIVITY` (1% of step time per step) and at most max(1, runs - 1) parameters are chosen (one
run's worth of residual stays to be checked). The rest stay at their previous values, each with the reason.
The error reported is leave-one-out (each run predicted by a fit without it), not the error on the fitted runs.
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
    run_dir: str = ""  # where the run wrote its config.toml (to repeat it with another layout)

    @classmethod
    def from_summary(cls, data: dict, name: str = "") -> Measurement:
        for key in ("model_shape", "seq_len", "global_batch", "planner_layout", "world_size", "step_time_s_median"):
            if key not in data:
                raise ValueError(f"run summary {name or ''}: missing '{key}' (write it with paratrain train "
                                 f"--summary-json)")
        if data.get("steps") == 0 or not _finite(data.get("step_time_s_median")):
            raise ValueError(f"run summary '{name}': no measured step time (the run trained "
                             f"{data.get('steps', 0)} steps; a run that resumed a finished run measures nothing): "
                             f"use summaries of runs that trained")
        return cls(model=ModelConfig(**data["model_shape"]), seq=data["seq_len"], global_batch=data["global_batch"],
                   layout=data["planner_layout"], world_size=data["world_size"],
                   step_time_s=data["step_time_s_median"], name=name, options=data.get("planner_options", {}),
                   run_dir=data.get("run_dir", ""))


def _finite(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def read_summary(p: str | Path) -> tuple[Path, dict]:
    """A run summary file's path and parsed JSON, or one clear error (training and generate summaries alike)."""
    path = Path(p)
    if not path.is_file():
        raise ValueError(f"run summary '{p}': no such file")
    try:
        return path, json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"run summary '{p}': not JSON ({exc.msg} at line {exc.lineno})") from None


def load_measurements(paths: list[str | Path]) -> list[Measurement]:
    out = []
    for p in paths:
        path, data = read_summary(p)
        out.append(Measurement.from_summary(data, name=path.stem))
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
        ll128_latency_us=t.interconnect.ll128_latency_us * params["link_latency_scale"],  # NCCL's other protocol alike
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


def predict(system: System, m: Measurement, checked=None):
    """The planner's estimate of run m on `system` sized for it. checked: m's layout as checked_layouts returned
    it for a system of the same size (the check is then not repeated: the same estimate)."""
    from paratrain.plan.api import estimate_checked
    from paratrain.plan.options import Options

    sized = sized_for(system, m.world_size)
    if checked is None:
        checked = _checked(sized, m)
    return estimate_checked(m.model, sized, 1, m.seq, m.global_batch, checked, Options.for_system(sized, **m.options))


def checked_layouts(system: System, measurements: list[Measurement]) -> list:
    """Each run's layout validated once (plan.api.check_layout) on `system` sized for it. A fit predicts every run
    ~10^3 times on systems that differ only in efficiencies (apply_parameters keeps every size), and the check
    was a fifth of each prediction's time."""
    return [_checked(sized_for(system, m.world_size), m) for m in measurements]


def _checked(sized: System, m: Measurement):
    from paratrain.plan.api import Layout, check_layout

    fields = dict(m.layout)
    if "schedule" in fields:  # run summaries written before Layout.schedule became pp_schedule (the trainer's name)
        fields.setdefault("pp_schedule", fields.pop("schedule"))
    layout = Layout(**{k: v for k, v in fields.items() if k in Layout.__dataclass_fields__})
    return check_layout(m.model, sized, 1, m.seq, m.global_batch, layout)


def _to_unit(params: dict[str, float]) -> np.ndarray:
    x = []
    for name, (lo, hi, log) in PARAMETERS.items():
        v = min(max(params[name], lo), hi)
        x.append(math.log(v) if log else v)
    return np.array(x)


def _from_unit(x: np.ndarray) -> dict[str, float]:
    return {name: (math.exp(v) if log else float(v)) for (name, (_, _, log)), v in zip(PARAMETERS.items(), x,
                                                                                        strict=True)}


# One "meaningful step" of each parameter in the fit's coordinates (log for log-scaled ones): x1.25 for a scale
# or a time, 0.1 for a fraction. The sensitivity of a run to a parameter is the change of its log step time
# per such step.
STEP = {name: (math.log(1.25) if log else 0.1) for name, (_, _, log) in PARAMETERS.items()}
MIN_SENSITIVITY = 0.01  # below 1% of step time per step, a parameter is not identified by the runs


def _free_and_fixed(system: System, fixed: dict[str, float] | None) -> tuple[list[str], dict[str, float]]:
    fixed = dict(fixed or {})
    if system.chip.status == "measured":
        # `paratrain probe` measured the streaming bandwidth itself (memory_bw_eff = 1 of it, what a long
        # memory-bound op like the optimizer step reaches); small elementwise ops are slower through their
        # per-kernel cost, which is fitted. Letting both move trades one for the other and mispredicts the
        # optimizer step (it matters: it separates DDP from FSDP on few ranks).
        fixed.setdefault("memory_bw_eff", system.chip.efficiency.memory_bw_eff)
    return [n for n in PARAMETERS if n not in fixed], fixed


def _log_ratios(system: System, params: dict[str, float], measurements: list[Measurement],
                checked: list | None = None) -> np.ndarray:
    """log(predicted / measured) per run; checked: checked_layouts(system, measurements), to skip the checks."""
    sys_ = apply_parameters(system, params)
    if checked is None:
        checked = checked_layouts(sys_, measurements)
    return np.array([math.log(predict(sys_, m, lay).step_time_s / m.step_time_s)
                     for m, lay in zip(measurements, checked, strict=True)])


def _least_squares(system: System, measurements: list[Measurement], names: list[str], start: dict[str, float],
                   shifts=(0.0, -0.3, 0.3)) -> tuple[dict[str, float], np.ndarray]:
    """Bounded least squares of the log step-time ratios over `names` (the others held at `start`)."""
    from scipy.optimize import least_squares

    x0 = _to_unit(start)
    if not names:
        return dict(start), _log_ratios(system, start, measurements)
    free = np.array([n in names for n in PARAMETERS])
    lo = _to_unit({n: PARAMETERS[n][0] for n in PARAMETERS})
    hi = _to_unit({n: PARAMETERS[n][1] for n in PARAMETERS})

    checked = checked_layouts(system, measurements)  # once: every residual predicts the same runs

    def residuals(xf: np.ndarray) -> np.ndarray:
        x = x0.copy()
        x[free] = xf
        return _log_ratios(system, _from_unit(x), measurements, checked)

    # Several starts: the step-time model is piecewise (max of overlapped terms), so one start can stall.
    best = None
    for shift in shifts:
        start_x = np.clip(x0[free] + shift * (hi[free] - lo[free]) / 4, lo[free] + 1e-9, hi[free] - 1e-9)
        # tolerances of 1e-5 in log step time (0.001%), far below run-to-run noise: each evaluation is a
        # planner estimate per run, the cost of calibrating
        res = least_squares(residuals, start_x, bounds=(lo[free], hi[free]), diff_step=1e-3, max_nfev=200,
                            ftol=1e-5, xtol=1e-5, gtol=1e-5)
        if best is None or res.cost < best.cost:
            best = res
    x = x0.copy()
    x[free] = best.x
    return _from_unit(x), best.fun


def sensitivity(system: System, measurements: list[Measurement], params: dict[str, float],
                names: list[str]) -> np.ndarray:
    """runs x names: change of each run's log step time for one STEP of each parameter at `params` (a step
    up, or down at the upper bound)."""
    checked = checked_layouts(system, measurements)
    base = _log_ratios(system, params, measurements, checked)
    x0 = _to_unit(params)
    hi = _to_unit({n: PARAMETERS[n][1] for n in PARAMETERS})
    cols = []
    for name in names:
        i = list(PARAMETERS).index(name)
        x = x0.copy()
        step = STEP[name] if x0[i] + STEP[name] <= hi[i] else -STEP[name]
        x[i] += step
        cols.append((_log_ratios(system, _from_unit(x), measurements, checked) - base) * (STEP[name] / step))
    return np.stack(cols, axis=1) if cols else np.zeros((len(measurements), 0))


def select_parameters(J: np.ndarray, names: list[str], n_runs: int) -> tuple[list[str], dict[str, str]]:
    """The parameters the runs identify, and why each other one is held (see the module docstring)."""
    from scipy.linalg import qr

    held: dict[str, str] = {}
    norms = np.linalg.norm(J, axis=0) if J.size else np.zeros(len(names))
    for name, norm in zip(names, norms, strict=True):
        if norm < MIN_SENSITIVITY:
            held[name] = (f"no run's step time depends on it (sensitivity {norm:.1%} per step, below "
                          f"{MIN_SENSITIVITY:.0%})")
    live = [i for i, n in enumerate(names) if n not in held]
    chosen: list[str] = []
    if live:
        _, R, piv = qr(J[:, live], mode="economic", pivoting=True)
        limit = max(1, n_runs - 1)
        for k, j in enumerate(piv):
            name = names[live[j]]
            beyond = abs(R[k, k]) if k < min(R.shape) else 0.0
            if len(chosen) >= limit:
                held[name] = (f"{n_runs} run(s) identify at most {limit} parameter(s) and keep a residual to "
                              f"check (more runs of other layouts: see --suggest)")
            elif beyond < MIN_SENSITIVITY:
                twin = max(chosen, key=lambda c: _cosine(J[:, names.index(c)], J[:, live[j]]))
                held[name] = (f"the runs cannot tell it from {twin} (what it adds beyond the chosen parameters: "
                              f"{beyond:.1%} per step)")
            else:
                chosen.append(name)
    return [n for n in names if n in chosen], held


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(abs(a @ b) / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


@dataclass
class Calibration:
    system: System  # the fitted system
    parameters: dict[str, float]  # every parameter: fitted ones moved, held ones at their previous values
    fitted: list[str]
    held: dict[str, str]  # name -> why it was not fitted
    fixed: list[str]
    sensitivity: dict[str, list[float]]  # parameter -> per run, at the first (all-parameter) fit
    residuals: list[float]  # log(predicted / measured) of the fitted runs


def calibrate(system: System, measurements: list[Measurement], fixed: dict[str, float] | None = None) -> Calibration:
    """Fit only what the runs identify: a first fit of every free parameter locates the region the runs point
    to, the sensitivities there choose the identifiable parameters, and the final fit moves only those from
    the previous values."""
    names, fixed = _free_and_fixed(system, fixed)
    start = {**current_parameters(system), **fixed}
    # several starts only where the runs may identify every parameter (the fit is then final)
    shifts = (0.0, -0.3, 0.3) if len(measurements) > len(names) else (0.0,)
    everything, _ = _least_squares(system, measurements, names, start, shifts=shifts)
    J = sensitivity(system, measurements, everything, names)
    chosen, held = select_parameters(J, names, len(measurements))
    if chosen == names:  # every free parameter is identified: the first fit is the fit
        params, res = everything, _log_ratios(system, everything, measurements)
    else:  # the chosen ones from where the first fit put them, and from the previous values; the better one
        warm = {**start, **{n: everything[n] for n in chosen}}
        params, res = min((_least_squares(system, measurements, chosen, s0, shifts=(0.0,)) for s0 in (warm, start)),
                          key=lambda r: float(np.sum(r[1] ** 2)))
    return Calibration(system=apply_parameters(system, params), parameters=params, fitted=chosen, held=held,
                       fixed=sorted(fixed), sensitivity={n: J[:, i].tolist() for i, n in enumerate(names)},
                       residuals=res.tolist())


def fit(system: System, measurements: list[Measurement], fixed: dict[str, float] | None = None) -> tuple[System, dict]:
    """`calibrate` as (fitted system, report dict) for scripts."""
    cal = calibrate(system, measurements, fixed)
    return cal.system, {"parameters": cal.parameters, "fitted": cal.fitted, "held": cal.held, "fixed": cal.fixed,
                        "rms_log_error": float(np.sqrt(np.mean(np.square(cal.residuals))))}


def leave_one_out(system: System, measurements: list[Measurement], cal: Calibration) -> list[dict]:
    """Each run predicted by a fit of the same parameters on the other runs (started from the full fit's
    values, one start: the neighbourhood is known). Empty with one run: nothing is left to check against."""
    if len(measurements) < 2:
        return []
    _, fixed = _free_and_fixed(system, None)
    start = {**current_parameters(system), **fixed}
    warm = {**start, **{n: cal.parameters[n] for n in cal.fitted}}
    rows = []
    for i, m in enumerate(measurements):
        others = measurements[:i] + measurements[i + 1:]
        params, _ = _least_squares(system, others, cal.fitted, warm, shifts=(0.0,))
        pred = predict(apply_parameters(system, params), m).step_time_s
        rows.append({"run": m.name, "layout": m.layout, "world_size": m.world_size, "measured_s": m.step_time_s,
                     "predicted_s": pred, "error": pred / m.step_time_s - 1})
    return rows


def candidate_layouts(system: System, like: Measurement, max_world: int | None = None) -> list[Measurement]:
    """Layouts the runtime runs for `like`'s model, sequence and batch on 1, 2, 4, ... ranks of this machine
    (up to the hardware entry's ranks per node): every tp x pp x dp with DDP or FSDP, the run's microbatch
    (or the largest that divides the per-rank batch), each valid for the planner."""
    from paratrain.plan.api import _divisors
    from paratrain.plan.config_writer import layout_name

    top = max_world or max(system.devices_per_node, like.world_size)
    mb0 = int(like.layout.get("microbatch", 1))
    out = []
    world = 1
    while world <= top:
        for tp in _divisors(world):
            for pp in _divisors(world // tp):
                dp = world // (tp * pp)
                if like.global_batch % dp:
                    continue
                per_rank = like.global_batch // dp
                mb = max(d for d in _divisors(per_rank) if d <= mb0)
                for kind in (("ddp", "fsdp") if dp > 1 else ("ddp",)):
                    layout = {"tp": tp, "pp": pp, "dp": dp, "cp": 1, "sp": False, "microbatch": mb,
                              "recompute": "none", "pp_schedule": "1f1b", "virtual_stages": 1, "dp_kind": kind,
                              "zero_stage": 0 if kind == "ddp" else 3, "pp_layers": None}
                    m = Measurement(like.model, like.seq, like.global_batch, layout, world, 1.0,
                                    name=layout_name(layout), options=like.options)
                    try:
                        predict(system, m)
                    except ValueError:  # the planner's own layout rules (tp vs heads, pp vs layers, ...)
                        continue
                    out.append(m)
        world *= 2
    return out


def _same_run(a: Measurement, b: Measurement) -> bool:
    keys = ("tp", "pp", "dp", "cp", "sp", "microbatch", "dp_kind")
    return a.world_size == b.world_size and all(a.layout.get(k) == b.layout.get(k) for k in keys[:4]) and \
        all(str(a.layout.get(k)) == str(b.layout.get(k)) for k in keys[4:])


def suggest_runs(system: System, measurements: list[Measurement], cal: Calibration, count: int = 3,
                 max_world: int | None = None) -> list[dict]:
    """The next runs that best separate the parameters: greedily, the candidate layout that most raises the
    number of identified parameters, then (a tie) the smallest singular value of the runs' sensitivity
    matrix (the direction the runs constrain least). Sensitivities at the current fit."""
    names, _ = _free_and_fixed(system, None)
    J = sensitivity(system, measurements, cal.parameters, names)
    pool = [c for c in candidate_layouts(system, measurements[-1], max_world)
            if not any(_same_run(c, m) for m in measurements)]
    rows = {id(c): sensitivity(system, [c], cal.parameters, names) for c in pool}
    out = []
    runs = len(measurements)
    for _ in range(count):
        best, best_key = None, None
        for c in pool:
            stacked = np.vstack([J, rows[id(c)]])
            chosen, _ = select_parameters(stacked, names, runs + 1)
            key = (len(chosen), float(np.linalg.svd(stacked[:, [names.index(n) for n in chosen]],
                                                    compute_uv=False).min()) if chosen else 0.0)
            if best_key is None or key > best_key:
                best, best_key = c, key
        if best is None:
            break
        J = np.vstack([J, rows[id(best)]])
        runs += 1
        pool.remove(best)
        out.append({"name": best.name, "world_size": best.world_size, "layout": best.layout,
                    "identified_after": best_key[0]})
    return out


def mape(system: System, measurements: list[Measurement]) -> tuple[float, list[dict]]:
    rows = []
    for m in measurements:
        pred = predict(system, m).step_time_s
        rows.append({"run": m.name, "layout": m.layout, "world_size": m.world_size, "measured_s": m.step_time_s,
                     "predicted_s": pred, "error": pred / m.step_time_s - 1})
    return float(np.mean([abs(r["error"]) for r in rows])), rows


def write_back(hardware_file: str | Path, system_name: str, params: dict[str, float], note: str,
               out: str | Path | None = None, header: str = "") -> Path:
    """The hardware TOML with the efficiency values of `system_name` (its chip, links and system tables)
    replaced, written to `out` (default: the input file itself)."""
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
        if link.get("ll128_latency_us"):
            link["ll128_latency_us"] = link["ll128_latency_us"] * params["link_latency_scale"]
        link["collective_overhead_us"] = params["collective_overhead_s"] * 1e6
        link["source"] = link.get("source", "") + f"; {note}"
        link["_calibrated"] = True
    for link in doc.get("interconnects", {}).values():
        link.pop("_calibrated", None)
    eff = sysd.setdefault("efficiency", {"tp_overlap": 0.0, "memory_usable_fraction": 0.9})
    eff["dp_overlap"] = params["dp_overlap"]
    eff["source"] = note
    target = Path(out) if out is not None else path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(header + tomli_w.dumps(doc))
    return target
