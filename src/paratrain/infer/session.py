"""What `paratrain generate` loads (the run's weights and tokenizer, the prompts) and what it records (the
summary that calibrates the serving model)."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(cfg, checkpoint: str | None = None):
    """The weights' tokenizer.json: a Hugging Face folder's own (model.hf_path), else data.tokenizer, else (for a
    paratrain run's checkpoint) the one the run trained with (`train.run_files.run_tokenizer`: kept in its run
    directory; the shared prepared folder may since hold another); None if none exists. A Hugging Face folder
    never borrows the prepared run's tokenizer: that vocabulary (and its end-of-sequence id) is another model's."""
    from tokenizers import Tokenizer

    from paratrain.train.run_files import run_tokenizer

    hf_path = cfg.model.hf_path
    paths = [str(Path(hf_path) / "tokenizer.json")] if hf_path else []
    paths.append(cfg.data.tokenizer)
    if not hf_path and (kept := run_tokenizer(cfg, checkpoint)) is not None:
        paths.append(str(kept))
    for path in paths:
        if path != "train" and Path(path).is_file():
            return Tokenizer.from_file(path)
    return None


def eos_id(tok) -> int | None:
    from paratrain.train.data import EOS_NAMES

    if tok is None:
        return None
    for name in EOS_NAMES:
        if (i := tok.token_to_id(name)) is not None:
            return i
    return None


def encode_prompts(texts: list[str], id_lists: list[str], tok, vocab: int) -> list[list[int]]:
    """The prompts as token ids: each text through the tokenizer, each ID,ID,... as given; checked."""
    prompts = []
    for text in texts:
        if tok is None:
            raise ValueError("--prompt needs a tokenizer: set data.tokenizer to a tokenizer.json (or run `paratrain "
                            "data prepare`), or pass --prompt-ids")
        prompts.append(tok.encode(text).ids)
    for ids in id_lists:
        try:
            prompts.append([int(x) for x in ids.split(",") if x.strip()])
        except ValueError:
            raise ValueError(f"--prompt-ids = {ids!r}: allowed: comma-separated token ids, e.g. 1,15043,29892") from None
    if not prompts or any(not p for p in prompts):
        raise ValueError("give at least one non-empty --prompt or --prompt-ids")
    bad = [i for p in prompts for i in p if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"--prompt-ids: token id {bad[0]} outside the model's vocabulary [0, {vocab})")
    return prompts


def load_model(cfg, checkpoint: str | None):
    """The single-device Llama with the run's weights: model.hf_path, or a checkpoint of the run (resharded
    to one device by DCP, whatever layout saved it)."""
    from paratrain.model.llama import Llama

    shape = cfg.model_shape()
    if cfg.model.hf_path and shape.num_experts:  # Mixtral, Qwen3-MoE: read whole (model/hf_moe.py)
        from paratrain.model.hf_moe import load_hf_moe

        return load_hf_moe(cfg.model.hf_path)
    if cfg.model.hf_path:
        from paratrain.model.hf import load_hf_llama

        return load_hf_llama(cfg.model.hf_path, shape)
    if checkpoint is None:
        raise ValueError("no weights: pass --checkpoint latest|STEP_FOLDER (a run's checkpoint) or set model.hf_path")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from paratrain.train.checkpoint import quiet_no_dist
    from paratrain.train.export import resolve_checkpoint

    directory = cfg.checkpoint.dir or str(Path(cfg.metrics.run_dir) / "checkpoints")
    # latest: the run's newest complete one; a folder or directory: as given; either checked against its manifest
    # (a mistyped path or a damaged checkpoint is one line, not DCP's traceback)
    storage, path = resolve_checkpoint(directory if checkpoint == "latest" else checkpoint)
    model = Llama(shape)
    state = {"model": get_model_state_dict(model)}
    with quiet_no_dist():
        dcp.load(state, storage_reader=storage.reader(path), no_dist=True)
    set_model_state_dict(model, state["model"])
    return model


def generate_from_config(cfg, checkpoint: str | None, texts: list[str], id_lists: list[str], max_new_tokens: int,
                         sampling, use_cache: bool = True) -> dict | None:
    """Generate from the run's weights: one process, or tensor parallel over every rank under torchrun. The
    summary (with the decoded texts when there is a tokenizer) on rank 0, None on the other ranks."""
    import os

    from paratrain.config import ParallelSection
    from paratrain.infer.generate import generate
    from paratrain.parallel.mesh import build_mesh, init_distributed, shutdown_distributed

    tok = load_tokenizer(cfg, checkpoint)
    prompts = encode_prompts(texts, id_lists, tok, cfg.model_shape().vocab)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        from paratrain.config import check_tp_layout

        check_tp_layout(cfg.model_shape(), world, False, 1)  # before any process group or weights
    env = init_distributed(cfg.train.device)
    model = load_model(cfg, checkpoint)
    if world > 1:
        from paratrain.parallel.tensor import apply_tp

        model = apply_tp(model, build_mesh(ParallelSection(tp=world), env)["tp"], sp=False, loss_parallel=False)
    model.to(env.device)
    result = generate(model, prompts, max_new_tokens, sampling, eos_id=eos_id(tok), use_cache=use_cache)
    summary = generation_summary(cfg.model_shape(), result, world, env.device.type, sampling,
                                 next(model.parameters()).dtype)
    if world > 1:
        shutdown_distributed()
    if env.rank != 0:
        return None
    if tok is not None:
        summary["texts"] = [tok.decode(t) for t in result.tokens]
    return summary


DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16"}


def generation_summary(shape, result, tp: int, device: str, sampling, dtype) -> dict:
    """What a run records for calibration (as a training run's summary): shape, layout, device, the measured
    prefill of the padded batch and the mean decode step at that batch and context
    (plan.serve_fit.measurements_from_generate reads it)."""
    return {"kind": "generate", "model_shape": shape.model_dump(), "tp": tp, "world_size": tp, "device": device,
            "dtype": DTYPE_NAMES.get(str(dtype), str(dtype)),
            "batch": result.batch, "prompt_tokens": result.prompt_tokens,
            "padded_prompt_tokens": result.padded_prompt_tokens, "prefill_s": result.prefill_s,
            "decode_steps": result.decode_steps, "decode_s_per_step": result.decode_s_per_step,
            "decode_s": result.decode_s, "mean_context": result.padded_prompt_tokens + result.decode_steps / 2,
            "use_cache": result.use_cache, "kv_cache_bytes_per_rank": result.cache_bytes,
            "sampling": vars(sampling), "tokens": result.tokens}


def print_generation(s: dict) -> None:
    print(f"{s['model_shape']['name']}: batch {s['batch']}, prompts {s['prompt_tokens']} tokens, tp {s['tp']} "
          f"({s['device']}), {'KV cache' if s['use_cache'] else 'no cache (recompute)'}")
    print(f"prefill {s['prefill_s'] * 1e3:.1f} ms; decode {s['decode_steps']} steps, "
          f"{s['decode_s_per_step'] * 1e3:.2f} ms per step")
    for i, toks in enumerate(s["tokens"]):
        text = s.get("texts", [None] * len(s["tokens"]))[i]
        print(f"[{i}] {text!r}" if text is not None else f"[{i}] {toks}")
