"""Reference model: published parameter counts, Hugging Face equivalence, determinism."""

import pytest
import torch

from paratrain.model.config import PRESETS, ModelConfig, load_model_config
from paratrain.model.llama import Llama, cross_entropy_loss


@pytest.mark.parametrize(
    "name, published",
    [("llama2-7b", 6.74e9), ("llama3-8b", 8.03e9), ("llama3-70b", 70.6e9), ("llama3.1-405b", 405.9e9),
     ("llama2-13b", 13.0e9), ("llama2-70b", 69.0e9), ("llama3.2-3b", 3.21e9)],
)
def test_preset_parameter_counts_match_published(name, published):
    assert abs(PRESETS[name].num_params() / published - 1) < 0.005


def test_instantiated_parameter_count_equals_formula():
    cfg = PRESETS["tiny"]
    assert sum(p.numel() for p in Llama(cfg).parameters()) == cfg.num_params()
    tied = cfg.model_copy(update={"tie_embeddings": True})
    assert sum(p.numel() for p in Llama(tied).parameters()) == tied.num_params()


def test_flops_per_token_is_six_n_plus_attention():
    cfg = PRESETS["llama2-7b"]
    seq = 4096
    expected = 6 * cfg.num_matmul_params() + 12 * cfg.layers * seq * cfg.hidden
    assert cfg.train_flops_per_token(seq) == pytest.approx(expected)


def test_invalid_shape_is_refused_with_the_field():
    with pytest.raises(ValueError, match="heads"):
        ModelConfig(layers=2, hidden=100, heads=3, vocab=10)


def test_model_toml(tmp_path):
    f = tmp_path / "m.toml"
    f.write_text('arch = "gpt"\nlayers = 2\nhidden = 64\nheads = 4\nvocab = 100\n')
    cfg = load_model_config(f)
    assert cfg.arch == "gpt" and cfg.ffn == 256
    with pytest.raises(ValueError, match="not a preset"):
        load_model_config(tmp_path / "missing.toml")


def test_same_seed_same_weights_and_loss():
    cfg = PRESETS["tiny"]
    tokens = torch.randint(0, cfg.vocab, (2, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(2):
        m = Llama(cfg)
        m.init_weights(seed=7)
        losses.append(cross_entropy_loss(m(tokens[:, :-1]), tokens[:, 1:]).item())
    assert losses[0] == losses[1]
    assert abs(losses[0] - torch.log(torch.tensor(float(cfg.vocab))).item()) < 0.5  # near-uniform at init


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}  # short, so the 40-token test sequence spans all bands


def _save_random_hf_llama(folder, tie: bool = False, kv_heads: int = 2, vocab: int = 300, theta: float = 10000.0,
                          scaling: dict | None = None, legacy_keys: bool = False):
    """A small random Hugging Face LlamaForCausalLM, built locally (no download), saved as safetensors.

    legacy_keys: rewrite config.json as transformers 4.x writes it (top-level rope_theta / rope_scaling, what
    Meta's released checkpoints carry) instead of 5.x's rope_parameters."""
    import json

    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=theta,
        rope_scaling=scaling, tie_word_embeddings=tie, attention_bias=False, mlp_bias=False,
    )
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # HF inits norms to 1; randomise them so a wrong norm mapping would show
        for name, p in hf_model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf_model.save_pretrained(folder, safe_serialization=True)
    if legacy_keys:
        path = folder / "config.json"
        data = json.loads(path.read_text())
        rope = data.pop("rope_parameters")
        data["rope_theta"] = rope.pop("rope_theta")
        data["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
        path.write_text(json.dumps(data))
    return hf_model


@pytest.mark.parametrize("tie, kv_heads, theta, scaling, legacy_keys", [
    (False, 2, 10000.0, None, False),
    (True, 4, 10000.0, None, False),
    (False, 2, 500000.0, None, True),  # Llama 3's theta, config.json as Meta's checkpoints have it
    (False, 2, 500000.0, LLAMA3_SCALING, False),  # Llama 3.1's long-context frequency scaling
    (False, 2, 500000.0, LLAMA3_SCALING, True),
])
def test_logits_equal_huggingface_llama(tmp_path, tie, kv_heads, theta, scaling, legacy_keys):
    from paratrain.model.hf import load_hf_llama

    hf_model = _save_random_hf_llama(tmp_path, tie, kv_heads, theta=theta, scaling=scaling, legacy_keys=legacy_keys)
    ours = load_hf_llama(tmp_path).eval()
    assert ours.cfg.rope_theta == theta and (ours.cfg.rope_scaling is None) == (scaling is None)
    tokens = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        ref = hf_model(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("key, value", [("attention_bias", True), ("hidden_act", "gelu"), ("head_dim", 32),
                                        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0})])
def test_huggingface_config_we_cannot_reproduce_is_refused(tmp_path, key, value):
    import json

    from paratrain.model.hf import config_from_hf

    _save_random_hf_llama(tmp_path, legacy_keys=True)
    data = json.loads((tmp_path / "config.json").read_text())
    data[key] = value
    (tmp_path / "config.json").write_text(json.dumps(data))
    shown = "rope_type='yarn'" if key == "rope_scaling" else f"{key}={value!r}"
    with pytest.raises(ValueError, match=f"config.json {shown} is not supported; allowed: "):
        config_from_hf(tmp_path)


def test_train_from_huggingface_folder(tmp_path):
    """model.hf_path is a user feature: `paratrain train` starts from the folder's weights, so its first loss
    is Hugging Face's own cross-entropy on the same first batch."""
    import json

    import torch.nn.functional as F

    from paratrain.cli import main
    from paratrain.config import load_config
    from paratrain.train.data import GlobalSampler, TokenWindows
    from paratrain.train.data.tokenize import train_bpe

    hf_model = _save_random_hf_llama(tmp_path / "hf", vocab=512)
    # the model folder's own tokenizer (data.tokenizer='auto' takes it): 512 tokens for the 512-row embedding
    train_bpe(["def main():\n    return sum(range(10))\n" * 200, "hello world " * 300], 512).save(
        str(tmp_path / "hf" / "tokenizer.json"))
    sets = [f'model.hf_path="{tmp_path / "hf"}"', f'data.prepared_dir="{tmp_path / "data"}"',
            "data.max_source_bytes=200000", "train.steps=2", "train.seq_len=32",
            "train.global_batch=4", "train.microbatch=4", "train.eval_every=0", "train.progress=false",
            "metrics.tensorboard=false", f'metrics.run_dir="{tmp_path / "run"}"', "checkpoint.save_final=false",
            'train.device="cpu"']
    args = ["train", *[a for s in sets for a in ("--set", s)], "--summary-json", str(tmp_path / "s.json")]
    assert main(args) == 0
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["model_shape"]["vocab"] == 512 and summary["model_shape"]["layers"] == 2

    cfg = load_config(None, sets)
    windows = TokenWindows(cfg.data.prepared_dir, "train", cfg.train.seq_len)
    x, y = windows.batch(GlobalSampler(windows.num_samples, 4, cfg.train.seed).global_indices(0))
    with torch.no_grad():
        expected = F.cross_entropy(hf_model(x).logits.flatten(0, 1), y.flatten()).item()
    assert summary["first_loss"] == pytest.approx(expected, rel=1e-5)


def test_huggingface_folder_refuses_shape_overrides(tmp_path):
    from paratrain.config import load_config

    _save_random_hf_llama(tmp_path)
    with pytest.raises(ValueError, match=r"model.layers=3 with model.hf_path=.*allowed with hf_path: .*max_seq"):
        load_config(None, [f'model.hf_path="{tmp_path}"', "model.layers=3"])
    cfg = load_config(None, [f'model.hf_path="{tmp_path}"', "model.max_seq=64", "train.seq_len=64"])
    assert cfg.model_shape().max_seq == 64 and cfg.model_shape().hidden == 64
    with pytest.raises(ValueError, match=r"model.hf_path=.*no config.json"):
        load_config(None, [f'model.hf_path="{tmp_path / "nowhere"}"'])
