"""Meta-device construction and shard-by-shard materialisation (parallel/materialize.py, model/init.py).

- The layout-independent init: a shard filled from its row source equals the slice of the single-device
  tensor, for any index pattern (contiguous, strided, uneven, column-sharded).
- Under every layout family (FSDP, HSDP, TP/SP, TP x FSDP (2-D strided shards), TP x DDP, PP x FSDP, CP x FSDP),
  `build_runner` builds on meta and each rank allocates only its shards: a TorchDispatchMode records every real
  (non-meta, non-DTensor-wrapper) tensor any op touches while the runner is built, and no such tensor has the
  full shape (or, flat, the full size) of a parameter the layout shards; and the gathered parameters equal the
  single-device model's bitwise.
The parity harness (test_parallel.py, test_pipeline*.py, test_context_parallel.py) checks losses and gradients
of the same layouts against the single device.
"""

import pytest
import torch
from parity import make_config
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from paratrain.model.init import FilledRows, RandomRows, read_all
from paratrain.parallel.materialize import fill_shard_

# Shapes chosen so that no shard of one parameter has the global shape of another (hidden 96, kv_dim 32,
# ffn 160, vocab 352): a full-shape tensor seen during the build can only be a full copy.
SHAPE = ["model.layers=2", "model.hidden=96", "model.heads=6", "model.kv_heads=2", "model.ffn_hidden=160",
         "model.vocab=352"]


@pytest.mark.parametrize("index", [
    [torch.arange(3, 9), None],  # a row range
    [torch.tensor([0, 1, 2, 7, 8, 12]), None],  # runs of rows (FSDP over TP: strided)
    [None, torch.arange(5, 11)],  # a column range (row-parallel TP)
    [torch.tensor([1, 4, 5]), torch.tensor([0, 2, 3, 9])],  # both, non-contiguous columns
    [torch.empty(0, dtype=torch.long), None],  # an empty shard (uneven FSDP split)
])
def test_shard_equals_slice_of_the_single_device_tensor(index):
    shape = (13, 11)
    source = RandomRows(seed=3, name="layers.0.attention.wq.weight", shape=shape, std=0.02)
    full = read_all(source, shape)
    expected = full
    for d, idx in enumerate(index):
        if idx is not None:
            expected = expected.index_select(d, idx)
    local = torch.full(expected.shape, float("nan"))
    fill_shard_(local, shape, index, source)
    assert torch.equal(local, expected)


def test_init_depends_on_seed_and_name_only():
    a = read_all(RandomRows(1, "w", (4, 8), 0.02), (4, 8))
    assert torch.equal(a, read_all(RandomRows(1, "w", (4, 8), 0.02), (4, 8)))
    assert not torch.equal(a, read_all(RandomRows(2, "w", (4, 8), 0.02), (4, 8)))
    assert not torch.equal(a, read_all(RandomRows(1, "v", (4, 8), 0.02), (4, 8)))
    assert abs(float(read_all(RandomRows(0, "big", (256, 256), 0.02), (256, 256)).std()) - 0.02) < 5e-4
    local = torch.zeros(2)
    fill_shard_(local, (6,), [torch.tensor([4, 5])], FilledRows((6,), 1.0))
    assert local.tolist() == [1.0, 1.0]


def test_a_read_of_many_blocks_gives_each_blocks_own_stream():
    """RandomRows.read spans several aligned blocks (read_rows) and draws them into one array: every row is
    still the Philox stream of its own block (key blake2b(seed, name), counter b * 2**192, as the module doc
    says), with or without column bounds, and a 1-D parameter's partial blocks are cut from whole ones."""
    import hashlib

    import numpy as np

    def stream(name, b, n):
        key = np.frombuffer(hashlib.blake2b(f"paratrain-init\0{5}\0{name}".encode(), digest_size=16).digest(),
                            dtype=np.uint64)
        bits = np.random.Philox(key=key, counter=np.array([0, 0, 0, b], dtype=np.uint64))
        return torch.from_numpy(np.random.Generator(bits).standard_normal(n, dtype=np.float32) * np.float32(0.02))

    m = RandomRows(5, "m", (40, 24), 0.02)
    assert m.read_rows >= 40
    rows = torch.stack([stream("m", r, 24) for r in range(40)])
    assert torch.equal(read_all(m, (40, 24)), rows)
    assert torch.equal(m.read(3, 31), rows[3:31])
    assert torch.equal(m.read(3, 31, [(5, 17)]), rows[3:31, 5:17])
    v = RandomRows(5, "v", (9000,), 0.02)  # blocks of 4096 values: [0, 4096), [4096, 8192), [8192, 9000)
    values = torch.cat([stream("v", 0, 4096), stream("v", 1, 4096), stream("v", 2, 808)])
    assert torch.equal(read_all(v, (9000,)), values)
    assert torch.equal(v.read(4000, 8500), values[4000:8500])
    local = torch.zeros(12, 6)
    fill_shard_(local, (40, 24), [torch.tensor([0, 1, 2, 3, 9, 10, 11, 12, 13, 30, 38, 39]), torch.arange(6, 12)], m)
    assert torch.equal(local, rows[[0, 1, 2, 3, 9, 10, 11, 12, 13, 30, 38, 39]][:, 6:12])


class RecordRealTensors(TorchDispatchMode):
    """Shapes of every real floating-point tensor an op takes or returns (weights are floating point; index
    tensors are not recorded; DTensor wrappers are skipped: their local tensors pass through this mode as plain
    tensors)."""

    def __init__(self):
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        from torch.distributed.tensor import DTensor

        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and not t.is_meta and t.is_floating_point():
                self.shapes.add(tuple(t.shape))
        return out


def _build_and_check(overrides: list[str]) -> dict:
    """On every rank: build the runner under the recorder; report full-size tensors of sharded parameters and
    whether the gathered weights equal the single-device model's."""
    from torch.distributed.tensor import DTensor

    from paratrain.parallel.mesh import init_distributed
    from paratrain.train.checkpoint import state_module
    from paratrain.train.loop import _build_model, build_runner

    cfg = make_config(SHAPE + overrides)
    env = init_distributed("cpu")
    recorder = RecordRealTensors()
    with recorder:
        runner = build_runner(cfg, env)
    reference = dict(_build_model(cfg, cfg.model_shape()).named_parameters())
    full_copies, mismatched, sharded = [], [], 0
    for name, p in state_module(runner.parts).named_parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        if local.numel() < p.numel():
            sharded += 1
            shape = tuple(p.shape)
            if shape in recorder.shapes or (p.numel(),) in recorder.shapes:
                full_copies.append(name)
        full = p.full_tensor() if isinstance(p, DTensor) else p
        if not torch.equal(full.detach(), reference[name].detach()):
            mismatched.append(name)
    return {"full_copies": full_copies, "mismatched": mismatched, "sharded": sharded}


LAYOUTS = [
    ["parallel.dp=4", "parallel.dp_kind=\"fsdp\""],
    ["parallel.dp=4", "parallel.dp_kind=\"hsdp\"", "parallel.dp_replicate=2"],
    ["parallel.tp=2", "parallel.dp=2", "parallel.dp_kind=\"fsdp\"", "parallel.sp=true"],  # 2-D strided shards
    ["parallel.tp=2", "parallel.dp=2", "parallel.dp_kind=\"ddp\""],
    ["parallel.pp=2", "parallel.dp=2", "parallel.dp_kind=\"fsdp\""],
    ["parallel.cp=2", "parallel.dp=2", "parallel.dp_kind=\"fsdp\""],
]


def _all_layouts():
    return [_build_and_check(layout) for layout in LAYOUTS]


def test_no_rank_materialises_a_full_sharded_weight(dist_run):
    per_rank = dist_run(4, _all_layouts)
    for rank, results in enumerate(per_rank):
        for layout, got in zip(LAYOUTS, results, strict=True):
            assert got["sharded"] > 0, f"{layout}: nothing sharded on rank {rank}?"
            assert not got["full_copies"], f"{layout} rank {rank}: full tensors of {got['full_copies']}"
            assert not got["mismatched"], f"{layout} rank {rank}: weights differ from one device: {got['mismatched']}"


def test_recorder_sees_a_full_copy(dist_run):
    """The check above can fail: materialising a whole model first (the old path) is caught."""
    per_rank = dist_run(2, _old_path_full_copies)
    assert all(per_rank), per_rank


def _old_path_full_copies() -> list[str]:
    from torch.distributed.tensor import DTensor

    from paratrain.parallel import parallelize
    from paratrain.parallel.mesh import build_mesh, init_distributed
    from paratrain.train.loop import _build_model

    cfg = make_config(SHAPE + ["parallel.dp=2", "parallel.dp_kind=\"fsdp\""])
    env = init_distributed("cpu")
    recorder = RecordRealTensors()
    with recorder:
        runner = parallelize(_build_model(cfg, cfg.model_shape()), cfg, build_mesh(cfg.parallel, env), env)
    return [name for name, p in runner.model.named_parameters()
            if isinstance(p, DTensor) and p._local_tensor.numel() < p.numel() and tuple(p.shape) in recorder.shapes]
