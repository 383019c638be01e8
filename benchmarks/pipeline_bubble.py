"""Measured pipeline bubble (idle fraction) of each schedule, beside the theory.

Method. The real PipelineRunner (paratrain.parallel.pipeline, torch.distributed.pipelining schedules, gloo)
runs a tiny Llama whose compute is negligible; each pipeline action is given a fixed cost by sleeping inside
the stage's action methods, so the schedule's structure, not CPU contention between ranks on this small
machine, decides the timing:
  * per rank and microbatch: forward t_f, backward 2 t_f (the usual B = 2F);
  * a rank holding v chunks (interleaved: virtual_stages; V schedules: 2) pays t_f / v per chunk forward and
    2 t_f / v per chunk backward; the zero-bubble schedules split that backward into input-gradient (I) and
    weight-gradient (W) halves, F = I = W = t_f / 2 per chunk (the condition under which ZB-V is bubble-free).
Busy time of a rank = wall time spent inside its forward/backward/weight actions; the step's wall time is
taken between barriers; idle fraction = 1 - busy / wall, averaged over ranks, median over measured steps.
Beside the closed-form theory, "sched-sim" replays the action lists the schedule executes (torch's own for
the multi-stage schedules) with the same fixed costs and free messages: where it equals the theory, the
schedule attains the theory and any measured excess is runtime cost (messages, Python, CPU sharing).

Theory (p stages' worth of ranks, m microbatches):
  * GPipe, 1F1B:           (p-1) / (m + p - 1)
  * interleaved 1F1B (v):  (p-1) / (v m + p - 1)
  * ZB-V / DualPipeV:      (p-1) / (6 m + p - 1). Derivation: with F = I = W = c per chunk, a rank does
    2 chunks x 3 ops = 6c per microbatch, 6mc per step. Rank p-1 cannot start before microbatch 0 has passed
    p-1 chunk forwards, (p-1)c, so the step takes at least (p-1)c + 6mc and every rank idles at least (p-1)c
    of it. Deferred W work fills the drain, so this fill is all that is left; replaying torch's ZBV and
    DualPipeV action lists (below) gives exactly this value.

Run:  python benchmarks/pipeline_bubble.py [--tf-ms 50] [--steps 3] [--factors 1 2 4 8] [--schedules ...] [--json]
          [--save rows.json] [--load rows.json] [--plot bubble.png]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev")
MICROBATCH_FACTORS = (1, 2, 4, 8)  # m = factor x p; the V schedules start at 2p (they need m >= 2p)
VIRTUAL = 2  # chunks per rank for interleaved_1f1b


def layout_of(schedule: str, p: int, m: int):
    from paratrain.parallel.pipeline import PipelineLayout

    chunks = 1 if schedule in ("gpipe", "1f1b") else 2
    return PipelineLayout(pp=p, chunks_per_rank=chunks, layers_per_stage=(1,) * (p * chunks), microbatches=m,
                          pp_schedule=schedule)


def ideal(schedule: str, p: int, m: int) -> tuple[float, float]:
    """(closed-form theory, simulation of the schedule's own action lists with the same fixed costs)."""
    from paratrain.parallel.pipeline import ideal_idle_fraction, schedule_action_lists, theory_idle_fraction

    layout = layout_of(schedule, p, m)
    v = layout.chunks_per_rank
    cost = {"F": 1 / v, "B": 2 / v, "I": 1 / v, "W": 1 / v}
    sim = ideal_idle_fraction(schedule_action_lists(layout), layout.num_stages, cost)
    return theory_idle_fraction(layout), sim


def cases(p: int, factors=MICROBATCH_FACTORS, schedules=SCHEDULES) -> list[tuple[str, int]]:
    out = []
    for schedule in schedules:
        for f in factors:
            m = f * p
            if schedule in ("zbv", "dualpipev") and m < 2 * p:
                continue
            out.append((schedule, m))
    return out


def _config(schedule: str, p: int, m: int):
    from paratrain.config import load_config

    chunks = 1 if schedule in ("gpipe", "1f1b") else 2
    extra = [f"parallel.virtual_stages={VIRTUAL}"] if schedule == "interleaved_1f1b" else []
    return load_config(None, [
        'model.preset="tiny"', f"model.layers={p * chunks}", "model.hidden=32", "model.heads=2", "model.kv_heads=2",
        "model.ffn_hidden=64", "model.vocab=64", "train.seq_len=16", "train.microbatch=1",
        f"train.global_batch={m}", f"parallel.pp={p}", "parallel.dp=1", f'parallel.pp_schedule="{schedule}"',
        *extra])


class ActionClock:
    """Wraps a PipelineStage's action methods: adds the fixed cost and sums the time spent inside them."""

    def __init__(self, stage, f_s: float, i_s: float, w_s: float):
        self.busy_s = 0.0
        fwd, bwd, wgt = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

        def forward_one_chunk(*args, **kwargs):
            return self._timed(fwd, f_s, args, kwargs)

        def backward_one_chunk(*args, **kwargs):
            full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)
            return self._timed(bwd, i_s + w_s if full else i_s, args, kwargs)

        def backward_weight_one_chunk(*args, **kwargs):
            return self._timed(wgt, w_s, args, kwargs)

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk

    def _timed(self, fn, cost_s, args, kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        time.sleep(cost_s)
        self.busy_s += time.perf_counter() - t0
        return out


def _pipeline_stages(schedule) -> list:
    return list(schedule._stages) if hasattr(schedule, "_stages") else [schedule._stage]


def measure(schedule_name: str, p: int, m: int, tf_s: float, steps: int) -> dict:
    """Run on every rank; returns this rank's idle fractions per measured step."""
    from paratrain.parallel import parallelize
    from paratrain.parallel.mesh import DistEnv, build_mesh
    from paratrain.train.loop import _build_model

    cfg = _config(schedule_name, p, m)
    env = DistEnv(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=dist.get_rank(),
                  device=torch.device("cpu"))
    model = _build_model(cfg, cfg.model_shape())
    runner = parallelize(model, cfg, build_mesh(cfg.parallel, env), env)
    chunks = runner.layout.chunks_per_rank
    f_s = tf_s / chunks
    i_s = w_s = tf_s / chunks  # backward = I + W = 2 F per chunk
    clocks = [ActionClock(s, f_s, i_s, w_s) for s in _pipeline_stages(runner.schedule)]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (m, 17), generator=g)
    idle = []
    for step in range(steps + 1):  # the first step also runs the schedule's shape inference: not measured
        for c in clocks:
            c.busy_s = 0.0
        dist.barrier()
        t0 = time.perf_counter()
        runner.forward_backward(tokens[:, :-1], tokens[:, 1:])
        dist.barrier()
        wall = time.perf_counter() - t0
        for part in runner.parts:
            part.zero_grad(set_to_none=True)
        if step > 0:
            idle.append(1 - sum(c.busy_s for c in clocks) / wall)
    return {"idle": idle}


def _worker(rank: int, world: int, store_path: str, tf_s: float, steps: int, factors, out_path: str,
            schedules=SCHEDULES) -> None:
    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    rows = []
    for schedule, m in cases(world, factors, schedules):
        result = measure(schedule, world, m, tf_s, steps)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, result["idle"])
        # Per step: mean over ranks; then the median over steps.
        measured = statistics.median(statistics.fmean(r[s] for r in per_rank) for s in range(steps))
        rows.append({"schedule": schedule, "p": world, "m": m, "measured_idle": measured})
        if rank == 0:
            print(f"  p={world} {schedule:<17} m={m:<3} measured {measured:6.3f}", file=sys.stderr, flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def run(p: int, tf_s: float, steps: int, factors=MICROBATCH_FACTORS, schedules=SCHEDULES) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(p, os.path.join(tmp, "store"), tf_s, steps, factors, out, schedules), nprocs=p,
                 join=True)
        with open(out) as f:
            return json.load(f)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = sorted({r["p"] for r in rows})
    fig, axes = plt.subplots(1, len(ps), figsize=(6 * len(ps), 4), squeeze=False)
    for ax, p in zip(axes[0], ps, strict=True):
        for i, schedule in enumerate(SCHEDULES):
            sel = [r for r in rows if r["p"] == p and r["schedule"] == schedule]
            color = f"C{i}"
            ax.plot([r["m"] for r in sel], [r["measured_idle"] for r in sel], "o-", color=color, label=schedule)
            ax.plot([r["m"] for r in sel], [r["theory_idle"] for r in sel], "--", color=color, alpha=0.6)
        ms = sorted({r["m"] for r in rows if r["p"] == p})
        ax.set(title=f"p = {p} (solid: measured, dashed: theory)", xlabel="microbatches m",
               ylabel="idle fraction", xscale="log")
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.minorticks_off()
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tf-ms", type=float, default=50.0, help="forward cost per rank and microbatch (ms)")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per case (after one warm-up step)")
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes to measure")
    ap.add_argument("--factors", type=int, nargs="+", default=list(MICROBATCH_FACTORS),
                    help="microbatch counts to measure, as multiples of p (V schedules skip m < 2p)")
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES,
                    help="schedules to measure (default: all)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    ap.add_argument("--plot", help="write measured vs theory to this PNG")
    ap.add_argument("--save", help="write the rows (measurements + theory) to this JSON file")
    ap.add_argument("--load", help="no measurement: print/plot rows saved earlier with --save")
    args = ap.parse_args(argv)
    if args.load:
        with open(args.load) as f:
            rows = json.load(f)
    else:
        rows = []
        for p in args.pp:
            n = len(cases(p, args.factors, args.schedules))
            print(f"measuring p={p} ({n} cases, t_f={args.tf_ms} ms)...", file=sys.stderr, flush=True)
            rows += run(p, args.tf_ms / 1000, args.steps, tuple(args.factors), tuple(args.schedules))
    for r in rows:
        r["theory_idle"], r["schedule_sim_idle"] = ideal(r["schedule"], r["p"], r["m"])
        r["ratio"] = r["measured_idle"] / r["theory_idle"]
    if args.save:
        with open(args.save, "w") as f:
            json.dump(rows, f, indent=1)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'schedule':<17} {'p':>2} {'m':>3} {'measured':>9} {'theory':>7} {'sched-sim':>9} {'ratio':>6}")
        for r in rows:
            print(f"{r['schedule']:<17} {r['p']:>2} {r['m']:>3} {r['measured_idle']:>9.3f} "
                  f"{r['theory_idle']:>7.3f} {r['schedule_sim_idle']:>9.3f} {r['ratio']:>6.2f}")
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
