"""Calibrate the serving model on this machine from paratrain's own generation runs.

Probes the host (`paratrain probe --quick`, or takes --hardware FILE), runs `generate` (KV cache, fp32) on a
small Llama at several batch sizes and prompt lengths, turns each run's summary into TTFT and TPOT
measurements (plan.serve_fit.measurements_from_generate), fits the five serving parameters on the
CALIBRATION runs and prints the errors on the EVALUATION runs before (the chip's training efficiency, the
fallback for an unknown stack) and after the fit.

    python benchmarks/serving_local.py                     # ~1-2 minutes on a quiet 2-core machine
    python benchmarks/serving_local.py --hardware runs/hardware/local.toml
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from paratrain.hardware.catalog import resolve_system  # noqa: E402
from paratrain.infer.generate import Sampling, generate  # noqa: E402
from paratrain.infer.session import generation_summary  # noqa: E402
from paratrain.model.config import ModelConfig  # noqa: E402
from paratrain.model.llama import Llama  # noqa: E402
from paratrain.plan.serve import serving_efficiency  # noqa: E402
from paratrain.plan.serve_fit import errors, fit, measurements_from_generate  # noqa: E402

# (batch, prompt tokens): calibration runs, then evaluation runs (never fitted on)
CALIBRATION = [(1, 32), (1, 256), (8, 64), (4, 256)]
EVALUATION = [(2, 128), (16, 32), (1, 512)]
NEW_TOKENS = 24


def probe(tmp: Path) -> Path:
    out = tmp / "local.toml"
    subprocess.run([sys.executable, "-m", "paratrain", "probe", "--quick", "--ranks", "1", "--out", str(out)],
                   check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, stdout=subprocess.DEVNULL)
    return out


def runs(model, shapes) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for batch, prompt in shapes:
        prompts = torch.randint(0, model.cfg.vocab, (batch, prompt), generator=g).tolist()
        result = generate(model, prompts, NEW_TOKENS)
        out.append(generation_summary(model.cfg, result, 1, "cpu", Sampling(), torch.float32))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", help="a `paratrain probe` file (default: probe now, --quick)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        system = resolve_system(args.hardware or str(probe(Path(tmp))))
    cfg = ModelConfig(name="local-bench", layers=8, hidden=512, heads=8, kv_heads=4, vocab=8192, max_seq=1024)
    model = Llama(cfg)
    model.init_weights(0)
    generate(model, [[1, 2, 3]], 4)  # warm-up
    cal = [m for s in runs(model, CALIBRATION) for m in measurements_from_generate(s, system)]
    ev = [m for s in runs(model, EVALUATION) for m in measurements_from_generate(s, system)]
    start = serving_efficiency(system)
    fitted = fit(cal, start)
    before, after = errors(ev, start), errors(ev, fitted)
    print(f"{cfg.num_params() / 1e6:.1f}M-parameter Llama, fp32, KV cache, on {system.name} "
          f"({system.chip.display_name}); {NEW_TOKENS} new tokens per run")
    print(f"fitted on {len(cal)} calibration measurements: " + ", ".join(
        f"{k} {getattr(fitted, k):.3g}" for k in ("decode_bw_eff", "kv_bw_eff", "prefill_flops_eff",
                                                   "layer_overhead_s", "collective_us")))
    print(f"{'evaluation run':<24} {'measured ms':>11} {'before':>8} {'after':>8}")
    for m, b, a in zip(ev, before, after, strict=True):
        label = f"{m['kind']} b{m['batch']} p{m['prompt']}"
        print(f"{label:<24} {m['value']:>11.2f} {b:>+8.1%} {a:>+8.1%}")
    print(f"evaluation MAPE: {np.mean(np.abs(before)):.1%} before, {np.mean(np.abs(after)):.1%} after the fit; "
          f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
