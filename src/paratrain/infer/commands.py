"""`paratrain generate`: text (or token ids) from a trained checkpoint or a Hugging Face folder, with a KV
cache; tensor parallel when launched by torchrun (tp = the number of ranks)."""

from __future__ import annotations

import json
from pathlib import Path

from paratrain.cli import ConfigArgs, Output, command, from_options, opt, options_of, show
from paratrain.config import load_config
from paratrain.infer.sampling import Sampling
from paratrain.infer.session import generate_from_config, print_generation


@command("generate", (ConfigArgs, Output, options_of(Sampling)),
         "generate text with a KV cache (checkpoint or Hugging Face model; TP under torchrun)",
         checkpoint=(str | None, opt("'latest' (newest complete checkpoint of the run's checkpoint.dir) or a step "
                                     "folder; not needed with model.hf_path")),
         prompt=(list[str], opt("a text prompt (needs data.tokenizer); repeatable", factory=list)),
         prompt_ids=(list[str], opt("a prompt as token ids", factory=list, metavar="ID,ID,...")),
         max_new_tokens=(int, opt("tokens to generate per prompt", 32, ge=1)),
         no_cache=(bool, opt("recompute the whole sequence each step (baseline)")),
         summary_json=(str | None, opt("write the timings and tokens as JSON (main rank)", metavar="FILE",
                                       writes="file")))
def run_generate(args) -> None:
    summary = generate_from_config(load_config(args.config, args.set), args.checkpoint, args.prompt, args.prompt_ids,
                                   args.max_new_tokens, from_options(Sampling, args), use_cache=not args.no_cache)
    if summary is None:  # not the main rank
        return
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2))
    show(args, summary, lambda: print_generation(summary))
