"""Stale-gradient data parallelism (issue 8): bounded staleness, time budget, straggler detection, eviction.

- s = 0 is bitwise identical to the runtime's synchronous DDP path (parallel/data.py BucketedGradReducer) at
  dp 2 and 4 and with TP2 x DP2: every parameter torch.equal after 3 AdamW steps.
- s = 1, 2: the step indices of applied gradients show staleness exactly s (never more), every rank holds the
  same weights, and the run matches a single-process delayed-gradient reference (same math, one process).
- delay compensation: optimizer_lookahead computes step t's gradient at the weights AdamW reaches with this rank's
  pending gradients (with one rank: exactly the weights it is applied to), weight_prediction at w_t + s(w_t -
  w_{t-1}); both checked against single-process references (torch's own AdamW on copies for the lookahead).
- lookahead_arrived: with every reduction forced to have arrived, s = 1 at dp 2 computes each gradient at the
  weights it is applied to (weights after N + 1 steps = synchronous DDP's after N, fp32 rounding); forced never
  arrived it is bit for bit the own-gradient lookahead; config errors and the per-step exact counts.
- time budget: the update is the mean over the microbatches each rank actually processed (checked against a
  single-process reference built from the processed counts each rank reports, so no timing assumption).
- end to end through `train()`: metrics carry staleness and stragglers; a rank slowed 4x is flagged and, with
  evict_stragglers, every rank stops after the checkpoint with exit code 75 and an eviction request file.
"""

import json

import pytest
import torch
from parity import clean_name, full_tensor, global_batch, make_config

from paratrain.config import load_config
from paratrain.parallel.data import bucket_params
from paratrain.parallel.mesh import init_distributed
from paratrain.parallel.runner import Runner
from paratrain.parallel.stale_dp import check_staleness_layout
from paratrain.stragglers import FaultInjection, StragglerDetector, lower_median, steps_to_flag
from paratrain.train.checkpoint import state_module
from paratrain.train.loop import build_optimizer, build_runner
from paratrain.train.staleness import EVICTION_EXIT_CODE

STALE = ['staleness.policy="bounded_staleness"', 'parallel.dp_kind="ddp"']
NO_COMP = ['staleness.compensation="none"']
OWN = ["staleness.lookahead_arrived=false"]  # the own-gradient prediction: deterministic, whatever the timing


# -- configuration and pure logic -----------------------------------------------------------------------------


def test_config_errors_name_field_value_and_allowed():
    with pytest.raises(ValueError, match="staleness.max_staleness=2 needs staleness.policy"):
        load_config(None, ["staleness.max_staleness=2"])
    with pytest.raises(ValueError, match="test_fault_injection.*honoured by the stale-gradient runner only"):
        load_config(None, ['staleness.test_fault_injection="slowdown=2,rank=1"'])
    with pytest.raises(ValueError, match="'speed=2' is not key=value with key one of rank, slowdown"):
        load_config(None, [*STALE, 'staleness.test_fault_injection="speed=2"'])
    with pytest.raises(ValueError, match="slowdown=0.5: allowed: >= 1"):
        load_config(None, [*STALE, 'staleness.test_fault_injection="slowdown=0.5"'])
    with pytest.raises(ValueError, match="staleness.policy"):
        load_config(None, ['staleness.policy="async"'])
    with pytest.raises(ValueError, match="staleness.compensation='dc_asgd': Input should be 'none', "
                                         "'weight_prediction' or 'optimizer_lookahead'"):
        load_config(None, [*STALE, 'staleness.compensation="dc_asgd"'])


def test_lookahead_refuses_an_optimizer_it_cannot_replay():
    cfg = make_config([*STALE, "staleness.max_staleness=1"])
    runner = build_runner(cfg, _single_env())
    with pytest.raises(ValueError, match="compensation='optimizer_lookahead' replays torch.optim.AdamW.*got SGD"):
        runner.attach_optimizer(torch.optim.SGD(runner.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="no amsgrad"):
        runner.attach_optimizer(torch.optim.AdamW(runner.parameters(), amsgrad=True))
    plain_sgd = build_runner(make_config([*STALE, "staleness.max_staleness=1",
                                          'staleness.compensation="weight_prediction"']), _single_env())
    plain_sgd.attach_optimizer(torch.optim.SGD(plain_sgd.parameters(), lr=0.1))  # extrapolation: any optimizer


def test_fsdp_pipeline_and_context_parallel_are_refused():
    fsdp = make_config(['staleness.policy="bounded_staleness"', 'parallel.dp_kind="fsdp"'])
    with pytest.raises(ValueError, match="needs parallel.dp_kind='ddp' \\(got 'fsdp'\\).*gather them every step"):
        check_staleness_layout(fsdp, {"pp": 1, "dp": 2, "cp": 1, "tp": 1})
    ddp = make_config([*STALE, "staleness.max_staleness=1"])
    for dim in ("pp", "cp"):
        with pytest.raises(ValueError, match=f"parallel.{dim}=2 is not supported"):
            check_staleness_layout(ddp, {"pp": 1, "dp": 2, "cp": 1, "tp": 1, dim: 2})
    check_staleness_layout(ddp, {"pp": 1, "dp": 2, "cp": 1, "tp": 2})  # TP x DP composes
    check_staleness_layout(fsdp, {"pp": 1, "dp": 1, "cp": 1, "tp": 1})  # no DP: nothing is sharded


def test_fault_injection_is_inert_by_default_and_reproducible():
    assert FaultInjection.parse("") is None
    assert load_config(None, []).staleness.test_fault_injection == ""
    f = FaultInjection.parse("sleep_s=0.0,probability=0.5,rank=1,seed=3")
    assert f.applies_to(1) and not f.applies_to(0)
    g = FaultInjection.parse("slowdown=2,rank=-1")
    assert g.applies_to(0) and g.applies_to(5) and g.slowdown == 2.0
    assert FaultInjection.parse("base_s=0.04,slowdown=2,rank=1").base_s == 0.04
    with pytest.raises(ValueError, match="base_s >= 0"):
        FaultInjection.parse("base_s=-1")


def test_straggler_detector_flags_slow_rank_after_full_window():
    d = StragglerDetector(world=4, threshold=1.5, window=3)
    assert d.update([1.0, 1.0, 1.0, 2.0]) == []  # window not full yet
    assert d.update([1.0, 1.1, 0.9, 2.0]) == []
    assert d.update([1.0, 1.0, 1.0, 5.0]) == [3]
    assert d.window_ratios()[3] == pytest.approx(2.0)
    for _ in range(2):  # one spike in a window of 3 does not flag (median over the window)
        d.update([1.0, 1.0, 1.0, 1.0])
    assert d.update([1.0, 9.0, 1.0, 1.0]) == []
    two = StragglerDetector(world=2, threshold=1.5, window=1)  # lower median: the faster peer is the reference
    assert two.update([1.0, 2.0]) == [1]
    assert lower_median([3.0, 1.0]) == 1.0 and lower_median([1.0, 2.0, 3.0]) == 2.0
    # what the simulator asks of the same detector: slow steps until a rank slowed f x is flagged
    assert steps_to_flag(1.4, 1.5, 10) is None  # below the threshold: never
    assert steps_to_flag(2.0, 1.5, 10) == 6  # window median (1 + 2) / 2 = 1.5 at 5 slow steps: not above
    assert steps_to_flag(4.0, 1.5, 10) == 5 and steps_to_flag(2.0, 1.5, 9) == 5


def _single_env():
    from paratrain.parallel.mesh import DistEnv

    return DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


# -- distributed runs (persistent gloo pool) ---------------------------------------------------------------------


def _train(cfg, runner, steps, schedule=None):
    """`steps` AdamW steps on the parity batches; per-rank slice of each global batch. Returns losses, the full
    parameters at the end, the applied-step history and the processed microbatches per step. `schedule`: a
    learning-rate multiplier per step (LambdaLR, given to the stale runner as the training loop does)."""
    optimizer = build_optimizer(runner, cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule) if schedule else None
    runner.hooks.attach_optimizer(optimizer, scheduler)
    per_rank = cfg.train.global_batch // runner.dp_size
    losses, in_flight = [], []
    for step in range(steps):
        inputs, targets = global_batch(cfg, step)
        sl = slice(runner.dp_rank * per_rank, (runner.dp_rank + 1) * per_rank)
        loss = runner.forward_backward(inputs[sl], targets[sl])
        in_flight.append(len(getattr(runner, "in_flight", [])))
        runner.clip_grad_norm_(cfg.optim.grad_clip)
        optimizer.step()
        if scheduler is not None and runner.hooks.applied_update():  # as the training loop does
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    runner.hooks.finish()
    params = {clean_name(n): full_tensor(p.detach()).clone() for n, p in state_module(runner.parts).named_parameters()}
    history = [(a.step, a.grad_step, a.loss, a.microbatches) for a in getattr(runner, "history", [])]
    return {"losses": losses, "params": params, "history": history, "in_flight": in_flight,
            "local_microbatches": list(getattr(runner, "local_microbatches", [])),
            "launched": list(getattr(runner, "launch_unix_s", [])),
            "applied": [a.applied_unix_s for a in getattr(runner, "history", [])]}


def _sync_and_stale0(overrides, steps):
    env = init_distributed("cpu")
    out = {}
    stale0 = [*STALE, "staleness.max_staleness=0", 'staleness.compensation="optimizer_lookahead"']  # inert at s=0
    for name, extra in (("sync", ['parallel.dp_kind="ddp"']), ("stale0", stale0)):
        cfg = make_config(overrides + extra)
        runner = build_runner(cfg, env)
        if name == "sync":  # bitwise needs the DDP path's buckets: gloo's sum order depends on the layout
            ours = [[id(p) for p in b] for b in bucket_params(runner.parameters(), cfg.parallel.ddp_bucket_bytes)]
            out["same_buckets"] = ours == [[id(p) for p in b] for b in runner.dp.reducer.buckets]
        out[name] = _train(cfg, runner, steps)
    return out


# Two layers (not parity.make_config's 4) everywhere here: the properties (bitwise equality, the applied step,
# the compensated update) do not depend on the depth, and each layer costs a quarter of a case's CPU.
TWO_LAYERS = "model.layers=2"
# TP x DP with 2 microbatches per rank (not 4): every DTensor op costs CPU; the properties do not depend on the
# number of microbatches accumulated (the layouts set it after the default 16)
TP2_DP2 = ["parallel.dp=2", "parallel.tp=2", "parallel.sp=true", TWO_LAYERS, "train.global_batch=8"]


# dp 4 at three bucket sizes (2 layers, 1.66 MiB: 21 buckets of one parameter at 0.01 MiB, 2 at 1 MiB, 1 at the
# default 25 MiB): with two ranks a + b is the same sum in any order, so only three or more ranks can show a
# bucket mismatch. (The 25 MiB case is the plain dp 4 one; it was also run a second time, as a separate bucket
# test with a subset of these assertions.)
@pytest.mark.parametrize("world,layout", [
    (2, ["parallel.dp=2"]), (4, ["parallel.dp=4"]), (4, TP2_DP2),
    (4, ["parallel.dp=4", "parallel.ddp_bucket_mb=0.01"]), (4, ["parallel.dp=4", "parallel.ddp_bucket_mb=1.0"]),
])
def test_s0_is_bitwise_identical_to_synchronous_ddp(dist_run, world, layout):
    overrides = ["train.global_batch=16", TWO_LAYERS, *layout]
    for rank, res in enumerate(dist_run(world, _sync_and_stale0, overrides, 3)):
        sync, stale = res["sync"], res["stale0"]
        assert res["same_buckets"], f"rank {rank}, {layout}"
        assert sync["params"].keys() == stale["params"].keys()
        differ = [n for n, p in sync["params"].items() if not torch.equal(p, stale["params"][n])]
        assert not differ, f"rank {rank}, {layout}: parameters differ from synchronous DDP: {differ[:5]}"
        assert [g for _, g, _, _ in stale["history"]] == [0, 1, 2]  # applied at once
        torch.testing.assert_close(torch.tensor(stale["losses"]), torch.tensor(sync["losses"]), rtol=1e-6, atol=0)


def _stale_run(overrides, steps):
    env = init_distributed("cpu")
    cfg = make_config(overrides)
    return _train(cfg, build_runner(cfg, env), steps)


def _delayed_reference(cfg, steps, s):
    """One process, full global batch: the gradient computed at step t is applied at step t + s."""
    runner = Runner(_single_model(cfg), cfg.train.microbatch, torch.device("cpu"))
    optimizer = build_optimizer(runner, cfg.optim)
    params = list(runner.parameters())
    pending, losses = [], []
    for step in range(steps):
        inputs, targets = global_batch(cfg, step)
        losses.append(float(runner.forward_backward(inputs, targets)))
        pending.append([p.grad.clone() for p in params])
        if step >= s:
            for p, g in zip(params, pending.pop(0), strict=True):
                p.grad = g
            runner.clip_grad_norm_(cfg.optim.grad_clip)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, {n: p.detach().clone() for n, p in runner.model.named_parameters()}


def _single_model(cfg):
    from paratrain.model.llama import Llama

    model = Llama(cfg.model_shape())
    model.init_weights(cfg.train.seed)
    return model


@pytest.mark.parametrize("s", [1, 2])
def test_bounded_staleness_applies_exactly_s_step_old_gradients(dist_run, s):
    steps = 6
    overrides = ["parallel.dp=2", "train.global_batch=16", TWO_LAYERS, *STALE, f"staleness.max_staleness={s}",
                 *NO_COMP]
    results = dist_run(2, _stale_run, overrides, steps)
    ref_losses, ref_params = _delayed_reference(make_config(overrides), steps, s)
    for res in results:
        history = res["history"]
        assert [t for t, _, _, _ in history] == list(range(steps))
        for t, grad_step, loss, microbatches in history:
            if t < s:
                assert grad_step is None  # warm-up: no update yet
                continue
            assert t - grad_step == s, f"step {t} applied the gradient of step {grad_step}"
            assert microbatches == 2 * 4  # all microbatches of both ranks
            assert loss == pytest.approx(ref_losses[grad_step], rel=1e-5)
        assert max(res["in_flight"]) <= s  # never more than s reductions outstanding after a step
        for name, p in res["params"].items():
            torch.testing.assert_close(p, ref_params[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    for name, p in results[0]["params"].items():
        assert torch.equal(p, results[1]["params"][name]), f"ranks disagree on {name}"


# -- delay compensation ---------------------------------------------------------------------------------------


def _compensated_reference(cfg, steps, s, dp, compensation):
    """One process, dp simulated ranks: rank r computes step t's gradient on its slice at its predicted weights;
    the mean over ranks is applied s steps later. The lookahead replays the rank's pending gradients with
    torch's own AdamW (and clip_grad_norm_) on a copy of the model and optimizer: independent of the runner's
    hand-written AdamW arithmetic. Returns the global losses and final parameters."""
    import copy

    model = _single_model(cfg)
    runner = Runner(model, cfg.train.microbatch, torch.device("cpu"))
    optimizer = build_optimizer(runner, cfg.optim)
    params = list(model.parameters())
    per_rank = cfg.train.global_batch // dp
    pending, losses, prev, coef = [], [], [p.detach().clone() for p in params], 1.0
    for step in range(steps):
        inputs, targets = global_batch(cfg, step)
        now = [p.detach().clone() for p in params]
        local, loss = [], 0.0
        for r in range(dp):
            probe = copy.deepcopy(model)
            with torch.no_grad():
                if compensation == "weight_prediction":
                    for q, w, w_prev in zip(probe.parameters(), now, prev, strict=True):
                        q.copy_(w + s * (w - w_prev))
                elif pending:  # optimizer_lookahead: AdamW steps with this rank's own pending gradients
                    probe_opt = build_optimizer(Runner(probe, 1, torch.device("cpu")), cfg.optim)
                    # load_state_dict keeps the state's tensors (no copy): deep-copy, or the probe's steps
                    # would update the real optimizer's moments in place
                    probe_opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
                    for grads_by_rank, _ in pending:  # scaled by the last real update's clipping coefficient
                        for q, g in zip(probe.parameters(), grads_by_rank[r], strict=True):
                            q.grad = g * coef
                        probe_opt.step()
                        probe_opt.zero_grad(set_to_none=True)
            rank_runner = Runner(probe, cfg.train.microbatch, torch.device("cpu"))
            sl = slice(r * per_rank, (r + 1) * per_rank)
            loss += float(rank_runner.forward_backward(inputs[sl], targets[sl])) / dp
            local.append([q.grad.clone() for q in probe.parameters()])
        losses.append(loss)
        pending.append((local, [sum(gs) / dp for gs in zip(*local, strict=True)]))
        prev = now
        if step >= s:
            for p, g in zip(params, pending.pop(0)[1], strict=True):
                p.grad = g
            norm = float(runner.clip_grad_norm_(cfg.optim.grad_clip))
            coef = min(cfg.optim.grad_clip / (norm + 1e-6), 1.0)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("compensation,s,world,layout", [
    ("optimizer_lookahead", 1, 2, ["parallel.dp=2"]),
    ("optimizer_lookahead", 2, 2, ["parallel.dp=2"]),
    ("weight_prediction", 2, 2, ["parallel.dp=2"]),
    ("optimizer_lookahead", 1, 4, TP2_DP2),
])
def test_compensated_update_matches_single_process_reference(dist_run, compensation, s, world, layout):
    """fp32; tolerance: each tensor's total update within 1e-3 of the reference's in L2 norm (Adam amplifies
    rounding where a gradient is near zero, so elementwise checks would fail on rounding alone)."""
    steps = 6
    overrides = ["train.global_batch=16", TWO_LAYERS, *layout, *STALE, f"staleness.max_staleness={s}",
                 f'staleness.compensation="{compensation}"']
    if compensation == "optimizer_lookahead" and "parallel.tp=2" not in layout:
        overrides += OWN  # with tp the automatic default is the own gradient: the reference checks that too
    results = dist_run(world, _stale_run, overrides, steps)
    cfg = make_config(overrides)
    ref_losses, ref_params = _compensated_reference(cfg, steps, s, 2, compensation)
    plain_losses, plain_params = _delayed_reference(cfg, steps, s)
    init = dict(_single_model(cfg).named_parameters())
    for res in results:
        for t, grad_step, loss, _ in res["history"]:
            assert grad_step is None if t < s else t - grad_step == s  # the bound still holds
            if grad_step is not None:
                assert loss == pytest.approx(ref_losses[grad_step], rel=1e-5)
        assert max(res["in_flight"]) <= s
        _assert_same_updates(res["params"], ref_params, init)
        # and the compensation did something: the losses of the gradients differ from the uncompensated run's
        assert res["history"][-1][2] != pytest.approx(plain_losses[steps - 1 - s], rel=1e-5)
    for rank in range(1, world):
        for name, p in results[0]["params"].items():
            assert torch.equal(p, results[rank]["params"][name]), f"rank {rank} disagrees on {name}"


@pytest.mark.parametrize("s", [1, 2])
def test_lookahead_with_one_rank_computes_at_the_weights_it_is_applied_to(s):
    """One process, constant lr, no clipping: the prediction is exact, so the weights step t's forward ran at equal
    the weights after optimizer step t + s - 1, to which its gradient is applied (fp32 rounding: the runner's
    AdamW arithmetic against torch's foreach AdamW)."""
    steps = 6
    cfg = make_config([*STALE, f"staleness.max_staleness={s}", 'staleness.compensation="optimizer_lookahead"',
                       "optim.grad_clip=0"])
    runner = build_runner(cfg, _single_env())
    optimizer = build_optimizer(runner, cfg.optim)
    runner.attach_optimizer(optimizer)
    seen, after = [], []
    runner.parts[0].register_forward_pre_hook(
        lambda m, a: seen.append([p.detach().clone() for p in m.parameters()]) if m.training else None)
    for step in range(steps):
        inputs, targets = global_batch(cfg, step)
        n_seen = len(seen)
        runner.forward_backward(inputs, targets)
        at_forward = seen[n_seen]  # every microbatch of the step runs at the same weights
        assert all(torch.equal(a, b) for a, b in zip(at_forward, seen[-1], strict=True))
        seen[n_seen:] = [at_forward]
        runner.clip_grad_norm_(cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        after.append([p.detach().clone() for p in runner.parts[0].parameters()])
    moved = 0
    for t in range(steps - s + 1):
        applied_to = after[t + s - 1]  # w_{t+s}: G_t is applied by optimizer step t + s
        for a, b in zip(seen[t], applied_to, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        moved += t > 0 and not all(torch.equal(a, b) for a, b in zip(seen[t], after[t - 1], strict=True))
    assert moved >= steps - s - 1  # the forward did run ahead of the current weights


def test_a_rank_more_than_s_steps_behind_makes_the_others_wait(dist_run):
    """Rank 1 sleeps 0.2 s before every step, s = 1: rank 0 may run ahead, but it has the gradient of step t - 1 in
    hand only after rank 1 launched step t - 1 (a causal check on one machine's clock, no timing threshold)."""
    steps, s = 5, 1
    overrides = ["parallel.dp=2", "train.global_batch=16", TWO_LAYERS, *STALE, f"staleness.max_staleness={s}",
                 'staleness.test_fault_injection="sleep_s=0.2,probability=1.0,rank=1"']
    fast, slow = dist_run(2, _stale_run, overrides, steps)
    for t in range(s, steps):
        assert fast["applied"][t] >= slow["launched"][t - s], f"rank 0 applied step {t - s} before rank 1 sent it"


def _budget_reference(cfg, steps, counts_per_rank, dp):
    """One process: the update of step t is the mean over exactly the microbatches each rank processed."""
    runner = Runner(_single_model(cfg), cfg.train.microbatch, torch.device("cpu"))
    optimizer = build_optimizer(runner, cfg.optim)
    per_rank, mb = cfg.train.global_batch // dp, cfg.train.microbatch
    losses = []
    for step in range(steps):
        inputs, targets = global_batch(cfg, step)
        rows = [r * per_rank + i for r in range(dp) for i in range(counts_per_rank[r][step] * mb)]
        losses.append(float(runner.forward_backward(inputs[rows], targets[rows])))
        runner.clip_grad_norm_(cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, {n: p.detach().clone() for n, p in runner.model.named_parameters()}


@pytest.mark.parametrize("fault", ["", "sleep_s=0.15,probability=1.0,rank=1"])
def test_time_budget_update_is_the_mean_over_processed_microbatches(dist_run, fault):
    """Budget 1 ns: each rank does exactly its first microbatch. Budget 0.1 s with rank 1 sleeping 0.15 s before
    every step: rank 1 does one, rank 0 as many as fit (whatever this machine manages: the reference is built
    from the counts the ranks report)."""
    steps = 4
    budget = "1e-9" if not fault else "0.1"
    overrides = ["parallel.dp=2", "train.global_batch=16", TWO_LAYERS, 'staleness.policy="time_budget"',
                 'parallel.dp_kind="ddp"', f"staleness.step_budget_s={budget}",
                 f'staleness.test_fault_injection="{fault}"']
    results = dist_run(2, _stale_run, overrides, steps)
    counts = [res["local_microbatches"] for res in results]
    if not fault:
        assert counts == [[1] * steps, [1] * steps]
    else:
        assert counts[1] == [1] * steps  # the sleeping rank always overruns: at least one, never more
    ref_losses, ref_params = _budget_reference(make_config(overrides), steps, counts, 2)
    init = dict(_single_model(make_config(overrides)).named_parameters())
    for res in results:
        assert [m for _, _, _, m in res["history"]] == [counts[0][t] + counts[1][t] for t in range(steps)]
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        _assert_same_updates(res["params"], ref_params, init)


# -- lookahead_arrived: the reduced gradient where it already arrived -------------------------------------------

ARRIVED = [*STALE, "staleness.max_staleness=1", 'staleness.compensation="optimizer_lookahead"',
           "staleness.lookahead_arrived=true", "staleness.arrival_grace=0"]  # tests that set a grace say so
# fp32 tolerance of "the same weights as synchronous DDP": each tensor's distance to sync's, relative to sync's total
# update, below 1e-4 (rounding: the runner's AdamW replay vs torch's foreach AdamW, the clip norm summed in another
# order). The own-gradient prediction misses by far more (asserted below, so the check can fail).
SYNC_EQUIVALENT_RTOL = 1e-4
# the lookahead_arrived tests' runs (several per test, 2 ranks): 2 layers, 4 microbatches of 2 rows per rank
LOOKAHEAD_MODEL = ["train.global_batch=16", TWO_LAYERS]


def _wait_then_arrived(item):
    for work in item.works:
        if work is not None:
            work.wait()
    return True


def _arrival_runs(overrides, steps):
    """Synchronous DDP for steps - 1 steps; s = 1 lookahead for `steps` steps with every reduction forced to have
    arrived (waited for before predicting), forced never arrived, and the plain own-gradient lookahead."""
    env = init_distributed("cpu")
    sync_cfg = make_config([*overrides, 'parallel.dp_kind="ddp"'])
    out = {"sync": _train(sync_cfg, build_runner(sync_cfg, env), steps - 1)}
    own = [*STALE, "staleness.max_staleness=1", 'staleness.compensation="optimizer_lookahead"', *OWN]
    for name, extra, arrived in (("forced", ARRIVED, _wait_then_arrived), ("never", ARRIVED, lambda item: False),
                                 ("own", own, None)):
        cfg = make_config(overrides + extra)
        runner = build_runner(cfg, env)
        if arrived is not None:
            runner.arrived = arrived
        out[name] = _train(cfg, runner, steps)
        out[name]["lookahead"] = [(a.lookahead_pending, a.lookahead_exact) for a in runner.history]
    return out


def _distance_to(params, ref_params, init):
    return max(float((p - ref_params[n]).norm() / (ref_params[n] - init[n].detach()).norm())
               for n, p in params.items())


def test_lookahead_arrived_at_s1_computes_at_the_weights_it_is_applied_to(dist_run):
    """dp 2, clipping on, constant lr: with every reduction in hand, step t's gradient is computed at exactly
    w_{t+1}, so the run is synchronous DDP one step late: its weights after N + 1 steps equal sync's after N (fp32
    rounding, SYNC_EQUIVALENT_RTOL), and each applied gradient's loss is sync's loss of that step. Never arrived:
    bit for bit the own-gradient lookahead."""
    steps = 6
    results = dist_run(2, _arrival_runs, ["parallel.dp=2", *LOOKAHEAD_MODEL], steps)
    init = dict(_single_model(make_config(LOOKAHEAD_MODEL)).named_parameters())
    for res in results:
        forced, never, own, sync = res["forced"], res["never"], res["own"], res["sync"]
        assert forced["lookahead"] == [(0, 0)] + [(1, 1)] * (steps - 1)
        assert never["lookahead"] == [(0, 0)] + [(1, 0)] * (steps - 1)
        for t, grad_step, loss, _ in forced["history"][1:]:
            assert t - grad_step == 1
            assert loss == pytest.approx(sync["losses"][grad_step], rel=1e-5)
        exact_err = _distance_to(forced["params"], sync["params"], init)
        own_err = _distance_to(own["params"], sync["params"], init)
        assert exact_err < SYNC_EQUIVALENT_RTOL, f"{exact_err:.2e}"
        assert own_err > 100 * exact_err, (own_err, exact_err)  # the own-gradient prediction is visibly off
        for n, p in never["params"].items():
            assert torch.equal(p, own["params"][n]), f"not arrived must be the plain lookahead: {n}"
    for name, p in results[0]["forced"]["params"].items():
        assert torch.equal(p, results[1]["forced"]["params"][name]), f"ranks disagree on {name}"


def _warmup(step):
    return min((step + 1) / 4, 1.0)  # a learning rate that changes every step at first


def _schedule_runs(overrides, steps):
    """s = 2 lookahead with every reduction forced to have arrived, under a warm-up schedule that advances with
    each applied update (as the training loop does): replayed at the schedule's future learning rates (the
    scheduler attached) and at the current one (not attached); and synchronous DDP with the same schedule, which
    s = 2 then reproduces two steps late. (At s = 1 the current rate is the right one: the one pending step is
    applied by the step about to run.)"""
    env = init_distributed("cpu")
    sync_cfg = make_config([*overrides, 'parallel.dp_kind="ddp"'])
    out = {"sync": _train(sync_cfg, build_runner(sync_cfg, env), steps - 2, _warmup)}
    cfg = make_config([*overrides, *ARRIVED, "staleness.max_staleness=2"])
    for name, schedule in (("future_lrs", _warmup), ("current_lr", None)):
        runner = build_runner(cfg, env)
        runner.arrived = _wait_then_arrived
        if schedule is None:  # the same schedule applied by hand: the runner does not know the future rates
            out[name] = _train_current_lr(cfg, runner, steps)
        else:
            out[name] = _train(cfg, runner, steps, schedule)
    return out


def _train_current_lr(cfg, runner, steps):
    """_train with the warm-up schedule set on the optimizer by hand (indexed by applied updates, s = 2), so the
    runner sees only the current lr."""
    optimizer = build_optimizer(runner, cfg.optim)
    runner.attach_optimizer(optimizer)
    base = [g["lr"] for g in optimizer.param_groups]
    per_rank = cfg.train.global_batch // runner.dp_size
    for step in range(steps):
        for g, lr in zip(optimizer.param_groups, base, strict=True):
            g["lr"] = lr * _warmup(max(0, step - 2))
        inputs, targets = global_batch(cfg, step)
        sl = slice(runner.dp_rank * per_rank, (runner.dp_rank + 1) * per_rank)
        runner.forward_backward(inputs[sl], targets[sl])
        runner.clip_grad_norm_(cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    runner.finish()
    return {"params": {clean_name(n): full_tensor(p.detach()).clone()
                       for n, p in state_module(runner.parts).named_parameters()}}


def test_lookahead_replays_the_learning_rates_of_the_steps_that_apply_it(dist_run):
    """Under a changing learning rate, s = 2 with every reduction in hand is synchronous DDP two steps late (the
    schedule counts applied updates), if the replay uses the rate of the update that applies each pending gradient
    (the scheduler attached, as the training loop does): weights within SYNC_EQUIVALENT_RTOL. Replaying at the
    current rate misses by far more (so the check can fail)."""
    steps = 6
    results = dist_run(2, _schedule_runs, ["parallel.dp=2", *LOOKAHEAD_MODEL], steps)
    init = dict(_single_model(make_config(LOOKAHEAD_MODEL)).named_parameters())
    for res in results:
        exact_err = _distance_to(res["future_lrs"]["params"], res["sync"]["params"], init)
        current_err = _distance_to(res["current_lr"]["params"], res["sync"]["params"], init)
        assert exact_err < SYNC_EQUIVALENT_RTOL, f"{exact_err:.2e}"
        assert current_err > 10 * exact_err, (current_err, exact_err)


def test_lookahead_arrived_config_errors_and_metrics():
    for bad in (['staleness.compensation="none"', "staleness.max_staleness=1"],
                ['staleness.compensation="weight_prediction"', "staleness.max_staleness=1"],
                ["staleness.max_staleness=0"]):
        with pytest.raises(ValueError, match="staleness.lookahead_arrived=true needs staleness.compensation="
                                             "'optimizer_lookahead' and staleness.max_staleness > 0 .*allowed"):
            load_config(None, [*STALE, *bad, "staleness.lookahead_arrived=true"])
    with pytest.raises(ValueError, match="staleness.lookahead_arrived=true needs"):
        load_config(None, ["staleness.lookahead_arrived=true"])  # policy sync
    assert load_config(None, []).staleness.lookahead_arrived is None  # automatic
    auto = build_runner(make_config([*STALE, "staleness.max_staleness=1"]), _single_env())
    # on where supported (tp = 1)
    assert auto.compensation.lookahead_arrived and auto.compensation.arrival_grace == 0.1
    own = build_runner(make_config([*STALE, "staleness.max_staleness=1", *OWN]), _single_env())
    assert not own.compensation.lookahead_arrived
    with pytest.raises(ValueError, match="lookahead_arrived=true with parallel.tp=2 is not supported"):
        check_staleness_layout(make_config(ARRIVED), {"pp": 1, "dp": 2, "cp": 1, "tp": 2})
    # one process: no reduction to wait for, so every pending step is exact and the metrics say so
    cfg = make_config([*ARRIVED, "staleness.max_staleness=2"])
    runner = build_runner(cfg, _single_env())
    optimizer = build_optimizer(runner, cfg.optim)
    runner.attach_optimizer(optimizer)
    for step in range(4):
        runner.forward_backward(*global_batch(cfg, step))
        runner.clip_grad_norm_(cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert [(a.lookahead_pending, a.lookahead_exact) for a in runner.history] == [(0, 0), (1, 1), (2, 2), (2, 2)]
    metrics = runner.staleness_metrics()
    assert metrics["lookahead_pending"] == 2 and metrics["lookahead_exact"] == 2


def _grace_run(grace, arrived, steps=4):
    """One process, s = 1, lookahead_arrived with arrival_grace = grace and a replaced arrival test."""
    cfg = make_config([*ARRIVED, f"staleness.arrival_grace={grace}"] if grace else ARRIVED)
    runner = build_runner(cfg, _single_env())
    runner.arrived = arrived
    return _train(cfg, runner, steps), runner.history


def test_arrival_grace_waits_until_arrival_or_the_deadline():
    """A reduction that never arrives is waited for exactly the grace (arrival_grace x the healthy step time, known
    from the first reduced step on), then the step predicts with the own gradient: bit for bit the run without a
    grace. One that arrives during the wait ends it early and replays the reduced gradient."""
    never = lambda item: False  # noqa: E731
    base, base_history = _grace_run(0.0, never)
    waited, history = _grace_run(0.5, never)
    assert [a.arrival_grace_s for a in base_history] == [0.0] * 4
    assert history[0].arrival_grace_s == 0.0 and history[1].arrival_grace_s == 0.0  # no step time known yet
    for a in history[2:]:
        assert a.arrival_grace_s > 0 and a.arrival_wait_s >= a.arrival_grace_s
        assert (a.lookahead_pending, a.lookahead_exact) == (1, 0)
    for name, p in waited["params"].items():
        assert torch.equal(p, base["params"][name]), f"a wait that ends in nothing must change nothing: {name}"
    polls = []

    def arrives_on_third_poll(item):  # monotonic, as work.is_completed(): once completed, always completed
        polls.append(item.step)
        return polls.count(item.step) >= 3
    _, history = _grace_run(1.0, arrives_on_third_poll)
    for a in history[2:]:
        assert (a.lookahead_pending, a.lookahead_exact) == (1, 1)
        assert a.arrival_wait_s < a.arrival_grace_s


def _arrives_from_second_ask():
    """Arrival test that says no at a step's prediction and yes from then on (between microbatches)."""
    asked: dict[int, int] = {}

    def arrived(item):
        asked[item.step] = asked.get(item.step, 0) + 1
        return asked[item.step] >= 2 and _wait_then_arrived(item)  # "arrived" means completed: wait for it here
    return arrived


def _weights_per_microbatch(overrides, steps):
    """dp 2, s = 1, lookahead_arrived, 4 microbatches per rank: the weights every microbatch's forward saw (a flat
    copy, via a forward pre-hook) and the exact-microbatch counts, for three arrival tests: never, always, and
    from the second ask on (a reduction arriving during the step)."""
    env = init_distributed("cpu")
    out = {}
    for name, arrived in (("never", lambda item: False), ("forced", _wait_then_arrived),
                          ("during", _arrives_from_second_ask())):
        cfg = make_config(overrides + ARRIVED)
        runner = build_runner(cfg, env)
        runner.arrived = arrived
        seen = []
        runner.model.register_forward_pre_hook(
            lambda mod, args, seen=seen, runner=runner:
            seen.append(torch.cat([full_tensor(p.detach()).reshape(-1) for p in runner.params])))
        out[name] = _train(cfg, runner, steps)
        out[name]["seen"] = seen
        out[name]["exact_mb"] = [a.exact_microbatches for a in runner.history]
        out[name]["lookahead"] = [(a.lookahead_pending, a.lookahead_exact) for a in runner.history]
    return out


def test_reduction_arriving_during_a_step_is_taken_between_microbatches(dist_run):
    """A reduction that arrives after the prediction: the step's first microbatch runs at the own-gradient
    prediction (the same weights, bit for bit, as a run where it never arrives), the remaining three at the exact
    prediction (the same weights as a run where it had arrived in time)."""
    mb = 4
    results = dist_run(2, _weights_per_microbatch, ["parallel.dp=2", *LOOKAHEAD_MODEL], 3)
    for res in results:
        never, forced, during = res["never"], res["forced"], res["during"]
        assert during["exact_mb"] == [0] + [mb - 1] * 2 and forced["exact_mb"] == [0] + [mb] * 2
        assert never["exact_mb"] == [0, 0, 0] and during["lookahead"][1:] == [(1, 1)] * 2
        # step 1 (the first with a pending step) starts from the same state in all three runs
        step1 = slice(mb, 2 * mb)
        seen_never, seen_forced, seen_during = (r["seen"][step1] for r in (never, forced, during))
        assert torch.equal(seen_during[0], seen_never[0])
        assert not torch.equal(seen_never[0], seen_forced[0])  # the check can fail: the two predictions differ
        for w in seen_during[1:]:
            assert torch.equal(w, seen_forced[0])


def test_arrival_grace_config_errors():
    with pytest.raises(ValueError, match=r"staleness.arrival_grace=0.2 waits for reductions .*allowed: "
                                         r"arrival_grace=0, or lookahead_arrived=true"):
        load_config(None, [*STALE, "staleness.max_staleness=1", *OWN, "staleness.arrival_grace=0.2"])
    with pytest.raises(ValueError, match="arrival_grace"):
        load_config(None, [*ARRIVED, "staleness.arrival_grace=1.5"])  # a fraction of the step time: at most 1
    assert load_config(None, [*ARRIVED, "staleness.arrival_grace=0.2"]).staleness.arrival_grace == 0.2


def _assert_same_updates(params, ref_params, init, rtol=1e-3):
    """Each tensor's total update (final - initial) within rtol of the reference's, in L2 norm. Elementwise checks
    fail on rounding alone: Adam divides by sqrt(v), amplifying it where a gradient is near zero."""
    for name, p in params.items():
        update = ref_params[name] - init[name].detach()
        err = float((p - ref_params[name]).norm() / update.norm())
        assert err < rtol, f"{name}: update differs by {err:.2e} of its norm"


# -- end to end through the training loop ---------------------------------------------------------------------------


def _train_loop(overrides):
    from paratrain.train.loop import train
    from paratrain.train.staleness import EvictionRequested

    cfg = load_config(None, overrides)
    try:
        return {"summary": train(cfg)}
    except EvictionRequested as exc:
        return {"evicted": exc.ranks, "code": exc.code, "path": str(exc.path)}


def _loop_overrides(tmp_path, extra):
    return ["train.steps=8", "optim.warmup_steps=1", "train.eval_every=0", "train.progress=false",
            f'metrics.run_dir="{tmp_path / "run"}"', "metrics.tensorboard=false",
            f'data.prepared_dir="{tmp_path / "data"}"', "data.max_source_bytes=200000", "data.vocab_size=512",
            "model.vocab=512", "model.layers=2", "train.global_batch=8", "train.microbatch=2", "train.seq_len=64",
            'train.device="cpu"', "parallel.dp=2", *STALE, *extra]


def test_training_loop_logs_staleness_and_evicts_a_slow_rank(dist_run, tmp_path):
    # slowdown 8 (was 4): at load average 100-200 on 2 cores a descheduled rank 0 measured up to ~2.7x its
    # compute, and a 4x rank 1 was then not flagged (threshold 1.5) within the window; the sleep costs no CPU
    overrides = _loop_overrides(tmp_path, [
        "staleness.max_staleness=1", 'staleness.test_fault_injection="slowdown=8,rank=1"',
        "staleness.straggler_window=3", "staleness.evict_stragglers=true", "checkpoint.interval=6"])
    results = dist_run(2, _train_loop, overrides)
    assert [r.get("evicted") for r in results] == [[1], [1]], results
    assert results[0]["code"] == EVICTION_EXIT_CODE
    request = json.loads((tmp_path / "run" / "eviction_request.json").read_text())
    assert request["ranks"] == [1] and request["step"] == 6 and request["step_time_ratio"][0] > 1.5
    assert "step_00000006" in request["checkpoint"]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "staleness" in r]
    assert [r["staleness"] for r in steps] == [None, 1, 1, 1, 1, 1]
    assert [r["grad_step"] for r in steps][1:] == [0, 1, 2, 3, 4]
    assert steps[-1]["stragglers"] == [1] and len(steps[-1]["rank_step_s"]) == 2


def test_training_loop_time_budget_reports_processed_tokens(dist_run, tmp_path):
    overrides = _loop_overrides(tmp_path, ['staleness.policy="time_budget"', "staleness.step_budget_s=1e-9",
                                           "train.steps=3"])
    results = dist_run(2, _train_loop, overrides)
    summary = results[0]["summary"]
    assert summary["steps"] == 3
    assert summary["tokens"] == 3 * 2 * 2 * 64  # one microbatch (2 x 64 tokens) per rank per step
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["microbatches"] for r in records if "microbatches" in r] == [2, 2, 2]  # step records only


def test_single_process_bounded_staleness_is_the_delayed_update():
    """No process group: the stale runner still delays by s (useful for convergence studies on one device)."""
    steps, s = 5, 2
    cfg = make_config([*STALE, f"staleness.max_staleness={s}", *NO_COMP])
    res = _train(cfg, build_runner(cfg, _single_env()), steps)
    ref_losses, ref_params = _delayed_reference(cfg, steps, s)
    assert [g for _, g, _, _ in res["history"]] == [None, None, 0, 1, 2]
    assert [loss for _, g, loss, _ in res["history"] if g is not None] == pytest.approx(ref_losses[:3], rel=1e-6)
    init = dict(_single_model(cfg).named_parameters())
    _assert_same_updates(res["params"], ref_params, init)


def test_the_loop_reaches_runners_through_explicit_hooks():
    """No duck typing: the training loop and its staleness helpers never ask a runner what it is; a synchronous
    runner carries the default hooks, the stale one its own (what the loop records and drains)."""
    import inspect

    from paratrain.parallel.runner import StepHooks
    from paratrain.train import loop, staleness

    for module in (loop, staleness):
        source = inspect.getsource(module)
        assert "hasattr(runner" not in source and "getattr(runner" not in source, module.__name__
    sync = build_runner(make_config([]), _single_env())
    assert type(sync.hooks) is StepHooks and sync.hooks.applied_update() and sync.hooks.step_metrics() == {}
    cfg = make_config([*STALE, "staleness.max_staleness=1", *NO_COMP])
    stale = build_runner(cfg, _single_env())
    assert isinstance(stale.hooks, StepHooks) and type(stale.hooks) is not StepHooks
    optimizer = build_optimizer(stale, cfg.optim)
    stale.hooks.attach_optimizer(optimizer, None)
    stale.forward_backward(*global_batch(cfg, 0))
    assert not stale.hooks.applied_update()  # s = 1: the first step applies nothing
    assert stale.hooks.step_metrics()["grad_step"] is None and stale.hooks.stragglers() == []
    stale.forward_backward(*global_batch(cfg, 1))
    assert stale.hooks.applied_update() and stale.hooks.step_metrics()["staleness"] == 1
    stale.hooks.finish()
    assert not stale.in_flight


@pytest.mark.slow
def test_torchrun_eviction_request_and_exit_code(tmp_path):
    """As users run it: torchrun, 2 ranks, s = 1, rank 1 slowed 8x (see above); the workers stop with exit code 75 after the
    checkpoint of step 6 and leave the eviction request (torchrun reports the workers' exit code, exits non-zero)."""
    import os

    import torchrun_fork

    from paratrain.train.data import prepare

    # The pool's ranks stay: idle they cost ~0.02 cores (4 ranks, groups shared) over this test's ~7 s, while the
    # next files' first pool tasks would pay a fresh pool's cold start (~2 CPU-s a rank; docs/benchmarks.md).
    overrides = _loop_overrides(tmp_path, [
        "staleness.max_staleness=1", 'staleness.test_fault_injection="slowdown=8,rank=1"',
        "staleness.straggler_window=3", "staleness.evict_stragglers=true", "checkpoint.interval=6"])
    prepare(load_config(None, overrides).data, log=lambda *_: None)
    sets = [a for o in overrides for a in ("--set", o)]
    code, log = torchrun_fork.run(["--nproc-per-node", "2", "--standalone"], ["train", *sets],  # forked warm
                                  {**os.environ, "OMP_NUM_THREADS": "1"}, tmp_path / "torchrun.log", 300)
    assert code != 0, log[-3000:]
    assert f"exitcode  : {EVICTION_EXIT_CODE}" in log or f"exitcode: {EVICTION_EXIT_CODE}" in log, log[-3000:]
    request = json.loads((tmp_path / "run" / "eviction_request.json").read_text())
    assert request["ranks"] == [1] and request["exit_code"] == EVICTION_EXIT_CODE
    assert (tmp_path / "run" / "checkpoints").is_dir()
