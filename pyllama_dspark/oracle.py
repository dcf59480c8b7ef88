"""An oracle proposer for tests and benchmarks: the target's own continuation with planted errors.

Random-weight drafts accept almost nothing, so they never exercise long accepted blocks, the
bonus token, partial acceptance at every position or EOS inside an accepted block.  The oracle
knows the reference sequence (prompt + the target's greedy continuation) and proposes it, except
that each block gets, with probability ``p_error``, one wrong token at a random position (or at
the positions ``error_at`` cycles through).  The engine must emit the reference either way.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .drafter import EMPTY, Proposal, Proposer


class OracleProposer(Proposer):
    name = "oracle"

    def __init__(self, reference: Sequence[int], n_vocab: int, *, block_size: int = 7, p_error: float = 0.5,
                 error_at: Optional[Sequence[Optional[int]]] = None, seed: int = 0):
        self.ref = np.asarray(list(reference), dtype=np.int32)
        self.n_vocab = int(n_vocab)
        self.block_size = int(block_size)
        self.p_error = float(p_error)
        self.error_at = list(error_at) if error_at is not None else None
        self.seed = seed
        self.reset()

    def max_draft(self) -> int:
        return self.block_size

    def reset(self, seq_id: int = 0) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.n_blocks = 0
        self.planted = []  # (pos0, index) of every planted error

    def _error_index(self, n: int) -> Optional[int]:
        if self.error_at is not None:
            e = self.error_at[self.n_blocks % len(self.error_at)]
            return e if e is not None and e < n else None
        if self.rng.random() < self.p_error:
            return int(self.rng.integers(0, n))
        return None

    def propose(self, anchor: int, pos0: int, n_draft: int, seq_id: int = 0) -> Proposal:
        if n_draft <= 0:
            return EMPTY
        n = min(n_draft, self.block_size)
        toks = np.empty(n, dtype=np.int32)
        avail = self.ref[pos0 + 1: pos0 + 1 + n]
        toks[: len(avail)] = avail
        # beyond the known reference: any tokens (they will be rejected or never reached)
        toks[len(avail):] = (np.arange(n - len(avail)) * 7919 + 13) % self.n_vocab
        e = self._error_index(n)
        if e is not None:
            toks[e] = (toks[e] + 1 + int(self.rng.integers(0, self.n_vocab - 1))) % self.n_vocab
            self.planted.append((pos0, e))
        self.n_blocks += 1
        # an oracle "knows" its survival: report 1 up to the planted error, 0 from there
        conf = np.ones(n, dtype=np.float32)
        if e is not None:
            conf[e:] = 0.0
        return Proposal(toks, conf)
