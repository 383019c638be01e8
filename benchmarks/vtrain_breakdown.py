"""vTrain single-node calibration set (benchmarks/data/published/vtrain_ground_truth_single.csv) broken down: the
planner's signed step-time error by hidden size, TP degree and microbatch, and per layout the measured and predicted
time of one layer-microbatch (forward, recomputed forward, backward), the slope of a least-squares fit of the step
time against layers x microbatches over the rows that share the layout (docs/planner.md, "The host-issue floor").

    PYTHONPATH=src:. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vtrain_breakdown.py
    PYTHONPATH=src:. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vtrain_breakdown.py --ops   # + the op count

--ops counts the aten ops the dispatcher sees (views and detaches included: each costs host time) for one layer-
microbatch of a Megatron-style GPT layer written in torch ops (pre-LN, fused qkv, scaled scores, causal mask,
softmax, attention dropout, GeLU MLP, dropout + residual), forward under checkpointing, then the recompute and the
backward: the host work that MEGATRON_HOST_LAUNCH_S is set to cover, per op.
"""

from __future__ import annotations

import argparse
import re
import sys

import numpy as np

from benchmarks.op_count import dispatched_ops
from benchmarks.planner_accuracy import MEGATRON, vtrain
from paratrain.hardware.catalog import get_catalog


def rows() -> list[dict]:
    out = []
    for label, pred, meas in vtrain(get_catalog().system("p4d.24xlarge")):
        d = {k: int(v) for k, v in re.findall(r"([a-zA-Z]+)(\d+)", label)}
        out.append({**d, "pred": pred, "meas": meas, "err": (pred - meas) / meas * 100})
    return out


def layer_ops(h: int = 256, heads: int = 4, seq: int = 64, batch: int = 2) -> tuple[int, int]:
    """(forward ops, recompute + backward ops) of one checkpointed GPT layer (module docstring), on CPU."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    ln1, ln2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
    qkv, proj, fc1, fc2 = (torch.nn.Linear(i, o) for i, o in ((h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)))
    d = h // heads

    def layer(x):  # x: [seq, batch, h], Megatron's layout
        q, k, v = qkv(ln1(x)).view(seq, batch, heads, 3 * d).split(d, dim=-1)
        q, k, v = (t.reshape(seq, batch * heads, d).transpose(0, 1) for t in (q, k, v))
        scores = torch.baddbmm(torch.empty(batch * heads, seq, seq), q, k.transpose(1, 2), beta=0.0, alpha=d**-0.5)
        causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        probs = F.dropout(torch.softmax(scores.masked_fill(causal, -10000.0), -1), 0.1)
        x = x + F.dropout(proj(torch.bmm(probs, v).transpose(0, 1).reshape(seq, batch, h)), 0.1)
        return x + F.dropout(fc2(F.gelu(fc1(ln2(x)))), 0.1)

    x = torch.randn(seq, batch, h, requires_grad=True)
    out = []
    fwd = dispatched_ops(lambda: out.append(checkpoint(layer, x, use_reentrant=False)))
    bwd = dispatched_ops(lambda: out[0].sum().backward())
    return sum(fwd.values()), sum(bwd.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", action="store_true", help="also count a GPT layer's dispatched ops (imports torch)")
    args = parser.parse_args()
    data = rows()
    print(f"vtrain_single: {len(data)} rows, MAPE {np.mean([abs(r['err']) for r in data]):.1f}%")
    for key in ("h", "tp", "mb", "pp"):
        groups: dict[int, list[float]] = {}
        for r in data:
            groups.setdefault(r[key], []).append(r["err"])
        print(f"  signed error by {key}: " + ", ".join(f"{k}: {np.mean(v):+.1f}% (n={len(v)})"
                                                      for k, v in sorted(groups.items())))
    print("\nms per layer-microbatch, measured / predicted (pp 1, dp 1 or the smallest dp measured)")
    for h in sorted({r["h"] for r in data}):
        for tp in sorted({r["tp"] for r in data}):
            cells = []
            for mb in sorted({r["mb"] for r in data}):
                same = [r for r in data if r["h"] == h and r["tp"] == tp and r["mb"] == mb and r["pp"] == 1]
                dps = sorted({r["dp"] for r in same})
                same = [r for r in same if dps and r["dp"] == dps[0]]
                if len(same) < 2:
                    cells.append("      -      ")
                    continue
                x = np.array([[1.0, r["L"] * r["gbs"] / r["dp"] / r["mb"]] for r in same])
                fit = [np.linalg.lstsq(x, np.array([r[k] for r in same]), rcond=None)[0][1] * 1e3 for k in ("meas", "pred")]
                cells.append(f"{fit[0]:5.2f} / {fit[1]:5.2f}")
            print(f"  h{h} tp{tp}: " + "  ".join(f"mb{mb} {c}" for mb, c in zip(sorted({r['mb'] for r in data}), cells, strict=True)))
    if args.ops:
        from benchmarks.planner_accuracy import MEGATRON_HOST_LAUNCH_S
        from paratrain.model.config import gpt_config
        from paratrain.plan.layer import host_issue_s

        fwd, bwd = layer_ops()
        model = gpt_config("gpt-h1024", 24, 1024, 16, 51200, 1024)
        floor = sum(host_issue_s(model, MEGATRON, np.array(0.0), np.array(2)))
        print(f"\nGPT layer, dispatched aten ops per layer-microbatch: forward {fwd}, recompute + backward {bwd}; "
              f"the host floor at MEGATRON_HOST_LAUNCH_S {MEGATRON_HOST_LAUNCH_S * 1e6:.0f} us per counted launch is "
              f"{floor * 1e3:.2f} ms, {floor / (fwd + bwd) * 1e6:.1f} us per dispatched op")
    return 0


if __name__ == "__main__":
    sys.exit(main())
