"""parallel.rank_order (paratrain.config.ranks): the rank groups of each order against Megatron-Core's RankGenerator
semantics, the config rule's errors, and the planner's group geometry. No processes (the DeviceMesh built for an
order is checked in tests/test_multinode_launch.py under a fake process group)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from paratrain.config import load_config
from paratrain.config.ranks import (
    DEFAULT_RANK_ORDER,
    MESH_DIMS,
    dim_strides,
    group_geometry,
    group_span,
    mesh_ranks,
    order_dims,
    rank_groups,
    valid_order,
)


def megatron_rank_groups(world_size, parallel_size, mask):
    """NVIDIA/Megatron-LM megatron/core/parallel_state.py generate_masked_orthogonal_rank_groups (@d98e8a64,
    Aug 2026), transcribed: the reference the rank order must reproduce."""
    def prefix_product(a, init=1):
        r = [init]
        for v in a:
            init = init * v
            r.append(init)
        return r

    def decompose(index, shape):
        stride = prefix_product(shape)
        return [(index // d) % s for s, d in zip(shape, stride, strict=False)]

    masked_shape = [s for s, m in zip(parallel_size, mask, strict=True) if m]
    unmasked_shape = [s for s, m in zip(parallel_size, mask, strict=True) if not m]
    global_stride = prefix_product(parallel_size)
    masked_stride = [d for d, m in zip(global_stride, mask, strict=False) if m]
    unmasked_stride = [d for d, m in zip(global_stride, mask, strict=False) if not m]
    group_size = prefix_product(masked_shape)[-1]
    ranks = []
    for group_index in range(world_size // group_size):
        g = decompose(group_index, unmasked_shape)
        ranks.append([sum(x * y for x, y in zip(decompose(r, masked_shape), masked_stride, strict=False))
                      + sum(x * y for x, y in zip(g, unmasked_stride, strict=False)) for r in range(group_size)])
    return ranks


ORDERS = ("tp-cp-dp-pp", "tp-cp-pp-dp", "tp-dp-pp-cp", "tp-pp-cp-dp")
SHAPES = ({"tp": 2, "cp": 3, "dp": 2, "pp": 2}, {"tp": 4, "cp": 1, "dp": 2, "pp": 3}, {"tp": 1, "cp": 2, "dp": 4, "pp": 2})


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("sizes", SHAPES)
def test_rank_groups_are_megatrons(order, sizes):
    """Every single dimension and the dp-cp pair (Megatron's data_parallel_group with context parallelism) give
    Megatron's groups, in its order; and each group's ranks follow the stride and span group_geometry reports."""
    dims = order_dims(order)
    world = int(np.prod(list(sizes.values())))
    for group in [(d,) for d in dims] + [("dp", "cp")]:
        expected = megatron_rank_groups(world, [sizes[d] for d in dims], [d in group for d in dims])
        assert rank_groups(dims, sizes, group) == expected
        degree, stride, inner, outer = group_geometry(dims, sizes, group)
        first = expected[0]
        assert degree == len(first)
        assert first[:inner] == [stride * i for i in range(inner)]  # a run of inner members stride apart
        assert [first[k * inner] for k in range(degree // inner)] == [outer * k for k in range(degree // inner)]
        assert group_span(stride, inner, outer, degree) >= first[-1] + 1


def test_default_order_is_todays_mesh_and_megatrons():
    """The default is the mapping paratrain always had (init_device_mesh's row-major (pp, dp, cp, tp) grid) and
    Megatron-Core's default order without ep; tp-cp-pp-dp (Megatron's --use-tp-pp-dp-mapping, Llama 3) puts dp
    outermost."""
    sizes = {"tp": 2, "cp": 2, "dp": 3, "pp": 2}
    assert (mesh_ranks(order_dims(DEFAULT_RANK_ORDER), sizes, MESH_DIMS)
            == np.arange(24).reshape(2, 3, 2, 2)).all()
    strides = dim_strides(order_dims("tp-cp-pp-dp"), sizes)
    assert strides == {"tp": 1, "cp": 2, "pp": 4, "dp": 8}
    assert rank_groups(order_dims("tp-cp-pp-dp"), sizes, ("dp",))[0] == [0, 8, 16]


def test_split_group_geometry_counts_members_per_domain():
    """Llama 3's long-context layout, TP8 CP16 PP16 DP8 in tp-cp-pp-dp: the dp x cp gradient group is 16 cp ranks 8
    apart, repeated every 2,048 ranks (one block per pipeline x cp x tp) - not one run of 128 ranks 8 apart."""
    sizes = {"tp": 8, "cp": 16, "pp": 16, "dp": 8}
    assert group_geometry(order_dims("tp-cp-pp-dp"), sizes, ("dp", "cp")) == (128, 8, 16, 2048)
    assert group_geometry(order_dims(DEFAULT_RANK_ORDER), sizes, ("dp", "cp")) == (128, 8, 128, 1024)
    # arrays (the planner's grid): a size-1 side leaves the other's run contiguous
    degree, stride, inner, outer = group_geometry(order_dims("tp-cp-pp-dp"), {"tp": 8, "cp": np.array([1, 16]),
                                                                              "pp": 16, "dp": 8}, ("dp", "cp"))
    assert degree.tolist() == [8, 128] and stride.tolist() == [128, 8] and inner.tolist() == [8, 16]


def test_valid_orders_keep_tp_innermost():
    good = ["-".join(("tp",) + p) for p in itertools.permutations(("cp", "dp", "pp"))]
    assert all(valid_order(o) for o in good)
    assert not any(valid_order(o) for o in ("cp-tp-dp-pp", "tp-cp-dp", "tp-cp-dp-pp-ep", "tp-tp-dp-pp"))


@pytest.mark.parametrize(("sets", "expected"), [
    (['parallel.rank_order="cp-tp-dp-pp"'], "parallel.rank_order='cp-tp-dp-pp': allowed: tp, cp, dp, pp each once"),
    (['parallel.rank_order="tp-cp-pp-dp"', 'parallel.dp_kind="hsdp"', "parallel.cp=2", "train.seq_len=128"],
     "parallel.rank_order='tp-cp-pp-dp' with parallel.dp_kind='hsdp' and parallel.cp=2"),
    (['parallel.rank_order="tp-cp-pp-dp"', 'model.preset="tiny-moe"'], "with model.num_experts="),
])
def test_rank_order_rule_errors_name_field_value_and_allowed(sets, expected):
    with pytest.raises(ValueError, match="rank_order") as err:
        load_config(None, sets)
    assert expected in str(err.value)


def test_rank_order_loads_and_reaches_the_planner_layout():
    from paratrain.plan.api import layout_from_parallel

    cfg = load_config(None, ['parallel.rank_order="tp-cp-pp-dp"'])
    assert layout_from_parallel(cfg.parallel, 1).rank_order == "tp-cp-pp-dp"
    assert layout_from_parallel(cfg.parallel, 1).to_parallel().rank_order == "tp-cp-pp-dp"


def _llama3_8k(system: str, order: str):
    """Llama 3 405B's 8,192-GPU layout (Dubey et al. 2024 sec. 3.3.2: TP8 PP16 v8, FSDP without resharding)."""
    from paratrain.plan.api import Layout, estimate

    lay = Layout(tp=8, pp=16, sp=True, microbatch=1, pp_schedule="interleaved_1f1b", virtual_stages=8, dp_kind="fsdp",
                 zero_stage=2, pp_layers="balanced", rank_order=order)
    return estimate("llama3.1-405b", system, 1024, 8192, 2048, lay, stack="megatron").time_breakdown_s


def test_planner_order_moves_pipeline_or_dp_across_pods():
    """On Meta's cluster (3,072-GPU pods, 1:7 between them) the default order sends the pipeline's sends across
    pods (PP stride 8 x 64 = 512, 16 stages span all 8,192 GPUs) and keeps a DP group of 64 x 8 ranks inside one;
    Meta's [TP, CP, PP, DP] keeps the pipeline in a pod (stride 8, span 128) and sends DP across. On DGX H100 (one
    non-blocking tier above the node, TP filling the node) the order changes nothing."""
    default, meta = _llama3_8k("meta-llama3-h100", DEFAULT_RANK_ORDER), _llama3_8k("meta-llama3-h100", "tp-cp-pp-dp")
    assert meta["pp_comm"] < default["pp_comm"] / 3
    assert meta["dp_comm"] > 1.1 * default["dp_comm"]
    assert _llama3_8k("dgx-h100", DEFAULT_RANK_ORDER) == _llama3_8k("dgx-h100", "tp-cp-pp-dp")
