"""The serving model (plan/serve.py) against published serving measurements.

Data: benchmarks/serving_measurements.csv, every row with its source and software. Rows are split by
name into `calibration` (the only rows `--calibrate` may fit the efficiency parameters on) and `evaluation`
(never used to set anything; tests/test_plan_serve.py requires them within 20%).

Row kinds and what is predicted (plan/serve_fit.py, which also holds the fit):
  ttft               prefill of `batch` prompts of `prompt` tokens (time to first token), ms
  tpot               one decode step at `batch` sequences holding prompt + output/2 tokens, ms
  static_throughput  output tokens/s per device of a static batch: batch x output / (prefill of the batch +
                     output decode steps) / tp (TensorRT-LLM gptSessionBenchmark)
  e2e                end-to-end latency of a static batch: prefill + (output - 1) decode steps, ms (vLLM)
  itl_concurrency    mean ITL of `batch` concurrent requests in a closed loop (continuous batching), ms (NIM)

    python benchmarks/serving_accuracy.py              # the table: every row, prediction, error
    python benchmarks/serving_accuracy.py --calibrate  # fit on calibration rows, rewrite serving_efficiency.toml
        (per stack only what its rows identify, the rest held: printed with the fit's and the leave-one-out MAPE)
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import fields, replace
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from paratrain.calibrate.serving import identify, leave_one_out  # noqa: E402
from paratrain.hardware.catalog import resolve_system  # noqa: E402
from paratrain.plan.serve import (  # noqa: E402
    EFFICIENCY_FIELDS,
    EFFICIENCY_FILE,
    HOST_FIELDS,
    ServingEfficiency,
    efficiency_tables,
    load_serving_model,
    serving_efficiency,
)
from paratrain.plan.serve_fit import BOUNDS, errors, fit, loss  # noqa: E402

DATA = ROOT / "benchmarks" / "serving_measurements.csv"
INT_FIELDS = ("tp", "batch", "prompt", "output")
# the buckets a static-shape engine was configured with, where the row's source states them (NxD Inference
# tutorials: --context-encoding-buckets / --token-generation-buckets)
BUCKET_FIELDS = ("prefill_bucket", "decode_bucket")
# Which parameters a stack's calibration rows may fit, and where the others come from. Every stack fits only
# what its rows identify (calibrate.serving.identify: the sensitivity of each row to one step of each candidate
# and calibrate.fit.select_parameters, the rule `paratrain calibrate` applies to a machine's own runs); the
# rest are held: at the parent table's values where a stack names a parent (the same chips and, for that
# parameter, the same physics), else at PRIORS, else at the table's previous value.
# nvidia (NIM / TensorRT-LLM / vLLM of 2024-2025) has 3 calibration rows: what they leave unidentified comes
#   from nvidia-trtllm-2023 (the same GPUs and TensorRT-LLM's decode attention kernel and custom all-reduce,
#   fitted there on 13 rows), except the per-layer cost (PRIORS).
# aws (NxD Inference) runs on the same chips and collectives library as transformers-neuronx but with fused
#   attention/MLP kernels, so its 2 trn2 rows may refit the prefill rate only.
# vllm-2024 (the 2024 nightly, V0 engine) runs the same CUDA kernels as the `nvidia` table's engines on the same
#   GPUs but waits for its Python engine loop every step and runs its own custom all-reduce: its rows may fit
#   those two (8B at TP 1 pins the host time, 70B at TP 4 and Mixtral at TP 2 the per-call all-reduce cost).
INHERITS = {"nvidia": ("nvidia-trtllm-2023", EFFICIENCY_FIELDS),
            "aws": ("aws-tnx-2024", ("prefill_flops_eff",)),
            "vllm-2024": ("nvidia", ("host_step_s", "collective_us"))}
# Held values with a physical reason, where the parent's value is the wrong physics for the stack.
PRIORS = {"nvidia": {"layer_overhead_s": (0.0, "today's engines replay each decode step as one CUDA graph (NIM's "
                                          "TensorRT-LLM, vLLM): no per-kernel launch left to pay per layer, unlike "
                                          "nvidia-trtllm-2023's 121 us (TensorRT-LLM v0.5-0.6)")}}
# Facts about each stack's software, not fitted (plan/serve.py ServingEfficiency):
# attention: NxD Inference runs its fused attention kernel (--attn-kernel-enabled in the tutorials' configs),
#   TensorRT-LLM and vLLM fused (flash) attention; transformers-neuronx 2.18 has no flash attention kernel below
#   8k tokens (its developer guide: "automatically used when the input sequence length is greater than 8k",
#   a later release), so unfused.
# head_layout / buckets: transformers-neuronx pads query heads to a multiple of tp and replicates K/V when tp
#   does not divide the kv heads (decoder.py), and compiles static shapes: prompts pad to power-of-two context
#   buckets, decode attends over the whole power-of-two token bucket (bucket.py; developer guide "Bucketing").
#   vLLM / TensorRT-LLM / NxD Inference: heads split evenly, paged KV read to the tokens held.
FACT_FIELDS = ("attention", "head_layout", "buckets", "gqa_decode")
STACK_FACTS = {
    "nvidia": {"attention": "flash", "head_layout": "shard", "buckets": False},
    "vllm-2024": {"attention": "flash", "head_layout": "shard", "buckets": False},
    "nvidia-trtllm-2023": {"attention": "flash", "head_layout": "shard", "buckets": False,
                           "gqa_decode": "per_query_head"},
    "aws": {"attention": "flash", "head_layout": "shard", "buckets": False},
    "aws-tnx-2024": {"attention": "unfused", "head_layout": "pad", "buckets": True},
}


def load_rows(path: Path = DATA) -> list[dict]:
    with path.open() as fh:
        rows = list(csv.DictReader(fh))
    for row in rows:
        for key in INT_FIELDS:
            row[key] = int(row[key])
        for key in BUCKET_FIELDS:  # blank: the stack's own rule (plan/serve_fit.py predict)
            row[key] = int(row[key]) if row.get(key) else None
        row["value"] = float(row["value"])
        model = row["model"]
        row["model_config"] = load_serving_model(ROOT / model if model.endswith(".toml") else model)
        row["system"] = resolve_system(row["hardware"])
    return rows


def family(row: dict) -> str:
    """The serving stack a row ran under: its efficiency table."""
    return row["stack"]


def benchmark_run(row: dict) -> tuple:
    """The benchmark run a row comes from: a run's TTFT and TPOT are left out together (one is no check of
    the other)."""
    return tuple(row[k] for k in ("stack", "model", "hardware", "tp", "weights", "kv", "batch", "prompt", "output"))


def stack_order(fams) -> list[str]:
    """Every stack after its parent (INHERITS)."""
    done: list[str] = []
    todo = sorted(fams)
    while todo:
        fam = next(f for f in todo if INHERITS.get(f, (None,))[0] in (None, *done))
        done.append(fam)
        todo.remove(fam)
    return done


def fit_stack(fam: str, cal: list[dict], fitted_tables: dict) -> tuple[ServingEfficiency, dict]:
    """One stack's table: the identified parameters fitted on its calibration rows, the rest held; and the
    report (fitted, held with where from and why, fit and leave-one-out errors)."""
    parent, candidates = INHERITS.get(fam, (None, EFFICIENCY_FIELDS))
    previous = efficiency_tables().get(fam) or serving_efficiency(cal[0]["system"])
    start = fitted_tables[parent] if parent else previous
    facts = {f.name: f.default for f in fields(ServingEfficiency) if f.name in FACT_FIELDS}
    priors = PRIORS.get(fam, {})
    start = replace(start, **{**facts, **STACK_FACTS[fam]}, **{n: v for n, (v, _) in priors.items()})
    _, chosen, why = identify(cal, start, list(candidates), BOUNDS)
    fitted = fit(cal, start, free=tuple(chosen)) if chosen else start
    held = {}
    # every parameter not fitted (a host time only where the stack may fit one: 0 elsewhere)
    for name in [n for n in EFFICIENCY_FIELDS + HOST_FIELDS if n not in chosen
                 and (n in EFFICIENCY_FIELDS or n in candidates)]:
        where = (f"prior ({priors[name][1]})" if name in priors else f"[{parent}]" if parent
                 else "its previous value")
        if name in why or name in candidates:
            held[name] = f"at {where}: {why.get(name, 'not identified').split(' (')[0]}"
        elif parent:
            held[name] = f"at {where}: not a parameter these rows may fit (INHERITS)"
    loo = leave_one_out(cal, start, chosen, BOUNDS, key=benchmark_run, reselect=True)
    report = {"fitted": chosen, "held": held, "rows": len(cal), "runs": len({benchmark_run(r) for r in cal}),
              "mape_fit": float(np.mean(np.abs(errors(cal, fitted)))), "log_error_fit": loss(cal, fitted),
              "mape_leave_one_out": float(np.mean([abs(p / r["value"] - 1) for r, p in loo])) if loo else None}
    return fitted, report


def table_source(fam: str, cal: list[dict], report: dict) -> str:
    software = sorted({r["software"].split(" (")[0] for r in cal})
    held = "; ".join(f"held {n} {why}" for n, why in report["held"].items() if "INHERITS" not in why)
    rest = [n for n, why in report["held"].items() if "INHERITS" in why]
    loo = report["mape_leave_one_out"]
    return (f"fitted {', '.join(report['fitted']) or 'nothing'} on the {len(cal)} {fam} calibration rows of "
            f"benchmarks/serving_measurements.csv ({', '.join(software)}) by benchmarks/serving_accuracy.py "
            f"--calibrate, {date.today()}" + (f"; {held}" if held else "")
            + (f"; {', '.join(rest)} from [{INHERITS[fam][0]}]" if rest else "")
            + f"; mean |log error| {report['log_error_fit']:.3f}, MAPE {report['mape_fit']:.1%}; leave-one-out "
            + (f"MAPE {loo:.1%} over {report['runs']} runs" if loo is not None else "none (one run)"))


def write_tables(rows: list[dict]) -> dict:
    """Fit each stack family on its calibration rows and rewrite serving_efficiency.toml (header kept);
    returns each stack's report."""
    text = EFFICIENCY_FILE.read_text()
    header = text[:text.index("\n[")].rstrip("\n") + "\n"
    tables, reports = [], {}
    fitted_tables: dict = {}
    for fam in stack_order({family(r) for r in rows}):
        cal = [r for r in rows if family(r) == fam and r["split"] == "calibration"]
        fitted, report = fit_stack(fam, cal, fitted_tables)
        fitted_tables[fam], reports[fam] = fitted, report
        names = EFFICIENCY_FIELDS + tuple(n for n in HOST_FIELDS if getattr(fitted, n))
        lines = [f"[{fam}]"] + [f"{n} = {float(f'{getattr(fitted, n):.3g}')!r}" for n in names]
        lines += [f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v)}".replace("'", '"')
                  for k, v in STACK_FACTS[fam].items()]
        lines.append(f'source = "{table_source(fam, cal, report)}"')
        tables.append("\n".join(lines))
        print_stack_report(fam, fitted, report)
    EFFICIENCY_FILE.write_text(header + "\n" + "\n\n".join(tables) + "\n")
    return reports


def print_stack_report(fam: str, fitted: ServingEfficiency, report: dict) -> None:
    loo = report["mape_leave_one_out"]
    print(f"[{fam}] {report['rows']} calibration rows ({report['runs']} runs): fit MAPE {report['mape_fit']:.1%}, "
          f"leave-one-out MAPE " + (f"{loo:.1%}" if loo is not None else "- (one run)"))
    for n in report["fitted"]:
        print(f"  fitted {n:>18} = {getattr(fitted, n):.4g}")
    for n, why in report["held"].items():
        print(f"  held   {n:>18} = {getattr(fitted, n):.4g}  {why}")


def summary(rows: list[dict], errs: np.ndarray) -> str:
    within = np.mean(np.abs(errs) <= 0.20)
    return f"{len(rows)} rows: MAPE {np.mean(np.abs(errs)):.1%}, within 20%: {within:.0%}, worst {np.max(np.abs(errs)):.1%}"


def print_families(rows: list[dict], errs: np.ndarray) -> None:
    """Per serving stack and chip: each split's rows, MAPE, share within 20% and worst error."""
    groups = sorted({(family(r), r["system"].chip.name) for r in rows})
    print(f"\n{'stack':<20} {'chip':<12} {'split':<12} {'rows':>4} {'MAPE':>7} {'<=20%':>6} {'worst':>7}")
    for fam, chip in groups:
        for split in ("calibration", "evaluation"):
            part = [i for i, r in enumerate(rows) if (family(r), r["system"].chip.name) == (fam, chip)
                    and r["split"] == split]
            if part:
                e = np.abs(errs[part])
                print(f"{fam:<20} {chip:<12} {split:<12} {len(part):>4} {e.mean():>7.1%} {np.mean(e <= 0.2):>6.0%} "
                      f"{e.max():>7.1%}")
    print()


def print_table(rows: list[dict], errs: np.ndarray) -> None:
    print(f"{'id':<44} {'split':<11} {'kind':<17} {'measured':>10} {'predicted':>10} {'error':>7}  unit")
    for row, err in zip(rows, errs, strict=True):
        print(f"{row['id']:<44} {row['split']:<11} {row['kind']:<17} {row['value']:>10.2f} "
              f"{row['value'] * (1 + err):>10.2f} {err:>+7.1%}  {row['unit']}")


def print_markdown(rows: list[dict], errs: np.ndarray) -> None:
    print("| row | split | stack | kind | hardware | tp | w/kv | batch | in/out | measured | predicted | error | source |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row, err in zip(rows, errs, strict=True):
        print(f"| {row['id']} | {row['split']} | {row['stack']} | {row['kind']} | {row['hardware']} | {row['tp']} | "
              f"{row['weights']}/{row['kv']} | {row['batch']} | {row['prompt']}/{row['output']} | {row['value']:g} "
              f"{row['unit'].replace('_', ' ')} | {row['value'] * (1 + err):.4g} | {err:+.1%} | {row['software']}; "
              f"{row['source']} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibrate", action="store_true",
                        help="fit the efficiency tables on the calibration rows and rewrite serving_efficiency.toml")
    parser.add_argument("--split", choices=["all", "calibration", "evaluation"], default="all")
    parser.add_argument("--markdown", action="store_true", help="the table as markdown, with sources (docs/serving.md)")
    args = parser.parse_args()
    rows = load_rows()
    if args.calibrate:
        write_tables(rows)
        rows = load_rows()
    shown = rows if args.split == "all" else [r for r in rows if r["split"] == args.split]
    errs = errors(shown)
    (print_markdown if args.markdown else print_table)(shown, errs)
    if not args.markdown:
        print_families(shown, errs)
    for split in ("calibration", "evaluation"):
        part = [i for i, r in enumerate(shown) if r["split"] == split]
        if part:
            print(f"{split:<12} {summary([shown[i] for i in part], errs[part])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
