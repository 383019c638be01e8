"""`paratrain export`: a training checkpoint (any layout) -> a Hugging Face Llama folder."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.cli import ConfigArgs, Output, UserError, command, opt, show


@dataclass(kw_only=True)
class ExportArgs(ConfigArgs, Output):
    checkpoint: str = opt("checkpoint folder or directory (local or s3://)", required=True)
    hf_out: str = opt("output folder", required=True, metavar="DIR")
    config: str | None = opt("the training config (default: the run's config.toml above the checkpoint)",
                             short="-c", metavar="FILE")
    dtype: str = opt("dtype of the exported weights", "fp32", choices=["fp32", "bf16"])
    max_shard_gib: float = opt("size of one safetensors file", 2.0, gt=0)


@command("export", ExportArgs, "export a checkpoint as a Hugging Face Llama folder")
def run_export(args) -> None:
    from paratrain.config import load_config
    from paratrain.train.export import export_hf, print_export, run_config_of, shard_progress

    config = args.config or run_config_of(args.checkpoint)
    if config is None and not args.set:
        raise UserError(f"--checkpoint {args.checkpoint}: no config.toml found above it; pass the training config "
                        f"with --config (the model shape is not stored in the checkpoint)")
    cfg = load_config(config, args.set)
    summary = export_hf(args.checkpoint, cfg, args.hf_out, args.dtype, int(args.max_shard_gib * 2**30),
                        shard_progress(quiet=args.json))
    summary["config"] = str(config) if config else None
    show(args, summary, lambda: print_export(summary))
