"""Load a Hugging Face Llama checkpoint folder (config.json + *.safetensors) into paratrain's model.

Hugging Face stores q/k projections permuted for its rotate-half RoPE; Meta's (and our) RoPE rotates
interleaved pairs. We undo the permutation that transformers' convert_llama_weights_to_hf.py applies.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from paratrain.model.config import ModelConfig
from paratrain.model.hf_config import _check_supported, _rope_scaling, config_from_hf  # noqa: F401 - re-exported
from paratrain.model.init import build_on_meta, read_all
from paratrain.model.llama import Llama

_LAYER_NAMES = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of HF's permute(w, n_heads): view(n, 2, d/2, in) -> (n, d/2, 2, in)."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, 2, out_dim // n_heads // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _permute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF's permute (convert_llama_weights_to_hf.py): our interleaved pairs -> its rotate-half halves."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def hf_names(cfg: ModelConfig) -> dict[str, tuple[str, int | None]]:
    """paratrain parameter name -> (Hugging Face tensor name, heads whose rows HF permutes, or None)."""
    names: dict[str, tuple[str, int | None]] = {"tok_embeddings.weight": ("model.embed_tokens.weight", None),
                                                "norm.weight": ("model.norm.weight", None)}
    if not cfg.tie_embeddings:
        names["output.weight"] = ("lm_head.weight", None)
    ours_to_hf = {v: k for k, v in _LAYER_NAMES.items()}
    for i in range(cfg.layers):
        for ours, hf in ours_to_hf.items():
            heads = cfg.heads if ours == "attention.wq" else cfg.n_kv_heads if ours == "attention.wk" else None
            names[f"layers.{i}.{ours}.weight"] = (f"model.layers.{i}.{hf}.weight", heads)
    return names


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Global shape of every parameter of the Llama of `cfg` (built on meta: no memory)."""
    model = build_on_meta(lambda: Llama(cfg))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


READ_ELEMS = 2**20  # values per slice read from a safetensors file: the memory a rank needs beyond its shard
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class SafetensorsFile:
    """Reads of row ranges (and a column range) of the tensors of one .safetensors file, touching only their
    bytes. Why not `safetensors.safe_open(...).get_slice`: in safetensors 0.8 (torch) it builds a full-shape
    view over the memory-mapped file and slices that; here a rank's read is exactly its rows' bytes (a tensor is
    stored row-major and contiguous: rows [r0, r1) are one byte range; a column range is one short read per
    row), on any filesystem, and never a full-shape tensor (tests/test_hf_roundtrip.py checks it). Format: an
    8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then the data."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        with path.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            try:
                header = json.loads(fh.read(n)) if 8 + n <= size else None
            except ValueError:
                header = None
        if not isinstance(header, dict):
            raise ValueError(f"{path}: not a safetensors file (no JSON header in its first {min(size, 8 + n):,} "
                             f"bytes); allowed: a complete .safetensors file (copied or downloaded again)")
        header.pop("__metadata__", None)
        self.data_start, self.tensors = 8 + n, header
        need = self.data_start + max((t["data_offsets"][1] for t in header.values()), default=0)
        if size < need:  # a copy or download cut short: reads past the end would give torch a short buffer
            raise ValueError(f"{path}: truncated: {size:,} bytes, its header describes {need:,}; allowed: the "
                             f"complete file (copied or downloaded again)")

    def keys(self):
        return self.tensors.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key]["shape"])

    def read(self, key: str, r0: int, r1: int, cols: tuple[int, int] | None = None) -> torch.Tensor:
        info = self.tensors[key]
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{self.path}: tensor '{key}' has dtype {info['dtype']}; readable: {', '.join(_ST_DTYPES)}")
        dtype, shape = _ST_DTYPES[info["dtype"]], info["shape"]
        row = math.prod(shape[1:])
        esize = dtype.itemsize
        base = self.data_start + info["data_offsets"][0]
        with self.path.open("rb") as fh:
            if cols is None or (cols[0] == 0 and cols[1] == shape[1]):
                fh.seek(base + r0 * row * esize)
                buf = bytearray(fh.read((r1 - r0) * row * esize))
                return torch.frombuffer(buf, dtype=dtype).view(r1 - r0, *shape[1:]) if buf else \
                    torch.empty((0, *shape[1:]), dtype=dtype)
            if len(shape) != 2:
                raise ValueError(f"{self.path}: column ranges of the {len(shape)}-D tensor '{key}' are not supported")
            width = cols[1] - cols[0]
            buf = bytearray((r1 - r0) * width * esize)
            for i, r in enumerate(range(r0, r1)):
                fh.seek(base + (r * row + cols[0]) * esize)
                buf[i * width * esize:(i + 1) * width * esize] = fh.read(width * esize)
            return torch.frombuffer(buf, dtype=dtype).view(r1 - r0, width)


class HFRows:
    """Row source (see paratrain.model.init) over one tensor of a safetensors file: reads only the requested
    rows and column range (`SafetensorsFile.read`), undoing HF's q/k head permutation a whole head at a
    time (the permutation stays within a head, so a block of whole heads is self-contained)."""

    def __init__(self, handle, key: str, shape: tuple[int, ...], heads: int | None):
        self.handle, self.key, self.shape, self.heads = handle, key, tuple(shape), heads
        row_numel = max(math.prod(shape[1:]), 1)
        if heads is None:
            self.block_rows = max(1, READ_ELEMS // row_numel)
        else:
            head_dim = shape[0] // heads
            self.block_rows = head_dim * max(1, READ_ELEMS // (row_numel * head_dim))

    def read(self, start: int, stop: int, bounds=()) -> torch.Tensor:
        cols = bounds[0] if bounds else None
        if self.heads is None:
            return self.handle.read(self.key, start, stop, cols)
        head_dim = self.shape[0] // self.heads
        h0, h1 = start // head_dim, -(-stop // head_dim)
        rows = _unpermute_rope(self.handle.read(self.key, h0 * head_dim, h1 * head_dim, cols), h1 - h0)
        return rows[start - h0 * head_dim:stop - h0 * head_dim]


class HFSource:
    """`source_of(name, shape)` for `paratrain.parallel.materialize`: paratrain parameter -> HFRows over the
    safetensors file holding it. Every expected tensor and its shape is checked when this is built, before
    any rank allocates anything."""

    def __init__(self, folder: str | Path, cfg: ModelConfig):
        self.folder, self.cfg = Path(folder), cfg
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"model.hf_path='{folder}': no *.safetensors files there")
        self._handles = {f.name: SafetensorsFile(f) for f in files}
        where = {key: name for name, h in self._handles.items() for key in h.keys()}
        self.names = hf_names(cfg)
        shapes = expected_shapes(cfg)
        missing = [hf for ours, (hf, _) in self.names.items() if hf not in where]
        known = {hf for hf, _ in self.names.values()} | ({"lm_head.weight"} if cfg.tie_embeddings else set())
        unexpected = [k for k in where if k not in known and not k.endswith("rotary_emb.inv_freq")]
        if missing or unexpected:
            raise ValueError(f"Hugging Face checkpoint '{folder}' does not match the config: missing "
                             f"{missing[:5]}, unexpected {unexpected[:5]}")
        self._where = where
        for ours, (hf, _) in self.names.items():
            got = self._handles[where[hf]].shape(hf)
            if got != shapes[ours]:
                raise ValueError(f"Hugging Face checkpoint '{folder}': {hf} has shape {got}, the config needs "
                                 f"{shapes[ours]}")

    def __call__(self, name: str, shape: tuple[int, ...]) -> HFRows:
        if name not in self.names:
            raise ValueError(f"parameter '{name}' has no Hugging Face counterpart")
        hf, heads = self.names[name]
        return HFRows(self._handles[self._where[hf]], hf, shape, heads)


def hf_source(folder: str | Path, cfg: ModelConfig | None = None) -> HFSource:
    return HFSource(folder, cfg or config_from_hf(folder))


def load_hf_llama(folder: str | Path, cfg: ModelConfig | None = None) -> Llama:
    """Build paratrain's Llama from a Hugging Face folder with the same weights (whole, in this process; a
    parallel layout reads only its shards: `paratrain.train.loop.build_runner` with model.hf_path).

    `cfg` (default: read from config.json) may differ from the folder's only where no weight depends on it
    (name, max_seq: the RoPE table length); `paratrain.config` refuses shape overrides with model.hf_path.
    """
    cfg = cfg or config_from_hf(folder)
    source = HFSource(folder, cfg)
    model = Llama(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(read_all(source(name, tuple(p.shape)), tuple(p.shape)))
    return model


# ---- export -------------------------------------------------------------------------------------------------
def hf_config(cfg: ModelConfig, dtype: str = "float32") -> dict:
    """config.json for transformers' LlamaForCausalLM with the same computation as paratrain's Llama."""
    out = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn,
        "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "vocab_size": cfg.vocab, "max_position_embeddings": cfg.max_seq,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": dtype, "rope_scaling": None,
    }
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        out["rope_scaling"] = {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                               "high_freq_factor": rs.high_freq_factor,
                               "original_max_position_embeddings": rs.original_max_seq}
    return out


def to_hf_tensor(name: str, value: torch.Tensor, cfg: ModelConfig) -> tuple[str, torch.Tensor]:
    """(Hugging Face name, tensor in HF's layout) of paratrain parameter `name`."""
    names = hf_names(cfg)
    if name not in names:
        raise ValueError(f"parameter '{name}' has no Hugging Face counterpart")
    hf, heads = names[name]
    return hf, (_permute_rope(value, heads) if heads is not None else value).contiguous()
