"""Context parallelism at a long sequence: tokens/s and peak memory per rank for CP 1/2/4, as ratios to CP 1.

For each CP degree the script launches `torchrun --nproc-per-node CP` on itself (worker mode). Every rank builds
the same model through paratrain's own `build_runner` (parallel.cp=CP, the rest of the mesh 1), then:
  * times `--steps` full training steps (forward/backward of one sequence of `--seq` tokens, grad clip, AdamW)
    after one warm-up step, ranks barriered around each step; tokens/s = global tokens / median step time;
  * runs one more step under torch's MemTracker (tensor-level accounting through a dispatch mode, CPU included):
    peak bytes per rank, split into parameters, gradients, optimizer state, activations and temporaries;
  * counts the bytes autograd saves inside the attention modules (saved-tensor hooks), per rank;
  * reports the ring's traffic per step and rank (K/V and dK/dV bytes sent) and the fraction of the step a rank
    spent blocked waiting for ring transfers (communication the block compute did not hide), and the spread of
    CPU time across ranks (the zig-zag layout's load balance: 1.0 = every rank did the same work).
Gradients are averaged with DDP (`--dp-kind ddp`, default) so parameter/optimizer memory stays the same across
CP degrees and the memory ratios show the activations CP splits; `--dp-kind fsdp` shards them over cp as well.

Each rank uses one compute thread. Two throughput numbers are printed: tokens/s (global tokens over the wall time of
a step, the slowest rank's) and tokens per CPU-second (global tokens over the CPU time all ranks spent on the
step). The second is the work efficiency of the ring (1.0 = no extra work); it stays meaningful on a machine with
fewer free cores than ranks, where the wall-clock ratio reflects how the OS shares the cores, not CP.

    .venv/bin/python benchmarks/context_parallel.py [--seq 8192] [--layers 2] [--steps 3] [--cp 1 2 4] [--json]
        [--attention auto math]   # the fused block kernel vs plain matmuls: peak attention memory as a ratio
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist


def _overrides(args) -> list[str]:
    return [f'model.preset="{args.preset}"', f"model.layers={args.layers}", f"model.max_seq={args.seq}",
            f"train.seq_len={args.seq}", "train.global_batch=1", "train.microbatch=1", "optim.warmup_steps=0",
            'optim.schedule="constant"', 'train.device="cpu"', f"parallel.cp={args.cp_degree}",
            f'parallel.dp_kind="{args.dp_kind}"', f'parallel.cp_attention="{args.cp_attention}"']


def attention_saved_bytes(runner, step) -> int:
    """Bytes autograd saves inside the attention modules during `step()`, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in runner.parameters() if not _is_dtensor(p)}
    storages: dict[int, int] = {}

    def pack(t):
        if not _is_dtensor(t) and t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    handles = []
    for block in runner.parts[0].layers.values():
        handles.append(block.attention.register_forward_pre_hook(lambda *_: hooks.__enter__()))
        handles.append(block.attention.register_forward_hook(lambda *_: hooks.__exit__(None, None, None)))
    step()
    for handle in handles:
        handle.remove()
    return sum(storages.values())


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def worker(args) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    from paratrain.config import load_config
    from paratrain.parallel.context import ring_stats
    from paratrain.parallel.mesh import init_distributed
    from paratrain.train.loop import build_optimizer, build_runner

    torch.set_num_threads(1)
    cfg = load_config(None, _overrides(args))
    env = init_distributed("cpu")
    runner = build_runner(cfg, env)
    optimizer = build_optimizer(runner, cfg.optim)
    rows = torch.randint(0, cfg.model_shape().vocab, (1, args.seq + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = rows[:, :-1], rows[:, 1:]

    def step():
        loss = runner.forward_backward(inputs, targets)
        runner.clip_grad_norm_(cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    losses = [step()]  # warm-up
    ring_stats(runner.parts)  # reset the ring counters
    times, cpu_times = [], []
    for _ in range(args.steps):
        _barrier(env)
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step())
        cpu_times.append(time.process_time() - c0)  # before the barrier: this rank's own work
        _barrier(env)
        times.append(time.perf_counter() - t0)
    ring = {k: v / args.steps for k, v in ring_stats(runner.parts).items()}
    tracker = MemTracker()
    tracker.track_external(*runner.parts, optimizer)
    with tracker:
        step()
    peak = {str(k).split(".")[-1].lower(): v for k, v in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
    attn_bytes = attention_saved_bytes(runner, step)
    result = {"rank": env.rank, "step_s": statistics.median(times), "cpu_s": statistics.median(cpu_times), "losses": losses, "peak_bytes": peak,
              "attention_saved_bytes": attn_bytes,
              "ring_bytes_sent": ring["bytes_sent"], "ring_wait_s": ring["wait_s"]}
    gathered = [None] * env.world_size if env.world_size > 1 else [result]
    if env.world_size > 1:
        dist.all_gather_object(gathered, result)
    if env.is_main:
        with open(args.out, "w") as f:
            json.dump(gathered, f)
    if env.world_size > 1:
        dist.destroy_process_group()


def _barrier(env) -> None:
    if env.world_size > 1:
        dist.barrier()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(args, cp: int, out: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cp), "--master-addr",
           "127.0.0.1", "--master-port", str(_free_port()), __file__, "--worker", "--cp-degree", str(cp),
           "--out", out, "--seq", str(args.seq), "--layers", str(args.layers), "--steps", str(args.steps),
           "--preset", args.preset, "--dp-kind", args.dp_kind, "--cp-attention", args.cp_attention]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"CP{cp} run failed:\n{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def summarize(cp: int, ranks: list[dict], seq: int, attention: str = "auto") -> dict:
    step_s = max(r["step_s"] for r in ranks)  # the step ends when the slowest rank does
    peak_total = max(r["peak_bytes"]["Total".lower()] for r in ranks)
    cpu_s = sum(r["cpu_s"] for r in ranks)  # CPU time of all ranks for one step: the total work
    return {"cp": cp, "attention": attention, "step_s": step_s, "tokens_per_s": seq / step_s, "cpu_s_per_step": cpu_s,
            "tokens_per_cpu_s": seq / cpu_s,
            # zig-zag balance: the busiest rank's CPU time over the least busy one's (1.0 = balanced)
            "rank_cpu_imbalance": max(r["cpu_s"] for r in ranks) / min(r["cpu_s"] for r in ranks),
            "peak_bytes_per_rank": peak_total,
            "peak_activation_bytes_per_rank": max(r["peak_bytes"]["act"] + r["peak_bytes"]["temp"] for r in ranks),
            "attention_saved_bytes_per_rank": max(r["attention_saved_bytes"] for r in ranks),
            "ring_mib_sent_per_rank": max(r["ring_bytes_sent"] for r in ranks) / 2**20,
            "ring_wait_fraction": max(r["ring_wait_s"] / r["step_s"] for r in ranks),
            "first_loss": ranks[0]["losses"][0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=8192, help="tokens per sequence (divisible by 2*max cp)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="CP degrees to compare (first = base)")
    ap.add_argument("--dp-kind", default="ddp", choices=["ddp", "fsdp"])
    ap.add_argument("--attention", nargs="+", default=["auto"], choices=["auto", "flash_cpu", "efficient", "math"],
                    help="cp block kernels to compare (parallel.cp_attention); e.g. auto math: the fused kernel "
                         "vs plain matmuls, peak attention memory as a ratio")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--cp-attention", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cp-degree", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    for cp in args.cp:
        if args.seq % (2 * cp):
            raise SystemExit(f"--seq {args.seq} must be divisible by 2*cp = {2 * cp}")
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for attention in args.attention:
            for cp in args.cp:
                print(f"CP{cp} ({attention}): {cp} rank(s), seq {args.seq} ...", file=sys.stderr, flush=True)
                args.cp_attention = attention
                out = os.path.join(tmp, f"cp{cp}_{attention}.json")
                rows.append(summarize(cp, launch(args, cp, out), args.seq, attention))
    kernels = _kernel_comparison(rows, args.attention)
    base = rows[0]
    for row in rows:
        row["throughput_ratio"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["work_efficiency"] = row["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
        for key in ("peak_bytes_per_rank", "peak_activation_bytes_per_rank", "attention_saved_bytes_per_rank"):
            row[key.replace("_bytes_per_rank", "_reduction")] = base[key] / row[key]
    if args.json:
        print(json.dumps({"seq": args.seq, "layers": args.layers, "preset": args.preset, "dp_kind": args.dp_kind,
                          "cores": os.cpu_count(), "rows": rows, "kernel_comparison": kernels}, indent=2))
        return
    mib = 2**20
    print(f"seq {args.seq}, preset {args.preset} x {args.layers} layers, fp32, {os.cpu_count()} cores, "
          f"grad reduction {args.dp_kind}")
    print(f"{'CP':>3} {'kernel':>9} {'tokens/s':>9} {'x CP1':>6} {'tok/cpu-s':>9} {'x CP1':>6} {'peak MiB/rank':>14} {'CP1/this':>9} {'act+tmp MiB':>12} "
          f"{'CP1/this':>9} {'attn saved MiB':>15} {'CP1/this':>9} {'ring MiB/step':>13} {'ring wait':>9} {'imbalance':>9}")
    for r in rows:
        print(f"{r['cp']:>3} {r['attention']:>9} {r['tokens_per_s']:>9.0f} {r['throughput_ratio']:>6.2f} "
              f"{r['tokens_per_cpu_s']:>9.0f} {r['work_efficiency']:>6.2f} "
              f"{r['peak_bytes_per_rank'] / mib:>14.1f} {r['peak_reduction']:>9.2f} "
              f"{r['peak_activation_bytes_per_rank'] / mib:>12.1f} {r['peak_activation_reduction']:>9.2f} "
              f"{r['attention_saved_bytes_per_rank'] / mib:>15.1f} {r['attention_saved_reduction']:>9.2f} "
              f"{r['ring_mib_sent_per_rank']:>13.1f} {r['ring_wait_fraction']:>9.1%} {r['rank_cpu_imbalance']:>9.2f}")
    _print_kernels(kernels)


def _kernel_comparison(rows: list[dict], attentions: list[str]) -> list[dict]:
    """Per CP degree: the plain-matmul kernel's peak attention memory over the fused kernel's, same run."""
    if "math" not in attentions or len(attentions) < 2:
        return []
    fused = next(a for a in attentions if a != "math")
    by = {(r["cp"], r["attention"]): r for r in rows}
    out = []
    for cp in sorted({r["cp"] for r in rows}):
        m, f = by[(cp, "math")], by[(cp, fused)]
        out.append({"cp": cp, "fused": fused,
                    "peak_activation_math_over_fused": m["peak_activation_bytes_per_rank"]
                    / f["peak_activation_bytes_per_rank"],
                    "attention_saved_math_over_fused": m["attention_saved_bytes_per_rank"]
                    / f["attention_saved_bytes_per_rank"],
                    "first_loss_diff": abs(m["first_loss"] - f["first_loss"])})
    return out


def _print_kernels(kernels: list[dict]) -> None:
    for k in kernels:
        print(f"CP{k['cp']}: math / {k['fused']}: peak activations+temporaries x{k['peak_activation_math_over_fused']:.2f}, "
              f"attention saved for backward x{k['attention_saved_math_over_fused']:.2f}, "
              f"first loss differs by {k['first_loss_diff']:.1e}")


if __name__ == "__main__":
    main()
