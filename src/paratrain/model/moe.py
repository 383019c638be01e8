"""Single-device mixture-of-experts feed-forward block in plain PyTorch (no parallel code here).

Layout (torchtitan's names): `router` (Linear hidden -> experts), `experts` (GroupedExperts: SwiGLU weights stacked
as (E, out, in) tensors w1 = gate, w3 = up, w2 = down, so a grouped matmul or expert parallelism slices dim 0),
optional `shared_experts` (one dense SwiGLU of width shared_experts * moe_ffn_hidden that every token passes).

Routing, per token (the three published variants):
- softmax (Mixtral, Qwen3-MoE): p = softmax(logits) over all experts, the top-k of p, renormalised to sum 1 when
  `router_norm_topk` (Mixtral always; Qwen3-MoE's norm_topk_prob).
- sigmoid (DeepSeek-V3): s = sigmoid(logits), the top-k of s, renormalised when `router_norm_topk`.
Capacity (Switch/GShard): with capacity_factor c, each expert takes at most ceil(c * T * k / E) of the T tokens'
assignments, earliest tokens first; a dropped assignment contributes nothing (the residual carries the token).
capacity_factor None = dropless.
Auxiliary load-balancing loss (Switch Transformer eq. 4, as transformers' `load_balancing_loss_func` computes it):
E * sum_e f_e * P_e, f_e = assignments to expert e / T, P_e = mean router probability of e (sigmoid scores are
normalised per token first). It is returned by `route`, kept on the module after each forward (`last_aux_loss`,
already times aux_loss_coef) and summed over layers by `Llama.aux_loss()` for the training loss to add.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.model.config import ModelConfig


@dataclass
class Routing:
    """What the router decided for T tokens: (T, k) expert ids and combine weights, (T, k) kept mask (False =
    dropped by capacity), the router probabilities (T, E) and the unscaled auxiliary loss."""

    experts: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor
    probs: torch.Tensor
    aux_loss: torch.Tensor


def capacity(tokens: int, cfg: ModelConfig) -> int | None:
    """Assignments one expert accepts from `tokens` tokens (None = dropless)."""
    if cfg.capacity_factor is None:
        return None
    return math.ceil(cfg.capacity_factor * tokens * cfg.experts_per_token / cfg.num_experts)


def route(logits: torch.Tensor, cfg: ModelConfig) -> Routing:
    """Top-k gating of router logits (T, E) (fp32 inside, as Megatron and DeepSeek compute the router)."""
    weights, experts, probs = gate(logits, cfg)
    n_exp = cfg.num_experts
    kept = within_capacity(experts, capacity(logits.shape[0], cfg), n_exp)
    tokens_per_expert = F.one_hot(experts, n_exp).float().sum((0, 1)) / logits.shape[0]
    aux = n_exp * (tokens_per_expert * probs.mean(0)).sum()
    return Routing(experts, weights, kept, probs, aux)


def gate(logits: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(T, k) combine weights and expert ids, (T, E) router probabilities of router logits (T, E), in fp32."""
    logits = logits.float()
    scores = logits.softmax(-1) if cfg.router_score == "softmax" else logits.sigmoid()
    weights, experts = scores.topk(cfg.experts_per_token, dim=-1)
    if cfg.router_norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    probs = scores if cfg.router_score == "softmax" else scores / scores.sum(-1, keepdim=True)
    return weights, experts, probs


def within_capacity(experts: torch.Tensor, cap: int | None, n_exp: int) -> torch.Tensor:
    """(T, k) bool: the assignment's position among its expert's assignments (token order, then slot) < cap."""
    if cap is None:
        return torch.ones_like(experts, dtype=torch.bool)
    one_hot = F.one_hot(experts.flatten(), n_exp)  # (T*k, E), token-major: earlier tokens first
    position = (one_hot.cumsum(0) - 1).gather(1, experts.flatten()[:, None]).view_as(experts)
    return position < cap


def sort_by_expert(routing: Routing, n_exp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kept assignments grouped by expert: (token index, flat (T*k) assignment index, counts per expert (E,))."""
    flat_experts = routing.experts.flatten()
    assignment = routing.kept.flatten().nonzero().squeeze(1)
    order = flat_experts[assignment].argsort(stable=True)
    assignment = assignment[order]
    counts = torch.bincount(flat_experts[assignment], minlength=n_exp)
    return assignment // routing.experts.shape[1], assignment, counts


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights: w1/w3 (E, ffn, hidden), w2 (E, hidden, ffn)."""

    def __init__(self, n_exp: int, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_exp, ffn, hidden))
        self.w3 = nn.Parameter(torch.empty(n_exp, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(n_exp, hidden, ffn))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x (N, hidden) grouped by expert, counts[e] rows for expert e -> (N, hidden)."""
        return grouped_swiglu(x, counts, self.w1, self.w3, self.w2)


def grouped_swiglu(x: torch.Tensor, counts: list[int], w1: torch.Tensor, w3: torch.Tensor,
                   w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU of each expert e over its counts[e] rows of x (grouped by expert). A loop of matmuls: the portable
    grouped matmul (torch._grouped_mm is CUDA-only and private in torch 2.13). Also run by expert parallelism on
    its local experts' (column/row slices of the) weights."""
    outs = []
    for e, rows in enumerate(x.split(counts)):
        outs.append((F.silu(rows @ w1[e].T) * (rows @ w3[e].T)) @ w2[e].T)
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


class MoE(nn.Module):
    """Router + routed experts (+ shared experts): the feed-forward of a MoE layer. x (b, s, h) -> (b, s, h)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        from paratrain.model.llama import FeedForward  # llama imports this module for its blocks

        if cfg.expert_bias:  # a planner-only shape (GPT-OSS): training it without the biases would be wrong
            raise ValueError("model.expert_bias=True: allowed: false (paratrain's MoE experts have no biases; "
                             "the field only tells the planner how a stack with expert biases runs)")
        if cfg.swiglu_limit is not None:  # planner-only (GPT-OSS): training an unclamped SwiGLU would be wrong
            raise ValueError(f"model.swiglu_limit={cfg.swiglu_limit}: allowed: unset (paratrain's experts run an "
                             "unclamped SwiGLU; the field only tells the planner how a stack with the clamp runs)")
        self.cfg = cfg
        self.router = nn.Linear(cfg.hidden, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden, cfg.moe_ffn)
        self.shared_experts = (FeedForward(cfg, cfg.shared_experts * cfg.moe_ffn) if cfg.shared_experts else None)
        self.last_aux_loss: torch.Tensor | None = None  # aux_loss_coef * aux loss of the latest forward
        self.last_routing: Routing | None = None  # the latest forward's routing
        self.router_stats: RouterStats | None = None  # summed over forwards since reset_router_stats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        routing = route(self.router(x), self.cfg)
        out = self.combine(x, routing, self.routed(x, routing))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        self.last_aux_loss = self.cfg.aux_loss_coef * routing.aux_loss
        self.record_routing(routing)
        return out.view(shape)

    def record_routing(self, routing: Routing) -> None:
        """Keep `routing` as last_routing and add it to router_stats (device ops only, no host sync). Not while
        backward recomputes this forward (activation recomputation): its tokens were counted when it first ran."""
        self.last_routing = routing
        if torch._C._current_graph_task_id() == -1:  # -1: not inside a backward pass (torch.utils.checkpoint's test)
            stats = routing_stats(routing, self.cfg.num_experts)
            self.router_stats = stats if self.router_stats is None else self.router_stats + stats

    def routed(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert outputs of the kept assignments, grouped by expert, and their flat assignment indices."""
        token, assignment, counts = sort_by_expert(routing, self.cfg.num_experts)
        return self.experts(x[token], counts.tolist()), assignment

    @staticmethod
    def combine(x: torch.Tensor, routing: Routing, routed: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Sum of weight * expert output per token (dropped assignments add nothing)."""
        y, assignment = routed
        w = routing.weights.flatten()[assignment].to(y.dtype)
        token = assignment // routing.experts.shape[1]
        # in the experts' output dtype (under bf16 autocast they compute bf16 from fp32 rows, as a dense MLP does)
        return torch.zeros_like(x, dtype=y.dtype).index_add_(0, token, y * w[:, None])


@dataclass
class RouterStats:
    """Router statistics of some tokens, additive (over microbatches, then over ranks): `counts` (E + 2,) int64 =
    kept assignments per expert, then dropped assignments, then tokens routed; `entropy_sum` 0-dim fp32 = the sum
    of the tokens' router entropies (nats; of the softmax probabilities, or of the normalised sigmoid scores)."""

    counts: torch.Tensor
    entropy_sum: torch.Tensor

    def __add__(self, other: RouterStats) -> RouterStats:
        return RouterStats(self.counts + other.counts, self.entropy_sum + other.entropy_sum)


def routing_stats(routing: Routing, n_exp: int) -> RouterStats:
    """The RouterStats of one routing, on its device without a host synchronisation (scatter_add, not a masked
    bincount, whose output size would be read on the host)."""
    kept = routing.kept.flatten()
    per_expert = torch.zeros(n_exp, dtype=torch.int64, device=kept.device)
    per_expert.scatter_add_(0, routing.experts.flatten(), kept.long())
    dropped = (~kept).sum().reshape(1)
    tokens = torch.full((1,), routing.experts.shape[0], dtype=torch.int64, device=kept.device)
    probs = routing.probs.detach().float()
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum()
    return RouterStats(torch.cat([per_expert, dropped, tokens]), entropy)


def metrics_of(counts: list[int], entropy_sum: float) -> dict[str, float | list[int]]:
    """Per-expert kept assignments, load imbalance (max / mean kept count), dropped assignments and the mean
    router entropy per token, from one layer's RouterStats (read on the host: counts as a list)."""
    per_expert, dropped, tokens = counts[:-2], counts[-2], counts[-1]
    mean = sum(per_expert) / len(per_expert)
    return {"tokens_per_expert": per_expert,
            "load_imbalance": max(per_expert) / mean if mean > 0 else 0.0,
            "dropped_tokens": dropped,
            "router_entropy": entropy_sum / tokens if tokens else 0.0}


def router_metrics(routing: Routing, n_exp: int) -> dict[str, float | list[int]]:
    """`metrics_of` one routing (a host synchronisation)."""
    stats = routing_stats(routing, n_exp)
    return metrics_of(stats.counts.tolist(), float(stats.entropy_sum))


def moe_layers(parts) -> dict[int, MoE]:
    """The MoE feed-forward of each layer the model parts hold, by its single-device layer number (pipeline
    stages keep the single-device keys of `layers`)."""
    return {int(key): block.feed_forward for part in parts for key, block in getattr(part, "layers", {}).items()
            if isinstance(getattr(block, "feed_forward", None), MoE)}


def reset_router_stats(parts) -> None:
    """Start a new count (the training loop calls it before each step)."""
    for moe in moe_layers(parts).values():
        moe.router_stats = None


def moe_metrics(parts, cfg: ModelConfig, reduce=None) -> dict[str, float | list[int]]:
    """Router metrics of the tokens counted since `reset_router_stats` (every microbatch of the step), over all
    ranks: each layer's RouterStats in its slot of one (cfg.layers, E + 2) int64 tensor and one (cfg.layers,) fp32
    tensor, zeros where this rank holds no such layer, summed by `reduce(tensor) -> tensor` (the runner's
    `reduce_layer_sums`: over the ranks that see other tokens and that hold other layers; None: this rank only).
    Then: assignment counts per expert summed over layers, the worst layer's load imbalance, dropped assignments
    summed, the per-token router entropy averaged over layers. Empty for a dense model. With a communicating
    `reduce` every rank must call it (a pipeline stage without MoE layers too); the one host synchronisation is
    reading the two reduced tensors."""
    if not cfg.num_experts:
        return {}
    layers = moe_layers(parts)
    device = next(p for part in parts for p in part.parameters()).device
    counts = torch.zeros(cfg.layers, cfg.num_experts + 2, dtype=torch.int64, device=device)
    entropy = torch.zeros(cfg.layers, dtype=torch.float32, device=device)
    for i, moe in layers.items():
        if moe.router_stats is not None:
            counts[i], entropy[i] = moe.router_stats.counts, moe.router_stats.entropy_sum
    if reduce is not None:
        counts, entropy = reduce(counts), reduce(entropy)
    per_layer = [metrics_of(c, e) for c, e in zip(counts.tolist(), entropy.tolist(), strict=True) if c[-1] > 0]
    if not per_layer:
        return {}
    return {"moe_tokens_per_expert": [sum(c) for c in zip(*(m["tokens_per_expert"] for m in per_layer), strict=True)],
            "moe_load_imbalance": max(m["load_imbalance"] for m in per_layer),
            "moe_dropped_tokens": sum(m["dropped_tokens"] for m in per_layer),
            "moe_router_entropy": sum(m["router_entropy"] for m in per_layer) / len(per_layer)}
