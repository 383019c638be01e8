"""Tensor and data parallelism on 2 ranks vs 1 rank, same model and global batch, measured in one run.

For each layout: tokens/s of a full training step (forward, backward, gradient reduction, clip, AdamW) and the
ratio to one rank. For the data-parallel layouts, also how much of the gradient-reduction time is hidden
behind backward compute:

  exposed  = DDP: time still spent waiting for gradient buckets after the last backward (measured directly);
             FSDP: step time with gradient reduction - step time with reduction switched off (same compute)
  alone    = time of the same reductions run by themselves after backward (DDP: every bucket all-reduced;
             FSDP: one reduce-scatter per FSDP unit, of the unit's unsharded gradient size)
  hidden   = 1 - exposed / alone   (clipped to [0, 1])

Each rank uses one thread; the 1-rank baseline runs first in the parent process, then 2 ranks are spawned once
(gloo) and run every layout. On a shared 2-core machine all numbers are noisy: times are the fastest of
the timed steps (interference only adds time); read ratios, not absolute rates, and rerun.

    .venv/bin/python benchmarks/parallel_scaling.py [--preset small] [--layers 4] [--seq 128] [--batch 8]
                                                     [--steps 4] [--bucket-mb 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

LAYOUTS = {
    "tp2": ["parallel.tp=2"],
    "tp2+sp": ["parallel.tp=2", "parallel.sp=true"],
    "ddp2": ["parallel.dp=2", "parallel.dp_kind=\"ddp\""],
    "fsdp2": ["parallel.dp=2", "parallel.dp_kind=\"fsdp\""],
    "fsdp2-zero2": ["parallel.dp=2", "parallel.dp_kind=\"fsdp\"", "parallel.reshard_after_forward=false"],
}


def make_cfg(args, overrides: list[str]):
    from paratrain.config import load_config

    per_rank = args.batch // (2 if any(o.startswith("parallel.dp=") for o in overrides) else 1)
    base = [f"model.preset=\"{args.preset}\"", f"model.layers={args.layers}", f"train.seq_len={args.seq}",
            f"train.global_batch={args.batch}", f"train.microbatch={per_rank}", "train.device=\"cpu\"",
            f"parallel.ddp_bucket_mb={args.bucket_mb}"]
    return load_config(None, base + overrides)


def batch(cfg, step: int):
    g = torch.Generator().manual_seed(step)
    vocab = cfg.model_shape().vocab
    rows = torch.randint(0, vocab, (cfg.train.global_batch, cfg.train.seq_len + 1), generator=g)
    return rows[:, :-1], rows[:, 1:]


def time_steps(cfg, runner, steps: int, sync: bool = True) -> float:
    """Fastest optimizer step in seconds (2 warm-up steps not counted). The minimum, not the median: on a
    shared machine, other processes only ever add time, so the fastest step is the least disturbed one."""
    from paratrain.train.loop import build_optimizer

    opt = build_optimizer(runner, cfg.optim)
    per_rank = cfg.train.global_batch // runner.dp_size
    times = []
    for step in range(steps + 2):
        x, y = batch(cfg, step)
        x, y = x[runner.dp_rank * per_rank:(runner.dp_rank + 1) * per_rank], y[runner.dp_rank * per_rank:
                                                                                (runner.dp_rank + 1) * per_rank]
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        if sync:
            runner.forward_backward(x, y)
        else:
            with _no_grad_sync(runner):
                runner.forward_backward(x, y)
        runner.clip_grad_norm_(cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= 2:
            times.append(time.perf_counter() - t0)
    return min(times)


class _no_grad_sync:
    """Switch gradient reduction off for every microbatch (the compute-only reference)."""

    def __init__(self, runner):
        self.runner = runner

    def __enter__(self):
        dp = self.runner.dp
        self.saved = self.runner.no_sync
        self.runner.no_sync = lambda last: dp.sync_context(False)

    def __exit__(self, *exc):
        self.runner.no_sync = self.saved
        self.runner.dp.sync_context(True)


def reduction_alone_s(cfg, runner, repeats: int = 3) -> float:
    """Seconds of the step's gradient reductions with nothing to overlap (after a backward without sync)."""
    dp = runner.dp
    x, y = batch(cfg, 0)
    per_rank = cfg.train.global_batch // runner.dp_size
    with _no_grad_sync(runner):
        runner.forward_backward(x[:per_rank], y[:per_rank])
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        if dp.reducer is not None:
            dp.reducer.reduce_all_now()
        else:
            for numel in fsdp_unit_numels(runner.model):
                full = torch.ones(numel - numel % runner.dp_size)
                out = torch.empty(full.numel() // runner.dp_size)
                dist.reduce_scatter_tensor(out, full, group=dp.group)
        times.append(time.perf_counter() - t0)
    for p in runner.parameters():
        p.grad = None
    return min(times)


def fsdp_unit_numels(model) -> list[int]:
    """Unsharded gradient elements of each FSDP unit: one per block, then the root (embedding, norm, head)."""
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.layers.values()]
    return blocks[::-1] + [sum(p.numel() for p in model.parameters()) - sum(blocks)]


def run_layout(args, name: str, env) -> dict:
    from paratrain.train.loop import build_runner

    cfg = make_cfg(args, LAYOUTS[name])
    runner = build_runner(cfg, env)
    waits = _record_finish_waits(runner)
    out = {"layout": name, "step_s": time_steps(cfg, runner, args.steps)}
    waits = waits[2:]  # the timed steps only (after 2 warm-up steps)
    if runner.dp is not None:
        out["reduce_alone_s"] = reduction_alone_s(cfg, runner)
        if runner.dp.reducer is not None:
            # DDP: what is still in flight when backward ends is the exposed part; measured directly.
            exposed = min(waits)
        else:
            # FSDP reduces inside backward hooks: exposed = step with reduction - step without it.
            out["step_nosync_s"] = time_steps(cfg, runner, args.steps, sync=False)
            exposed = max(out["step_s"] - out["step_nosync_s"], 0.0)
        out["exposed_s"] = exposed
        out["hidden_fraction"] = min(max(1 - exposed / out["reduce_alone_s"], 0.0), 1.0)
    return out


def _record_finish_waits(runner) -> list[float]:
    """Seconds each step spends waiting for DDP buckets after the last backward (filled while timing)."""
    waits: list[float] = []
    reducer = runner.dp.reducer if runner.dp is not None else None
    if reducer is None:
        return waits
    finish = reducer.finish

    def timed_finish():
        t0 = time.perf_counter()
        finish()
        if reducer.sync:
            waits.append(time.perf_counter() - t0)

    reducer.finish = timed_finish
    return waits


def worker(rank: int, args, port: int, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    from paratrain.parallel.mesh import init_distributed

    env = init_distributed("cpu")
    results = []
    for name in args.layouts:
        results.append(run_layout(args, name, env))
        if rank == 0 and not args.json:
            print(f"  measured {name}", file=sys.stderr, flush=True)
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def single_rank(args) -> float:
    from paratrain.parallel.mesh import DistEnv
    from paratrain.train.loop import build_runner

    torch.set_num_threads(1)
    cfg = make_cfg(args, [])
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    return time_steps(cfg, build_runner(cfg, env), args.steps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per layout (after 2 warm-up steps)")
    p.add_argument("--bucket-mb", type=float, default=2.0, help="DDP gradient bucket size (MiB)")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    tokens = args.batch * args.seq
    base_s = single_rank(args)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=worker, args=(r, args, port, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = queue.get(timeout=1800)
    for proc in procs:
        proc.join()
    rows = [{"layout": "1 rank", "step_s": base_s}] + results
    for r in rows:
        r["tokens_per_s"] = tokens / r["step_s"]
        r["vs_1_rank"] = base_s / r["step_s"]
    if args.json:
        print(json.dumps({"args": vars(args), "tokens_per_step": tokens, "results": rows}, indent=2))
        return 0
    print(f"model {args.preset} x{args.layers} layers, seq {args.seq}, global batch {args.batch} "
          f"({tokens} tokens/step), fp32, 1 thread per rank, gloo")
    print(f"{'layout':<13}{'step s':>8}{'tokens/s':>10}{'vs 1 rank':>11}{'exposed s':>11}{'alone s':>9}"
          f"{'hidden':>8}")
    for r in rows:
        extra = (f"{r['exposed_s']:>11.3f}{r['reduce_alone_s']:>9.3f}{r['hidden_fraction']:>8.0%}"
                 if "hidden_fraction" in r else "")
        print(f"{r['layout']:<13}{r['step_s']:>8.3f}{r['tokens_per_s']:>10.0f}{r['vs_1_rank']:>10.2f}x{extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
