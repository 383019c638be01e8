"""`paratrain calibrate` on `paratrain generate` summaries: the serving model's efficiency on this machine.

A generate summary (`paratrain generate --summary-json`, "kind": "generate") gives two measurements
(plan.serve_fit.measurements_from_generate): the prefill of its padded batch (TTFT) and its mean decode step
(TPOT) at that batch and context. The serving model's five parameters (plan/serving_efficiency.toml) are
fitted to them with the same rules as the training fit (calibrate/fit.py): only the parameters the runs
identify (the sensitivity of each measurement's log time to one meaningful step of each parameter, and the
column-pivoted QR of calibrate.fit.select_parameters; at most one fewer than the measurements), the rest held
with the reason, and the error reported leave-one-out: each generate run (both its measurements) predicted by
a fit of the same parameters on the other runs. The result is the [systems.X.serving] table of the new
hardware file, which plan.serve.serving_efficiency reads for that system. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

from paratrain.calibrate.fit import select_parameters
from paratrain.hardware.catalog import System
from paratrain.plan.serve import EFFICIENCY_FIELDS, ServingEfficiency, serving_efficiency
from paratrain.plan.serve_fit import fit, measurements_from_generate, predict

# what a generate summary must hold for calibration (what infer.session.generation_summary writes)
GENERATE_KEYS = ("model_shape", "tp", "batch", "padded_prompt_tokens", "prefill_s", "decode_steps",
                 "decode_s_per_step")
# One "meaningful step" of each parameter (as calibrate.fit.STEP): +-0.1 of a fraction, x1.25 of a fixed cost
# (from at least TIME_FLOOR, so that a cost now at 0 still has a step)
FRACTIONS = ("decode_bw_eff", "kv_bw_eff", "prefill_flops_eff")
TIME_FLOOR = {"layer_overhead_s": 1e-6, "collective_us": 1.0, "host_step_s": 1e-5}
# The search box for a machine's own runs. plan.serve_fit.BOUNDS is the box of production serving stacks
# (CUDA graphs, fused kernels: tens of us per layer); paratrain's runtime is eager PyTorch, where one layer's
# forward is ~15 dispatched ops of 10-100 us each on a CPU host (more when ranks share cores), and small
# matmuls reach a few % of the probe's peak: the same physics, a wider physical range.
RUNTIME_BOUNDS = {"decode_bw_eff": (0.005, 1.0), "kv_bw_eff": (0.005, 1.0), "prefill_flops_eff": (0.005, 1.0),
                  "layer_overhead_s": (0.0, 0.05), "collective_us": (0.0, 1e4)}


def is_generate_summary(data: dict) -> bool:
    return isinstance(data, dict) and data.get("kind") == "generate"


def split_summaries(paths) -> tuple[list[str], list[tuple[str, dict]]]:
    """The training summaries (their paths, for calibrate.fit.load_measurements) and the generate summaries
    ((name, data)) among `paths`, told apart by the summary's "kind"."""
    from paratrain.calibrate.fit import read_summary

    training, generating = [], []
    for p in paths:
        path, data = read_summary(p)
        if is_generate_summary(data):
            generating.append((path.stem, data))
        elif isinstance(data, dict) and data.get("kind", "train") != "train":
            raise ValueError(f"run summary '{p}': kind = {data['kind']!r}: allowed: a paratrain train summary "
                             f"or a paratrain generate one (kind = 'generate')")
        else:
            training.append(str(path))
    return training, generating


def serving_report_lines(rep: dict) -> list[str]:
    """The serving fit as `paratrain calibrate` prints it."""
    lines = [f"serving model: {rep['runs']} generate run(s), {rep['measurements']} measurements (prefill, "
             f"decode step): fitted {len(rep['fitted'])} of {len(EFFICIENCY_FIELDS) - len(rep['fixed'])} free parameters"]
    for k in rep["fitted"]:
        share = max(abs(v) for v in rep["sensitivity_per_step"][k])
        lines.append(f"  fitted {k:>22} = {rep['parameters'][k]:.4g}   (was {rep['start'][k]:.4g}; up to "
                     f"{share:.0%} of a measured time per step)")
    for k, why in rep["held"].items():
        lines.append(f"  held   {k:>22} = {rep['parameters'][k]:.4g}   {why}")
    for k in rep["fixed"]:
        lines.append(f"  fixed  {k:>22} = {rep['parameters'][k]:.4g}   the memory bandwidth the probe measured")
    for r in rep["leave_one_out_rows"]:
        lines.append(f"  [left out] {r['run']:<20} {r['kind']:>4} measured {r['measured_ms']:8.2f} ms  predicted "
                     f"{r['predicted_ms']:8.2f} ms  error {r['error']:+.1%}")
    if rep["mape_leave_one_out"] is None:
        lines.append(f"  error: {rep['mape_before']:.1%} before; leave-one-out needs 2 or more generate runs "
                     f"(on the fitted runs {rep['mape_fitted_runs']:.1%}, which checks nothing)")
    else:
        lines.append(f"  error: {rep['mape_before']:.1%} before; leave-one-out MAPE {rep['mape_leave_one_out']:.1%} "
                     f"over {rep['runs']} runs (on the fitted runs themselves {rep['mape_fitted_runs']:.1%})")
    return lines


def generate_rows(data: dict, name: str, system: System) -> list[dict]:
    """The TTFT and TPOT measurements of one generate summary, each tagged with the run's name; one clear
    error for a summary calibration cannot use."""
    missing = [k for k in GENERATE_KEYS if k not in data]
    if missing:
        raise ValueError(f"generate summary '{name}': missing '{missing[0]}' (write it with paratrain generate "
                         f"--summary-json)")
    for key in ("prefill_s", "decode_s_per_step"):
        value = data[key]
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0) and \
                not (key == "decode_s_per_step" and data["decode_steps"] == 0):
            raise ValueError(f"generate summary '{name}': {key} = {value!r}: must be a measured time > 0")
    try:
        rows = measurements_from_generate(data, system)
    except (TypeError, ValueError) as exc:
        if hasattr(exc, "errors"):  # pydantic's ModelConfig validation: its first error, one line
            first = exc.errors()[0]
            exc = f"model_shape.{'.'.join(map(str, first['loc']))}: {first['msg']}"
        raise ValueError(f"generate summary '{name}': {exc}") from None
    return [{**r, "run": name, "id": f"{name}:{r['kind']}"} for r in rows]


def _step(eff: ServingEfficiency, name: str, sign: float = 1.0) -> ServingEfficiency:
    value = getattr(eff, name)
    if name in FRACTIONS:
        return replace(eff, **{name: value + sign * 0.1})
    return replace(eff, **{name: max(value, TIME_FLOOR[name]) * 1.25 ** sign})


def sensitivity(rows: list[dict], eff: ServingEfficiency, names: list[str],
                bounds: dict = RUNTIME_BOUNDS) -> np.ndarray:
    """measurements x names: change of each measurement's log time for one step of each parameter
    (a step down for a fraction that a step up would carry past its upper bound in `bounds`)."""
    base = np.log([predict(r, eff) for r in rows])
    cols = []
    for name in names:
        sign = -1.0 if name in FRACTIONS and getattr(eff, name) + 0.1 > bounds[name][1] else 1.0
        moved = np.log([predict(r, _step(eff, name, sign)) for r in rows])
        cols.append((moved - base) * sign)  # per step up
    return np.stack(cols, axis=1)


@dataclass
class ServingCalibration:
    efficiency: ServingEfficiency  # fitted where identified, the rest at their previous values
    start: ServingEfficiency
    fitted: list[str]
    held: dict[str, str]
    fixed: list[str]  # measured by the probe, not fitted
    sensitivity: dict[str, list[float]]
    rows: list[dict]  # per measurement: run, kind, measured_ms, before_ms, fitted_ms
    leave_one_out: list[dict]

    def report(self) -> dict:
        loo = self.leave_one_out
        return {"runs": len({r["run"] for r in self.rows}), "measurements": len(self.rows),
                "fitted": self.fitted, "held": self.held, "fixed": self.fixed,
                "parameters": {n: getattr(self.efficiency, n) for n in EFFICIENCY_FIELDS},
                "start": {n: getattr(self.start, n) for n in EFFICIENCY_FIELDS}, "start_source": self.start.source,
                "sensitivity_per_step": self.sensitivity,
                "mape_before": _mape(self.rows, "before_ms"), "mape_fitted_runs": _mape(self.rows, "fitted_ms"),
                "mape_leave_one_out": _mape(loo, "predicted_ms") if loo else None,
                "rows": self.rows, "leave_one_out_rows": loo}


def _mape(rows: list[dict], key: str) -> float:
    return float(np.mean([abs(r[key] / r["measured_ms"] - 1) for r in rows]))


def calibrate_serving(system: System, rows: list[dict]) -> ServingCalibration:
    """Fit the identified serving parameters to the measurements (from the system's current serving table)."""
    start, fixed = _start(system)
    names = [n for n in EFFICIENCY_FIELDS if n not in fixed]
    J, chosen, held = identify(rows, start, names, RUNTIME_BOUNDS)
    eff = fit(rows, start, free=tuple(chosen), bounds=RUNTIME_BOUNDS) if chosen else start
    note = ", ".join(chosen) or "nothing"
    eff = replace(eff, source=f"`paratrain calibrate` on {len({r['run'] for r in rows})} paratrain generate run(s) "
                              f"on this machine: fitted {note}; held at the previous values ({start.source}): "
                              f"{', '.join(held) or 'none'}")
    table = [{"run": r["run"], "kind": r["kind"], "batch": r["batch"], "prompt": r["prompt"], "output": r["output"],
              "measured_ms": r["value"], "before_ms": predict(r, start), "fitted_ms": predict(r, eff)} for r in rows]
    return ServingCalibration(eff, start, chosen, held, fixed, {n: J[:, i].tolist() for i, n in enumerate(names)},
                              table, _leave_one_out(rows, start, chosen))


def identify(rows: list[dict], start: ServingEfficiency, names: list[str],
             bounds: dict) -> tuple[np.ndarray, list[str], dict[str, str]]:
    """The parameters among `names` that the measurements identify, and why each other one is held: the
    sensitivities at a first fit of every name (where the rows point, from `start`), as calibrate.fit does,
    then calibrate.fit.select_parameters (at most one fewer than the measurements). The one rule for the
    serving model, for a machine's own runs (calibrate_serving) and for the published serving tables
    (benchmarks/serving_accuracy.py --calibrate)."""
    first = fit(rows, start, free=tuple(names), bounds=bounds)
    J = sensitivity(rows, first, names, bounds)
    chosen, held = select_parameters(J, names, len(rows))
    return J, chosen, held


def _start(system: System) -> tuple[ServingEfficiency, list[str]]:
    """The values the fit starts from (the system's serving table now) and the parameters it keeps fixed: on
    a machine `paratrain probe` measured (chip status "measured"), the memory bandwidth is measured, not
    fitted (the rule calibrate.fit applies to memory_bw_eff): weights and KV cache stream at the probe's
    bandwidth, and what a decode step takes beyond that is per-layer cost. Fitting both would trade one for
    the other on runs of one model (its weight bytes are the same in every run)."""
    start = serving_efficiency(system)
    if system.chip.status != "measured":
        return start, []
    bw = system.chip.efficiency.memory_bw_eff
    return replace(start, decode_bw_eff=bw, kv_bw_eff=bw), ["decode_bw_eff", "kv_bw_eff"]


def _leave_one_out(rows: list[dict], start: ServingEfficiency, chosen: list[str]) -> list[dict]:
    """Each run's measurements predicted by a fit of the chosen parameters on the other runs' measurements.
    Repeats of one batch and prompt length are left out together: a repeat is no check of its twin."""
    out = leave_one_out(rows, start, chosen, RUNTIME_BOUNDS, key=lambda r: (r["batch"], r["prompt"]))
    return [{"run": r["run"], "kind": r["kind"], "measured_ms": r["value"], "predicted_ms": p,
             "error": p / r["value"] - 1} for r, p in out]


def leave_one_out(rows: list[dict], start: ServingEfficiency, chosen: list[str], bounds: dict,
                  key, reselect: bool = False) -> list[tuple[dict, float]]:
    """(row, prediction) for every row, each group of rows (rows with one `key`) predicted by a fit of the
    chosen parameters on the other groups, from `start` (never from the full fit, which saw the group).
    `reselect`: each fold fits only what its own rows identify (identify on the other groups), so that a
    parameter only the left-out group pinned stays at start instead of wandering. Empty when there are fewer
    than 2 groups or nothing is fitted."""
    groups = list(dict.fromkeys(key(r) for r in rows))
    if len(groups) < 2 or not chosen:
        return []
    out = []
    for group in groups:
        others = [r for r in rows if key(r) != group]
        free = identify(others, start, chosen, bounds)[1] if reselect else chosen
        left_out = fit(others, start, free=tuple(free), bounds=bounds) if free else start
        out += [(r, predict(r, left_out)) for r in rows if key(r) == group]
    return out


def serving_table(eff: ServingEfficiency) -> dict:
    """The [systems.X.serving] table (hardware.catalog.SERVING_FIELDS) of a fitted efficiency."""
    return {k: v for k, v in asdict(eff).items()}


def write_serving(hardware_file, system_name: str, eff: ServingEfficiency, out, header: str = ""):
    """`hardware_file` with [systems.<system_name>.serving] set to `eff`, written to `out`."""
    import tomllib
    from pathlib import Path

    import tomli_w

    doc = tomllib.loads(Path(hardware_file).read_text())
    systems = doc.get("systems", {})
    if system_name not in systems:
        raise ValueError(f"hardware file '{hardware_file}': has no [systems.{system_name}] to calibrate")
    systems[system_name]["serving"] = serving_table(eff)
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(header + tomli_w.dumps(doc))
    return target
