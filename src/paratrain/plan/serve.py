"""The serving model: prefill and decode time, KV-cache memory, capacity, latency and replica search.

Torch-free and element-wise on numpy arrays (batch and context may be arrays), like the training model, whose
roofline and collective functions it reuses (plan/kernels.py, plan/collectives.py). docs/serving.md writes the
formulas up; in short, per replica of tp x pp devices (one pipeline stage per pp rank):

- prefill of n prompts of s tokens: compute-bound. Matmul FLOPs 2 x (matmul parameters) per token plus causal
  attention 2 s^2 h per layer per prompt (unfused stacks compute the whole square and write the scores),
  at prefill_flops_eff of the dense peak of the compute precision, in a soft roofline with the weight read;
  two all-reduces of the activations per layer over the TP group.
- one decode step for b sequences holding c tokens each: memory-bound. The weights (at their precision) are
  streamed once per step at decode_bw_eff of HBM bandwidth, every sequence's KV cache (c tokens, the kv heads
  this device holds) at kv_bw_eff; FLOPs 2 x parameters x b; two latency-bound all-reduces per layer (the
  link's ring-step latency plus the serving stack's collective_us per call), layer_overhead_s per layer.
- pipeline parallelism: b sequences in pp microbatches; a token passes all pp stages (ITL = pp stage times
  plus the hand-offs), each stage holds 1/pp of the layers.
- KV cache: 2 x layers x kv_heads x head_dim x bytes per token, paged in blocks (vLLM's 16 tokens); with
  tp > kv_heads each device keeps one kv head (replicated, as vLLM and NxD Inference do). Multi-head latent
  attention (model.mla, DeepSeek-V3): layers x (kv_lora_rank + qk_rope_head_dim) x bytes, the same on every TP
  rank; decode attention in the absorbed form, prefill in the expanded one (attention_head_dim).
- speculative decoding (optional): k draft tokens per step accepted with probability a each: (1-a^(k+1))/(1-a)
  tokens per target verification (Leviathan et al. 2023, eq. 1) for k draft steps plus one target step over
  k + 1 tokens.

The efficiency parameters live in plan/serving_efficiency.toml per serving stack (by default the chip
vendor's current engines), fitted on named calibration rows (benchmarks/serving_accuracy.py), never per
workload.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from paratrain.config.options import described
from paratrain.hardware.catalog import System, Tier, resolve_system
from paratrain.model.config import ModelConfig, load_model_config
from paratrain.plan.collectives import collective_time_s, p2p_time_s
from paratrain.plan.kernels import soft_roofline
from paratrain.plan.precision import BF16_BYTES

# A serving model TOML may name its experts as earlier versions of this module did; they are the training
# schema's fields (model.config: num_experts, moe_ffn_hidden), the one MoE description both planners read.
SERVING_MOE_KEYS = {"experts": "num_experts", "expert_ffn": "moe_ffn_hidden"}


def load_serving_model(spec: str | Path | ModelConfig) -> ModelConfig:
    """A preset (model.config: dense Llamas and the MoE presets, mixtral-8x7b among them) or a model TOML; a TOML
    with `experts` / `expert_ffn` (this module's older names) reads them as num_experts / moe_ffn_hidden."""
    if isinstance(spec, ModelConfig):
        return spec
    key = str(spec)
    if key.endswith(".toml") and Path(key).is_file():
        with open(key, "rb") as fh:
            data = tomllib.load(fh)
        data = data.get("model", data)
        if any(old in data for old in SERVING_MOE_KEYS):
            data = {SERVING_MOE_KEYS.get(k, k): v for k, v in data.items()}
            data.setdefault("name", Path(key).stem)
            return ModelConfig(**data)
    return load_model_config(spec)


def _is_moe(model: ModelConfig) -> bool:
    return model.num_experts > 0


def _layer_params(model: ModelConfig, active: bool = False) -> float:
    """Parameters of an average layer: all of them (what a device holds) or, `active`, what one token multiplies
    with; a MoE model's dense first layers, shared experts and router counted by ModelConfig.layer_params."""
    return model.layer_params(active) / model.layers if _is_moe(model) else model.params_per_layer()


def _routed_expert_params(model: ModelConfig) -> float:
    """One routed expert's parameters, times the share of layers that have experts (an average layer)."""
    return 3 * model.hidden * model.moe_ffn * model.moe_layers / model.layers


# bytes per weight element; int4 weight-only carries one fp16 scale per group of 128 (AWQ/GPTQ's default).
# fp32: what paratrain's own runtime generates in on a CPU host (its peak is what `paratrain probe` measured).
WEIGHT_PRECISIONS = {"bf16": 2.0, "fp8": 1.0, "int8": 1.0 + 2 / 128, "int4": 0.5 + 2 / 128, "fp32": 4.0}
KV_PRECISIONS = {"bf16": 2.0, "fp8": 1.0, "int8": 1.0, "fp32": 4.0}
PAGE_TOKENS = 16  # vLLM's default KV block size (--block-size 16)
MEMORY_UTILIZATION = 0.9  # share of device memory the engine takes (vLLM gpu_memory_utilization default)
EFFICIENCY_FILE = Path(__file__).with_name("serving_efficiency.toml")
EFFICIENCY_FIELDS = ("decode_bw_eff", "kv_bw_eff", "prefill_flops_eff", "layer_overhead_s", "collective_us")
# Fitted only where a stack's calibration rows name it (benchmarks/serving_accuracy.py INHERITS), 0 elsewhere:
# host time per engine step the device waits for (vLLM's V0 engine loop: scheduling, input preparation and
# output processing in Python between CUDA-graph replays; the vLLM v0.6.0 blog profiles Llama 3 8B on one H100
# at 38% GPU time, the rest on the CPU side). Engines with a C++ runtime or an overlapped scheduler: 0.
HOST_FIELDS = ("host_step_s",)
# shard: tp divides the query heads, each device keeps max(kv_heads / tp, 1) kv heads (vLLM, TensorRT-LLM, NxD
# Inference). pad: transformers-neuronx (2.18, decoder.py DecoderLayer.to_neuron and the GQA checks of
# DecoderLmHeadForSamplingNoEmbedding): query heads padded with zeros up to a multiple of tp (Llama-2-13B's 40
# heads at tp 32 run as 64), an MHA model's K/V padded with them, and a GQA model whose kv heads tp does not
# divide has K/V replicated to one per query head (GQA.REPLICATED_HEADS).
HEAD_LAYOUTS = ("shard", "pad")
# grouped: the decode kernel loads each kv head once for its group of query heads (vLLM's paged attention,
# TensorRT-LLM's XQA, NxD Inference). per_query_head: every query head's thread block loads its group's K/V
# itself, so the kernel moves (and takes the time of) an MHA cache: TensorRT-LLM's masked MHA kernel before
# XQA (XQA reached Hopper Llama-2-70B in TensorRT-LLM v0.10.0, its release notes).
GQA_DECODE = ("grouped", "per_query_head")
MIN_TOKEN_BUCKET = 128  # transformers-neuronx token buckets: powers of two from 128 (bucket.token_sizes)


@dataclass(frozen=True)
class ServingEfficiency:
    """Achieved fractions of the chip's peaks and fixed costs of a serving stack (see serving_efficiency.toml)."""

    decode_bw_eff: float
    kv_bw_eff: float
    prefill_flops_eff: float
    layer_overhead_s: float
    collective_us: float
    source: str = ""
    attention: str = "flash"  # the stack's prefill attention: "flash" (fused, causal half) or "unfused"
    head_layout: str = "shard"  # how the stack spreads attention heads over tp: HEAD_LAYOUTS
    buckets: bool = False  # static shapes: prompts and the attended KV padded to power-of-two buckets
    gqa_decode: str = "grouped"  # how the decode attention kernel reads a GQA cache: GQA_DECODE
    host_step_s: float = 0.0  # host time per engine step not overlapped with the device (HOST_FIELDS)

    def __post_init__(self) -> None:
        if self.attention not in ("flash", "unfused"):
            raise ValueError(f"attention = {self.attention!r}: allowed: flash, unfused")
        if self.head_layout not in HEAD_LAYOUTS:
            raise ValueError(f"head_layout = {self.head_layout!r}: allowed: {', '.join(HEAD_LAYOUTS)}")
        if self.gqa_decode not in GQA_DECODE:
            raise ValueError(f"gqa_decode = {self.gqa_decode!r}: allowed: {', '.join(GQA_DECODE)}")
        for name in ("decode_bw_eff", "kv_bw_eff", "prefill_flops_eff"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} = {getattr(self, name)}: must be in (0, 1]")
        for name in ("layer_overhead_s", "collective_us", "host_step_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} = {getattr(self, name)}: must be >= 0")


@lru_cache(maxsize=8)
def _read_tables(path: str, mtime_ns: int) -> dict[str, ServingEfficiency]:
    """Memoised on the file and its modification time (a rewritten file is read again)."""
    with open(path, "rb") as fh:
        raw = tomllib.load(fh)
    return {family: ServingEfficiency(**table) for family, table in raw.items()}


def efficiency_tables(path: Path | None = None) -> dict[str, ServingEfficiency]:
    """Every serving stack's table in serving_efficiency.toml (or `path`)."""
    path = Path(path or EFFICIENCY_FILE)
    return _read_tables(str(path), path.stat().st_mtime_ns)


def serving_stacks(path: Path | None = None) -> tuple[str, ...]:
    """The serving-stack tables there are (serving_efficiency.toml)."""
    return tuple(efficiency_tables(path))


def serving_efficiency(system: System, stack: str | None = None, path: Path | None = None) -> ServingEfficiency:
    """The parameters of a serving stack: `stack` names a table (serving_stacks()); by default the table
    named after the chip's vendor (today's engines there). A system whose hardware file has its own
    [systems.X.serving] table (`paratrain calibrate` on `paratrain generate` runs measured there) uses that
    one. Chips with no table (a probed local host) fall back to their training efficiency: the same physics,
    uncalibrated for serving."""
    tables = efficiency_tables(path)
    if stack is not None:
        if stack not in tables:
            raise ValueError(f"stack = {stack!r}: allowed: {', '.join(tables)}")
        return tables[stack]
    if system.serving:
        return ServingEfficiency(**dict(system.serving))
    if system.chip.vendor in tables:
        return tables[system.chip.vendor]
    eff = system.chip.efficiency
    return ServingEfficiency(decode_bw_eff=eff.memory_bw_eff, kv_bw_eff=eff.memory_bw_eff,
                             prefill_flops_eff=eff.matmul_eff_max, layer_overhead_s=8 * eff.kernel_overhead_s,
                             collective_us=0.0, source=f"no serving table for vendor {system.chip.vendor!r}: "
                             "the chip's training efficiency (uncalibrated for serving)",
                             attention=system.stack.attention if system.stack is not None else "flash")


@dataclass(frozen=True)
class Replica:
    """One serving replica: tp x pp devices, weight / KV-cache precision, optional speculative decoding (each
    field's help is its `paratrain serve` option's).

    ep (mixture-of-experts models): the experts of a layer are spread whole over ep of the stage's tp devices
    (expert parallelism; ep must divide tp and the experts), each token's hidden state sent to the devices of
    its experts and back (two all-to-alls per layer); ep = 1 splits every expert over the tp devices like a
    dense MLP (one all-reduce).

    spec_tokens: draft tokens per step (0 = off); spec_accept: probability each is accepted; draft: the
    draft model (a preset name or ModelConfig), run on the same devices with the same tp."""

    tp: int = described("tensor parallel degree of a replica", 1)
    pp: int = described("pipeline parallel degree of a replica", 1)
    ep: int = described("expert parallel degree (mixture-of-experts models; divides tp)", 1)
    weights: str = described("weight precision: bf16, fp8, int8, int4 (weight-only)", "bf16")
    kv: str = described("KV-cache precision: bf16, fp8, int8", "bf16")
    spec_tokens: int = described("speculative decoding: draft tokens per step", 0)
    spec_accept: float = described("probability a draft token is accepted", 0.7)
    draft: str | None = described("draft model (preset or TOML) for speculative decoding", None)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)!r}: must be an integer >= 1")
        if self.weights not in WEIGHT_PRECISIONS:
            raise ValueError(f"weights = {self.weights!r}: allowed: {', '.join(WEIGHT_PRECISIONS)}")
        if self.kv not in KV_PRECISIONS:
            raise ValueError(f"kv = {self.kv!r}: allowed: {', '.join(KV_PRECISIONS)}")
        if self.spec_tokens < 0:
            raise ValueError(f"spec_tokens = {self.spec_tokens}: must be >= 0")
        if not 0 <= self.spec_accept < 1:
            raise ValueError(f"spec_accept = {self.spec_accept}: must be in [0, 1)")
        if self.spec_tokens and self.draft is None:
            raise ValueError("spec_tokens > 0 needs a draft model (e.g. draft = 'llama3.2-1b' or a model TOML)")

    @property
    def devices(self) -> int:
        return self.tp * self.pp

    def to_dict(self) -> dict:
        return asdict(self)


def check_replica(model: ModelConfig, system: System, rep: Replica, layout: str = "shard") -> None:
    """One ValueError naming the field, the value and what is allowed. A stack that pads heads (layout "pad",
    transformers-neuronx) runs any tp: the heads are padded up to it (Llama-2-13B's 40 heads at tp 24 or 32)."""
    padded = layout == "pad"
    checks = [
        (padded or model.heads % rep.tp == 0, f"tp = {rep.tp}: must divide heads = {model.heads}"),
        (padded or model.n_kv_heads % rep.tp == 0 or rep.tp % model.n_kv_heads == 0,
         f"tp = {rep.tp}: must divide or be a multiple of kv_heads = {model.n_kv_heads}"),
        (model.layers >= rep.pp, f"pp = {rep.pp}: must be <= layers = {model.layers}"),
        (rep.ep == 1 or (_is_moe(model) and rep.tp % rep.ep == 0 and model.num_experts % rep.ep == 0),
         f"ep = {rep.ep}: needs a mixture-of-experts model, and ep must divide tp = {rep.tp} and the experts"),
        (rep.tp <= system.devices_per_node,
         f"tp = {rep.tp}: tensor parallelism stays inside one {system.name} ({system.devices_per_node} "
         f"{system.device_unit}s); use pp across nodes"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


# ---- shapes --------------------------------------------------------------------------------------------
def heads_per_device(model: ModelConfig, tp: int, layout: str = "shard") -> tuple[float, float]:
    """(query heads, kv heads) one device computes and holds under the stack's head layout (HEAD_LAYOUTS)."""
    if layout == "shard":
        return model.heads / tp, max(model.n_kv_heads / tp, 1.0)
    q = float(math.ceil(model.heads / tp))
    if model.n_kv_heads == model.heads or model.n_kv_heads % tp:
        return q, q  # MHA padded with the query heads; GQA replicated to one kv head per query head
    return q, model.n_kv_heads / tp


def _unsplit_attention_params(model: ModelConfig, rep: Replica, layout: str) -> float:
    """Per device and layer: the attention weights held beyond an even 1/tp split (pad: zero heads and replicated
    K/V are real weights the device reads and multiplies). MLA: its down-projections, which every TP rank holds
    whole (vllm-project/vllm model_executor/models/deepseek_v2.py: q_a_proj and kv_a_proj_with_mqa are
    ReplicatedLinear, fused_qkv_a_proj a MergedReplicatedLinear in later versions; q_b_proj / kv_b_proj
    column-parallel, o_proj row-parallel; SGLang's deepseek_v2.py the same)."""
    if model.mla is not None:
        return model.mla.latent_params(model.hidden) * (1 - 1 / rep.tp)
    if layout == "shard":
        return 0.0
    q, kv = heads_per_device(model, rep.tp, layout)
    return model.hidden * model.head_dim * (2 * (q - model.heads / rep.tp) + 2 * (kv - model.n_kv_heads / rep.tp))


def attention_head_dim(model: ModelConfig, phase: str) -> float:
    """Per query head, the mean of the attention core's q/k width and its v width (the head_dim of the 2 x 2 x c
    x head_dim FLOPs per head and token): head_dim for plain attention. MLA as inference engines run it (vLLM's
    MLA backends / FlashMLA, SGLang; DeepSeek-V2 report sec. 2.1.2 on absorbing W_UK into W_Q and W_UV into W_O):
    decode in the absorbed form, each head's query against the cached latent + RoPE key (kv_lora_rank +
    qk_rope_head_dim) and its output in the latent (kv_lora_rank); prefill in the expanded form (q/k head dim
    qk_nope + qk_rope, v head dim v_head_dim). The absorbed q and output projections cost the same 2 x kv_b_proj
    FLOPs per token as the expanded ones, so the matmul FLOPs stay 2 x parameters."""
    mla = model.mla
    if mla is None:
        return model.head_dim
    if phase == "decode":
        return (mla.cache_dim + mla.kv_lora_rank) / 2.0
    return (mla.qk_head_dim + mla.v_head_dim) / 2.0


def token_bucket(tokens, smallest: int = MIN_TOKEN_BUCKET):
    """The power-of-two bucket (>= smallest) a static-shape stack compiles for `tokens`."""
    t = np.maximum(np.asarray(tokens, dtype=float), 1.0)
    return np.maximum(smallest, 2.0 ** np.ceil(np.log2(t)))


def kv_bytes_per_token(model: ModelConfig, kv: str, tp: int = 1, pp: int = 1, layout: str = "shard") -> float:
    """KV-cache bytes per token on one device: K and V of the kv heads it holds (GQA/MQA: kv_heads < heads;
    tp > kv_heads replicates one kv head per device; `layout` pad: heads_per_device) for its layers. MLA: the
    latent and the RoPE key (MLA.cache_dim) per layer, the same on every TP rank (vLLM's MLA backends and
    SGLang cache them unsplit by heads)."""
    if model.mla is not None:
        return (model.layers / pp) * model.mla.cache_dim * KV_PRECISIONS[kv]
    heads_dev = heads_per_device(model, tp, layout)[1]
    return 2.0 * (model.layers / pp) * heads_dev * model.head_dim * KV_PRECISIONS[kv]


def weight_bytes_per_device(model: ModelConfig, rep: Replica, layout: str = "shard") -> float:
    """Weights one device holds: its 1/pp of the layers sharded over tp, plus the embedding (first stage) and
    the output head (last stage) sharded over tp; the fuller of the two end stages (both when pp = 1)."""
    wb = WEIGHT_PRECISIONS[rep.weights]
    layers = math.ceil(model.layers / rep.pp) * (_layer_params(model) / rep.tp
                                                 + _unsplit_attention_params(model, rep, layout))
    ends = model.embedding_params() + model.head_params() if rep.pp == 1 else \
        max(model.embedding_params(), model.head_params())
    return (layers + ends / rep.tp) * wb


def _streamed_weight_bytes(model: ModelConfig, rep: Replica, tokens=1.0, layout: str = "shard"):
    """Weight bytes read per forward on the slowest stage: its layers and the output head (the embedding is a
    lookup of b rows, not a read of the table). A mixture-of-experts layer reads only the experts its
    `tokens` tokens route to: E (1 - (1 - k/E)^tokens) of them in expectation (uniform routing)."""
    wb = WEIGHT_PRECISIONS[rep.weights]
    head = model.vocab * model.hidden
    layers = math.ceil(model.layers / rep.pp)
    pad = layers * _unsplit_attention_params(model, rep, layout) * wb
    if not _is_moe(model):
        return (layers * model.params_per_layer() + head) / rep.tp * wb + pad
    experts = model.num_experts
    touched = experts * (1 - (1 - model.experts_per_token / experts) ** np.asarray(tokens, dtype=float))
    expert = _routed_expert_params(model)
    per_layer = _layer_params(model) - experts * expert + touched * expert  # all but the untouched experts
    return (layers * per_layer + head) / rep.tp * wb + pad


def _matmul_params_stage(model: ModelConfig, rep: Replica, layout: str = "shard") -> float:
    """Parameters each token multiplies with on the stage (active experts only), per device."""
    per_layer = _layer_params(model, active=True)
    layers = math.ceil(model.layers / rep.pp)
    return (layers * per_layer + model.vocab * model.hidden) / rep.tp + layers * _unsplit_attention_params(
        model, rep, layout)


def peak_flops(system: System, weights: str) -> float:
    """Dense peak per device for the compute precision: fp8 weights run FP8 matmuls where the chip has them;
    int8/int4 weight-only formats dequantize to BF16 (they save bytes, not FLOPs)."""
    tflops = system.chip.bf16_tflops
    if weights == "fp8" and system.chip.fp8_tflops:
        tflops = system.chip.fp8_tflops
    return tflops * 1e12 / system.devices_per_chip


def _serving_system(system: System, eff: ServingEfficiency) -> System:
    """The system with the serving stack's per-call collective cost on every link (decode all-reduces are tiny
    and latency-bound: inference engines use one-shot / custom all-reduce kernels, not the training stack's). Its
    collectives keep the links' model the serving tables were fitted with: the chip's reduction rate
    (chip.reduce_gbytes_per_s, set from training-sized reductions) is not part of them (docs/planner.md, nxdtp)."""
    tiers = tuple(Tier(t.name, replace(t.interconnect, collective_overhead_us=eff.collective_us), t.domain_devices)
                  for t in system.tiers)
    return replace(system, tiers=tiers, chip=replace(system.chip, reduce_gbytes_per_s=0.0))


def _tp_comm_s(system: System, model: ModelConfig, rep: Replica, tokens, layers: int):
    """Two all-reduces of the activations (tokens x hidden, bf16) per layer, plus one all-gather of the logits."""
    if rep.tp == 1:
        return np.zeros_like(np.asarray(tokens, dtype=float))
    act = np.asarray(tokens, dtype=float) * model.hidden * BF16_BYTES
    per_layer = 2 * collective_time_s(system, "allreduce", act, rep.tp, 1)
    if rep.ep > 1:  # the MLP's all-reduce becomes dispatch + combine all-to-alls of k copies per token (an
        # all-to-all moves (n-1)/n of its buffer like an all-gather: that ring cost stands in for it)
        a2a = collective_time_s(system, "allgather", act * model.experts_per_token, rep.ep, 1)
        per_layer = collective_time_s(system, "allreduce", act, rep.tp, 1) + 2 * a2a
    logits = collective_time_s(system, "allgather", np.asarray(tokens, dtype=float) * model.vocab * 4, rep.tp, 1)
    return layers * per_layer + logits


# ---- prefill and decode --------------------------------------------------------------------------------
def prefill_time_s(model: ModelConfig, system: System, rep: Replica, prompt_tokens, prompts=1,
                   eff: ServingEfficiency | None = None, attention: str | None = None):
    """Time to run the prompts through the replica (= time to first token of a lone request). prompt_tokens:
    tokens per prompt; prompts: how many in the batch."""
    eff = eff or serving_efficiency(system)
    sys_s = _serving_system(system, eff)
    s = np.asarray(prompt_tokens, dtype=float)
    if eff.buckets:  # the prompt runs padded to its context-encoding bucket (transformers-neuronx bucket.find;
        s = token_bucket(s, MIN_TOKEN_BUCKET // 2)  # default context buckets: half the token buckets, from 64)
    n = np.asarray(prompts, dtype=float)
    tokens = s * n
    layers = math.ceil(model.layers / rep.pp)
    attention = attention or eff.attention
    q_heads = heads_per_device(model, rep.tp, eff.head_layout)[0]
    square = 1.0 if attention == "unfused" else 0.5  # causal: a fused kernel skips the masked half
    attn_flops = layers * n * 4.0 * square * s * s * q_heads * attention_head_dim(model, "prefill")
    flops = 2.0 * tokens * _matmul_params_stage(model, rep, eff.head_layout) + attn_flops
    compute = flops / (peak_flops(system, rep.weights) * eff.prefill_flops_eff)
    score_bytes = 0.0
    if attention == "unfused":  # scores written and read once in bf16
        score_bytes = layers * n * 2 * BF16_BYTES * q_heads * s * s
    act_bytes = layers * tokens * 8 * model.hidden * BF16_BYTES / rep.tp  # q/k/v/o and MLP activations, roughly
    memory = (_streamed_weight_bytes(model, rep, tokens, eff.head_layout) + score_bytes + act_bytes) / (
        system.device_hbm_bw_bytes_per_s * eff.decode_bw_eff)
    stage = soft_roofline(compute, memory) + layers * eff.layer_overhead_s + _tp_comm_s(sys_s, model, rep, tokens, layers)
    hand_off = p2p_time_s(sys_s, tokens * model.hidden * BF16_BYTES, rep.tp, rep.pp) if rep.pp > 1 else 0.0
    return rep.pp * stage + (rep.pp - 1) * hand_off + eff.host_step_s  # the prefill is one engine step


def decode_step_s(model: ModelConfig, system: System, rep: Replica, batch, context,
                  eff: ServingEfficiency | None = None, tokens_per_seq: int = 1):
    """Time of one decode step (one new token for each of `batch` sequences holding `context` tokens each) =
    the inter-token latency at that batch. tokens_per_seq > 1: a speculative verification step."""
    eff = eff or serving_efficiency(system)
    sys_s = _serving_system(system, eff)
    b = np.asarray(batch, dtype=float)
    c = np.asarray(context, dtype=float)
    mb = b / rep.pp  # sequences per pipeline microbatch: every stage works on one microbatch at a time
    layers = math.ceil(model.layers / rep.pp)
    tokens = mb * tokens_per_seq
    if eff.buckets:  # attention runs over the whole power-of-two token bucket holding the context
        c = token_bucket(c)
    q_heads = heads_per_device(model, rep.tp, eff.head_layout)[0]
    flops = 2.0 * tokens * _matmul_params_stage(model, rep, eff.head_layout) + \
        layers * tokens * 4.0 * c * q_heads * attention_head_dim(model, "decode")
    compute = flops / (peak_flops(system, rep.weights) * eff.prefill_flops_eff)
    bw = system.device_hbm_bw_bytes_per_s
    weights = _streamed_weight_bytes(model, rep, tokens, eff.head_layout) / (bw * eff.decode_bw_eff)
    kv = mb * c * kv_bytes_per_token(model, rep.kv, rep.tp, rep.pp, eff.head_layout) / (bw * eff.kv_bw_eff)
    if eff.gqa_decode == "per_query_head" and model.mla is None:  # each query head reads its kv head's cache
        # again (an MLA kernel reads the one shared latent per token once for all its heads)
        kv = kv * q_heads / heads_per_device(model, rep.tp, eff.head_layout)[1]
    stage = soft_roofline(compute, weights + kv) + layers * eff.layer_overhead_s + _tp_comm_s(
        sys_s, model, rep, tokens, layers)
    hand_off = p2p_time_s(sys_s, tokens * model.hidden * BF16_BYTES, rep.tp, rep.pp) if rep.pp > 1 else 0.0
    return rep.pp * (stage + hand_off) + eff.host_step_s


def _draft_model(rep: Replica) -> ModelConfig | None:
    if not rep.spec_tokens:
        return None
    return load_serving_model(rep.draft)


def expected_tokens_per_step(spec_tokens: int, accept: float) -> float:
    """Leviathan et al. 2023 eq. 1: tokens produced per target step with k drafts accepted w.p. a each."""
    if spec_tokens == 0:
        return 1.0
    return (1 - accept ** (spec_tokens + 1)) / (1 - accept)


def inter_token_s(model: ModelConfig, system: System, rep: Replica, batch, context,
                  eff: ServingEfficiency | None = None):
    """Mean time per generated token of one sequence (decode step, or speculative cycle / tokens per cycle)."""
    draft = _draft_model(rep)
    if draft is None:
        return decode_step_s(model, system, rep, batch, context, eff)
    k = rep.spec_tokens
    draft_rep = replace(rep, weights="bf16", spec_tokens=0, draft=None, tp=_draft_tp(draft, rep.tp))
    cycle = (k * decode_step_s(draft, system, draft_rep, batch, context, eff)
             + decode_step_s(model, system, rep, batch, context, eff, tokens_per_seq=k + 1))
    return cycle / expected_tokens_per_step(k, rep.spec_accept)


def _draft_tp(draft: ModelConfig, tp: int) -> int:
    """The draft runs on the same devices: the largest tp <= the target's that its heads allow."""
    return max(d for d in range(1, tp + 1) if tp % d == 0 and draft.heads % d == 0
               and (draft.n_kv_heads % d == 0 or d % draft.n_kv_heads == 0))


# ---- memory and capacity -------------------------------------------------------------------------------
def kv_pages_bytes_per_sequence(model: ModelConfig, rep: Replica, tokens, layout: str = "shard") -> np.ndarray:
    """KV cache of one sequence of `tokens` tokens on one device, in whole pages of PAGE_TOKENS."""
    pages = np.ceil(np.asarray(tokens, dtype=float) / PAGE_TOKENS)
    return pages * PAGE_TOKENS * kv_bytes_per_token(model, rep.kv, rep.tp, rep.pp, layout)


def kv_budget_bytes(model: ModelConfig, system: System, rep: Replica, max_tokens_per_step: int = 8192,
                    layout: str = "shard") -> float:
    """Device memory left for the KV cache: MEMORY_UTILIZATION of HBM minus weights (and the draft's) minus
    the activation workspace of one step of max_tokens_per_step tokens (vLLM's profiling run does the same)."""
    draft = _draft_model(rep)
    weights = weight_bytes_per_device(model, rep, layout)
    if draft is not None:
        weights += weight_bytes_per_device(draft, Replica(tp=_draft_tp(draft, rep.tp)))
    workspace = max_tokens_per_step * (4 * model.hidden + 2 * model.ffn / rep.tp + model.vocab / rep.tp) * 4
    return system.device_memory_bytes * MEMORY_UTILIZATION - weights - workspace


def max_sequences(model: ModelConfig, system: System, rep: Replica, tokens_per_sequence,
                  layout: str = "shard") -> np.ndarray:
    """Concurrent sequences of that length one replica's KV cache holds (0: the weights do not fit)."""
    budget = kv_budget_bytes(model, system, rep, layout=layout)
    per_seq = kv_pages_bytes_per_sequence(model, rep, tokens_per_sequence, layout)
    # every pipeline stage holds the KV of its own layers for every sequence: per_seq is already per stage
    return np.floor(np.maximum(budget, 0.0) / per_seq)


# ---- one operating point -------------------------------------------------------------------------------
@dataclass
class ServeEstimate:
    """One replica at `batch` concurrent sequences, prompt `prompt` and `output` tokens per request."""

    model: str
    system: str
    replica: Replica
    devices: int
    chips: float
    batch: int
    prompt: int
    output: int
    ttft_s: float  # prefill of one prompt plus the wait for the running decode step (no queueing)
    itl_s: float  # decode step at the mean context (prompt + output/2), prefill stalls included
    decode_step_s: float  # decode step alone
    prefill_s: float  # prefill of one prompt
    requests_per_s: float  # per replica at this batch (continuous batching, steady state)
    output_tokens_per_s: float
    input_tokens_per_s: float
    prefill_time_share: float  # share of the replica's time spent on prefill
    weights_bytes_per_device: float
    kv_bytes_per_device: float
    kv_bytes_per_token_per_device: float
    memory_capacity_bytes: float
    max_sequences: int
    fits: bool
    efficiency: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["replica"] = self.replica.to_dict()
        return data


def operating_point(model: ModelConfig, system: System, rep: Replica, batch, prompt: int, output: int,
                    eff: ServingEfficiency | None = None) -> dict[str, np.ndarray]:
    """Latency and throughput of a replica at `batch` (array) concurrent requests of prompt/output tokens.

    Continuous batching in steady state: every request is prefilled once and decoded `output` times while
    `batch` share the steps. Chunked prefill rides on the decode steps, which read the weights anyway, so
    each prompt adds its marginal cost (prefill of the prompt minus a one-token pass) to the steps it
    shares: the replica's time per request cycle is output x step + batch x marginal prefill."""
    eff = eff or serving_efficiency(system)
    b = np.asarray(batch, dtype=float)
    context = prompt + output / 2.0
    step = inter_token_s(model, system, rep, b, context, eff)
    pre = prefill_time_s(model, system, rep, prompt, 1, eff)
    marginal = np.maximum(pre - prefill_time_s(model, system, rep, 1, 1, eff), 0.0)
    cycle = output * step + b * marginal
    rps = b / cycle
    return {"itl_s": cycle / output, "decode_step_s": step, "prefill_s": pre * np.ones_like(b),
            "ttft_s": pre + step, "requests_per_s": rps, "output_tokens_per_s": rps * output,
            "input_tokens_per_s": rps * prompt, "prefill_time_share": b * marginal / cycle}


def estimate(model: ModelConfig | str, system: System | str, rep: Replica, batch: int, prompt: int,
             output: int, eff: ServingEfficiency | None = None) -> ServeEstimate:
    model = load_serving_model(model)
    system = resolve_system(system)
    _check_request(batch=batch, prompt=prompt, output=output)
    eff = eff or serving_efficiency(system)
    check_replica(model, system, rep, eff.head_layout)
    point = {k: float(np.asarray(v)) for k, v in operating_point(model, system, rep, batch, prompt, output, eff).items()}
    layout = eff.head_layout
    seqs = int(max_sequences(model, system, rep, prompt + output, layout))
    per_tok = kv_bytes_per_token(model, rep.kv, rep.tp, rep.pp, layout)
    kv = float(kv_pages_bytes_per_sequence(model, rep, prompt + output, layout)) * batch  # per device (its stage)
    est = ServeEstimate(
        model=model.name, system=system.name, replica=rep, devices=rep.devices,
        chips=rep.devices / system.devices_per_chip, batch=batch, prompt=prompt, output=output,
        weights_bytes_per_device=weight_bytes_per_device(model, rep, layout), kv_bytes_per_device=kv,
        kv_bytes_per_token_per_device=per_tok, memory_capacity_bytes=system.device_memory_bytes * MEMORY_UTILIZATION,
        max_sequences=seqs, fits=batch <= seqs, efficiency=asdict(eff), **point)
    if seqs == 0:
        est.notes.append(f"the weights do not fit: {est.weights_bytes_per_device / 2**30:.1f} GiB per device of "
                         f"{est.memory_capacity_bytes / 2**30:.1f} GiB usable; raise tp/pp or lower the precision")
    elif batch > seqs:
        est.notes.append(f"batch {batch} needs more KV cache than fits: at most {seqs} sequences of "
                         f"{prompt + output} tokens")
    return est


def _check_request(**values) -> None:
    for name, value in values.items():
        if not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name} = {value!r}: must be an integer >= 1")


# ---- search --------------------------------------------------------------------------------------------
@dataclass
class Target:
    """A request mix and its service-level objective: `rate` requests/s of `prompt` input and `output` output
    tokens, time to first token <= ttft_s and mean inter-token latency <= itl_s (None: unconstrained).
    max_utilization: share of a replica's capacity planned for (queueing makes latency grow without bound as
    the load nears capacity; sim/serving.py shows by how much)."""

    rate: float
    prompt: int
    output: int
    ttft_s: float | None = described("time-to-first-token target", None, gt=0)
    itl_s: float | None = described("inter-token latency target (time per output token)", None, gt=0)
    max_utilization: float = described("share of replica capacity to plan for (queueing headroom)", 0.8, gt=0)

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate = {self.rate}: must be > 0 requests/s")
        _check_request(prompt=self.prompt, output=self.output)
        for name in ("ttft_s", "itl_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} = {value}: must be > 0 seconds")
        if not 0 < self.max_utilization <= 1:
            raise ValueError(f"max_utilization = {self.max_utilization}: must be in (0, 1]")


@dataclass
class ServePlan:
    """A deployment: `replicas` copies of one replica layout at `batch` concurrent requests each."""

    estimate: ServeEstimate
    replicas: int
    devices: int
    chips: float
    nodes: int
    utilization: float
    usd_per_hour: float | None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["estimate"] = self.estimate.to_dict()
        return data


MAX_BATCH = 4096


def best_batch(model: ModelConfig, system: System, rep: Replica, target: Target,
               eff: ServingEfficiency | None = None) -> tuple[int, dict] | None:
    """The largest batch (highest throughput per replica) meeting the latency targets and fitting the KV cache."""
    eff = eff or serving_efficiency(system)
    limit = int(min(MAX_BATCH, max_sequences(model, system, rep, target.prompt + target.output, eff.head_layout)))
    if limit < 1:
        return None
    batches = np.arange(1, limit + 1, dtype=float)
    point = operating_point(model, system, rep, batches, target.prompt, target.output, eff)
    ok = np.ones_like(batches, dtype=bool)
    if target.itl_s is not None:
        ok &= point["itl_s"] <= target.itl_s
    if target.ttft_s is not None:
        ok &= point["ttft_s"] <= target.ttft_s
    if not ok.any():
        return None
    i = int(np.flatnonzero(ok)[np.argmax(point["requests_per_s"][ok])])
    return int(batches[i]), {k: float(v[i]) for k, v in point.items()}


def nodes_for(system: System, rep: Replica, replicas: int) -> int:
    """Whole nodes to rent: replicas smaller than a node are packed (a replica never straddles two nodes
    unless it is bigger than one)."""
    per_node = system.devices_per_node
    if rep.devices <= per_node:
        return math.ceil(replicas / (per_node // rep.devices))
    return replicas * math.ceil(rep.devices / per_node)


def replica_layouts(model: ModelConfig, system: System, weights: tuple[str, ...], kv: tuple[str, ...],
                    max_pp: int = 8, layout: str = "shard") -> list[Replica]:
    """Every replica layout worth trying: tp a divisor of the node's devices the heads allow, pp up to max_pp."""
    out = []
    per_node = system.devices_per_node
    for tp in range(1, per_node + 1):
        if per_node % tp and tp & (tp - 1):  # divisors of the node, and powers of two (packed, some idle)
            continue
        for pp in (1, 2, 4, 8):
            if pp > max_pp:
                continue
            eps = [e for e in range(1, tp + 1) if tp % e == 0] if _is_moe(model) else [1]
            for w in weights:
                for k in kv:
                    for ep in eps:
                        rep = Replica(tp=tp, pp=pp, ep=ep, weights=w, kv=k)
                        try:
                            check_replica(model, system, rep, layout)
                        except ValueError:
                            continue
                        out.append(rep)
    return out


def plan(model: ModelConfig | str, system: System | str, target: Target, weights: tuple[str, ...] = ("bf16",),
         kv: tuple[str, ...] = ("bf16",), top: int = 5, replicas: list[Replica] | None = None,
         eff: ServingEfficiency | None = None, device_usd_per_hour: float | None = None) -> list[ServePlan]:
    """The cheapest deployments meeting the target: for each replica layout, its best batch, then enough
    replicas for the rate at max_utilization. Ranked by whole nodes (on one system: by cost; cost/serving.py
    prices them, device_usd_per_hour fills usd_per_hour), then devices, then time to first token."""
    model = load_serving_model(model)
    system = resolve_system(system)
    eff = eff or serving_efficiency(system)
    price = device_usd_per_hour
    plans = []
    for rep in replicas or replica_layouts(model, system, weights, kv, layout=eff.head_layout):
        found = best_batch(model, system, rep, target, eff)
        if found is None:
            continue
        batch, point = found
        n = math.ceil(target.rate / (point["requests_per_s"] * target.max_utilization))
        est = estimate(model, system, rep, batch, target.prompt, target.output, eff)
        devices = n * rep.devices
        nodes = nodes_for(system, rep, n)
        plans.append(ServePlan(
            estimate=est, replicas=n, devices=devices, chips=devices / system.devices_per_chip, nodes=nodes,
            utilization=target.rate / (n * point["requests_per_s"]),
            usd_per_hour=None if price is None else price * nodes * system.devices_per_node))
    plans.sort(key=lambda p: (p.nodes, p.devices, p.estimate.ttft_s))
    return plans[:top]
