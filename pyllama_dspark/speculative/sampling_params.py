"""llama.cpp's sampling parameters (:class:`SamplingParams`, checked on construction) and the seed a
generation draws with."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

# llama.cpp's LLAMA_DEFAULT_SEED: "pick a random seed"
LLAMA_DEFAULT_SEED = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp sampling parameters; the defaults are llama.cpp's (``common_params_sampling``).

    ``seed`` None, -1 or 0xFFFFFFFF draws a random seed per generation; any other value makes the
    generation deterministic.  ``penalty_last_n`` -1 means the whole sequence, 0 disables the
    penalties.  ``penalize_prompt``: the penalties count the prompt's tokens too, as llama-server
    feeds them to its sampler (``run``, ``serve``); llama-cpp-python's ``Llama`` counts only the
    generated tokens (the ``DSpark`` class sets it False).
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: Optional[int] = None
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    penalize_prompt: bool = True

    def __post_init__(self):
        self.validate()

    @classmethod
    def greedy(cls) -> "SamplingParams":
        return cls(temperature=0.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def has_penalties(self) -> bool:
        return self.penalty_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0)

    def with_seed(self, seed: Optional[int]) -> "SamplingParams":
        return replace(self, seed=seed)

    def validate(self) -> None:
        def num(name, integral=False):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise TypeError(f"sampling parameter {name} must be a number, got {v!r}")
            if integral and float(v) != int(v):
                raise ValueError(f"sampling parameter {name} must be an integer, got {v!r}")
            if not math.isfinite(float(v)):
                raise ValueError(f"sampling parameter {name} must be finite, got {v!r}")
            return v

        for n in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            num(n)
        num("top_k", True)
        num("penalty_last_n", True)
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repeat_penalty <= 0.0:
            raise ValueError(f"repeat_penalty must be > 0 (1.0 = off), got {self.repeat_penalty}")
        if not isinstance(self.penalize_prompt, (bool, np.bool_)):
            raise TypeError(f"penalize_prompt must be a bool, got {self.penalize_prompt!r}")
        if self.penalty_last_n < -1:
            raise ValueError(f"penalty_last_n must be >= -1 (-1 = whole sequence, 0 = off), got {self.penalty_last_n}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
                raise TypeError(f"seed must be an integer or None, got {self.seed!r}")
            if self.seed < -1:
                raise ValueError(f"seed must be >= 0 (or -1 / None for a random seed), got {self.seed}")

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def resolve_seed(seed: Optional[int]) -> int:
    """The seed a generation uses: ``seed`` itself, or a fresh random one for None / -1 / 0xFFFFFFFF."""
    if seed is None or seed == -1 or seed == LLAMA_DEFAULT_SEED:
        return int(np.random.SeedSequence().entropy % (1 << 63))
    return int(seed)
