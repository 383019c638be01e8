"""Layout-independent weight initialisation: every value is a function of (seed, parameter name, index) only.

The rule (GPT-2 / Megatron style): norm weights 1, every other matrix N(0, 0.02), the residual-output
projections (attention.wo, feed_forward.w2, MoE experts.w2) N(0, 0.02 / sqrt(2 * layers)).

Why not one torch generator for the whole model (what `init_weights` used to do): the values a parameter gets
would then depend on every parameter drawn before it and on the order they are drawn in, so a rank that holds
a shard can only reproduce its values by drawing the whole model. Here each parameter is cut into row blocks
along dim 0 (`block_rows`: one row of a matrix), and block b of parameter `name` is drawn from its
own counter-based stream: numpy's Philox4x64 with key = blake2b(seed, name) and counter = b * 2**192, so the
streams of different blocks never overlap and none depends on another. A rank that owns rows [r0, r1) (FSDP,
or tensor parallelism's column-parallel weights) draws only the blocks that cover them; a rank that owns
columns (row-parallel weights) draws whole blocks one at a time and keeps its columns. The single-device model
draws every block, so single device == any layout, bit for bit. Memory beyond the shard: one block.
(torch's CPU generator is MT19937 seeded with 32 bits only, so per-block torch generators could collide; and
DTensor's own RNG (torch.distributed.tensor._random) is Philox-offset based and supported on CUDA-like devices
only: on a CPU mesh every rank draws the same local values, measured with torch 2.13.)

A "row source" is what a materialiser reads parameter values from, one aligned read at a time:
`block_rows` (rows per aligned block), optionally `read_rows` (rows one read may span, a multiple of
block_rows; default one block: `rows_per_read`) and `read(start, stop, bounds)` -> rows [start, stop) (within
one aligned read) restricted to `bounds` [(lo, hi) or None per dim >= 1]. `RandomRows` and `FilledRows` here,
`paratrain.model.hf.HFRows` for Hugging Face weights.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch

META = torch.device("meta")  # construction without memory; parallel/materialize.py allocates the shards
BLOCK_ELEMS = 4096  # values per random block of a 1-D parameter (a matrix's block is one row)
READ_ELEMS = 2**20  # values a RandomRows read returns at most (whole blocks; see RandomRows.read_rows)
INIT_STD = 0.02


def build_on_meta(factory):
    """Construct a module (factory()) without allocating its parameters or buffers."""
    with META:
        return factory()


@dataclass(frozen=True)
class ParamInit:
    kind: str  # "ones" | "normal"
    std: float = 0.0


def param_init(name: str, layers: int) -> ParamInit:
    """How parameter `name` (single-device model name) of a `layers`-layer Llama is initialised."""
    if name.endswith("norm.weight"):
        return ParamInit("ones")
    if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
        return ParamInit("normal", INIT_STD / math.sqrt(2 * layers))
    return ParamInit("normal", INIT_STD)


def block_rows(shape: tuple[int, ...]) -> int:
    """Rows (along dim 0) of one random block of a parameter of global `shape`: one row of a matrix (so no
    shard of more than one row is ever drawn whole), BLOCK_ELEMS values of a vector."""
    return 1 if len(shape) >= 2 else BLOCK_ELEMS


class RandomRows:
    """N(0, std) values of parameter `name` with global `shape`, drawn block by block (see the module doc)."""

    def __init__(self, seed: int, name: str, shape: tuple[int, ...], std: float):
        self.shape, self.std = tuple(shape), std
        self.block_rows = block_rows(self.shape)
        # Rows one `read` may return (whole blocks, about READ_ELEMS values): a read of many rows draws each
        # block straight into one output array, where a read per block cost ~4x more in the per-block Python
        # and tensor overhead (the tiny model's 5,376 rows: 77 -> 31 ms a model, paid per rank and layout built).
        row_numel = max(math.prod(self.shape[1:]), 1)
        self.read_rows = self.block_rows * max(1, READ_ELEMS // (row_numel * self.block_rows))
        digest = hashlib.blake2b(f"paratrain-init\0{seed}\0{name}".encode(), digest_size=16).digest()
        self._key = np.frombuffer(digest, dtype=np.uint64).copy()
        self._bits = np.random.Philox(key=self._key)
        self._gen = np.random.Generator(self._bits)
        self._counter = np.zeros(4, dtype=np.uint64)
        self._state = {"bit_generator": "Philox", "state": {"counter": self._counter, "key": self._key},
                       "buffer": np.zeros(4, dtype=np.uint64), "buffer_pos": 4, "has_uint32": 0, "uinteger": 0}

    def _draw(self, b: int, out: np.ndarray) -> None:
        """Standard normals of aligned block b into `out` (C-contiguous, the block's shape)."""
        # Restart the stream at counter b * 2**192 (setting the state is 5x cheaper than a new generator;
        # the setter copies the counter, so one state dict serves every block).
        self._counter[3] = b
        self._bits.state = self._state
        self._gen.standard_normal(dtype=np.float32, out=out)

    def block(self, b: int) -> torch.Tensor:
        """Aligned block b (rows b*block_rows .. up to block_rows more), all columns, fp32."""
        return self.read(b * self.block_rows, min(self.shape[0], (b + 1) * self.block_rows))

    def read(self, start: int, stop: int, bounds=()) -> torch.Tensor:
        """Rows [start, stop) (any number of aligned blocks) restricted to `bounds`: the values a read of
        each block alone gives. Memory beyond the result: one block."""
        br, width = self.block_rows, self.shape[1:]
        cols = tuple(slice(None) if b is None else slice(*b) for b in (bounds or [None] * len(width)))
        out = np.empty((stop - start, *(len(range(n)[c]) for n, c in zip(width, cols, strict=True))),
                       dtype=np.float32)
        scratch = None
        for b in range(start // br, (stop - 1) // br + 1):
            b0 = b * br
            rows = min(br, self.shape[0] - b0)
            lo, hi = max(start, b0), min(stop, b0 + rows)
            if lo == b0 and hi == b0 + rows and out.shape[1:] == width:  # a whole block, all columns: in place
                self._draw(b, out[lo - start:hi - start])
                continue
            if scratch is None or scratch.shape[0] != rows:
                scratch = np.empty((rows, *width), dtype=np.float32)
            self._draw(b, scratch)
            out[lo - start:hi - start] = scratch[(slice(lo - b0, hi - b0), *cols)]
        out *= np.float32(self.std)
        return torch.from_numpy(out)


class FilledRows:
    """A constant (norm weights)."""

    def __init__(self, shape: tuple[int, ...], value: float):
        self.shape, self.value = tuple(shape), value
        self.block_rows = max(shape[0], 1) if shape else 1  # no stream: any range at once
        self.read_rows = self.block_rows

    def read(self, start: int, stop: int, bounds=()) -> torch.Tensor:
        sizes = [b[1] - b[0] if b is not None else n for b, n in zip(bounds or [None] * (len(self.shape) - 1),
                                                                        self.shape[1:], strict=True)]
        return torch.full((stop - start, *sizes), self.value, dtype=torch.float32)


def init_source(seed: int, name: str, shape: tuple[int, ...], layers: int) -> RandomRows | FilledRows:
    """The row source of parameter `name`'s initial values."""
    rule = param_init(name, layers)
    if rule.kind == "ones":
        return FilledRows(shape, 1.0)
    return RandomRows(seed, name, shape, rule.std)


def rows_per_read(source) -> int:
    """Rows a read of `source` may span (aligned to it): `read_rows` where the source has it, else one block."""
    return getattr(source, "read_rows", source.block_rows)


def read_all(source, shape: tuple[int, ...]) -> torch.Tensor:
    """The whole parameter from a row source, read by read (single-device initialisation)."""
    step = rows_per_read(source)
    parts = [source.read(r, min(r + step, shape[0])) for r in range(0, shape[0], step)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@torch.no_grad()
def init_full_(model: torch.nn.Module, seed: int, layers: int) -> None:
    """Initialise every parameter of an unsharded model (one process) with the layout-independent rule."""
    for name, p in model.named_parameters():
        p.copy_(read_all(init_source(seed, name, tuple(p.shape), layers), tuple(p.shape)))
