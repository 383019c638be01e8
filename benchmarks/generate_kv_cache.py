"""KV-cache decode vs recomputation: time per generated token of paratrain's generate() with the cache and
with the whole sequence recomputed every step (the same tokens; the test suite checks that), in the same
run, on this machine. Prints both and their ratio.

    python benchmarks/generate_kv_cache.py                       # small model, prompt 128, 128 new tokens
    python benchmarks/generate_kv_cache.py --prompt 512 --new 256 --batch 4
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from paratrain.infer.generate import generate  # noqa: E402
from paratrain.model.config import ModelConfig  # noqa: E402
from paratrain.model.llama import Llama  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(name="bench", layers=args.layers, hidden=args.hidden, heads=args.hidden // 64,
                      kv_heads=max(1, args.hidden // 128), vocab=4096, max_seq=args.prompt + args.new)
    model = Llama(cfg)
    model.init_weights(0)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab, (args.batch, args.prompt), generator=g).tolist()
    generate(model, prompts, 4)  # warm-up
    rows = {}
    for use_cache in (True, False):
        t0 = time.perf_counter()
        out = generate(model, prompts, args.new, use_cache=use_cache)
        rows[use_cache] = (out, time.perf_counter() - t0)
    cached, recomputed = rows[True][0], rows[False][0]
    same = cached.tokens == recomputed.tokens
    ratio = recomputed.decode_s_per_step / cached.decode_s_per_step
    print(f"model {cfg.num_params() / 1e6:.1f}M params ({cfg.layers} layers, hidden {cfg.hidden}), batch {args.batch}, "
          f"prompt {args.prompt}, {args.new} new tokens, {args.threads} thread(s)")
    for use_cache, (out, total) in rows.items():
        print(f"{'KV cache ' if use_cache else 'recompute'}: prefill {out.prefill_s * 1e3:7.1f} ms, decode "
              f"{out.decode_s_per_step * 1e3:7.2f} ms/step, total {total:6.2f} s")
    print(f"decode speed-up of the KV cache: {ratio:.1f}x (same tokens: {same}); load average "
          f"{os.getloadavg()[0]:.2f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
