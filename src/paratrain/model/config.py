"""Model shapes: the presets with their published shapes, and the parameter / FLOP arithmetic.

A `ModelConfig` describes a decoder without allocating any weights, so the planner can reason about
a 405B model on a laptop. The runtime builds `paratrain.model.llama.Llama` from the same object.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RopeScaling(BaseModel):
    """Llama 3.1's RoPE frequency scaling ("rope_type": "llama3" in Hugging Face configs): wavelengths longer
    than original_max_seq / low_freq_factor are stretched by `factor`, shorter than original_max_seq /
    high_freq_factor kept, and those between interpolated smoothly. Source: Meta's llama-models
    reference (`apply_scaling` in llama3.1's model.py) and the released Llama 3.1 config.json files."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    factor: float = Field(gt=0)
    low_freq_factor: float = Field(default=1.0, gt=0)
    high_freq_factor: float = Field(default=4.0, gt=0)
    original_max_seq: int = Field(default=8192, gt=0)

    @model_validator(mode="after")
    def _check(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
                             f"low_freq_factor={self.low_freq_factor}")
        return self


class MLA(BaseModel):
    """Multi-head latent attention's shape (DeepSeek-AI 2024, DeepSeek-V3 Technical Report sec. 2.1.1, eq. 1-11;
    deepseek-ai/DeepSeek-V3 config.json q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
    v_head_dim). Per layer: the queries come from a down-projection to q_lora_rank (RMSNorm) and an up-projection to
    heads x (nope + rope); the keys' and values' shared latent from a down-projection to kv_lora_rank (RMSNorm), plus
    one rope-dim key shared by every head, and an up-projection to heads x (nope + v). RoPE on the rope-dim part only;
    the attention core runs at q/k head dim nope + rope and v head dim v; the output projection reads heads x v.
    Shape only, for the planner: paratrain's trainer has no MLA and refuses such a model (config.rules model_mla)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    q_lora_rank: int | None = Field(default=None, gt=0)  # None: one plain query projection (DeepSeek-V2-Lite)
    kv_lora_rank: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Elements per token and layer an inference engine caches: the compressed latent and the decoupled RoPE key,
        shared by every head (report sec. 2.1.1: "only the blue-boxed vectors need to be cached")."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def latent_params(self, hidden: int) -> int:
        """The down-projections every head shares (hidden -> q_lora_rank, hidden -> kv_lora_rank + rope) and their
        RMSNorms: not split by heads (inference engines replicate them on every TP rank)."""
        q = 0 if self.q_lora_rank is None else hidden * self.q_lora_rank + self.q_lora_rank
        return q + hidden * self.cache_dim + self.kv_lora_rank

    def attention_params(self, hidden: int, heads: int) -> int:
        """Weights of one MLA block: down/up projections, their two RMSNorms and the output projection."""
        q_width = heads * self.qk_head_dim
        q_up = hidden * q_width if self.q_lora_rank is None else self.q_lora_rank * q_width
        kv_up = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return self.latent_params(hidden) + q_up + kv_up + heads * self.v_head_dim * hidden


class ModelConfig(BaseModel):
    """Shape of a decoder-only transformer.

    arch="llama": RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP (3 matrices of ffn_hidden).
    arch="gpt": LayerNorm, learned positions, multi-head attention, GeLU MLP (2 matrices of ffn_hidden, 4h),
    biases everywhere (Megatron GPT-3 shapes used by the published A100 measurements).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "custom"
    arch: Literal["llama", "gpt"] = "llama"
    layers: int = Field(gt=0)
    hidden: int = Field(gt=0)
    heads: int = Field(gt=0)
    kv_heads: int | None = Field(default=None, gt=0)
    ffn_hidden: int | None = Field(default=None, gt=0)
    vocab: int = Field(gt=0)
    max_seq: int = Field(default=4096, gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)
    norm_eps: float = Field(default=1e-5, gt=0)
    tie_embeddings: bool = False
    rope_scaling: RopeScaling | None = None  # Llama 3.1-style long-context frequency scaling; None = plain RoPE
    head_dim_override: int | None = Field(default=None, gt=0)  # per-head width when not hidden / heads (Qwen3)
    qk_norm: bool = False  # RMSNorm of each query/key head before RoPE (Qwen3)
    # ---- mixture of experts (paratrain.model.moe); num_experts = 0: every layer is dense ------------------------
    num_experts: int = Field(default=0, ge=0)  # routed experts per MoE layer
    experts_per_token: int = Field(default=2, gt=0)  # top-k
    moe_ffn_hidden: int | None = Field(default=None, gt=0)  # SwiGLU width of one expert (default ffn_hidden)
    shared_experts: int = Field(default=0, ge=0)  # always-on experts (DeepSeek-V3: 1), one SwiGLU of n * width
    first_dense_layers: int = Field(default=0, ge=0)  # layers 0..n-1 keep the dense FFN (DeepSeek-V3: 3)
    router_score: Literal["softmax", "sigmoid"] = "softmax"  # Mixtral/Qwen3: softmax; DeepSeek-V3: sigmoid
    router_norm_topk: bool = True  # renormalise the top-k weights to sum 1 (Mixtral; Qwen3 norm_topk_prob)
    capacity_factor: float | None = Field(default=None, gt=0)  # None = dropless; else per-expert cap c*T*k/E
    aux_loss_coef: float = Field(default=0.01, ge=0)  # load-balancing loss weight (Switch Transformer: 0.01)
    # group-limited (DeepSeek-V3: "node-limited") routing: the routed experts split into router_groups contiguous
    # groups, each token's top-k taken inside its router_group_topk best groups (config.json n_group / topk_group;
    # Megatron-Core moe_router_num_groups / moe_router_group_topk, moe_utils.group_limited_topk). 1 / 1: plain
    # top-k. Shape only, for the planner (plan.moe.node_hit_fraction: the nodes a token's dispatch reaches); the
    # trainer's router takes a plain top-k and refuses router_groups > 1 (rules model_router_groups)
    router_groups: int = Field(default=1, gt=0)
    router_group_topk: int = Field(default=1, gt=0)
    # routed experts with biases on their two linear layers (GPT-OSS: gate_up_proj_bias, down_proj_bias). Shape only:
    # the planner times how Megatron-Core applies them (plan.moe.expert_bias_s); paratrain's MoE block has none and
    # refuses such a config (model.moe.MoEBlock)
    expert_bias: bool = False
    # YaRN context extension factor (GPT-OSS: rope_scaling {"rope_type": "yarn", "factor": 32}): shape only, for the
    # planner, whose cost is how Megatron-Core runs RoPE with YaRN's attention factor (plan.layer.unfused_rope_s);
    # paratrain's RoPE has no YaRN and refuses such a config (model.llama.Llama)
    rope_yarn_factor: float | None = Field(default=None, gt=1)
    # clamp of the routed experts' gated activation (GPT-OSS config.json swiglu_limit 7: the gate half clamped from
    # above, the linear half to [-limit, limit]): shape only, for the planner, whose cost is how Megatron-Core
    # clamps in eager PyTorch ahead of its fused activation (plan.moe.glu_clamp_s); paratrain's experts run a
    # plain SwiGLU and refuse such a config (model.moe.MoE)
    swiglu_limit: float | None = Field(default=None, gt=0)
    # multi-head latent attention in place of (grouped-query) attention (DeepSeek-V3); None = plain attention. Shape
    # only, for the planner (plan.layer times it as Megatron-Core runs it); the trainer refuses it (rules model_mla)
    mla: MLA | None = None
    # multi-token prediction depths (DeepSeek-V3 report sec. 2.2; config.json num_nextn_predict_layers; Megatron-Core
    # mtp_num_layers): each adds one transformer block (the decoder's last layer's kind), two RMSNorms and a 2h -> h
    # projection, sharing the embedding and the output head, with a loss of its own. Not in num_params /
    # active_params (the report's 671B / 37B exclude them: mtp_params); the planner times and sizes them on the
    # last pipeline stage; the trainer refuses mtp_layers > 0 (rules model_mtp)
    mtp_layers: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        kv = self.kv_heads if self.kv_heads is not None else self.heads
        if self.head_dim_override is None and self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be divisible by heads={self.heads}")
        if self.heads % kv:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={kv}")
        if self.arch == "gpt" and kv != self.heads:
            raise ValueError("arch='gpt' uses multi-head attention: kv_heads must equal heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim}: rotary embeddings need an even head_dim")
        if self.num_experts:
            self._check_moe()
        return self

    def _check_moe(self) -> None:
        checks = [
            ("arch", self.arch, self.arch == "llama", "'llama' (MoE layers are SwiGLU experts)"),
            ("experts_per_token", self.experts_per_token, self.experts_per_token <= self.num_experts,
             f"1..num_experts={self.num_experts}"),
            ("first_dense_layers", self.first_dense_layers, self.first_dense_layers < self.layers,
             f"0..layers-1={self.layers - 1} (at least one MoE layer)"),
            ("router_groups", self.router_groups, self.num_experts % self.router_groups == 0,
             f"a divisor of num_experts={self.num_experts}"),
            ("router_group_topk", self.router_group_topk, self.router_group_topk <= self.router_groups and
             self.experts_per_token <= self.router_group_topk * self.num_experts // self.router_groups,
             f"1..router_groups={self.router_groups}, their experts holding experts_per_token"),
        ]
        for name, value, ok, allowed in checks:
            if not ok:
                raise ValueError(f"model.{name}={value!r} with num_experts={self.num_experts}: allowed: {allowed}")

    # ---- derived shapes -------------------------------------------------------------------------
    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden // self.heads

    @property
    def rope_attention_factor(self) -> float:
        """YaRN's attention (concentration) factor on cos/sin: 0.1 ln(factor) + 1 (Peng et al. 2023, YaRN eq. 22;
        Megatron-Core yarn_rotary_pos_embedding._yarn_get_mscale with mscale unset, as GPT-OSS); 1 without YaRN."""
        return 0.1 * math.log(self.rope_yarn_factor) + 1.0 if self.rope_yarn_factor else 1.0

    @property
    def moe_ffn(self) -> int:
        return self.moe_ffn_hidden or self.ffn

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.first_dense_layers

    @property
    def moe_layers(self) -> int:
        return self.layers - self.first_dense_layers if self.num_experts else 0

    @property
    def ffn(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return 4 * self.hidden if self.arch == "gpt" else _llama_ffn(self.hidden)

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    # ---- parameter counts ---------------------------------------------------------------------------
    def params_per_layer(self) -> int:
        """A dense layer (MoE layers: `moe_layer_params`)."""
        h, f, kv, q = self.hidden, self.ffn, self.kv_dim, self.heads * self.head_dim
        attn = 2 * h * q + 2 * h * kv  # q, k, v, o
        if self.mla is not None:
            attn = self.mla.attention_params(h, self.heads)
        if self.arch == "llama":
            qk_norm = 2 * self.head_dim if self.qk_norm else 0
            return attn + 3 * h * f + 2 * h + qk_norm  # gate, up, down; two RMSNorm weights (+ q/k norms)
        # gpt: biases on qkv/o/fc1/fc2, two LayerNorms with weight and bias
        return attn + (h + 2 * kv + h) + 2 * h * f + f + h + 4 * h

    def embedding_params(self) -> int:
        pos = self.max_seq * self.hidden if self.arch == "gpt" else 0
        return self.vocab * self.hidden + pos

    def head_params(self) -> int:
        """Final norm plus the output projection (zero extra if tied to the embedding)."""
        norm = self.hidden if self.arch == "llama" else 2 * self.hidden
        return norm + (0 if self.tie_embeddings else self.vocab * self.hidden)

    def moe_layer_params(self, active: bool = False) -> int:
        """A MoE layer: the dense layer with its FFN replaced by router + experts (+ shared experts); `active`:
        only the top-k routed experts one token passes through."""
        h, fm = self.hidden, self.moe_ffn
        routed = self.experts_per_token if active else self.num_experts
        return (self.params_per_layer() - 3 * h * self.ffn + h * self.num_experts
                + (routed + self.shared_experts) * 3 * h * fm)

    def layer_params(self, active: bool = False) -> int:
        """All transformer layers together."""
        dense = self.layers - self.moe_layers
        return dense * self.params_per_layer() + self.moe_layers * self.moe_layer_params(active)

    def num_params(self) -> int:
        """The main model (the multi-token-prediction modules apart: mtp_params)."""
        return self.embedding_params() + self.layer_params() + self.head_params()

    def mtp_layer_params(self) -> int:
        """Parameters of one multi-token-prediction depth that are its own (the embedding and output head are the
        main model's): its transformer block (a MoE layer where the decoder's last layer is one: Megatron-Core builds
        it from the decoder's layer spec), the RMSNorms of the hidden state and of the embedding, the 2h -> h
        projection of their concatenation and the final RMSNorm before the shared head (DeepSeek-V3 report sec.
        2.2, eq. 21; Megatron-Core MultiTokenPredictionLayer enorm, hnorm, eh_proj, final_layernorm)."""
        block = self.moe_layer_params() if self.is_moe_layer(self.layers - 1) else self.params_per_layer()
        return block + self.mtp_glue_params()

    def mtp_glue_params(self) -> int:
        """What one multi-token-prediction depth adds around its block: the 2h -> h eh_proj and three RMSNorms
        (enorm, hnorm, final_layernorm)."""
        h = self.hidden
        return 2 * h * h + 3 * h

    def mtp_params(self) -> int:
        return self.mtp_layers * self.mtp_layer_params()

    def active_params(self) -> int:
        """Parameters one token uses (MoE: top-k routed experts only); = num_params for a dense model."""
        return self.embedding_params() + self.layer_params(active=True) + self.head_params()

    def num_matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (what the 6N rule counts): no embedding lookup;
        a MoE layer counts its active experts."""
        return self.layer_params(active=True) + self.vocab * self.hidden

    def attention_width(self) -> float:
        """Per token and layer, the mean of the attention core's query/key width and its value width, the `h` of
        the 2 x 2 x s x h attention FLOP count (QK^T over the q/k width, AV over the v width): the hidden size, the
        convention for plain attention; MLA: heads x (qk_head_dim + v_head_dim) / 2 (DeepSeek-V3: 128 x 160)."""
        if self.mla is None:
            return float(self.hidden)
        return self.heads * (self.mla.qk_head_dim + self.mla.v_head_dim) / 2.0

    # ---- FLOPs ------------------------------------------------------------------------------------
    def forward_flops_per_token(self, seq: int) -> float:
        """Model FLOPs of one forward pass per token: 2 per matmul weight, plus causal-free attention.

        Attention scores and the weighted sum cost 2 * 2 * seq * attention_width per layer per token (counted
        for the full, unmasked square, the convention of Narayanan et al. 2021 and PaLM's MFU). The
        multi-token-prediction modules are not counted (DeepSeek-V3's 37B active exclude them).
        """
        return 2.0 * self.num_matmul_params() + 4.0 * self.layers * seq * self.attention_width()

    def train_flops_per_token(self, seq: int) -> float:
        """Forward + backward (backward = 2x forward): the denominator-free numerator of MFU."""
        return 3.0 * self.forward_flops_per_token(seq)


def _llama_ffn(hidden: int, multiple_of: int = 256) -> int:
    """Meta's Llama rule: 2/3 of 4h, rounded up to a multiple of 256."""
    f = int(2 * 4 * hidden / 3)
    return multiple_of * ((f + multiple_of - 1) // multiple_of)


# Published shapes. Sources: Touvron et al. 2023 "Llama 2" Table 1 and the released config.json files;
# Dubey et al. 2024 "The Llama 3 Herd of Models" Table 3 and config.json (ffn, vocab 128256, rope 500000;
# Llama 3.1: rope_scaling factor 8, low/high_freq_factor 1/4, original_max_position_embeddings 8192).
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(name="tiny", layers=4, hidden=128, heads=4, kv_heads=2, ffn_hidden=352,
                        vocab=4096, max_seq=512),
    "small": ModelConfig(name="small", layers=8, hidden=256, heads=8, kv_heads=4, ffn_hidden=688,
                         vocab=4096, max_seq=1024),
    "llama2-7b": ModelConfig(name="llama2-7b", layers=32, hidden=4096, heads=32, kv_heads=32,
                             ffn_hidden=11008, vocab=32000, max_seq=4096),
    "llama2-13b": ModelConfig(name="llama2-13b", layers=40, hidden=5120, heads=40, kv_heads=40,
                              ffn_hidden=13824, vocab=32000, max_seq=4096),
    "llama2-70b": ModelConfig(name="llama2-70b", layers=80, hidden=8192, heads=64, kv_heads=8,
                              ffn_hidden=28672, vocab=32000, max_seq=4096),
    "llama3-8b": ModelConfig(name="llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=8,
                             ffn_hidden=14336, vocab=128256, max_seq=8192, rope_theta=500000.0),
    "llama3-70b": ModelConfig(name="llama3-70b", layers=80, hidden=8192, heads=64, kv_heads=8,
                              ffn_hidden=28672, vocab=128256, max_seq=8192, rope_theta=500000.0),
    # Llama 3.2 3B: Meta's released config.json (meta-llama/Llama-3.2-3B, Sept 2024): tied embeddings, rope_scaling
    # factor 32, low/high_freq_factor 1/4, original_max_position_embeddings 8192; 3.21B parameters.
    "llama3.2-3b": ModelConfig(name="llama3.2-3b", layers=28, hidden=3072, heads=24, kv_heads=8, ffn_hidden=8192,
                               vocab=128256, max_seq=131072, rope_theta=500000.0, tie_embeddings=True,
                               rope_scaling=RopeScaling(factor=32.0)),
    # ---- mixtures of experts (paratrain.model.moe) ----
    "tiny-moe": ModelConfig(name="tiny-moe", layers=4, hidden=128, heads=4, kv_heads=2, ffn_hidden=352, vocab=4096,
                            max_seq=512, num_experts=8, experts_per_token=2, moe_ffn_hidden=96, shared_experts=1,
                            first_dense_layers=1),
    # Mixtral 8x7B: Jiang et al. 2024 "Mixtral of Experts" Table 1 and mistralai/Mixtral-8x7B-v0.1 config.json
    # (router_aux_loss_coef 0.02); 46.7B parameters, 12.9B active (the model card / paper: "47B", "13B").
    "mixtral-8x7b": ModelConfig(name="mixtral-8x7b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
                                vocab=32000, max_seq=32768, rope_theta=1e6, num_experts=8, experts_per_token=2,
                                aux_loss_coef=0.02),
    # Qwen3-30B-A3B: Qwen/Qwen3-30B-A3B config.json (head_dim 128, moe_intermediate_size 768, 128 experts, top 8,
    # norm_topk_prob true, router_aux_loss_coef 0.001) and the Qwen3 technical report (Yang et al. 2025, Table 2):
    # 30.5B parameters, 3.3B active.
    "qwen3-30b-a3b": ModelConfig(name="qwen3-30b-a3b", layers=48, hidden=2048, heads=32, kv_heads=4,
                                 head_dim_override=128, ffn_hidden=6144, vocab=151936, max_seq=40960,
                                 rope_theta=1e6, norm_eps=1e-6, num_experts=128, experts_per_token=8,
                                 moe_ffn_hidden=768, aux_loss_coef=0.001, qk_norm=True),
    # DeepSeek-V3-shaped: DeepSeek-AI 2024 "DeepSeek-V3 Technical Report" sec. 4.2 and deepseek-ai/DeepSeek-V3
    # config.json: 61 layers, hidden 7168, 3 dense first layers (ffn 18432), 256 routed experts of 2048, top 8,
    # 1 shared, sigmoid scores, node-limited routing (n_group 8, topk_group 4: report sec. 2.1.2, "each token will be
    # sent to at most M = 4 nodes"); multi-head latent attention (q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128,
    # qk_rope_head_dim 64, v_head_dim 128: 187.1M a layer) and one multi-token-prediction depth
    # (num_nextn_predict_layers 1; report sec. 2.2 and 4.2: D = 1 in training). 671.0B parameters, 37.5B active
    # (the report's 671B / 37B); the MTP module's own 11.6B apart (with the checkpoint's copies of the embedding and
    # the head: its 14B, 684.5B in all). YaRN's mscale folds into MLA's softmax scale (Megatron-Core), not into RoPE.
    "deepseek-v3": ModelConfig(name="deepseek-v3", layers=61, hidden=7168, heads=128, kv_heads=128, ffn_hidden=18432,
                               vocab=129280, max_seq=163840, norm_eps=1e-6, num_experts=256, experts_per_token=8,
                               moe_ffn_hidden=2048, shared_experts=1, first_dense_layers=3, router_score="sigmoid",
                               aux_loss_coef=0.0001, mtp_layers=1, router_groups=8, router_group_topk=4,
                               mla=MLA(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                       v_head_dim=128)),
    "llama3.1-405b": ModelConfig(name="llama3.1-405b", layers=126, hidden=16384, heads=128, kv_heads=8,
                                 ffn_hidden=53248, vocab=128256, max_seq=131072, rope_theta=500000.0,
                                 rope_scaling=RopeScaling(factor=8.0)),
}


def gpt_config(name: str, layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048) -> ModelConfig:
    """A Megatron GPT shape (the one used by Narayanan et al. 2021 and Korthikanti et al. 2022)."""
    return ModelConfig(name=name, arch="gpt", layers=layers, hidden=hidden, heads=heads, vocab=vocab,
                       max_seq=seq)


def load_model_config(spec: str | Path) -> ModelConfig:
    """A preset name, or a TOML file with arch/layers/hidden/heads/kv_heads/ffn_hidden/vocab.

    The TOML may hold the keys at top level or under a [model] table.
    """
    key = str(spec)
    if key in PRESETS:
        return PRESETS[key]
    path = Path(key)
    if not path.is_file():
        raise ValueError(f"model '{key}': not a preset ({', '.join(PRESETS)}) and no such TOML file")
    with path.open("rb") as fh:
        data = tomllib.load(fh)
    data = data.get("model", data)
    data.setdefault("name", path.stem)
    return ModelConfig(**data)
