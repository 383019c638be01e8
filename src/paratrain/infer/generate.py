"""Autoregressive generation with a KV cache: greedy or sampled, batched prompts (left-padded), on one
process or a tensor-parallel model (every rank runs the same loop on replicated logits and draws the same
samples from a generator seeded alike).

`use_cache=False` recomputes the whole sequence at every step (with the same masks, so the same tokens): the
baseline the KV cache is measured against (benchmarks/generate_kv_cache.py).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from paratrain.device import synchronize as _sync
from paratrain.infer.kv_cache import KVCache, attach
from paratrain.infer.sampling import Sampling


@dataclass
class Generation:
    """New tokens per prompt (up to and including an end-of-sequence token) and the measured times."""

    tokens: list[list[int]]
    prompt_tokens: list[int]
    batch: int
    padded_prompt_tokens: int
    prefill_s: float
    decode_steps: int
    decode_s: float
    use_cache: bool
    cache_bytes: int = 0
    step_s: list[float] = field(default_factory=list)

    @property
    def decode_s_per_step(self) -> float:
        return self.decode_s / self.decode_steps if self.decode_steps else float("nan")

    def to_dict(self) -> dict:
        data = asdict(self)
        data["decode_s_per_step"] = self.decode_s_per_step
        return data


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, valid): prompts right-aligned in a (b, longest) tensor, valid marking the real tokens."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: need at least one prompt, each of at least one token")
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[i, width - len(p):] = True
    return tokens, valid


def next_tokens(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator) -> torch.Tensor:
    """One token per row of (b, vocab) logits."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    scores = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(scores, min(sampling.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = scores.sort(dim=-1, descending=True)
        cum = ordered.softmax(-1).cumsum(-1)
        drop = cum - ordered.softmax(-1) >= sampling.top_p  # keep up to the token that reaches top_p
        scores = scores.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    probs = scores.softmax(-1)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)


def _forward(model: nn.Module, tokens: torch.Tensor, valid: torch.Tensor, start: int, max_len: int,
             cache: KVCache | None) -> tuple[torch.Tensor, KVCache]:
    """Logits of the last position after running `tokens` (positions start..) through the model."""
    cache = cache or KVCache(tokens.shape[0], max_len, valid)
    positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
    with attach(model, cache):
        logits = model(tokens, positions=positions)
    cache.advance(tokens.shape[1])
    return logits[:, -1], cache


@torch.no_grad()
def generate(model: nn.Module, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling | None = None,
             eos_id: int | None = None, pad_id: int = 0, use_cache: bool = True) -> Generation:
    """Generate up to max_new_tokens per prompt (stopping a sequence at eos_id, the batch when all stopped)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens}: must be >= 1")
    sampling = sampling or Sampling()
    device = next(model.parameters()).device
    tokens, valid = left_pad(prompts, pad_id)
    b, width = tokens.shape
    max_len = width + max_new_tokens
    limit = model.cfg.max_seq
    if max_len > limit:
        raise ValueError(f"prompt ({width} tokens) + max_new_tokens ({max_new_tokens}) = {max_len}: exceeds the "
                         f"model's max_seq = {limit}")
    valid = torch.cat([valid, torch.ones(b, max_new_tokens, dtype=torch.bool)], dim=1)
    tokens = tokens.to(device)
    gen = torch.Generator().manual_seed(sampling.seed)
    was_training = model.training
    model.eval()
    try:
        _sync(device)
        t0 = time.perf_counter()
        logits, cache = _forward(model, tokens, valid, 0, max_len, None)
        new = next_tokens(logits, sampling, gen)
        _sync(device)
        prefill_s = time.perf_counter() - t0
        out = [new]
        done = torch.zeros(b, dtype=torch.bool, device=device) if eos_id is None else new == eos_id
        seq = torch.cat([tokens, new[:, None]], dim=1)
        steps: list[float] = []
        while len(out) < max_new_tokens and not bool(done.all()):
            t0 = time.perf_counter()
            if use_cache:
                logits, cache = _forward(model, seq[:, -1:], valid, seq.shape[1] - 1, max_len, cache)
            else:  # recompute everything so far, with the same masks
                logits, cache = _forward(model, seq, valid, 0, max_len, None)
            new = next_tokens(logits, sampling, gen)
            new = torch.where(done, torch.full_like(new, pad_id), new)
            _sync(device)
            steps.append(time.perf_counter() - t0)
            out.append(new)
            if eos_id is not None:
                done |= new == eos_id
            seq = torch.cat([seq, new[:, None]], dim=1)
    finally:
        model.train(was_training)
    return Generation(tokens=_cut(torch.stack(out, dim=1).tolist(), eos_id), prompt_tokens=[len(p) for p in prompts],
                      batch=b, padded_prompt_tokens=width, prefill_s=prefill_s, decode_steps=len(steps),
                      decode_s=sum(steps), use_cache=use_cache, cache_bytes=cache.nbytes(), step_s=steps)


def _cut(rows: list[list[int]], eos_id: int | None) -> list[list[int]]:
    if eos_id is None:
        return rows
    return [row[:row.index(eos_id) + 1] if eos_id in row else row for row in rows]
