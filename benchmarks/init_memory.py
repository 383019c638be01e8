"""Host memory of meta-device construction + sharded materialisation under FSDP, rank by rank (CPU, gloo).

Spawns N ranks (fresh interpreters, as torchrun would), each: imports torch and paratrain and joins the gloo
process group (the *fixed overhead*, measured in the same run: the RSS of a rank that has built nothing), builds
the preset on the meta device, applies FSDP over N ranks, materialises its shards (paratrain's default path),
then runs one forward and one backward on a short sequence (no optimizer step: at 3B parameters the AdamW state
alone would not fit this machine). Printed per rank: peak RSS (getrusage ru_maxrss) after each phase, the
private memory (Private_* in /proc/self/smaps_rollup: what this rank adds to the machine, without the shared
library pages every rank maps) after each phase, the unsharded model size and the shard's share (unsharded / N).

Goal per phase (docs/benchmarks/init_memory.md): peak RSS <= the phase's fixed overhead + 1.5 x the shard's share,
plus FSDP's working set beyond the shards, which does not grow with depth (stated from the shapes before the run:
forward 3 x one block, the gathered units; backward 5 x one block plus the gradient shards, 1 x share).

Forward/backward need more than the shards: FSDP all-gathers one unit at a time (a block, or the root), the
unsharded gradients of a unit live until its reduce-scatter, and the gradient shards accumulate. With
--vocab-parallel dp (the default here) the embedding and head are sharded by vocabulary rows over the ranks and
never gathered (parallel/vocab.py); with off, FSDP's root unit gathers the whole (tied) embedding on every rank
from the first forward to the end of backward (for Llama 3.2 3B, 0.73 GiB + its full-size gradients per rank).
The parent estimates the need from the shapes before starting and refuses (unless --force) when the machine's
MemAvailable is short: ranks that run out of memory on a shared machine get other people's processes killed too.

  python benchmarks/init_memory.py --preset tiny --ranks 4
  python benchmarks/init_memory.py --preset llama3.2-3b --ranks 8 --dtype bf16 --seq 16
  python benchmarks/init_memory.py --preset llama3.2-3b --ranks 2 --layers 2 --dtype bf16 --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import tempfile
import time

PHASES = ("materialise", "forward", "backward")


def rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def private_bytes() -> int:
    """Private (not shared) resident memory of this process."""
    total = 0
    with open("/proc/self/smaps_rollup") as fh:
        for line in fh:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1]) * 1024
    return total


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def overrides(args) -> list[str]:
    out = [f'model.preset="{args.preset}"', f"model.max_seq={args.seq}", f"train.seq_len={args.seq}",
           f"train.global_batch={args.ranks}", "train.microbatch=1", f"parallel.dp={args.ranks}",
           'parallel.dp_kind="fsdp"', 'train.device="cpu"', f'parallel.vocab_parallel="{args.vocab_parallel}"']
    if args.layers:
        out.append(f"model.layers={args.layers}")
    if getattr(args, "vocab", 0):
        out.append(f"model.vocab={args.vocab}")
    return out


def estimate_rank_bytes(args, base_bytes: int) -> dict[str, int]:
    """Rough peak RSS per rank and phase, from the shapes (to refuse a run that cannot fit before starting)."""
    from paratrain.config import load_config

    shape = load_config(None, overrides(args)).model_shape()
    elem = 2 if args.dtype == "bf16" else 4
    share = shape.num_params() * elem // args.ranks
    root = (shape.vocab * shape.hidden * (1 if shape.tie_embeddings else 2) + shape.hidden) * elem
    if args.vocab_parallel == "dp" and args.ranks > 1:  # the embedding/head stay sharded (in `share`): never gathered
        root = shape.hidden * elem
    block = shape.params_per_layer() * elem
    # Transients fitted to two measured runs (llama3.2-3b shape, 2 layers, vocab 32064, bf16, on 2 and 8 ranks:
    # docs/benchmarks/init_memory.md): forward peak = base + share + 2 (root + block) (within 3%), backward
    # <= base + 2 share + 3.5 root + 2.5 block (3% and 10% above the measured peaks). Only a guard against starting
    # a run the machine cannot hold, not a prediction we report. The factor 2 on a gathered unit: FSDP2
    # all-gathers into a flat buffer and copies out into the unsharded parameters; the backward's ~3 roots: the
    # gathered tied embedding/head, its gradient, and a second full-size gradient (the embedding's, added into
    # the head's) or the reduce-scatter input.
    return {"materialise": base_bytes + share, "forward": base_bytes + share + 2 * (root + block),
            "backward": base_bytes + 2 * share + int(3.5 * root + 2.5 * block)}

def block_bytes(args) -> int:
    from paratrain.config import load_config

    return load_config(None, overrides(args)).model_shape().params_per_layer() * (2 if args.dtype == "bf16" else 4)


def phase_goals(args, base: dict, share: float) -> dict[str, float]:
    """Peak RSS allowed per phase: the phase's measured fixed overhead + 1.5 x the shard's share, plus what FSDP2
    holds beyond the shards whatever the depth (from the shapes, before the run): in forward 3 blocks (the
    current block's unsharded parameters while the next block's all-gather lands in its flat buffer and is copied
    out into its parameters); in backward those 3, the current block's unsharded gradient and the reduce-scatter
    input (5 blocks), and the gradient shards (1 x share: no optimizer step). (First stated as 2 and 3 blocks;
    the 2-layer run in docs/benchmarks/init_memory.md measured 3.2 and 3.9: the next block's gather was missed.)"""
    block = block_bytes(args)
    extra = {"materialise": 0, "forward": 3 * block, "backward": 5 * block + share}
    return {p: base[p + "_rss_peak_bytes"] + 1.5 * share + extra[p] for p in args.phases}


def progress(out: dict, phase: str) -> None:
    """Rank 0's line as each phase ends (so a run stopped later still shows how far it got)."""
    if out["rank"] == 0:
        print(f"rank 0: {phase} done in {out[phase + '_s']:.1f} s, peak RSS {gib(out[phase + '_rss_peak_bytes'])} "
              f"GiB, private {gib(out[phase + '_private_bytes'])} GiB; MemAvailable {gib(mem_available_bytes())} GiB",
              file=sys.stderr, flush=True)


def rank_main(rank: int, args, store_path: str, queue) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(args.ranks), "LOCAL_RANK": str(rank)})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from paratrain.config import load_config
    from paratrain.model.init import build_on_meta
    from paratrain.model.llama import Llama
    from paratrain.parallel import parallelize
    from paratrain.parallel.mesh import DistEnv, build_mesh
    from paratrain.parallel.runner import plain

    dist.init_process_group("gloo", store=dist.FileStore(store_path, args.ranks), rank=rank,
                            world_size=args.ranks)
    env = DistEnv(rank=rank, world_size=args.ranks, local_rank=rank, device=torch.device("cpu"))
    out = {"rank": rank, "base_rss_peak_bytes": rss_peak_bytes(), "base_private_bytes": private_bytes()}
    cfg = load_config(None, overrides(args))
    dist.barrier()
    t0 = time.perf_counter()
    model = build_on_meta(lambda: Llama(cfg.model_shape()))
    if args.dtype == "bf16":
        model.to(torch.bfloat16)  # parameters stored in bf16 (no fp32 master copy): a memory demonstration
    unsharded = sum(p.numel() * p.element_size() for p in model.parameters())
    runner = parallelize(model, cfg, build_mesh(cfg.parallel, env), env)
    out["materialise_s"] = time.perf_counter() - t0
    out["unsharded_bytes"] = unsharded
    local = [getattr(p, "_local_tensor", p) for p in runner.model.parameters()]
    out["local_param_bytes"] = sum(t.numel() * t.element_size() for t in local)
    out["materialise_rss_peak_bytes"], out["materialise_private_bytes"] = rss_peak_bytes(), private_bytes()
    progress(out, "materialise")
    dist.barrier()
    if "forward" in args.phases:
        g = torch.Generator().manual_seed(rank)
        tokens = torch.randint(0, cfg.model_shape().vocab, (1, args.seq + 1), generator=g)
        t0 = time.perf_counter()
        step_context = getattr(runner, "step_context", contextlib.nullcontext)  # one rank: a plain Runner
        with step_context():  # loss_parallel when the head is vocab-parallel
            loss = runner.loss_fn(runner.model(tokens[:, :-1]), tokens[:, 1:])
        out["forward_s"], out["loss"] = time.perf_counter() - t0, float(plain(loss.detach()))
        out["forward_rss_peak_bytes"], out["forward_private_bytes"] = rss_peak_bytes(), private_bytes()
        progress(out, "forward")
        dist.barrier()
        if "backward" in args.phases:
            t0 = time.perf_counter()
            with step_context():
                loss.backward()
            out["backward_s"] = time.perf_counter() - t0
            grads = [p.grad for p in runner.model.parameters() if p.grad is not None]
            out["grad_shards"] = len(grads)
            out["grad_norm_sq_local"] = float(sum(float(getattr(g, "_local_tensor", g).float().pow(2).sum())
                                                  for g in grads))
            out["backward_rss_peak_bytes"], out["backward_private_bytes"] = rss_peak_bytes(), private_bytes()
            progress(out, "backward")
            dist.barrier()
    queue.put(out)
    dist.destroy_process_group()


def bare_import(queue) -> None:
    """A process that imports torch and builds nothing."""
    import torch  # noqa: F401

    queue.put({"rss_peak_bytes": rss_peak_bytes(), "private_bytes": private_bytes()})


def run_ranks(ctx, args) -> list[dict]:
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=rank_main, args=(r, args, os.path.join(tmp, "store"), queue))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        results = []
        while len(results) < len(procs):
            try:
                results.append(queue.get(timeout=5))
            except Exception:  # noqa: BLE001 - queue.Empty: is everyone still alive?
                if dead := [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]:
                    for p in procs:
                        p.kill()
                    raise SystemExit(f"rank(s) {dead} died (exit codes {[procs[i].exitcode for i in dead]}); "
                                     f"see their output above") from None
        for p in procs:
            p.join()
    return sorted(results, key=lambda r: r["rank"])


def fixed_overhead(ctx, args) -> dict:
    """What a rank costs whatever the model: one rank running the same code path (imports, gloo group, meta
    build, FSDP, materialise, the same phases) on a negligible model (tiny, 1 layer, vocab 256: 0.6 MB)."""
    small = argparse.Namespace(**{**vars(args), "preset": "tiny", "layers": 1, "ranks": 1, "vocab": 256})
    queue = ctx.Queue()
    proc = ctx.Process(target=bare_import, args=(queue,))
    proc.start()
    bare = queue.get()
    proc.join()
    (run,) = run_ranks(ctx, small)
    return {"bare_import_rss_peak_bytes": bare["rss_peak_bytes"], "bare_import_private_bytes": bare["private_bytes"],
            **{f"{p}_rss_peak_bytes": run[f"{p}_rss_peak_bytes"] for p in args.phases},
            **{f"{p}_private_bytes": run[f"{p}_private_bytes"] for p in args.phases}}


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--seq", type=int, default=16, help="sequence length of the forward/backward (and max_seq)")
    ap.add_argument("--layers", type=int, default=0, help="override the preset's layer count (0: keep)")
    ap.add_argument("--vocab", type=int, default=0, help="override the preset's vocabulary (0: keep)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="parameter storage dtype")
    ap.add_argument("--phases", default="materialise,forward,backward", help=f"subset of {','.join(PHASES)}")
    ap.add_argument("--vocab-parallel", choices=["auto", "off", "dp"], default="dp",
                    help="parallel.vocab_parallel: dp shards the embedding/head by vocabulary rows over the FSDP ranks "
                         "(never gathered); off: FSDP gathers them whole with the root unit (the old path)")
    ap.add_argument("--force", action="store_true", help="run even if the estimate exceeds MemAvailable")
    ap.add_argument("--json", action="store_true", help="print only JSON")
    args = ap.parse_args(argv)
    args.phases = [p for p in args.phases.split(",") if p]
    bad = [p for p in args.phases if p not in PHASES]
    if bad or "materialise" not in args.phases or ("backward" in args.phases and "forward" not in args.phases):
        ap.error(f"--phases {','.join(args.phases)}: allowed: materialise[,forward[,backward]]")
    if args.ranks < 1:
        ap.error(f"--ranks {args.ranks}: must be >= 1")

    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # fresh interpreters: the base overhead is what a torchrun rank pays
    base = fixed_overhead(ctx, args)
    need = estimate_rank_bytes(args, base["materialise_rss_peak_bytes"])
    last = args.phases[-1]
    total_need, available = need[last] * args.ranks, mem_available_bytes()
    if not args.json:
        print(f"fixed overhead: a process that imports torch: RSS {gib(base['bare_import_rss_peak_bytes'])} GiB; a rank "
              f"running this code path on a negligible model: peak RSS "
              + ", ".join(f"{p} {gib(base[p + '_rss_peak_bytes'])}" for p in args.phases)
              + f" GiB. Estimated need for '{last}': {gib(total_need)} GiB over {args.ranks} ranks, MemAvailable "
              f"{gib(available)} GiB; load {' '.join(open('/proc/loadavg').read().split()[:3])}", flush=True)
    if total_need > available and not args.force:
        print(f"refusing: the estimate ({gib(total_need)} GiB) exceeds MemAvailable ({gib(available)} GiB); use fewer "
              f"--phases, a smaller model, or --force", file=sys.stderr)
        return 2
    results = run_ranks(ctx, args)
    report = {"args": {k: v for k, v in vars(args).items() if k != "json"}, "fixed_overhead": base,
              "estimate_per_rank_bytes": need, "ranks": results}
    share = results[0]["unsharded_bytes"] / args.ranks
    goals = phase_goals(args, base, share)
    report["goal_rss_bytes"] = goals
    report["goal_met"] = {p: all(r[p + "_rss_peak_bytes"] <= g for r in results) for p, g in goals.items()}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.preset} ({'layers=' + str(args.layers) + ', ' if args.layers else ''}{args.dtype} parameters), "
          f"FSDP over {args.ranks} ranks, seq {args.seq}: unsharded {gib(results[0]['unsharded_bytes'])} GiB, "
          f"shard's share {gib(share)} GiB, one block {gib(block_bytes(args))} GiB; vocab_parallel={args.vocab_parallel}")
    print("goal per phase: peak RSS <= fixed overhead of the phase + 1.5 x share + FSDP's working set (forward: "
          "3 x one block, the gathered units; backward: 5 x one block, plus the gradient shards, 1 x share): "
          + ", ".join(f"{p} {gib(g)} GiB" for p, g in goals.items()))
    cols = [("materialise", "mat"), ("forward", "fwd"), ("backward", "bwd")]
    head = "rank  local shard GiB  " + "  ".join(f"{c} peak RSS / private GiB" for _, c in cols if _ in args.phases)
    print(head)
    for r in results:
        cells = [f"{gib(r[p + '_rss_peak_bytes'])} / {gib(r[p + '_private_bytes'])}".rjust(len(c) + 24)
                 for p, c in cols if p in args.phases]
        print(f"{r['rank']:>4}  {gib(r['local_param_bytes']):>15}  " + "  ".join(cells))
    times = {p: max(r[p + "_s"] for r in results) for p in args.phases}
    print("slowest rank, seconds: " + ", ".join(f"{p} {t:.1f}" for p, t in times.items()))
    for p in args.phases:
        worst = max(r[p + "_rss_peak_bytes"] for r in results)
        print(f"{p}: peak RSS max {gib(worst)} GiB = fixed {gib(base[p + '_rss_peak_bytes'])} + "
              f"{(worst - base[p + '_rss_peak_bytes']) / share:.2f} x share; goal {gib(goals[p])} GiB met on every "
              f"rank: {report['goal_met'][p]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
