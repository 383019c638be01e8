"""Single-device Llama decoder in plain PyTorch (no parallel code here).

Module names follow Meta's/torchtitan's (tok_embeddings, layers.N.attention.wq, feed_forward.w1, ...), so the
tensor-parallel plans in `paratrain.parallel` and checkpoints map onto them by name. `layers` is a ModuleDict
keyed by the global layer index: a pipeline stage deletes the layers it does not own and keeps the names of
the rest, so checkpoints reshard across pipeline layouts by name.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.model.config import ModelConfig, RopeScaling
from paratrain.model.init import init_full_
from paratrain.model.moe import MoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (as Meta's reference does), return in the input dtype.
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def scale_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1's long-context scaling of RoPE frequencies (Meta's `apply_scaling`): low frequencies (long
    wavelengths) divided by `factor`, high ones kept, a smooth interpolation between."""
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = scaling.original_max_seq / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_seq / scaling.high_freq_factor
    smooth = (scaling.original_max_seq / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    return torch.where((wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen), interpolated, out)


def rope_tables(head_dim: int, max_seq: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables, (max_seq, head_dim/2). Real tables, not complex: DTensor and bf16 handle them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None:
        inv_freq = scale_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(max_seq, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) as Meta's complex formulation does. x: (b, s, heads, head_dim)."""
    x_even, x_odd = x.float()[..., 0::2], x.float()[..., 1::2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class CoreAttention(nn.Module):
    """softmax(QK^T/sqrt(d))V with a causal mask: the part selective recompute drops and context
    parallelism replaces. q: (b, heads, s, d); k, v: (b, kv_heads, s, d)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.shape[1] != q.shape[1]:  # grouped-query attention: share each kv head across its query group
            repeat = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)
        self.core = CoreAttention()
        # Qwen3: RMSNorm over each head's query/key before RoPE (None: Llama)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 = gate, w3 = up, w2 = down."""

    def __init__(self, cfg: ModelConfig, ffn: int | None = None):
        super().__init__()
        ffn = ffn or cfg.ffn
        self.w1 = nn.Linear(cfg.hidden, ffn, bias=False)
        self.w3 = nn.Linear(cfg.hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        # A mixture-of-experts layer keeps the name feed_forward (router, experts, shared_experts under it).
        self.feed_forward = MoE(cfg) if cfg.is_moe_layer(layer_id) else FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.arch != "llama":
            raise ValueError(f"model.arch='{cfg.arch}': the runtime trains arch='llama' only")
        if cfg.rope_yarn_factor is not None:  # planner-only (GPT-OSS): training without YaRN would be wrong
            raise ValueError(f"model.rope_yarn_factor={cfg.rope_yarn_factor}: allowed: unset (paratrain's RoPE has "
                             "no YaRN; the field only tells the planner how a stack runs it)")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.layers)})
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq, cfg.rope_theta, cfg.rope_scaling)
        # Non-persistent: derived from the config, so checkpoints and HF loading never carry them.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init (GPT-2/Megatron style: N(0, 0.02), residual outputs scaled by 1/sqrt(2L)).

        Each value depends on (seed, parameter name, index) only (`paratrain.model.init`), so a sharded
        layout that materialises its shards from the meta device gets exactly these weights.
        """
        init_full_(self, seed, self.cfg.layers)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """(Re)compute the RoPE tables on the buffers' device: after `to_empty` they hold garbage."""
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq, self.cfg.rope_theta, self.cfg.rope_scaling)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def positions_tables(self, seq: int, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if positions is None:
            return self.rope_cos[:seq], self.rope_sin[:seq]
        return self.rope_cos[positions], self.rope_sin[positions]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (b, s) int64 -> logits (b, s, vocab). A pipeline stage without the embedding takes
        hidden states (b, s, h) instead; one without the head returns hidden states.

        `positions` (s,) gives global token positions when a rank holds a slice of the sequence
        (context parallelism); by default positions are 0..s-1.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        # Tables stay fp32 (rotation is computed in fp32 even under bf16 autocast / FSDP mixed precision).
        cos, sin = self.positions_tables(tokens.shape[1], positions)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the MoE layers' load-balancing losses (already times aux_loss_coef) of the latest forward, for the
    training loss to add; None for a dense model."""
    losses = [m.last_aux_loss for m in model.modules() if isinstance(m, MoE) and m.last_aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
