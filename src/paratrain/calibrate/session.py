"""One `paratrain calibrate` session: fit the planner (and the serving model) to measured runs, check the fit
leave-one-out, propose the runs that would identify more, write the calibrated hardware file; and the text
report of it and of `paratrain probe`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from paratrain.calibrate.serving import serving_report_lines
from paratrain.config.options import described


@dataclass(kw_only=True)
class Calibration:
    """What one session takes; each field's metadata is its `paratrain calibrate` option (help, bounds)."""
    runs: list[str] = described("run summaries: JSON from paratrain train --summary-json (the planner's parameters) "
                                "and/or paratrain generate --summary-json (the serving model's, into "
                                "[systems.X.serving])", factory=list, positional=True, nargs="+")
    hardware: str = described("hardware TOML file holding the system to calibrate", required=True, metavar="FILE")
    system: str = described("system name inside that file", "local")
    out: str | None = described("hardware TOML to write (default: <hardware>.calibrated.toml beside it)", None,
                                metavar="FILE", writes="file")
    in_place: bool = described("rewrite the --hardware file itself", False)
    holdout: float = described("fraction of runs kept out of the fit and only predicted (every other run), in [0, 1)",
                               0.0, ge=0, lt=1)
    suggest: int | None = described("list the next N runs (default 3) that best separate the parameters, each with its "
                                    "config (<runs folder>/next/<layout>.toml); writes no hardware file", None,
                                    nargs="?", const=3, metavar="N", ge=1)
    dry_run: bool = described("fit and report, do not write a file", False)


def calibrated_path(hardware: str, out: str | None, in_place: bool) -> Path:
    """Where the calibrated file goes: never over the input unless --in-place."""
    src = Path(hardware)
    if in_place:
        if out:
            raise ValueError("--in-place and --out: give one (--in-place rewrites --hardware itself)")
        return src
    target = Path(out) if out else src.with_name(src.stem.removesuffix(".calibrated") + ".calibrated.toml")
    if target.resolve() == src.resolve():
        raise ValueError(f"--out '{target}' is the --hardware file itself; allowed: another path, or --in-place "
                        f"to rewrite it")
    return target


def run_calibration(args: Calibration) -> dict:
    """One `paratrain calibrate` session: fit, check leave-one-out, propose runs, write the file."""
    from paratrain.calibrate.fit import (
        calibrate,
        leave_one_out,
        load_measurements,
        mape,
        suggest_runs,
        write_back,
    )
    from paratrain.calibrate.serving import split_summaries, write_serving
    target = calibrated_path(args.hardware, args.out, args.in_place)
    train_paths, generate_runs = split_summaries(args.runs)
    system = _system_from_file(args.hardware, args.system)
    serving = calibrate_generate(system, generate_runs)
    if not train_paths:
        return _serving_only(args, target, serving)
    runs = load_measurements(train_paths)
    step = round(1 / args.holdout) if args.holdout else 0
    test = [m for i, m in enumerate(runs) if step and i % step == 1]
    train = [m for m in runs if m not in test]
    if not train:
        raise ValueError("calibrate: no runs left to fit after the holdout")
    before, _ = mape(system, train)
    cal = calibrate(system, train)
    fit_error, rows = mape(cal.system, train)
    loo = leave_one_out(system, train, cal)
    wanted = args.suggest or len(cal.held)
    suggestions = suggest_runs(system, train, cal, count=max(wanted, 1)) if cal.held or args.suggest else []
    if args.suggest is None:  # only as many as it takes to identify the most the candidates can
        reach = max((s["identified_after"] for s in suggestions), default=len(cal.fitted))
        suggestions = suggestions[:next((i + 1 for i, s in enumerate(suggestions) if s["identified_after"] == reach),
                                        len(suggestions))]
        if reach <= len(cal.fitted):
            suggestions = []
    out = {"hardware": args.hardware, "system": args.system, "runs": len(train), "fitted": cal.fitted,
           "held": cal.held, "fixed": cal.fixed, "parameters": cal.parameters,
           "sensitivity_per_step": cal.sensitivity, "mape_before": before,
           "mape_fitted_runs": fit_error, "fit_rows": rows,
           "mape_leave_one_out": (sum(abs(r["error"]) for r in loo) / len(loo)) if loo else None,
           "leave_one_out_rows": loo,
           "suggested_runs": []}
    if serving is not None:
        out["serving"] = serving.report()
    runs_dir = Path(train_paths[-1]).parent
    for sug in suggestions:
        config = suggestion_config(sug, train[-1], runs_dir)
        out["suggested_runs"].append({**sug, "config": str(config) if config else None,
                                      "command": suggestion_command(sug, config)})
    if test:
        out["mape_holdout"], out["holdout_rows"] = mape(cal.system, test)
    write = not args.dry_run and args.suggest is None
    if write:
        note = (f"calibrated by `paratrain calibrate` on {len(train)} run(s): fitted {', '.join(cal.fitted)}"
                + (f"; leave-one-out MAPE {out['mape_leave_one_out']:.1%}" if loo else "; no leave-one-out check "
                   "(one run)"))
        header = f"# {note}\n# from {args.hardware}; held: {', '.join(cal.held) or 'none'}\n"
        out["written"] = str(write_back(args.hardware, args.system, cal.parameters, note, out=target, header=header))
        if serving is not None:  # the serving model's table, into the file just written
            write_serving(target, args.system, serving.efficiency, target,
                          header=header + f"# serving: {serving.efficiency.source}\n")
    return out


def calibrate_generate(system, generate_runs: list[tuple[str, dict]]):
    """The serving model fitted to the `paratrain generate` summaries among the runs (None without any)."""
    from paratrain.calibrate.serving import calibrate_serving, generate_rows

    if not generate_runs:
        return None
    rows = [r for name, data in generate_runs for r in generate_rows(data, name, system)]
    return calibrate_serving(system, rows)


def _serving_only(args, target: Path, serving) -> dict:
    """calibrate with generate summaries only: the serving table written, the training parameters as they were."""
    from paratrain.calibrate.serving import write_serving

    if args.suggest is not None:
        raise ValueError("--suggest proposes training runs: give at least one paratrain train summary")
    out = {"hardware": args.hardware, "system": args.system, "serving": serving.report()}
    if not args.dry_run:
        header = (f"# serving model calibrated by `paratrain calibrate` from {args.hardware}: "
                  f"{serving.efficiency.source}\n")
        out["written"] = str(write_serving(args.hardware, args.system, serving.efficiency, target, header=header))
    return out


def suggestion_config(s: dict, like, runs_dir: Path) -> Path | None:
    """The measured run's own config (<run_dir>/config.toml) with the suggested layout, a fresh run dir and
    no leftover layout keys (zero_stage, pp_layers, ...), as runs/next/<layout>.toml; None when the run left
    no config to start from or the result does not validate."""
    import tomllib

    import tomli_w

    from paratrain.config import load_config
    from paratrain.plan.config_writer import fresh_run_dir

    src = Path(like.run_dir) / "config.toml" if like.run_dir else None
    if src is None or not src.is_file():
        return None
    doc = tomllib.loads(src.read_text())
    lay = s["layout"]
    par = doc.setdefault("parallel", {})
    for key in ("zero_stage", "pp_layers", "dp_replicate", "reshard_after_forward"):
        par.pop(key, None)
    par.update(tp=lay["tp"], pp=lay["pp"], cp=lay["cp"], dp=lay["dp"], dp_kind=lay["dp_kind"], sp=bool(lay["sp"]),
               recompute=lay["recompute"], pp_schedule=lay["pp_schedule"], virtual_stages=lay["virtual_stages"])
    doc.setdefault("train", {})["microbatch"] = lay["microbatch"]
    metrics = doc.setdefault("metrics", {})
    metrics["run_dir"] = fresh_run_dir(s["name"], Path(metrics.get("run_dir", "runs/x")).parent)
    doc.setdefault("checkpoint", {})["dir"] = ""  # under the new run dir
    out = runs_dir / "next" / f"{s['name']}.toml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# suggested by `paratrain calibrate`: {s['name']} on {s['world_size']} rank(s), from {src}\n"
                   + tomli_w.dumps(doc))
    try:
        load_config(out, [])
    except ValueError:
        out.unlink()
        return None
    return out


def suggestion_command(s: dict, config: Path | None) -> str:
    """The command that runs a suggested layout."""
    launch = "paratrain train" if s["world_size"] == 1 else f"torchrun --nproc-per-node {s['world_size']} -m paratrain train"
    summary = (config.parent.parent if config else Path("runs")) / f"{s['name']}.json"
    if config is None:
        lay = s["layout"]
        return (f"{launch} --config YOUR_CONFIG.toml --set parallel.tp={lay['tp']} --set parallel.pp={lay['pp']} "
                f"--set parallel.dp={lay['dp']} --set parallel.dp_kind={lay['dp_kind']} "
                f"--set train.microbatch={lay['microbatch']} --summary-json {summary}")
    return f"{launch} --config {config} --summary-json {summary}"


def print_calibration(out: dict) -> None:
    if "runs" not in out:  # generate summaries only: the serving table
        print(f"calibrated {out['system']} of {out['hardware']}")
        print("\n".join(serving_report_lines(out["serving"])))
        print_written(out)
        return
    n = out["runs"]
    print(f"calibrated {out['system']} of {out['hardware']} on {n} run(s): fitted {len(out['fitted'])} of "
          f"{len(out['fitted']) + len(out['held'])} free parameters")
    for k in out["fitted"]:
        share = max(abs(v) for v in out["sensitivity_per_step"][k])
        print(f"  fitted {k:>22} = {out['parameters'][k]:.4g}   (up to {share:.0%} of a run's step time per step)")
    for k, why in out["held"].items():
        print(f"  held   {k:>22} = {out['parameters'][k]:.4g}   {why}")
    for k in out["fixed"]:
        print(f"  fixed  {k:>22} = {out['parameters'][k]:.4g}   measured by the probe")
    for r in out["leave_one_out_rows"]:
        print(f"  [left out] {r['run']:<28} measured {r['measured_s'] * 1e3:8.1f} ms  predicted "
              f"{r['predicted_s'] * 1e3:8.1f} ms  error {r['error']:+.1%}")
    if out["mape_leave_one_out"] is None:
        print(f"error: {out['mape_before']:.1%} before; leave-one-out needs 2 or more runs (a run fitted by "
              f"its own parameter matches itself, {out['mape_fitted_runs']:.1%}, which checks nothing)")
    else:
        print(f"error: {out['mape_before']:.1%} before; leave-one-out MAPE {out['mape_leave_one_out']:.1%} over "
              f"{n} runs (on the fitted runs themselves {out['mape_fitted_runs']:.1%})")
    for r in out.get("holdout_rows", []):
        print(f"  [held out] {r['run']:<28} measured {r['measured_s'] * 1e3:8.1f} ms  predicted "
              f"{r['predicted_s'] * 1e3:8.1f} ms  error {r['error']:+.1%}")
    if out.get("holdout_rows"):
        print(f"held-out MAPE {out['mape_holdout']:.1%} on {len(out['holdout_rows'])} runs")
    if out.get("serving"):
        print("\n".join(serving_report_lines(out["serving"])))
    print_written(out)
    sugg = out["suggested_runs"]
    if sugg:
        print(f"{len(sugg)} more run(s) would identify {sugg[-1]['identified_after']} parameters "
              f"(now {len(out['fitted'])}); next:")
        for s in sugg:
            print(f"  {s['command']}")
    elif out["held"]:
        print("no run of another layout on this machine would identify more parameters")


def print_written(out: dict) -> None:
    if out.get("written"):
        same = out["written"] == out["hardware"]
        print(f"wrote {out['written']}" + ("" if same else f" ({out['hardware']} unchanged; --in-place rewrites it)"))


def _system_from_file(path: str, name: str):
    from pathlib import Path

    from paratrain.hardware.catalog import CatalogError, load_catalog

    if not Path(path).is_file():
        raise ValueError(f"--hardware '{path}': no such file")
    try:
        return load_catalog([Path(path)]).system(name)
    except CatalogError as exc:
        raise ValueError(str(exc)) from None


def print_probe(res, out: Path) -> None:
    """What `paratrain probe` measured, and where it wrote the hardware file."""
    print(f"peak matmul {res.peak_tflops * 1e3:,.1f} GFLOP/s per rank, memory {res.memory_bw_gbytes_per_s:.1f} GB/s")
    for kind, fit in res.fits.items():
        print(f"{kind:>15}: latency {fit['latency_us']:.0f} us, bandwidth {fit['bw_gbytes_per_s']:.2f} GB/s")
    if (link := res.link_fit):
        print(f"planner's link model (all collectives, {link['points']} points, MAPE {link['mape']:.0%}): "
              f"{link['latency_us']:.0f} us per ring step, +{link['timeshare_step_us']:.0f} us per step for "
              f"each further rank sharing a core ({link['cores']} cores), {link['bw_gbytes_per_s']:.2f} GB/s")
    print(f"wrote {out}")
