"""Helpers of benchmarks/accelerator_check.sh: the bare PyTorch baseline, the catalog system of this machine's
accelerator, and the report.

  bare    a plain PyTorch training loop of the same model (paratrain.model.llama.Llama, the single-device
          reference: no parallel code), same optimizer (AdamW, foreach), same bf16 autocast, same clipping,
          random tokens already on the device (no data loader): what paratrain's runner, metrics and data path
          cost is the paratrain/bare throughput ratio.
  system  the hardware catalog system whose chip this machine has (for MFU against the catalog peak).
  report  one table from the runs' outputs: tokens/s (median step after warm-up), MFU, peak memory, ratio.

Run through the shell script; `python benchmarks/accelerator_check.py --help` for each part.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

WARMUP_STEPS = 10  # excluded from the medians: allocator growth, kernel selection, the first optimizer step


def model_config(args):
    from paratrain.model.config import ModelConfig

    return ModelConfig(name="check", layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                       ffn_hidden=args.ffn_hidden, vocab=args.vocab, max_seq=args.seq, tie_embeddings=True)


def bare(args) -> dict:
    """The baseline loop; returns median step time, tokens/s and peak memory."""
    import torch

    from paratrain import device as dev
    from paratrain.model.llama import Llama, cross_entropy_loss

    device = dev.pick_device(args.device, 0)
    torch.manual_seed(0)
    model = Llama(model_config(args))
    model.init_weights(0)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    dtype = torch.bfloat16 if args.dtype == "bf16" else None
    times = []
    dev.reset_peak_memory(device)
    for _ in range(args.steps):
        dev.synchronize(device)
        t0 = time.perf_counter()
        with dev.autocast(device, dtype):
            loss = cross_entropy_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dev.synchronize(device)
        times.append(time.perf_counter() - t0)
    steady = times[min(WARMUP_STEPS, len(times) - 1):]
    step_s = statistics.median(steady)
    return {"run": "bare PyTorch, 1 device", "world_size": 1, "step_time_s": step_s,
            "tokens_per_s": args.batch * args.seq / step_s, "memory_bytes": dev.peak_memory_bytes(device),
            "loss_last": float(loss.detach()), "params": sum(p.numel() for p in model.parameters())}


def paratrain_run(run_dir: str, label: str) -> dict:
    """A `paratrain train` run's numbers from its metrics.jsonl (median step after warm-up, as `bare`)."""
    rows = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step_time_s" in r]
    steady = steps[min(WARMUP_STEPS, len(steps) - 1):]
    summary = json.loads(Path(run_dir, "summary.json").read_text())
    world = summary["world_size"]
    step_s = statistics.median(r["step_time_s"] for r in steady)
    tokens = summary["global_batch"] * summary["seq_len"]
    return {"run": label, "world_size": world, "step_time_s": step_s, "tokens_per_s": tokens / step_s,
            "memory_bytes": max(r["memory_bytes"] for r in steps), "loss_last": steps[-1]["loss"]}


def catalog_system(device_type: str, device_name: str) -> str:
    """The catalog system whose chip this device is (its display name's model token in the device's name),
    preferring the system with the most devices per node. '' when none matches."""
    from paratrain.hardware.catalog import get_catalog

    name = device_name.lower()
    best = ("", -1)
    for sys_name, system in get_catalog().systems.items():
        chip = system.chip.display_name.lower().replace("nvidia ", "").replace("aws ", "")
        token = chip.split()[0] if chip else ""
        if token and token in name and system.devices_per_node > best[1] and "ultraserver" not in sys_name:
            best = (sys_name, system.devices_per_node)
    return best[0]


def device_name(device_type: str) -> str:
    import torch

    module = torch.get_device_module(device_type)
    getter = getattr(module, "get_device_name", None)
    return getter(0) if getter is not None else device_type


def report(args) -> str:
    from paratrain.hardware.catalog import resolve_system
    from paratrain.model.config import ModelConfig

    runs = [json.loads(Path(p).read_text()) for p in args.runs]
    cfg = ModelConfig(**json.loads(Path(args.model_json).read_text()))
    flops_per_token = cfg.train_flops_per_token(args.seq)
    peak = resolve_system(args.hardware).device_peak_flops if args.hardware else None
    bare_tps = next((r["tokens_per_s"] for r in runs if r["run"].startswith("bare")), None)
    lines = [f"model {cfg.num_params() / 1e6:,.1f}M parameters, seq {args.seq}, "
             f"MFU against {'the catalog peak of ' + args.hardware if peak else 'no catalog peak (unknown device)'}",
             f"{'run':<34} {'ranks':>5} {'tokens/s':>12} {'tok/s/rank':>11} {'MFU':>6} {'peak mem GiB':>12} "
             f"{'vs bare':>8}"]
    for r in runs:
        per_rank = r["tokens_per_s"] / r["world_size"]
        mfu = f"{flops_per_token * per_rank / peak:.1%}" if peak else "-"
        ratio = f"{per_rank / bare_tps:.3f}" if bare_tps else "-"
        lines.append(f"{r['run']:<34} {r['world_size']:>5} {r['tokens_per_s']:>12,.0f} {per_rank:>11,.0f} {mfu:>6} "
                     f"{r['memory_bytes'] / 2**30:>12.1f} {ratio:>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bare", help="the bare PyTorch baseline; JSON to --out")
    for flag, default in (("layers", 16), ("hidden", 2048), ("heads", 32), ("kv_heads", 8), ("ffn_hidden", 8192),
                          ("vocab", 128256), ("seq", 2048), ("batch", 8), ("steps", 200)):
        b.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=int, default=default)
    b.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    b.add_argument("--device", default="auto")
    b.add_argument("--out", required=True)
    s = sub.add_parser("system", help="print the catalog system of this machine's accelerator ('' if none)")
    s.add_argument("--device", default="auto")
    pr = sub.add_parser("paratrain", help="a paratrain run's numbers (metrics.jsonl + summary.json); JSON to --out")
    pr.add_argument("--run-dir", required=True)
    pr.add_argument("--label", required=True)
    pr.add_argument("--out", required=True)
    r = sub.add_parser("report", help="the table")
    r.add_argument("runs", nargs="+")
    r.add_argument("--model-json", required=True, help="the model shape (ModelConfig fields) as JSON")
    r.add_argument("--seq", type=int, required=True)
    r.add_argument("--hardware", default="", help="catalog system for the peak ('' = no MFU)")
    args = p.parse_args(argv)
    if args.cmd == "bare":
        Path(args.out).write_text(json.dumps(bare(args)))
    elif args.cmd == "paratrain":
        Path(args.out).write_text(json.dumps(paratrain_run(args.run_dir, args.label)))
    elif args.cmd == "system":
        from paratrain.device import Accelerator, resolve_device_type

        kind = resolve_device_type(args.device, Accelerator.detect())
        print(catalog_system(kind, device_name(kind)) if kind != "cpu" else "")
    else:
        print(report(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
