"""One transformer layer on one device: its matmul shapes, the HBM traffic of its elementwise ops (fused, eager
PyTorch, Megatron-Core's unfused RoPE) and its forward compute time (`_per_layer_compute`), with what splitting
the GEMMs for TP overlap adds, torch's ring-attention merges and the matmuls per-op selective checkpointing
recomputes. T = tokens of one microbatch on one device, tp the tensor-parallel degree (plan/step.py's conventions).
"""

from __future__ import annotations

import numpy as np

from paratrain.hardware.catalog import System
from paratrain.model.config import ModelConfig
from paratrain.plan.kernels import (
    cast_cost,
    flash_causal_fraction,
    matmul_time_s,
    memory_time_s,
    soft_roofline,
)
from paratrain.plan.options import (
    EAGER_ELEMENTWISE_KERNELS,
    EAGER_EXTRA_MATMULS,
    EAGER_NORM_RESIDUAL_BYTES,
    EAGER_REPEAT_KV_BYTES,
    EAGER_SWIGLU_BYTES,
    Options,
)
from paratrain.plan.precision import BF16_BYTES


def layer_matmuls(model: ModelConfig, seq: int, attention: str):
    """Forward matmuls of one layer as (name, N, K, shard) with M = tokens; shard "n" or "k" is the dim TP splits.

    Attention core returned separately (it scales with seq). The query and attention-output width is
    heads x head_dim, which is not the hidden size where the head dim is set apart (Qwen3, GPT-OSS)."""
    h, f, kv, q = model.hidden, model.ffn, model.kv_dim, query_dim(model)
    mlp_in = 2 * f if model.arch == "llama" else f
    mlp = [("mlp_in", mlp_in, h, "n"), ("mlp_out", h, f, "k")]
    if model.mla is not None:
        return [*mla_matmuls(model), *mlp]
    return [("qkv", q + 2 * kv, h, "n"), ("proj", h, q, "k"), *mlp]


def mla_matmuls(model: ModelConfig):
    """Multi-head latent attention's matmuls as Megatron-Core runs them (megatron/core/transformer/
    multi_latent_attention.py MLASelfAttention): linear_q_down_proj (h -> q_lora_rank) and linear_kv_down_proj
    (h -> kv_lora_rank + rope dim) duplicated on every TP rank (TELinear parallel_mode "duplicated"; shard "none"),
    linear_q_up_proj (-> heads x (nope + rope)) and linear_kv_up_proj (-> heads x (nope + v)) column-parallel,
    linear_proj (heads x v -> h) row-parallel."""
    h, a, mla = model.hidden, model.heads, model.mla
    q_width = a * mla.qk_head_dim
    if mla.q_lora_rank is None:
        q = [("q_up", q_width, h, "n")]
    else:
        q = [("q_down", mla.q_lora_rank, h, "none"), ("q_up", q_width, mla.q_lora_rank, "n")]
    return [*q, ("kv_down", mla.kv_lora_rank + mla.qk_rope_head_dim, h, "none"),
            ("kv_up", a * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank, "n"),
            ("proj", h, attention_out_dim(model), "k")]


def query_dim(model: ModelConfig) -> int:
    """Width of the queries (heads x head_dim; MLA: heads x (nope + rope))."""
    return model.heads * (model.mla.qk_head_dim if model.mla is not None else model.head_dim)


def attention_out_dim(model: ModelConfig) -> int:
    """Width of the attention output, the output projection's input: heads x head_dim (MLA: heads x v_head_dim)."""
    return model.heads * (model.mla.v_head_dim if model.mla is not None else model.head_dim)


def key_value_dims(model: ModelConfig) -> tuple[int, int]:
    """(K, V) widths per token as the attention core reads them: kv heads x head_dim each; MLA: every head's key
    (nope + rope; the shared rope part expanded per head) and value (v)."""
    if model.mla is None:
        return model.kv_dim, model.kv_dim
    return model.heads * model.mla.qk_head_dim, model.heads * model.mla.v_head_dim


def _mlp_params_per_layer(model: ModelConfig) -> float:
    """Matmul parameters of one layer's MLP (SwiGLU: gate, up, down; GPT: fc1, fc2)."""
    return float((3 if model.arch == "llama" else 2) * model.hidden * model.ffn)


def mlp_activation_bytes_per_token(model: ModelConfig) -> float:
    """HBM traffic of the MLP's activation function per token (SwiGLU: read gate and up, write the product;
    bias-GeLU: read + write), the elementwise part of the MLP block."""
    return float((3 if model.arch == "llama" else 2) * model.ffn * BF16_BYTES)


# Passes over the attention scores that an unfused softmax in XLA's standard lowering adds to the fused kernel's read
# and write (Options.fused_softmax False): three reads and a write against one and one
UNFUSED_SOFTMAX_EXTRA_PASSES = 2


def elementwise_bytes_per_token(model: ModelConfig, seq: int, attention: str, fused_softmax: bool = True):
    """HBM traffic of the memory-bound ops of one layer's forward, per token: (sp_part, tp_part, core, kernels).

    sp_part: norms and residual/dropout adds (replicated across TP ranks without SP). tp_part: activation
    function, rotary. core: the unfused attention's scale/mask/softmax/dropout over a*s scores (the softmax as one
    fused kernel, or with fused_softmax False in XLA's standard lowering: UNFUSED_SOFTMAX_EXTRA_PASSES more, and its
    reductions as kernels of their own).
    kernels: number of separate elementwise kernels (each pays the chip's kernel overhead).
    """
    h, kv, a = model.hidden, model.kv_dim, model.heads
    norms = 2 * (2 * h) * BF16_BYTES  # two norms, read + write h each
    residual = 2 * (3 * h) * BF16_BYTES  # two residual (+bias+dropout) adds: read 2h, write h
    if model.arch == "llama":
        act = mlp_activation_bytes_per_token(model)  # SwiGLU: read gate and up, write product
        # fused RoPE: read + write q and k once (unfused_rope_s times the unfused path instead)
        rope = 0 if model.rope_attention_factor != 1.0 else 2 * (query_dim(model) + kv) * BF16_BYTES
        core = 2 * a * seq * BF16_BYTES  # fused scale-mask-softmax: read + write scores
        kernels = 6
        if model.mla is not None:
            norms, rope, kernels = norms + mla_norm_bytes(model), mla_rope_bytes(model), kernels + 2
    else:
        act = mlp_activation_bytes_per_token(model)  # bias-GeLU: read + write
        rope = 0
        core = (2 + 2.5) * a * seq * BF16_BYTES  # softmax read/write + dropout read/write/mask
        kernels = 7
    if attention == "flash":
        core, kernels = 0, kernels - 1
    elif not fused_softmax:
        core, kernels = core + UNFUSED_SOFTMAX_EXTRA_PASSES * a * seq * BF16_BYTES, kernels + 2
    return float(norms + residual), float(act + rope), float(core), kernels


def mla_norm_bytes(model: ModelConfig) -> float:
    """Per token: MLA's two RMSNorms on the latents (q_layernorm over q_lora_rank, kv_layernorm over kv_lora_rank),
    read + write, on every TP rank (their down-projections are duplicated)."""
    mla = model.mla
    return 2.0 * ((mla.q_lora_rank or 0) + mla.kv_lora_rank) * BF16_BYTES


def mla_rope_bytes(model: ModelConfig) -> float:
    """Per token, split by TP: Megatron-Core's fused MLA RoPE (apply_rope_fusion: fused_apply_mla_rope_for_q,
    fused_apply_mla_rope_for_kv): the query read and written in place (heads x (nope + rope)); the kv up-projection's
    output (heads x (nope + v)) and the shared rope key read, the per-head key (nope + rope) and value (v) written."""
    a, mla = model.heads, model.mla
    q = 2 * a * mla.qk_head_dim
    kv = a * (mla.qk_nope_head_dim + mla.v_head_dim) + mla.qk_rope_head_dim + a * (mla.qk_head_dim + mla.v_head_dim)
    return float((q + kv) * BF16_BYTES)


def mla_up_proj_replay_s(model: ModelConfig, system: System, opts: Options, T, tp):
    """Forward time per layer that Megatron-Core's "mla_up_proj" recompute replays in the backward
    (Options.recompute_mla_up_proj): the two column-parallel up-projections (q_up, kv_up) of T tokens and the fused
    MLA RoPE (mla_rope_bytes, two kernels). Zero for a model without MLA."""
    if model.mla is None:
        return 0.0 * np.asarray(T, dtype=float)
    gemms = sum(matmul_time_s(system, T, n / tp, k, opts.fp8, opts)
                for name, n, k, _ in mla_matmuls(model) if name in ("q_up", "kv_up"))
    return gemms + memory_time_s(system, T * mla_rope_bytes(model) / tp, 2)


def eager_elementwise_bytes_per_token(model: ModelConfig, opts: Options) -> tuple[float, float]:
    """(sp_part, tp_part) HBM bytes per token of a Llama block's elementwise ops forward in eager PyTorch (the
    EAGER_* counts): norms and residual adds (replicated across TP ranks without SP), then SwiGLU, rotary and the
    GQA K/V repeat (split by TP)."""
    q, kv = query_dim(model), model.kv_dim
    repeat = EAGER_REPEAT_KV_BYTES * (q + kv) if model.n_kv_heads < model.heads else 0.0
    tp_part = EAGER_SWIGLU_BYTES * model.ffn + opts.eager_rope_bytes * (q + kv) + repeat
    return float(EAGER_NORM_RESIDUAL_BYTES * model.hidden), float(tp_part)


# RoPE as Megatron-Core runs it where the model has YaRN's attention factor (mscale != 1: "not supported by TE's
# fused RoPE. Using unfused implementation", megatron/core/models/common/embeddings/rope_utils.py, the same in the
# Megatron-LM commits Megatron-Bridge v0.2.2-v0.4.0 pin; GPT-OSS's factor 32 gives 1.35): _apply_rotary_pos_emb_bshd
# in eager PyTorch on q and on k. Per element of the tensor, bf16 (2 bytes): forward -x2 (read + write half),
# cat((-x2, x1)) (read + write), t * cos, rotated * sin (read + write each), their sum (read 2, write 1) and the
# final cat with the empty pass-through part (read + write): 12 passes, 24 bytes; 6 kernels plus 6 small ones for
# the cos/sin tables (cos, sin, * mscale, .to). Backward (autograd): grad * cos, grad * sin, the negation's and the
# chunk's gradients (a cat), the sum of the two paths and the slice's gradient (zeros + copy): 13 passes, 26 bytes,
# 8 kernels.
UNFUSED_ROPE_FWD_BYTES = 24
UNFUSED_ROPE_BWD_BYTES = 26
UNFUSED_ROPE_FWD_KERNELS = 12  # per rotated tensor (q, k)
UNFUSED_ROPE_BWD_KERNELS = 8


def unfused_rope_s(model: ModelConfig, system: System, T, tp):
    """(forward s, backward s) of one layer's RoPE on the unfused path (UNFUSED_ROPE_*): q (heads x head_dim / tp)
    and k (the rank's kv heads) of T tokens. Zero for a model without YaRN's attention factor (its RoPE is the fused
    kernel, in elementwise_bytes_per_token)."""
    if model.rope_attention_factor == 1.0:
        return 0.0, 0.0
    elements = T * (query_dim(model) / tp + model.kv_dim / np.minimum(tp, model.n_kv_heads))
    fwd = memory_time_s(system, elements * UNFUSED_ROPE_FWD_BYTES, 2 * UNFUSED_ROPE_FWD_KERNELS)
    bwd = memory_time_s(system, elements * UNFUSED_ROPE_BWD_BYTES, 2 * UNFUSED_ROPE_BWD_KERNELS)
    return fwd, bwd


def layer_kernels(model: ModelConfig, opts: Options) -> int:
    """Kernels one layer's forward launches on one device, as the compute model counts them: its matmuls (eager's
    separate q/k/v and gate/up ones included), the attention core's two and its elementwise kernels (FP8 casts and MoE
    expert kernels not counted: no stack that sets Options.host_launch_s runs them)."""
    kernels = EAGER_ELEMENTWISE_KERNELS if opts.eager else elementwise_bytes_per_token(
        model, model.max_seq, opts.attention, opts.fused_softmax)[3]
    matmuls = len(layer_matmuls(model, model.max_seq, opts.attention)) + (EAGER_EXTRA_MATMULS if opts.eager else 0)
    return matmuls + 2 + kernels


def host_issue_s(model: ModelConfig, opts: Options, tp_calls_fwd, rc):
    """(forward s, backward s) the host needs to issue one layer's kernels and TP collective calls for one
    microbatch (Options.host_launch_s each): forward layer_kernels plus its TP calls; backward twice the forward's
    kernels (autograd's input- and weight-gradient kernels per matmul, one backward kernel or two per elementwise
    op) and its TP calls, plus what recompute replays (full: the forward again; selective: the attention core's
    two matmuls and its softmax). rc: RECOMPUTE codes (2 full, 1 selective)."""
    fwd_kernels = layer_kernels(model, opts)
    replay = np.where(rc == 2, (fwd_kernels + tp_calls_fwd) / opts.recompute_every, np.where(rc == 1, 3.0, 0.0))
    fwd = opts.host_launch_s * (fwd_kernels + tp_calls_fwd)
    bwd = opts.host_launch_s * (2.0 * fwd_kernels + tp_calls_fwd + replay)
    return fwd, bwd


def _per_layer_compute(model, system, seq, opts, T, tp, sp, cp, zero=0):
    """Forward compute time of one layer on one device, split into matmuls, attention core and elementwise; the
    last entry is the MLP's down-projection GEMM alone (what Options.replay_drops_dead_tail leaves out of a replay)."""
    matmuls, cast_bytes, mlp, column, tail = 0.0, 0.0, 0.0, [], 0.0
    split_fwd = split_bwd = 0.0  # what splitting the GEMMs for TP overlap adds (tp_overlap_split_s)
    sac = sum(matmul_time_s(system, T, n, k, opts.fp8, opts) for n, k in _op_sac_recomputed(model, tp)) \
        if opts.selective_ops else 0.0
    for name, n, k, shard in layer_matmuls(model, seq, opts.attention):
        n_dev, k_dev = {"n": (n / tp, k), "k": (n, k / tp)}.get(shard, (n, k))  # "none": duplicated (MLA's down)
        if name == "qkv":  # GQA with tp > kv heads: each rank computes (a replica of) one K and one V head
            n_dev = query_dim(model) / tp + 2 * model.kv_dim / np.minimum(tp, model.n_kv_heads)
        one = matmul_time_s(system, T, n_dev, k_dev, opts.fp8, opts)
        matmuls = matmuls + one
        if opts.tp_comm_overlap and shard != "none":
            fwd_extra, bwd_extra = tp_overlap_split_s(system, opts, name, shard, one, T, n_dev, k_dev, tp)
            split_fwd, split_bwd = split_fwd + fwd_extra, split_bwd + bwd_extra
        mlp = mlp + (one if name.startswith("mlp") else 0.0)
        tail = one if name == "mlp_out" else tail
        if shard == "n":  # column-parallel (QKV, MLP in): under SP an all-gather feeds each
            column.append(one)
        # FP8 (Transformer Engine / torchao current scaling): each matmul's input is scaled (an amax read) and
        # cast (read bf16, write fp8) before the GEMM: 2 + 2 + 1 bytes per element, memory-bound. The weight too,
        # at every call (torchao float8), unless the stack caches the cast weight across microbatches
        # (Options.fp8_weight_cache: then once per step, in evaluate)
        weight = np.where(opts.fp8_weight_cache & (zero < 3), 0.0, n_dev * k_dev)  # ZeRO-3 re-gathers: no cache
        cast_bytes = cast_bytes + (cast_cost(system, opts)[0] * (T * k_dev + weight) if opts.fp8 else 0.0)
    heads = model.heads / tp
    s_local = seq / cp
    d_qk, d_v = query_dim(model) / model.heads, attention_out_dim(model) / model.heads  # head dims (MLA: 192, 128)
    b_seqs = T / s_local  # microbatch sequences on this device
    # Attention core per head as two batched matmuls (QK^T and AV) over the visible keys. Flash skips the masked half
    # (causal), in the blocks its kernel works in (chip.flash_fwd_key_tile: the NKI kernel's 2048-key tiles run whole
    # on the diagonal); under CP the stack's ring kernel is taken as fine-grained
    keys = seq if opts.attention == "unfused" else seq * np.where(
        cp > 1, 0.5, flash_causal_fraction(seq, system.chip.flash_fwd_key_tile))
    core_flops = 2.0 * b_seqs * heads * s_local * keys * (d_qk + d_v)  # QK^T at the q/k head dim, AV at v's
    eff = system.chip.efficiency
    core_traffic = BF16_BYTES * b_seqs * heads * (2 * s_local * (d_qk + d_v))  # read Q, K, V, write the output
    if opts.attention == "unfused":
        core_traffic = core_traffic + 2 * BF16_BYTES * b_seqs * heads * s_local * keys  # scores written, read
    # the stack's attention kernel where it names one (on Hopper FlashAttention-2, or TE's cuDNN attention); else a flash kernel at the chip's
    # own bound where its vector engines limit it (Trainium: chips.toml flash_attention_eff); else the GEMMs' rate
    attn_eff = opts.attention_eff if opts.attention_eff is not None else (
        eff.flash_attention_eff if opts.attention == "flash" and eff.flash_attention_eff is not None else (
            opts.matmul_eff if opts.matmul_eff is not None else eff.matmul_eff_max))
    core = soft_roofline(core_flops / (system.device_peak_flops * attn_eff),
                         core_traffic / (system.device_hbm_bw_bytes_per_s * eff.memory_bw_eff)) + 2 * eff.kernel_overhead_s
    sp_b, tp_b, core_b, kernels = elementwise_bytes_per_token(model, seq, opts.attention, opts.fused_softmax)
    if opts.eager:
        kernels = EAGER_ELEMENTWISE_KERNELS
        matmuls = matmuls + EAGER_EXTRA_MATMULS * system.chip.efficiency.kernel_overhead_s
        if model.arch == "llama":  # the counted bytes (EAGER_*); GPT blocks keep the fused count (not counted)
            sp_b, tp_b = eager_elementwise_bytes_per_token(model, opts)
    sp_scale = np.where(sp, 1.0 / tp, 1.0)
    elem_bytes = T * (sp_b * sp_scale + tp_b / tp + core_b * (seq / cp / seq) / tp) + cast_bytes
    elementwise = memory_time_s(system, elem_bytes, kernels + (cast_cost(system, opts)[1] if opts.fp8 else 0))
    # the MLP block alone (replayed by Options.recompute_mlp): its matmuls and its activation function
    mlp = mlp + memory_time_s(system, T * mlp_activation_bytes_per_token(model) / tp, 1)
    overlapped = (tp > 1) & sp
    return (matmuls, core, elementwise, mlp, column, sac, np.where(overlapped, split_fwd, 0.0),
            np.where(overlapped, split_bwd, 0.0), tail)


# Transformer Engine's userbuffer TP overlap as NeMo / Megatron-Bridge configure it (tp_overlap_configs/userbuffers.py,
# every H100/B200 TransformerLayerTPOverlapCfg): the GEMMs fed by an all-gather (qkv_fprop, fc1_fprop and the
# row-parallel linears' proj_dgrad, fc2_dgrad) run as RingExchangeOverlapCfg, one GEMM per arriving chunk of T/tp
# rows; the forward GEMMs that feed a reduce-scatter (proj_fprop, fc2_fprop) as PipelineOverlapCfg, num_splits 4, with
# set_sm_margin: the GEMM runs on the SMs the reduce-scatter kernels leave (num_sm 24 for proj, 16 for fc2 in the
# configs with hidden 8192 and below, 8 at 16384); the column-parallel dgrads and every wgrad run bulk overlaps (the
# whole GEMM, 2-4 SMs for the collective: not counted). torch's async TP (fused_all_gather_matmul /
# fused_matmul_reduce_scatter) splits likewise into tp chunks, on copy engines (no SMs taken: Options.tp_overlap_sms
# empty)
TE_PIPELINE_SPLITS = 4
TE_OVERLAP_SMS = (("proj", 24), ("mlp_out", 16))


def tp_overlap_split_s(system: System, opts: Options, name, shard, whole, T, n_dev, k_dev, tp):
    """(forward s, backward s) one layer matmul gains from being split for TP communication overlap
    (Options.tp_comm_overlap with SP; TE_*): an all-gather-fed GEMM runs as tp GEMMs of T/tp rows (its weight read
    each time, its fixed cost paid each time), a reduce-scatter-fed one as TE_PIPELINE_SPLITS GEMMs on the SMs the
    collective leaves (Options.tp_overlap_sms). Forward: column-parallel ring exchange, row-parallel pipeline;
    backward: the row-parallel dgrad is a ring exchange (its shape taken as the forward's)."""
    def split(parts, sms_taken=0.0):
        sms = system.chip.cores_per_chip
        slow = sms / max(sms - sms_taken, 1.0)
        return parts * matmul_time_s(system, T / parts, n_dev, k_dev, opts.fp8, opts) * slow - whole
    ring = split(np.maximum(tp, 1.0))
    if shard == "n":
        return ring, 0.0
    if not opts.tp_overlap_sms:  # torch's fused_matmul_reduce_scatter: tp chunks too
        return ring, ring
    return split(TE_PIPELINE_SPLITS, dict(opts.tp_overlap_sms).get(name, 0.0)), ring


# torch's context_parallel (torch.distributed.tensor.experimental._attention, the allgather-rotate ring torchtitan runs)
# merges each ring step's SDPA output into an fp32 accumulator in eager ops (_SDPAMerger with convert_to_f32, the
# default): per step, bytes per element of the rank's attention output (query width), forward: the block output to
# fp32 (read 2, write 4), out - block_out (12), x sigmoid(lse difference) (8), out - that (12): 38 on a full step, 31
# on a round-robin partial one (half the work plus _partial_update's clone of the whole accumulator), about 34.5,
# plus the torch.cat of K and V for the next step (8, K and V at the query width: torchtitan repeats them before
# SDPA); once: the first block's conversion and the result's cast back (6 + 6). Backward
# (_templated_ring_attention_backward), per step: dQ += the block's bf16 dQ in fp32 (10), dK and dV likewise (20),
# the fp32 torch.cat of dK/dV for the rotation (16), the K/V cat (8), about 2 more for the partial updates' clones;
# once: the fp32 zeros for dQ, dK, dV (12) and their casts back to bf16 (18)
CP_MERGE_FWD_STEP_BYTES = 42.5
CP_MERGE_FWD_ONCE_BYTES = 12
CP_MERGE_BWD_STEP_BYTES = 56
CP_MERGE_BWD_ONCE_BYTES = 30
CP_MERGE_FWD_KERNELS = 6  # per step: cast, sub, sigmoid, mul, sub, cat (logsigmoid on the lse: small)
CP_MERGE_BWD_KERNELS = 5  # per step: three accumulations, two cats


def cp_merge_s(model: ModelConfig, system: System, opts: Options, T, tp, cp):
    """(forward s, backward s) of one layer's ring-attention merge traffic under torch's context_parallel
    (Options.cp_comm "allgather_rotate"; CP_MERGE_*): memory-bound eager ops over the rank's attention output
    (T tokens x query width / tp), cp - 1 merges forward, cp accumulations backward. Zero for the other CP
    implementations (Megatron-Core / Transformer Engine fuse their corrections; Llama 3's all-gather runs one
    attention call over the gathered K/V) and without CP."""
    if opts.cp_comm != "allgather_rotate":
        return 0.0, 0.0
    elements = T * attention_out_dim(model) / tp
    steps = np.maximum(cp - 1.0, 0.0)
    fwd = memory_time_s(system, elements * (CP_MERGE_FWD_ONCE_BYTES + steps * CP_MERGE_FWD_STEP_BYTES),
                        steps * CP_MERGE_FWD_KERNELS + 2)
    bwd = memory_time_s(system, elements * (CP_MERGE_BWD_ONCE_BYTES + cp * CP_MERGE_BWD_STEP_BYTES),
                        cp * CP_MERGE_BWD_KERNELS + 6)
    return np.where(cp > 1, fwd, 0.0), np.where(cp > 1, bwd, 0.0)


def _op_sac_recomputed(model: ModelConfig, tp):
    """(N, K) per device of the matmuls torchtitan's per-op selective checkpointing recomputes (Options.selective_ops),
    every second one of the block: Llama's wq, wk, wv, wo, w1, w3, w2 -> wk (column-parallel, the rank's kv heads),
    wo (row-parallel), w3 (column-parallel); a GPT block's fused qkv, out, fc1, fc2 -> out and fc2."""
    wo = (model.hidden, attention_out_dim(model) / tp)
    if model.arch != "llama":
        return [wo, (model.hidden, model.ffn / tp)]
    return [(model.kv_dim / np.minimum(tp, model.n_kv_heads), model.hidden), wo, (model.ffn / tp, model.hidden)]
