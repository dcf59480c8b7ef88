"""A draft's metadata as the shim reads it (layers it needs from the target, block layout, heads)."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import List

from pyllama_dspark.gguf.info import block_offset
from pyllama_dspark.llama import _native as nat


@dataclass
class DraftMeta:
    target_layers: List[int]
    block_size: int
    mask_token_id: int
    sample_from_anchor: bool
    causal: bool
    has_confidence: bool
    has_markov: bool
    markov_rank: int
    has_d2t: bool
    n_vocab_draft: int

    @property
    def kind(self) -> str:
        return "dspark" if self.has_markov else "dflash"

    @property
    def block_offset(self) -> int:
        """Block row of the first draft (see :func:`~pyllama_dspark.gguf.info.block_offset`)."""
        return block_offset(self.has_markov, self.sample_from_anchor)

    @classmethod
    def from_native(cls, m: nat.DraftMeta) -> "DraftMeta":
        return cls(
            target_layers=[int(m.target_layers[i]) for i in range(m.n_target_layers)],
            block_size=int(m.block_size),
            mask_token_id=int(m.mask_token_id),
            sample_from_anchor=bool(m.sample_from_anchor),
            causal=bool(m.causal),
            has_confidence=bool(m.has_confidence),
            has_markov=bool(m.has_markov),
            markov_rank=int(m.markov_rank),
            has_d2t=bool(m.has_d2t),
            n_vocab_draft=int(m.n_vocab_draft),
        )


def read_draft_meta(path: str) -> DraftMeta:
    m = nat.DraftMeta()
    nat.check(nat.read_draft_meta(os.fsencode(path), ctypes.byref(m)), f"reading draft metadata of {path}")
    return DraftMeta.from_native(m)
