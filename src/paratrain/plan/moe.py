"""Mixture-of-experts physics of the planner: expert compute, all-to-all dispatch/combine, expert memory and
expert data-parallel traffic. No torch; element-wise on numpy arrays like plan/step.py, which calls in here.

How a MoE model enters the dense formulas (plan/step.py evaluate): `dense_view` is the model with its routed
experts taken out. Its per-layer FFN width is the layer average of what stays replicated and TP-sharded like a
dense MLP: the dense first layers' FFN, the MoE layers' shared experts (n x moe_ffn, one SwiGLU) and the router
(h x E = 3h x E/3). The dense code times and sizes that average layer (attention, TP, CP, PP, DP, memory). This
module adds what the routed experts cost on top, per (average) layer: `layer_terms` (grouped expert GEMMs,
permute/unpermute, all-to-all), `memory_terms` (expert weights, gradients, optimizer state; MoE activations and
dispatch buffers) and the expert data-parallel traffic over the expert-data-parallel group. Model FLOPs count
the real model's active parameters (ModelConfig.num_matmul_params: top-k routed + shared experts + dense layers
+ router).

Expert layout (torchtitan's and Megatron-Core's "MoE parallel folding", Liu et al. 2025): the ranks of one
pipeline stage, tp x cp x dp of them, are refolded for the expert layers as etp x ep x edp, etp innermost.
etp = 1 (torchtitan's default expert_tensor_parallel_degree, Megatron-Core's expert_tensor_parallel_size = 1 in
the Megatron-Bridge MoE recipes): ep borrows from tp, cp and dp, each expert holds its full width and each rank
routes its 1/tp of the tokens (sequence parallel); etp = tp: experts are TP-sharded like the dense MLP and ep
borrows from cp and dp only. edp = tp*cp*dp / (etp*ep) replicas of each expert shard. Which (ep, etp) are valid is
paratrain.config.rules' (the trainer's rules, written once); this module only times and sizes them.
"""

from __future__ import annotations

import math

import numpy as np

from paratrain.config.rules import EXPERT, edp_degree, expert_view, mask  # noqa: F401 - edp_degree re-exported
from paratrain.hardware.catalog import System
from paratrain.model.config import ModelConfig
from paratrain.plan.collectives import overlapped_exposed_s, timesharing_ranks
from paratrain.plan.data_parallel import _data_parallel_s
from paratrain.plan.kernels import block_scaled, cast_cost, matmul_time_s, memory_time_s
from paratrain.plan.pipeline import inflight_microbatches
from paratrain.plan.precision import BF16_BYTES, FP8_BYTES, OPTIMIZER_BYTES, WEIGHT_BYTES

# Memory-bound kernels of one MoE block forward outside the expert GEMMs (Megatron-Core's alltoall token
# dispatcher and torchtitan's MoE: router softmax/sigmoid, top-k, score normalisation, histogram of tokens per
# expert, permute, unpermute + weighted sum, SwiGLU on the expert rows, aux-loss terms)
MOE_ELEMENTWISE_KERNELS = 8
# A flat all-to-all dispatch (Megatron-Core's MoEAlltoAllTokenDispatcher, torchtitan's all_to_all_single path)
# copies the routed rows twice more than a hierarchical one: what arrives from the ep ranks is ordered by source
# rank, so "Permutation 2" (sort_chunks_by_idxs, when num_local_experts > 1) regroups it by local expert before
# the GEMMs and "Unpermutation 2" restores the rank order before the combine, each a read + write of every
# routed row. DeepEP / HybridEP (the flex dispatcher) deliver the tokens once per rank and permute them by local
# expert once (the 2 copies every dispatcher pays: permute, unpermute).
FLAT_DISPATCH_EXTRA_COPIES = 2
# Load imbalance of a learned router, as the coefficient of variation of tokens per expert in one microbatch.
# Wang et al. 2024 ("Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts", Table 1/Fig. 3):
# batch-level MaxVio (max load / mean - 1) of 0.2-0.7 for 1B-3B MoEs with 64 experts trained with an aux loss or
# the loss-free bias; the CV of a load whose max over E experts sits ~sqrt(2 ln E) CV above the mean is then
# ~0.1-0.25. 0.15 is the assumption used for learned routing; published benchmark runs that force-balance
# their routing (Megatron-Bridge's performance tables) pass Options.moe_imbalance = 1.
ROUTER_LOAD_CV = 0.15
# Dropless dispatch reads the per-expert token counts to the host once per MoE layer forward (Megatron-Core's
# MoEAlltoAllTokenDispatcher: the all-to-all split sizes and GroupedLinear's m_splits are Python lists, taken
# with a .cpu() and a stream synchronisation at its cuda_sync_point; DeepEP's normal kernels likewise wait on
# the host for the receive counts). The GPU queue drains there; it restarts when the host has launched again,
# and the dispatch kernels right after the sync (permute, the all-to-all, the sort of the received chunks by
# local expert) run at the host's launch pace: the sync round trip plus these 3, each one kernel launch
# (the chip's kernel_overhead_s). A capacity factor (token dropping: static shapes) needs no sync.
HOST_SYNC_LAUNCHES = 4
# Transformer Engine's multi-stream grouped GEMM (one cuBLASLt GEMM per local expert over several streams: what
# Megatron-Core's TEGroupedMLP runs on Hopper) costs this much per expert GEMM more than one grouped launch for
# all experts. Published kernel measurement, TE PR #3134 (2026-06, benchmarks/linear/benchmark_grouped_linear.py,
# "PURE" kernel-vs-kernel row, 8 experts x 128 tokens, N = K = 2048): 0.267 ms multi-stream against 0.069 ms for
# the single-launch grouped kernel, (0.267 - 0.069) / 8 = 24.75 us per expert GEMM. Measured on SM100 (NVFP4);
# taken as the cost of the path itself (cuBLASLt call, stream/event hand-offs), not of the chip's math: an
# assumption for Hopper, where no such measurement was found.
MULTISTREAM_GEMM_S = (0.267e-3 - 0.069e-3) / 8
# Transformer Engine's GroupedLinear quantizes the operands of its per-expert GEMMs one local expert at a time
# (tex.split_quantize, one quantizer per expert; TE v2.12 csrc/extensions/cast.cpp multi_tensor_quantize_impl:
# "Quantize kernels individually" unless every quantizer is delayed-scaling FP8): per GEMM layer, the input in
# the forward and the output gradient in the backward, fc1 and fc2. Per-tensor current scaling (what Megatron-
# Bridge's FP8-CS recipes run) launches 3 kernels per expert tensor (Float8CurrentScalingQuantizer::quantize_impl:
# nvte_compute_amax, nvte_compute_scale_from_amax, nvte_quantize_v2); block-scaled formats (MXFP8, FP8
# blockwise) find their scales while casting: 1. Each pays the chip's kernel_overhead_s like every other kernel.
QUANTIZED_TENSORS_PER_DIRECTION = 2  # fc1 and fc2: inputs forward, output gradients backward
CURRENT_SCALING_QUANTIZE_KERNELS = 3
BLOCK_SCALED_QUANTIZE_KERNELS = 1
# SMs the all-to-all kernels hold while they run (what the compute overlapped with them loses). DeepEP /
# HybridEP: Megatron-Core's moe_deepep_num_sms = 20 (TransformerConfig; DeepSeek-V3 report sec. 3.2.2: "only
# 20 SMs" for dispatch and combine on H800). NCCL's all-to-all runs one CTA per channel; 32 channels is an
# assumption (NCCL's channel count for a large p2p operation on Hopper), not measured here.
DEEPEP_SMS = 20
NCCL_ALLTOALL_SMS = 32
# HybridEP as Megatron-Bridge's performance runs use it: scripts/performance/utils/overrides.py
# (_set_common_perf_overrides, v0.2.2 helpers.py to v0.4.2) sets moe_hybridep_num_sms = 32 when the backend is
# hybridep ("TODO: This needs to be adjusted when overlapping HybridEP with computation").
HYBRIDEP_SMS = 32
# HybridEP's inter-node dispatch and combine, measured: deepseek-ai/DeepEP hybrid-ep branch, Hybrid-EP
# implementation doc, "H100 Platform" table (PR #494, 2025-11-18, Hybrid-EP_Implementation.md @35a4826, the same
# table @07eea0c; docs/README_Hybrid-EP.md since): 16 / 32 / 64 ranks (2 / 4 / 8 nodes of 8 H100), 4096 tokens
# per rank x hidden 7168, top-8 of 128 experts (8 per rank), uniform random routing, "Kernel Only", the 16-SM
# rows (the recipes' 32 SMs taken as 16: at 2 nodes 8 SMs already reach 76.80 / 62.00 / 68.00, saturated).
# The test counts one copy of each token per destination node *including its own* (tests/utils.py
# count_rdma_send_from_routing_map: "we do not set the local node map to zeros"), i.e. the tokens the kernel
# moves through its per-node pipeline (RDMA to the remote node or straight to the own node, then TMA/NVLink to
# the node's GPUs holding an expert), so each rate is per node-copy byte, NVLink fan-out included: the whole
# across-node dispatch or combine of that node count. Read as the network's share (the remote (N-1)/N of the
# copies): 2 nodes 35.9 GB/s (under the NICs: the per-node stage binds), 4 nodes 43.3, 8 nodes 43.7 GB/s (BF16
# dispatch; the NICs bind, at 43.5 GB/s rather than the catalog's 40). Keyed by chip: no other chip's inter-node
# figure (the B200 and GB200 tables are one NVLink domain).
HYBRIDEP_MEASURED_NODES = (2, 4, 8)
HYBRIDEP_NODE_COPY_BYTES_PER_S = {"h100": {"dispatch_bf16": (71.71e9, 57.69e9, 49.97e9),
                                           "dispatch_fp8": (68.48e9, 55.35e9, 46.52e9),
                                           "combine": (62.95e9, 57.46e9, 49.77e9)}}
# Routing probabilities as the expert block receives them: DeepEP / HybridEP take float32 probs (Megatron-Core
# token_dispatcher.py, the flex dispatcher: "self.token_probs = self.token_probs.float()"); the alltoall
# dispatcher keeps the router's dtype, bf16 unless the recipe sets moe_router_dtype = fp32 (GPT-OSS does not).
FLEX_PROBS_BYTES = 4
ALLTOALL_PROBS_BYTES = BF16_BYTES


def is_moe(model: ModelConfig) -> bool:
    return model.num_experts > 0


def dense_view(model: ModelConfig) -> ModelConfig:
    """The model with its routed experts removed: per-layer FFN width = the layer average of the dense FFNs,
    shared experts and router (what TP shards and DP replicates like a dense MLP). Not validated (the width may
    be tiny: Mixtral has no shared expert, only its 8-column router)."""
    L, ml = model.layers, model.moe_layers
    width = ((L - ml) * model.ffn + ml * (model.shared_experts * model.moe_ffn + model.num_experts / 3.0)) / L
    return model.model_copy(update={"num_experts": 0, "first_dense_layers": 0, "ffn_hidden": max(1, round(width))})


def expert_params_per_layer(model: ModelConfig) -> float:
    """Routed-expert parameters of an average layer (all experts; MoE layers only hold them)."""
    return model.moe_layers / model.layers * model.num_experts * 3 * model.hidden * model.moe_ffn


def routing_imbalance(model: ModelConfig, opts, rows_per_rank, ep):
    """Tokens the busiest expert-parallel rank receives over the mean (>= 1): what its expert GEMMs and its share
    of the all-to-all scale with. Options.moe_imbalance when given (1: force-balanced routing). Otherwise the
    expected maximum over ep ranks of their loads, each the sum over its E/ep experts: per expert a relative
    spread ROUTER_LOAD_CV (learned routing) plus multinomial sampling of `rows_per_rank` assignments; the maximum
    of ep roughly normal loads sits sqrt(2 ln ep) standard deviations above the mean. A capacity factor caps it
    (token dropping: no expert takes more than c x its mean share)."""
    if opts.moe_imbalance is not None:
        return np.full(np.shape(rows_per_rank), float(opts.moe_imbalance)) if np.ndim(rows_per_rank) else \
            float(opts.moe_imbalance)
    ep = np.asarray(ep, dtype=float)
    local = model.num_experts / ep
    cv_rank = np.sqrt(ROUTER_LOAD_CV**2 / local + 1.0 / np.maximum(rows_per_rank, 1.0))
    imb = 1.0 + np.sqrt(2.0 * np.log(np.maximum(ep, 1.0))) * cv_rank
    if model.capacity_factor is not None:
        imb = np.minimum(imb, max(1.0, model.capacity_factor))
    return np.where(ep > 1, imb, 1.0)


def node_hit_fraction(model: ModelConfig, nodes):
    """Expected fraction of the EP group's `nodes` that one token's k routed experts reach (>= 1/nodes; a node is
    reached when it holds one of them), experts laid out contiguously (Megatron-Core: EP rank r holds experts
    r x local ...). Plain top-k: each of the k picks lands on a node with probability 1/N (experts uniform over
    nodes, picks independent), 1 - (1 - 1/N)^k. Group-limited routing (ModelConfig.router_groups G, router_group_topk
    g; Megatron-Core moe_utils.group_limited_topk: contiguous groups, the top-k taken inside the g best groups):
    DeepSeek-V3's node-limited routing, each token sent to at most g nodes when the groups are the nodes (sec.
    2.1.2). With c = G/N whole groups a node (G a multiple of N), j of them among the g chosen (hypergeometric) and
    each pick landing in one of them with probability j/g: sum_j P(j) (1 - (1 - j/g)^k); a group spanning N/G whole
    nodes (N a multiple of G): g/G (1 - (1 - G/(g N))^k). Groups that cut across nodes otherwise: plain top-k.
    Under force-balanced benchmark routing (Megatron-Core moe_router_force_load_balancing: random logits, then the
    same group-limited top-k) the chosen groups and experts are uniform, as assumed here."""
    nodes = np.asarray(nodes, dtype=float)
    k, G, g = model.experts_per_token, model.router_groups, model.router_group_topk
    values, inverse = np.unique(nodes, return_inverse=True)
    out = np.empty(values.shape)
    for i, n in enumerate(values):
        n_int = max(1, int(round(n)))
        if G > 1 and g < G and G % n_int == 0:
            c = G // n_int
            out[i] = sum(math.comb(c, j) * math.comb(G - c, g - j) / math.comb(G, g) * (1 - (1 - j / g) ** k)
                         for j in range(0, min(c, g) + 1))
        elif G > 1 and g < G and n_int % G == 0:
            out[i] = g / G * (1 - (1 - G / (g * n_int)) ** k)
        else:
            out[i] = 1 - (1 - 1 / max(n, 1.0)) ** k
    return out[inverse].reshape(nodes.shape)


def alltoall_time_s(system: System, nbytes, degree, stride, imbalance=1.0, dedup_k=None, model=None):
    """One all-to-all over `degree` ranks spaced `stride` apart, each sending `nbytes` spread evenly over the
    group (1/degree stays local). Alpha-beta per tier: the part bound for peers first reachable over tier i
    (inside its domain but not the inner one) moves at that tier's per-device bandwidth; the tiers move at once
    (NVLink and the NICs in parallel, as NCCL's and DeepEP's all-to-all do), so the slowest tier sets the time,
    plus the outermost tier's latency and per-call overhead. The busiest receiver gets `imbalance` x the mean.
    dedup_k (hierarchical dispatch, DeepEP / HybridEP as DeepSeek-V3 sec. 3.2.2 describes it): `nbytes` are k
    copies of each token; across the scale-out network a token goes once to each remote node holding one of
    its k experts, then NVLink fans it out: of N nodes, (N-1)(1-(1-1/N)^k) remote ones are expected (experts
    uniform over nodes), instead of k(N-1)/N copies; with `model` given, (N-1) x node_hit_fraction (its
    group-limited routing; the own node is reached as often as any other)."""
    nbytes = np.asarray(nbytes, dtype=float) * imbalance
    degree = np.asarray(degree, dtype=float)
    stride = np.asarray(stride, dtype=float)
    share = timesharing_ranks(system)
    slowest = np.zeros(np.broadcast(nbytes, degree, stride).shape)
    fixed = np.zeros_like(slowest)
    reached = np.ones_like(slowest)
    for tier in system.tiers:
        inside = np.clip(np.floor(tier.domain_devices / stride), 1.0, degree) if tier.domain_devices else degree
        peers = np.maximum(inside - reached, 0.0)
        link = tier.interconnect
        fraction = peers / degree
        if dedup_k is not None and not tier.domain_devices:  # node-deduplicated copies over the network
            nodes = degree / reached
            hit = node_hit_fraction(model, nodes) if model is not None else 1 - (1 - 1 / nodes) ** dedup_k
            fraction = np.where(nodes > 1, (nodes - 1) * hit / dedup_k, fraction)
        t = nbytes * fraction * share / tier.per_device_bw_bytes_per_s(system)
        slowest = np.maximum(slowest, t)
        fixed = np.where(peers > 0, (link.latency_us + link.collective_overhead_us) * 1e-6, fixed)
        reached = np.maximum(reached, inside)
    return np.where(degree > 1, slowest + fixed, 0.0)


def hybridep_rate_bytes_per_s(measured, nodes):
    """HybridEP's per-node-copy rate at `nodes` nodes from the rates measured at HYBRIDEP_MEASURED_NODES: the
    network's share of it (the remote (N-1)/N of the copies) interpolated linearly between the measured node
    counts and held beyond the largest (there the NICs bind, as measured at 4 and 8 nodes: more nodes only
    raise the remote share), then back to a per-copy rate, x N/(N-1). Exact at each measured count."""
    known = np.asarray(HYBRIDEP_MEASURED_NODES, dtype=float)
    network = np.asarray(measured, dtype=float) * (known - 1) / known
    n = np.maximum(np.asarray(nodes, dtype=float), known[0])
    return np.interp(n, known, network) * n / (n - 1)


def hybridep_node_copy_s(system: System, opts, tokens, ep, stride, model, hidden):
    """(dispatch s, dispatch-as-bf16 s, combine s) of HybridEP's dispatch and combine across nodes: each of a
    rank's `tokens` goes once to every node holding one of its k experts, its own included, N x
    node_hit_fraction of N nodes (plain top-k: N(1-(1-1/N)^k), experts uniform over nodes; fewer under
    group-limited routing), at the rate measured for that node count (HYBRIDEP_NODE_COPY_BYTES_PER_S via
    hybridep_rate_bytes_per_s; the combine's gradient leaves like a bf16 dispatch). The measured kernel is the
    whole across-node operation, so it replaces the per-tier alltoall_time_s there; zero inside one node, for
    the other backends and on chips with no measurement."""
    rates = HYBRIDEP_NODE_COPY_BYTES_PER_S.get(system.chip.name)
    zero = 0.0 * np.asarray(tokens, dtype=float) * np.asarray(ep, dtype=float)
    if opts.moe_flex_backend != "hybridep" or rates is None:
        return zero, zero, zero
    per_node = np.clip(np.floor(system.devices_per_node / np.asarray(stride, dtype=float)), 1.0, ep)
    nodes = np.asarray(ep, dtype=float) / per_node
    copies = np.where(nodes > 1, nodes * node_hit_fraction(model, nodes), 0.0)
    rate = {key: hybridep_rate_bytes_per_s(measured, nodes) for key, measured in rates.items()}
    bf16 = tokens * copies * hidden * BF16_BYTES
    fp8 = opts.fp8 and opts.moe_fp8_dispatch
    dispatch = tokens * copies * hidden * FP8_BYTES / rate["dispatch_fp8"] if fp8 else bf16 / rate["dispatch_bf16"]
    return dispatch, bf16 / rate["dispatch_bf16"], bf16 / rate["combine"]


def per_expert_quantize_s(system: System, opts, local):
    """Launch time of the per-expert operand quantization of Transformer Engine's GroupedLinear, per direction
    (the forward's and the backward's are equal: QUANTIZED_TENSORS_PER_DIRECTION tensors each), per MoE block.
    Only on the per-expert GEMM path (Options.moe_gemm_per_expert) with low-precision matmuls; a grouped kernel
    for all experts (DeepGEMM, torch._grouped_mm) quantizes the routed rows in one pass (in cast_cost's bytes)."""
    if not (opts.fp8 and opts.moe_gemm_per_expert):
        return 0.0 * np.asarray(local, dtype=float)
    kernels = BLOCK_SCALED_QUANTIZE_KERNELS if block_scaled(system, opts) else CURRENT_SCALING_QUANTIZE_KERNELS
    return QUANTIZED_TENSORS_PER_DIRECTION * np.asarray(local, dtype=float) * kernels \
        * system.chip.efficiency.kernel_overhead_s


def fp8_padding_s(model: ModelConfig, system: System, opts, routed):
    """Time per direction, per MoE block, of Transformer Engine's Fp8Padding and Fp8Unpadding around the per-expert
    GEMMs: Megatron-Core's TEGroupedMLP pads each local expert's rows to the FP8/FP4 alignment (16 rows, 32 for the
    MX formats and NVFP4) before fc1 and unpads fc2's output after it, under FP8 or FP4 (experts.py forward,
    `quantization_padding` / `quantization_unpadding`, in every Megatron-LM commit Megatron-Bridge v0.2.2-v0.4.2
    pins). TE (module/fp8_padding.py) returns early only when every count is already aligned, which routing
    leaves them not (force-balanced or learned); otherwise `tex.fused_multi_row_padding` copies every routed row
    (h wide, bf16: read + write) into the padded buffer, the unpadding copies the outputs back, and the backward
    runs the same two copies of the gradients the other way (once per direction, as per_expert_quantize_s). Plus
    the probs' column padded alike (one small kernel). None where the dispatcher already padded the rows
    (Options.moe_fused_padding: HybridEP's pad_multiple; DeepEP pads only with moe_router_padding_for_quantization,
    which the recipes leave off), on the fused grouped-GEMM path or in BF16."""
    if not (opts.fp8 and opts.moe_gemm_per_expert) or opts.moe_fused_padding:
        return 0.0 * np.asarray(routed, dtype=float)
    return memory_time_s(system, routed * model.hidden * BF16_BYTES * 2 * 2, 3)


def expert_bias_s(model: ModelConfig, system: System, opts, routed, local):
    """(forward s, backward s) per MoE block of the routed experts' output bias as Megatron-Core applies it
    (TEGroupedMLP._apply_bias, megatron/core/transformer/moe/experts.py, the same code in core v0.15-v0.18 and in
    the Megatron-LM commits Megatron-Bridge v0.2.2, v0.3.0 and v0.4.0 pin): fc2 is built with skip_bias_add
    (the bias must be scaled by each row's routing probability, as the rows already were before fc2), so the
    bias is added in eager PyTorch, one local expert at a time: `torch.cat([t + b * p for t, b, p in
    zip(split(out), biases, split(probs))]).to(out.dtype)`. Per element of the routed rows (h wide), with P =
    the probs' bytes (FLEX_PROBS_BYTES / ALLTOALL_PROBS_BYTES; b * p and the sum take that dtype):
    forward b * p writes P, t + b*p reads 2 + P and writes P, cat reads and writes P, the cast back (only where
    P != 2) reads P and writes 2; backward (autograd): the cast's gradient (P != 2) reads 2 writes P, the
    gradient to t casts back (P != 2), the mul's two gradients (to the bias and to the probs) each write
    grad x other and sum it over the broadcast dimension (read P, write P, read P), and the split's backward
    concatenates the experts' gradients of t into fc2's output gradient (read and write 2; the probs' split
    likewise, a column). Kernels: 2 per expert + cat (+ cast) forward, 4 per expert (+ a cast each) + the two
    split gradients backward, each paying the chip's kernel_overhead_s. fc1's bias is in its GEMM's epilogue
    (skip_bias_add=False): not counted. Zero without expert biases."""
    if not model.expert_bias:
        return 0.0, 0.0
    P = FLEX_PROBS_BYTES if opts.moe_hierarchical_dispatch else ALLTOALL_PROBS_BYTES
    cast = float(P != BF16_BYTES)
    elements = routed * model.hidden
    fwd_bytes = P + (BF16_BYTES + 2 * P) + 2 * P + cast * (P + BF16_BYTES)
    bwd_bytes = cast * 2 * (BF16_BYTES + P) + 2 * 3 * P + 2 * BF16_BYTES
    fwd = memory_time_s(system, elements * fwd_bytes, 2 * local + 1 + cast)
    bwd = memory_time_s(system, elements * bwd_bytes, (4 + cast) * local + cast + 2)
    return fwd, bwd


def glu_clamp_s(model: ModelConfig, system: System, routed, etp):
    """(forward s, backward s) per MoE block of the clamp on the routed experts' gated activation
    (ModelConfig.swiglu_limit; GPT-OSS: 7) as Megatron-Core runs it. TEGroupedMLP.bias_act_func (the recipes'
    bias_activation_fusion) calls `weighted_bias_quick_geglu_impl` with config.activation_func_clamp_value
    (megatron/core/fusions/fused_bias_geglu.py, the same function in the Megatron-LM commits Megatron-Bridge
    v0.2.0-v0.4.2 pin), which clamps in eager PyTorch before the fused (jit) weighted quick-GEGLU:
    `x_glu, x_linear = input.chunk(2, -1); input = torch.cat((x_glu.clamp(min=None, max=c),
    x_linear.clamp(min=-c, max=c)), -1)`, then `torch.tensor(linear_offset, device=input.device)`, a copy from
    host memory that PyTorch synchronises (non_blocking=False: aten/src/ATen/native/cuda/Copy.cu copy_kernel_cuda
    -> memcpy_and_sync, cudaMemcpyAsync + cudaStreamSynchronize): the queue drains as at the dropless token-count
    sync (HOST_SYNC_LAUNCHES). Per element of one half (routed rows x width, bf16): forward each clamp reads and
    writes 2 bytes and the cat reads and writes both halves, 16 bytes, 3 kernels; backward (autograd): PyTorch's
    clamp_backward (torch/csrc/autograd/FunctionsManual.cpp) masks and selects, `where(self <= max, grad, 0)`
    for the gate half (le reads 2 writes 1, where reads 3 writes 2: 8 bytes) and `where((self >= min)
    .logical_and_(self <= max), grad, 0)` for the linear half (14 bytes), each with a scalar_tensor fill, and
    chunk's backward (split_backward) concatenates the two halves' gradients (8 bytes): 30 bytes, 9 kernels.
    The activation's replay under recompute_modules "moe_act" reruns the forward part (norm_act_replay_s), as
    full recompute does. Zero without swiglu_limit."""
    if model.swiglu_limit is None:
        return 0.0, 0.0
    elements = routed * model.moe_ffn / np.asarray(etp, dtype=float)
    sync = HOST_SYNC_LAUNCHES * system.chip.efficiency.kernel_overhead_s
    return memory_time_s(system, elements * 16, 3) + sync, memory_time_s(system, elements * 30, 9)


def norm_act_replay_s(model: ModelConfig, system: System, T, tp, sp, etp, routed):
    """Forward time per average layer that Megatron-Core replays in the backward under selective recompute of
    "layernorm" and "moe_act" (Options.recompute_norm_act; Megatron-Bridge's GPT-OSS recipes:
    recompute_modules = ["layernorm", "moe_act"], gpt_oss_workload_base_configs.py v0.2.2-v0.4.2). "layernorm":
    TransformerLayer checkpoints a norm without its output (tensor_parallel.CheckpointWithoutOutput) only where
    the norm is a module of its own (`not isinstance(..., IdentityOp)`, transformer_layer.py): in the Transformer
    Engine spec (gpt_layer_specs.py, the bridge's default_layer_spec) the input norm is fused into linear_qkv
    (TELayerNormColumnParallelLinear) and a dense layer's pre-MLP norm into linear_fc1, so only a MoE layer's
    pre_mlp_layernorm (a TENorm) is rerun: a read and a write of the rank's tokens (its SP shard), one kernel.
    "moe_act": TEGroupedMLP (activation_recompute) reruns the expert activation (with the probs' scaling): per
    routed row a read of fc1's output (2 x width) and a write of width, bf16, one kernel, and with
    ModelConfig.swiglu_limit the eager clamp ahead of it (glu_clamp_s, forward part). The attention core is
    not replayed (not in the list). The memory they free: activation_bytes_per_layer."""
    if not model.num_experts:
        return 0.0 * np.asarray(T, dtype=float)
    tokens = T / np.where(np.asarray(sp, dtype=bool), tp, 1.0)
    norm = memory_time_s(system, tokens * model.hidden * BF16_BYTES * 2, 1)
    width = model.moe_ffn / np.asarray(etp, dtype=float)
    act = memory_time_s(system, routed * 3 * width * BF16_BYTES, 1) + glu_clamp_s(model, system, routed, etp)[0]
    return model.moe_layers / model.layers * (norm + act)


def wgrad_accumulate_s(system: System, opts, rows, n, k):
    """Time one expert weight-gradient GEMM takes beyond its forward-shaped count (plan.step times a backward
    GEMM as the forward one): with Megatron-Core's gradient_accumulation_fusion (Megatron-Bridge's default where
    Transformer Engine is installed: models/gpt_provider.py `can_enable_gradient_accumulation_fusion`) TE's
    GroupedLinear writes each expert's weight gradient into its main_grad with accumulate=True (module/
    grouped_linear.py: `wgrad_list = main_grads`, cuBLAS beta = 1), so the GEMM also reads the weight-shaped
    buffer back and writes it at the buffer's width (Options.grad_bytes: 2, the grad_reduce_in_fp32 = False of
    the performance recipes; 4 for an fp32 buffer) instead of bf16. Small where an expert gets many rows; at
    GPT-OSS's ~1,000 rows per expert at mb1 (K = 2,880) the GEMM nears its memory roofline. Zero without
    Options.wgrad_accumulation_fusion (the megatron stack sets it)."""
    if not opts.wgrad_accumulation_fusion:
        return 0.0 * np.asarray(rows, dtype=float)
    extra = (opts.grad_bytes + (opts.grad_bytes - BF16_BYTES)) * n * k
    return matmul_time_s(system, rows, n, k, opts.fp8, opts, extra_bytes=extra) \
        - matmul_time_s(system, rows, n, k, opts.fp8, opts)


def layer_terms(model: ModelConfig, system: System, opts, *, T, tp, sp, ep, etp, rc):
    """Per average layer, forward, on the busiest expert rank: (expert GEMMs s, elementwise s, all-to-all fwd s,
    all-to-all bwd s, all-to-all bytes per microbatch, routed rows, per-expert quantize launches + FP8 row padding s,
    (eager expert work outside the fused kernels forward s, backward s: the expert bias, expert_bias_s, and the
    activation clamp, glu_clamp_s), expert weight-gradient accumulation s (backward only)). Backward GEMMs and elementwise traffic are 2x (plan.step); the quantize
    launches and the padding copies are once per direction; the expert bias has its own forward and backward
    (expert_bias_s)."""
    share = model.moe_layers / model.layers  # the average layer's share of a MoE block
    h, fm, k, E = model.hidden, model.moe_ffn, model.experts_per_token, model.num_experts
    ep = np.asarray(ep, dtype=float)
    etp = np.asarray(etp, dtype=float)
    tokens = T * etp / tp  # tokens a rank routes: its SP shard (etp = 1) or the TP group's all (etp = tp)
    rows = tokens * k  # assignments it sends, and on average receives
    imb = routing_imbalance(model, opts, rows, ep)
    local = E / ep
    per_expert = rows * imb / local
    width = fm / etp
    overhead = system.chip.efficiency.kernel_overhead_s
    # the run's precision options (FP8 / MX block scaling / FP4, the stack's GEMM efficiency): Transformer
    # Engine's GroupedLinear runs the expert GEMMs in the recipe's format, as the dense layer matmuls
    gemm = local * (matmul_time_s(system, per_expert, 2 * width, h, opts.fp8, opts)
                    + matmul_time_s(system, per_expert, h, width, opts.fp8, opts))
    # one grouped launch for all local experts: the fixed cost paid twice (once per GEMM), not 2 x local
    gemm = gemm - 2 * (local - 1) * overhead
    if opts.moe_gemm_per_expert:  # TE's multi-stream loop over the local experts (backward: 2x, as the GEMMs)
        gemm = gemm + 2 * local * MULTISTREAM_GEMM_S
    wgrad = local * (wgrad_accumulate_s(system, opts, per_expert, 2 * width, h)
                     + wgrad_accumulate_s(system, opts, per_expert, h, width))
    routed = rows * imb
    flat = not opts.moe_hierarchical_dispatch
    copies = 2 + np.where((ep > 1) & (local > 1) & flat, FLAT_DISPATCH_EXTRA_COPIES, 0)
    elem_bytes = (tokens * E * 4 * 3  # fp32 router scores: write, top-k read, softmax/sigmoid read+write
                  + routed * h * BF16_BYTES * 2 * copies  # permute, unpermute (+ sort/unsort chunks): read + write
                  + routed * 3 * width * BF16_BYTES  # SwiGLU: read gate, up, write product
                  + (cast_cost(system, opts)[0] * routed * (h + width) if opts.fp8 else 0.0))
    elem = memory_time_s(system, elem_bytes, MOE_ELEMENTWISE_KERNELS + copies - 2)
    dispatch_bytes = FP8_BYTES if opts.fp8 and opts.moe_fp8_dispatch else BF16_BYTES
    stride = np.where(etp > 1, tp, 1.0)
    dedup = k if opts.moe_hierarchical_dispatch else None
    dispatch = alltoall_time_s(system, rows * h * dispatch_bytes, ep, stride, imb, dedup, model)
    combine = alltoall_time_s(system, rows * h * BF16_BYTES, ep, stride, imb, dedup, model)
    # HybridEP across nodes where it was measured (H100): its measured kernel time for that node count, NICs,
    # per-node stage and NVLink fan-out together, in place of the per-tier model
    node_dispatch, node_dispatch_bf16, node_combine = hybridep_node_copy_s(system, opts, tokens * imb, ep, stride,
                                                                          model, h)
    measured = node_combine > 0
    dispatch_bf16 = np.where(measured, node_dispatch_bf16, combine)  # the combine's gradient, like a bf16 dispatch
    dispatch, combine = np.where(measured, node_dispatch, dispatch), np.where(measured, node_combine, combine)
    # the dropless host sync sits on the dispatch path (once per forward; replayed by full recompute below);
    # counted with the all-to-all, so where there is one (ep > 1; at ep = 1 a few microseconds are left out)
    sync = np.where(ep > 1, HOST_SYNC_LAUNCHES * overhead, 0.0) if model.capacity_factor is None else 0.0
    a2a_fwd = dispatch + combine + sync
    # backward: the gradient of the combine goes out like a dispatch and that of the dispatch comes back like a
    # combine, both bf16; full recompute replays the forward's pair first
    a2a_bwd = dispatch_bf16 + combine + np.where(rc == 2, a2a_fwd, 0.0)
    a2a_bytes = rows * h * (dispatch_bytes + 3 * BF16_BYTES) * np.where(ep > 1, 1.0, 0.0)
    # per direction: the per-expert operand quantize launches and TE's row padding / unpadding for them
    quantize = per_expert_quantize_s(system, opts, local) + fp8_padding_s(model, system, opts, routed)
    bias_fwd, bias_bwd = expert_bias_s(model, system, opts, routed, local)
    clamp_fwd, clamp_bwd = glu_clamp_s(model, system, routed, etp)
    return (share * gemm, share * elem, share * a2a_fwd, share * a2a_bwd, share * a2a_bytes, routed, share * quantize,
            (share * (bias_fwd + clamp_fwd), share * (bias_bwd + clamp_bwd)), share * wgrad)


def exposed_alltoall(opts, a2a_fwd, a2a_bwd, fwd_compute, bwd_compute, unpaired=0.0, comm_sm_fraction=0.0):
    """(forward, backward) all-to-all time left after overlap. Options.ep_overlap is the fraction of the layer's
    compute it can hide behind: both schedules that overlap it pair one microbatch's forward with another's
    backward (Megatron-Core's moe_a2a_overlap, DeepSeek-V3's DualPipe, sec. 3.2.1), so the forward and backward
    all-to-alls together hide behind forward + backward compute. Two limits (plan.step.evaluate passes them):
    - `unpaired`: the fraction of a step's microbatches whose forward (warm-up) or backward (cool-down) has no
      partner to pair with: their all-to-all is exposed whole.
    - `comm_sm_fraction` f: the communication kernels occupy f of the SMs while they run, so the compute they
      hide behind runs at 1 - f meanwhile: a pair with all-to-all time C and overlappable compute X takes
      max(C, X + f C), i.e. exposed max(C - X, f C).
    What is exposed is split between forward and backward as the traffic is."""
    total = a2a_fwd + a2a_bwd
    window = opts.ep_overlap * (fwd_compute + bwd_compute)
    paired = overlapped_exposed_s(total, window, comm_sm_fraction)  # the data-parallel overlap's rule
    left = unpaired * total + (1.0 - unpaired) * paired
    scale = np.where(total > 0, left / np.where(total > 0, total, 1.0), 0.0)
    return a2a_fwd * scale, a2a_bwd * scale


def overlap_limits(system: System, opts, sched, pp, v, m):
    """(unpaired, comm_sm_fraction) for exposed_alltoall. Unpaired: the warm-up forwards before the first
    backward on the first pipeline rank (plan.pipeline.inflight_microbatches: 1F1B p, interleaved
    (2(p-1) + (v-1)p + 1)/v stages, one at pp = 1) over the step's m microbatches; the cool-down backwards
    mirror them. The V schedules (DualPipe, ZB-V standing in for it) feed microbatches from both ends and
    overlap from the start (DeepSeek-V3 Fig. 5): none. SMs: the dispatcher's kernels over the chip's SMs
    (cores_per_chip on NVIDIA parts); Trainium's collectives run on their own engines: 0."""
    sched = np.asarray(sched)
    unpaired = np.where(sched >= 3, 0.0, np.minimum(1.0, inflight_microbatches(sched, pp, v, m, 0) / m))
    sms = (HYBRIDEP_SMS if opts.moe_flex_backend == "hybridep" else DEEPEP_SMS) if opts.moe_hierarchical_dispatch \
        else NCCL_ALLTOALL_SMS
    fraction = sms / system.chip.cores_per_chip if system.chip.vendor == "nvidia" else 0.0
    return unpaired, fraction


def activation_bytes_per_layer(model: ModelConfig, T, tp, ep, etp, routed, fp8: bool = False, *, sp=False,
                               norm_act: bool = False, probs_in_experts: bool = False):
    """MoE block activations kept for backward per average layer per microbatch (selective or no recompute):
    router scores (fp32) and top-k indices/weights of the rank's tokens; per routed row the permuted input (h)
    and the activation output (width) that the two expert GEMMs' weight gradients need (FP8: kept cast, 1 byte,
    as for the dense matmuls), gate and up (2 x width) for the SwiGLU backward, and the expert output (h) for
    the gradient of the routing weights, bf16, unless the probabilities scale the activation inside the expert
    block (probs_in_experts, Options.moe_probs_in_experts: Megatron-Core's weighted activation saves its input
    and the probs, the combine nothing), and with ModelConfig.swiglu_limit the clamped copy of fc1's output
    (2 x width) that the fused activation saves (glu_clamp_s).
    norm_act (Options.recompute_norm_act, Megatron-Core's recompute_modules "layernorm" + "moe_act", output-
    discarding checkpoints: tensor_parallel.CheckpointWithoutOutput frees the output's storage after its consumer
    ran and restores it by the replay before backward): "moe_act" drops the activation output, fc2's saved input
    (experts.py TEGroupedMLP; under FP8 set_save_original_input makes fc2 save that bf16 output instead of its
    cast, so what the planner counts for it goes either way), and keeps fc1's output (the checkpoint's input);
    "layernorm" drops the pre-MLP norm's output (what the dense view counts as the MLP input, h per token of the
    rank's SP shard at the dense part's 2 bytes, 1 under FP8) and keeps its input (the residual). Returned as a
    negative part of this term: the dense view counts the norm output. Only MoE layers have a norm of their own
    (norm_act_replay_s)."""
    share = model.moe_layers / model.layers
    tokens = T * np.asarray(etp, dtype=float) / tp
    width = model.moe_ffn / np.asarray(etp, dtype=float)
    router = tokens * model.num_experts * 4 + tokens * model.experts_per_token * 12
    gemm_in = FP8_BYTES if fp8 else BF16_BYTES
    kept_act = 0.0 if norm_act else width * gemm_in  # fc2's input, dropped by "moe_act"
    kept_out = 0.0 if probs_in_experts else model.hidden * BF16_BYTES  # the expert output, for the probs' grad
    # the activation clamp (glu_clamp_s): the fused activation saves the clamped copy of fc1's output, which the
    # clamps' backward keeps as well; "moe_act" (the checkpoint keeps only its input) drops the copy
    clamped = 0.0 if norm_act or model.swiglu_limit is None else 2 * width * BF16_BYTES
    rows = routed * (model.hidden * gemm_in + kept_act + 2 * width * BF16_BYTES + kept_out + clamped)
    norm_out = T / np.where(np.asarray(sp, dtype=bool), tp, 1.0) * model.hidden * gemm_in
    return share * (router + rows - np.where(norm_act, norm_out, 0.0))


def dispatch_buffer_bytes(model: ModelConfig, routed):
    """Transient buffers of one dispatch/combine: send and receive rows, bf16, both directions."""
    return 4 * routed * model.hidden * BF16_BYTES * (model.moe_layers > 0)


def expert_memory_per_layer(model: ModelConfig, opts, tp, cp, dp, ep, etp, zero):
    """(weights, grads, optimizer) bytes per average layer per device for the routed experts, sharded over
    ep x etp and, by the ZeRO stage, over the expert-data-parallel group edp = tp*cp*dp/(ep*etp)."""
    params = expert_params_per_layer(model) / (np.asarray(ep, dtype=float) * etp)
    edp = edp_degree(tp, cp, dp, ep, etp)
    weights = params * WEIGHT_BYTES / np.where(zero == 3, edp, 1.0)
    grads = params * opts.grad_bytes / np.where(zero >= 2, edp, 1.0)
    optimizer = params * OPTIMIZER_BYTES / np.where(zero >= 1, edp, 1.0)
    return weights, grads, optimizer


def expert_data_parallel_s(model: ModelConfig, system: System, opts, *, tp, cp, dp, ep, etp, zero, kind, m,
                           stage_fwd, stage_bwd, layers, link_busy, pp=1.0, chunks=1.0):
    """(total, exposed, expert parameters on the device, edp shard degree) of the routed experts' gradient (and
    ZeRO/FSDP parameter) traffic per step over the edp group (stride ep x etp: the expert mesh is etp innermost,
    then ep), with plan.data_parallel's rules for the ZeRO stage. link_busy: the link time already taken
    out of that window (the dense part's DP traffic hidden in it, and the other traffic on the same links). pp, chunks: the stage's pipeline degree and model chunks
    (Megatron-Core buckets and dispatches the expert buffers per stage and chunk as the dense ones)."""
    edp = edp_degree(tp, cp, dp, ep, etp)
    # HSDP on experts: sharded inside a node as the dense part is, replicated across nodes
    shard = np.where(kind == 2, np.maximum(1.0, np.minimum(edp, system.devices_per_node / (ep * etp))), edp)
    params_dev = layers * expert_params_per_layer(model) / (ep * etp)
    # bucket_dp: Megatron-Core sizes the expert buffers' buckets with the one ddp_config.bucket_size, set from the
    # dense data-parallel group where the run leaves it unset (plan.data_parallel.default_bucket_bytes), not from edp
    total, exposed = _data_parallel_s(system, opts, params_dev, edp, shard, ep * etp, zero, kind, m, stage_fwd,
                                      stage_bwd, layers, 1.0, link_busy, pp=pp, chunks=chunks, bucket_dp=dp)
    return np.where(edp > 1, total, 0.0), np.where(edp > 1, exposed, 0.0), params_dev, shard


def memory_terms(model: ModelConfig, opts, *, T, tp, cp, dp, ep, etp, zero, rc, routed, sp=False) -> dict:
    """What plan.memory.memory_per_device adds per layer a rank holds (weights, grads, optimizer: the routed
    experts; activations: the MoE block's, per microbatch in flight, none kept under full recompute or with
    selective recompute of the MLP, Options.recompute_mlp) and once (the dispatch/combine buffers; when the block
    is recomputed, the one MoE block rebuilt during backward)."""
    weights, grads, optimizer = expert_memory_per_layer(model, opts, tp, cp, dp, ep, etp, zero)
    act = activation_bytes_per_layer(model, T, tp, ep, etp, routed, opts.fp8, sp=sp,
                                     probs_in_experts=opts.moe_probs_in_experts)
    rebuilt = (rc == 2) | ((rc == 1) & opts.recompute_mlp)
    if opts.recompute_norm_act:  # full recompute keeps none of it; otherwise the two modules' outputs are dropped
        act = np.where(rebuilt, act, activation_bytes_per_layer(
            model, T, tp, ep, etp, routed, opts.fp8, sp=sp, norm_act=True, probs_in_experts=opts.moe_probs_in_experts))
    once = dispatch_buffer_bytes(model, routed) + np.where(rebuilt, act, 0.0)
    return {"weights": weights, "grads": grads, "optimizer": optimizer,
            "activations": np.where(rebuilt, 0.0, act), "once": once,
            "share": model.moe_layers / model.layers}


def expert_axes(model: ModelConfig, arrays: tuple, ok):
    """The search grid (tp, pp, cp, dp first, then the other axes) with (ep, etp) added: a dense model gets
    ep = etp = 1; a MoE model every layout that passed (`ok`) once per (ep, etp) pair the expert-parallel rules
    allow (paratrain.config.rules, the trainer's too: ep a divisor of num_experts dividing tp*cp*dp/etp, etp 1
    or tp). Returns (*arrays, ep, etp, ok)."""
    if not model.num_experts:
        ones = np.ones(np.shape(arrays[0]), dtype=int)
        return (*arrays, ones, ones, ok)
    sel = np.nonzero(ok)[0]
    arrays = tuple(np.asarray(a)[sel] for a in arrays)
    tp, cp, dp = arrays[0], arrays[2], arrays[3]
    E = model.num_experts
    eps = np.array([e for e in range(1, E + 1) if E % e == 0])
    i, j, sharded = (a.ravel() for a in np.meshgrid(np.arange(sel.size), np.arange(eps.size), np.array([0, 1]),
                                                    indexing="ij"))
    ep = eps[j]
    etp = np.where(sharded == 1, tp[i], 1)
    # search policy: at tp = 1 the two etp choices are one layout (keep it once)
    valid = ((sharded == 0) | (tp[i] > 1)) & mask(expert_view(model, tp[i], cp[i], dp[i], ep, etp), groups=EXPERT)
    return (*(a[i] for a in arrays), ep, etp, valid)
