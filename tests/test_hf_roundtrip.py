"""Hugging Face weights in and out of a parallel layout (model/hf.py, train/export.py).

For a small Llama (multi-head attention) under FSDP over 4 ranks and a grouped-query, Llama 3 rope-scaled one
under TP2 x PP2 (the harder pair for the slicing: one kv head per TP rank; each model's tensor mapping and each
layout's slicing are exercised once, the other two pairs cost ~4 CPU-s and checked nothing more), built locally
with transformers and saved as safetensors:
1. `build_runner` with model.hf_path reads each rank's slices from the safetensors files into the meta-built
   model: every rank's parameters (gathered) equal the whole-folder load bitwise;
2. two AdamW steps, a DCP checkpoint;
3. `paratrain export` of that checkpoint, reloaded with transformers.AutoModelForCausalLM: logits equal to
   paratrain's model loaded from the same checkpoint within 1e-5 (fp32), and the layout's own eval loss after
   training equals that model's loss on the same batch (rtol 1e-5).
"""

import importlib.util
import json

import pytest
import torch
from test_model import LLAMA3_SCALING, _save_random_hf_llama

from paratrain.config import load_config

# Skipped without transformers, found without importing it: the pool's 4 ranks import this module for
# _train_and_save, which needs no transformers, and a module-level import cost each rank ~0.9 CPU-s.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")

MODELS = {"mha": dict(kv_heads=4), "gqa_llama3": dict(kv_heads=2, theta=500000.0, scaling=LLAMA3_SCALING)}
LAYOUTS = {"tp2_pp2": ["parallel.tp=2", "parallel.pp=2"], "fsdp4": ["parallel.dp=4", "parallel.dp_kind=\"fsdp\""]}
PAIRS = {"mha": "fsdp4", "gqa_llama3": "tp2_pp2"}  # model -> the layout it is loaded, trained and exported under


def _config(folder, layout: list[str]):
    return load_config(None, [f'model.hf_path="{folder}"', "train.seq_len=32", "train.global_batch=8",
                              "train.microbatch=2", "optim.warmup_steps=0", 'optim.schedule="constant"',
                              "optim.lr=1e-3", "train.seed=7", *layout])


def _batch(step: int, vocab: int):
    rows = torch.randint(0, vocab, (8, 33), generator=torch.Generator().manual_seed(100 + step))
    return rows[:, :-1], rows[:, 1:]


def _train_and_save(cases: list[tuple[str, list[str], str]]) -> list[dict]:
    """Per rank, per (hf folder, layout, checkpoint dir): sharded load, check, 2 steps, eval loss, save."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from paratrain.model.hf import load_hf_llama
    from paratrain.parallel.mesh import init_distributed, resolve_degrees
    from paratrain.train.checkpoint import CheckpointManager, state_module
    from paratrain.train.loop import build_optimizer, build_runner

    out = []
    for folder, layout, ckpt in cases:
        cfg = _config(folder, layout)
        env = init_distributed("cpu")
        runner = build_runner(cfg, env)
        whole = dict(load_hf_llama(folder, cfg.model_shape()).named_parameters())
        differ = [name for name, p in state_module(runner.parts).named_parameters()
                  if not torch.equal((p.full_tensor() if isinstance(p, DTensor) else p).detach(), whole[name])]
        optimizer = build_optimizer(runner, cfg.optim)
        per_rank = cfg.train.global_batch // runner.dp_size
        sl = slice(runner.dp_rank * per_rank, (runner.dp_rank + 1) * per_rank)
        for step in range(2):
            x, y = _batch(step, cfg.model_shape().vocab)
            runner.forward_backward(x[sl], y[sl])
            runner.clip_grad_norm_(cfg.optim.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        x, y = _batch(99, cfg.model_shape().vocab)
        eval_loss = float(runner.eval_loss(x[sl], y[sl]))
        mgr = CheckpointManager(ckpt, env.rank, layout=resolve_degrees(cfg.parallel, env.world_size),
                                log=lambda _msg: None)
        mgr.save(2, runner.parts, optimizer, {"step": 2})
        mgr.close()
        dist.barrier()
        out.append({"differ": differ, "eval_loss": eval_loss})
    return out


def test_load_sharded_train_export_reload(dist_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from paratrain.model.hf import expected_shapes
    from paratrain.model.llama import Llama
    from paratrain.train.export import export_hf, load_model_tensors, resolve_checkpoint

    cases, names = [], []
    for model_name, kwargs in MODELS.items():
        folder = tmp_path / model_name
        _save_random_hf_llama(folder, **kwargs)
        layout_name = PAIRS[model_name]
        cases.append((str(folder), LAYOUTS[layout_name], str(tmp_path / f"ckpt_{model_name}_{layout_name}")))
        names.append(f"{model_name} {layout_name}")
    per_rank = dist_run(4, _train_and_save, cases)
    for rank, results in enumerate(per_rank):
        for name, got in zip(names, results, strict=True):
            assert not got["differ"], f"{name} rank {rank}: sharded HF load differs from the whole load: {got['differ']}"

    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(5))
    for i, ((folder, layout, ckpt), name) in enumerate(zip(cases, names, strict=True)):
        cfg = _config(folder, layout)
        out = tmp_path / f"export_{i}"
        summary = export_hf(ckpt, cfg, out, max_shard_bytes=100_000)  # several files: the index is exercised
        assert summary["files"] > 1 and json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        ours = Llama(cfg.model_shape())
        storage, path = resolve_checkpoint(ckpt)
        ours.load_state_dict(load_model_tensors(storage, path, expected_shapes(cfg.model_shape())), strict=False)
        ours.eval()
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        x, y = _batch(99, cfg.model_shape().vocab)
        with torch.no_grad():
            torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5, msg=name)
            loss = torch.nn.functional.cross_entropy(ours(x).flatten(0, 1), y.flatten()).item()
        assert per_rank[0][i]["eval_loss"] == pytest.approx(loss, rel=1e-5), name
        assert not torch.equal(ours.tok_embeddings.weight, torch.zeros(1)), name


def test_export_refuses_a_checkpoint_of_another_model(tmp_path):
    from paratrain.train.export import _check_checkpoint_shapes

    class Reader:
        def read_metadata(self):
            from types import SimpleNamespace

            return SimpleNamespace(state_dict_metadata={"model.w": SimpleNamespace(size=torch.Size([2, 3]))})

    class Storage:
        def reader(self, _path):
            return Reader()

    with pytest.raises(ValueError, match=r"'w' has shape \(2, 3\), the config's model needs \(3, 3\)"):
        _check_checkpoint_shapes(Storage(), "ck", {"w": (3, 3)})
    with pytest.raises(ValueError, match=r"no tensor 'v'"):
        _check_checkpoint_shapes(Storage(), "ck", {"v": (3, 3)})


def test_export_cli_after_paratrain_train(tmp_path, capsys):
    """What a user runs: `paratrain train`, then `paratrain export` finds the run's config.toml above the
    checkpoint and its tokenizer; transformers loads model and tokenizer; logits as paratrain's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from paratrain.cli import main
    from paratrain.model.hf import expected_shapes
    from paratrain.model.llama import Llama
    from paratrain.train.export import load_model_tensors, resolve_checkpoint

    run = tmp_path / "run"
    sets = ['model.preset="tiny"', "model.layers=2", "model.vocab=512", f'data.prepared_dir="{tmp_path / "data"}"',
            "data.max_source_bytes=100000", "data.vocab_size=400", "train.steps=2", "train.seq_len=32",
            "train.global_batch=4", "train.microbatch=4", "train.eval_every=0", "train.progress=false",
            "metrics.tensorboard=false", f'metrics.run_dir="{run}"', 'train.device="cpu"']
    assert main(["train", *[a for s in sets for a in ("--set", s)]]) == 0
    capsys.readouterr()
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(run / "checkpoints"), "--hf-out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tokenizer"] and summary["config"].endswith("config.toml")
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("def main():\n    return 0\n")["input_ids"]
    assert 0 < len(ids) < 32 and max(ids) < 400
    cfg = load_config(str(run / "config.toml"))
    ours = Llama(cfg.model_shape())
    ours.load_state_dict(load_model_tensors(*resolve_checkpoint(str(run / "checkpoints")),
                                            expected_shapes(cfg.model_shape())), strict=False)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(x), hf(x).logits, rtol=1e-5, atol=1e-5)
    assert main(["export", "--checkpoint", str(tmp_path / "nowhere"), "--hf-out", str(out), "--set", "x=1"]) == 2


def _hf_build_full_copies(folder: str, layouts: list[list[str]]) -> list[list[str]]:
    """Per layout: sharded parameters of which a full-shape (or full-size flat) float tensor was seen while the
    runner was built from the Hugging Face folder (safetensors slices pass through the recorder as soon as any
    op touches them: the head unpermutation, the copy into the shard)."""
    from test_materialize import RecordRealTensors
    from torch.distributed.tensor import DTensor

    from paratrain.parallel.mesh import init_distributed
    from paratrain.train.checkpoint import state_module
    from paratrain.train.loop import build_runner

    out = []
    for layout in layouts:
        recorder = RecordRealTensors()
        with recorder:
            runner = build_runner(_config(folder, layout), init_distributed("cpu"))
        out.append([name for name, p in state_module(runner.parts).named_parameters()
                    if isinstance(p, DTensor) and p._local_tensor.numel() < p.numel()
                    and (tuple(p.shape) in recorder.shapes or (p.numel(),) in recorder.shapes)])
    return out


def test_sharded_hf_load_reads_no_full_tensor(dist_run, tmp_path):
    """Multi-head (kv_heads=4) so that no shard of one parameter has another's full shape (with kv_heads=2, a
    TP2 shard of wq is (32, 64), wk's full shape)."""
    _save_random_hf_llama(tmp_path, kv_heads=4)
    per_rank = dist_run(4, _hf_build_full_copies, str(tmp_path), list(LAYOUTS.values()))
    assert all(not copies for results in per_rank for copies in results), per_rank


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_safetensors_row_and_column_reads(tmp_path, dtype):
    from safetensors.torch import save_file

    from paratrain.model.hf import SafetensorsFile

    tensors = {"a": torch.randn(7, 5).to(dtype), "b": torch.randn(6).to(dtype)}
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"format": "pt"})
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert f.shape("a") == (7, 5) and set(f.keys()) == {"a", "b"}
    assert torch.equal(f.read("a", 2, 5), tensors["a"][2:5])
    assert torch.equal(f.read("a", 1, 6, (1, 4)), tensors["a"][1:6, 1:4])
    assert torch.equal(f.read("b", 3, 6), tensors["b"][3:6])
    assert f.read("a", 4, 4).shape == (0, 5)
