"""paratrain vs torchtitan on the same model: tokens/s and peak memory, one process and FSDP over 2 ranks.

The model is torchtitan's own `llama3` "debugmodel" (6.16M parameters: dim 256, 16 heads, 6 layers, vocab 2048,
SwiGLU 768, untied) built by torchtitan's code, and the same shape built by paratrain; the script checks that the
parameter counts agree before timing anything. Both sides see the same batches (paratrain's prepared data and its
global sampler, each data-parallel rank its own slice), fp32, AdamW with the same settings, gradient clipping, and
run the same number of steps; the first `--warmup` steps are left out of the timing on both sides.

- torchtitan side: `Llama3Model` from its config registry, parallelised by torchtitan's `parallelize_llama` (which
  always applies FSDP2, with a 1-rank mesh on one process, as torchtitan's trainer does), torchtitan's
  `cross_entropy_loss` and `clip_grad_norm_`, in the loop of its `train_step` (forward, loss, backward, clip,
  step, zero_grad, the loss read back). torchtitan's language models accept only FlexAttention or varlen
  attention (both need per-document masks); on CPU we give each block torchtitan's own
  `ScaledDotProductAttention` (causal, the same SDPA kernel paratrain calls) instead. Everything else is theirs.
- paratrain side: the real `paratrain.train.loop.train()` with its metrics, timers and data pipeline; tokens/s
  from its own per-step records over the same steps.

Each (side, world size, round) runs in freshly spawned processes, so the peak RSS of a process (getrusage) is its
own; we print it and the growth over the process's RSS right after imports (the model, optimizer state and
activations, without the ~0.4 GB of libraries). Rounds alternate the sides and the median per-round ratio is the
headline: this machine is noisy, read ratios, not absolute rates.

torchtitan is an optional dependency (`pip install torchtitan==0.3.0` plus its imports: tyro, einops,
torchdata, spmd_types, torch_checkpointing, docstring_parser; `--torchtitan-path DIR` adds an unpacked wheel to
sys.path). Without it the script says so and exits 2.

    .venv/bin/python benchmarks/vs_torchtitan.py [--world 1 2] [--steps 30] [--warmup 5] [--rounds 3]
                                                 [--seq 256] [--batch 8] [--torchtitan-path /tmp/ttpkg]
"""

from __future__ import annotations

import argparse
import json
import os
import queue as queue_module
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from paratrain.config import load_config  # noqa: E402
from paratrain.device import available_accelerator, host  # noqa: E402
from paratrain.train.data import GlobalSampler, TokenWindows, prepare  # noqa: E402

# torchtitan's llama3 "debugmodel" in paratrain's schema. Its RoPE theta (500000, Llama 3.1 scaling) and norm
# epsilon (1e-6) are not overridable here and cost nothing different: the two sides differ in those numbers only.
MODEL = ["model.layers=6", "model.hidden=256", "model.heads=16", "model.kv_heads=16", "model.ffn_hidden=768", "model.vocab=2048"]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def settings(args, run_dir: str, world: int) -> list[str]:
    return [*MODEL, f"train.steps={args.steps}", f"train.seq_len={args.seq}",
            f"train.global_batch={args.batch}", f"train.microbatch={args.batch // world}", "train.eval_every=0",
            "train.progress=false", "train.log_every=1000000", "train.deterministic=false",
            'train.dtype="fp32"', "checkpoint.interval=0", "checkpoint.save_final=false",
            "metrics.tensorboard=false", f'metrics.run_dir="{run_dir}"', f'data.prepared_dir="{args.data}"',
            "data.vocab_size=2048", "data.max_source_bytes=2000000",
            *([f"parallel.dp={world}", 'parallel.dp_kind="fsdp"'] if world > 1 else [])]


def _point_torchtitan_at(device_type: str) -> None:
    """torchtitan picks its device once at import (tools/utils.py: the available accelerator, else "cuda") and
    its mesh code reads that module global; on a host without an accelerator we point it at the host device."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils

    if available_accelerator() is None:
        parallel_dims.device_type = dist_utils.device_type = device_type


def torchtitan_model(world: int):
    """torchtitan's debugmodel, parallelised by torchtitan (FSDP2 over all ranks), initialised by torchtitan."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs, parallelize_llama

    _point_torchtitan_at(host().type)
    cfg = llama3_configs["debugmodel"]("flex")
    for layer in cfg.layers:  # see the module docstring: the causal SDPA block instead of FlexAttention on CPU
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        model = cfg.build()
    # the classic FSDP2 path (fully_shard per block, plain tensors outside the data-parallel mesh); 0.3.0's default
    # "spmd_types" backend is a newer typed-DTensor path, and paratrain's FSDP is the classic one too
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", data_parallel_shard_degree=world)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    training = TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32")
    parallelize_llama(model, parallel_dims=dims, training=training, parallelism=parallelism,
                      compile_config=CompileConfig(), ac_config=None, dump_folder=tempfile.gettempdir())
    if available_accelerator() is None:
        # torchtitan sets FSDP's gradient divide factor to 1.0 (it normalises the loss by the global token count
        # itself), which FSDP2 reduces with PREMUL_SUM; gloo has no PREMUL_SUM, and with a factor of 1 a plain
        # SUM is the same reduction
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=host())
    with torch.no_grad():
        model.init_states(buffer_device=None)
    return model


def torchtitan_loop(args, rank: int, world: int) -> dict:
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.utils import clip_grad_norm_

    cfg = load_config(None, settings(args, tempfile.mkdtemp(), world))
    torch.manual_seed(cfg.train.seed)
    model = torchtitan_model(world)
    params = sum(p.numel() for p in model.parameters())  # FSDP parameters are DTensors: numel() is global
    o = cfg.optim
    groups = [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=True)
    data = TokenWindows(cfg.data.prepared_dir, "train", cfg.train.seq_len)
    sampler = GlobalSampler(data.num_samples, cfg.train.global_batch, cfg.train.seed)
    timed, global_tokens = 0.0, cfg.train.global_batch * cfg.train.seq_len
    for step in range(args.steps):
        t0 = time.perf_counter()
        x, y = data.batch(sampler.next_indices(rank, world))
        loss = cross_entropy_loss(model(x), y) / global_tokens  # torchtitan: sum over tokens / global tokens
        loss.backward()
        clip_grad_norm_(list(model.parameters()), o.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        if step >= args.warmup:
            timed += time.perf_counter() - t0
    tokens = (args.steps - args.warmup) * cfg.train.global_batch * cfg.train.seq_len
    return {"tokens_per_s": tokens / timed, "params": params}


def paratrain_loop(args, rank: int, world: int) -> dict:
    from paratrain.model.llama import Llama
    from paratrain.train.loop import train

    cfg = load_config(None, settings(args, args.run_dir, world))
    train(cfg)
    with torch.device("meta"):
        params = sum(p.numel() for p in Llama(cfg.model_shape()).parameters())
    if rank:  # rank 0 writes the metrics
        return {"tokens_per_s": float("nan"), "params": params}
    steps = [r for r in map(json.loads, open(f"{args.run_dir}/metrics.jsonl")) if "step_time_s" in r
             and r["step"] > args.warmup]
    tokens_per_s = sum(r["tokens_per_s"] * r["step_time_s"] for r in steps) / sum(r["step_time_s"] for r in steps)
    return {"tokens_per_s": tokens_per_s, "params": params}


SIDES = {"torchtitan": torchtitan_loop, "paratrain": paratrain_loop}


def worker(rank: int, side: str, args, world: int, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if args.torchtitan_path:
        sys.path.insert(0, args.torchtitan_path)
    import torch.distributed as dist

    if side == "torchtitan":  # paratrain's train() sets up its own process group from the same variables
        dist.init_process_group(rank=rank, world_size=world)  # torch's default backend for this device
    base = _rss_bytes()
    out = SIDES[side](args, rank, world)
    out.update(rank=rank, peak_rss_bytes=_peak_rss_bytes(), growth_rss_bytes=_peak_rss_bytes() - base)
    if dist.is_initialized():
        dist.destroy_process_group()
    queue.put(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_side(side: str, args, world: int) -> dict:
    args.run_dir = tempfile.mkdtemp(prefix="paratrain-vs-tt-")  # a fresh run each time (it would resume)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(r, side, args, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = []
    while len(results) < world:  # a rank that dies never reports: stop at once instead of waiting forever
        try:
            results.append(queue.get(timeout=5))
        except queue_module.Empty:
            if failed := [p.exitcode for p in procs if p.exitcode]:
                raise SystemExit(f"{side}, world {world}: a rank exited with {failed[0]} (its traceback above)") from None
    for p in procs:
        p.join()
    shutil.rmtree(args.run_dir, ignore_errors=True)
    rank0 = min(results, key=lambda r: r["rank"])
    return {"tokens_per_s": rank0["tokens_per_s"], "params": rank0["params"],
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in results),
            "growth_rss_bytes": max(r["growth_rss_bytes"] for r in results)}


def check_torchtitan(path: str | None) -> str | None:
    if path:
        sys.path.insert(0, path)
    try:
        import torchtitan  # noqa: F401
    except ImportError as e:
        return f"torchtitan is not installed ({e}); pip install torchtitan==0.3.0, or --torchtitan-path DIR"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2], help="world sizes to compare (FSDP when > 1)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the timing on both sides")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--torchtitan-path", default=None, help="directory holding an unpacked torchtitan wheel")
    ap.add_argument("--json", action="store_true", help="print only the JSON summary")
    args = ap.parse_args(argv)
    if (why := check_torchtitan(args.torchtitan_path)) is not None:
        print(why, file=sys.stderr)
        return 2
    args.data = tempfile.mkdtemp(prefix="paratrain-vs-tt-data-")
    prepare(load_config(None, settings(args, args.data, 1)).data, log=lambda *_: None)
    say = (lambda *_: None) if args.json else print
    summary = {}
    for world in args.world:
        rounds = []
        for r in range(args.rounds):
            tt, ours = run_side("torchtitan", args, world), run_side("paratrain", args, world)
            if tt["params"] != ours["params"]:
                raise SystemExit(f"not the same model: torchtitan {tt['params']:,} vs paratrain "
                                 f"{ours['params']:,} parameters")
            rounds.append((ours, tt))
            say(f"world {world} round {r + 1}: torchtitan {tt['tokens_per_s']:,.0f} tok/s, "
                f"peak RSS {tt['peak_rss_bytes'] / 2**20:,.0f} MiB (+{tt['growth_rss_bytes'] / 2**20:,.0f}); "
                f"paratrain {ours['tokens_per_s']:,.0f} tok/s, peak RSS {ours['peak_rss_bytes'] / 2**20:,.0f} MiB "
                f"(+{ours['growth_rss_bytes'] / 2**20:,.0f}); ratio {ours['tokens_per_s'] / tt['tokens_per_s']:.3f}")
        speed = statistics.median(o["tokens_per_s"] / t["tokens_per_s"] for o, t in rounds)
        memory = statistics.median(o["peak_rss_bytes"] / t["peak_rss_bytes"] for o, t in rounds)
        growth = statistics.median(o["growth_rss_bytes"] / t["growth_rss_bytes"] for o, t in rounds)
        summary[f"world_{world}"] = {"params": rounds[0][0]["params"], "tokens_per_s_ratio": speed,
                                     "peak_rss_ratio": memory, "rss_growth_ratio": growth,
                                     "rounds": [{"paratrain": o, "torchtitan": t} for o, t in rounds]}
        say(f"world {world}: paratrain/torchtitan median tokens/s ratio {speed:.3f}, peak RSS ratio {memory:.3f}, "
            f"RSS growth ratio {growth:.3f} ({args.rounds} rounds, load {os.getloadavg()[0]:.1f})")
    shutil.rmtree(args.data, ignore_errors=True)
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
