"""A Hugging Face Llama folder's config.json as a ModelConfig (torch-free: the config schema reads it for
model.hf_path; the weights are model/hf.py's)."""

from __future__ import annotations

import json
from pathlib import Path

from paratrain.model.config import ModelConfig, RopeScaling


def config_from_hf(folder: str | Path, name: str | None = None) -> ModelConfig:
    """The ModelConfig of a Hugging Face Llama folder's config.json (transformers 4.x keys `rope_theta` /
    `rope_scaling`, or 5.x `rope_parameters`). What paratrain's Llama cannot reproduce is refused, never
    silently approximated."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"model.hf_path='{folder}': no config.json there (need a Hugging Face Llama folder)")
    hf = json.loads(path.read_text())
    if hf.get("model_type") in MOE_KINDS:  # Mixtral, Qwen3-MoE
        try:
            return config_from_hf_moe(hf, name or Path(folder).name)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"model.hf_path='{folder}': {exc}") from None
    _check_supported(hf, folder)
    rope = hf.get("rope_parameters") or {}
    return ModelConfig(
        name=name or Path(folder).name,
        layers=hf["num_hidden_layers"],
        hidden=hf["hidden_size"],
        heads=hf["num_attention_heads"],
        kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        ffn_hidden=hf["intermediate_size"],
        vocab=hf["vocab_size"],
        max_seq=hf.get("max_position_embeddings", 4096),
        rope_theta=hf.get("rope_theta") or rope.get("rope_theta") or 10000.0,
        norm_eps=hf.get("rms_norm_eps", 1e-5),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        rope_scaling=_rope_scaling(hf),
    )


def _rope_scaling(hf: dict) -> RopeScaling | None:
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    return RopeScaling(factor=params["factor"], low_freq_factor=params.get("low_freq_factor", 1.0),
                       high_freq_factor=params.get("high_freq_factor", 4.0),
                       original_max_seq=params.get("original_max_position_embeddings", 8192))


def _check_supported(hf: dict, folder) -> None:
    """One clear error for a config.json this Llama would compute differently from transformers."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    heads = hf.get("num_attention_heads", 1)
    checks = [
        ("model_type", hf.get("model_type", "llama"), ("llama", *MOE_KINDS)),
        ("hidden_act", hf.get("hidden_act", "silu"), ("silu",)),
        ("attention_bias", hf.get("attention_bias", False), (False,)),
        ("mlp_bias", hf.get("mlp_bias", False), (False,)),
        ("rope_type", params.get("rope_type", params.get("type", "default")), ("default", "llama3")),
        ("head_dim", hf.get("head_dim") or hf.get("hidden_size", 0) // heads, (hf.get("hidden_size", 0) // heads,)),
    ]
    for key, value, allowed in checks:
        if value not in allowed:
            raise ValueError(f"model.hf_path='{folder}': config.json {key}={value!r} is not supported; allowed: "
                             f"{', '.join(repr(a) for a in allowed)}")


# model_type -> (MoE module prefix in the published checkpoint, expert matrix names gate/up/down, architecture)
MOE_KINDS = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2"), "MixtralForCausalLM"),
          "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), "Qwen3MoeForCausalLM")}


def config_from_hf_moe(hf: dict, name: str = "hf-moe") -> ModelConfig:
    """The ModelConfig of a Mixtral / Qwen3-MoE config.json; what paratrain would compute differently is refused."""
    kind = hf.get("model_type")
    checks = [("model_type", kind, tuple(MOE_KINDS)), ("hidden_act", hf.get("hidden_act", "silu"), ("silu",)),
              ("attention_bias", hf.get("attention_bias", False), (False,)),
              ("decoder_sparse_step", hf.get("decoder_sparse_step", 1), (1,)),
              ("mlp_only_layers", hf.get("mlp_only_layers") or [], ([],)),
              ("sliding_window", hf.get("sliding_window") if hf.get("use_sliding_window", True) else None, (None,))]
    for key, value, allowed in checks:
        if value not in allowed:
            raise ValueError(f"config.json {key}={value!r} is not supported; allowed: "
                             f"{', '.join(repr(a) for a in allowed)}")
    rope = hf.get("rope_parameters") or {}
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    qwen = kind == "qwen3_moe"
    return ModelConfig(
        name=name, layers=hf["num_hidden_layers"], hidden=hf["hidden_size"], heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim_override=head_dim if head_dim * heads != hf["hidden_size"] else None,
        ffn_hidden=hf["intermediate_size"], vocab=hf["vocab_size"], max_seq=hf.get("max_position_embeddings", 4096),
        rope_theta=hf.get("rope_theta") or rope.get("rope_theta") or 10000.0, norm_eps=hf.get("rms_norm_eps", 1e-5),
        tie_embeddings=hf.get("tie_word_embeddings", False), rope_scaling=_rope_scaling(hf), qk_norm=qwen,
        num_experts=hf.get("num_local_experts") or hf["num_experts"],  # Qwen3's released key / transformers 5's
        experts_per_token=hf["num_experts_per_tok"],
        moe_ffn_hidden=hf["moe_intermediate_size"] if qwen else hf["intermediate_size"],
        router_norm_topk=hf.get("norm_topk_prob", False) if qwen else True,
        aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))
