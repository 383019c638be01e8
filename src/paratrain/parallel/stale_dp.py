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
predicted weights instead of w_t, so it is computed near the weights it will be applied to.
- "optimizer_lookahead" (default): run AdamW's update, on a scratch copy, with the gradients this rank computed
  at steps t - s .. t - 1 (those still in flight: their reduced versions are what the next s updates apply),
  scaled by the last applied gradient's clipping coefficient, at the current learning rate: w_hat ~ w_{t+s}. With
  one rank and no clipping the prediction is exact, so s = 1 computes at exactly the weights it will be applied
  to; with dp ranks it misses by the difference between the rank's own gradient and the dp mean, damped by
  (1 - beta1). It is the weight prediction of XPipe
  (Guan et al. 2019, "XPipe: Efficient Pipeline Model Parallelism for Multi-GPU DNN Training", Adam's update
  direction) and SpecTrain (Chen et al. 2018, "Efficient and Robust Parallel DNN Training through Model
  Parallelism on Multi-GPU Platform"), using the rank's own pending gradients for the unknown next updates.
  `staleness.lookahead_arrived` (on by default without tensor parallelism): a pending step whose all-reduce has
  completed enters the replay with its reduced dp-mean gradient and that gradient's own clipping coefficient, i.e.
  exactly what the optimizer will apply; the others keep the own gradient. Before predicting, a rank waits up to
  `arrival_grace` x the healthy step time for the pending reductions (a straggler's is given up on at the deadline),
  and one that arrives later is taken between microbatches. Each pending step replays at the learning rate of the
  step that applies it (the loop attaches its LambdaLR). With every reduction in time, s computes at exactly the
  weights its gradient is applied to (synchronous DDP s steps late, up to fp32 rounding); under stragglers it
  degrades to the own-gradient prediction. Where a gradient is computed then depends on arrival timing: runs are
  not bitwise reproducible run to run (ranks still hold identical weights: only the mean is applied); set
  lookahead_arrived = false for the reproducible own-gradient prediction.
- "weight_prediction": linear extrapolation of the last update, w_hat = w_t + s (w_t - w_{t-1}) (SpecTrain's
  "smoothed gradient" prediction in its optimizer-agnostic form).
The weights the optimizer steps are restored bit for bit after backward, so every rank still holds identical
weights; s = 0 computes at w_t (nothing is pending), so it stays bitwise synchronous DDP.

Works with replicated data parallelism, alone or on top of tensor parallelism (the reduction runs over the dp
group on each rank's local shard). FSDP/HSDP cannot run stale (parameters are sharded and gathered every step,
gradients reduce-scattered into the shards the optimizer steps) and pipeline/context parallelism are not
supported: `check_staleness_layout` refuses them with a clear message.
"""

from __future__ import annotations

import contextlib
import math
import socket
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.config import TrainConfig
from paratrain.device import read_after, to_device
from paratrain.parallel.data import bucket_params, local
from paratrain.parallel.grad_norm import clip_coefficient, global_grad_norm
from paratrain.parallel.runner import ParallelRunner, plain
from paratrain.train.staleness import AUTO_BUDGET_SLACK, FaultInjection, StragglerDetector, lower_median

META_FIELDS = 2  # [sum of microbatch losses, microbatches processed], then one work time per dp rank
ARRIVAL_POLL_S = 2e-4  # how often the arrival grace asks whether the pending reductions completed


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
        # Delay compensation needs something to compensate: s = 0 computes at w_t (bitwise synchronous DDP).
        self.compensation = st.compensation if self.max_staleness > 0 else "none"
        self.optimizer: torch.optim.Optimizer | None = None  # attach_optimizer (optimizer_lookahead)
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None  # attach_optimizer: future learning rates
        self.prev_weights: list[torch.Tensor] | None = None  # weight_prediction: w_{t-1} (local shards)
        self.last_clip_coef = 1.0  # clipping coefficient of the last applied gradient (optimizer_lookahead)
        # unset = automatic: on where supported (check_staleness_layout refuses an explicit true with tp > 1)
        arrived = st.lookahead_arrived if st.lookahead_arrived is not None else tp_group is None
        self.lookahead_arrived = arrived and self.compensation == "optimizer_lookahead"
        self.grad_clip = cfg.optim.grad_clip  # the exact clipping coefficient of an arrived gradient needs it
        # Whether a pending step's reduction is in hand (never waits); tests replace it to force either case.
        self.arrived = reduction_arrived
        self.lookahead_counts = (0, 0)  # (pending, exact) of the current step's prediction
        self.arrival_grace = st.arrival_grace if self.lookahead_arrived else 0.0
        self.arrival_grace_s = self.arrival_wait_s = 0.0  # of the current step
        self.exact_microbatches = 0  # of the current step
        self.step_weights: list[torch.Tensor] = []  # w_t while a prediction is swapped in (local shards)
        self.hosts = self._gather_hosts()

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, scheduler=None) -> None:
        """The optimizer whose state and hyperparameters optimizer_lookahead replays (the training loop calls
        this right after building it). Only plain AdamW is replayed. With its LambdaLR scheduler, each pending
        step replays at the learning rate of the step it will be applied at; without, at the current one."""
        if self.compensation == "optimizer_lookahead":
            check_lookahead_optimizer(optimizer)
        self.optimizer = optimizer
        self.scheduler = scheduler if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) else None

    @property
    def applied_update(self) -> bool:
        """Whether this step applied a gradient (not a warm-up step): the loop advances the learning-rate schedule
        only then, so the schedule counts updates and the first update runs at its first value, as in sync."""
        return bool(self.history) and self.history[-1].grad_step is not None

    def _replay_lrs(self) -> list[list[float]] | None:
        """Per pending step (oldest first) and parameter group: the learning rate of the update that will apply it.
        The schedule advances once per applied update (`applied_update`), and data step d of this runner is its
        d-th update: schedule index = (updates before this runner started) + d, where updates before = the
        scheduler's last_epoch minus this runner's updates so far (max(0, step - s); a resumed run restarts the
        warm-up)."""
        if self.scheduler is None:
            return None
        sched = self.scheduler
        first = sched.last_epoch - max(0, self.step - self.max_staleness)
        return [[base * fn(first + item.step) for base, fn in zip(sched.base_lrs, sched.lr_lambdas, strict=True)]
                for item in self.in_flight]

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
        if self.compensation == "optimizer_lookahead":  # before _apply_due overwrites .grad with G_{t-s}
            scale = 1.0 / done if self.time_budget else 1.0  # time budget sums microbatches: make it a mean
            self.in_flight[-1].local_grads = [own_gradient(p, scale) for p in self.params]
        applied = self._apply_due()
        applied.lookahead_pending, applied.lookahead_exact = self.lookahead_counts
        applied.arrival_grace_s, applied.arrival_wait_s = self.arrival_grace_s, self.arrival_wait_s
        applied.exact_microbatches = self.exact_microbatches
        self.step += 1
        if applied.grad_step is None:  # warm-up: nothing reduced yet; report this rank's own loss
            return loss_sum / done
        return torch.tensor(applied.loss)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def _at_predicted_weights(self):
        """Swap the predicted weights in for forward/backward, then restore w_t exactly (a saved copy)."""
        self.lookahead_counts, self.arrival_grace_s, self.arrival_wait_s = (0, 0), 0.0, 0.0
        self.exact_microbatches = 0
        predicted = self._predicted_weights()
        if predicted is None:
            yield
            return
        params = self.params
        saved = [local(p).detach().clone() for p in params]
        self.step_weights = saved  # w_t, for a prediction made again between microbatches
        with torch.no_grad():
            for p, w in zip(params, predicted, strict=True):
                local(p).copy_(w)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, w in zip(params, saved, strict=True):
                    local(p).copy_(w)
            if self.compensation == "weight_prediction":
                self.prev_weights = saved

    def _predicted_weights(self) -> list[torch.Tensor] | None:
        """Local shards of the weights this step's gradient is computed at; None = at w_t."""
        if self.compensation == "weight_prediction":
            if self.prev_weights is None:  # first step: no update seen yet; remember w_0
                self.prev_weights = [local(p).detach().clone() for p in self.params]
                return None
            return extrapolate(self.params, self.prev_weights, self.max_staleness)
        if self.compensation == "optimizer_lookahead" and self.in_flight:
            if self.optimizer is None:
                raise RuntimeError("staleness.compensation='optimizer_lookahead' needs the optimizer: call "
                                   "runner.attach_optimizer(optimizer) after building it (train() does)")
            if self.lookahead_arrived:
                return self._lookahead_with_arrived()
            pending = [item.local_grads for item in self.in_flight]
            # Scaled by the clipping coefficient of the last applied (dp-mean) gradient, not clipped by their own
            # norm: a rank's gradient is noisier than the mean, so its norm is larger and self-clipping would
            # shrink it below the scale of the gradients in the optimizer's moments (measured in a simulation of
            # dp 2: +4.8% vs +6.7% final loss over sync, 6 seeds; docs/staleness.md). Before any update the
            # coefficient is 1: Adam's first steps do not depend on a common scale of their gradients.
            return adamw_lookahead(self.optimizer, self.params, pending, [self.last_clip_coef] * len(pending),
                                   lrs=self._replay_lrs())
        return None

    def _refresh_prediction(self) -> None:
        """lookahead_arrived, between microbatches: when a pending reduction has arrived since the prediction,
        predict again with it and compute the step's remaining microbatches there (their gradients are summed with
        the earlier ones, computed a little off: still closer than all of them at the own-gradient prediction)."""
        pending, exact = self.lookahead_counts
        if exact == pending or sum(map(self.arrived, self.in_flight)) == exact:  # arrival is monotonic
            return
        predicted = self._lookahead_with_arrived(wait=False, base=self.step_weights)
        with torch.no_grad():
            for p, w in zip(self.params, predicted, strict=True):
                local(p).copy_(w)

    def _lookahead_with_arrived(self, wait: bool = True, base: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """optimizer_lookahead where every pending step whose reduction has already completed enters the replay
        with the reduced dp-mean gradient, clipped by its own coefficient (what the optimizer will apply, up to
        rounding); the others keep this rank's own gradient and the last applied clipping coefficient. `wait`:
        spend the arrival grace first (not between microbatches); `base`: replay from these weights (w_t) instead of
        the parameters' current values (a prediction is already swapped in)."""
        if wait:
            self._await_arrival()
        pending, coefs, exact = [], [], 0
        for item in self.in_flight:
            if self.arrived(item):
                grads = self._reduced_gradients(item)
                pending.append(grads)
                coefs.append(clip_coefficient(global_grad_norm(grads, self.device), self.grad_clip)
                             if self.grad_clip > 0 else 1.0)
                exact += 1
            else:
                pending.append(item.local_grads)
                coefs.append(self.last_clip_coef)
        self.lookahead_counts = (len(pending), exact)
        return adamw_lookahead(self.optimizer, self.params, pending, coefs, base, self._replay_lrs())

    def _await_arrival(self) -> None:
        """The arrival grace: wait up to arrival_grace x the healthy ranks' step time (lower median of the last
        reduced step's work times) for the pending reductions not waited for before. On time they replay exactly; a
        straggler's is given up on at the deadline and never waited for again (it may still be taken between
        microbatches), so each reduction costs at most one grace, and a late one does not make every later step
        wait. No wait before the first reduction has told the step times."""
        fresh = [item for item in self.in_flight if not item.grace_used]
        if self.arrival_grace <= 0 or not self.detector.history or not fresh:
            return
        self.arrival_grace_s = self.arrival_grace * lower_median(self.detector.history[-1])
        t0 = time.perf_counter()
        deadline = t0 + self.arrival_grace_s
        while not all(self.arrived(item) for item in fresh) and time.perf_counter() < deadline:
            time.sleep(ARRIVAL_POLL_S)
        self.arrival_wait_s = time.perf_counter() - t0
        for item in fresh:
            item.grace_used = True

    def _reduced_gradients(self, item: InFlightStep) -> list[torch.Tensor]:
        """The reduced gradient of a completed in-flight step per parameter (self.params order), split from the flat
        buckets as _apply_due does, as new tensors (the buckets stay untouched for _apply_due)."""
        scale = 1.0 / item.meta[1] if self.time_budget else 1.0  # a device scalar: no host read
        by_param = {}
        for bucket, flat in zip(self.buckets, item.flats, strict=True):
            offset = 0
            for p in bucket:
                shard = local(p)
                by_param[id(p)] = flat[offset:offset + shard.numel()].view_as(shard) * scale
                offset += shard.numel()
        return [by_param[id(p)] for p in self.params]

    def _accumulate(self, chunks, t0: float) -> tuple[torch.Tensor, int]:
        """Forward/backward over the microbatches (all, or as many as the time budget allows; at least one).
        The loss sum stays on the device: no host read per microbatch."""
        n = len(chunks)
        budget_s = self._budget_s(n) if self.time_budget else float("inf")
        loss_sum, done = torch.zeros((), dtype=torch.float64, device=self.device), 0
        for x, y in chunks:
            mb_t0 = time.perf_counter()
            if self.lookahead_arrived:
                if done:
                    self._refresh_prediction()
                pending, exact = self.lookahead_counts
                self.exact_microbatches += pending > 0 and exact == pending
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
            grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1).clone()
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
            offset = 0
            for p in bucket:
                g = local(p.grad)
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
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
        self.last_clip_coef = clip_coefficient(norm, max_norm) if max_norm > 0 else 1.0  # same as the clip
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
        if self.lookahead_arrived:
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


def check_lookahead_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """optimizer_lookahead replays AdamW's update; refuse anything it would replay wrongly."""
    ok = type(optimizer) is torch.optim.AdamW and not any(
        g.get("amsgrad") or g.get("maximize") or isinstance(g["lr"], torch.Tensor) for g in optimizer.param_groups)
    if not ok:
        raise ValueError(f"staleness.compensation='optimizer_lookahead' replays torch.optim.AdamW (no amsgrad/"
                         f"maximize, float lr); got {type(optimizer).__name__}; allowed: compensation="
                         f"'weight_prediction' or 'none' for other optimizers")


def reduction_arrived(item: InFlightStep) -> bool:
    """Every all-reduce of the step (gradient buckets and metadata) has completed; asks, never waits. One process
    (no group, no works): the local gradient is the reduced one."""
    return all(work is None or work.is_completed() for work in item.works)


def own_gradient(p: nn.Parameter, scale: float) -> torch.Tensor:
    """A copy of this rank's gradient of p (times scale), laid out as p: with tensor parallelism a gradient can be
    placed differently from its parameter (e.g. partial sums), which the elementwise AdamW replay cannot mix."""
    if p.grad is None:
        return torch.zeros_like(p)
    g = p.grad.detach()
    if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
        g = g.redistribute(p.device_mesh, p.placements)
    return g.clone().mul_(scale)


def extrapolate(params, prev_weights: list[torch.Tensor], s: int) -> list[torch.Tensor]:
    """weight_prediction: w_t + s (w_t - w_{t-1}), the last update repeated s times (SpecTrain, Chen et al. 2018)."""
    return [local(p).detach() + s * (local(p).detach() - prev) for p, prev in zip(params, prev_weights, strict=True)]


def adamw_lookahead(optimizer: torch.optim.Optimizer, params, pending: list[list[torch.Tensor]],
                    coefs: list[float], base: list[torch.Tensor] | None = None,
                    lrs: list[list[float]] | None = None) -> list[torch.Tensor]:
    """Local shards of the weights after AdamW steps with `pending` gradients (oldest first, each scaled by its
    clipping coefficient), from the optimizer's current state and from `base` (default: the parameters' values),
    on scratch copies; the optimizer is untouched.
    Same arithmetic as torch's single-tensor AdamW. `lrs[j][g]`: the learning rate of pending step j in parameter
    group g (the schedule's values at the steps that will apply them); None = every step at the current one."""
    group_of = {id(p): (gi, g) for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    predicted = []
    for i, p in enumerate(params):
        (gi, group), state = group_of[id(p)], optimizer.state.get(p, {})
        wd, eps = group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        w = (base[i] if base is not None else local(p).detach()).clone()  # base: w_t when p holds a prediction
        m = local(state["exp_avg"]).clone() if state else torch.zeros_like(w)
        v = local(state["exp_avg_sq"]).clone() if state else torch.zeros_like(w)
        k = float(state["step"]) if state else 0.0
        for j, (grads, coef) in enumerate(zip(pending, coefs, strict=True)):
            lr = group["lr"] if lrs is None else lrs[j][gi]
            g = local(grads[i]) * coef
            k += 1
            w.mul_(1 - lr * wd)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / math.sqrt(1 - beta2 ** k)).add_(eps)
            w.addcdiv_(m, denom, value=-lr / (1 - beta1 ** k))
        predicted.append(w)
    return predicted


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
