"""Loss curves of the tiny Llama in fp32 and bf16 mixed precision, side by side (docs/devices.md).

Runs `paratrain train` (the real CLI, --summary-json) on the same data, seed and schedule:
  fp32 single device | bf16 single device (autocast path) | bf16 FSDP2 on 2 gloo ranks, reduce fp32 and bf16
  (MixedPrecisionPolicy path, torchrun).
Prints a table of the loss at chosen steps and the largest relative gap to fp32 over all steps, and plots the
curves. The tolerance stated in tests/test_precision.py bounds a single step's error (gradient
sqrt(2 n_fwd) u); over a training run the curves drift apart like two fp32 runs with different summation
orders do, so the curves are shown, not asserted.

Run:  python benchmarks/precision_curves.py --data data/stdlib [--steps 150] [--plot docs/benchmarks/precision_curves.png]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RUNS = {
    "fp32": ([], 1),
    "fp32 fsdp2 (control)": (['parallel.dp_kind="fsdp"'], 2),  # fp32 too: drift from reduction order alone
    "bf16": (['train.dtype="bf16"'], 1),
    "bf16 fsdp2 reduce fp32": (['train.dtype="bf16"', 'parallel.dp_kind="fsdp"'], 2),
    "bf16 fsdp2 reduce bf16": (['train.dtype="bf16"', 'train.reduce_dtype="bf16"', 'parallel.dp_kind="fsdp"'], 2),
}


def base_settings(data: str, steps: int, run_dir: Path) -> list[str]:
    return ["model.preset=\"tiny\"", "model.layers=2", f"data.prepared_dir=\"{data}\"", f"train.steps={steps}",
            "train.seq_len=64", "train.global_batch=8", "train.microbatch=4", "train.eval_every=0",
            "optim.warmup_steps=10", "checkpoint.save_final=false", "checkpoint.resume=\"none\"",
            "train.progress=false", "metrics.tensorboard=false", f"metrics.run_dir=\"{run_dir}\"",
            "train.device=\"cpu\""]


def run(name: str, data: str, steps: int, work: Path) -> list[float]:
    extra, ranks = RUNS[name]
    out = work / (name.replace(" ", "_") + ".json")
    sets = [a for s in base_settings(data, steps, work / name.replace(" ", "_")) + extra for a in ("--set", s)]
    if ranks == 1:
        cmd = [sys.executable, "-m", "paratrain", "train", *sets, "--summary-json", str(out)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "-m", "paratrain", "train", *sets, "--summary-json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["losses"]


def table(curves: dict[str, list[float]], at: list[int]) -> str:
    ref = curves["fp32"]
    last = max(len(ref) // 6, 1)
    head = ("| run | " + " | ".join(f"loss @ {s}" for s in at) + f" | mean of last {last} | max rel. gap to fp32 "
            f"(any step) | rel. gap of the mean of the last {last} |")
    lines = [head, "|" + "---|" * (len(at) + 4)]
    ref_tail = sum(ref[-last:]) / last
    for name, c in curves.items():
        gap = max(abs(a - b) / b for a, b in zip(c, ref, strict=True))
        tail = sum(c[-last:]) / last
        lines.append(f"| {name} | " + " | ".join(f"{c[s - 1]:.4f}" for s in at)
                     + f" | {tail:.4f} | {gap:.2e} | {abs(tail / ref_tail - 1):.2e} |")
    return "\n".join(lines)


def plot(curves: dict[str, list[float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, gap) = plt.subplots(1, 2, figsize=(11, 4))
    for name, c in curves.items():
        ax.plot(range(1, len(c) + 1), c, label=name, lw=1)
        if name != "fp32":
            gap.plot(range(1, len(c) + 1), [a / b - 1 for a, b in zip(c, curves["fp32"], strict=True)], label=name,
                     lw=1)
    ax.set(xlabel="step", ylabel="training loss", title="tiny Llama (2 layers), fp32 vs bf16")
    gap.set(xlabel="step", ylabel="loss / fp32 loss - 1", title="relative gap to fp32")
    ax.legend()
    gap.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/stdlib", help="a prepared data folder (paratrain data prepare)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--plot", help="write the curves to this PNG")
    p.add_argument("--json", help="write the curves to this JSON file")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        curves = {}
        for name in RUNS:
            print(f"running {name} ...", file=sys.stderr, flush=True)
            curves[name] = run(name, args.data, args.steps, Path(tmp))
    at = sorted({1, args.steps // 4, args.steps // 2, args.steps})
    print(table(curves, at))
    if args.plot:
        plot(curves, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps(curves))


if __name__ == "__main__":
    main()
