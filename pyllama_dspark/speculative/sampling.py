"""The sampler state of one generation (:class:`TokenSampler`): parameters, seeded draws and the
penalty history, over llama.cpp's sampler chain (:mod:`.chain`).

``temperature <= 0`` means greedy.  Without penalties the engine takes its exact greedy path and
never calls into this module.  With penalties (llama.cpp applies them before the greedy pick) a
:class:`TokenSampler` stands in: its rows are one-hot at the argmax of the penalized row, so the
speculative accept rule reduces to "draft == penalized argmax", the history including the drafted
prefix.

A request's ``logit_bias`` (token id -> bias added to its logit, -inf: never drawn) and grammar (a
:class:`~pyllama_dspark.llama.grammar.GrammarCursor` over llama.cpp's grammar engine) act on the target's rows before
the chain: the chain runs on the biased row with every token the grammar rejects at -inf, so the
output follows constrained sampling from the target (at T = 0 the constrained argmax, found with
one single-token grammar check when the unconstrained pick is allowed).  The draft's rows
(:meth:`TokenSampler.draft_probs`) get the bias but not the grammar: the loop cuts a block at its
first token the grammar rejects (:func:`~.verify.speculative_accept`'s ``cut_q``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, Iterable, Optional, Sequence

import numpy as np

from pyllama_dspark.speculative.chain import (chain_dist, chain_dist_native, chain_params_native, greedy_dist,
                                       logits_row)
from pyllama_dspark.speculative.dist import Dist, sample_from
from pyllama_dspark.speculative.sampling_params import SamplingParams, resolve_seed
from pyllama_dspark.speculative.shim import native_chain

# SamplingParams and Dist are imported from here by the decoding loops
__all__ = ["Dist", "SamplingParams", "TokenSampler"]


class TokenSampler:
    """Sampler state for one generation: parameters, a seeded RNG and the penalty history
    (``history``, the prompt, is kept only when ``params.penalize_prompt``).

    At temperature <= 0 (only needed with penalties: llama.cpp's greedy pick over the penalized
    row) :meth:`probs` is one-hot at that pick and the seed is None."""

    def __init__(self, params: SamplingParams, history: Iterable[int] = (), banned: Optional[Sequence[int]] = None,
                 logit_bias: Optional[Dict[int, float]] = None, grammar=None):
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(params).__name__}")
        self.params = params
        self.greedy = params.is_greedy
        self.seed = None if self.greedy else resolve_seed(params.seed)
        self.rng = np.random.default_rng(self.seed)
        self.history: list = list(history) if params.has_penalties and params.penalize_prompt else []
        self.banned = None if banned is None or not len(banned) else np.unique(np.asarray(banned, dtype=np.int64))
        self._banned32 = None if self.banned is None else self.banned.astype(np.int32)
        nat = native_chain()
        self._nat = nat
        self._cparams = (chain_params_native(nat, replace(params, temperature=0.0) if self.greedy else params)
                         if nat else None)
        self.grammar = grammar          # a GrammarCursor, or None
        if logit_bias:
            self._bias_ids = np.fromiter(logit_bias.keys(), dtype=np.int64, count=len(logit_bias))
            self._bias_vals = np.fromiter(logit_bias.values(), dtype=np.float32, count=len(logit_bias))
        else:
            self._bias_ids = None

    @property
    def constrained(self) -> bool:
        return self.grammar is not None

    def close(self) -> None:
        if self.grammar is not None:
            self.grammar.close()
            self.grammar = None

    def window(self, extra: Sequence[int] = ()) -> Optional[np.ndarray]:
        """The last penalty_last_n tokens of history + extra (None when penalties are off)."""
        if not self.params.has_penalties:
            return None
        n = self.params.penalty_last_n
        extra = list(extra)
        if n < 0:
            seq = self.history + extra
        else:
            seq = (self.history[-n:] + extra)[-n:] if n > 0 else []
        return np.asarray(seq, dtype=np.int32)

    def probs(self, logits: np.ndarray, extra: Sequence[int] = ()) -> Dist:
        """Chain distribution of a target logits row, the sequence being history + ``extra``
        (one-hot at the penalized argmax at temperature <= 0): logit bias, then the grammar's
        mask in the state after ``extra``, then the chain."""
        x = self._biased(logits)
        if self.grammar is None:
            return self._chain(x, extra)
        g = self.grammar.state_after(extra)
        if self.greedy:
            d = self._chain(x, extra)
            if g.allows(int(d.ids[0])):   # the unconstrained pick is allowed: it is the constrained one
                return d
        return self._chain(g.mask(x), extra)

    def draft_probs(self, logits: np.ndarray, extra: Sequence[int] = ()) -> Dist:
        """The draft's row: logit bias and chain, no grammar (see the module's doc)."""
        return self._chain(self._biased(logits), extra)

    def _biased(self, logits: np.ndarray) -> np.ndarray:
        if self._bias_ids is None:
            return logits
        x = np.array(logits, dtype=np.float32, copy=True)
        x[self._bias_ids] += self._bias_vals
        return x

    def _chain(self, logits: np.ndarray, extra: Sequence[int] = ()) -> Dist:
        if self._nat:
            return chain_dist_native(self._nat, logits_row(logits), self.params, self.window(extra), self._banned32,
                                     self._cparams)
        if self.greedy:
            return greedy_dist(logits, self.params, self.window(extra), self.banned)
        return chain_dist(logits, self.params, self.window(extra), self.banned)

    def sample(self, probs) -> int:
        return sample_from(probs, self.rng.random())

    def accept(self, tokens: Iterable[int]) -> None:
        """Tokens committed to the sequence (the penalty history, when penalties are on, and the
        grammar's state)."""
        tokens = [int(t) for t in tokens]
        if self.params.has_penalties:
            self.history.extend(tokens)
        if self.grammar is not None:
            self.grammar.commit(tokens)
