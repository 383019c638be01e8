"""Checkpoint I/O: save and load throughput vs a plain copy of the same bytes on the same disk, and the time the
training loop is blocked by a save, asynchronous vs synchronous.

  save MB/s   CheckpointManager.save (DCP shards + fsync + sha256 read-back + manifest), vs copying the same
              files with shutil + fsync (what any checkpoint must at least cost on this disk)
  load MB/s   CheckpointManager.resume (manifest checksum verification + DCP load into the live model and
              optimizer), vs reading the same files into memory
  blocked     seconds the loop spends inside save() per checkpoint while it trains (save every --every steps):
              sync = the whole save; async = staging a CPU copy + waiting for the previous save, if unfinished

Rounds alternate and medians are reported, since this machine is shared and noisy. The files were just written,
so both the load and the plain read are served mostly from the page cache (the ratio compares like with like).

    .venv/bin/python benchmarks/checkpoint_io.py [--preset small] [--rounds 3] [--dir /path/on/disk] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from paratrain.model.config import PRESETS
from paratrain.model.llama import Llama
from paratrain.train.checkpoint import CheckpointManager, step_name


def build(preset: str, seed: int = 0):
    model = Llama(PRESETS[preset])
    model.init_weights(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def train_step(model, opt, batch: int = 2, seq: int = 64) -> None:
    tokens = torch.randint(0, 4096, (batch, seq + 1))  # both presets have vocab 4096
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def quiet(_msg: str) -> None:
    pass


def copy_with_fsync(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        with open(f, "rb") as fin, open(dst / f.name, "wb") as fout:
            shutil.copyfileobj(fin, fout, 8 << 20)
            fout.flush()
            os.fsync(fout.fileno())


def read_all(folder: Path) -> int:
    n = 0
    for f in folder.iterdir():
        with open(f, "rb") as fh:
            while chunk := fh.read(8 << 20):
                n += len(chunk)
    return n


def one_round(root: Path, model, opt) -> dict:
    ckpt_dir = root / "ckpt"
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    mgr = CheckpointManager(ckpt_dir, keep=1, log=quiet)
    t0 = time.perf_counter()
    mgr.save(1, [model], opt, {"step": 1})
    save_s = time.perf_counter() - t0
    folder = ckpt_dir / step_name(1)
    nbytes = sum(f.stat().st_size for f in folder.iterdir())
    shutil.rmtree(ckpt_dir)
    t0 = time.perf_counter()
    CheckpointManager(ckpt_dir, keep=1, verify="size", log=quiet).save(1, [model], opt, {"step": 1})
    save_size_only_s = time.perf_counter() - t0
    copy_dst = root / "copy"
    shutil.rmtree(copy_dst, ignore_errors=True)
    t0 = time.perf_counter()
    copy_with_fsync(folder, copy_dst)
    copy_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    read_all(copy_dst)
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    CheckpointManager(ckpt_dir, keep=1, log=quiet).resume([model], opt)
    load_s = time.perf_counter() - t0
    mb = nbytes / 1e6
    return {"bytes": nbytes, "save_MBps": mb / save_s, "save_size_only_MBps": mb / save_size_only_s, "copy_MBps": mb / copy_s, "load_MBps": mb / load_s,
            "read_MBps": mb / read_s}


def blocked_time(root: Path, model, opt, async_save: bool, steps: int, every: int) -> dict:
    ckpt_dir = root / ("async" if async_save else "sync")
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    mgr = CheckpointManager(ckpt_dir, keep=2, async_save=async_save, log=quiet)
    blocked, t_start = [], time.perf_counter()
    for step in range(1, steps + 1):
        train_step(model, opt)
        if step % every == 0:
            t0 = time.perf_counter()
            mgr.save(step, [model], opt, {"step": step})
            blocked.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    mgr.close()
    drain_s = time.perf_counter() - t0
    return {"blocked_s_per_save": statistics.median(blocked), "loop_wall_s": time.perf_counter() - t_start,
            "final_drain_s": drain_s, "saves": len(blocked)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=["tiny", "small"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12, help="training steps per blocked-time measurement")
    ap.add_argument("--every", type=int, default=3, help="save every N steps in the blocked-time measurement")
    ap.add_argument("--dir", default=None, help="folder on the disk to measure (default: a temp folder)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    model, opt = build(args.preset)
    train_step(model, opt)  # optimizer state exists: the checkpoint holds params + 2 Adam moments
    io_rounds, block_rounds = [], []
    try:
        for _ in range(args.rounds):
            io_rounds.append(one_round(root, model, opt))
            sync = blocked_time(root, model, opt, False, args.steps, args.every)
            asyn = blocked_time(root, model, opt, True, args.steps, args.every)
            block_rounds.append((sync, asyn))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in io_rounds) for k in io_rounds[0]}
    sync_b = statistics.median(s["blocked_s_per_save"] for s, _ in block_rounds)
    async_b = statistics.median(a["blocked_s_per_save"] for _, a in block_rounds)
    result = {
        "preset": args.preset, "checkpoint_MB": med["bytes"] / 1e6, "rounds": args.rounds,
        "save_MBps": med["save_MBps"], "plain_copy_MBps": med["copy_MBps"],
        "save_vs_copy": med["save_MBps"] / med["copy_MBps"],
        "save_size_only_MBps": med["save_size_only_MBps"],
        "save_size_only_vs_copy": med["save_size_only_MBps"] / med["copy_MBps"],
        "load_MBps": med["load_MBps"], "plain_read_MBps": med["read_MBps"],
        "load_vs_read": med["load_MBps"] / med["read_MBps"],
        "sync_blocked_s_per_save": sync_b, "async_blocked_s_per_save": async_b,
        "async_vs_sync_blocked": async_b / sync_b,
        "loop_wall_s_sync": statistics.median(s["loop_wall_s"] for s, _ in block_rounds),
        "loop_wall_s_async": statistics.median(a["loop_wall_s"] for _, a in block_rounds),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"checkpoint of preset {args.preset!r}: {result['checkpoint_MB']:.1f} MB (params + AdamW moments), "
          f"median of {args.rounds} rounds")
    print(f"save  {result['save_MBps']:8.1f} MB/s   plain copy+fsync {result['plain_copy_MBps']:8.1f} MB/s   "
          f"ratio {result['save_vs_copy']:.2f}")
    print(f"save  {result['save_size_only_MBps']:8.1f} MB/s   (checkpoint.verify=\"size\": no sha256 read-back)     "
          f"ratio {result['save_size_only_vs_copy']:.2f}")
    print(f"load  {result['load_MBps']:8.1f} MB/s   plain read       {result['plain_read_MBps']:8.1f} MB/s   "
          f"ratio {result['load_vs_read']:.2f}")
    print(f"loop blocked per save: sync {sync_b:.3f} s, async {async_b:.3f} s   ratio async/sync "
          f"{result['async_vs_sync_blocked']:.2f}")
    print(f"loop wall time ({args.steps} steps, save every {args.every}): sync {result['loop_wall_s_sync']:.2f} s, "
          f"async {result['loop_wall_s_async']:.2f} s")


if __name__ == "__main__":
    main()
