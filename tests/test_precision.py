"""bf16 mixed precision (parallel/precision.py) against the fp32 single-device reference, on every path.

Tolerance, derived rather than picked. bf16 keeps 8 significant bits: unit roundoff u = 2^-8. Each bf16
rounding on the way from the input to the output perturbs it by at most u relative; with independent rounding
errors the relative error after n roundings grows like sqrt(n) u (the probabilistic rounding-error model of
Higham & Mary 2019; the worst case n u is far too pessimistic for sums of random-signed errors). Along the
forward path of one block the activations are rounded to bf16 8 times (the inputs of the q/k/v, output, gate/up
and down projections, the attention inputs and output, the SwiGLU product), plus 2 for the head, so
n_fwd = 8 L + 2; the backward rounds each matmul's output gradient once more per forward rounding, n_bwd =
2 n_fwd. So: gradient relative error (||g - g_ref|| / ||g_ref|| per tensor) <= sqrt(2 n_fwd) u, and the loss
relative error <= sqrt(n_fwd) u (a bound on any forward output's relative error; the loss at initialisation,
close to ln V, is far less sensitive, so the loss check is loose). L = 2 here: gradients 0.0234, loss 0.0166.
Measured (1 December 2026): gradients 0.008-0.011, losses 1e-5 to 3e-5 relative.

Each case also checks that bf16 really happened (an fp32 run would pass the tolerance trivially): the gradient
error must exceed u/16 (fp32 gives ~1e-6), FSDP's blocks must see bf16 weights in forward (the all-gather moves
bf16), and with reduce_dtype=bf16 every reduced gradient must be exactly representable in bf16.
"""

from __future__ import annotations

import math

import pytest
import torch
from parity import make_config, reference, run_steps

from paratrain.config import load_config, precision_bytes
from paratrain.parallel.precision import BF16_UNIT_ROUNDOFF, bf16_rtol

LAYERS = 2
SHAPE = [f"model.layers={LAYERS}"]
STEPS = 2  # AdamW steps: the second runs on the optimizer state the first left (as in the fp32 parity tests)
BF16 = ['train.dtype="bf16"']
U = BF16_UNIT_ROUNDOFF
N_FWD = 8 * LAYERS + 2
LOSS_RTOL = math.sqrt(N_FWD) * U
GRAD_RTOL = math.sqrt(2 * N_FWD) * U
assert bf16_rtol(LAYERS) == pytest.approx({"loss": LOSS_RTOL, "grad": GRAD_RTOL})  # the rule verify uses
GRAD_FLOOR = U / 16  # below this the run was not in bf16

CASES = [
    ["parallel.dp=2", 'parallel.dp_kind="fsdp"'],  # reduce fp32 (default)
    ["parallel.dp=2", 'parallel.dp_kind="fsdp"', 'train.reduce_dtype="bf16"'],
    ["parallel.dp=2", 'parallel.dp_kind="ddp"', 'train.reduce_dtype="bf16"'],
    ["parallel.tp=2"],  # autocast path, DTensor weights
    ["parallel.pp=2"],  # autocast path, stages
    ["parallel.cp=2"],  # FSDP over the cp ranks
]


# the large-model compositions: FSDP per pipeline stage, FSDP over tensor-parallel (SP) weights
CASES_4 = [
    ["parallel.pp=2", "parallel.dp=2", 'parallel.dp_kind="fsdp"'],
    ["parallel.tp=2", "parallel.sp=true", "parallel.dp=2", 'parallel.dp_kind="fsdp"', 'train.reduce_dtype="bf16"'],
]


def _run_case(overrides: list[str]) -> dict:
    from paratrain.parallel.mesh import init_distributed
    from paratrain.train.loop import build_runner

    cfg = make_config(SHAPE + BF16 + overrides)
    runner = build_runner(cfg, init_distributed("cpu"))
    seen = set()
    for part in runner.parts:
        for name, block in part.layers.items():
            block.register_forward_pre_hook(lambda m, _a, n=name: seen.add(str(m.attention.wq.weight.dtype)))
    out = run_steps(cfg, runner, STEPS)
    out["weight_dtypes_in_forward"] = sorted(seen)
    return out


def _run_cases(cases):
    return [_run_case(c) for c in cases]


@pytest.fixture(scope="module")
def ref():
    return reference(make_config(SHAPE), STEPS)


def _check(ref: dict, got: dict, label: str) -> list[str]:
    bad = []
    losses, ref_losses = torch.tensor(got["losses"]), torch.tensor(ref["losses"])
    loss_err = float(((losses - ref_losses).abs() / ref_losses.abs()).max())
    if loss_err > LOSS_RTOL:
        bad.append(f"{label}: loss relative error {loss_err:.2e} > {LOSS_RTOL:.2e}")
    errs = {n: float((g - ref["grads"][n]).norm() / ref["grads"][n].norm()) for n, g in got["grads"].items()}
    worst = max(errs, key=errs.get)
    if errs[worst] > GRAD_RTOL:
        bad.append(f"{label}: gradient of {worst}: relative error {errs[worst]:.2e} > {GRAD_RTOL:.2e}")
    if max(errs.values()) < GRAD_FLOOR:
        bad.append(f"{label}: gradients within {max(errs.values()):.1e} of fp32: bf16 compute did not happen")
    return bad


def test_single_device_bf16_within_tolerance_of_fp32(ref):
    assert not _check(ref, reference(make_config(SHAPE + BF16), STEPS), "single device bf16")


@pytest.mark.parametrize("world, cases", [(2, CASES), (4, CASES_4)], ids=["2 ranks", "4 ranks"])
def test_every_path_bf16_within_tolerance_of_fp32_reference(dist_run, ref, world, cases):
    results = dist_run(world, _run_cases, cases)
    failures = []
    for rank, per_case in enumerate(results):
        for overrides, got in zip(cases, per_case, strict=True):
            label = f"{' '.join(overrides)} (rank {rank})"
            failures += _check(ref, got, label)
            fsdp = 'parallel.dp_kind="fsdp"' in overrides or "parallel.cp=2" in overrides
            expected = ["torch.bfloat16"] if fsdp else ["torch.float32"]  # FSDP gathers bf16; autocast casts
            if got["weight_dtypes_in_forward"] != expected:
                failures.append(f"{label}: blocks saw weights {got['weight_dtypes_in_forward']}, expected {expected}")
            if 'train.reduce_dtype="bf16"' in overrides:
                for name, g in got["grads"].items():
                    if not torch.equal(g, g.to(torch.bfloat16).float()):
                        failures.append(f"{label}: gradient of {name} was not reduced in bf16")
                        break
    assert not failures, "\n".join(failures)


def test_reduce_dtype_checked_and_read_by_the_planner():
    with pytest.raises(ValueError, match=r"train.reduce_dtype='bf16' needs train.dtype='bf16'"):
        load_config(overrides=['train.reduce_dtype="bf16"'])
    assert precision_bytes(load_config().train) == {"param_bytes": 4, "grad_bytes": 4}
    bf = load_config(overrides=BF16 + ['train.reduce_dtype="bf16"']).train
    assert precision_bytes(bf) == {"param_bytes": 2, "grad_bytes": 2}


def test_planner_dp_bytes_follow_the_run_precision():
    """The planner's FSDP traffic for an fp32 run is twice that of a bf16 run with bf16 reduction."""
    from paratrain.hardware.catalog import resolve_system
    from paratrain.plan.api import Layout, estimate
    from paratrain.plan.options import Options

    model = make_config(SHAPE).model_shape()
    system = resolve_system("p5.48xlarge")
    layout = Layout(tp=1, pp=1, cp=1, dp=8, microbatch=1, dp_kind="fsdp", zero_stage=3)

    def dp_bytes(train_overrides):
        opts = Options.for_system(system, **precision_bytes(load_config(overrides=train_overrides).train))
        return estimate(model, system, 1, 32, 8, layout, opts).comm_bytes_per_device["dp"]

    assert dp_bytes([]) == pytest.approx(2 * dp_bytes(BF16 + ['train.reduce_dtype="bf16"']))
