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

from pyllama_dspark.spec.drafter import EMPTY, Proposal, Proposer


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


class TableOracleProposer(Proposer):
    """A T > 0 proposer with a non-trivial q built from the target's own logits (tests, benches).

    ``table`` maps ``(pos0, anchor, x_1, ..., x_j)`` to the target's logits row after those tokens
    (the context before pos0 being the caller's fixed prompt).  Draft k is drawn from

        q_k = (1 - junk) * chain(row / skew) + junk * uniform(junk_ids)

    with ``chain`` the generation's sampler chain: close to the target (high, partial acceptance)
    but not equal to it, with some mass on ``junk_ids`` (tokens the target may never emit).
    Proposing stops where the table has no row for the prefix drawn so far.  At T = 0 it proposes
    the rows' argmax chain.
    """

    name = "table-oracle"

    def __init__(self, table, *, block_size: int = 7, skew: float = 1.5, junk: float = 0.1,
                 junk_ids: Sequence[int] = (0, 1, 2)):
        if skew <= 0:
            raise ValueError(f"skew must be > 0, got {skew}")
        if not 0.0 <= junk < 1.0:
            raise ValueError(f"junk must be in [0, 1), got {junk}")
        self.table = table
        self.block_size = int(block_size)
        self.skew = float(skew)
        self.junk = float(junk)
        self.junk_ids = np.unique(np.asarray(list(junk_ids), dtype=np.int64))

    def max_draft(self) -> int:
        return self.block_size

    def propose(self, anchor: int, pos0: int, n_draft: int, seq_id: int = 0) -> Proposal:
        key = (pos0, int(anchor))
        toks = []
        while len(toks) < min(n_draft, self.block_size) and key in self.table:
            toks.append(int(np.argmax(self.table[key])))
            key = key + (toks[-1],)
        return Proposal(np.asarray(toks, dtype=np.int32)) if toks else EMPTY

    def _q(self, row: np.ndarray, sampler, drafted):
        from pyllama_dspark.spec.sampling import Dist

        base = sampler.probs(np.asarray(row, dtype=np.float32) / np.float32(self.skew), drafted)
        if self.junk == 0.0 or self.junk_ids.size == 0:
            return base
        ids = np.union1d(base.ids, self.junk_ids)
        probs = np.zeros(ids.size)
        probs[np.searchsorted(ids, base.ids)] += (1.0 - self.junk) * base.probs
        probs[np.searchsorted(ids, self.junk_ids)] += self.junk / self.junk_ids.size
        return Dist(ids, probs, base.n_vocab)

    def propose_sampled(self, anchor: int, pos0: int, n_draft: int, sampler, seq_id: int = 0) -> Proposal:
        key = (pos0, int(anchor))
        toks, qs = [], []
        while len(toks) < min(n_draft, self.block_size) and key in self.table:
            q = self._q(self.table[key], sampler, toks)
            toks.append(sampler.sample(q))
            qs.append(q)
            key = key + (toks[-1],)
        if not toks:
            return EMPTY
        return Proposal(np.asarray(toks, dtype=np.int32), None, qs)
