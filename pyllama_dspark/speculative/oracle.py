"""Oracle proposers: the target's own continuation with planted errors.

Random-weight drafts accept almost nothing, so they never exercise long accepted blocks, the
bonus token, partial acceptance at every position or EOS inside an accepted block.  The oracle
knows the reference sequence (prompt + the target's greedy continuation) and proposes it, except
that each block gets, with probability ``p_error``, one wrong token at a random position (or at
the positions ``error_at`` cycles through).  The engine must emit the reference either way.

**The planted error** (:class:`OracleProposer`, the one definition every front end uses): the
drafter's full block of ``B`` drafts (``block_size``) is entirely right with probability
``P = 1 - p_error``; otherwise exactly one draft, at a position drawn uniformly from ``0 .. B-1``,
is replaced by another token (the drafts before it are right, the ones after it are never
reached).  A request for ``n < B`` drafts gets the first ``n`` drafts of that block, as from a
block drafter, whose first ``n`` drafts do not depend on how many are asked for: it holds the
error only when the error's position is below ``n``.  So ``P`` is a property of the drafter, not
of the verify length: the conditional acceptance at position ``k`` (0-based) is
``1 - (1 - P) / (B - k)`` whatever ``n``, a block of ``n`` is right with probability
``P + (1 - P) (B - n) / B``, and the expected number of accepted drafts of a full block of 7 is
``7 P + 3 (1 - P)``.

:class:`OracleDraft` is the user-facing form (``-md oracle:P`` on ``run``, ``bench`` and
``bench-schedule``): it answers "what would a drafter right with probability P give me here?"
without flattering.  It runs a real draft pass of a draft matched to the target (the shipped
drafter, or a random one of the target's shape) every time it proposes, discards that pass's
tokens, and reports no confidences (the ``auto`` schedule then works from the running acceptance,
as for a DFlash draft).  It is greedy only (T = 0): its q is a point mass, which at T > 0 would
not be the distribution of a real drafter.
"""

from __future__ import annotations

import contextlib
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from pyllama_dspark.llama.recurrent import undone
from pyllama_dspark.speculative.drafter import EMPTY, BlockRequest, Proposal, Proposer, propose_all


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

    def _error_index(self, n: int) -> Optional[Tuple[int, int]]:
        if self.error_at is not None:
            e = self.error_at[self.n_blocks % len(self.error_at)]
            return (e, 1 + int(self.rng.integers(0, self.n_vocab - 1))) if e is not None and e < n else None
        if self.rng.random() < self.p_error:
            # over the full block (its replacement drawn too, so that a shorter request leaves the
            # random stream as a full one would): n drafts are the block's first n
            e = int(self.rng.integers(0, self.block_size))
            bump = 1 + int(self.rng.integers(0, self.n_vocab - 1))
            return (e, bump) if e < n else None
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
        err = self._error_index(n)
        e = None
        if err is not None:
            e, bump = err
            toks[e] = (toks[e] + bump) % self.n_vocab
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
        from pyllama_dspark.speculative.sampling import Dist

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


class OracleSet(Proposer):
    """One :class:`OracleProposer` per prompt, bound to whichever sequence slot decodes that prompt
    (the decoding loop calls :meth:`bind` when it admits a request)."""

    name = "oracle"

    def __init__(self, prompts: Sequence[Sequence[int]] = (), refs: Sequence[Sequence[int]] = (), n_vocab: int = 0,
                 p_error: float = 0.5, seed: int = 0, block_size: int = 7):
        self.n_vocab, self.p_error, self.seed, self.block_size = int(n_vocab), float(p_error), int(seed), int(block_size)
        self._by_prompt: Dict[Tuple[int, ...], OracleProposer] = {}
        self._by_seq: Dict[int, OracleProposer] = {}
        for p, r in zip(prompts, refs):
            self.add(p, r)

    def add(self, prompt: Sequence[int], continuation: Sequence[int]) -> None:
        """Know ``continuation`` as the target's greedy output after ``prompt``."""
        key = tuple(int(t) for t in prompt)
        self._by_prompt[key] = OracleProposer(list(key) + [int(t) for t in continuation], self.n_vocab,
                                              block_size=self.block_size, p_error=self.p_error,
                                              seed=self.seed + len(self._by_prompt))

    def knows(self, prompt: Sequence[int]) -> bool:
        return tuple(int(t) for t in prompt) in self._by_prompt

    def bind(self, seq_id: int, prompt: Sequence[int]) -> None:
        key = tuple(int(t) for t in prompt)
        if key not in self._by_prompt:
            raise ValueError("the oracle has no reference continuation for this prompt (prepare() it first)")
        self._by_seq[seq_id] = self._by_prompt[key]

    def max_draft(self) -> int:
        return self.block_size

    def propose(self, anchor: int, pos0: int, n_draft: int, seq_id: int = 0) -> Proposal:
        return self._by_seq[seq_id].propose(anchor, pos0, n_draft, seq_id)


def greedy_reference(target, prompt: Sequence[int], n: int, seq_id: int = 0) -> List[int]:
    """The target's greedy continuation of ``prompt`` (``n`` tokens, end-of-generation tokens
    included and gone past), decoded as the loop's prefill does (``n_batch`` chunks) and then one
    token per decode.  Uses, and clears, sequence ``seq_id`` of ``target``."""
    toks = np.asarray(list(prompt), dtype=np.int32)
    if toks.size == 0:
        raise ValueError("empty prompt")
    if toks.size + n + 1 > target.n_ctx:
        from pyllama_dspark.errors import ContextOverflowError

        raise ContextOverflowError(f"prompt + {n} tokens exceed the context ({target.n_ctx})")
    ids, margin = np.zeros(1, dtype=np.int32), np.zeros(1, dtype=np.float32)
    out: List[int] = []
    target.seq_rm(seq_id, 0, -1)
    try:
        for c0 in range(0, toks.size, target.n_batch):
            chunk = toks[c0:c0 + target.n_batch]
            target.decode(chunk, c0, seq_id, all_outputs=False)
        target.argmax(int(min(toks.size - c0, target.n_batch)) - 1, 1, ids, margin)
        out.append(int(ids[0]))
        while len(out) < n:
            target.decode(np.asarray(out[-1:], dtype=np.int32), toks.size + len(out) - 1, seq_id)
            target.argmax(0, 1, ids, margin)
            out.append(int(ids[0]))
    finally:
        target.seq_rm(seq_id, 0, -1)
    return out


class OracleDraft(Proposer):
    """``-md oracle:P``: the target's greedy continuation, each block entirely right with
    probability ``p`` (see the module's definition of the planted error), proposed after a real
    draft pass of ``inner`` (a :class:`~.drafter.DraftModelProposer` matched to the target) whose
    tokens are discarded; no confidences.  Greedy only.  :meth:`prepare` the prompts first (their
    reference continuations are decoded then, outside any timing).

    **Re-anchoring.**  The greedy continuation is the one the verifier computes from the *current*
    prefix.  Where a committed token leaves the prepared reference (a numerical near-tie between
    batch shapes: on a GPU, llama.cpp picks kernels by batch size, so a token verified in a block
    can differ from the same token decoded alone), the oracle follows the new prefix:

    - ``mode="reference"`` (the default on a CPU): the prepared reference; after a divergence, the
      continuation of the new prefix is decoded one token at a time on the sequence itself (then
      removed again), as the reference was;
    - ``mode="shadow"`` (the default when the target is offloaded to a GPU): every block is what
      the verify will compute: a decode of [anchor, guesses] on the sequence itself, in the verify's
      shape, its argmax taken as the next guesses until they agree (one decode when the guesses
      were right), then removed, so the verify decodes the same rows on the same memory.

    Their time is the oracle's, not a drafter's: it is kept in :meth:`hidden_ms` (and out of
    :meth:`llama_ms`), which the loop takes out of the draft pass and the generation's time.
    ``n_reanchored`` counts the blocks whose prepared reference was wrong."""

    name = "oracle"
    has_confidence = False
    MODES = ("auto", "reference", "shadow")

    def __init__(self, target, inner, p: float, *, seed: int = 0, mode: str = "auto"):
        if mode not in self.MODES:
            raise ValueError(f"oracle mode must be one of {self.MODES}, got {mode!r}")
        self.target = target
        self.inner = inner
        self.p = float(p)
        self.memory_tag = f"oracle:{self.p:g}"
        self.offset = getattr(inner, "offset", 0)
        self.set = OracleSet(n_vocab=target.n_vocab, p_error=1.0 - self.p, seed=seed, block_size=inner.max_draft())
        offloaded = bool(getattr(getattr(target, "settings", None), "offloaded", False))
        self.mode = ("shadow" if offloaded else "reference") if mode == "auto" else mode
        self.n_reanchored = 0
        self.n_shadow_decodes = 0
        self._hidden_ms = 0.0
        self._hidden_llama_ms = 0.0

    def prepare(self, prompts: Sequence[Sequence[int]], n: int) -> None:
        """Decode the reference continuation (``n`` tokens) of every prompt not known yet."""
        for p in prompts:
            if not self.set.knows(p):
                self.set.add(p, greedy_reference(self.target, p, n))

    def bind(self, seq_id: int, prompt: Sequence[int]) -> None:
        self.set.bind(seq_id, prompt)

    def max_draft(self) -> int:
        return self.inner.max_draft()

    def reset(self, seq_id: int = 0) -> None:
        self.inner.reset(seq_id)

    def observe(self, row0: int, n: int, pos0: int, seq_id: int = 0) -> None:
        self.inner.observe(row0, n, pos0, seq_id)

    def observe_later(self, row0: int, n: int, pos0: int, seq_id: int = 0) -> None:
        self.inner.observe_later(row0, n, pos0, seq_id)

    def rollback(self, p0: int, seq_id: int = 0) -> None:
        self.inner.rollback(p0, seq_id)

    def catch_up_ms(self) -> float:
        return self.inner.catch_up_ms()

    def llama_ms(self) -> float:
        # the inner draft's decodes, less the target decodes made for the oracle's own truth
        return self.inner.llama_ms() - self._hidden_llama_ms

    def hidden_ms(self) -> float:
        """Milliseconds spent so far computing the oracle's truth (a running total)."""
        return self._hidden_ms

    def propose_batch(self, requests: Sequence[BlockRequest]) -> List[Proposal]:
        if any(r.sampler is not None for r in requests):
            raise ValueError("the oracle proposer is greedy only (temperature 0)")
        propose_all(self.inner, requests)   # the real draft pass; its tokens are discarded
        t0, l0 = time.perf_counter(), self.target.llama_ms
        live = [r for r in requests if r.n_draft > 0]
        if live:
            self._shadow(live) if self.mode == "shadow" else [self._follow(r) for r in live]
        self._hidden_llama_ms += self.target.llama_ms - l0
        self._hidden_ms += (time.perf_counter() - t0) * 1e3
        out = []
        for r in requests:
            p = self.set.propose(r.anchor, r.pos0, r.n_draft, r.seq_id)
            out.append(Proposal(p.tokens) if len(p.tokens) else EMPTY)
        return out

    # ---- the truth: the greedy continuation of the current prefix --------------------------------
    def _set_truth(self, o: "OracleProposer", pos0: int, anchor: int, truth) -> None:
        """The reference of ``o`` from ``pos0`` on is ``anchor`` then ``truth``; counts a wrong one."""
        need = pos0 + 1 + len(truth)
        ref = o.ref
        known = ref[pos0:need]
        if len(known) < need - pos0 or known[0] != anchor or np.any(known[1:] != truth):
            if len(known) and (known[0] != anchor or np.any(known[1:len(known)] != truth[:len(known) - 1])):
                self.n_reanchored += 1
            if ref.size < need:
                ref = np.concatenate([ref, np.zeros(need - ref.size, dtype=np.int32)])
            ref[pos0] = anchor
            ref[pos0 + 1:need] = truth
            o.ref = ref

    def _follow(self, r: BlockRequest) -> None:
        """Reference mode: after a divergence, the continuation of the new prefix, one token a
        decode on the sequence itself (removed again), as far as the prepared reference reached."""
        o = self.set._by_seq[r.seq_id]
        if r.pos0 < o.ref.size and o.ref[r.pos0] == r.anchor:
            return
        tgt = self.target
        n = max(int(o.ref.size) - r.pos0 - 1, self.set.block_size)
        n = min(n, tgt.n_ctx - r.pos0 - 1)
        ids, margin = np.zeros(1, dtype=np.int32), np.zeros(1, dtype=np.float32)
        out, tok = [], r.anchor
        with undone(tgt, r.seq_id, r.pos0):
            for i in range(n):
                tgt.decode(np.asarray([tok], dtype=np.int32), r.pos0 + i, r.seq_id)
                tgt.argmax(0, 1, ids, margin)
                tok = int(ids[0])
                out.append(tok)
        self.n_reanchored += 1
        o.ref = np.concatenate([o.ref[:r.pos0], np.asarray([r.anchor] + out, dtype=np.int32)])

    def _shadow(self, requests: Sequence[BlockRequest]) -> None:
        """Shadow mode: each request's block as the verify computes it (see the class docstring)."""
        tgt = self.target
        guesses = []
        for r in requests:
            o = self.set._by_seq[r.seq_id]
            n = min(r.n_draft, self.set.block_size)
            g = np.zeros(n, dtype=np.int32)
            if r.pos0 < o.ref.size and o.ref[r.pos0] == r.anchor:
                avail = o.ref[r.pos0 + 1:r.pos0 + 1 + n]
                g[:avail.size] = avail
            guesses.append(g)
        rows = sum(1 + g.size for g in guesses)
        tok, pos, seqs = (np.zeros(rows, dtype=np.int32) for _ in range(3))
        outs = np.ones(rows, dtype=np.int8)
        ids, margin = np.zeros(rows, dtype=np.int32), np.zeros(rows, dtype=np.float32)
        for _ in range(1 + max(g.size for g in guesses)):
            at = 0
            for r, g in zip(requests, guesses):
                k = 1 + g.size
                tok[at], tok[at + 1:at + k] = r.anchor, g
                pos[at:at + k] = np.arange(r.pos0, r.pos0 + k, dtype=np.int32)
                seqs[at:at + k] = r.seq_id
                at += k
            with contextlib.ExitStack() as undo:
                for r in requests:
                    undo.enter_context(undone(tgt, r.seq_id, r.pos0))
                tgt.decode_rows(tok, pos, seqs, outs)
                self.n_shadow_decodes += 1
                tgt.argmax(0, rows, ids, margin)
            done, at = True, 0
            for g in guesses:
                y = ids[at:at + g.size]
                wrong = np.flatnonzero(y != g)
                if wrong.size:
                    done = False
                    g[wrong[0]:] = y[wrong[0]:]
                at += 1 + g.size
            if done:
                break
        for r, g in zip(requests, guesses):
            self._set_truth(self.set._by_seq[r.seq_id], r.pos0, r.anchor, g)

    def propose(self, anchor: int, pos0: int, n_draft: int, seq_id: int = 0) -> Proposal:
        return self.propose_batch([BlockRequest(anchor, pos0, n_draft, seq_id)])[0]

    def propose_sampled(self, anchor, pos0, n_draft, sampler, seq_id: int = 0) -> Proposal:
        raise ValueError("the oracle proposer is greedy only (temperature 0)")

    def close(self) -> None:
        self.inner.close()
