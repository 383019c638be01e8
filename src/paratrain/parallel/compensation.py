"""Delay compensation for stale gradients: where the gradient of step t is computed, given that it is applied at
step t + s. One strategy object per runner (`make_compensation`); the stale-gradient runner
(parallel/stale_dp.py) swaps the predicted weights in for forward/backward and restores w_t bit for bit after.

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
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.parallel.data import local
from paratrain.parallel.grad_norm import clip_coefficient, global_grad_norm
from paratrain.stragglers import lower_median

ARRIVAL_POLL_S = 2e-4  # how often the arrival grace asks whether the pending reductions completed
COMPENSATIONS = ("none", "weight_prediction", "optimizer_lookahead")


def make_compensation(st, tp_group, grad_clip: float) -> Compensation:
    """The strategy of `staleness` section `st`. Delay compensation needs something to compensate: s = 0 computes
    at w_t (bitwise synchronous DDP), so it gets none."""
    name = st.compensation if st.max_staleness > 0 else "none"
    if name == "weight_prediction":
        return WeightPrediction(st.max_staleness)
    if name == "optimizer_lookahead":
        # unset = automatic: on where supported (check_staleness_layout refuses an explicit true with tp > 1)
        arrived = st.lookahead_arrived if st.lookahead_arrived is not None else tp_group is None
        return OptimizerLookahead(st.max_staleness, arrived, st.arrival_grace if arrived else 0.0, grad_clip)
    if name != "none":
        raise ValueError(f"staleness.compensation='{name}': allowed: {', '.join(COMPENSATIONS)}")
    return Compensation()


class Compensation:
    """"none": the gradient of step t is computed at w_t. The interface every strategy implements; `run` is the
    stale-gradient runner (its parameters `params`, pending steps `in_flight`, step counter `step`, w_t while a
    prediction is swapped in `step_weights`, the arrival test `arrived`, `reduced_gradients`, `detector`)."""

    name = "none"
    keeps_own_gradients = False  # whether the runner keeps each pending step's own gradient (optimizer_lookahead)
    lookahead_arrived = False
    last_clip_coef = 1.0  # clipping coefficient of the last applied gradient (the runner's clip sets it)

    def attach(self, optimizer: torch.optim.Optimizer, scheduler=None) -> None:
        """The optimizer (and its schedule) the training loop built."""

    def begin_step(self) -> None:
        """Before a step's prediction: reset the step's counters."""

    def predict(self, run) -> list[torch.Tensor] | None:
        """Local shards of the weights this step's gradient is computed at; None = at w_t."""
        return None

    def before_microbatch(self, run, done: int) -> list[torch.Tensor] | None:
        """Before each microbatch (`done` of the step's so far): new weights for the rest of the step, or None to
        keep the current ones."""
        return None

    def after_backward(self, saved: list[torch.Tensor]) -> None:
        """After the step's backward, with w_t (`saved`, restored into the parameters)."""

    def counts(self) -> dict:
        """The step's prediction statistics for its AppliedStep record."""
        return {}


class WeightPrediction(Compensation):
    """"weight_prediction": w_t + s (w_t - w_{t-1}), the last update repeated s times."""

    name = "weight_prediction"

    def __init__(self, s: int):
        self.s = s
        self.prev_weights: list[torch.Tensor] | None = None  # w_{t-1} (local shards)

    def predict(self, run):
        if self.prev_weights is None:  # first step: no update seen yet; remember w_0
            self.prev_weights = [local(p).detach().clone() for p in run.params]
            return None
        return extrapolate(run.params, self.prev_weights, self.s)

    def after_backward(self, saved):
        self.prev_weights = saved


class OptimizerLookahead(Compensation):
    """"optimizer_lookahead": AdamW replayed on the pending steps' gradients (this rank's own, or with
    lookahead_arrived the reduced dp mean of those whose all-reduce completed), at the learning rates of the
    steps that will apply them."""

    name = "optimizer_lookahead"
    keeps_own_gradients = True

    def __init__(self, s: int, lookahead_arrived: bool, arrival_grace: float, grad_clip: float):
        self.s = s
        self.lookahead_arrived = lookahead_arrived
        self.arrival_grace = arrival_grace
        self.grad_clip = grad_clip  # the exact clipping coefficient of an arrived gradient needs it
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None  # future learning rates
        self.begin_step()

    def attach(self, optimizer, scheduler=None):
        """Only plain AdamW is replayed. With its LambdaLR scheduler, each pending step replays at the learning
        rate of the step it will be applied at; without, at the current one."""
        check_lookahead_optimizer(optimizer)
        self.optimizer = optimizer
        self.scheduler = scheduler if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) else None

    def begin_step(self):
        self.pending_exact = (0, 0)  # (pending, exact) of the current step's prediction
        self.arrival_grace_s = self.arrival_wait_s = 0.0
        self.exact_microbatches = 0

    def counts(self):
        pending, exact = self.pending_exact
        return {"lookahead_pending": pending, "lookahead_exact": exact, "arrival_grace_s": self.arrival_grace_s,
                "arrival_wait_s": self.arrival_wait_s, "exact_microbatches": self.exact_microbatches}

    def predict(self, run):
        if not run.in_flight:
            return None
        if self.optimizer is None:
            raise RuntimeError("staleness.compensation='optimizer_lookahead' needs the optimizer: call "
                               "runner.hooks.attach_optimizer(optimizer) after building it (train() does)")
        if self.lookahead_arrived:
            return self._with_arrived(run)
        pending = [item.local_grads for item in run.in_flight]
        # Scaled by the clipping coefficient of the last applied (dp-mean) gradient, not clipped by their own
        # norm: a rank's gradient is noisier than the mean, so its norm is larger and self-clipping would
        # shrink it below the scale of the gradients in the optimizer's moments (measured in a simulation of
        # dp 2: +4.8% vs +6.7% final loss over sync, 6 seeds; docs/staleness.md). Before any update the
        # coefficient is 1: Adam's first steps do not depend on a common scale of their gradients.
        return adamw_lookahead(self.optimizer, run.params, pending, [self.last_clip_coef] * len(pending),
                               lrs=self._replay_lrs(run))

    def before_microbatch(self, run, done: int) -> list[torch.Tensor] | None:
        """lookahead_arrived: count the microbatch as exact (every pending step exact) and, after the first,
        return a new prediction when a pending reduction arrived since the last one."""
        if not self.lookahead_arrived:
            return None
        predicted = self.between_microbatches(run) if done else None
        pending, exact = self.pending_exact
        self.exact_microbatches += pending > 0 and exact == pending
        return predicted

    def between_microbatches(self, run):
        """When a pending reduction has arrived since the prediction, predict again with it and compute the
        step's remaining microbatches there (their gradients are summed with the earlier ones, computed a little
        off: still closer than all of them at the own-gradient prediction)."""
        pending, exact = self.pending_exact
        if exact == pending or sum(map(run.arrived, run.in_flight)) == exact:  # arrival is monotonic
            return None
        return self._with_arrived(run, wait=False, base=run.step_weights)

    def _replay_lrs(self, run) -> list[list[float]] | None:
        """Per pending step (oldest first) and parameter group: the learning rate of the update that will apply it.
        The schedule advances once per applied update (`applied_update`), and data step d of the runner is its
        d-th update: schedule index = (updates before the runner started) + d, where updates before = the
        scheduler's last_epoch minus the runner's updates so far (max(0, step - s); a resumed run restarts the
        warm-up)."""
        if self.scheduler is None:
            return None
        sched = self.scheduler
        first = sched.last_epoch - max(0, run.step - self.s)
        return [[base * fn(first + item.step) for base, fn in zip(sched.base_lrs, sched.lr_lambdas, strict=True)]
                for item in run.in_flight]

    def _with_arrived(self, run, wait: bool = True, base: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Every pending step whose reduction has already completed enters the replay with the reduced dp-mean
        gradient, clipped by its own coefficient (what the optimizer will apply, up to rounding); the others keep
        this rank's own gradient and the last applied clipping coefficient. `wait`: spend the arrival grace first
        (not between microbatches); `base`: replay from these weights (w_t) instead of the parameters' current
        values (a prediction is already swapped in)."""
        if wait:
            self._await_arrival(run)
        pending, coefs, exact = [], [], 0
        for item in run.in_flight:
            if run.arrived(item):
                grads = run.reduced_gradients(item)
                pending.append(grads)
                coefs.append(clip_coefficient(global_grad_norm(grads, run.device), self.grad_clip)
                             if self.grad_clip > 0 else 1.0)
                exact += 1
            else:
                pending.append(item.local_grads)
                coefs.append(self.last_clip_coef)
        self.pending_exact = (len(pending), exact)
        return adamw_lookahead(self.optimizer, run.params, pending, coefs, base, self._replay_lrs(run))

    def _await_arrival(self, run) -> None:
        """The arrival grace: wait up to arrival_grace x the healthy ranks' step time (lower median of the last
        reduced step's work times) for the pending reductions not waited for before. On time they replay exactly; a
        straggler's is given up on at the deadline and never waited for again (it may still be taken between
        microbatches), so each reduction costs at most one grace, and a late one does not make every later step
        wait. No wait before the first reduction has told the step times."""
        fresh = [item for item in run.in_flight if not item.grace_used]
        if self.arrival_grace <= 0 or not run.detector.history or not fresh:
            return
        self.arrival_grace_s = self.arrival_grace * lower_median(run.detector.history[-1])
        t0 = time.perf_counter()
        deadline = t0 + self.arrival_grace_s
        while not all(run.arrived(item) for item in fresh) and time.perf_counter() < deadline:
            time.sleep(ARRIVAL_POLL_S)
        self.arrival_wait_s = time.perf_counter() - t0
        for item in fresh:
            item.grace_used = True


def check_lookahead_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """optimizer_lookahead replays AdamW's update; refuse anything it would replay wrongly."""
    ok = type(optimizer) is torch.optim.AdamW and not any(
        g.get("amsgrad") or g.get("maximize") or isinstance(g["lr"], torch.Tensor) for g in optimizer.param_groups)
    if not ok:
        raise ValueError(f"staleness.compensation='optimizer_lookahead' replays torch.optim.AdamW (no amsgrad/"
                         f"maximize, float lr); got {type(optimizer).__name__}; allowed: compensation="
                         f"'weight_prediction' or 'none' for other optimizers")


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
