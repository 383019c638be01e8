"""A KV cache for paratrain's Llama, attached from outside the model.

model/llama.py stays the single-device training reference: its Attention computes q, k, v (RoPE applied,
local heads under tensor parallelism) and hands them to `attention.core`. `attach(model, cache)` swaps each
block's core for a CachedCore that appends the new keys/values to the cache and attends over everything
cached so far, then restores the original cores on exit. The positions of the new tokens reach RoPE through
Llama.forward's existing `positions` argument. Nothing in the model changes, and a TP-sharded model (DTensor
styles on wq/wk/wv/wo) works unchanged: the core only ever sees this rank's local heads.

Batches of prompts of different lengths are left-padded: `valid` marks real tokens; a query attends to real
keys at or before its position (and to itself, so padding rows stay finite). All sequences share positions
0..L-1, so a left-padded prompt's tokens sit at shifted positions; RoPE attention depends only on position
differences, so the result equals the unpadded prompt's (up to rounding).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


class KVCache:
    """Keys and values of every layer for `batch` sequences of up to `max_len` tokens (allocated on first use
    with the shape and dtype the layer hands over). `length`: tokens cached so far (shared by the batch)."""

    def __init__(self, batch: int, max_len: int, valid: torch.Tensor | None = None):
        if batch < 1 or max_len < 1:
            raise ValueError(f"KVCache(batch={batch}, max_len={max_len}): both must be >= 1")
        self.batch, self.max_len, self.length = batch, max_len, 0
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.valid = torch.ones(batch, max_len, dtype=torch.bool) if valid is None else valid

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (b, kv_heads, s, d) at [length, length + s); return all cached keys/values of the layer."""
        s = k.shape[2]
        end = self.length + s
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} tokens > max_len {self.max_len}")
        if layer not in self.keys:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self.keys[layer] = k.new_zeros(shape)
            self.values[layer] = v.new_zeros(shape)
        self.keys[layer][:, :, self.length:end] = k
        self.values[layer][:, :, self.length:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def mask(self, s: int, device: torch.device) -> torch.Tensor:
        """(b, 1, s, length + s) bool: causal over the cache, real keys only, plus each query's own key."""
        end = self.length + s
        q_pos = torch.arange(self.length, end, device=device)[:, None]
        k_pos = torch.arange(end, device=device)[None, :]
        allowed = (k_pos <= q_pos)[None] & self.valid[:, None, :end].to(device)
        allowed |= (k_pos == q_pos)[None]
        return allowed[:, None]

    def advance(self, s: int) -> None:
        self.length += s

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))


class CachedCore(nn.Module):
    """Drop-in for model.llama.CoreAttention that reads and extends a KVCache."""

    def __init__(self, cache: KVCache, layer: int):
        super().__init__()
        self.cache, self.layer = cache, layer

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.cache.write(self.layer, k, v)
        if keys.shape[1] != q.shape[1]:  # grouped-query attention, as CoreAttention does it
            repeat = q.shape[1] // keys.shape[1]
            keys = keys.repeat_interleave(repeat, dim=1)
            values = values.repeat_interleave(repeat, dim=1)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.cache.mask(q.shape[2], q.device))


@contextmanager
def attach(model: nn.Module, cache: KVCache):
    """Within the block, every attention of `model` uses `cache`; the original cores come back afterwards."""
    saved = {}
    try:
        for name, block in model.layers.items():
            saved[name] = block.attention.core
            block.attention.core = CachedCore(cache, int(name))
        yield cache
    finally:
        for name, core in saved.items():
            model.layers[name].attention.core = core
