"""`paratrain verify`: run one job twice and compare the runs step by step, rank by rank.

The validation AWS recommends for TorchNeuron (and that works for any accelerator): the same job (ranks,
layout, seed, data) on CPU with gloo and on the device; per step and rank, compare the loss, the gradient norm
and checksums of the parameters after the update. On a machine without an accelerator the same command
compares two layouts of one job on CPU (e.g. FSDP over 2 ranks against the single-device run), which is how it
is tested here.

Each run is `paratrain train` itself (torchrun for more than one rank) with an observer on every rank that
records, after each optimizer step: the loss and pre-clip gradient norm the loop reports (the same numbers
as metrics.jsonl), the global parameter norm (computed from local shards with the loop's own global-norm rule,
so it is layout-independent) and this rank's local checksums (sum and norm of the shards it holds, comparable
only between runs of the same layout).

Pass/fail: every compared quantity within `rtol` (relative). Defaults: fp32 1e-4 (two fp32 runs differ by
summation order only: the parity harness holds 1e-5 after 3 steps); bf16 the rounding bound of one step
(paratrain.parallel.precision.bf16_rtol, gradient rule), since two bf16 runs each sit within it of fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from paratrain.cli import ConfigArgs, Output, command, opt

FP32_RTOL = 1e-4
GLOBAL_KEYS = ("loss", "grad_norm", "param_norm")  # the same on every rank and in every layout
LOCAL_KEYS = ("local_norm", "local_sum")  # this rank's shards: compared only between runs of one layout


@dataclass(kw_only=True)
class VerifyArgs(ConfigArgs, Output):
    device: str = opt("device of the run under test (auto: the accelerator present, else cpu); the reference "
                      "always runs on the host with its backend", "auto")
    steps: int = opt("optimizer steps per run", 5, ge=1)
    nproc: int = opt("ranks of the run under test (and of the reference)", 1, ge=1)
    against_layout: list[str] = opt("the reference run's layout differs: overrides for it, or 'single' = one rank, "
                                    "default [parallel] (then only global quantities are compared)", factory=list,
                                    metavar="SECTION.KEY=VALUE|single")
    against_nproc: int | None = opt("ranks of the reference run (default: 1 for 'single', else --nproc)", ge=1)
    rtol: float | None = opt("relative tolerance (default: fp32 1e-4, bf16 the one-step rounding bound of "
                             "docs/devices.md)", gt=0)


# -- what each rank records ---------------------------------------------------------------------------------
def checksums(runner) -> dict[str, float]:
    """Global parameter norm (layout-independent) and this rank's local shard sum and norm."""
    import torch
    from torch.distributed.tensor import DTensor

    from paratrain.parallel.grad_norm import global_grad_norm

    params = [p.detach() for p in runner.parameters()]
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    local_sum = float(sum(t.double().sum() for t in local)) if local else 0.0
    local_norm = float(torch.stack([t.double().norm() for t in local]).norm()) if local else 0.0
    # the loop's own rule for a global norm from local shards (applied to the parameters instead of gradients)
    norm = global_grad_norm(params, runner.device, runner.norm_groups, *runner.norm_slots)
    return {"param_norm": float(norm), "local_norm": local_norm, "local_sum": local_sum}


def trace_run(cfg) -> dict:
    """Train `cfg` on this rank with the recording observer; this rank's trace."""
    from paratrain.train.loop import train

    rows: list[dict] = []
    summary = train(cfg, observer=lambda step, runner, rec: rows.append({"step": step, **rec, **checksums(runner)}))
    return {"rank": summary["rank"], "world_size": summary["world_size"], "layout": summary["layout"], "steps": rows}


def worker(config: str | None, overrides: list[str], trace_dir: str) -> None:
    """One rank of one run (under torchrun, or alone): write trace_dir/rank<r>.json."""
    from paratrain.config import load_config
    from paratrain.parallel.mesh import shutdown_distributed

    trace = trace_run(load_config(config, overrides))
    shutdown_distributed()
    Path(trace_dir, f"rank{trace['rank']}.json").write_text(json.dumps(trace))


# -- running the two jobs -------------------------------------------------------------------------------------
def run_job(config: str | None, overrides: list[str], nproc: int, work: Path, log) -> list[dict]:
    """Run one job (`nproc` ranks) and return each rank's trace, rank order."""
    work.mkdir(parents=True, exist_ok=True)
    args = ["-m", "paratrain.train.verify", "--trace", str(work)]
    if config:
        args += ["--config", config]
    for item in overrides:
        args += ["--set", item]
    if nproc > 1:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    log(f"running {nproc} rank(s): {' '.join(overrides[-4:])} ...")
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"verify: a run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return [json.loads(Path(work, f"rank{r}.json").read_text()) for r in range(nproc)]


def job_overrides(base: list[str], steps: int, device: str, run_dir: Path) -> list[str]:
    """The same job, `steps` long, on `device`, writing only to run_dir (no checkpoints, no resume)."""
    return [*base, f"train.steps={steps}", f"train.device=\"{device}\"", "train.progress=false",
            "train.eval_every=0", "checkpoint.save_final=false", "checkpoint.interval=0", "checkpoint.resume=\"none\"",
            "metrics.tensorboard=false", f"metrics.run_dir=\"{run_dir}\""]


# -- comparison ---------------------------------------------------------------------------------------------
def rel(a: float, b: float) -> float:
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale else 0.0


def compare(ref: list[dict], test: list[dict], rtol: float, same_layout: bool) -> dict:
    """Per step and rank of `test`: relative differences to the reference (rank by rank for the same layout,
    else against the reference's rank 0 on the global quantities). `passed` = every difference <= rtol."""
    keys = GLOBAL_KEYS + (LOCAL_KEYS if same_layout else ())
    rows, worst = [], dict.fromkeys(keys, 0.0)
    for trace in test:
        partner = ref[trace["rank"]] if same_layout else ref[0]
        for mine, theirs in zip(trace["steps"], partner["steps"], strict=True):
            diffs = {}
            for k in keys:
                if k == "local_sum":  # a sum can cancel to ~0: scale by the shard's norm x sqrt(numel) instead
                    scale = max(abs(theirs["local_norm"]), 1e-30)
                    diffs[k] = abs(mine[k] - theirs[k]) / scale
                else:
                    diffs[k] = rel(mine[k], theirs[k])
                worst[k] = max(worst[k], diffs[k])
            rows.append({"step": mine["step"], "rank": trace["rank"], **diffs,
                         "ok": all(d <= rtol for d in diffs.values())})
    return {"rtol": rtol, "same_layout": same_layout, "rows": rows, "worst": worst,
            "passed": all(r["ok"] for r in rows) and bool(rows)}


def default_rtol(cfg) -> float:
    if cfg.train.dtype == "fp32":
        return FP32_RTOL
    from paratrain.parallel.precision import bf16_rtol

    return bf16_rtol(cfg.model_shape().layers)["grad"]


def print_report(result: dict, labels: tuple[str, str]) -> None:
    keys = list(result["worst"])
    print(f"reference: {labels[0]}\nunder test: {labels[1]}")
    print(f"relative differences ({'rank by rank' if result['same_layout'] else 'global, each rank vs reference'}"
          f"), tolerance {result['rtol']:.1e}:")
    print(f"{'step':>5} {'rank':>5} " + " ".join(f"{k:>11}" for k in keys) + "  ok")
    for r in result["rows"]:
        print(f"{r['step']:>5} {r['rank']:>5} " + " ".join(f"{r[k]:>11.2e}" for k in keys) + ("  yes" if r["ok"] else "  NO"))
    worst = ", ".join(f"{k} {v:.2e}" for k, v in result["worst"].items())
    print(f"{'PASS' if result['passed'] else 'FAIL'}: worst {worst} (tolerance {result['rtol']:.1e})")


def plan_runs(args) -> tuple[list[str], int, list[str], int, str, bool]:
    """(test overrides, test ranks, reference overrides, reference ranks, test device, same layout), checked
    before any work."""
    from paratrain.cli import UserError
    from paratrain.config import check_launch, load_config
    from paratrain.device import CPU, Accelerator, load_extension, resolve_device_type

    load_extension(args.device)  # e.g. torch_neuronx for --device neuron, as the ranks do
    device = resolve_device_type(args.device, Accelerator.detect())
    against = list(args.against_layout)
    single = "single" in against
    if single and len(against) > 1:
        raise UserError(f"--against-layout {' '.join(against)}: 'single' takes no other overrides")
    if device == CPU and not against:
        raise UserError(f"--device={args.device}: the run under test is on the host too, so the two runs would be "
                        f"identical; allowed: --device <an accelerator present>, or --against-layout "
                        f"SECTION.KEY=VALUE|single to compare two layouts")
    ref_nproc = args.against_nproc or (1 if single else args.nproc)
    ref_sets = [*args.set, *(["parallel.dp=-1", "parallel.tp=1", "parallel.pp=1", "parallel.cp=1",
                              "parallel.sp=false"] if single else against)]
    for sets, n, name in ((args.set, args.nproc, "--nproc"), (ref_sets, ref_nproc, "--against-nproc")):
        try:
            check_launch(load_config(args.config, sets), n)
        except ValueError as exc:
            raise UserError(f"{name}={n}: {exc}") from None
    return list(args.set), args.nproc, ref_sets, ref_nproc, device, not against


@command("verify", VerifyArgs, "the same job on CPU and on the device (or two layouts), compared")
def run_verify(args) -> int:
    from paratrain.config import load_config
    from paratrain.device import CPU

    test_sets, test_n, ref_sets, ref_n, device, same = plan_runs(args)
    cfg = load_config(args.config, test_sets)
    rtol = args.rtol if args.rtol is not None else default_rtol(cfg)
    log = (lambda m: None) if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    with tempfile.TemporaryDirectory(prefix="paratrain-verify-") as tmp:
        work = Path(tmp)
        ref = run_job(args.config, job_overrides(ref_sets, args.steps, CPU, work / "ref_run"), ref_n,
                      work / "ref", log)
        test = run_job(args.config, job_overrides(test_sets, args.steps, device, work / "test_run"), test_n,
                       work / "test", log)
    result = compare(ref, test, rtol, same)
    labels = (f"{CPU}, {ref_n} rank(s), layout {ref[0]['layout']}", f"{device}, {test_n} rank(s), layout "
              f"{test[0]['layout']}")
    if args.json:
        print(json.dumps({"reference": labels[0], "test": labels[1], **result}))
    else:
        print_report(result, labels)
    return 0 if result["passed"] else 1


def _worker_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m paratrain.train.verify")
    p.add_argument("--trace", required=True)
    p.add_argument("--config")
    p.add_argument("--set", action="append", default=[])
    a = p.parse_args(argv)
    worker(a.config, a.set, a.trace)


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
