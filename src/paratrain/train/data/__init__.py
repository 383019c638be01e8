"""Training data: sources in the formats people train on, streaming parallel tokenization into
memory-mapped shards, weighted mixtures, and the deterministic, resumable sample order.

  sources.py   which files a data.source names, their formats and text fields, their documents
  tokenize.py  tokenizers (trained, a tokenizer.json, a model folder's), chat templates, segmentation
  pipeline.py  `paratrain data prepare`: fingerprint, streaming tokenization with workers, shards, resume
  indexed.py   Megatron-Core .bin/.idx reader and writer
  windows.py   token windows over the shards, GlobalSampler (one source), BlendSampler (a mixture)

Importing this package does not import torch (the tokenizer worker processes import it).
"""

from paratrain.train.data.pipeline import prepare, read_meta, source_specs, summary_line
from paratrain.train.data.tokenize import EOS, EOS_NAMES
from paratrain.train.data.windows import (
    BlendSampler,
    GlobalSampler,
    MixtureWindows,
    TokenWindows,
    all_tokens,
    make_sampler,
    open_windows,
)

__all__ = ["EOS", "EOS_NAMES", "BlendSampler", "GlobalSampler", "MixtureWindows", "TokenWindows", "all_tokens",
           "make_sampler", "open_windows", "prepare", "read_meta", "source_specs", "summary_line"]
