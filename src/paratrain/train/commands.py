"""`paratrain train`, `paratrain data prepare`, `paratrain config`."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from paratrain.cli import ConfigArgs, Output, RunFiles, command, opt

TRAIN_HELP = """\
Train a Llama-style model from a TOML config (see configs/ and docs/config.md).

One process:          paratrain train --config configs/tiny.toml
TP2 x DP2 with SP:    torchrun --nproc-per-node 4 -m paratrain train --config configs/tiny.toml \\
                          --set parallel.tp=2 --set parallel.sp=true --set parallel.dp_kind=ddp \\
                          --set train.microbatch=8 --set metrics.run_dir=runs/tp2dp2
PP2 x TP2 x DP2:      torchrun --nproc-per-node 8 -m paratrain train --config configs/tiny.toml \\
                          --set parallel.tp=2 --set parallel.pp=2 --set train.microbatch=4 \\
                          --set metrics.run_dir=runs/3d
Override any key:     --set optim.lr=1e-3 --set train.steps=50 --set parallel.recompute=selective
Start from Hugging Face weights:  --set model.hf_path=path/to/llama   (config.json + *.safetensors)
Check a config only:  paratrain config --config my.toml --set parallel.tp=4

The layout (tp, sp, pp, cp, dp, dp_kind, recompute) is checked against the model and the number of ranks
before any work; a bad one is one line naming the key, its value and what is allowed.
Resumes automatically from the newest complete checkpoint in checkpoint.dir (checkpoint.resume="auto"; by
default <metrics.run_dir>/checkpoints, so a new experiment wants a new metrics.run_dir); one run per
checkpoint.dir (a lease); SIGTERM/SIGUSR1 save at the next step and exit 0. Exit status 1: the run trained but
did not end well (its final checkpoint not saved, non-finite numbers); see docs/checkpoints.md. train.microbatch
must divide the per-rank batch train.global_batch / dp.
Metrics: <metrics.run_dir>/metrics.jsonl (loss, lr, grad_norm, tokens_per_s, mfu, memory_bytes per step) and
TensorBoard logs in <metrics.run_dir>/tensorboard. MFU is against metrics.hardware's catalog peak, or else
against a matmul probe of this machine (the summary says which).
"""


PREPARE_HELP = """\
Tokenize data.source (or the weighted data.mix) into memory-mapped token shards with an index under
data.prepared_dir (plus tokenizer.json and meta.json). `paratrain train` prepares the data itself when needed;
run this first to see the corpus, or before torchrun so ranks never wait for it. Streaming (memory does not grow
with the corpus), data.workers tokenizer processes, resumable after an interruption, re-prepared when a file of
the corpus changes. Formats (from extension and content): UTF-8 text, JSONL/JSON and Parquet/Arrow records
(data.text_field, or chat messages in data.messages_field through the tokenizer's chat template), a Hugging Face
datasets save_to_disk folder, .npy tokens, Megatron .bin/.idx. See docs/data.md.

Default source 'stdlib': this Python's standard library source (nothing downloaded), tokenized with a
byte-level BPE tokenizer trained locally (data.vocab_size tokens). data.tokenizer='auto' uses model.hf_path's
tokenizer.json when that is set.

  paratrain data prepare                                           # the embedded default
  paratrain data prepare --set data.source=corpus/ --set data.prepared_dir=data/mine --progress on
  paratrain data prepare --set data.source=a.jsonl --set data.text_field=body --set data.tokenizer=path/to/model
  paratrain data prepare --set 'data.mix=[{source="web/", weight=0.8}, {source="code.jsonl", weight=0.2}]'
(--set values are TOML; a value that is not valid TOML, like a bare path, is taken as a string.)
"""


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


@command("train", TrainArgs, "train a model (single process or under torchrun)", TRAIN_HELP)
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


@command("data prepare", PrepareArgs, "tokenize data.source into data.prepared_dir", PREPARE_HELP)
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
