"""Load a Hugging Face Llama checkpoint folder (config.json + *.safetensors) into paratrain's model.

Hugging Face stores q/k projections permuted for its rotate-half RoPE; Meta's (and our) RoPE rotates
interleaved pairs. We undo the permutation that transformers' convert_llama_weights_to_hf.py applies.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from paratrain.model.config import ModelConfig, RopeScaling
from paratrain.model.llama import Llama

_LAYER_NAMES = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}


def config_from_hf(folder: str | Path, name: str | None = None) -> ModelConfig:
    """The ModelConfig of a Hugging Face Llama folder's config.json (transformers 4.x keys `rope_theta` /
    `rope_scaling`, or 5.x `rope_parameters`). What paratrain's Llama cannot reproduce is refused, never
    silently approximated."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"model.hf_path='{folder}': no config.json there (need a Hugging Face Llama folder)")
    hf = json.loads(path.read_text())
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
        ("model_type", hf.get("model_type", "llama"), ("llama",)),
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


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of HF's permute(w, n_heads): view(n, 2, d/2, in) -> (n, d/2, 2, in)."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, 2, out_dim // n_heads // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def hf_state_dict_to_paratrain(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key == "model.embed_tokens.weight":
            out["tok_embeddings.weight"] = value
        elif key == "model.norm.weight":
            out["norm.weight"] = value
        elif key == "lm_head.weight":
            out["output.weight"] = value
        elif key.startswith("model.layers."):
            _, _, idx, rest = key.split(".", 3)
            module, leaf = rest.rsplit(".", 1)
            if module not in _LAYER_NAMES:
                raise ValueError(f"unexpected tensor '{key}' in the Hugging Face checkpoint")
            if module == "self_attn.q_proj":
                value = _unpermute_rope(value, cfg.heads)
            elif module == "self_attn.k_proj":
                value = _unpermute_rope(value, cfg.n_kv_heads)
            out[f"layers.{idx}.{_LAYER_NAMES[module]}.{leaf}"] = value
        elif key.endswith("rotary_emb.inv_freq"):
            continue  # derived from the config
        else:
            raise ValueError(f"unexpected tensor '{key}' in the Hugging Face checkpoint")
    if cfg.tie_embeddings:
        out.setdefault("output.weight", out["tok_embeddings.weight"])
    return out


def load_hf_llama(folder: str | Path, cfg: ModelConfig | None = None) -> Llama:
    """Build paratrain's Llama from a Hugging Face folder with the same weights.

    `cfg` (default: read from config.json) may differ from the folder's only where no weight depends on it
    (name, max_seq: the RoPE table length); `paratrain.config` refuses shape overrides with model.hf_path.
    """
    folder = Path(folder)
    cfg = cfg or config_from_hf(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model.hf_path='{folder}': no *.safetensors files there")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    model = Llama(cfg)
    missing, unexpected = model.load_state_dict(hf_state_dict_to_paratrain(sd, cfg), strict=False)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "output.weight")]
    if missing or unexpected:
        raise ValueError(f"Hugging Face checkpoint '{folder}' does not match: missing {missing}, unexpected {unexpected}")
    return model
