"""How `generate` picks each token (torch-free, so the CLI builds its options from it without importing torch)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (argmax). Otherwise softmax(logits / temperature) over the top_k tokens (0: all)
    whose cumulative probability first reaches top_p, drawn with a generator seeded by `seed`. Each field's help
    is its `paratrain generate` option's."""

    temperature: float = field(default=0.0, metadata={"help": "0 = greedy", "ge": 0})
    top_k: int = field(default=0, metadata={"help": "sample among the k most likely tokens (0 = all)", "ge": 0})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling threshold", "gt": 0, "le": 1})
    seed: int = field(default=0, metadata={"help": "random seed of the sampling"})

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature = {self.temperature}: must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k}: must be >= 0 (0 = no limit)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p}: must be in (0, 1]")
