"""Expert parallelism on the tiny MoE block: tokens/s and all-to-all time for EP 1/2/4, as ratios to EP 1.

For each EP degree the script launches `torchrun --nproc-per-node EP` on itself (worker mode). Every rank builds
the tiny-moe preset's MoE block (8 experts of width 96, top 2, 1 shared expert, hidden 128) with the same weights,
draws its own `--tokens` tokens (EP reuses data-parallel ranks: each rank routes different tokens), and times
`--steps` forward+backward passes after one warm-up (ranks barriered around each; the slowest rank's wall time).
EP 1 is the single-device block (`paratrain.model.moe.MoE`); EP > 1 is `paratrain.parallel.expert.ExpertParallelMoE`.
All-to-all time: the four exchanges of one step (dispatch and combine, forward and backward) re-run alone with the
step's split sizes, median of `--steps`. tokens/s = global tokens / step time; per rank the work per token is the
same at every degree, so on an idle machine with >= EP free cores the ideal ratio is EP (weak scaling).

    .venv/bin/python benchmarks/moe.py [--tokens 2048] [--steps 5] [--ep 1 2 4] [--json]
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


def _block(ep: int, device_type: str):
    from paratrain.model.config import PRESETS
    from paratrain.model.moe import MoE

    torch.manual_seed(0)
    block = MoE(PRESETS["tiny-moe"])
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    if ep == 1:
        return block
    from torch.distributed.device_mesh import init_device_mesh

    from paratrain.parallel.expert import ExpertParallelMoE

    mesh = init_device_mesh(device_type, (ep,), mesh_dim_names=("ep",))  # the layer parallelize() builds
    return ExpertParallelMoE(block, mesh, ("ep",))


def _a2a_time(block, x: torch.Tensor) -> float:
    """The step's four exchanges alone (sizes of this rank's dispatch), in seconds."""
    from paratrain.model.moe import route, sort_by_expert
    from paratrain.parallel.expert import all_to_all_single

    with torch.no_grad():
        routing = route(block.router(x), block.cfg)
        _, _, counts = sort_by_expert(routing, block.cfg.num_experts)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts)
    send = counts.view(block.ep, block.local).sum(1).tolist()
    got = recv.view(block.ep, block.local).sum(1).tolist()
    rows = torch.randn(sum(send), x.shape[1])
    dist.barrier()
    t0 = time.perf_counter()
    for a, b in ((got, send), (send, got), (got, send), (send, got)):  # dispatch, combine; their backwards
        inp = rows if sum(b) == rows.shape[0] else torch.randn(sum(b), x.shape[1])
        all_to_all_single(inp.new_empty(sum(a), x.shape[1]), inp, a, b)
    return time.perf_counter() - t0


def worker(args) -> None:
    from paratrain.parallel.mesh import init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    env = init_distributed("cpu")
    ep = env.world_size
    block = _block(ep, env.device.type)
    x = torch.randn(args.tokens, block.cfg.hidden, generator=torch.Generator().manual_seed(env.rank))
    steps, a2a = [], []
    for i in range(args.steps + 1):
        if ep > 1:
            dist.barrier()
        t0 = time.perf_counter()
        block(x.requires_grad_(True)).square().mean().backward()
        if ep > 1:
            dist.barrier()
        if i:
            steps.append(time.perf_counter() - t0)
            a2a.append(_a2a_time(block, x.detach()) if ep > 1 else 0.0)
    if env.rank == 0:
        print(json.dumps({"ep": ep, "step_s": statistics.median(steps), "a2a_s": statistics.median(a2a),
                          "tokens_per_s": ep * args.tokens / statistics.median(steps)}))
    shutdown_distributed()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank and step")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--json", action="store_true", help="print only JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    rows = []
    for ep in args.ep:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ep}", f"--master-port={_port()}",
               __file__, "--worker", "--tokens", str(args.tokens), "--steps", str(args.steps)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
        rows.append(json.loads([line for line in out.splitlines() if line.startswith("{")][-1]))
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["tokens_per_s_ratio"] = r["tokens_per_s"] / base
        r["a2a_share_of_step"] = r["a2a_s"] / r["step_s"]
    loadavg = open("/proc/loadavg").read().split()[0]
    if args.json:
        print(json.dumps({"rows": rows, "loadavg": loadavg}))
        return
    print(f"tiny-moe block, {args.tokens} tokens/rank, load average {loadavg}")
    print("ep  step_s   tokens/s  ratio_vs_ep1  a2a_s    a2a/step")
    for r in rows:
        print(f"{r['ep']:<3} {r['step_s']:.4f}  {r['tokens_per_s']:9.0f}  {r['tokens_per_s_ratio']:12.2f}  "
              f"{r['a2a_s']:.5f}  {r['a2a_share_of_step']:.2f}")


if __name__ == "__main__":
    main()
