"""Proposal sources behind one protocol: a DSpark/DFlash draft model, nothing, or (tests) an oracle.

The engine calls, per sequence:
  ``observe(row0, n, pos0)``  after a target decode: rows row0..row0+n-1 of that decode are now
                              committed at positions pos0.. (their captured features may be used);
  ``propose(anchor, pos0, n_draft)`` -> Proposal: up to n_draft tokens following ``anchor`` (which
                              sits at position pos0 and is not yet in the target memory);
  ``rollback(p0)``            positions >= p0 were rejected: forget them;
  ``reset()``                 before a new generation.

Like llama.cpp's server, the engine always asks for a full ``n_max`` block and truncates the
proposal itself when fewer tokens may be drafted (near max_tokens / the end of the context): the
block is non-causal, so its length changes what the draft predicts.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .handles import Draft


@dataclass
class Proposal:
    tokens: np.ndarray                      # int32 [k]
    confidence: Optional[np.ndarray] = None  # float32 [k] (P(accepted | prefix accepted)), if known
    # T > 0 only: probs[i] is the distribution tokens[i] was drawn from (float64 [k, n_vocab] or a
    # sequence of such rows); None means a deterministic proposal (q = one-hot at tokens[i])
    probs: Optional[Sequence[np.ndarray]] = None


EMPTY = Proposal(np.zeros(0, dtype=np.int32))


class Proposer:
    name = "none"

    def max_draft(self) -> int:
        return 0

    def reset(self, seq_id: int = 0) -> None:
        pass

    def observe(self, row0: int, n: int, pos0: int, seq_id: int = 0) -> None:
        pass

    def propose(self, anchor: int, pos0: int, n_draft: int, seq_id: int = 0) -> Proposal:
        return EMPTY

    def propose_sampled(self, anchor: int, pos0: int, n_draft: int, sampler, seq_id: int = 0) -> Proposal:
        """Temperature > 0: drafts drawn with ``sampler`` (a :class:`~.sampling.TokenSampler`) and
        the distributions they were drawn from (``Proposal.probs``).

        The default is the deterministic proposal (``probs`` None: q is one-hot at each token),
        which speculative sampling verifies losslessly too."""
        return self.propose(anchor, pos0, n_draft, seq_id)

    def rollback(self, p0: int, seq_id: int = 0) -> None:
        pass

    def close(self) -> None:
        pass


class NoDraft(Proposer):
    """Plain target decoding (one token per cycle)."""


class DraftModelProposer(Proposer):
    """A DFlash / DSpark block drafter running in its llama.cpp context.

    DSpark with ``sample_from_anchor`` (anchor-first): block [anchor, mask x (k-1)], row i predicts
    the token at pos0+1+i -> k drafts from k rows.  DFlash (and bonus-anchor DSpark): block
    [anchor, mask x k], drafts read from rows 1..k.  The greedy Markov chain runs inside llama.cpp's
    draft graph, so the argmax of each row is the DSpark greedy draft.
    """

    def __init__(self, draft: Draft, conditioning: str = "sampled"):
        self.draft = draft
        m = draft.meta
        self.meta = m
        self.name = m.kind
        self.conditioning = conditioning
        self._block_sampler = None  # built on the first T > 0 proposal (loads the Markov head)
        self._markov = None
        self.offset = 0 if (m.has_markov and m.sample_from_anchor) else 1
        self._max = max(0, m.block_size - self.offset)
        cap = m.block_size + 1
        self._block = np.full(cap, m.mask_token_id, dtype=np.int32)
        self._ids = np.zeros(cap, dtype=np.int32)
        self._margin = np.zeros(cap, dtype=np.float32)
        self._conf = np.zeros(cap, dtype=np.float32)

    def max_draft(self) -> int:
        return self._max

    def reset(self, seq_id: int = 0) -> None:
        self.draft.seq_rm(seq_id, 0, -1)

    def observe(self, row0: int, n: int, pos0: int, seq_id: int = 0) -> None:
        self.draft.inject_captured(row0, n, pos0, seq_id)

    def propose(self, anchor: int, pos0: int, n_draft: int, seq_id: int = 0) -> Proposal:
        if n_draft <= 0:
            return EMPTY
        n_draft = min(n_draft, self._max)
        n_block = n_draft + self.offset
        block = self._block[:n_block]
        block[0] = anchor
        block[1:] = self.meta.mask_token_id
        d = self.draft
        d.decode_block(block, pos0, seq_id)
        d.argmax(self.offset, n_draft, self._ids, self._margin)
        conf = None
        if self.meta.has_confidence:
            d.confidence(self.offset, n_draft, self._conf)
            conf = self._conf[:n_draft].copy()
        # the block is non-causal: its noise K/V must not survive into the next block
        d.seq_rm(seq_id, pos0, -1)
        return Proposal(self._ids[:n_draft].copy(), conf)

    @property
    def block_sampler(self):
        """The :class:`~.draft_sampling.BlockSampler` T > 0 proposals use (built on first use)."""
        return self._sampler()

    def _sampler(self):
        if self._block_sampler is None:
            from .draft_sampling import BlockSampler, read_conf_head, read_d2t
            from .handles import MarkovHead

            d, m = self.draft, self.meta
            markov = conf = d2t = None
            if m.has_markov:
                s = d.settings
                # one thread: a [rank x n_vocab] product per call is too small to gain from a pool,
                # and a pool on a busy machine costs far more than it saves
                markov = MarkovHead(d.path, use_gpu=s.n_gpu_layers > 0, n_threads=1)
                self._markov = markov
                if m.has_confidence:
                    conf = read_conf_head(d.path, d.n_embd, markov.rank)
            if m.has_d2t:
                d2t = read_d2t(d.path)
            self._block_sampler = BlockSampler(d, markov, conf, d2t, self.conditioning)
        return self._block_sampler

    def propose_sampled(self, anchor: int, pos0: int, n_draft: int, sampler, seq_id: int = 0) -> Proposal:
        """T > 0: the block decode as for greedy, then drafts drawn left to right from
        chain(U_k + B(x_{k-1})) with x_{k-1} the token drawn before (see :mod:`.draft_sampling`)."""
        if n_draft <= 0:
            return EMPTY
        bs = self._sampler()
        n_draft = min(n_draft, self._max)
        n_block = n_draft + self.offset
        block = self._block[:n_block]
        block[0] = anchor
        block[1:] = self.meta.mask_token_id
        d = self.draft
        d.decode_block(block, pos0, seq_id, hidden=bs.conf is not None and bs.conditioning == "sampled")
        tokens, q, conf = bs.sample(self.offset, n_draft, sampler)
        d.seq_rm(seq_id, pos0, -1)
        return Proposal(tokens, conf, q)

    def rollback(self, p0: int, seq_id: int = 0) -> None:
        self.draft.seq_rm(seq_id, p0, -1)

    def close(self) -> None:
        if self._markov is not None:
            self._markov.close()
            self._markov = None
        self.draft.close()


def clamp_n_max(n_max: int, proposer: Proposer) -> int:
    """Validate n_max and clamp it to what the drafter was trained for (with a warning, as llama.cpp)."""
    if int(n_max) <= 0:
        raise ValueError(f"n_max must be >= 1, got {n_max}")
    limit = proposer.max_draft()
    if isinstance(proposer, NoDraft):
        return 0
    if n_max > limit:
        warnings.warn(
            f"requested n_max={n_max} exceeds what the {proposer.name} draft can produce per block "
            f"({limit}); clamping to {limit}", stacklevel=3)
        return limit
    return int(n_max)
