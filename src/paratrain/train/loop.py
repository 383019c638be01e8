"""The training loop. The same code runs one process on a CPU and thousands of ranks under torchrun:
the layout lives in `paratrain.parallel`, which hands this loop a `Runner`.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices  # torch's own list

from paratrain.config import (  # noqa: F401 - check_batch_layout re-exported (callers of train.loop)
    OptimSection,
    TrainConfig,
    check_batch_layout,
    check_launch,
    dump_config,
    precision_bytes,
)
from paratrain.config.layout import run_layout
from paratrain.device import HostValues, is_host, sync_fn
from paratrain.model.llama import Llama
from paratrain.model.moe import moe_metrics, reset_router_stats
from paratrain.parallel import parallelize
from paratrain.parallel.materialize import build_on_meta, materialize, random_init
from paratrain.parallel.mesh import build_mesh, init_distributed, resolve_degrees, shutdown_distributed
from paratrain.parallel.runner import multi_tensor_kernels_take
from paratrain.train import staleness  # straggler metrics, eviction request, draining
from paratrain.train.checkpoint import (
    CheckpointManager,
    check_checkpoint_dir,
    check_resume_source,
    set_rng_state,
    tidy_incomplete,
)
from paratrain.train.data import make_sampler, open_windows, prepare, read_meta
from paratrain.train.data.tokenize import check_model_tokenizer, check_vocab_fits
from paratrain.train.faults import FaultInjector
from paratrain.train.lease import RunLease
from paratrain.train.metrics import (
    MetricsLogger,
    PeakFlops,
    Tracker,
    machine_peak_flops,
    peak_memory_bytes,
    supersede_records,
    tracker_modules,
)
from paratrain.train.predict import measured_for_planner, planner_prediction
from paratrain.train.preemption import Preemption
from paratrain.train.profiling import StepTimer
from paratrain.train.run_files import check_run_tokenizer, keep_run_tokenizer
from paratrain.train.storage import RetryPolicy
from paratrain.train.watchdog import Watchdog, stack_dumps_on_signal


def lr_lambda(opt: OptimSection, total_steps: int):
    """Multiplier of opt.lr at each step: linear warmup, then cosine/linear decay to min_lr (or constant)."""
    floor = opt.min_lr / opt.lr

    def fn(step: int) -> float:
        if step < opt.warmup_steps:
            return (step + 1) / opt.warmup_steps
        if opt.schedule == "constant":
            return 1.0
        progress = min((step - opt.warmup_steps) / max(total_steps - opt.warmup_steps, 1), 1.0)
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if opt.schedule == "cosine" else 1 - progress
        return floor + (1 - floor) * decay

    return fn


def run_step(runner, optimizer, scheduler, inputs, targets, grad_clip: float, timer) -> dict:
    """One optimizer step: forward/backward over the microbatches, clip, update, schedule. Returns the step's
    device scalars (loss, grad norm) unread: a normal step makes the host wait for the device nowhere
    (tests/test_host_syncs.py counts it for every layout)."""
    with timer.phase("forward_backward"):
        loss = runner.forward_backward(inputs, targets)
    with timer.phase("optimizer"):
        grad_norm = runner.clip_grad_norm_(grad_clip)
        optimizer.step()
        if runner.hooks.applied_update():  # stale warm-up steps apply nothing: no lr consumed
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return {"loss": loss, "grad_norm": grad_norm}


def build_optimizer(runner, opt: OptimSection) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not norms), with torch's fused kernel for each group whose
    parameters the multi-tensor kernels take (`multi_tensor_kernels_take`: all plain tensors, or all
    DTensors, on any meshes) on a device torch has fused kernels for (torchtitan's default too). On DTensors
    the fused update is one op per step where foreach issues a dozen, and DTensor propagates the sharding of
    each over the whole parameter list the first time it sees a layout: the first step's update cost 1.0
    CPU-s on 4 ranks of the 2-layer tiny model under HSDP or TP2 x FSDP2 with foreach, 0.16-0.26 fused
    (steady steps 0.006 either way; growing with the parameter count). A group that mixes DTensor and plain
    parameters (the matrices of experts under DDP) takes the per-parameter loop. The choice is per group
    (`fused`/`foreach` group keys), and a resume keeps it (CheckpointManager.load)."""
    params = [p for p in runner.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    fusable = all(p.device.type in _get_fused_kernels_supported_devices() and torch.is_floating_point(p)
                  for p in params)
    groups = []
    for group, weight_decay in ((decay, opt.weight_decay), (no_decay, 0.0)):
        multi = multi_tensor_kernels_take(group)
        groups.append({"params": group, "weight_decay": weight_decay, "fused": (multi and fusable) or None,
                       "foreach": multi and not fusable})
    return torch.optim.AdamW(groups, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps)


WARMUP_STEPS = 2  # first steps of a process (allocator, kernel selection, first collectives): not steady state


@dataclass
class StepStats:
    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    compute_s: float = 0.0
    steady_tokens: int = 0
    steady_s: float = 0.0
    excluded_warmup: int = 0
    excluded_profiled: int = 0

    def throughput(self) -> dict:
        """tokens/s over the steady steps (all steps if there are none), and what it leaves out."""
        if self.steady_s > 0:
            rate = self.steady_tokens / self.steady_s
            parts = [f"{n} {what} step(s)" for n, what in ((self.excluded_warmup, "warm-up"),
                                                            (self.excluded_profiled, "profiled")) if n]
            note = f"excludes {' and '.join(parts)}" if parts else "all steps"
        else:
            rate = self.tokens / self.compute_s if self.compute_s else 0.0
            note = "all steps (too few for a steady state: warm-up included)"
        return {"tokens_per_s": rate, "tokens_per_s_all_steps": self.tokens / self.compute_s if self.compute_s else 0.0,
                "tokens_per_s_note": note}


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed every generator a run may draw from: torch (CPU and every accelerator), Python and NumPy."""
    torch.manual_seed(seed)  # seeds the accelerators' generators too
    random.seed(seed)
    np.random.seed(seed % 2**32)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def _finite(value) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return True  # not a number (a runner that reports no norm): nothing to check


def _stderr(text: str) -> None:  # logs before the run's logger exists; stdout is the command's output
    print(text, file=sys.stderr, flush=True)


def train(cfg: TrainConfig, resume_from: str | None = None, observer=None, trackers: dict | None = None,
          faults: FaultInjector | None = None) -> dict:
    """Train per `cfg`; returns a summary (first/last loss, tokens/s, paths; `errors`: why the run must exit
    non-zero, e.g. a final save that failed). Runs on every rank.
    `observer(step, runner, record)`, if given, is called on every rank after each optimizer step
    (`paratrain verify` records per-rank losses, gradient norms and parameter checksums with it).
    `trackers`: {"wandb": module, "mlflow": module} to log to (default: those the config names, imported).
    `faults`: test-only fault injection (paratrain.train.faults), inert when None."""
    if trackers is None:
        trackers = tracker_modules(cfg.metrics)  # a configured tracker that is not installed fails now
    env = init_distributed(cfg.train.device, timeout_s=cfg.train.collective_timeout_s)
    if is_host(env.device) and "OMP_NUM_THREADS" not in os.environ and env.world_size > 1:
        torch.set_num_threads(1)  # one compute thread per rank: ranks share the cores
    degrees = resolve_degrees(cfg.parallel, env.world_size)  # validates before any work
    check_batch_layout(cfg, degrees["dp"])
    check_resume_source(cfg.checkpoint.resume, resume_from)  # a mistyped checkpoint path fails before any work
    ck = cfg.checkpoint
    ckpt_dir = ck.dir or str(Path(cfg.metrics.run_dir) / "checkpoints")
    lease, preemption = None, None

    def take_lease_and_tidy(storage):  # rank 0, before the write probe
        nonlocal lease
        if ck.lease_ttl_s:
            lease = RunLease(storage, ck.lease_ttl_s, log=_stderr)
            lease.acquire()
        # failed partial saves hold the space the probe needs; a folder whose manifest alone is missing stays for
        # the resume, which quarantines it and refuses to start over from step 0 past it (moved here, it was lost)
        tidy_incomplete(storage, log=_stderr, quarantine_complete=False)
    try:
        if ck.interval or ck.save_final:  # a checkpoint.dir nothing can be written to, or in use by another run
            check_checkpoint_dir(ckpt_dir, env.rank, RetryPolicy(ck.retries, ck.retry_base_s),
                                 before_probe=take_lease_and_tidy)
        preemption = Preemption(ck.preempt_deadline_s, log=_stderr, slack=2 + cfg.staleness.max_staleness).install()
        return _train(cfg, resume_from, env, degrees, ckpt_dir, lease, preemption, observer, trackers,
                      faults or FaultInjector())
    finally:
        if preemption is not None:
            preemption.restore()
        if lease is not None:
            lease.release()


def train_process(cfg: TrainConfig, resume_from: str | None = None, faults: FaultInjector | None = None) -> dict:
    """`train` as one process of a launch (`paratrain train`): the layout checked against torchrun's WORLD_SIZE
    before this rank joins a process group (every rank refuses a bad one at once, in one line), and the group
    left at the end if this call joined it, so the ranks exit together with no gloo thread left running."""
    check_launch(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    joined_here = not dist.is_initialized()  # a caller that set up the process group keeps it
    with stack_dumps_on_signal():  # `kill -USR2 <pid>`: where this rank is, printed to its log
        summary = train(cfg, resume_from=resume_from, faults=faults)
    if joined_here:
        shutdown_distributed()
    return summary


def _train(cfg: TrainConfig, resume_from: str | None, env, degrees: dict, ckpt_dir: str, lease, preemption,
           observer, trackers, faults: FaultInjector) -> dict:
    seed_everything(cfg.train.seed, cfg.train.deterministic)
    model_cfg = cfg.model_shape()
    check_trainable_hf_folder(cfg)
    check_model_tokenizer(cfg.data, cfg.model.hf_path, model_cfg.vocab)  # every rank, before the data work
    if cfg.model.hf_path:  # its files' headers, tensor names and shapes (no weights read), before the data work
        weights_source(cfg)
    if env.is_main:
        # its note goes to stderr with the other logs: stdout is the command's output
        prepare(cfg.data, hf_path=cfg.model.hf_path, log=_stderr)
    if dist.is_initialized():
        dist.barrier()
    check_vocab_fits(read_meta(cfg.data.prepared_dir)["vocab_size"], model_cfg.vocab, cfg.model.hf_path,
                     f"data.prepared_dir='{cfg.data.prepared_dir}'")
    # what the planner predicts for this run, computed before the model is built so that a layout it cannot model fails now
    predicted = planner_prediction(cfg, model_cfg, degrees, env.world_size) if cfg.metrics.hardware else None

    runner = build_runner(cfg, env)
    optimizer = build_optimizer(runner, cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim, cfg.train.steps))
    runner.hooks.attach_optimizer(optimizer, scheduler)  # stale gradients: compensation replays both

    train_data = open_windows(cfg.data.prepared_dir, "train", cfg.train.seq_len)
    val_data = open_windows(cfg.data.prepared_dir, "val", cfg.train.seq_len)
    sampler = make_sampler(train_data, cfg.train.global_batch, cfg.train.seed)  # one source, or the mixture

    run_dir = Path(cfg.metrics.run_dir)
    # a bar redraws with "\r": in a log file (Slurm, a pipe, torchrun's redirects) it is one endless line, so
    # there the loop prints a line every train.log_every steps instead (torchtitan's logs)
    bar = cfg.train.progress and sys.stderr.isatty()
    logger = MetricsLogger(run_dir, env.is_main, cfg.metrics.jsonl, cfg.metrics.tensorboard,
                           cfg.train.steps, bar,
                           trackers=_trackers(cfg, trackers, run_dir) if env.is_main else None)
    ck = cfg.checkpoint
    saves = bool(ck.interval or ck.save_final)
    layout = run_layout(cfg.parallel, degrees, model_cfg.num_experts)  # as reported: pp/dp/cp/tp (+ ep/etp/edp)
    ckpt = CheckpointManager(ckpt_dir, env.rank, keep=ck.keep, layout=layout, async_save=ck.async_save,
                             verify=ck.verify, retry=RetryPolicy(ck.retries, ck.retry_base_s), log=logger.write,
                             timeout_s=ck.collective_timeout_s, partial_load=ck.partial_load,
                             allow_fresh_start=ck.allow_fresh_start, faults=faults)
    preemption.log = logger.write
    start_step, resumed = 0, None
    source = resume_from or (ck.resume if ck.resume not in ("auto", "none") else None)
    try:
        if source or ck.resume == "auto":
            resumed = _resume(ckpt, runner, optimizer, source, ckpt_dir)  # newest complete; refuses damaged ones
        if resumed is not None:  # the checkpoint's token ids are the run's tokenizer's (rank 0 reads run_dir)
            ckpt._from_rank0(lambda: check_run_tokenizer(cfg))
        elif saves:  # resume="none": a fresh run never mixes its saves with (or prunes) the ones already there
            ckpt.supersede_existing('checkpoint.resume="none": starting from step 0')
    except BaseException:
        logger.abandon()  # the refusal is the one line on stderr
        raise
    if resumed is not None:
        scheduler.load_state_dict(resumed.extra["scheduler"])
        sampler.load_state_dict(resumed.extra["sampler"])
        start_step = resumed.extra["step"]
        logger.write(f"{resumed.describe(layout, env.world_size)}; sampler at global sample "
                     f"{sampler.step * cfg.train.global_batch}")
        if start_step >= cfg.train.steps:  # one line, no summary of a run that did not run
            logger.write(f"nothing left to train: the checkpoint is at step {start_step}, train.steps="
                         f"{cfg.train.steps} (a finished run in {ckpt_dir}); raise train.steps to continue it, or "
                         f"use a new metrics.run_dir")
            ckpt.close()
            logger.close()
            return {"nothing_to_train": True, "steps": 0, "rank": env.rank, "run_dir": str(run_dir),
                    "checkpoint": str(ckpt.latest() or ""), "resumed_from": resumed.path,
                    "world_size": env.world_size, "layout": layout}
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(dump_config(cfg))
        keep_run_tokenizer(cfg)  # generate and export read the run's own (data.prepared_dir may be prepared again)
        if mixture := sampler.describe(cfg.train.steps):  # realised proportions of a data.mix
            logger.write(mixture)
    if env.is_main and cfg.metrics.jsonl:  # the steps after the checkpoint are recomputed: one record each
        supersede_records(run_dir / "metrics.jsonl", start_step, logger.write)

    peak = _peak_flops(cfg, env)
    peak_flops, peak_label = peak.flops, peak.label
    logger.write(banner(cfg, model_cfg, layout, env, read_meta(cfg.data.prepared_dir), ckpt_dir, resumed, peak))
    # The start-up draws (the matmul probe above, model init) are done: the first step starts from exactly the
    # saved generators (bit-for-bit continuation), or from the seed on a fresh start.
    if resumed is not None:
        set_rng_state(resumed.rng)
    else:
        seed_everything(cfg.train.seed, cfg.train.deterministic)
    flops_per_token = model_cfg.train_flops_per_token(cfg.train.seq_len)
    stats = StepStats()
    first_loss = last_loss = float("nan")
    t_start = time.perf_counter()
    timer = StepTimer(sync=sync_fn(env.device))
    breakdowns: list[dict] = []
    pending = None  # the last step's record, completed (read from the device) one step late
    watchdog = Watchdog(env.rank, env.world_size, cfg.train.watchdog_s, logger.write)
    errors: list[str] = []
    preempted: dict | None = None
    nonfinite, rollbacks, last_save_s = "", 0, 0.0  # why numbers went non-finite since the last save
    straggler_log = staleness.StragglerLog()

    def finish_record() -> None:
        """Complete the pending step's record with its device values and log it: read one step late, the
        read waits only for that step's work (HostValues), so the device never idles for the logger."""
        nonlocal pending, first_loss, last_loss, nonfinite
        if pending is None:
            return
        done_step, record, values = pending
        pending = None
        record.update(values.read())
        loss_value = record["loss"]
        if not nonfinite and not (_finite(loss_value) and _finite(record.get("grad_norm"))):
            nonfinite = f"step {done_step + 1}: loss {loss_value}, grad_norm {record.get('grad_norm')}"
            logger.write(f"WARNING: non-finite numbers at {nonfinite}")
        stats.losses.append(loss_value)
        if done_step == start_step:
            first_loss = loss_value
        last_loss = loss_value
        logger.log(done_step + 1, record)
        logger.advance(1, {"loss": loss_value, "tok/s": record["tokens_per_s"], "mfu": record["mfu"]})
        if (done_step + 1) % cfg.train.log_every == 0 and not bar:
            logger.write(f"step {done_step + 1:>6} loss {loss_value:.4f} lr {record['lr']:.2e} "
                         f"tok/s {record['tokens_per_s']:,.0f} mfu {record['mfu']:.1%} "
                         f"mem {record['memory_bytes'] / 2**20:,.0f} MiB")

    step = start_step
    while step < cfg.train.steps:
        t0 = time.perf_counter()
        profiled = bool(cfg.metrics.profile_every) and (step + 1) % cfg.metrics.profile_every == 0
        trace = run_dir / "traces" / f"step_{step + 1:08d}_rank{env.rank}.json" if cfg.metrics.trace else None
        lr_used = scheduler.get_last_lr()[0]  # the lr of this step (run_step's scheduler.step() moves to the next)
        with timer.profile(profiled, trace):
            with timer.phase("data"):
                inputs, targets = train_data.batch(sampler.next_indices(runner.dp_rank, runner.dp_size))
            watchdog.mark(step + 1, "data_loading")
            reset_router_stats(runner.parts)  # MoE: router metrics count this step's tokens (nothing when dense)
            values = HostValues(run_step(runner, optimizer, scheduler, inputs, targets, cfg.optim.grad_clip, timer),
                                env.device)
        watchdog.mark(step + 1, "compute")
        faults.point("after_step", step + 1, env.rank)
        if observer is not None:  # paratrain verify: compares every step, so it reads them at once
            observer(step + 1, runner, values.read())
        dt = time.perf_counter() - t0  # host time; with the one-step-late read it tracks the device's step time
        tokens = runner.hooks.step_tokens(cfg.train.global_batch * cfg.train.seq_len)  # time budget: fewer
        stats.tokens += tokens
        stats.compute_s += dt
        # the headline throughput: steady steps only (not the first WARMUP_STEPS, not the profiled ones)
        steady = step - start_step >= WARMUP_STEPS and not profiled
        stats.steady_tokens += tokens if steady else 0
        stats.steady_s += dt if steady else 0.0
        stats.excluded_warmup += step - start_step < WARMUP_STEPS
        stats.excluded_profiled += profiled and step - start_step >= WARMUP_STEPS
        tokens_per_s = tokens / dt
        # MFU per device: model FLOPs of this step over (world size x peak of one device). A rate above a
        # probed peak proves the probe under-measured this machine: the peak is raised to it, and said so.
        if (note := peak.observe(flops_per_token * tokens / dt / env.world_size)) is not None:
            logger.write(note)
            peak_flops, peak_label = peak.flops, peak.label
        mfu = flops_per_token * tokens / dt / (peak_flops * env.world_size)
        record = {"lr": lr_used, "tokens_per_s": tokens_per_s, "mfu": mfu, "step_time_s": dt,
                  "memory_bytes": peak_memory_bytes(env.device)}
        if model_cfg.num_experts and (step + 1) % cfg.train.log_every == 0:  # one host sync, on log steps only
            record.update(moe_metrics(runner.parts, model_cfg, runner.reduce_layer_sums))  # the global batch
        phases = timer.take()
        if "backward" in phases:  # a profiled step: split forward from backward
            phases["forward"] = phases["forward_backward"] - phases["backward"]
        breakdowns.append({"step_time_s": dt, **phases})
        record.update({k if k.endswith("_s") else f"time_{k}_s": v for k, v in phases.items()})
        straggler_log.on_step(runner.hooks, record, logger)  # applied step, staleness, stragglers
        finish_record()  # the previous step's, now that this one is queued
        pending = (step, record, values)
        step += 1  # steps done
        notice = preemption.requested(step)  # every rank, every step: they agree on the step to stop at
        interval = cfg.checkpoint.interval
        last = step == cfg.train.steps
        checkpointing = bool((interval and step % interval == 0) or (last and cfg.checkpoint.save_final)
                             or (notice and saves))
        evaluating = cfg.train.eval_every and step % cfg.train.eval_every == 0
        if last or checkpointing or evaluating or profiled or notice:  # these steps wait for the device anyway
            finish_record()
        if evaluating:
            val = _evaluate(runner, val_data, cfg)
            logger.log(step, {"val_loss": val})
            logger.write(f"step {step}: val_loss {val:.4f}")
        if notice and not saves:
            logger.write(f"{preemption.signal}: checkpoints are off (checkpoint.interval=0, save_final=false): "
                         f"stopping at step {step} without saving")
            preempted = {"signal": preemption.signal, "step": step, "checkpoint": "",
                         "seconds_after_notice": preemption.elapsed_s()}
            break
        if not checkpointing:
            continue
        # what any rank saw since the last save (a loss may be rank-local; the lease lives on rank 0)
        nonfinite, lost = ckpt.from_any_rank(nonfinite, lease.lost if lease is not None else "")
        if lost:
            errors.append(f"{lost}: stopped at step {step} without saving")
            break
        if nonfinite:
            action = _nonfinite_action(ck, nonfinite, rollbacks, last or notice, ckpt, logger)
            if action == "rollback":
                rollbacks += 1
                back = ckpt.resume(runner.parts, optimizer, ckpt.latest())
                scheduler.load_state_dict(back.extra["scheduler"])  # the sampler goes on: past the bad batches
                logger.write(f"rolled back to step {back.step} ({back.path}) after non-finite numbers at "
                             f"{nonfinite}; skipping the batches of steps {back.step + 1}..{step} "
                             f"(rollback {rollbacks}/{ck.max_rollbacks})")
                if env.is_main and cfg.metrics.jsonl:
                    supersede_records(run_dir / "metrics.jsonl", back.step, logger.write)
                step, nonfinite = back.step, ""
                continue
            if action == "skip":
                continue
            errors.append(action)
            break
        if notice:
            left_s = preemption.deadline_s - preemption.elapsed_s()
            logger.write(f"{preemption.signal}: saving step {step} before exiting ({left_s:.0f} s of "
                         f"checkpoint.preempt_deadline_s left)")
            if last_save_s > left_s:
                logger.write(f"WARNING: the last save took {last_save_s:.0f} s, more than the {left_s:.0f} s left")
        t_ckpt = time.perf_counter()
        saved = ckpt.save(step, runner.parts, optimizer, {"step": step, "scheduler": scheduler.state_dict(),
                                                          "sampler": sampler.state_dict()})
        # the time the step loop was blocked (an asynchronous save writes on in the background)
        last_save_s = time.perf_counter() - t_ckpt
        logger.log(step, {"time_checkpoint_s": last_save_s})
        if notice:
            ok = ckpt.wait() is not False
            preempted = {"signal": preemption.signal, "step": step, "checkpoint": str(saved) if ok else "",
                         "seconds_after_notice": preemption.elapsed_s()}
            if not ok:
                errors.append(f"preempted ({preemption.signal}) but the checkpoint of step {step} was NOT saved: "
                              f"{ckpt.last_error.get(step, 'see the log')}")
            else:
                logger.write(f"{preemption.signal}: checkpoint of step {step} committed "
                             f"{preemption.elapsed_s():.1f} s after the notice; exiting 0 so that the scheduler's "
                             "requeue resumes from it")
            break
        # evict_stragglers stops every rank here (exit code 75) once the checkpoint committed
        staleness.after_checkpoint(runner.hooks, cfg.staleness.evict_stragglers and not last, run_dir, step,
                                   str(saved), logger, env.is_main, ckpt.close)
    finish_record()
    watchdog.close()
    runner.hooks.finish()  # wait for stale reductions still in flight
    ckpt.close()  # an asynchronous save still in flight commits before the run reports done
    if preempted is None and not errors and cfg.checkpoint.save_final and cfg.train.steps in ckpt.last_error:
        errors.append(f"the final checkpoint (step {cfg.train.steps}) was NOT saved: "
                      f"{ckpt.last_error[cfg.train.steps]}; latest complete: {ckpt.latest() or 'none'}")
    wall = time.perf_counter() - t_start
    for error in errors:
        logger.write(f"ERROR: {error}")
    logger.close()
    summary = {
        "first_loss": first_loss, "last_loss": last_loss, "losses": stats.losses,
        "steps": len(stats.losses), "tokens": stats.tokens,
        **stats.throughput(),
        "wall_s": wall, "peak_flops": peak_flops, "peak_label": peak_label,
        "run_dir": str(run_dir), "checkpoint": str(ckpt.latest() or ""), "rank": env.rank,
        "resumed_from": resumed.path if resumed else "", "failed_checkpoint_saves": ckpt.failed_saves,
        "world_size": env.world_size, "layout": layout, "traces": timer.traces, "errors": errors,
        "preempted": preempted, "rollbacks": rollbacks, "watchdog_warnings": watchdog.warnings,
        **measured_for_planner(cfg, model_cfg, degrees, breakdowns, WARMUP_STEPS),
    }
    if cfg.metrics.hardware and env.is_main:
        summary["predicted"] = predicted
    return summary


def _nonfinite_action(ck, nonfinite: str, rollbacks: int, final: bool, ckpt, logger) -> str:
    """What to do at a save when the numbers went non-finite since the last one (checkpoint.nonfinite):
    "rollback", "skip", or the error that stops the run. Nothing non-finite is ever committed."""
    ckpt.wait()
    latest = ckpt.latest()
    if ck.nonfinite == "rollback" and rollbacks < ck.max_rollbacks and latest:
        return "rollback"
    if ck.nonfinite == "skip" and not final:
        logger.write(f"ERROR: checkpoint NOT saved: non-finite numbers at {nonfinite} "
                     "(checkpoint.nonfinite=\"skip\"); training continues")
        return "skip"
    why = {"rollback": f"after {rollbacks} rollback(s)" if latest else "no checkpoint to roll back to",
           "skip": "the final save is skipped", "stop": "checkpoint.nonfinite=\"stop\""}[ck.nonfinite]
    return (f"non-finite numbers at {nonfinite} ({why}): stopped without saving; the newest complete checkpoint "
            f"{latest or '(none)'} is kept")


def build_runner(cfg: TrainConfig, env):
    """The model built on the meta device, laid out for cfg.parallel, then materialised shard by shard on
    every rank (each rank allocates and fills only what it holds; same weights as one device for any layout)."""
    model_cfg = cfg.model_shape()
    model = build_on_meta(lambda: Llama(model_cfg))
    return parallelize(model, cfg, build_mesh(cfg.parallel, env), env, source_of=weights_source(cfg))


def weights_source(cfg: TrainConfig):
    """Where the initial weights come from: the Hugging Face folder (read slice by slice), or the
    layout-independent random init of train.seed."""
    if cfg.model.hf_path:
        from paratrain.model.hf import hf_source

        check_trainable_hf_folder(cfg)
        return hf_source(cfg.model.hf_path, cfg.model_shape())
    return random_init(cfg)


def check_trainable_hf_folder(cfg: TrainConfig) -> None:
    if cfg.model.hf_path and cfg.model_shape().num_experts:  # the slice reader maps one HF tensor to one of ours
        raise ValueError(f"model.hf_path='{cfg.model.hf_path}': a mixture-of-experts folder (Mixtral, Qwen3-MoE) "
                         f"is read by `paratrain generate` only; training from it is not supported yet (its "
                         f"per-expert tensors stack into one of ours); allowed: a Llama folder")


def _build_model(cfg: TrainConfig, model_cfg) -> Llama:
    """The whole model in this process, with the weights `build_runner` gives any layout."""
    model = Llama(model_cfg)
    materialize([model], None, weights_source(cfg))
    return model


def _peak_flops(cfg: TrainConfig, env) -> PeakFlops:
    """Peak FLOP/s of one rank: from the hardware catalog (or a probed hardware file) when metrics.hardware
    names one, else this machine's probe, measured once and cached (`machine_peak_flops`)."""
    if cfg.metrics.hardware:
        from paratrain.hardware.catalog import resolve_system

        system = resolve_system(cfg.metrics.hardware)
        if system.chip.status == "measured" and is_host(env.device):
            # a probed CPU file: one chip = one core at one thread; this rank's share of the cores
            ranks = max(env.world_size, 1)
            cores = max(system.chips_per_node, 1)
            share = max(min(torch.get_num_threads(), cores / ranks), min(1.0, cores / ranks))
            return PeakFlops(system.chip.bf16_tflops * 1e12 * share,
                             f"probed peak of {system.name} ({cfg.metrics.hardware}) x {share:g} core(s) per rank",
                             "catalog")
        return PeakFlops(system.device_peak_flops, f"bf16 peak of one {system.device_unit} of {system.name}",
                         "catalog")
    return machine_peak_flops(env.device, local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _resume(ckpt: CheckpointManager, runner, optimizer, source, ckpt_dir: str):
    """ckpt.resume, with a checkpoint of another model (DCP's size mismatch or missing keys, deep in a
    traceback) turned into one line naming the folder and what to do."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return ckpt.resume(runner.parts, optimizer, source)
    except CheckpointException as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if "mismatch" in ln or "Missing key" in ln
                 or ln.startswith(("ValueError", "RuntimeError", "KeyError"))]
        why = lines[0] if lines else str(exc).splitlines()[0]
        raise ValueError(f"cannot resume from {source or ckpt_dir}: it holds a different model or layout than this "
                         f"config ({why}); allowed: the model it was saved with, a new metrics.run_dir, or "
                         f"checkpoint.resume='none'") from None


def _trackers(cfg: TrainConfig, modules: dict, run_dir: Path) -> list[Tracker]:
    config = cfg.model_dump()
    names = {"wandb": cfg.metrics.wandb_project, "mlflow": cfg.metrics.mlflow_experiment}
    return [Tracker(kind, module, names[kind] or "paratrain", run_dir.name, run_dir, config)
            for kind, module in modules.items()]


def banner(cfg: TrainConfig, model_cfg, degrees: dict, env, meta: dict, ckpt_dir: str, resumed,
           peak: PeakFlops) -> str:
    """What this run is about to do, before its first step."""
    t = cfg.train
    tokens = t.steps * t.global_batch * t.seq_len
    order = [d for d in ("pp", "dp", "cp", "tp", "ep", "etp", "edp") if degrees.get(d, 1) > 1]
    lines = [
        f"model       {model_cfg.name}: {model_cfg.num_params() / 1e6:,.2f}M parameters ({model_cfg.layers} layers, "
        f"hidden {model_cfg.hidden}, {model_cfg.heads} heads, vocab {model_cfg.vocab:,})",
        f"layout      {' x '.join(f'{d} {degrees[d]}' for d in order) or 'one rank'} on {env.world_size} rank(s), "
        f"{env.device.type}; {cfg.parallel.dp_kind if degrees['dp'] > 1 else 'no data parallelism'}, "
        f"microbatch {t.microbatch}, recompute {cfg.parallel.recompute}",
    ]
    lines += [f"            {line}" for line in _ranks_lines(degrees, env.world_size)]
    lines += [
        f"data        {cfg.data.prepared_dir}: {meta['train_tokens']:,} train tokens (vocab {meta['vocab_size']:,}); "
        f"{t.steps} steps x {t.global_batch} x {t.seq_len} = {tokens:,} tokens "
        f"({tokens / max(meta['train_tokens'], 1):.2f} epochs)",
        f"checkpoint  {ckpt_dir} (" + (f"every {cfg.checkpoint.interval} steps" if cfg.checkpoint.interval else
                                       "at the end" if cfg.checkpoint.save_final else "none saved") + ")",
        "resume      " + (f"from {resumed.path} (step {resumed.extra['step']})" if resumed else "no: a fresh start"),
        f"MFU against {peak.flops / 1e12:,.3f} TFLOP/s per rank: {peak.label}",
    ]
    return "\n".join(lines)


def _ranks_lines(degrees: dict, world: int, limit: int = 8) -> list[str]:
    """Each rank's coordinates in the mesh (pp, dp, cp, tp; tp innermost), the first `limit` ranks; with expert
    parallelism also its ep and edp coordinates: a stage's dp x cp x tp ranks in that order refolded as
    (edp, ep, etp), etp innermost (config.rules; the etp coordinate is the tp one or none)."""
    if world == 1:
        return []
    dims = [d for d in ("pp", "dp", "cp", "tp", "edp", "ep") if degrees.get(d, 1) > 1]
    out = []
    for rank in range(min(world, limit)):
        rest, coords = rank, {}
        for d in reversed(("pp", "dp", "cp", "tp")):
            rest, coords[d] = divmod(rest, degrees[d])
        if degrees.get("ep", 1) > 1:
            in_stage = rank % (degrees["dp"] * degrees["cp"] * degrees["tp"])
            coords["edp"], coords["ep"] = divmod(in_stage // degrees["etp"], degrees["ep"])
        out.append(f"rank {rank}: " + " ".join(f"{d}{coords[d]}" for d in dims))
    if world > limit:
        out.append(f"... ({world - limit} more ranks)")
    return [", ".join(out[i:i + 4]) for i in range(0, len(out), 4)]


def _evaluate(runner, data, cfg: TrainConfig) -> float:
    per_rank = max(cfg.train.global_batch // runner.dp_size, cfg.train.microbatch)
    losses = []
    for b in range(cfg.train.eval_batches):
        start = (b * runner.dp_size + runner.dp_rank) * per_rank
        idx = [(start + i) % data.num_samples for i in range(per_rank)]
        losses.append(float(runner.eval_loss(*data.batch(idx))))
    return sum(losses) / len(losses)
