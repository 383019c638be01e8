"""Stale-gradient data parallelism: the gradient all-reduce of step t runs in the background while the next
steps compute, and is applied at step t + s (bounded staleness s), optionally with a per-step time budget.

Semantics (docs/staleness.md has the full story):
- Every rank keeps identical weights: at optimizer step t every rank applies the same gradient, the average over
  data-parallel ranks of the gradients of step t - s. Steps t < s apply no update (the optimizer skips parameters
  without a gradient). Without compensation those gradients were computed at w_{t-s}: async SGD with a fixed delay
  s (the weight-stashing-free variant of PipeDream-2BW's delay of 1); with it, near w_t (below).
- The bound is a guarantee: at step t a rank waits for the all-reduce of step t - s, which completes only when
  every rank has contributed step t - s. So no rank runs more than s steps ahead of the slowest.
- s = 0 reduces exactly as the runtime's synchronous DDP path (`parallel.data.BucketedGradReducer`): the same
  buckets, the same division by the dp size before the sum, the same all-reduce per bucket, so the weights are
  bitwise identical for any dp size (gloo's ring sum order depends on the bucket layout, hence the same layout).
- Time budget: a rank stops after the microbatch that leaves too little of the budget for another one (it always
  does at least one). Gradients are summed (not averaged) over microbatches and ranks and divided by the total
  number of microbatches processed, so the update is the mean over processed tokens (every microbatch has
  microbatch x seq_len tokens). The rest of a rank's slice of the global batch is skipped, never revisited: the
  global sampler advances one global batch per step on every rank, so it stays deterministic and consistent.
- Each step's small metadata (sum of microbatch losses, microbatches processed, every rank's work time) rides
  along in its own all-reduce, so losses, token counts and straggler detection need no extra blocking collective.

Delay compensation (`staleness.compensation`, only for s > 0): the gradient applied at step t + s is computed at
predicted weights instead of w_t; the strategies (optimizer_lookahead, weight_prediction) are in
parallel/compensation.py. The weights the optimizer steps are restored bit for bit after backward, so every rank
still holds identical weights; s = 0 computes at w_t (nothing is pending), so it stays bitwise synchronous DDP.

Works with replicated data parallelism, alone or on top of tensor parallelism (the reduction runs over the dp
group on each rank's local shard). FSDP/HSDP cannot run stale (parameters are sharded and gathered every step,
gradients reduce-scattered into the shards the optimizer steps) and pipeline/context parallelism are not
supported: `check_staleness_layout` refuses them with a clear message.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from paratrain.config import TrainConfig
from paratrain.device import read_after, to_device
from paratrain.parallel.compensation import make_compensation, own_gradient
from paratrain.parallel.data import bucket_params, bucket_views, copy_into_grads, flat_grads, local
from paratrain.parallel.grad_norm import clip_coefficient
from paratrain.parallel.runner import ParallelRunner, StepHooks, plain
from paratrain.stragglers import FaultInjection, StragglerDetector, lower_median

META_FIELDS = 2  # [sum of microbatch losses, microbatches processed], then one work time per dp rank
# Slack on the automatic time budget (step_budget_s = 0): the healthy ranks' full-batch time plus 10%, so that
# timing noise does not make a healthy rank drop its last microbatch.
AUTO_BUDGET_SLACK = 0.10


def check_staleness_layout(cfg: TrainConfig, degrees: dict[str, int]) -> None:
    """Refuse layouts that cannot run with stale gradients, naming the fields (before anything is built)."""
    policy = cfg.staleness.policy
    if policy == "sync":
        return
    where = f"staleness.policy='{policy}'"
    if degrees["dp"] > 1 and cfg.parallel.dp_kind != "ddp":
        raise ValueError(f"{where} needs parallel.dp_kind='ddp' (got '{cfg.parallel.dp_kind}'): FSDP/HSDP shard "
                         f"the parameters and gather them every step, so a rank cannot run ahead on stale "
                         f"gradients; allowed: dp_kind='ddp', or staleness.policy='sync'")
    if cfg.staleness.lookahead_arrived and degrees["tp"] > 1:
        raise ValueError(f"staleness.lookahead_arrived=true with parallel.tp={degrees['tp']} is not supported (tp "
                         f"peers would have to agree on which reductions arrived, and the reduced gradient's "
                         f"placement differs from the parameter's); allowed: parallel.tp=1, or "
                         f"staleness.lookahead_arrived=false")
    for dim in ("pp", "cp"):
        if degrees[dim] > 1:
            raise ValueError(f"{where} with parallel.{dim}={degrees[dim]} is not supported (stale gradients are "
                             f"implemented for data parallelism, alone or with tensor parallelism); allowed: "
                             f"parallel.{dim}=1, or staleness.policy='sync'")


@dataclass
class InFlightStep:
    step: int
    flats: list[torch.Tensor]
    works: list
    meta: torch.Tensor
    tokens_per_microbatch: int
    local_grads: list[torch.Tensor] | None = None  # this rank's own mean gradient (optimizer_lookahead only)
    grace_used: bool = False  # the arrival grace waited for it once already


@dataclass
class AppliedStep:
    """What optimizer step `step` applied: the gradient of data step `grad_step` (None during warm-up)."""

    step: int
    grad_step: int | None
    microbatches: int = 0
    tokens: int = 0
    loss: float = float("nan")
    wait_s: float = 0.0
    rank_step_s: list[float] = field(default_factory=list)
    applied_unix_s: float = 0.0  # when the reduced gradient was in hand (tests check the bound causally)
    # lookahead_arrived: pending steps this step's gradient was predicted over, and how many of them entered the
    # AdamW replay with their reduced dp-mean gradient (exact) rather than this rank's own
    lookahead_pending: int = 0
    lookahead_exact: int = 0
    arrival_grace_s: float = 0.0  # how long the arrival grace could wait before predicting this step
    arrival_wait_s: float = 0.0  # how long it did
    # microbatches of this step computed with every pending step exact (a reduction that arrives during the step
    # is taken in between microbatches)
    exact_microbatches: int = 0


class StaleDataParallelRunner(ParallelRunner):
    def __init__(self, model: nn.Module, cfg: TrainConfig, device: torch.device, dp_rank: int, dp_size: int,
                 group: dist.ProcessGroup | None, tp_group: dist.ProcessGroup | None = None,
                 loss_parallel: bool = False, is_main: bool = True):
        super().__init__(model, cfg.train.microbatch, device, cfg.train.dtype, dp_rank, dp_size, dp=None,
                         loss_parallel=loss_parallel)
        st = cfg.staleness
        self.time_budget = st.policy == "time_budget"
        self.max_staleness = st.max_staleness
        self.step_budget_s = st.step_budget_s
        self.fault = FaultInjection.parse(st.test_fault_injection)
        self.group, self.tp_group = group, tp_group
        self.is_main = is_main
        # the DDP path's buckets (same rule, same size): s = 0 is then bitwise synchronous DDP
        self.buckets = bucket_params(self.parameters(), cfg.parallel.ddp_bucket_bytes)
        self.detector = StragglerDetector(dp_size, st.straggler_threshold, st.straggler_window)
        self.in_flight: deque[InFlightStep] = deque()
        self.history: list[AppliedStep] = []  # one per optimizer step: tests check staleness from it
        self.local_microbatches: list[int] = []  # per step, this rank's processed microbatches
        self.launch_unix_s: list[float] = []  # per step, when this rank launched its reduction
        self.step = 0
        self.compensation = make_compensation(st, tp_group, cfg.optim.grad_clip)
        # Whether a pending step's reduction is in hand (never waits); tests replace it to force either case.
        self.arrived = reduction_arrived
        self.step_weights: list[torch.Tensor] = []  # w_t while a prediction is swapped in (local shards)
        self.hosts = self._gather_hosts()
        self.hooks = StaleStepHooks(self)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, scheduler=None) -> None:
        """The optimizer (and LambdaLR schedule) the compensation replays (the training loop calls this through
        `hooks` right after building it; parallel/compensation.py)."""
        self.compensation.attach(optimizer, scheduler)

    @property
    def applied_update(self) -> bool:
        """Whether this step applied a gradient (not a warm-up step): the loop advances the learning-rate schedule
        only then, so the schedule counts updates and the first update runs at its first value, as in sync."""
        return bool(self.history) and self.history[-1].grad_step is not None

    # -- the step -------------------------------------------------------------------------------------------
    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Local gradients of this step, launch their reduction, install the gradient due now (step - s)."""
        inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
        chunks = list(zip(inputs.split(self.microbatch), targets.split(self.microbatch), strict=True))
        t0 = time.perf_counter()
        if self.fault is not None:
            self.fault.before_step(self.step, self.dp_rank)
        with self.step_context(), self._at_predicted_weights():
            loss_sum, done = self._accumulate(chunks, t0)
        work_s = (time.perf_counter() - t0) * len(chunks) / done  # normalised to the full local batch
        self.local_microbatches.append(done)
        self._launch(loss_sum, done, work_s, chunks[0][0].numel())
        if self.compensation.keeps_own_gradients:  # before _apply_due overwrites .grad with G_{t-s}
            scale = 1.0 / done if self.time_budget else 1.0  # time budget sums microbatches: make it a mean
            self.in_flight[-1].local_grads = [own_gradient(p, scale) for p in self.params]
        applied = self._apply_due()
        for name, value in self.compensation.counts().items():
            setattr(applied, name, value)
        self.step += 1
        if applied.grad_step is None:  # warm-up: nothing reduced yet; report this rank's own loss
            return loss_sum / done
        return torch.tensor(applied.loss)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def _at_predicted_weights(self):
        """Swap the compensation's predicted weights in for forward/backward, then restore w_t exactly (a saved
        copy)."""
        self.compensation.begin_step()
        predicted = self.compensation.predict(self)
        if predicted is None:
            yield
            return
        params = self.params
        saved = [local(p).detach().clone() for p in params]
        self.step_weights = saved  # w_t, for a prediction made again between microbatches
        self._load(predicted)
        try:
            yield
        finally:
            self._load(saved)
            self.compensation.after_backward(saved)

    @torch.no_grad()
    def _load(self, weights: list[torch.Tensor]) -> None:
        for p, w in zip(self.params, weights, strict=True):
            local(p).copy_(w)

    def reduced_gradients(self, item: InFlightStep) -> list[torch.Tensor]:
        """The reduced gradient of a completed in-flight step per parameter (self.params order), split from the flat
        buckets as _apply_due does, as new tensors (the buckets stay untouched for _apply_due)."""
        scale = 1.0 / item.meta[1] if self.time_budget else 1.0  # a device scalar: no host read
        by_param = {}
        for bucket, flat in zip(self.buckets, item.flats, strict=True):
            for p, view in zip(bucket, bucket_views(bucket, flat), strict=True):
                by_param[id(p)] = view * scale
        return [by_param[id(p)] for p in self.params]

    def _accumulate(self, chunks, t0: float) -> tuple[torch.Tensor, int]:
        """Forward/backward over the microbatches (all, or as many as the time budget allows; at least one).
        The loss sum stays on the device: no host read per microbatch."""
        n = len(chunks)
        budget_s = self._budget_s(n) if self.time_budget else float("inf")
        loss_sum, done = torch.zeros((), dtype=torch.float64, device=self.device), 0
        for x, y in chunks:
            mb_t0 = time.perf_counter()
            if (weights := self.compensation.before_microbatch(self, done)) is not None:
                self._load(weights)
            with self.autocast():
                raw = self.loss_fn(self.model(x), y)
                # Bounded staleness divides exactly as the synchronous Runner does (bitwise at s = 0); the time
                # budget sums, and divides by the global microbatch count after the reduction.
                loss = raw if self.time_budget else raw / n
            loss.backward()
            loss_sum += plain(raw.detach())
            done += 1
            if self.fault is not None:
                self.fault.after_microbatch(self.dp_rank, time.perf_counter() - mb_t0)
            if done < n and self._out_of_budget(time.perf_counter() - t0, done, budget_s):
                break
        return loss_sum, done

    def _budget_s(self, n: int) -> float:
        """step_budget_s, or automatic: the healthy ranks' full-batch time (lower median over ranks, last known
        step) plus AUTO_BUDGET_SLACK. Unbounded until one step's times are known."""
        if self.step_budget_s > 0:
            return self.step_budget_s
        if not self.detector.history:
            return float("inf")
        return lower_median(self.detector.history[-1]) * (1 + AUTO_BUDGET_SLACK)

    def _out_of_budget(self, elapsed_s: float, done: int, budget_s: float) -> bool:
        """Stop when one more microbatch (at this step's mean pace) would end past the budget. Tensor-parallel
        peers of this dp rank must stop together (they compute each microbatch jointly): any one decides."""
        stop = elapsed_s + elapsed_s / done > budget_s
        if self.tp_group is None:
            return stop
        flag = torch.tensor([float(stop)], device=self.device)  # NCCL: device tensors only
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.tp_group)
        return bool(flag.item())

    def _launch(self, loss_sum: torch.Tensor, done: int, work_s: float, tokens_per_mb: int) -> None:
        flats, works = [], []
        for bucket in self.buckets:
            flat = flat_grads(bucket)  # the DDP reducer's copy of a bucket (parallel/data.py)
            if not self.time_budget:
                flat.div_(self.dp_size)
            flats.append(flat)
            works.append(self._all_reduce(flat))
        meta = torch.zeros(META_FIELDS + self.dp_size, dtype=torch.float64, device=self.device)
        meta[0], meta[1], meta[META_FIELDS + self.dp_rank] = loss_sum, done, work_s
        if self.tp_group is not None:  # tp peers report the same work time, so every rank flags the same ranks
            dist.all_reduce(meta[META_FIELDS + self.dp_rank:META_FIELDS + self.dp_rank + 1], op=dist.ReduceOp.MAX,
                            group=self.tp_group)
        self.launch_unix_s.append(time.time())
        works.append(self._all_reduce(meta))
        self.in_flight.append(InFlightStep(self.step, flats, works, meta, tokens_per_mb))

    def _all_reduce(self, t: torch.Tensor):
        if self.group is None:
            return None
        return dist.all_reduce(t, group=self.group, async_op=True)

    def _apply_due(self) -> AppliedStep:
        """Install the reduced gradient of step - s into .grad, or clear .grad during warm-up."""
        due = self.step - self.max_staleness
        if not self.in_flight or self.in_flight[0].step > due:
            for p in self.parameters():
                p.grad = None
            applied = AppliedStep(self.step, None)
            self.history.append(applied)
            return applied
        item = self.in_flight.popleft()
        assert item.step == due, f"in-flight step {item.step}, due {due}"  # one launch per step: never skipped
        t0 = time.perf_counter()
        # the step's metadata, read as soon as its reduction completed (on an accelerator without waiting for the
        # compute queued since); then the gradient buckets' reductions, waited for on the compute stream
        meta = read_after(item.works[-1:], item.meta, self.device)
        for work in item.works[:-1]:
            if work is not None:
                work.wait()
        wait_s = time.perf_counter() - t0
        microbatches = int(meta[1])
        for bucket, flat in zip(self.buckets, item.flats, strict=True):
            if self.time_budget:
                flat.div_(microbatches)
            copy_into_grads(bucket, flat)
        rank_step_s = meta[META_FIELDS:]
        self.detector.update(rank_step_s)
        applied = AppliedStep(self.step, item.step, microbatches, microbatches * item.tokens_per_microbatch,
                              meta[0] / meta[1], wait_s, rank_step_s, time.time())
        self.history.append(applied)
        return applied

    # -- what the rest of the runtime asks ----------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        if all(p.grad is None for p in self.parameters()):  # warm-up step: nothing to clip, nothing applied
            return torch.zeros((), device=self.device)
        norm = super().clip_grad_norm_(max_norm)
        # optimizer_lookahead scales pending own gradients by the last applied gradient's clipping coefficient
        self.compensation.last_clip_coef = clip_coefficient(norm, max_norm) if max_norm > 0 else 1.0
        return norm

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Evaluation only (forward_backward never calls it): a blocking mean over the dp group."""
        if self.group is None:
            return loss
        loss = loss.clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.group)
        return loss

    def finish(self) -> None:
        """Wait for every reduction still in flight; their gradients are dropped (the run stops here)."""
        while self.in_flight:
            for work in self.in_flight.popleft().works:
                if work is not None:
                    work.wait()

    def tokens_last_step(self, default_tokens: int) -> int:
        last = self.history[-1] if self.history else None
        return last.tokens if last is not None and last.grad_step is not None else default_tokens

    def staleness_metrics(self) -> dict:
        last = self.history[-1]
        metrics = {"applied_step": last.step, "grad_step": last.grad_step,
                   "staleness": None if last.grad_step is None else last.step - last.grad_step,
                   "microbatches": last.microbatches, "tokens_processed": last.tokens, "wait_s": last.wait_s,
                   "stragglers": list(self.detector.flagged)}
        if last.rank_step_s:
            metrics["rank_step_s"] = last.rank_step_s
        ratios = self.detector.window_ratios()
        if ratios:
            metrics["straggler_ratio"] = ratios
        if self.compensation.lookahead_arrived:
            metrics["lookahead_pending"], metrics["lookahead_exact"] = last.lookahead_pending, last.lookahead_exact
            metrics["arrival_wait_s"] = last.arrival_wait_s
            metrics["exact_microbatches"] = last.exact_microbatches
        return metrics

    def _gather_hosts(self) -> list[str]:
        """Host name of every dp rank (once, at start): the eviction request names hosts, not just ranks."""
        host = socket.gethostname()
        if self.group is None:
            return [host]
        hosts: list = [None] * self.dp_size
        dist.all_gather_object(hosts, host, group=self.group)
        return hosts


def reduction_arrived(item: InFlightStep) -> bool:
    """Every all-reduce of the step (gradient buckets and metadata) has completed; asks, never waits. One process
    (no group, no works): the local gradient is the reduced one."""
    return all(work is None or work.is_completed() for work in item.works)


class StaleStepHooks(StepHooks):
    """The training loop's hooks (parallel/runner.py StepHooks) for the stale-gradient runner."""

    def __init__(self, runner: StaleDataParallelRunner):
        self.runner = runner

    def attach_optimizer(self, optimizer, scheduler=None) -> None:
        self.runner.attach_optimizer(optimizer, scheduler)

    def applied_update(self) -> bool:
        return self.runner.applied_update

    def step_tokens(self, default_tokens: int) -> int:
        return self.runner.tokens_last_step(default_tokens)

    def step_metrics(self) -> dict:
        return self.runner.staleness_metrics()

    def stragglers(self) -> list[int]:
        return list(self.runner.detector.flagged)

    def straggler_ratios(self) -> list[float]:
        return self.runner.detector.window_ratios()

    def hosts(self) -> list[str]:
        return self.runner.hosts

    def finish(self) -> None:
        self.runner.finish()


def build_stale_runner(model: nn.Module, cfg: TrainConfig, mesh, env, degrees: dict[str, int]):
    """The runner for staleness.policy != 'sync', on a model already tensor-parallelised (if tp > 1)."""
    check_staleness_layout(cfg, degrees)
    if mesh is None:
        return StaleDataParallelRunner(model, cfg, env.device, 0, 1, None, is_main=True)
    dp_mesh = mesh["dp"]
    group = dp_mesh.get_group() if dp_mesh.size() > 1 else None
    tp_group = mesh["tp"].get_group() if degrees["tp"] > 1 else None
    return StaleDataParallelRunner(model, cfg, env.device, dp_mesh.get_local_rank(), degrees["dp"], group,
                                   tp_group=tp_group, loss_parallel=degrees["tp"] > 1, is_main=env.is_main)
