"""How `generate` picks each token (torch-free, so the CLI builds its options from it without importing torch)."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config.options import described


@dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (argmax). Otherwise softmax(logits / temperature) over the top_k tokens (0: all)
    whose cumulative probability first reaches top_p, drawn with a generator seeded by `seed`. Each field's help
    is its `paratrain generate` option's."""

    temperature: float = described("0 = greedy", 0.0, ge=0)
    top_k: int = described("sample among the k most likely tokens (0 = all)", 0, ge=0)
    top_p: float = described("nucleus sampling threshold", 1.0, gt=0, le=1)
    seed: int = described("random seed of the sampling", 0)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature = {self.temperature}: must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k}: must be >= 0 (0 = no limit)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p}: must be in (0, 1]")
