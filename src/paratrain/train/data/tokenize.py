"""Tokenizers (trained here, a tokenizer.json, or a Hugging Face model folder's), chat templates, and the
linear-time segmentation of documents that tokenization workers encode.

Why segment: a tokenizer's cost on one pre-token grows faster than its length (BPE training touches a
whole word at each merge that applies to it), and encoding a whole huge document at once holds all its
offsets in memory. So documents are cut into segments of at most SEGMENT_CHARS at points where the GPT-2 and
Llama 3 pre-tokenizer regexes split anyway (_SAFE_CUTS: the ids are the same as encoding the document
whole), and runs of over MAX_RUN characters without a class change (a long line
without whitespace, base64, ...) are cut every MAX_RUN characters, the only place the output differs from
encoding the document whole.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

EOS = "<|endoftext|>"
# End-of-document tokens of common tokenizer.json files (ours/GPT-2, Llama 3, Llama 2/SentencePiece, Gemma).
EOS_NAMES = (EOS, "<|end_of_text|>", "</s>", "<eos>")
SEGMENT_CHARS = 1 << 20
MAX_RUN = 256
_LONG_RUN = re.compile(rf"\S{{{MAX_RUN + 1},}}|\s{{{MAX_RUN + 1},}}")
# Safe cuts, best first: a lone newline between two non-space characters, then a letter followed by
# punctuation other than an apostrophe ("self|.x", "foo|("): both pre-tokenizer regexes split there and
# what precedes or follows the cut is matched the same with or without the rest of the text.
_SAFE_CUTS = (re.compile(r"(?<=\S)\n(?=\S)"), re.compile(r"(?<=[^\W\d_])(?=[^\w\s']|_)"))


@dataclass
class TokenizerInfo:
    """A resolved data.tokenizer: where it came from, its json (None = to be trained), its chat template."""

    setting: str  # "train", or the tokenizer.json path
    json_text: str | None
    chat_template: str | None = None
    special: dict | None = None  # bos_token / eos_token strings for the template
    tok: object = None  # the loaded tokenizer (checked when resolved, before any data work)

    @property
    def digest(self) -> str:
        body = self.json_text or f"train:{self.setting}"
        return hashlib.sha256((body + (self.chat_template or "")).encode()).hexdigest()


def tokenizer_path(setting: str, hf_path: str | None) -> Path | None:
    """The tokenizer.json data.tokenizer names: 'auto' = the model folder's (model.hf_path) or a trained one;
    a file; or a folder holding tokenizer.json (a Hugging Face model folder). None = train one here."""
    if setting == "auto":
        if not hf_path:
            return None
        setting = hf_path
        where = f"model.hf_path='{hf_path}' (data.tokenizer='auto' uses the model's own tokenizer)"
    elif setting == "train":
        return None
    else:
        where = f"data.tokenizer='{setting}'"
    path = Path(setting).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{where}: no tokenizer.json there; allowed: 'auto', 'train', a tokenizer.json file or "
                         f"a folder holding one")
    return path


def resolve_tokenizer(setting: str, hf_path: str | None, vocab_size: int) -> TokenizerInfo:
    path = tokenizer_path(setting, hf_path)
    if path is None:
        return TokenizerInfo(f"train (vocab {vocab_size})", None)
    template, special = _chat_template(path.parent)
    text = path.read_text(encoding="utf-8")
    return TokenizerInfo(str(path), text, template, special, load(text, f"data.tokenizer='{path}'"))


def _chat_template(folder: Path) -> tuple[str | None, dict]:
    """The chat template of a Hugging Face tokenizer folder: chat_template.jinja, or tokenizer_config.json's
    chat_template (a string, or a list of named templates: 'default')."""
    special: dict = {}
    template = None
    cfg_path = folder / "tokenizer_config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        for key in ("bos_token", "eos_token"):
            value = cfg.get(key)
            special[key] = value.get("content") if isinstance(value, dict) else value
        template = cfg.get("chat_template")
        if isinstance(template, list):
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return template, special


def chat_renderer(info: TokenizerInfo):
    """messages -> text, as transformers' apply_chat_template renders it (sandboxed jinja2, trim/lstrip
    blocks, no generation prompt); special tokens stay as text and are matched when encoding."""
    from datetime import datetime

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    template = env.from_string(info.chat_template)
    special = {k: v or "" for k, v in (info.special or {}).items()}

    def render(messages, where: str) -> str:
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError(f"data.source {where}: not a chat message list (a list of {{role, content}} objects)")
        return template.render(messages=messages, add_generation_prompt=False, **special)

    return render


def load(json_text: str, where: str = "data.tokenizer"):
    """A tokenizer from its JSON; a file that is not one is a user error (one line), not a Rust panic."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(json_text)
    except Exception as exc:  # tokenizers raises a bare Exception for malformed JSON or an unknown model
        raise ValueError(f"{where}: not a valid tokenizer.json ({exc}); allowed: a Hugging Face tokenizers JSON "
                         f"file, or data.tokenizer='train'") from None


def eos_id(tok) -> int | None:
    return next((i for i in map(tok.token_to_id, EOS_NAMES) if i is not None), None)


def train_bpe(pieces, vocab_size: int):
    """A byte-level BPE (GPT-2 style) trained on an iterator of text pieces (streamed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(pieces, trainer=trainer)
    return tok


def cut_long_runs(text: str) -> list[str]:
    """`text` as pieces that no pre-token spans across: runs of over MAX_RUN non-space (or space)
    characters are cut every MAX_RUN characters. Normal text comes back as [text]."""
    pieces, start = [], 0
    for m in _LONG_RUN.finditer(text):
        for cut in range(m.start() + MAX_RUN, m.end(), MAX_RUN):
            pieces.append(text[start:cut])
            start = cut
    pieces.append(text[start:])
    return pieces


def segments(text: str, limit: int = SEGMENT_CHARS) -> list[str]:
    """`text` cut into segments of at most `limit` characters at a safe cut (same ids as the whole text)
    where the window has one, else at `limit`."""
    out, start = [], 0
    while len(text) - start > limit:
        window_end = start + limit
        cut = None
        for pattern in _SAFE_CUTS:
            for m in pattern.finditer(text, start + 1, window_end):
                cut = m.end()
            if cut:
                break
        cut = cut or window_end
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def encode_items(tok, items: list[tuple[str, bool, bool]], eos: int | None, dtype: str) -> np.ndarray:
    """Token ids of a chunk of segments: (text, add_special_tokens, doc_end), with EOS after each document."""
    ids: list[int] = []
    for text, add_special, doc_end in items:
        if text:
            enc = tok.encode(cut_long_runs(text), is_pretokenized=True, add_special_tokens=add_special)
            ids.extend(enc.ids)
        if doc_end and eos is not None:
            ids.append(eos)
    return np.asarray(ids, dtype=dtype)


@lru_cache(maxsize=2)
def _from_file(path: str, mtime_ns: int):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def worker_encode(tokenizer_file: str, items, eos: int | None, dtype: str) -> np.ndarray:
    """encode_items in a worker process: the tokenizer is loaded once per process (cached by path and
    mtime; the chunks carry the path, not the tokenizer)."""
    return encode_items(_from_file(tokenizer_file, Path(tokenizer_file).stat().st_mtime_ns), items, eos, dtype)


def padding_allowance(model_vocab: int) -> int:
    """How many more embedding rows than tokens a pretrained model may have: checkpoints pad the matrix for
    fast kernels (GPT-NeoX 50,277 -> 50,432 rows, Qwen2.5 151,665 -> 151,936, phi-2 50,295 -> 51,200)."""
    return max(1024, model_vocab // 64)


def check_vocab_fits(tokens: int, model_vocab: int, hf_path: str | None, where: str) -> None:
    """The tokenizer's ids index the model's embedding: not more tokens than rows, and with pretrained
    weights (model.hf_path) not far fewer either (a different tokenizer's ids mean different tokens)."""
    if tokens > model_vocab:
        raise ValueError(f"model.vocab={model_vocab} is smaller than the tokenizer's {tokens} tokens ({where}); "
                         f"allowed: model.vocab >= {tokens}, or a smaller data.vocab_size")
    if hf_path and tokens < model_vocab - padding_allowance(model_vocab):
        raise ValueError(f"the tokenizer's {tokens} tokens ({where}) do not match the embedding of "
                         f"model.hf_path='{hf_path}' ({model_vocab} rows); allowed: the model's own tokenizer "
                         f"(data.tokenizer='auto' takes the folder's tokenizer.json)")


def check_model_tokenizer(data, hf_path: str | None, model_vocab: int) -> None:
    """Before any data work, on every rank: the tokenizer data.tokenizer resolves to suits the model."""
    if hf_path and data.tokenizer == "train":
        raise ValueError(f"data.tokenizer='train' with model.hf_path='{hf_path}': a tokenizer trained here does "
                         f"not match the pretrained embedding; allowed: 'auto' (the folder's tokenizer.json) or "
                         f"the tokenizer.json the model was trained with")
    path = tokenizer_path(data.tokenizer, hf_path)
    if path is not None:

        check_vocab_fits(load(Path(path).read_text(), f"data.tokenizer='{path}'").get_vocab_size(), model_vocab,
                         hf_path, f"data.tokenizer "
                         f"resolves to {path}")
