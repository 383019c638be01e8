"""Activation memory of one transformer block per rank: bytes autograd keeps for backward.

Counted with torch.autograd.graph.saved_tensors_hooks (every tensor an op saves, deduplicated by storage, local
shard of DTensors, parameters and RoPE tables excluded) plus the inputs a checkpointed region keeps for its
recompute (those are held by the checkpoint itself, not through saved-tensor hooks). Run as a script to print
the table recorded in docs/parallelism.md:  .venv/bin/python tests/test_activation_memory.py
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from paratrain.model.config import ModelConfig
from paratrain.model.llama import Llama
from paratrain.parallel.recompute import apply_recompute, observe_kept_tensors

SHAPE = ModelConfig(name="mem", layers=1, hidden=256, heads=8, kv_heads=4, ffn_hidden=512, vocab=256, max_seq=256)
BATCH, SEQ = 2, 128
KERNELS = {"cpu-flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


def _local(t: torch.Tensor) -> torch.Tensor:
    while isinstance(t, (DTensor, AsyncCollectiveTensor)):
        t = t._local_tensor if isinstance(t, DTensor) else t.elem
    return t


class SavedBytes:
    """Unique storages kept for backward, with the bytes of attention-score-shaped (.., s, s) tensors."""

    def __init__(self, excluded: set[int], seq: int):
        self.excluded, self.seq = excluded, seq
        self.storages: dict[int, int] = {}
        self.score_storages: set[int] = set()

    def add(self, t: torch.Tensor) -> None:
        t = _local(t)
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.excluded or key in self.storages:
            return
        self.storages[key] = storage.nbytes()
        if t.dim() == 4 and t.shape[-1] == t.shape[-2] == self.seq:  # (b, heads, s, s) probabilities
            self.score_storages.add(key)

    def pack(self, t):
        self.add(t)
        return t

    def observe_inputs(self, args) -> None:
        for a in args:
            if isinstance(a, torch.Tensor):
                self.add(a)

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    @property
    def scores(self) -> int:
        return sum(self.storages[k] for k in self.score_storages)


def measure_block(tp: int, sp: bool, recompute: str, kernels=tuple(KERNELS)) -> dict:
    """Bytes saved for backward by block 0 on this rank, for each attention kernel in `kernels` (run on every
    rank of a world divisible by tp). One model per layout serves every kernel: the kernel is chosen per
    forward (and its recompute), and nothing a forward/backward leaves behind is counted by the next (parameter
    and gradient storages are excluded; the gradients are dropped in between)."""
    model = Llama(SHAPE)
    model.init_weights(0)
    rank = 0
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from paratrain.parallel.tensor import apply_tp

        world = dist.get_world_size()
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]
        apply_tp(model, mesh, sp=sp)
        rank = mesh.get_local_rank()
    apply_recompute(model, recompute)
    block = model.layers["0"]
    x_full = torch.randn(BATCH, SEQ, SHAPE.hidden, generator=torch.Generator().manual_seed(0))
    cos, sin = model.rope_cos[:SEQ], model.rope_sin[:SEQ]
    excluded = {_local(t).untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    out = {}
    for kernel in kernels:
        x = (x_full.chunk(tp, dim=1)[rank] if sp else x_full).clone().requires_grad_()
        counter = SavedBytes(excluded, SEQ)
        with sdpa_kernel(KERNELS[kernel]), observe_kept_tensors(counter.observe_inputs), \
                torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            y = block(x, cos, sin)
        with sdpa_kernel(KERNELS[kernel]):  # the recompute in backward must pick the same attention kernel
            _local(y).sum().backward()  # the recorded graph is a working one
        model.zero_grad(set_to_none=True)
        out[kernel] = {"bytes": counter.total, "score_bytes": counter.scores}
        del x, y, counter
    return out


def predicted_bytes(tp: int, sp: bool, recompute: str, kernel: str) -> int:
    """What the derivation in docs/parallelism.md predicts for this block (fp32, 4 bytes per element).

    Per TP region ("half") outside the TP-sharded part: the norm input, its normalised output, the norm x
    weight product that feeds the column-parallel linears (3 bsh) and the rstd (bs). Inside (sharded by t):
    attention keeps q, the kv heads repeated for GQA, v repeated and the output (4 bsh) plus, for the CPU
    flash kernel, the row logsumexp (b a s), or for the math kernel the softmax probabilities (b a s^2);
    selective keeps q, k, v un-repeated and the output instead; the SwiGLU keeps w1 x, silu(w1 x), w3 x and
    their product (4 bsf). SP shards the outside part by t too; full recompute keeps only the block input."""
    b, s, h, f, a = BATCH, SEQ, SHAPE.hidden, SHAPE.ffn, SHAPE.heads
    kv_dim = SHAPE.kv_dim
    if recompute == "full":
        return 4 * b * s * h // (tp if sp else 1)
    outside = 2 * (3 * b * s * h + b * s)
    if recompute == "selective":
        attention = 2 * b * s * h + 2 * b * s * kv_dim
    else:
        attention = 4 * b * s * h + (a * b * s if kernel == "cpu-flash" else a * b * s * s)
    inside = attention + 4 * b * s * f
    elements = (outside + inside) / tp if sp else outside + inside / tp
    return int(4 * elements)


CASES = [(tp, sp, mode) for tp in (1, 2, 4) for sp in (False, True) for mode in ("none", "selective", "full")
         if not (sp and tp == 1)]


def _measure_cases(cases):
    """{(tp, sp, mode, kernel): bytes} of each (tp, sp, mode) case, every kernel on one model."""
    return {(*case, kernel): got for case in cases for kernel, got in measure_block(*case).items()}


def _all_results(dist_run) -> dict:
    results = _measure_cases([c for c in CASES if c[0] == 1])
    for tp in (2, 4):  # each on a world of tp ranks: at world 4, tp=2 would only repeat the block on a second pair
        results.update(dist_run(tp, _measure_cases, [c for c in CASES if c[0] == tp])[0])
    return results


@pytest.fixture(scope="module")
def results(dist_run):
    return _all_results(dist_run)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_saved_bytes_match_derivation(results, kernel):
    for tp, sp, mode in CASES:
        got = results[(tp, sp, mode, kernel)]["bytes"]
        assert got == predicted_bytes(tp, sp, mode, kernel), (tp, sp, mode, kernel, got)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_ratios_theory_predicts(results, kernel):
    base = {mode: results[(1, False, mode, kernel)]["bytes"] for mode in ("none", "selective", "full")}
    for tp in (2, 4):
        for mode in ("none", "selective", "full"):
            assert results[(tp, True, mode, kernel)]["bytes"] * tp == base[mode]  # SP divides everything by t
            # TP alone leaves the norm/residual region (6 bsh + 2 bs per block) replicated
            assert results[(tp, False, mode, kernel)]["bytes"] * tp > base[mode] or mode == "full"
    assert base["full"] == 4 * BATCH * SEQ * SHAPE.hidden  # full: only the block input
    # selective drops the attention-score terms: none keeps (b, heads, s, s) probabilities only with the math
    # kernel; the CPU flash kernel never materialises them (it keeps a logsumexp per row instead)
    scores = results[(1, False, "none", kernel)]["score_bytes"]
    assert scores == (4 * BATCH * SHAPE.heads * SEQ * SEQ if kernel == "math" else 0)
    assert results[(1, False, "selective", kernel)]["score_bytes"] == 0
    assert base["none"] - base["selective"] >= scores


def _markdown_table(results: dict) -> str:
    lines = ["| TP | SP | recompute | kernel | saved bytes / rank | x of TP1 same mode | predicted |",
             "|---|---|---|---|---:|---:|---:|"]
    for kernel in KERNELS:
        for tp, sp, mode in CASES:
            got = results[(tp, sp, mode, kernel)]["bytes"]
            base = results[(1, False, mode, kernel)]["bytes"]
            lines.append(f"| {tp} | {'on' if sp else 'off'} | {mode} | {kernel} | {got:,} | {got / base:.3f} | "
                         f"{predicted_bytes(tp, sp, mode, kernel):,} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import os
    import sys

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, os.path.dirname(__file__))
    import dist_pool

    try:
        print(f"one block: b={BATCH} s={SEQ} h={SHAPE.hidden} heads={SHAPE.heads} kv_heads={SHAPE.kv_heads} "
              f"ffn={SHAPE.ffn}, fp32")
        print(_markdown_table(_all_results(lambda w, fn, *a: dist_pool.get_pool(w).run(fn, *a))))
    finally:
        dist_pool.close_all()
