"""`paratrain export`: a training checkpoint (any layout) -> a Hugging Face Llama folder."""

from __future__ import annotations

import argparse
import json
import sys

HELP = """\
Write a Hugging Face Llama folder (config.json, sharded safetensors + index, tokenizer if the run has one) from a
paratrain checkpoint saved under any layout (TP, PP, FSDP, ...). transformers loads it with
AutoModelForCausalLM.from_pretrained(DIR) and computes the same logits.

  paratrain export --checkpoint runs/default/checkpoints --hf-out out/my-llama
  paratrain export --checkpoint runs/default/checkpoints/step_00000100 --hf-out out/my-llama --dtype bf16
  paratrain export --checkpoint s3://bucket/run/checkpoints --config run.toml --hf-out out/my-llama

--checkpoint: a checkpoint folder (step_*) or a checkpoint directory (its newest complete checkpoint); it is
verified against its manifest first. The model shape comes from the run's config.toml (found above the
checkpoint, where `paratrain train` writes it) or --config/--set. Runs in one process, no process group; memory:
one output shard (--max-shard-gb).
"""


def register(sub) -> None:
    p = sub.add_parser("export", help="export a checkpoint as a Hugging Face Llama folder", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="checkpoint folder or directory (local or s3://)")
    p.add_argument("--hf-out", required=True, help="output folder")
    p.add_argument("--config", help="the training config (default: the run's config.toml above the checkpoint)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="dtype of the exported weights")
    p.add_argument("--max-shard-gb", type=float, default=2.0, help="size of one safetensors file (GiB)")
    p.add_argument("--json", action="store_true", help="print only a JSON summary")
    p.set_defaults(func=run_export)


def run_export(args) -> int:
    from paratrain.cli import UserError
    from paratrain.config import load_config
    from paratrain.train.export import export_hf, run_config_of

    if args.max_shard_gb <= 0:
        raise UserError(f"--max-shard-gb {args.max_shard_gb}: must be > 0")
    config = args.config or run_config_of(args.checkpoint)
    if config is None and not args.set:
        raise UserError(f"--checkpoint {args.checkpoint}: no config.toml found above it; pass the training config "
                        f"with --config (the model shape is not stored in the checkpoint)")
    cfg = load_config(config, args.set)

    def progress(done: int, total: int) -> None:
        if not args.json:
            print(f"\rwriting safetensors {done}/{total}", end="" if done < total else "\n", file=sys.stderr,
                  flush=True)

    summary = export_hf(args.checkpoint, cfg, args.hf_out, args.dtype, int(args.max_shard_gb * 2**30), progress)
    summary["config"] = str(config) if config else None
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"exported {summary['checkpoint']} -> {summary['out']}: {summary['tensors']} tensors, "
              f"{summary['bytes'] / 2**20:,.1f} MiB in {summary['files']} file(s), {summary['dtype']}"
              + (", tokenizer.json" if summary["tokenizer"] else ""))
    return 0
