"""`paratrain train`, `data prepare`, `config`, `checkpoint list|verify` and `export`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from paratrain.cli import ConfigArgs, Output, RunFiles, UserError, command, opt, print_json, show
from paratrain.config import load_config, reference_markdown, resolved_config
from paratrain.train.checkpoint_info import describe_dir, print_checkpoints, verify_checkpoint
from paratrain.train.faults import FaultInjector
from paratrain.train.summary import print_summary

GROUPS = [("data", "prepare training data (tokenize into a memory-mapped token file)"),
          ("checkpoint", "list and verify training checkpoints")]


@command("train", (ConfigArgs, RunFiles, Output), "train a model (single process or under torchrun)")
def run_train(args, faults=None) -> int:
    """`paratrain train`. `faults`: test-only fault injection; by default what PARATRAIN_FAULT_KILL asks for
    (parsed here, before any work)."""
    from paratrain.train.loop import train_process

    cfg = load_config(args.config, args.set)  # fails here, before any process group or data work
    faults = faults if faults is not None else FaultInjector.from_env(os.environ)  # a malformed spec, too
    summary = train_process(cfg, args.resume_from, faults)
    ran = not summary.get("nothing_to_train")  # said in one line by the loop; no summary of a run that did not run
    if summary["rank"] == 0:
        print_json(summary, indent=None) if args.json else print_summary(summary) if ran else None  # one line
        if args.summary_json and ran:
            Path(args.summary_json).write_text(json.dumps(summary, indent=2))
    for error in summary.get("errors", []):  # e.g. the final save failed: the run did not end well
        print(f"paratrain train: error: {error}", file=sys.stderr)
    return 1 if summary.get("errors") else 0


@command("data prepare", (ConfigArgs, Output), "tokenize data.source into data.prepared_dir",
         force=(bool, opt("re-tokenize even if already prepared")),
         progress=(str | None, opt("progress bar with tokens/s on stderr (default: when stderr is a terminal)",
                                   choices=("on", "off"))))
def run_prepare(args) -> None:
    from paratrain.train.data import prepare, read_meta, summary_line  # tokenizers: not for --help
    from paratrain.train.data.tokenize import check_model_tokenizer

    cfg = load_config(args.config, args.set)
    if cfg.model.hf_path:
        check_model_tokenizer(cfg.data, cfg.model.hf_path, cfg.model_shape().vocab)
    out = prepare(cfg.data, force=args.force, hf_path=cfg.model.hf_path, progress={"on": True, "off": False}.get(
        args.progress), log=lambda msg: print(msg, file=sys.stderr) if not args.json else None,
        summary=False)  # the summary is the command's result: once, on stdout
    meta = read_meta(out)
    show(args, meta, lambda: print(summary_line(out, meta)))


@command("config", ConfigArgs, "validate a config and print it fully resolved (defaults filled in)",
         reference=(bool, opt("print the reference of every key (markdown)")))
def run_config(args) -> None:
    text = f"{reference_markdown()}\n" if args.reference else resolved_config(load_config(args.config, args.set))
    print(text, end="")


@command("checkpoint list", Output, "checkpoints in a directory: step, status, size, layout",
         dir=(str, opt("checkpoint directory (checkpoint.dir)", positional=True)))
def run_list(args) -> None:
    rows = describe_dir(args.dir)
    if not rows and not args.json:
        raise UserError(f"no step_* checkpoint folders in {args.dir}")
    show(args, rows, lambda: print_checkpoints(rows))


@command("checkpoint verify", Output, "check a checkpoint's files against its manifest (sizes and sha256)",
         path=(str, opt("a checkpoint folder (step_*) or a directory (its newest complete checkpoint)",
                        positional=True)))
def run_verify(args) -> int:
    r = verify_checkpoint(args.path)
    show(args, r, lambda: print(f"{r['path']}: " + (f"OK ({r['seconds']:.2f} s)" if r["ok"] else
                                                    f"REFUSED: {r['problem']}")))
    return 0 if r["ok"] else 1


@command("export", (ConfigArgs, Output), "export a checkpoint as a Hugging Face Llama folder",
         checkpoint=(str, opt("checkpoint folder or directory (local or s3://)", required=True)),
         hf_out=(str, opt("output folder", required=True, metavar="DIR", writes="dir")),
         config=(str | None, opt("the training config (default: the run's config.toml above the checkpoint)",
                                 short="-c", metavar="FILE")),
         dtype=(str, opt("dtype of the exported weights", "fp32", choices=["fp32", "bf16"])),
         max_shard_gib=(float, opt("size of one safetensors file", 2.0, gt=0)))
def run_export(args) -> None:
    from paratrain.train.export import export_hf, print_export, run_config_of, shard_progress

    cfg, config = run_config_of(args.checkpoint, args.config, args.set)
    summary = export_hf(args.checkpoint, cfg, args.hf_out, args.dtype, int(args.max_shard_gib * 2**30),
                        shard_progress(quiet=args.json))
    summary["config"] = str(config) if config else None
    show(args, summary, lambda: print_export(summary))
