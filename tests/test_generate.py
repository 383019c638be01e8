"""`paratrain generate` and the KV cache (infer/): token for token equal to transformers' greedy generation
on a small random Llama built here (no hub), in one process and tensor parallel over 2 gloo ranks."""

from __future__ import annotations

import json

import pytest
import torch

from paratrain.cli import main
from paratrain.infer.generate import Sampling, generate, left_pad
from paratrain.infer.kv_cache import KVCache
from paratrain.model.hf import load_hf_llama

PROMPTS = [[5, 17, 42, 9, 100, 3], [7, 8, 9], [200, 1, 2, 3, 4, 5, 6, 7]]
NEW = 16


def _hf_folder(path, kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(kv_heads)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.1)
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(path)
    return hf


def _hf_greedy(hf, prompts):
    """transformers' own greedy generation of the left-padded batch."""
    tokens, valid = left_pad(prompts)
    out = hf.generate(tokens, attention_mask=valid.long(), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return out[:, tokens.shape[1]:].tolist()


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """(folder, transformers' greedy tokens) for a GQA model (2 kv heads) and an MQA one (1 kv head)."""
    out = {}
    for kv in (2, 1):
        folder = tmp_path_factory.mktemp(f"hf_kv{kv}")
        out[kv] = (str(folder), _hf_greedy(_hf_folder(folder, kv), PROMPTS))
    return out


def test_greedy_equals_transformers_single_process(hf_models):
    for folder, expected in hf_models.values():
        model = load_hf_llama(folder)
        assert generate(model, PROMPTS, NEW).tokens == expected
        # recomputation without the cache gives the same tokens
        assert generate(model, PROMPTS, NEW, use_cache=False).tokens == expected
        # one prompt alone: as in the batch (left padding does not change a sequence's tokens)
        assert generate(model, [PROMPTS[1]], NEW).tokens == [expected[1]]


def _tp_generate(folder: str) -> list[list[int]]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from paratrain.parallel.tensor import apply_tp

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = apply_tp(load_hf_llama(folder), mesh, sp=False, loss_parallel=False)
    local = model.layers["0"].attention.wq.weight.to_local().shape[0]
    assert local == model.cfg.heads * model.cfg.head_dim // 2  # really sharded
    return generate(model, PROMPTS, NEW).tokens


def test_greedy_equals_transformers_tp2(hf_models, dist_run):
    for folder, expected in hf_models.values():  # kv 2: kv heads split; kv 1: the kv head replicated
        assert dist_run(2, _tp_generate, folder) == [expected, expected]


def test_sampling_is_seeded_and_respects_top_k(hf_models):
    model = load_hf_llama(hf_models[2][0])
    a = generate(model, PROMPTS, 8, Sampling(temperature=1.0, top_k=5, seed=3))
    assert a.tokens == generate(model, PROMPTS, 8, Sampling(temperature=1.0, top_k=5, seed=3)).tokens
    assert a.tokens != generate(model, PROMPTS, 8, Sampling(temperature=1.0, top_k=5, seed=4)).tokens
    # top_k = 1 is greedy whatever the temperature
    assert generate(model, PROMPTS, 8, Sampling(temperature=2.0, top_k=1)).tokens == generate(model, PROMPTS, 8).tokens
    with pytest.raises(ValueError, match="top_p = 0"):
        Sampling(top_p=0)


def test_kv_cache_mask_and_limits():
    cache = KVCache(2, 6, torch.tensor([[False, True, True, True, True, True], [True] * 6]))
    m = cache.mask(3, torch.device("cpu"))[:, 0]
    assert m.shape == (2, 3, 3)
    assert not m[0, 1, 0] and m[0, 1, 1] and not m[0, 1, 2]  # padding hidden, causal
    assert m[0, 0, 0]  # a padding query sees itself (finite rows)
    cache.advance(3)
    assert cache.mask(1, torch.device("cpu"))[1, 0, 0].all()  # the next token sees all four
    with pytest.raises(ValueError, match="KV cache full"):
        cache.write(0, torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 4, 8))


def test_generate_cli_from_hf_folder_and_checkpoint(hf_models, tmp_path, capsys):
    folder, expected = hf_models[2]
    summary = tmp_path / "gen.json"
    ids = ["--prompt-ids", ",".join(map(str, PROMPTS[0]))]
    assert main(["generate", "--set", f"model.hf_path='{folder}'", *ids, "--max-new-tokens", str(NEW),
                 "--summary-json", str(summary), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == [expected[0]] and json.loads(summary.read_text())["decode_steps"] == NEW - 1
    assert out["prefill_s"] > 0 and out["decode_s_per_step"] > 0 and out["kind"] == "generate"
    # a checkpoint written by paratrain's checkpoint manager, loaded back by --checkpoint latest
    from paratrain.train.checkpoint import CheckpointManager

    model = load_hf_llama(folder)
    opt = torch.optim.AdamW(model.parameters())
    run = tmp_path / "run"
    CheckpointManager(str(run / "checkpoints"), log=lambda _m: None).save(1, [model], opt, {"step": 1})
    shape = model.cfg
    sets = [f"model.layers={shape.layers}", f"model.hidden={shape.hidden}", f"model.heads={shape.heads}",
            f"model.kv_heads={shape.n_kv_heads}", f"model.ffn_hidden={shape.ffn}", f"model.vocab={shape.vocab}",
            f"model.max_seq={shape.max_seq}", f"metrics.run_dir='{run}'"]
    args = ["generate", *sum((["--set", s] for s in sets), []), *ids, "--max-new-tokens", str(NEW), "--json"]
    assert main([*args, "--checkpoint", "latest"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == [expected[0]]
    assert main(args) == 2  # no weights named
    assert "no weights" in capsys.readouterr().err
    assert main([*args[:-1], "--checkpoint", "latest", "--prompt-ids", "1,x"]) == 2


def test_a_hugging_face_folder_never_takes_the_prepared_runs_tokenizer(hf_models, tmp_path):
    """`generate` with model.hf_path once stopped one token early after `make demo`: it took the demo's prepared
    tokenizer (another vocabulary) for its end-of-sequence id. The folder's own tokenizer.json is used, else none."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from paratrain.config import load_config
    from paratrain.infer.session import load_tokenizer

    prepared = tmp_path / "prepared"
    prepared.mkdir()
    Tokenizer(WordLevel({"<unk>": 0, "<eos>": 1}, unk_token="<unk>")).save(str(prepared / "tokenizer.json"))
    folder, _ = hf_models[2]
    hf_cfg = load_config(None, [f"model.hf_path='{folder}'", f"data.prepared_dir='{prepared}'"])
    assert load_tokenizer(hf_cfg) is None  # the folder has no tokenizer.json
    run_cfg = load_config(None, [f"data.prepared_dir='{prepared}'"])
    assert load_tokenizer(run_cfg).get_vocab_size() == 2  # a paratrain run's checkpoint: its prepared tokenizer
