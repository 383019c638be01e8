"""`paratrain simulate`: failures, checkpoints, restarts, spares and stragglers over a whole training run."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from paratrain.cli import Output, UserError, Workload, command, opt, print_json
from paratrain.hardware.catalog import PURCHASE_HELP, PURCHASE_OPTIONS
from paratrain.sim.config import (
    REPAIR_DISTRIBUTIONS,
    STRAGGLER_POLICIES,
    config_from_options,
    parse_duration_s,
)

DURATION = parse_duration_s  # '90s', '20m', '2.5h', '54d' -> seconds


def GB(value: float, _flag: str) -> float:  # noqa: N802 (a unit, as DURATION)
    return value * 1e9


CLUSTER, WORK, CKPT, FAIL, STRAG, COST = ("cluster", "workload (give --steps, or --duration for a fixed window)",
                                          "checkpoints", "failures and recovery", "stragglers", "cost and Monte Carlo")


@dataclass(kw_only=True)
class SimulateArgs(Workload, Output):
    config: str | None = opt("TOML file with SimConfig fields (see docs/simulator.md)", metavar="FILE")
    devices: int | None = opt("devices in the job: accelerator packages that fail as a unit (GPUs, Trainium chips)",
                              group=CLUSTER, to="devices")
    devices_per_node: int | None = opt("devices per node (default 8)", group=CLUSTER, to="devices_per_node")
    nodes_per_domain: int | None = opt("nodes replaced together, e.g. 4 for a Trn2 UltraServer (default 1)",
                                       group=CLUSTER, to="nodes_per_domain")
    hardware: str | None = opt("catalog system (e.g. p5.48xlarge, trn2.48xlarge): fills chips per node and the "
                               "price per chip-hour", group=CLUSTER)
    purchase: str = opt(PURCHASE_HELP + " (the price --hardware fills in)", "on-demand", choices=PURCHASE_OPTIONS,
                        group=CLUSTER)
    step_time: str | None = opt("fault-free time of one training step, e.g. 8.5s", group=WORK, to="step_time_s", conv=DURATION)
    steps: int | None = opt("steps to train: report time and cost to train", group=WORK, to="steps")
    duration: str | None = opt("fixed wall-clock window, e.g. 54d: report what it achieves", group=WORK, to="duration_s", conv=DURATION)
    checkpoint_gb: float | None = opt("checkpoint size in GB (default 1000)", group=CKPT, to="checkpoint_bytes", conv=GB)
    write_gbps: float | None = opt("aggregate storage write bandwidth, GB/s (default 100)", group=CKPT, to="write_bytes_per_s", conv=GB)
    read_gbps: float | None = opt("aggregate storage read bandwidth, GB/s (default 100)", group=CKPT, to="read_bytes_per_s", conv=GB)
    async_fraction: float | None = opt("share of each write overlapped with compute, in [0,1) (default 0: "
                                       "blocking)", group=CKPT, to="async_fraction")
    interval: str | None = opt("daly (default), young, a duration (20m) or a step count (500steps)", group=CKPT, to="checkpoint_interval")
    failures_file: str | None = opt("TOML failure model ([[cause]] tables) instead of the Llama 3 table",
                                    group=FAIL, metavar="TOML")
    rate_scale: float | None = opt("multiply every failure rate (default 1)", group=FAIL)
    detect: str | None = opt("time to notice a failure (default 60s; NCCL watchdog causes: 10m)", group=FAIL, to="detect_s", conv=DURATION)
    restart: str | None = opt("relaunch and initialise the job (default 3m)", group=FAIL, to="restart_s", conv=DURATION)
    swap: str | None = opt("extra time to bring a spare node in (default 1m)", group=FAIL, to="swap_s", conv=DURATION)
    spare_nodes: int | None = opt("hot spare nodes (default 1% of the job's nodes)", group=FAIL, to="spare_nodes")
    repair: str | None = opt("mean time to repair a failed node (default 24h)", group=FAIL, to="repair_mean_s", conv=DURATION)
    repair_dist: str | None = opt("repair time distribution (default lognormal)", choices=REPAIR_DISTRIBUTIONS,
                                  group=FAIL, to="repair_distribution")
    straggler_rate: float | None = opt("slow episodes per device-hour (default 0)", group=STRAG, to="stragglers.rate_per_device_hour")
    straggler_duration: str | None = opt("mean episode length (default 30m)", group=STRAG, to="stragglers.mean_duration_s", conv=DURATION)
    straggler_slowdown: float | None = opt("median slowdown factor, > 1 (default 1.5)", group=STRAG, to="stragglers.slowdown_median")
    straggler_sigma: float | None = opt("lognormal spread of the slowdown excess (default 0.5)", group=STRAG, to="stragglers.slowdown_sigma")
    straggler_policy: str | None = opt("default wait", choices=STRAGGLER_POLICIES, group=STRAG, to="stragglers.policy")
    staleness_steps: int | None = opt("bounded_staleness tolerance in steps (default 4)", group=STRAG, to="stragglers.staleness_steps")
    evict_after: str | None = opt("evict_replace: persistence before eviction (default 5m)", group=STRAG, to="stragglers.evict_after_s", conv=DURATION)
    price_per_device_hour_usd: float | None = opt("USD per device-hour, a device being one GPU or Trainium chip "
                                                  "(spares are paid for too)", group=COST, metavar="USD", to="price_per_device_hour_usd")
    price: str | None = opt("", group=COST, refused="ambiguous (USD per device-hour here, per node-hour in "
                            "`paratrain compare`); use --price-per-device-hour-usd USD")
    samples: int | None = opt("Monte-Carlo replicas (default 100)", group=COST, to="samples")
    seed: int | None = opt("random seed (default 0)", group=COST, to="seed")
    plot: str | None = opt("write PNGs of goodput vs checkpoint interval, vs cluster size and vs spare nodes",
                           metavar="DIR", group="output")
    daly_check: bool = opt("reproduce Daly's published examples analytically and by simulation, then exit",
                           group="output")


@command("simulate", SimulateArgs,
         "failures, checkpoints, spares and stragglers at cluster scale (goodput, time, cost)")
def run_simulate(args) -> None:
    from paratrain.sim.report import daly_check, format_report, print_daly_check, progress_bars, write_plots

    if args.daly_check:
        rows = daly_check(samples=args.samples or 200, seed=args.seed or 0,
                          progress=progress_bars(args.json)("Daly cases"))
        print_json(rows) if args.json else print_daly_check(rows)
        return
    cfg = config_from_options(args)
    from paratrain.sim.engine import simulate
    from paratrain.sim.results import summarize

    started = time.perf_counter()
    report = summarize(simulate(cfg))
    report["elapsed_s"] = time.perf_counter() - started
    if args.plot:
        try:
            report["plots"] = write_plots(cfg, Path(args.plot), json_mode=args.json)
        except OSError as exc:
            raise UserError(f"--plot {args.plot!r}: cannot write there ({exc.strerror})") from None
    print_json(report) if args.json else print(format_report(report))
