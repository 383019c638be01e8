"""Speed and sanity of the request-level serving simulator (sim/serving.py): one replica swept over 20 arrival
rates from 5% to 120% of its analytic capacity; prints each rate's throughput / offered ratio and p99 latency,
and the wall and CPU time of the whole sweep (goal: under 10 s; on a shared machine the CPU time is the
machine-independent part).

    python benchmarks/serving_sim.py                 # llama3-8b on one H100, 2000 requests per rate
    python benchmarks/serving_sim.py --model llama3-70b --hardware trn2.48xlarge --tp 16 --requests 1000
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from paratrain.hardware.catalog import resolve_system  # noqa: E402
from paratrain.model.config import load_model_config  # noqa: E402
from paratrain.plan.serve import Replica, operating_point  # noqa: E402
from paratrain.sim.serving import Engine, Slo, sweep  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--hardware", default="p5.48xlarge")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--output", type=int, default=256)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--max-seqs", type=int, default=256)
    args = parser.parse_args()
    model, system, rep = load_model_config(args.model), resolve_system(args.hardware), Replica(tp=args.tp)
    engine = Engine(max_seqs=args.max_seqs)
    cap = float(operating_point(model, system, rep, args.max_seqs, args.prompt, args.output)["requests_per_s"])
    rates = np.linspace(0.05, 1.2, 20) * cap
    start, cpu = time.perf_counter(), time.process_time()
    results = sweep(model, system, rep, rates, args.requests, args.prompt, args.output, engine,
                    Slo(ttft_s=1.0, itl_s=0.05))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    print(f"{model.name} on {system.name} tp {rep.tp}: {args.prompt}+{args.output} tokens, analytic capacity "
          f"{cap:.2f} req/s at {args.max_seqs} sequences")
    print(f"{'load':>5} {'rate':>7} {'thr/rate':>8} {'TTFT p50 ms':>11} {'p99 ms':>9} {'ITL p99 ms':>10} "
          f"{'batch':>6} {'SLO ok':>6} {'events':>7}")
    for rate, r in results:
        print(f"{rate / cap:>5.2f} {rate:>7.2f} {r.throughput_rps / rate:>8.3f} {r.ttft_s['p50'] * 1e3:>11.1f} "
              f"{r.ttft_s['p99'] * 1e3:>9.1f} {r.itl_s['p99'] * 1e3:>10.2f} {r.mean_batch:>6.1f} "
              f"{r.slo_attainment:>6.1%} {r.events:>7}")
    events = sum(r.events for _, r in results)
    print(f"20 rates x {args.requests} requests in {seconds:.2f} s wall, {cpu:.2f} s CPU "
          f"({events / cpu:,.0f} events per CPU-second); load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
