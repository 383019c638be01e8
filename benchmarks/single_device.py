"""paratrain's training loop vs a minimal hand-written PyTorch loop: same model, same batches, same optimizer.

Prints tokens/s of both and the ratio (goal >= 0.97: the framework costs under 3%). The two are run
alternately, several rounds, in one process, and the medians compared, since this machine is noisy.
Both sides: the first `--warmup` steps are excluded from the timing (allocator and kernel warm-up, the first
metrics writes), and the optimizer is the same: AdamW with paratrain's settings (lr, betas, eps, weight decay
on matrices only, foreach kernels, the same schedule and clipping). paratrain's tokens/s is taken from its
own per-step times in metrics.jsonl over the same steps.
Both run in torch's default mode (train.deterministic=false: the bare loop does not switch on
torch.use_deterministic_algorithms either); paratrain's side is the real `train()` with JSONL and TensorBoard
metrics, per-step timers and its data pipeline, the bare side a plain loop over the same batches.

    .venv/bin/python benchmarks/single_device.py [--steps 40] [--rounds 3] [--preset tiny]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from paratrain.config import load_config
from paratrain.model.llama import Llama
from paratrain.train.data import GlobalSampler, TokenWindows, prepare
from paratrain.train.loop import lr_lambda, train


def bare_loop(cfg, steps: int, warmup: int) -> float:
    """What a user would write by hand: tokens/s over the steps after `warmup`."""
    data = TokenWindows(cfg.data.prepared_dir, "train", cfg.train.seq_len)
    sampler = GlobalSampler(data.num_samples, cfg.train.global_batch, cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    model = Llama(cfg.model_shape())
    model.init_weights(cfg.train.seed)
    o = cfg.optim
    groups = [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(o, steps))
    timed = 0.0
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = data.batch(sampler.next_indices())
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        if step >= warmup:
            timed += time.perf_counter() - t0
    return (steps - warmup) * cfg.train.global_batch * cfg.train.seq_len / timed


def paratrain_loop(cfg, warmup: int) -> float:
    """paratrain's real train(); tokens/s over the same steps, from its own per-step records."""
    train(cfg)
    records = [json.loads(line) for line in open(f"{cfg.metrics.run_dir}/metrics.jsonl")]
    steps = [r for r in records if "step_time_s" in r and r["step"] > warmup]
    return sum(r["tokens_per_s"] * r["step_time_s"] for r in steps) / sum(r["step_time_s"] for r in steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=5, help="steps excluded from the timing on both sides")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    run_dir = tempfile.mkdtemp(prefix="paratrain-bench-")
    cfg = load_config(None, [
        f'model.preset="{args.preset}"', f"train.steps={args.steps}", "train.seq_len=128",
        "train.global_batch=16", "train.microbatch=16", "train.eval_every=0", "train.progress=false",
        "train.log_every=1000000", "checkpoint.save_final=false", f'metrics.run_dir="{run_dir}"',
        "train.deterministic=false",
    ])
    prepare(cfg.data, log=lambda *_: None)
    ours, bare = [], []
    for r in range(args.rounds):
        bare.append(bare_loop(cfg, args.steps, args.warmup))
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each round (it would resume otherwise)
        ours.append(paratrain_loop(cfg, args.warmup))
        print(f"round {r + 1}: bare {bare[-1]:,.0f} tok/s   paratrain {ours[-1]:,.0f} tok/s   "
              f"ratio {ours[-1] / bare[-1]:.3f}")
    # Each round's ratio pairs two runs made back to back, which cancels slow drifts in machine load.
    ratio = statistics.median(o / b for o, b in zip(ours, bare, strict=True))
    print(f"median: bare {statistics.median(bare):,.0f} tok/s, paratrain {statistics.median(ours):,.0f} tok/s, "
          f"median per-round ratio {ratio:.3f} (goal >= 0.97)")


if __name__ == "__main__":
    main()
