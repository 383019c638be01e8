"""`paratrain train`, `paratrain data prepare`, `paratrain config`."""

from __future__ import annotations

import argparse
import json
import os
import sys

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


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", help="TOML config file (default: built-in defaults = tiny model)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config key (repeatable); the value is parsed as TOML")


def register(sub) -> None:
    p = sub.add_parser("train", help="train a model (single process or under torchrun)", description=TRAIN_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(p)
    p.add_argument("--resume-from", metavar="PATH",
                   help="resume from this checkpoint folder (.../step_00000100) or checkpoint directory (its newest "
                        "complete one); local, shared filesystem or s3://bucket/prefix. Default: checkpoint.resume "
                        "(\"auto\": the newest complete one in checkpoint.dir)")
    p.add_argument("--summary-json", help="write the run summary as JSON to this file (main rank)")
    p.add_argument("--json", action="store_true",
                   help="print the run summary as JSON on stdout instead of the text summary (main rank)")
    p.set_defaults(func=run_train)

    d = sub.add_parser("data", help="prepare training data (tokenize into a memory-mapped token file)")
    dsub = d.add_subparsers(dest="data_command", metavar="ACTION")
    prep = dsub.add_parser("prepare", help="tokenize data.source into data.prepared_dir",
                           description=PREPARE_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(prep)
    prep.add_argument("--force", action="store_true", help="re-tokenize even if already prepared")
    prep.add_argument("--json", action="store_true", help="print the prepared data's meta.json on stdout")
    prep.add_argument("--progress", choices=("on", "off"), help="progress bar with tokens/s on stderr "
                      "(default: when stderr is a terminal)")
    prep.set_defaults(func=run_prepare)
    d.set_defaults(func=lambda args: d.print_help() or 0)

    c = sub.add_parser("config", help="validate a config and print it fully resolved (defaults filled in)")
    _add_config_args(c)
    c.add_argument("--reference", action="store_true", help="print the reference of every key (markdown)")
    c.set_defaults(func=run_config)


def run_config(args) -> int:
    from paratrain.config import dump_config, load_config, reference_markdown

    if args.reference:
        print(reference_markdown())
        return 0
    cfg = load_config(args.config, args.set)
    if cfg.parallel.pp > 1 or cfg.parallel.pp_layers is not None:  # stages vs layers, schedule, microbatches
        from paratrain.parallel.pipeline import check_pipeline_layout

        check_pipeline_layout(cfg, cfg.parallel.dp if cfg.parallel.dp > 0 else None)  # dp=-1: known at launch
    print(dump_config(cfg), end="")
    shape = cfg.model_shape()
    print(f"# model: {shape.name}, {shape.num_params() / 1e6:,.2f}M parameters")
    return 0


def run_prepare(args) -> int:
    import sys

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
    return 0


def run_train(args, faults=None) -> int:
    """`paratrain train`. `faults`: test-only fault injection; by default what PARATRAIN_FAULT_KILL asks for
    (parsed here, before any work)."""
    import torch.distributed as dist

    from paratrain.config import load_config
    from paratrain.parallel.mesh import shutdown_distributed
    from paratrain.train.faults import FaultInjector
    from paratrain.train.loop import train

    cfg = load_config(args.config, args.set)  # fails here, before any process group or data work
    faults = faults if faults is not None else FaultInjector.from_env(os.environ)  # a malformed spec, too
    check_launch(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    joined_here = not dist.is_initialized()  # a caller that set up the process group keeps it
    summary = train(cfg, resume_from=args.resume_from, faults=faults)
    if joined_here:
        shutdown_distributed()  # torchrun's ranks exit together, with no gloo thread left running
    if summary["rank"] == 0:
        if summary.get("nothing_to_train"):  # said in one line by the loop; no summary of a run that did not run
            if args.json:
                print(json.dumps(summary))
            return 0
        if args.json:
            print(json.dumps(summary))
        else:
            print_summary(summary)
        if args.summary_json:
            with open(args.summary_json, "w") as fh:
                json.dump(summary, fh, indent=2)
    for error in summary.get("errors", []):  # e.g. the final save failed: the run did not end well
        print(f"paratrain train: error: {error}", file=sys.stderr)
    return 1 if summary.get("errors") else 0


def run_mfu(s: dict) -> float | None:
    """Model FLOPs utilisation of the whole run: train FLOPs per token x tokens/s over (ranks x peak)."""
    if not s.get("model_shape") or not s.get("peak_flops"):
        return None
    from paratrain.model.config import ModelConfig

    flops_per_token = ModelConfig(**s["model_shape"]).train_flops_per_token(s["seq_len"])
    return flops_per_token * s["tokens_per_s"] / (s["peak_flops"] * s["world_size"])


def check_launch(cfg, world_size: int) -> None:
    """The checks that need the number of ranks (degrees vs world size, batch vs dp), before this rank joins
    a process group: under torchrun every rank refuses a bad layout at once, with one line."""
    from paratrain.config import resolve_degrees
    from paratrain.train.loop import check_batch_layout

    check_batch_layout(cfg, resolve_degrees(cfg.parallel, world_size)["dp"])


def print_summary(s: dict) -> None:
    if s.get("preempted"):
        p = s["preempted"]
        print(f"\npreempted ({p['signal']}) at step {p['step']}: checkpoint {p['checkpoint'] or 'NOT saved'}, "
              f"{p['seconds_after_notice']:.1f} s after the notice; start the same command again to resume")
    drop = (1 - s["last_loss"] / s["first_loss"]) if s["first_loss"] == s["first_loss"] else float("nan")
    print("\n=== paratrain run summary ===")
    print(f"layout          {s['layout']} on {s['world_size']} rank(s)")
    print(f"steps           {s['steps']} ({s['tokens']:,} tokens) in {s['wall_s']:.1f} s")
    print(f"loss            {s['first_loss']:.4f} -> {s['last_loss']:.4f} ({drop:.1%} lower)")
    print(f"throughput      {s['tokens_per_s']:,.0f} tokens/s ({s.get('tokens_per_s_note', 'all steps')})")
    if (mfu := run_mfu(s)) is not None:
        print(f"MFU             {mfu:.1%} (of the {s['peak_label']}: {s['peak_flops'] / 1e12:,.2f} TFLOP/s per rank)")
    print(f"metrics         {s['run_dir']}/metrics.jsonl, TensorBoard: {s['run_dir']}/tensorboard")
    print(f"checkpoint      {s['checkpoint'] or '(none saved)'}")
    if s.get("predicted"):
        pred, measured = s["predicted"], s.get("step_time_s_median", float("nan"))
        print(f"step time       measured {measured * 1e3:,.1f} ms (median), planner predicted "
              f"{pred['step_time_s'] * 1e3:,.1f} ms on {pred['system']} ({pred['step_time_s'] / measured - 1:+.0%})")
        shown = {k: v for k, v in pred["breakdown_s"].items() if v > 0}
        print("  predicted     " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in shown.items()))
        meas = s.get("breakdown_median_s", {})
        print("  measured      " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in meas.items()))
