"""Context parallelism (CP): the sequence split across the `cp` mesh dimension, attention computed as ring
attention, for long sequences whose activations do not fit one device (Llama 3 trained at 128K with CP 16).

Sequence layout: zig-zag, load-balanced
  The global sequence (length s) is cut into 2*cp chunks; cp rank r holds chunks r and 2cp-1-r (one early,
  one late), in that order. Under a causal mask an early chunk has little to attend to and a late one much, so
  pairing them gives every rank the same attention work; with a contiguous split rank cp-1 would do ~2x the
  average and rank 0 would idle. Inputs and targets are sharded identically (`zigzag_shard`), RoPE uses the
  global positions of the local tokens (`zigzag_positions`, passed to `Llama.forward(positions=...)`), and the
  loss of the step is the mean over all tokens of the global sequence (local means averaged over cp: every rank
  holds the same number of tokens).

Ring attention (written here in plain PyTorch)
  torch.distributed.tensor.experimental.context_parallel (torch 2.13) replaces only the CUDA SDPA kernels
  (flash / efficient / cudnn). On CPU, SDPA lowers to aten._scaled_dot_product_flash_attention_for_cpu, which it
  does not handle: under gloo the call fails with "Operator aten._scaled_dot_product_flash_attention_for_cpu.default
  does not have a sharding strategy registered" (probe: docs/context_parallel.md). It also needs every buffer
  to be sharded through its context manager. So the ring is an autograd.Function here, on any device/backend:

  Forward, cp steps; at step i rank r holds the K/V block of source rank j = (r - i) mod cp. Before computing
  on it, the block is already on its way to rank r+1 (dist.batch_isend_irecv), so the transfer overlaps the
  block's compute. With the zig-zag layout only three block shapes occur, each a dense (unmasked) kernel except
  the first:
      i = 0   local q x local kv, causal (the local order [chunk r, chunk 2cp-1-r] is globally increasing)
      j < r   all local q x the early kv chunk of j (it precedes both local chunks), no mask
      j > r   the late q chunk x both kv chunks of j (both precede it; neither precedes chunk r), no mask
  Steps after the first are each half a local block of work on every rank. Partial results are merged with
  the online softmax: out = sum_b out_b * exp(lse_b - lse), lse = logaddexp over blocks, in fp32.

  Backward runs the same ring for K/V, plus a second ring (its own P2P tag) carrying each block's dK/dV
  accumulator: rank r adds its contribution to the block it holds and passes the sum on; after cp hops the sum
  arrives back at the block's owner. Block gradients use the final out and lse (exact: P = exp(S - lse)).
  Saved for backward: q, k, v, out, lse of the local tokens only -- O(s/cp) per rank, no s x s term.

  Block kernels (`parallel.cp_attention`, default auto): a fused kernel that returns the log-sum-exp and never
  materialises the s x s scores, picked by which aten op has a kernel for the device's backend: on CPU the
  flash kernel SDPA itself uses (aten._scaled_dot_product_flash_attention_for_cpu, handles GQA); on CUDA (and
  any backend registering it) the memory-efficient kernel (aten._scaled_dot_product_efficient_attention, fp32
  and bf16; kv heads repeated for GQA). A reference in matmuls ("math", fp32 scores per block) remains only
  for devices with neither, and as the reference the fused ones are tested against.

Why a ring rather than all-gathering K/V (Llama 3's choice): the ring keeps one remote K/V block (plus one in
flight) per rank instead of the whole sequence's K/V, and its transfers hide behind block compute; the
all-gather is simpler and better when K/V are small next to Q (heavy GQA) and the network is fast. Both cut
the attention activations saved for backward by cp.

Composition: CP is orthogonal to TP (heads are sharded by TP, the sequence by CP; the ring runs on each TP
rank's own heads); data parallelism reduces gradients over the flattened (dp, cp) mesh, since cp ranks compute
gradients of different tokens of the same sequences (`paratrain.parallel.dp_mesh_of`).
With pipeline parallelism (pipeline.py), every stage module gets ring attention over its cp group
(`paratrain.parallel.apply_techniques`: TP/SP -> CP -> recompute -> DP over (dp, cp)), and `PipelineRunner` shards each
batch zig-zag before the schedule: each cp "copy" of the pipeline carries the s/cp slices of the same
microbatches, so the activations between stages are (mb, s/cp, h) -- (mb, s/(cp*tp), h) with SP -- and the P2P
messages shrink by cp. A stage without the embedding still needs the global positions of its tokens for RoPE:
`apply_context_parallel(sp_tp=tp)` registers the positions hook ahead of SP's own stage hook and scales the
received length back to the s/cp tokens attention sees. The ring's P2P (on the cp group) and the pipeline's (on
the pp group) never wait on each other: all cp ranks of a stage execute the same schedule actions in the same
order. The loss is each last-stage rank's mean over its tokens, averaged over dp x cp. Every schedule works,
the zero-bubble ones included (their split backward runs the ring backward in the input-gradient pass; the
weight pass starts below the ring). Stale-gradient DP with CP stays refused by that feature's own check.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from paratrain.config.layout import check_cp_layout  # noqa: F401 - re-exported; torch-free for config loading
from paratrain.model.llama import CoreAttention
from paratrain.parallel.runner import ParallelRunner

TAG_KV, TAG_DKV = 17, 18  # distinct P2P tags: the K/V and dK/dV rings are in flight at the same time
IMPLS = ("auto", "flash_cpu", "math")


# -- sequence layout -----------------------------------------------------------------------------------------
def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2*cp) that cp rank `rank` holds: one early, one late."""
    return rank, 2 * cp - 1 - rank


def zigzag_positions(seq_len: int, cp: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions of the tokens cp rank `rank` holds, in local order: (seq_len / cp,) int64."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in zigzag_chunks(cp, rank)])


def zigzag_shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """The local slice of `x` along the sequence dimension `dim` (its size must be divisible by 2*cp)."""
    if cp == 1:
        return x
    chunk = x.shape[dim] // (2 * cp)
    return torch.cat([x.narrow(dim, c * chunk, chunk) for c in zigzag_chunks(cp, rank)], dim=dim)


def zigzag_unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of zigzag_shard: the full sequence from every rank's local slice (rank order)."""
    cp = len(shards)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, local in enumerate(shards):
        early, late = local.chunk(2, dim=dim)
        first, second = zigzag_chunks(cp, rank)
        chunks[first], chunks[second] = early, late
    return torch.cat(chunks, dim=dim)


# -- block kernels: out and log-sum-exp of one q block against one kv block ----------------------------------
# Fused kernels that return the log-sum-exp the ring's merge needs, in order of preference, with the aten op
# that must have a kernel for the device's dispatch key (so the choice needs no device names): the CPU flash
# kernel SDPA itself uses; the memory-efficient kernel (CUDA and other backends that register it; fp32/bf16).
# Neither materialises the s x s scores. "math" (plain matmuls, fp32 scores: O(s_q x s_k) per block) is kept
# only for devices without any of these kernels, and as the reference the fused ones are tested against.
FUSED = (("flash_cpu", "aten::_scaled_dot_product_flash_attention_for_cpu"),
         ("efficient", "aten::_scaled_dot_product_efficient_attention"))
IMPLS = ("auto", *(name for name, _ in FUSED), "math")


def fused_kernels_for(device: torch.device) -> list[str]:
    """The fused block kernels registered for this device's backend (dispatch key), in order of preference."""
    key = torch._C._dispatch_key_for_device(device.type)
    return [name for name, op in FUSED if torch._C._dispatch_has_kernel_for_dispatch_key(op, key)]


def _pick_impl(impl: str, device: torch.device) -> str:
    if impl not in IMPLS:
        raise ValueError(f"parallel.cp_attention='{impl}': allowed: {', '.join(IMPLS)}")
    available = fused_kernels_for(device)
    if impl == "auto":
        return available[0] if available else "math"
    if impl != "math" and impl not in available:
        raise ValueError(f"parallel.cp_attention='{impl}': no such kernel for device '{device}'; allowed here: "
                         f"{', '.join(['auto', *available, 'math'])}")
    return impl


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, impl: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, lse fp32 (b, heads, sq)). q: (b, heads, sq, d); k, v: (b, kv_heads, sk, d)."""
    if impl == "flash_cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    if impl == "efficient":  # no GQA in the kernel: kv heads repeated (a view-sized copy, not s x s)
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, _expand_kv(k, q), _expand_kv(v, q), None, True, 0.0, causal)
        return out, lse[..., :q.shape[2]].float()  # CUDA pads the lse rows to a multiple of 32 (kAlignLSE)
    scores = _scores(q, k, causal)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probs, _expand_kv(v, q).float()).to(q.dtype), lse


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block, given the *final* out and lse of these queries (so P is the global softmax).
    The efficient kernel's backward reads the lse in its forward's layout: rows padded to a multiple of 32
    (`_padded_lse`; the padding rows are never read)."""
    if impl == "flash_cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal)
    if impl == "efficient":
        seed = offset = torch.empty((), dtype=torch.int64, device=q.device)  # no dropout: never read
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, _expand_kv(k, q), _expand_kv(v, q), None, out, _padded_lse(lse, q), seed, offset, 0.0,
            [True, True, True, False], causal)
        return dq, _reduce_kv(dk, k).to(k.dtype), _reduce_kv(dv, v).to(v.dtype)
    scale = q.shape[-1] ** -0.5
    probs = torch.exp(_scores(q, k, causal) - lse.unsqueeze(-1))
    dout32, k_exp, v_exp = dout.float(), _expand_kv(k, q).float(), _expand_kv(v, q).float()
    dv = torch.matmul(probs.transpose(-1, -2), dout32)
    dprobs = torch.matmul(dout32, v_exp.transpose(-1, -2))
    delta = (dout32 * out.float()).sum(-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    dq = torch.matmul(dscores, k_exp)
    dk = torch.matmul(dscores.transpose(-1, -2), q.float())
    return dq.to(q.dtype), _reduce_kv(dk, k).to(k.dtype), _reduce_kv(dv, v).to(v.dtype)


def _padded_lse(lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The lse in the layout the CUDA efficient kernel writes and its backward reads: (b, heads, sq rounded up
    to a multiple of 32), contiguous. GPU path reviewed against the kernel's source, not run here (no GPU)."""
    pad = -q.shape[2] % 32
    return torch.nn.functional.pad(lse, (0, pad)).contiguous() if pad else lse.contiguous()


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    scores = torch.matmul(q.float(), _expand_kv(k, q).float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        sq, sk = scores.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores


def _expand_kv(t: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention: kv head h serves query heads h*g .. h*g+g-1."""
    groups = q.shape[1] // t.shape[1]
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def _reduce_kv(grad: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    b, heads, s, d = grad.shape
    groups = heads // kv.shape[1]
    return grad.view(b, kv.shape[1], groups, s, d).sum(2) if groups > 1 else grad


def _merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Online softmax: fold one block's (out, lse) into the running fp32 (out, lse), in place."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1))
    out.add_(block_out.float() * torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


# -- the ring -----------------------------------------------------------------------------------------------
@dataclass
class _Transfer:
    sent: torch.Tensor  # kept alive until the send completes
    recv: torch.Tensor
    works: list
    ring: Ring

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        for work in self.works:
            work.wait()
        self.ring.wait_s += time.perf_counter() - t0
        return self.recv


class Ring:
    """Neighbour exchange on the cp process group: send to rank+1, receive from rank-1 (group ranks)."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if self.size > 1:
            ranks = dist.get_process_group_ranks(group)
            self.next_peer = ranks[(self.rank + 1) % self.size]
            self.prev_peer = ranks[(self.rank - 1) % self.size]
        # Counters for benchmarks and the planner's traffic formula: bytes this rank sent, and the time it was
        # blocked waiting for transfers (the communication the block compute did not hide).
        self.bytes_sent = 0
        self.wait_s = 0.0

    def start(self, tensor: torch.Tensor, tag: int) -> _Transfer:
        recv = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.next_peer, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev_peer, self.group, tag)]
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return _Transfer(tensor, recv, dist.batch_isend_irecv(ops), self)


def _block_role(step: int, ring: Ring) -> str:
    """Which part of the local queries/keys step `step` computes: 'causal', 'early_kv' or 'late_q'."""
    if step == 0:
        return "causal"
    return "early_kv" if (ring.rank - step) % ring.size < ring.rank else "late_q"


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, impl: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    half = q.shape[2] // 2
    kv = torch.stack((k, v))  # one message per hop
    out = lse = None
    for step in range(ring.size):
        transfer = ring.start(kv, TAG_KV) if step < ring.size - 1 else None  # overlaps this step's compute
        role = _block_role(step, ring)
        if role == "causal":
            block_out, lse = block_forward(q, k, v, True, impl)
            out = block_out.float()
        elif role == "early_kv":
            block_out, block_lse = block_forward(q, kv[0, :, :, :half], kv[1, :, :, :half], False, impl)
            _merge_(out, lse, block_out, block_lse)
        else:
            block_out, block_lse = block_forward(q[:, :, half:], kv[0], kv[1], False, impl)
            _merge_(out[:, :, half:], lse[:, :, half:], block_out, block_lse)
        if transfer is not None:
            kv = transfer.wait()
    return out.to(q.dtype), lse


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, ring: Ring, impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    half = q.shape[2] // 2
    dq = torch.zeros_like(q, dtype=torch.float32)
    kv = torch.stack((k, v))
    dkv_transfer = None
    for step in range(ring.size):
        kv_transfer = ring.start(kv, TAG_KV) if step < ring.size - 1 else None
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # grads of the block held now
        role = _block_role(step, ring)
        if role == "causal":
            dq_b, dk_b, dv_b = block_backward(dout, q, k, v, out, lse, True, impl)
            dq += dq_b
            dkv[0] += dk_b
            dkv[1] += dv_b
        elif role == "early_kv":
            dq_b, dk_b, dv_b = block_backward(dout, q, kv[0, :, :, :half], kv[1, :, :, :half], out, lse, False, impl)
            dq += dq_b
            dkv[0, :, :, :half] += dk_b
            dkv[1, :, :, :half] += dv_b
        else:
            dq_b, dk_b, dv_b = block_backward(dout[:, :, half:], q[:, :, half:], kv[0], kv[1], out[:, :, half:],
                                              lse[:, :, half:], False, impl)
            dq[:, :, half:] += dq_b
            dkv[0] += dk_b
            dkv[1] += dv_b
        if dkv_transfer is not None:
            dkv += dkv_transfer.wait()  # what the ranks before us added to this block
        if ring.size > 1:
            dkv_transfer = ring.start(dkv, TAG_DKV)
        if kv_transfer is not None:
            kv = kv_transfer.wait()
    if dkv_transfer is not None:
        dkv = dkv_transfer.wait()  # our own block, with every rank's contribution
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, impl: str):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = ring_forward(q, k, v, ring, impl)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.impl = ring, impl
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.ring, ctx.impl)
        return dq, dk, dv, None, None


class RingAttention(nn.Module):
    """Drop-in for `CoreAttention` on zig-zag sequence shards: q (b, heads, s/cp, d), k, v (b, kv_heads, s/cp, d),
    causal over global positions. Not a CoreAttention subclass on purpose: selective recompute targets those,
    and this module saves only O(s/cp) tensors, so recomputing it (and its ring) would buy nothing."""

    def __init__(self, group: dist.ProcessGroup | None, impl: str = "auto"):
        super().__init__()
        self.ring = Ring(group)
        self.impl = impl

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.shape[2] % 2:
            raise ValueError(f"ring attention: local sequence {q.shape[2]} must be even (two zig-zag chunks)")
        return RingAttentionFunction.apply(q, k, v, self.ring, _pick_impl(self.impl, q.device))

    def extra_repr(self) -> str:
        return f"cp={self.ring.size}, rank={self.ring.rank}, impl={self.impl}"


# -- applying it to a model and driving it -------------------------------------------------------------------
def apply_context_parallel(parts: Iterable[nn.Module], group: dist.ProcessGroup | None, impl: str = "auto",
                           sp_tp: int = 1, device: torch.device | None = None) -> None:
    """Replace every attention core with ring attention over `group`, and make each part take the global
    RoPE positions of its zig-zag slice. Apply after tensor parallelism, before recompute and data parallelism.

    `parts` may be pipeline stages: a stage without the token embedding receives hidden states of s/cp tokens,
    or s/(cp*tp) with sequence parallelism; pass `sp_tp` = tp when SP is on so that its positions cover the
    cp-local sequence its attention sees (SP gathers it over tp)."""
    ring = Ring(group)
    if device is not None:
        _pick_impl(impl, device)  # validate the name (and that the kernel exists here) before touching the model
    elif impl not in IMPLS:
        raise ValueError(f"parallel.cp_attention='{impl}': allowed: {', '.join(IMPLS)}")
    for part in parts:
        for block in part.layers.values():
            if not isinstance(block.attention.core, CoreAttention):
                raise TypeError(f"expected CoreAttention at attention.core, found {type(block.attention.core)}")
            block.attention.core = RingAttention(group, impl)
        gathered = 1 if getattr(part, "tok_embeddings", None) is not None else sp_tp
        # prepend: runs before the SP stage hook (parallel/tensor.py), which would otherwise fill in 0..s/cp-1.
        part.register_forward_pre_hook(_zigzag_positions_hook(ring.size, ring.rank, gathered), with_kwargs=True,
                                       prepend=True)


def ring_stats(parts: Iterable[nn.Module]) -> dict[str, float]:
    """Totals over every ring attention layer of `parts` since the last call (which resets them): bytes this rank
    sent (K/V and dK/dV) and seconds it waited on transfers."""
    rings = [m.ring for part in parts for m in part.modules() if isinstance(m, RingAttention)]
    stats = {"bytes_sent": float(sum(r.bytes_sent for r in rings)), "wait_s": sum(r.wait_s for r in rings)}
    for r in rings:
        r.bytes_sent, r.wait_s = 0, 0.0
    return stats


def _zigzag_positions_hook(cp: int, rank: int, gathered: int = 1):
    """Tokens (or a pipeline stage's hidden states) arrive as this rank's zig-zag slice, (b, s/cp, ...), or
    (b, s/(cp*gathered), ...) when sequence parallelism splits it further: RoPE must see the global positions
    of the s/cp tokens attention works on."""

    def hook(_module, args, kwargs):
        if kwargs.get("positions") is None and (len(args) < 2 or args[1] is None):
            local = args[0].shape[1] * gathered
            kwargs["positions"] = zigzag_positions(local * cp, cp, rank, args[0].device)
        return args, kwargs

    return hook


def shard_batch(inputs: torch.Tensor, targets: torch.Tensor, cp: int, rank: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """This cp rank's zig-zag slice of a (b, s) batch, with one clear error when s does not split."""
    seq = inputs.shape[1]
    if seq % (2 * cp):
        raise ValueError(f"parallel.cp={cp}: batch sequence length {seq} must be divisible by 2*cp={2 * cp}")
    return zigzag_shard(inputs, cp, rank), zigzag_shard(targets, cp, rank)


class ContextParallelRunner(ParallelRunner):
    """ParallelRunner whose batches are sharded along the sequence (zig-zag) before the step, and whose loss is
    averaged over dp x cp. Gradients are averaged over the flattened (dp, cp) mesh by the data-parallel wrapper
    (`self.dp`, built on that mesh), which is why `self.dp` is always present when cp > 1."""

    def __init__(self, *args, cp_group: dist.ProcessGroup, **kwargs):
        super().__init__(*args, **kwargs)
        self.cp_size = dist.get_world_size(cp_group)
        self.cp_rank = dist.get_rank(cp_group)
        if self.dp is None:
            raise ValueError("context parallelism needs gradient reduction over the (dp, cp) mesh")

    def shard_sequence(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return shard_batch(inputs, targets, self.cp_size, self.cp_rank)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return super().forward_backward(*self.shard_sequence(inputs, targets))

    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return super().eval_loss(*self.shard_sequence(inputs, targets))

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Mean over dp x cp ranks = the mean over every token of the global batch (equal tokens per rank)."""
        loss = loss.clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dp.group)
        return loss
