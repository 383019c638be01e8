"""`paratrain generate`: text (or token ids) from a trained checkpoint or a Hugging Face folder, with a KV
cache; tensor parallel when launched by torchrun (tp = the number of ranks)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

HELP = """\
Generate from a model trained by paratrain (a checkpoint of its run) or imported (model.hf_path), with a KV
cache: greedy (--temperature 0, the default) or sampled (--temperature/--top-k/--top-p, --seed). Several
--prompt flags make one batch (left-padded). Under torchrun every rank holds 1/N of the weights (tensor
parallelism over all N ranks). The measured prefill and per-step decode times go to --summary-json (the
serving model's calibration input, docs/serving.md).

  paratrain generate --config configs/tiny.toml --set metrics.run_dir=runs/demo --checkpoint latest \\
      --prompt "def main(" --max-new-tokens 40
  paratrain generate --set model.hf_path=path/to/llama --set data.tokenizer=path/to/llama/tokenizer.json \\
      --prompt "The capital of France is" --prompt "1, 2, 3," --max-new-tokens 16 --json
  torchrun --nproc-per-node 2 -m paratrain generate --set model.hf_path=path/to/llama --prompt-ids 1,15043
"""


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text with a KV cache (checkpoint or Hugging Face model; TP under torchrun)",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="training config TOML (the model and tokenizer it names)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--checkpoint", default=None,
                   help="'latest' (newest complete checkpoint of the run's checkpoint.dir) or a step folder; "
                        "not needed with model.hf_path")
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (needs data.tokenizer); repeatable")
    p.add_argument("--prompt-ids", action="append", default=[], metavar="ID,ID,...", help="a prompt as token ids")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence each step (baseline)")
    p.add_argument("--summary-json", default=None, help="write the timings and tokens as JSON (main rank)")
    p.add_argument("--json", action="store_true", help="print only JSON")
    p.set_defaults(func=run_generate)


def _tokenizer(cfg):
    """The run's tokenizer.json: data.tokenizer, or the one `data prepare` wrote; None if neither exists."""
    from tokenizers import Tokenizer

    for path in (cfg.data.tokenizer, str(Path(cfg.data.prepared_dir) / "tokenizer.json")):
        if path != "train" and Path(path).is_file():
            return Tokenizer.from_file(path)
    return None


def _eos_id(tok) -> int | None:
    from paratrain.train.data import EOS_NAMES

    if tok is None:
        return None
    for name in EOS_NAMES:
        if (i := tok.token_to_id(name)) is not None:
            return i
    return None


def _prompts(args, tok, vocab: int) -> list[list[int]]:
    from paratrain.cli import UserError

    prompts = []
    for text in args.prompt:
        if tok is None:
            raise UserError("--prompt needs a tokenizer: set data.tokenizer to a tokenizer.json (or run `paratrain "
                            "data prepare`), or pass --prompt-ids")
        prompts.append(tok.encode(text).ids)
    for ids in args.prompt_ids:
        try:
            prompts.append([int(x) for x in ids.split(",") if x.strip()])
        except ValueError:
            raise UserError(f"--prompt-ids = {ids!r}: allowed: comma-separated token ids, e.g. 1,15043,29892") from None
    if not prompts or any(not p for p in prompts):
        raise UserError("give at least one non-empty --prompt or --prompt-ids")
    bad = [i for p in prompts for i in p if not 0 <= i < vocab]
    if bad:
        raise UserError(f"--prompt-ids: token id {bad[0]} outside the model's vocabulary [0, {vocab})")
    return prompts


def load_model(cfg, checkpoint: str | None):
    """The single-device Llama with the run's weights: model.hf_path, or a checkpoint of the run (resharded
    to one device by DCP, whatever layout saved it)."""
    from paratrain.cli import UserError
    from paratrain.model.llama import Llama

    shape = cfg.model_shape()
    if cfg.model.hf_path:
        from paratrain.model.hf import load_hf_llama

        return load_hf_llama(cfg.model.hf_path, shape)
    if checkpoint is None:
        raise UserError("no weights: pass --checkpoint latest|STEP_FOLDER (a run's checkpoint) or set model.hf_path")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from paratrain.train.checkpoint import CheckpointManager

    directory = cfg.checkpoint.dir or str(Path(cfg.metrics.run_dir) / "checkpoints")
    manager = CheckpointManager(directory, log=lambda _msg: None)
    path = manager.latest() if checkpoint == "latest" else checkpoint
    if path is None:
        raise UserError(f"--checkpoint latest: no complete checkpoint in {directory}")
    model = Llama(shape)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, storage_reader=manager.storage.reader(path), no_dist=True)
    set_model_state_dict(model, state["model"])
    return model


def run_generate(args) -> int:
    from paratrain.cli import UserError
    from paratrain.config import ParallelSection, load_config
    from paratrain.infer.generate import Sampling, generate
    from paratrain.parallel.mesh import build_mesh, init_distributed, shutdown_distributed

    cfg = load_config(args.config, args.set)
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens = {args.max_new_tokens}: must be >= 1")
    tok = _tokenizer(cfg)
    prompts = _prompts(args, tok, cfg.model_shape().vocab)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        from paratrain.config.layout import check_tp_layout

        check_tp_layout(cfg.model_shape(), world, False, 1)  # before any process group or weights
    env = init_distributed(cfg.train.device)
    model = load_model(cfg, args.checkpoint)
    if world > 1:
        from paratrain.parallel.tensor import apply_tp

        model = apply_tp(model, build_mesh(ParallelSection(tp=world), env)["tp"], sp=False, loss_parallel=False)
    model.to(env.device)
    result = generate(model, prompts, args.max_new_tokens, sampling, eos_id=_eos_id(tok),
                      use_cache=not args.no_cache)
    summary = generation_summary(cfg.model_shape(), result, world, env.device.type, sampling,
                                 next(model.parameters()).dtype)
    if world > 1:
        shutdown_distributed()
    if env.rank == 0:
        if tok is not None:
            summary["texts"] = [tok.decode(t) for t in result.tokens]
        if args.summary_json:
            Path(args.summary_json).write_text(json.dumps(summary, indent=2))
        if args.json:
            print(json.dumps(summary))
        else:
            _print(summary)
    return 0


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


def _print(s: dict) -> None:
    print(f"{s['model_shape']['name']}: batch {s['batch']}, prompts {s['prompt_tokens']} tokens, tp {s['tp']} "
          f"({s['device']}), {'KV cache' if s['use_cache'] else 'no cache (recompute)'}")
    print(f"prefill {s['prefill_s'] * 1e3:.1f} ms; decode {s['decode_steps']} steps, "
          f"{s['decode_s_per_step'] * 1e3:.2f} ms per step")
    for i, toks in enumerate(s["tokens"]):
        text = s.get("texts", [None] * len(s["tokens"]))[i]
        print(f"[{i}] {text!r}" if text is not None else f"[{i}] {toks}")
