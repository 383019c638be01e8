"""Stragglers on CPU/gloo: throughput of bounded staleness (s = 1, 2) and the time-budget mode against synchronous
data parallelism with a rank slowed on purpose, and convergence of the tiny model under each policy.

Every run is the real training loop (`paratrain.train.loop.train`) on forked gloo ranks, with the test-only fault
injection of `staleness.test_fault_injection`. The synchronous baseline is policy bounded_staleness with s = 0,
which tests/test_staleness.py shows bitwise identical to the runtime's DDP path (and it honours the injection).

Throughput runs add an emulated device time per microbatch on every rank (--base-s, a sleep) to a 1-layer model,
so the result reflects the policy rather than the CPU share a shared machine gives each rank.

Scenarios (delays sized from the measured healthy step time T):
  healthy    no injection
  jitter     every rank independently sleeps 1.0 T before a step with probability 0.25
  one_random rank 1 alone sleeps 1.0 T before a step with probability 0.25
  constant   rank 1 runs 2x slower all the time (sleeps as long as each microbatch's compute)

Printed per dp size and scenario: tokens/s per policy, the ratio to synchronous, and "hidden": the share of the
delay synchronous training loses that the policy recovers, (t_sync - t_policy) / (t_sync - t_floor). t_floor is
the healthy time plus the largest per-rank total of injected sleep: no policy that processes every sample can be
faster, since that rank must sleep through it. Bounded staleness can only hide waiting, never a rank's own delay:
it absorbs jitter spread across ranks; a single rank's delays (one_random, constant) are hidden only by the time
budget, which processes fewer of that rank's samples.

    .venv/bin/python benchmarks/stragglers.py                 # throughput at dp 2 and 4, convergence
    .venv/bin/python benchmarks/stragglers.py --quick         # fewer steps, rounds and seeds
    .venv/bin/python benchmarks/stragglers.py --json out.json # also write every measurement
    .venv/bin/python benchmarks/stragglers.py --skip throughput --lookahead-arrived --conv-fault jitter \
        --rows sync "s=1 lookahead_own" "s=1 optimizer_lookahead"   # own-gradient vs default lookahead, jittered
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import paratrain.train.loop  # noqa: F401 - imported before forking so ranks start warm
from paratrain.config import load_config
from paratrain.stragglers import FaultInjection
from paratrain.train.data import prepare

COMPENSATIONS = ("none", "weight_prediction", "optimizer_lookahead")  # staleness.compensation values

POLICIES = {  # name -> [staleness] overrides (compensation: the config default unless a row sets it)
    "sync": ['staleness.policy="bounded_staleness"', "staleness.max_staleness=0"],
    "s=1": ['staleness.policy="bounded_staleness"', "staleness.max_staleness=1"],
    "s=2": ['staleness.policy="bounded_staleness"', "staleness.max_staleness=2"],
    "budget": ['staleness.policy="time_budget"', "staleness.max_staleness=0"],
}
# Which policies run in which scenario: staleness where it can help (jitter), the time budget where only it can
# (one slow rank), sync everywhere as the baseline; s = 1 everywhere to show what it does and does not hide.
SCENARIO_POLICIES = {"healthy": ["sync", "s=1"], "jitter": ["sync", "s=1", "s=2"],
                     "one_random": ["sync", "s=1", "budget"], "constant": ["sync", "s=1", "budget"]}
SLEEP_PROBABILITY = 0.25
MIN_SLEEP_S = 0.05


def fault_specs(step_s: float, base_s: float) -> dict[str, str]:
    base = f"base_s={base_s}," if base_s > 0 else ""
    sleep = f"{base}sleep_s={step_s:.4f},probability={SLEEP_PROBABILITY}"
    return {"healthy": base.rstrip(","), "jitter": f"{sleep},rank=-1,seed=1", "one_random": f"{sleep},rank=1,seed=1",
            "constant": f"{base}slowdown=2.0,rank=1"}


# Throughput runs use a 1-layer tiny model on 32-token sequences plus an emulated device time per microbatch
# (--base-s, a sleep): the real compute is then small against the emulated one and the injected delays, so the
# policies, not the CPU share a shared 2-core machine gives each rank, decide the result. Convergence runs use
# the tiny preset as it is (4 layers) and real compute only.
THROUGHPUT_SHAPE = ["model.layers=1", "train.seq_len=32"]
SEQ_LEN = 64


def base_overrides(run_dir: Path, steps: int, seed: int, dp: int) -> list[str]:
    return [f"train.steps={steps}", f"train.seed={seed}", f"train.seq_len={SEQ_LEN}", "train.global_batch=16",
            "train.microbatch=2", "train.eval_every=0", "train.progress=false", "train.device=\"cpu\"",
            "optim.warmup_steps=10", "train.log_every=100000", f'metrics.run_dir="{run_dir}"', "metrics.tensorboard=false",
            "checkpoint.save_final=false", "checkpoint.resume=\"none\"", f"parallel.dp={dp}",
            'parallel.dp_kind="ddp"', "staleness.straggler_window=5"]


# -- running the training loop on forked gloo ranks ---------------------------------------------------------------


def _die_with_parent() -> None:
    """Linux: a rank gets SIGTERM when the benchmark process dies, instead of waiting forever on its peers."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _rank_main(rank: int, world: int, store_path: str, overrides: list[str], out) -> None:
    _die_with_parent()
    torch.set_num_threads(1)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the loop's step lines; the parent prints the results
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "OMP_NUM_THREADS": "1"})
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        summary = paratrain.train.loop.train(load_config(None, overrides))
        out.put((rank, {k: summary[k] for k in ("wall_s", "tokens", "steps", "last_loss")}))
    except BaseException as exc:  # noqa: BLE001 - report to the parent instead of hanging it
        out.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))
    finally:
        dist.destroy_process_group()


def run_training(world: int, overrides: list[str]) -> dict:
    """Train on `world` forked ranks; rank 0's summary plus the metrics it logged."""
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="stragglers-") as tmp:
        out = ctx.Queue()
        procs = [ctx.Process(target=_rank_main, args=(r, world, os.path.join(tmp, "store"), overrides, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=900) for _ in procs)
        for p in procs:
            p.join()
    errors = [r["error"] for r in results.values() if "error" in r]
    if errors:
        raise RuntimeError(errors[0])
    return results[0]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# -- throughput -------------------------------------------------------------------------------------------------


def injected_floor_s(spec: str, steps: int, world: int, step_s: float) -> float:
    """The largest per-rank total of injected sleep over the run (same seeded draws as the runner makes)."""
    fault = FaultInjection.parse(spec)
    if fault is None or fault.sleep_s == 0:
        return 0.0
    import random

    ranks = range(world) if fault.rank == -1 else [fault.rank]
    return max(sum(fault.sleep_s for t in range(steps)
                   if random.Random(f"{fault.seed}/{r}/{t}").random() < fault.probability) for r in ranks)


def throughput(world: int, steps: int, repeats: int, base_s: float, workdir: Path, progress,
               stale_set: list[str] = ()) -> dict:
    """Median wall time per (scenario, policy) over `repeats` rounds; each round runs every cell once, so slow
    drifts in machine load hit every policy alike. `stale_set`: overrides for the s = 1, 2 cells only."""
    healthy = fault_specs(0.0, base_s)["healthy"]
    emulate = [f'staleness.test_fault_injection="{healthy}"'] if healthy else []
    calib = run_training(world, base_overrides(workdir / f"dp{world}-calib", steps, 0, world) + THROUGHPUT_SHAPE
                         + POLICIES["sync"] + emulate)
    step_s = max(calib["wall_s"] / steps, MIN_SLEEP_S)
    specs = fault_specs(step_s, base_s)
    cells = [(sc, name) for sc in specs for name in SCENARIO_POLICIES[sc]]
    samples: dict = {cell: [] for cell in cells}
    for rep in range(repeats):
        for scenario, name in cells:
            run_dir = workdir / f"dp{world}-{scenario}-{name.replace(',', '_').replace('=', '')}-{rep}"
            spec = specs[scenario]
            fault = [f'staleness.test_fault_injection="{spec}"'] if spec else []
            stale = list(stale_set) if name.startswith("s=") else []
            res = run_training(world, base_overrides(run_dir, steps, 0, world) + THROUGHPUT_SHAPE + POLICIES[name]
                               + fault + stale)
            metrics = read_metrics(run_dir)
            samples[(scenario, name)].append({
                "wall_s": res["wall_s"], "tokens": res["tokens"],
                "max_staleness_seen": max((m["staleness"] or 0) for m in metrics),
                "flagged": sorted({r for m in metrics for r in m.get("stragglers", [])})})
            progress(f"dp={world} round {rep + 1}/{repeats} {scenario:<10} {name:<10} "
                     f"{res['tokens'] / res['wall_s']:>9,.0f} tok/s ({res['wall_s']:.1f} s)")
    rows: dict = {sc: {} for sc in specs}
    for (scenario, name), runs in samples.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        tokens = statistics.median(r["tokens"] for r in runs)
        rows[scenario][name] = {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
                                "runs_wall_s": [r["wall_s"] for r in runs],
                                "max_staleness_seen": max(r["max_staleness_seen"] for r in runs),
                                "flagged": sorted({f for r in runs for f in r["flagged"]})}
    healthy_s = rows["healthy"]["sync"]["wall_s"]
    for scenario, spec in specs.items():
        if scenario != "healthy":  # a 2x rank: only skipping its samples gets back to the healthy time
            rows[scenario]["_floor_s"] = healthy_s + injected_floor_s(spec, steps, world, step_s)
    return {"step_s_calibration": step_s, "sleep_s": step_s, "base_s": base_s, "specs": specs, "scenarios": rows}


def print_throughput(world: int, result: dict) -> None:
    print(f"\n## dp={world}: tokens/s (ratio to sync; hidden = share of sync's lost time recovered)")
    print(f"healthy step time {result['step_s_calibration'] * 1e3:.0f} ms (= the injected sleep); emulated device "
          f"time {result['base_s'] * 1e3:.0f} ms per microbatch on every rank")
    names = list(POLICIES)
    print(f"{'scenario':<11}" + "".join(f"{n:>22}" for n in names) + f"{'flagged (sync)':>16}")
    for scenario, row in result["scenarios"].items():
        sync = row["sync"]
        cells = []
        for n in names:
            if n not in row:
                cells.append(f"{'-':>22}")
                continue
            r = row[n]
            ratio = r["tokens_per_s"] / sync["tokens_per_s"]
            hidden = ""
            floor = row.get("_floor_s")
            if floor is not None and sync["wall_s"] > floor and n != "sync":
                hidden = f" {(sync['wall_s'] - r['wall_s']) / (sync['wall_s'] - floor):>4.0%}"
            cells.append(f"{r['tokens_per_s']:>9,.0f} {ratio:>5.2f}x{hidden:>6}")
        print(f"{scenario:<11}" + "".join(cells) + f"{str(sync['flagged']):>16}")


# -- convergence ---------------------------------------------------------------------------------------------


EXACT_ROW = "s=1 lookahead, 1 rank (exact)"
# optimizer_lookahead predicts with the reductions that arrived (waiting up to staleness.arrival_grace), the
# config's default; these rows predict with the rank's own gradients only (lookahead_arrived = false)
OWN_ROWS = {"s=1 lookahead_own": "s=1", "s=2 lookahead_own": "s=2"}


def conv_fault_spec(fault: str, sleep_s: float) -> str:
    """The convergence runs' injected delay: none, or the jitter scenario (every rank independently sleeps sleep_s
    before a step with probability SLEEP_PROBABILITY). Only timing-dependent rows (optimizer_lookahead with arrived reductions, the default) can change
    their numbers under it; the others compute the same losses, only slower."""
    if fault == "none":
        return ""
    return f"sleep_s={sleep_s},probability={SLEEP_PROBABILITY},rank=-1,seed=1"


BUDGET_ROW = "budget (rank 1 2x slow)"
BUDGET_SAME_TOKENS_ROW = "budget, same tokens (rank 1 2x slow)"


def convergence_runs(compensations: list[str], exact_row: bool = False, own_rows: bool = False,
                     fault_spec: str = "", rows: list[str] | None = None,
                     arrival_grace: float | None = None) -> dict[str, tuple[int, list[str]]]:
    """Row name -> (ranks, overrides): sync, s = 1 and 2 with each delay compensation, the time budget; optionally
    s = 1 with optimizer_lookahead on one rank (same global batch), where the prediction is exact up to clipping:
    what a perfect delay compensation would give, i.e. how far apart two equivalent runs land (the noise floor)."""
    runs = {"sync": (2, POLICIES["sync"])}
    for comp in compensations:
        for s in ("s=1", "s=2"):
            runs[f"{s} {comp}"] = (2, POLICIES[s] + [f'staleness.compensation="{comp}"'])
    runs[BUDGET_ROW] = (2, POLICIES["budget"] + ['staleness.test_fault_injection="slowdown=2.0,rank=1"'])
    # the time budget again, with more steps so that it processes as many tokens as sync (the step count comes
    # from the same seed's budget row: steps x sync tokens / budget tokens)
    runs[BUDGET_SAME_TOKENS_ROW] = runs[BUDGET_ROW]
    if exact_row:
        runs[EXACT_ROW] = (1, POLICIES["s=1"] + ['staleness.compensation="optimizer_lookahead"'])
    if own_rows:  # the reproducible own-gradient prediction
        for name, s in OWN_ROWS.items():
            runs[name] = (2, POLICIES[s] + ['staleness.compensation="optimizer_lookahead"',
                                            "staleness.lookahead_arrived=false"])
    if arrival_grace is not None:  # another grace for the rows that predict with arrived reductions
        runs = {name: (ranks, policy + [f"staleness.arrival_grace={arrival_grace}"]
                       if name.endswith("optimizer_lookahead") else policy)
                for name, (ranks, policy) in runs.items()}
    if fault_spec:  # every row but the time budget's (which keeps its own slow rank) runs jittered
        runs = {name: (ranks, policy if name.startswith("budget") else
                       policy + [f'staleness.test_fault_injection="{fault_spec}"'])
                for name, (ranks, policy) in runs.items()}
    if rows:
        unknown = sorted(set(rows) - set(runs))
        if unknown:
            raise SystemExit(f"--rows: unknown row(s) {unknown}; allowed: {sorted(runs)}")
        runs = {name: run for name, run in runs.items() if name == "sync" or name in rows}
    return runs


def convergence(steps: int, seeds: list[int], compensations: list[str], workdir: Path, progress,
                extra: list[str] = (), exact_row: bool = False, **row_options) -> dict:
    """Final validation loss after `steps` steps (same tokens offered) per policy, dp 2, over seeds. The time
    budget runs with rank 1 at 2x slowdown, so it really skips samples; staleness math does not depend on timing.
    `extra`: overrides added to every run (e.g. another learning rate, an extra row of the table)."""
    runs = convergence_runs(compensations, exact_row, **row_options)
    out: dict = {name: {"val_loss": [], "tokens": [], "wall_s": [], "lookahead_exact": [], "lookahead_pending": [],
                        "arrival_wait_s": [], "exact_microbatches": [], "predicted_microbatches": []}
                 for name in runs}
    for seed in seeds:
        for name, (ranks, policy) in runs.items():
            run_dir = workdir / f"conv-{len(list(workdir.glob('conv-*')))}"  # a fresh directory per run
            run_steps = steps
            if name == BUDGET_SAME_TOKENS_ROW:
                if BUDGET_ROW not in out or len(out[BUDGET_ROW]["tokens"]) < len(out["sync"]["tokens"]):
                    continue  # --rows left out the budget row it is sized from
                run_steps = round(steps * out["sync"]["tokens"][-1] / out[BUDGET_ROW]["tokens"][-1])
            overrides = base_overrides(run_dir, run_steps, seed, ranks) + policy + [
                f"train.eval_every={run_steps}", "train.eval_batches=8", *extra]
            res = run_training(ranks, overrides)
            metrics = read_metrics(run_dir)
            val = [m["val_loss"] for m in metrics if "val_loss" in m][-1]
            out[name]["val_loss"].append(val)
            # rank 0's record of how many pending steps its predictions replayed with the arrived dp mean
            out[name]["lookahead_exact"].append(sum(m.get("lookahead_exact", 0) for m in metrics))
            out[name]["lookahead_pending"].append(sum(m.get("lookahead_pending", 0) for m in metrics))
            out[name]["arrival_wait_s"].append(sum(m.get("arrival_wait_s", 0.0) for m in metrics))
            per_rank_mb = 16 // (ranks * 2)  # global batch 16, microbatch 2
            out[name]["exact_microbatches"].append(sum(m.get("exact_microbatches", 0) for m in metrics))
            out[name]["predicted_microbatches"].append(
                per_rank_mb * sum(1 for m in metrics if m.get("lookahead_pending", 0) > 0))
            out[name]["tokens"].append(res["tokens"])
            out[name]["wall_s"].append(res["wall_s"])
            progress(f"convergence seed {seed} {name:<24} val_loss {val:.4f} tokens {res['tokens']:,}")
    return {name: row for name, row in out.items() if row["val_loss"]}


def print_convergence(result: dict, steps: int, seeds: list[int], label: str = "") -> None:
    sync = statistics.mean(result["sync"]["val_loss"])
    print(f"\n## convergence: tiny model, dp=2, {steps} steps x 16 x {SEQ_LEN} tokens offered, seeds {seeds}"
          f"{label}")
    print("vs sync: mean over seeds vs the mean of sync; paired: mean over seeds of the per-seed ratio")
    print(f"{'policy':<32}{'val loss (mean)':>16}{'vs sync':>9}{'paired':>9}  {'per seed':<{7 * len(seeds)}}"
          f"{'tokens used':>13}{'wall s':>8}{'exact':>8}{'exact mb':>9}{'wait ms':>9}")
    for name, r in result.items():
        mean = statistics.mean(r["val_loss"])
        paired = statistics.mean(v / b - 1 for v, b in zip(r["val_loss"], result["sync"]["val_loss"], strict=True))
        per_seed = " ".join(f"{v:.3f}" for v in r["val_loss"])
        print(f"{name:<32}{mean:>16.4f}{(mean / sync - 1):>+9.2%}{paired:>+9.2%}  {per_seed:<{7 * len(seeds)}}"
              f"{statistics.mean(r['tokens']):>13,.0f}{statistics.mean(r['wall_s']):>8.1f}{exact_share(r):>8}"
              f"{exact_microbatch_share(r):>9}{wait_per_step_ms(r, steps):>9}")


def exact_share(row: dict) -> str:
    """Share of pending steps (rank 0, all seeds) replayed with the arrived dp-mean gradient; '' for other rows."""
    pending = sum(row.get("lookahead_pending", []))
    return f"{sum(row['lookahead_exact']) / pending:.0%}" if pending else ""


def exact_microbatch_share(row: dict) -> str:
    """Share of rank 0's microbatches (of steps with a pending prediction) computed with every pending step exact,
    counting reductions taken between microbatches; '' for other rows."""
    total = sum(row.get("predicted_microbatches", []))
    return f"{sum(row['exact_microbatches']) / total:.0%}" if total and any(row["exact_microbatches"]) else ""


def wait_per_step_ms(row: dict, steps: int) -> str:
    """Mean time per step rank 0 spent in the arrival grace; '' for rows without lookahead_arrived."""
    waits = row.get("arrival_wait_s", [])
    return f"{1e3 * sum(waits) / (steps * len(waits)):.1f}" if any(waits) else ""


def compensation_overhead(compensations: list[str], steps: int = 20, rounds: int = 3) -> dict:
    """Step time of the stale runner in one process (no communication) per compensation and s: the cost of the
    prediction itself (weight copies, the AdamW replay). Tiny model, seq 64, global batch 16; min over rounds."""
    from paratrain.parallel.mesh import DistEnv
    from paratrain.train.loop import build_optimizer, build_runner

    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 4096, (steps + 5, 16, SEQ_LEN + 1), generator=gen)
    times: dict = {}
    for _ in range(rounds):
        for comp in compensations:
            for s in (1, 2):
                cfg = load_config(None, ['staleness.policy="bounded_staleness"', f"staleness.max_staleness={s}",
                                         f'staleness.compensation="{comp}"', f"train.seq_len={SEQ_LEN}",
                                         "train.global_batch=16", "train.microbatch=2", 'train.device="cpu"'])
                runner = build_runner(cfg, env)
                optimizer = build_optimizer(runner, cfg.optim)
                runner.attach_optimizer(optimizer)
                for i, rows in enumerate(data):
                    if i == 5:  # after warm-up (the delay pipeline is full)
                        t0 = time.perf_counter()
                    runner.forward_backward(rows[:, :-1], rows[:, 1:])
                    runner.clip_grad_norm_(cfg.optim.grad_clip)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                times.setdefault(f"{comp} s={s}", []).append((time.perf_counter() - t0) / steps)
    return {k: min(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4], help="data-parallel sizes (default 2 4)")
    ap.add_argument("--steps", type=int, default=40, help="steps per throughput run (default 40)")
    ap.add_argument("--conv-steps", type=int, default=150, help="steps per convergence run (default 150)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="convergence seeds (default 1 2 3)")
    ap.add_argument("--base-s", type=float, default=0.04,
                    help="emulated device seconds per microbatch in throughput runs (default 0.04; 0 = real compute only)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds per throughput cell, median (default 3)")
    ap.add_argument("--quick", action="store_true", help="1 round of 30 steps, 100 convergence steps, 2 seeds")
    ap.add_argument("--skip", choices=["throughput", "convergence"], help="skip one part")
    ap.add_argument("--compensation", nargs="+", default=list(COMPENSATIONS), choices=COMPENSATIONS,
                    help="staleness.compensation values for the s = 1, 2 convergence rows (default: all)")
    ap.add_argument("--exact-row", action="store_true",
                    help="add a convergence row: s = 1 with optimizer_lookahead on 1 rank, where the prediction is "
                         "exact (the noise floor: how far two equivalent runs land apart)")
    ap.add_argument("--extra-lr", type=float, nargs="*", default=[],
                    help="also run the convergence table at these learning rates (extra information; the "
                         "main table keeps the default optim.lr)")
    ap.add_argument("--own-rows", action="store_true",
                    help="add convergence rows s = 1, 2 with optimizer_lookahead and staleness.lookahead_arrived = "
                         "false (each rank predicts with its own pending gradients: reproducible)")
    ap.add_argument("--arrival-grace", type=float,
                    help="staleness.arrival_grace of the optimizer_lookahead rows (default: the config's): the "
                         "fraction of the healthy step time a rank waits for pending reductions before predicting; "
                         "the 'exact' column is the share of pending steps replayed with the arrived dp mean")
    ap.add_argument("--stale-set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="config overrides for the s = 1, 2 throughput cells, e.g. staleness.arrival_grace=0 or "
                         "staleness.lookahead_arrived=false")
    ap.add_argument("--conv-fault", choices=["none", "jitter"], default="none",
                    help="delay injected into the convergence runs (default none): jitter = every rank sleeps "
                         "--conv-sleep-s before a step with probability 0.25 (the time budget row keeps its own)")
    ap.add_argument("--conv-sleep-s", type=float, default=MIN_SLEEP_S,
                    help=f"jitter sleep of the convergence runs (default {MIN_SLEEP_S})")
    ap.add_argument("--rows", nargs="+",
                    help="run only these convergence rows (plus sync), e.g. \"s=1 optimizer_lookahead\"")
    ap.add_argument("--json", help="write all measurements to this file")
    ap.add_argument("--overhead", action="store_true",
                    help="only measure the step time each compensation costs (one process, tiny model) and exit")
    args = ap.parse_args(argv)
    if args.overhead:
        torch.set_num_threads(1)
        times = compensation_overhead(list(COMPENSATIONS))
        for name, t in times.items():
            base = times[f"none s={name[-1]}"]
            print(f"{name:<28}{t * 1e3:>8.1f} ms/step{t / base - 1:>+8.1%} vs none")
        return 0
    if args.quick:
        args.steps, args.repeats, args.conv_steps, args.seeds = 30, 1, 100, args.seeds[:2]
    prepare(load_config(None, []).data)  # the default corpus, once, before forking
    progress = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    report: dict = {"command": " ".join(sys.argv), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "load_average_start": os.getloadavg()}
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start (timings share the machine)")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="stragglers-runs-") as tmp:
        work = Path(tmp)
        if args.skip != "throughput":
            report["throughput"] = {}
            for world in args.dp:
                report["throughput"][world] = throughput(world, args.steps, args.repeats, args.base_s, work, progress,
                                                         args.stale_set)
                print_throughput(world, report["throughput"][world])
        if args.skip != "convergence":
            row_options = {"own_rows": args.own_rows, "rows": args.rows, "arrival_grace": args.arrival_grace,
                           "fault_spec": conv_fault_spec(args.conv_fault, args.conv_sleep_s)}
            report["convergence"] = convergence(args.conv_steps, args.seeds, args.compensation, work, progress,
                                                exact_row=args.exact_row, **row_options)
            print_convergence(report["convergence"], args.conv_steps, args.seeds)
            for lr in args.extra_lr:
                key = f"convergence_lr_{lr:g}"
                report[key] = convergence(args.conv_steps, args.seeds, args.compensation, work, progress,
                                          [f"optim.lr={lr}", f"optim.min_lr={lr / 10}"], args.exact_row,
                                          **row_options)
                print_convergence(report[key], args.conv_steps, args.seeds, f", lr {lr:g} (min_lr {lr / 10:g})")
    report["load_average_end"] = os.getloadavg()
    print(f"\n(total {time.perf_counter() - t0:.0f} s on {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at the end)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
