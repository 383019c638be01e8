"""`paratrain train`, `paratrain data prepare`, `paratrain config`."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from paratrain.cli import ConfigArgs, Output, RunFiles, command, opt


@dataclass(kw_only=True)
class TrainArgs(ConfigArgs, RunFiles, Output):
    pass


@dataclass(kw_only=True)
class PrepareArgs(ConfigArgs, Output):
    force: bool = opt("re-tokenize even if already prepared")
    progress: str | None = opt("progress bar with tokens/s on stderr (default: when stderr is a terminal)",
                               choices=("on", "off"))


@dataclass(kw_only=True)
class ConfigCheckArgs(ConfigArgs):
    reference: bool = opt("print the reference of every key (markdown)")


GROUPS = [("data", "prepare training data (tokenize into a memory-mapped token file)")]


@command("train", TrainArgs, "train a model (single process or under torchrun)")
def run_train(args, faults=None) -> int:
    """`paratrain train`. `faults`: test-only fault injection; by default what PARATRAIN_FAULT_KILL asks for
    (parsed here, before any work)."""
    import torch.distributed as dist

    from paratrain.config import check_launch, load_config
    from paratrain.parallel.mesh import shutdown_distributed
    from paratrain.train.faults import FaultInjector
    from paratrain.train.loop import train
    from paratrain.train.summary import print_summary

    cfg = load_config(args.config, args.set)  # fails here, before any process group or data work
    faults = faults if faults is not None else FaultInjector.from_env(os.environ)  # a malformed spec, too
    check_launch(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    joined_here = not dist.is_initialized()  # a caller that set up the process group keeps it
    summary = train(cfg, resume_from=args.resume_from, faults=faults)
    if joined_here:
        shutdown_distributed()  # torchrun's ranks exit together, with no gloo thread left running
    ran = not summary.get("nothing_to_train")  # said in one line by the loop; no summary of a run that did not run
    if summary["rank"] == 0:
        if args.json:
            print(json.dumps(summary))
        elif ran:
            print_summary(summary)
        if args.summary_json and ran:
            Path(args.summary_json).write_text(json.dumps(summary, indent=2))
    for error in summary.get("errors", []):  # e.g. the final save failed: the run did not end well
        print(f"paratrain train: error: {error}", file=sys.stderr)
    return 1 if summary.get("errors") else 0


@command("data prepare", PrepareArgs, "tokenize data.source into data.prepared_dir")
def run_prepare(args) -> None:
    from paratrain.config import load_config
    from paratrain.train.data import prepare, read_meta, summary_line
    from paratrain.train.data.tokenize import check_model_tokenizer

    cfg = load_config(args.config, args.set)
    if cfg.model.hf_path:
        check_model_tokenizer(cfg.data, cfg.model.hf_path, cfg.model_shape().vocab)
    progress = None if args.progress is None else args.progress == "on"
    out = prepare(cfg.data, force=args.force, hf_path=cfg.model.hf_path, progress=progress,
                  log=lambda msg: print(msg, file=sys.stderr) if not args.json else None)
    meta = read_meta(out)
    print(json.dumps(meta, indent=2) if args.json else summary_line(out, meta))



@command("config", ConfigCheckArgs, "validate a config and print it fully resolved (defaults filled in)")
def run_config(args) -> None:
    from paratrain.config import load_config, reference_markdown, resolved_config

    if args.reference:
        return print(reference_markdown())
    print(resolved_config(load_config(args.config, args.set)), end="")
