"""Export a training checkpoint (DCP, any layout) as a Hugging Face Llama folder.

Writes config.json, model-0000i-of-0000n.safetensors + model.safetensors.index.json (transformers' sharded
layout) and, when the run's prepared data has one, tokenizer.json + tokenizer_config.json, so that
`transformers.AutoModelForCausalLM.from_pretrained(out)` computes the same logits as paratrain.

DCP stores every tensor under its single-device name with its global shape whatever layout saved it, and loads
into one process without a process group: the export reads one output file's worth of tensors at a time
(`max_shard_bytes`), so its memory is bounded by one output shard, not the model.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from paratrain.config import TrainConfig, load_config
from paratrain.model.config import ModelConfig
from paratrain.model.hf import expected_shapes, hf_config, to_hf_tensor
from paratrain.train.run_files import run_tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HF_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}
DEFAULT_SHARD_BYTES = 2 * 2**30


def resolve_checkpoint(source: str) -> tuple[object, str]:
    """(storage, path) of `source`: a checkpoint folder, or a directory (its newest complete checkpoint);
    refused if its files do not match its manifest."""
    from paratrain.train.checkpoint import CheckpointError, CheckpointManager

    mgr = CheckpointManager(source, log=lambda _msg: None)
    storage, path = mgr._resolve_source(source)
    problem = mgr.verify(path, storage)
    if problem:
        raise CheckpointError(f"--checkpoint {source}: {problem}")
    return storage, path


def shard_progress(quiet: bool):
    """export_hf's progress(done, total): a line on stderr that counts the safetensors files (none if quiet)."""
    def progress(done: int, total: int) -> None:
        if not quiet:
            print(f"\rwriting safetensors {done}/{total}", end="" if done < total else "\n", file=sys.stderr,
                  flush=True)

    return progress


def print_export(summary: dict) -> None:
    print(f"exported {summary['checkpoint']} -> {summary['out']}: {summary['tensors']} tensors, "
          f"{summary['bytes'] / 2**20:,.1f} MiB in {summary['files']} file(s), {summary['dtype']}"
          + (", tokenizer.json" if summary["tokenizer"] else "") + f"; {summary['architecture']}")


def run_config_of(checkpoint: str, config: str | None = None, sets=()) -> tuple[TrainConfig, Path | str | None]:
    """A checkpoint's training config and its file: `config` with `sets`, else the config.toml `paratrain train`
    wrote into its run directory, looked for above the checkpoint (run_dir/checkpoints/step_N by default)."""
    if config is None and "://" not in checkpoint:
        config = next((p / "config.toml" for p in Path(checkpoint).absolute().parents[:3]
                       if (p / "config.toml").is_file()), None)
    if config is None and not sets:
        raise ValueError(f"--checkpoint {checkpoint}: no config.toml found above it; pass the training config with "
                         "--config (the model shape is not stored in the checkpoint)")
    return load_config(config, sets), config


def load_model_tensors(storage, path: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The model tensors `shapes` (single-device names) of a checkpoint, fp32, in this process."""
    import torch.distributed.checkpoint as dcp

    from paratrain.train.checkpoint import quiet_no_dist

    model = {name: torch.empty(shape, dtype=torch.float32) for name, shape in shapes.items()}
    with quiet_no_dist():
        dcp.load({"model": model}, storage_reader=storage.reader(path), no_dist=True)
    return model


def _groups(shapes: dict[str, tuple[int, ...]], max_bytes: int, elem_bytes: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = elem_bytes * int(torch.Size(shape).numel())
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def export_hf(checkpoint: str, cfg: TrainConfig, out: str | Path, dtype: str = "fp32",
              max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress=None) -> dict:
    """Write the Hugging Face folder `out` from `checkpoint`; returns a summary."""
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: allowed {', '.join(DTYPES)}")
    model_cfg: ModelConfig = cfg.model_shape()
    kind = moe_kind(model_cfg) if model_cfg.num_experts else None  # refused (one line) before any file is written
    storage, path = resolve_checkpoint(checkpoint)
    shapes = expected_shapes(model_cfg)
    _check_checkpoint_shapes(storage, path, shapes)
    out = Path(out)
    if kind is not None:
        return _export_moe(storage, path, cfg, kind, shapes, out, dtype, run_tokenizer(cfg, checkpoint))
    out.mkdir(parents=True, exist_ok=True)
    groups = _groups(shapes, max_shard_bytes, DTYPES[dtype].itemsize)
    weight_map, total = {}, 0
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        loaded = load_model_tensors(storage, path, {n: shapes[n] for n in names})
        tensors = dict(to_hf_tensor(n, loaded.pop(n).to(DTYPES[dtype]), model_cfg) for n in names)
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        readable_like_the_rest(out / file)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file))
        if progress is not None:
            progress(i + 1, len(groups))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(hf_config(model_cfg, HF_DTYPE_NAMES[dtype]), indent=2))
    tokenizer = _copy_tokenizer(run_tokenizer(cfg, checkpoint), out)
    return {"checkpoint": path, "out": str(out), "files": len(groups), "bytes": total, "tensors": len(weight_map),
            "dtype": dtype, "tokenizer": tokenizer, "architecture": "LlamaForCausalLM"}


def readable_like_the_rest(path: Path) -> None:
    """safetensors 0.8 writes through a temporary file created 0600 and renamed (safetensors issue #782): the
    weights were readable by their owner only, beside a config.json every user of a shared machine can read. Give
    them the mode a new file gets under this process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def moe_kind(cfg: ModelConfig) -> str:
    """The transformers architecture a mixture-of-experts model exports as: Qwen3-MoE (q/k norms) or Mixtral;
    one line naming what neither has (shared experts, dense first layers, ...)."""
    from paratrain.model.hf_moe import hf_moe_config

    kind = "qwen3_moe" if cfg.qk_norm else "mixtral"
    try:
        hf_moe_config(cfg, kind)
    except ValueError as exc:
        raise ValueError(f"model '{cfg.name}' has no Hugging Face counterpart: a mixture-of-experts model exports as "
                         f"Mixtral or Qwen3-MoE only, and {exc}") from None
    return kind


def _export_moe(storage, path: str, cfg: TrainConfig, kind: str, shapes, out: Path, dtype: str, tokenizer) -> dict:
    """A Mixtral / Qwen3-MoE folder (model/hf_moe.py's layout, one safetensors file): the whole model in this
    process, as `save_hf_moe` writes it."""
    from paratrain.model.hf import SafetensorsFile
    from paratrain.model.hf_moe import MOE_KINDS, save_hf_moe
    from paratrain.model.llama import Llama

    model_cfg = cfg.model_shape()
    model = Llama(model_cfg)
    missing = model.load_state_dict(load_model_tensors(storage, path, shapes), strict=False).missing_keys
    assert not set(missing) & set(shapes), missing  # every parameter is in `shapes`; buffers are built by Llama
    model.to(DTYPES[dtype])
    save_hf_moe(model, out, kind)
    readable_like_the_rest(out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": HF_DTYPE_NAMES[dtype]}, indent=2))
    written = SafetensorsFile(out / "model.safetensors").tensors
    total = sum(t["data_offsets"][1] - t["data_offsets"][0] for t in written.values())
    return {"checkpoint": path, "out": str(out), "files": 1, "bytes": total, "tensors": len(written),
            "dtype": dtype, "tokenizer": _copy_tokenizer(tokenizer, out), "architecture": MOE_KINDS[kind][2]}


def _check_checkpoint_shapes(storage, path: str, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every parameter of the config is in the checkpoint with its shape: one clear error otherwise."""
    metadata = storage.reader(path).read_metadata().state_dict_metadata
    for name, shape in shapes.items():
        key = f"model.{name}"
        if key not in metadata:
            raise ValueError(f"--checkpoint {path}: no tensor '{name}'; the checkpoint does not hold this model "
                             f"(wrong --config?)")
        got = tuple(metadata[key].size)
        if got != shape:
            raise ValueError(f"--checkpoint {path}: '{name}' has shape {got}, the config's model needs {shape} "
                             f"(wrong --config?)")


def _copy_tokenizer(src: Path | None, out: Path) -> str | None:
    """The run's tokenizer.json (`run_files.run_tokenizer`) + a tokenizer_config.json naming the fast tokenizer."""
    from paratrain.train.data import EOS_NAMES

    if src is None:
        return None
    shutil.copyfile(src, out / "tokenizer.json")
    vocab = json.loads(src.read_text()).get("model", {}).get("vocab", {})
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast"}
    eos = next((name for name in EOS_NAMES if name in vocab), None)
    if eos is not None:
        tok_cfg["eos_token"] = eos
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return str(src)
