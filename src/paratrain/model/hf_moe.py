"""Hugging Face Mixtral (MixtralForCausalLM) and Qwen3-MoE (Qwen3MoeForCausalLM) folders in and out of paratrain's
Llama with MoE layers (whole model in one process; the dense Llama's sharded loader is `paratrain.model.hf`).

Checkpoints come in two layouts: the published per-expert one (Mixtral `block_sparse_moe.experts.E.w1/w2/w3`,
Qwen3 `mlp.experts.E.gate_proj/up_proj/down_proj`) and transformers 5's in-memory stacked one
(`mlp.experts.gate_up_proj` (E, 2f, h) = [gate; up], `mlp.experts.down_proj` (E, h, f)); both are read, the
per-expert one is written (what every released checkpoint and older transformers read). q/k rows are unpermuted
per head as for the dense Llama (and Qwen3's q/k norm weights with them).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from paratrain.model.config import ModelConfig
from paratrain.model.hf import _permute_rope, _unpermute_rope
from paratrain.model.hf_config import (  # torch-free: the config schema reads them
    MOE_KINDS,
    config_from_hf_moe,
)
from paratrain.model.llama import Llama

_KINDS = MOE_KINDS

_ATTN = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo"}


def hf_moe_config(cfg: ModelConfig, kind: str) -> dict:
    """config.json of the `kind` ('mixtral' | 'qwen3_moe') transformers model computing what paratrain's does."""
    if kind not in _KINDS:
        raise ValueError(f"kind={kind!r}: allowed: {', '.join(_KINDS)}")
    bad = [("first_dense_layers", cfg.first_dense_layers, 0), ("shared_experts", cfg.shared_experts, 0),
           ("router_score", cfg.router_score, "softmax"), ("capacity_factor", cfg.capacity_factor, None),
           ("qk_norm", cfg.qk_norm, kind == "qwen3_moe"), ("rope_scaling", cfg.rope_scaling, None)]
    if kind == "mixtral":
        bad += [("router_norm_topk", cfg.router_norm_topk, True), ("moe_ffn_hidden", cfg.moe_ffn, cfg.ffn)]
    for key, value, allowed in bad:
        if value != allowed:
            raise ValueError(f"model.{key}={value!r}: {_KINDS[kind][2]} has no such option; allowed: {allowed!r}")
    out = {"architectures": [_KINDS[kind][2]], "model_type": kind, "hidden_act": "silu", "attention_bias": False,
           "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn, "num_hidden_layers": cfg.layers,
           "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
           "vocab_size": cfg.vocab, "max_position_embeddings": cfg.max_seq, "rms_norm_eps": cfg.norm_eps,
           "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings, "num_experts_per_tok":
           cfg.experts_per_token, "router_aux_loss_coef": cfg.aux_loss_coef, "torch_dtype": "float32",
           "sliding_window": None}
    if kind == "mixtral":
        out["num_local_experts"] = cfg.num_experts
    else:
        out.update(num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_ffn, norm_topk_prob=cfg.router_norm_topk,
                   decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False)
    return out


def _layer_map(cfg: ModelConfig, kind: str, i: int) -> dict[str, tuple[str, int | None]]:
    """paratrain name -> (published HF name, heads whose rows HF permutes) of layer i, experts excluded."""
    prefix, ours = f"model.layers.{i}", f"layers.{i}"
    moe, _, _ = _KINDS[kind]
    out = {f"{ours}.attention.{w}.weight": (f"{prefix}.self_attn.{hf}.weight",
                                             cfg.heads if w == "wq" else cfg.n_kv_heads if w == "wk" else None)
           for hf, w in _ATTN.items()}
    out[f"{ours}.attention_norm.weight"] = (f"{prefix}.input_layernorm.weight", None)
    out[f"{ours}.ffn_norm.weight"] = (f"{prefix}.post_attention_layernorm.weight", None)
    out[f"{ours}.feed_forward.router.weight"] = (f"{prefix}.{moe}.gate.weight", None)
    if cfg.qk_norm:  # one head's norm weight: permuted like each head's rows
        out[f"{ours}.attention.q_norm.weight"] = (f"{prefix}.self_attn.q_norm.weight", 1)
        out[f"{ours}.attention.k_norm.weight"] = (f"{prefix}.self_attn.k_norm.weight", 1)
    return out


def _experts_from_hf(sd: dict, cfg: ModelConfig, kind: str, i: int) -> dict[str, torch.Tensor]:
    moe, (gate, up, down), _ = _KINDS[kind]
    ours = f"layers.{i}.feed_forward.experts"
    stacked = f"model.layers.{i}.mlp.experts"
    if f"{stacked}.gate_up_proj" in sd:
        w1, w3 = sd.pop(f"{stacked}.gate_up_proj").chunk(2, dim=1)
        return {f"{ours}.w1": w1, f"{ours}.w3": w3, f"{ours}.w2": sd.pop(f"{stacked}.down_proj")}
    per = f"model.layers.{i}.{moe}.experts"
    take = {n: torch.stack([sd.pop(f"{per}.{e}.{n}.weight") for e in range(cfg.num_experts)])
            for n in (gate, up, down)}
    return {f"{ours}.w1": take[gate], f"{ours}.w3": take[up], f"{ours}.w2": take[down]}


def state_dict_from_hf_moe(sd: dict[str, torch.Tensor], cfg: ModelConfig, kind: str) -> dict[str, torch.Tensor]:
    """paratrain state dict of a Mixtral / Qwen3-MoE state dict (either layout); every tensor must be used."""
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    if kind == "mixtral":  # transformers 5 renames block_sparse_moe -> mlp in memory
        sd = {k.replace(".mlp.gate.", ".block_sparse_moe.gate."): v for k, v in sd.items()}
    out = {"tok_embeddings.weight": sd.pop("model.embed_tokens.weight"), "norm.weight": sd.pop("model.norm.weight")}
    if not cfg.tie_embeddings:
        out["output.weight"] = sd.pop("lm_head.weight")
    sd.pop("lm_head.weight", None)
    for i in range(cfg.layers):
        for name, (hf, heads) in _layer_map(cfg, kind, i).items():
            w = sd.pop(hf)
            out[name] = _unpermute_rope(w.view(w.shape[0], -1), heads).view(w.shape) if heads else w
        out.update(_experts_from_hf(sd, cfg, kind, i))
    if sd:
        raise ValueError(f"Hugging Face {kind} state dict has tensors paratrain does not use: {sorted(sd)[:5]}")
    return out


def state_dict_to_hf_moe(model: Llama, kind: str) -> dict[str, torch.Tensor]:
    """The published per-expert layout of paratrain's MoE Llama."""
    cfg, sd = model.cfg, {k: v.detach() for k, v in model.state_dict().items()}
    moe, (gate, up, down), _ = _KINDS[kind]
    out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["output.weight"]
    for i in range(cfg.layers):
        for name, (hf, heads) in _layer_map(cfg, kind, i).items():
            w = sd[name]
            out[hf] = _permute_rope(w.view(w.shape[0], -1), heads).view(w.shape) if heads else w
        per, ours = f"model.layers.{i}.{moe}.experts", f"layers.{i}.feed_forward.experts"
        for n, w in ((gate, "w1"), (up, "w3"), (down, "w2")):
            for e in range(cfg.num_experts):
                out[f"{per}.{e}.{n}.weight"] = sd[f"{ours}.{w}"][e]
    return {k: v.contiguous().clone() for k, v in out.items()}


def _read(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"'{folder}': no config.json there (need a Hugging Face Mixtral or Qwen3-MoE folder)")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"'{folder}': no *.safetensors files there")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    return json.loads(path.read_text()), sd


def load_hf_moe(folder: str | Path) -> Llama:
    """paratrain's Llama (MoE layers) with the weights of a Hugging Face Mixtral / Qwen3-MoE folder."""
    folder = Path(folder)
    hf, sd = _read(folder)
    cfg = config_from_hf_moe(hf, folder.name)
    model = Llama(cfg)
    model.load_state_dict(state_dict_from_hf_moe(sd, cfg, hf["model_type"]), strict=True)
    model.init_buffers()
    return model


def save_hf_moe(model: Llama, folder: str | Path, kind: str) -> None:
    """Write config.json + model.safetensors that transformers loads as `kind` with the same computation."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = hf_moe_config(model.cfg, kind)
    save_file(state_dict_to_hf_moe(model, kind), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
