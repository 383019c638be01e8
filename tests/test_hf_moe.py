"""Mixtral and Qwen3-MoE: small random transformers models -> paratrain (logits within 1e-5 fp32) -> back."""

from __future__ import annotations

import pytest
import torch

from paratrain.model.hf_moe import config_from_hf_moe, load_hf_moe, save_hf_moe

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64, rope_theta=10000.0,
              tie_word_embeddings=False)


def _hf_model(kind: str):
    torch.manual_seed(0)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(**COMMON, num_local_experts=4)
        model = transformers.MixtralForCausalLM(cfg)
    else:  # head_dim 16 != hidden / heads: exercises head_dim_override; norm_topk_prob off
        cfg = transformers.Qwen3MoeConfig(**COMMON, num_experts=4, moe_intermediate_size=16, head_dim=16,
                                          norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])
        model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # HF's init is N(0, 0.02) with ones for norms: randomise norms too, so a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.2)
    return model.eval()


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_hf_moe_logits_equal_and_roundtrip(kind, tmp_path):
    hf = _hf_model(kind)
    hf.config._attn_implementation = "eager"
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf_moe(tmp_path / "hf")
    assert ours.cfg.num_experts == 4 and ours.cfg.qk_norm == (kind == "qwen3_moe")
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits
        got = ours(tokens)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        save_hf_moe(ours, tmp_path / "back", kind)
        again = type(hf).from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
        torch.testing.assert_close(again(tokens).logits, want, rtol=0, atol=1e-5)


def test_hf_moe_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="model_type='llama'"):
        config_from_hf_moe({"model_type": "llama"})
    with pytest.raises(ValueError, match="decoder_sparse_step=2"):
        config_from_hf_moe({"model_type": "qwen3_moe", "decoder_sparse_step": 2})
