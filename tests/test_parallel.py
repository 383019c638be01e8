"""Tensor/sequence/data parallelism and recomputation against the single-device model (CPU, gloo, fp32).

Each case runs the same model (tiny shape, 4 layers, heads=4, kv_heads=2, vocab 256) on the same global batch
as the single-device reference and compares: the loss of the first forward, every parameter's gradient after
the first backward (relative L2 error per parameter, from the full tensor gathered out of its shards), and the
losses of 3 AdamW steps (grad clipping on). Tolerance: loss rtol 1e-5 (atol 1e-6), gradient relative error 1e-5.

Cases are grouped per world size and recompute mode and run in one call to the persistent gloo pool.
TP4 on this model has kv_heads=2 < tp=4, so it also covers the replicated-kv-head path.
"""

import pytest
from parity import assert_matches_reference, make_config, parallel_run, reference

LOSS_RTOL, LOSS_ATOL, GRAD_RTOL = 1e-5, 1e-6, 1e-5

LAYOUTS = {
    2: [
        ["parallel.tp=2"],
        ["parallel.tp=2", "parallel.sp=true"],
        ["parallel.dp=2", "parallel.dp_kind=\"fsdp\""],
        ["parallel.dp=2", "parallel.dp_kind=\"ddp\""],
    ],
    4: [
        ["parallel.tp=4"],
        ["parallel.tp=4", "parallel.sp=true"],
        ["parallel.tp=2", "parallel.dp=2", "parallel.sp=true", "parallel.dp_kind=\"fsdp\""],
        ["parallel.tp=2", "parallel.dp=2", "parallel.sp=true", "parallel.dp_kind=\"ddp\""],
    ],
}


@pytest.fixture(scope="module")
def ref():
    return reference(make_config())


def _run_cases(cases):
    return [parallel_run(overrides) for overrides in cases]


def _check_all(ref, cases, per_rank_results):
    failures = []
    for rank, results in enumerate(per_rank_results):
        for overrides, got in zip(cases, results, strict=True):
            try:
                assert_matches_reference(ref, got, LOSS_RTOL, LOSS_ATOL, GRAD_RTOL)
            except AssertionError as exc:
                failures.append(f"{' '.join(overrides)} (rank {rank}): {exc}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("world", [2, 4])
def test_layouts_match_single_device(dist_run, ref, world, recompute):
    cases = [layout + [f"parallel.recompute=\"{recompute}\""] for layout in LAYOUTS[world]]
    _check_all(ref, cases, dist_run(world, _run_cases, cases))


def test_zero2_and_hsdp_match_single_device(dist_run, ref):
    cases = [
        ["parallel.dp=4", "parallel.dp_kind=\"fsdp\"", "parallel.reshard_after_forward=false"],
        ["parallel.dp=4", "parallel.dp_kind=\"hsdp\"", "parallel.dp_replicate=2"],
        ["parallel.tp=2", "parallel.dp=2", "parallel.dp_kind=\"hsdp\"", "parallel.dp_replicate=2",
         "parallel.sp=true"],
        ["parallel.dp=4", "parallel.zero_stage=2"],
    ]
    _check_all(ref, cases, dist_run(4, _run_cases, cases))
