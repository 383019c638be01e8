"""Context parallelism: zig-zag layout, block kernels, ring attention, and whole-model parity (CPU, gloo, fp32).

Ring attention is compared with SDPA on the whole sequence (outputs and q/k/v gradients of each rank's
zig-zag slice). The model cases run the same model and global batch as the single-device reference
(tests/parity.py): loss of the first forward, every parameter's gradient after one backward, and the losses
of 2 AdamW steps, on a 2-layer model (a block boundary between two ring attentions). Tolerance: loss rtol 1e-5 (atol 1e-6), gradient relative L2 error 1e-5 -- the same as every
other layout: the ring only reorders fp32 sums (blockwise softmax merged by log-sum-exp).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from parity import (
    assert_cases_match,
    assert_matches_reference,
    global_batch,
    make_config,
    parallel_run,
    reference,
)

from paratrain.model.llama import CoreAttention
from paratrain.parallel.context import (
    RingAttention,
    block_backward,
    block_forward,
    check_cp_layout,
    zigzag_positions,
    zigzag_shard,
    zigzag_unshard,
)

LOSS_RTOL, LOSS_ATOL, GRAD_RTOL = 1e-5, 1e-6, 1e-5
ATTN_TOL = {"rtol": 1e-5, "atol": 1e-6}


# -- layout --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_zigzag_shard_positions_and_unshard(cp):
    seq = 8 * cp
    x = torch.arange(seq).expand(3, seq)
    shards = [zigzag_shard(x, cp, r) for r in range(cp)]
    for r, local in enumerate(shards):
        assert torch.equal(local[0], zigzag_positions(seq, cp, r))  # positions are what the slice holds
    assert torch.equal(zigzag_unshard(shards), x)
    assert sorted(torch.cat([s[0] for s in shards]).tolist()) == list(range(seq))


def test_zigzag_balances_causal_work():
    """Causal (query, key) pairs per rank are equal under zig-zag; a contiguous split would be 1:3 at cp=2."""
    seq, cp = 64, 4
    pairs = [int((zigzag_positions(seq, cp, r) + 1).sum()) for r in range(cp)]
    assert len(set(pairs)) == 1


def test_layout_errors_name_the_fields():
    with pytest.raises(ValueError, match=r"train.seq_len=30 must be divisible by 2\*cp=4"):
        check_cp_layout(30, 2)
    check_cp_layout(32, 2, pp=2)  # composes with pipeline parallelism (tests/test_pipeline_context.py)
    with pytest.raises(ValueError, match=r"train.seq_len/cp=12 must be divisible by parallel.tp=8"):
        check_cp_layout(24, 2, tp=8, sp=True)
    check_cp_layout(32, 4, tp=2, sp=True)


def test_config_errors_at_load_time():
    """A bad cp layout is refused when the config is loaded, before any rank builds anything (one line)."""
    for overrides, match in ((["parallel.cp=4", "train.seq_len=36"], r"parallel.cp=4: train.seq_len=36"),
                             (["parallel.cp=2", "parallel.pp=2", "train.seq_len=30"],
                              r"parallel.cp=2: train.seq_len=30 must be divisible by 2\*cp=4")):
        with pytest.raises(ValueError, match=match):
            make_config(overrides)


# -- block kernels -------------------------------------------------------------------------------------------
def _qkv(b=2, heads=4, kv_heads=2, sq=12, sk=12, d=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, heads, sq, d, generator=g, dtype=dtype),
            torch.randn(b, kv_heads, sk, d, generator=g, dtype=dtype),
            torch.randn(b, kv_heads, sk, d, generator=g, dtype=dtype))


def _sdpa(q, k, v, causal):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          is_causal=causal)


def test_block_kernel_choice_follows_the_kernels_registered_for_the_device():
    """auto = the first fused kernel (returns the lse, no s x s scores) that has a kernel for the device's
    backend; math only where none has; a named kernel that is not there is refused naming what is."""
    from paratrain.parallel.context import _pick_impl, fused_kernels_for

    cpu = torch.device("cpu")
    assert fused_kernels_for(cpu)[0] == "flash_cpu"
    assert _pick_impl("auto", cpu) == "flash_cpu" and _pick_impl("math", cpu) == "math"
    if "efficient" not in fused_kernels_for(cpu):  # this CPU build registers no efficient kernel for CPU
        with pytest.raises(ValueError, match=r"cp_attention='efficient'.*allowed here: auto, flash_cpu, math"):
            _pick_impl("efficient", cpu)
    with pytest.raises(ValueError, match=r"cp_attention='flash'.*allowed: auto, flash_cpu, efficient, math"):
        _pick_impl("flash", cpu)


@pytest.mark.parametrize("impl", ["flash_cpu", "math"])
@pytest.mark.parametrize("causal,sq", [(True, 12), (False, 12), (False, 6)])
def test_block_kernels_match_sdpa(impl, causal, sq):
    q, k, v = _qkv(sq=sq)
    q_ref, k_ref, v_ref = (t.clone().requires_grad_() for t in (q, k, v))
    out_ref = _sdpa(q_ref, k_ref, v_ref, causal)
    dout = torch.randn_like(out_ref)
    out_ref.backward(dout)

    out, lse = block_forward(q, k, v, causal, impl)
    torch.testing.assert_close(out, out_ref.detach(), **ATTN_TOL)
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones(sq, 12, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1), **ATTN_TOL)
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, causal, impl)
    for got, want in ((dq, q_ref.grad), (dk, k_ref.grad), (dv, v_ref.grad)):
        torch.testing.assert_close(got, want, **ATTN_TOL)


def test_flash_kernel_reads_strided_slices():
    """The ring passes sequence slices of a stacked K/V buffer without copying them."""
    q, k, v = _qkv(sq=12, sk=12)
    kv = torch.stack((k, v))
    out, lse = block_forward(q, kv[0, :, :, :6], kv[1, :, :, :6], False, "flash_cpu")
    out_c, lse_c = block_forward(q, kv[0, :, :, :6].contiguous(), kv[1, :, :, :6].contiguous(), False, "flash_cpu")
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)


def test_ring_of_one_is_core_attention():
    q, k, v = (t.requires_grad_() for t in _qkv(sq=16, sk=16))
    ring_out = RingAttention(None)(q, k, v)
    grads = torch.autograd.grad(ring_out.square().sum(), (q, k, v))
    core_out = CoreAttention()(q, k, v)
    want = torch.autograd.grad(core_out.square().sum(), (q, k, v))
    torch.testing.assert_close(ring_out, core_out, **ATTN_TOL)
    for got, ref in zip(grads, want, strict=True):
        torch.testing.assert_close(got, ref, **ATTN_TOL)


# -- ring attention on the pool ------------------------------------------------------------------------------
def _ring_vs_full(impl: str, heads: int, kv_heads: int, seq: int):
    """On every rank: ring attention over WORLD on this rank's zig-zag slice vs SDPA over the whole sequence."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    q, k, v = _qkv(b=2, heads=heads, kv_heads=kv_heads, sq=seq, sk=seq, d=16, seed=3)
    dout = torch.randn(2, heads, seq, 16, generator=torch.Generator().manual_seed(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    _sdpa(*full, causal=True).backward(dout)

    local = [zigzag_shard(t, cp, rank, dim=2).requires_grad_() for t in (q, k, v)]
    out = RingAttention(dist.group.WORLD, impl)(*local)
    out.backward(zigzag_shard(dout, cp, rank, dim=2))
    ref_out = zigzag_shard(_sdpa(q, k, v, causal=True), cp, rank, dim=2)
    errors = {"out": float((out.detach() - ref_out).abs().max())}
    for name, mine, ref in zip("qkv", local, full, strict=True):
        errors[f"d{name}"] = float((mine.grad - zigzag_shard(ref.grad, cp, rank, dim=2)).abs().max())
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_full_attention(dist_run, world):
    cases = [(impl, 4, kv, 32) for impl in ("flash_cpu", "math") for kv in (4, 2)]
    per_rank = dist_run(world, _run_ring_cases, cases)
    for rank, results in enumerate(per_rank):
        for case, errors in zip(cases, results, strict=True):
            assert max(errors.values()) < 1e-5, f"cp={world} rank {rank} {case}: {errors}"


def _run_ring_cases(cases):
    return [_ring_vs_full(*case) for case in cases]


# -- whole model vs single device ----------------------------------------------------------------------------
MB4 = "train.microbatch=4"  # without dp: 2 microbatches of 4 rows (accumulation still runs), not 4 of 2
CASES = {
    2: [["parallel.cp=2", MB4], ["parallel.cp=2", "parallel.dp_kind=\"ddp\"", MB4]],
    4: [["parallel.cp=4", MB4],
        ["parallel.cp=2", "parallel.tp=2", MB4],
        ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true", MB4],
        ["parallel.cp=2", "parallel.dp=2", "parallel.dp_kind=\"fsdp\""],
        ["parallel.cp=2", "parallel.dp=2", "parallel.dp_kind=\"hsdp\"", "parallel.dp_replicate=2"],
        ["parallel.cp=2", "parallel.dp=2", "parallel.dp_kind=\"ddp\"", "parallel.recompute=\"full\""]],
}


SHAPE, STEPS = ["model.layers=2"], 2


def _run_cases(cases, steps=3):
    return [parallel_run(overrides, steps) for overrides in cases]


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_matches_single_device(dist_run, world):
    cases = [SHAPE + c for c in CASES[world]]
    per_rank = dist_run(world, _run_cases, cases, STEPS)
    for mb4 in (True, False):  # each case against the reference of its own microbatch size
        group = [i for i, c in enumerate(cases) if (MB4 in c) == mb4]
        if not group:
            continue
        ref = reference(make_config(SHAPE + ([MB4] if mb4 else [])), STEPS)
        assert_cases_match(ref, [cases[i] for i in group], [[r[i] for i in group] for r in per_rank], LOSS_RTOL,
                           LOSS_ATOL, GRAD_RTOL)


# -- ring traffic: what the planner's formula says -----------------------------------------------------------
def planner_ring_bytes(cp, tp, seq, tokens_batch, layers, kv_dim, elem_bytes=4):
    """Per rank, one forward+backward: K/V forward 2(cp-1)/cp*s*b*kv_dim*B, the same again in backward, plus the
    fp32 dK/dV ring 2*s*b*kv_dim*4; kv_dim is per TP rank."""
    kv = kv_dim // tp
    kv_ring = 2 * (cp - 1) / cp * seq * tokens_batch * kv * elem_bytes
    return layers * (2 * kv_ring + 2 * seq * tokens_batch * kv * 4)


def _ring_bytes_of_step(overrides):
    from paratrain.parallel.context import ring_stats
    from paratrain.parallel.mesh import init_distributed
    from paratrain.train.loop import build_runner

    cfg = make_config(overrides)
    env = init_distributed("cpu")
    runner = build_runner(cfg, env)
    inputs, targets = global_batch(cfg, 0)
    runner.forward_backward(inputs, targets)
    return ring_stats(runner.parts)["bytes_sent"]


# The layouts (and model, microbatches) of test_context_parallel_matches_single_device's cases: the ranks' DTensor
# sharding caches from those cases serve these (a new layout costs each rank ~0.4 CPU-s of first-time sharding
# propagation). Two blocks: the bytes are per block times blocks, compared exactly.
@pytest.mark.parametrize("world,overrides,cp,tp", [(2, ["parallel.cp=2"], 2, 1), (4, ["parallel.cp=4"], 4, 1),
                                                   (4, ["parallel.cp=2", "parallel.tp=2"], 2, 2)])
def test_ring_traffic_matches_planner_formula(dist_run, world, overrides, cp, tp):
    overrides = [*SHAPE, *overrides, MB4]
    cfg = make_config(overrides)
    shape = cfg.model_shape()
    want = planner_ring_bytes(cp, tp, cfg.train.seq_len, cfg.train.global_batch // (world // (cp * tp)),
                              shape.layers, shape.kv_dim)
    assert dist_run(world, _ring_bytes_of_step, overrides) == [want] * world


# -- attention activation memory per rank --------------------------------------------------------------------
MEM_SEQ = 2048


def attention_saved_bytes(runner, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """Bytes autograd saves for backward inside the attention modules (projections, RoPE, core) during one
    forward/backward of `runner`, parameters excluded, each storage counted once."""
    params = {p.untyped_storage().data_ptr() for p in runner.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    model = runner.parts[0]
    for block in model.layers.values():
        block.attention.register_forward_pre_hook(lambda *_: hooks.__enter__())
        block.attention.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    runner.forward_backward(inputs, targets)
    return sum(storages.values())


def _memory_config(overrides, seq):
    """One block: the saved bytes are per attention module, the same in every block."""
    base = ["model.layers=1", "train.global_batch=1", "train.microbatch=1", f"train.seq_len={seq}",
            f"model.max_seq={seq}"]
    return make_config(base + list(overrides))


def _saved_bytes_of_layout(overrides, seq):
    from paratrain.parallel.mesh import DistEnv, init_distributed
    from paratrain.train.loop import build_runner

    cfg = _memory_config(overrides, seq)
    env = init_distributed("cpu") if overrides else DistEnv(0, 1, 0, torch.device("cpu"))
    inputs = torch.randint(0, 256, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    return attention_saved_bytes(build_runner(cfg, env), inputs[:, :-1], inputs[:, 1:])


def _ring_of_one_saved_bytes(seq):
    """The single-device model with ring attention of one rank: the CP=1 point of the same code path."""
    from paratrain.parallel.context import RingAttention
    from paratrain.parallel.mesh import DistEnv
    from paratrain.train.loop import build_runner

    runner = build_runner(_memory_config([], seq), DistEnv(0, 1, 0, torch.device("cpu")))
    for block in runner.parts[0].layers.values():
        block.attention.core = RingAttention(None)
    inputs = torch.randint(0, 256, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    return attention_saved_bytes(runner, inputs[:, :-1], inputs[:, 1:])


@pytest.fixture(scope="module")
def one_process_memory() -> tuple[int, int]:
    """(stock single-device model, ring path of one rank) saved bytes at MEM_SEQ, measured once for both cp; and
    no s x s term anywhere: doubling the sequence doubles the ring path's saved bytes."""
    ring_one = _ring_of_one_saved_bytes(MEM_SEQ)
    assert _ring_of_one_saved_bytes(2 * MEM_SEQ) == 2 * ring_one
    return _saved_bytes_of_layout([], MEM_SEQ), ring_one


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_activation_memory_falls_by_cp(dist_run, one_process_memory, cp):
    """Per-rank saved attention activations at s=2048 are exactly 1/cp of the CP=1 ring path, and at most 1/cp of
    the stock single-device model (measured, one block: 5.5 MB single device, 2.8 MB/rank at CP2, 1.4 MB/rank at CP4)."""
    single, ring_one = one_process_memory
    # ddp: plain parameters, so saved weights are recognised and excluded (FSDP's are gathered copies).
    per_rank = dist_run(cp, _saved_bytes_of_layout, [f"parallel.cp={cp}", "parallel.dp_kind=\"ddp\""], MEM_SEQ)
    assert len(set(per_rank)) == 1, f"unbalanced ranks: {per_rank}"
    assert per_rank[0] * cp == ring_one, f"cp={cp}: {per_rank[0]} B/rank x {cp} != {ring_one} B at cp=1"
    assert per_rank[0] * cp <= single, f"cp={cp}: {per_rank[0]} B/rank vs {single} B single device"


BF16 = ["train.dtype=\"bf16\""]


def test_context_parallel_bf16_close_to_single_device_bf16(dist_run):
    """bf16 autocast: CP2 vs the single-device bf16 run. Both round differently (the ring merges bf16 block outputs
    in fp32), so the bound is bf16-sized, about 2x the single device's own bf16-vs-fp32 difference (measured:
    loss 6.5e-5 relative, gradients 9.4e-3; CP2 vs single bf16: 4.8e-5 and 8.2e-3): loss rtol 1e-3, gradient 2e-2."""
    ref = reference(make_config(BF16), STEPS)
    for rank, (got,) in enumerate(dist_run(2, _run_cases, [["parallel.cp=2"] + BF16], STEPS)):
        try:
            assert_matches_reference(ref, got, rtol=1e-3, atol=1e-4, grad_rtol=2e-2)
        except AssertionError as exc:
            raise AssertionError(f"bf16 cp=2 rank {rank}: {exc}") from None


# -- checkpoints: a CP run resumes in one process (parameters sharded over dp x cp by FSDP, resharded by name) --
CKPT_DATA = ["data.max_source_bytes=200000", "data.vocab_size=384"]


def _train_settings(tmp, run, *extra):
    return ["model.vocab=384", "model.layers=2", "train.steps=4", "checkpoint.interval=2", "train.global_batch=4",
            "train.microbatch=2", "train.seq_len=32", "optim.warmup_steps=1", "train.eval_every=0",
            "train.progress=false", "metrics.tensorboard=false", 'train.device="cpu"', f'metrics.run_dir="{tmp / run}"',
            f'data.prepared_dir="{tmp / "data"}"', *CKPT_DATA, *extra]


def _train(sets, resume_from=None):
    from paratrain.config import load_config
    from paratrain.train.loop import train

    return train(load_config(None, sets), resume_from)


def test_cp2_checkpoint_resumes_in_one_process(dist_run, tmp_path):
    from paratrain.config import load_config
    from paratrain.train.checkpoint import step_name
    from paratrain.train.data import prepare

    prepare(load_config(None, [f'data.prepared_dir="{tmp_path / "data"}"', *CKPT_DATA]).data, log=lambda *_: None)
    full = dist_run(2, _train, _train_settings(tmp_path, "cp2", "parallel.cp=2", 'parallel.dp_kind="fsdp"'))
    losses = full[0]["losses"]
    assert full[0]["layout"]["cp"] == 2 and full[1]["losses"] == losses and len(losses) == 4
    single = _train(_train_settings(tmp_path, "single"), str(tmp_path / "cp2" / "checkpoints" / step_name(2)))
    torch.testing.assert_close(torch.tensor(single["losses"]), torch.tensor(losses[2:]), rtol=1e-5, atol=0)
