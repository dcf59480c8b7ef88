"""Proposal sources behind one protocol: a DSpark/DFlash draft model, nothing, or (tests) an oracle.

The loop (:mod:`pyllama_dspark.decode.loop`) calls, per sequence:
  ``observe(row0, n, pos0)``  after a target decode: rows row0..row0+n-1 of that decode are now
                              committed at positions pos0.. (their captured features may be used);
  ``propose(anchor, pos0, n_draft)`` -> Proposal: up to n_draft tokens following ``anchor`` (which
                              sits at position pos0 and is not yet in the target memory);
  ``propose_batch([BlockRequest])`` the proposals of every sequence of a step at once (greedy or,
                              with a request's sampler, sampled); a draft model runs them in one
                              draft decode;
  ``rollback(p0)``            positions >= p0 were rejected: forget them;
  ``reset()``                 before a new generation.
  ``observe_later(...)``      as observe, after a cycle that drafted nothing: the rows may be kept
                              and folded in by the next proposal (a draft model keeps the captured
                              features on the host and injects them in one batch when drafting
                              resumes, so cycles without drafts cost what plain decoding costs).

Like llama.cpp's server, the loop always asks for a full ``n_max`` block and truncates the
proposal itself when fewer tokens may be drafted (near max_tokens / the end of the context): the
block is non-causal, so its length changes what the draft predicts.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

from pyllama_dspark.llama.handles import Draft
from pyllama_dspark.llama.prompt_state import SeqBytes, seq_state_size


@dataclass
class Proposal:
    tokens: np.ndarray                      # int32 [k]
    confidence: Optional[np.ndarray] = None  # float32 [k] (P(accepted | prefix accepted)), if known
    # T > 0 only: probs[i] is the distribution tokens[i] was drawn from (float64 [k, n_vocab] or a
    # sequence of such rows); None means a deterministic proposal (q = one-hot at tokens[i])
    probs: Optional[Sequence[np.ndarray]] = None


EMPTY = Proposal(np.zeros(0, dtype=np.int32))


@dataclass
class BlockRequest:
    """One sequence's request for a draft block in a step of the loop."""
    anchor: int           # the last emitted token, at position pos0 (not yet in the target memory)
    pos0: int
    n_draft: int          # drafts wanted (the block the drafter runs is sized by it)
    seq_id: int = 0
    sampler: object = None   # T > 0: the sequence's TokenSampler (drafts are drawn with it); None: greedy

#: Host memory one sequence may hold in deferred feature rows before they are injected in one
#: batch anyway ($PYLLAMA_DSPARK_DEFER_MB, default 64 MiB: ~5,800 rows of SmolLM2's 5 x 576
#: features, ~800 rows of a 20k-wide target).
DEFER_BYTES = int(float(os.environ.get("PYLLAMA_DSPARK_DEFER_MB", "64")) * (1 << 20))


class _Deferred:
    """Feature rows of one sequence captured but not yet injected: contiguous positions pos0.., in
    one buffer that grows (doubling) so that a cycle's row is copied straight into it."""

    __slots__ = ("pos0", "buf", "n", "_base", "_row_bytes")

    def __init__(self, pos0: int, width: int):
        self.pos0 = pos0
        self.n = 0
        self._row_bytes = 4 * int(width)
        self._alloc(np.empty((64, width), dtype=np.float32))

    def _alloc(self, buf: np.ndarray) -> None:
        self.buf = buf
        self._base = buf.ctypes.data

    @property
    def nbytes(self) -> int:
        return self.n * self._row_bytes

    @property
    def rows(self) -> np.ndarray:
        """The kept rows, [n, width] (a view)."""
        return self.buf[:self.n]

    def _reserve(self, k: int) -> None:
        if self.n + k > self.buf.shape[0]:
            grown = np.empty((max(2 * self.buf.shape[0], self.n + k), self.buf.shape[1]), dtype=np.float32)
            grown[:self.n] = self.buf[:self.n]
            self._alloc(grown)

    def add_captured(self, target, row0: int, k: int) -> None:
        """Rows row0..row0+k-1 of the target's last decode, copied to the end of the buffer."""
        self._reserve(k)
        target.copy_features_at(row0, k, self._base + self.n * self._row_bytes)
        self.n += k

    def add(self, rows: np.ndarray) -> None:
        self._reserve(rows.shape[0])
        self.buf[self.n:self.n + rows.shape[0]] = rows
        self.n += rows.shape[0]

    def truncate(self, p0: int) -> None:
        """Drop the rows at positions >= p0."""
        self.n = min(self.n, max(0, p0 - self.pos0))


class Proposer:
    name = "none"

    def max_draft(self) -> int:
        return 0

    def reset(self, seq_id: int = 0) -> None:
        pass

    def observe(self, row0: int, n: int, pos0: int, seq_id: int = 0) -> None:
        pass

    def observe_later(self, row0: int, n: int, pos0: int, seq_id: int = 0) -> None:
        """Like :meth:`observe` after a cycle that drafted nothing: a proposer may keep the rows
        and fold them in when it next proposes (no per-cycle draft work while drafting is off)."""
        self.observe(row0, n, pos0, seq_id)

    def propose(self, anchor: int, pos0: int, n_draft: int, seq_id: int = 0) -> Proposal:
        return EMPTY

    def llama_ms(self) -> float:
        """Milliseconds spent so far inside llama.cpp's decodes on the proposer's own contexts."""
        return 0.0

    def catch_up_ms(self) -> float:
        """Milliseconds spent so far folding in rows kept by :meth:`observe_later` (a running
        total): the first pass after plain cycles pays them, and they are not what a pass costs."""
        return 0.0

    def propose_sampled(self, anchor: int, pos0: int, n_draft: int, sampler, seq_id: int = 0) -> Proposal:
        """Temperature > 0: drafts drawn with ``sampler`` (a :class:`~.sampling.TokenSampler`) and
        the distributions they were drawn from (``Proposal.probs``).

        The default is the deterministic proposal (``probs`` None: q is one-hot at each token),
        which speculative sampling verifies losslessly too."""
        return self.propose(anchor, pos0, n_draft, seq_id)

    def propose_batch(self, requests: Sequence[BlockRequest]) -> List[Proposal]:
        """One proposal per request, in order (a proposer that can draft several sequences in one
        pass overrides this)."""
        return [propose_one(self, r) for r in requests]

    def rollback(self, p0: int, seq_id: int = 0) -> None:
        pass

    def state_size(self, seq_id: int = 0) -> int:
        """Bytes :meth:`save_state` would copy for ``seq_id`` (the prompt store sizes a state first)."""
        return 0

    def save_state(self, seq_id: int = 0):
        """What the proposer holds of ``seq_id`` (for the prompt store), or None: nothing."""
        return None

    def load_state(self, state, seq_id: int = 0) -> None:
        """``seq_id`` as :meth:`save_state` found it (``state`` None: emptied)."""
        self.reset(seq_id)

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
        self.offset = m.block_offset
        self._max = max(0, m.block_size - self.offset)
        self._deferred: Dict[int, _Deferred] = {}
        self.defer_bytes = DEFER_BYTES
        self.n_deferred_injections = 0     # catch-up injections made (rows folded in at once)
        self._catch_up_ms = 0.0

    def max_draft(self) -> int:
        return self._max

    def reset(self, seq_id: int = 0) -> None:
        self._deferred.pop(seq_id, None)
        self.draft.seq_rm(seq_id, 0, -1)

    def observe(self, row0: int, n: int, pos0: int, seq_id: int = 0) -> None:
        self.catch_up(seq_id)
        self.draft.inject_captured(row0, n, pos0, seq_id)

    def observe_later(self, row0: int, n: int, pos0: int, seq_id: int = 0) -> None:
        """Copy the captured rows to the host (a few KB per token); they are injected in one batch
        by :meth:`catch_up` before the next block, or once the buffer passes ``defer_bytes``."""
        dq = self._deferred.get(seq_id)
        if dq is not None and dq.pos0 + dq.n != pos0:   # not contiguous (cannot happen in the loops)
            self.catch_up(seq_id)
            dq = None
        if dq is None:
            dq = self._deferred[seq_id] = _Deferred(pos0, self.draft.target.feature_width)
        dq.add_captured(self.draft.target, row0, n)
        if dq.nbytes > self.defer_bytes:
            self.catch_up(seq_id)

    def catch_up(self, seq_id: int = 0) -> None:
        """Inject the deferred feature rows of ``seq_id`` (one batched injection)."""
        dq = self._deferred.pop(seq_id, None)
        if dq is None or dq.n == 0:
            return
        t0 = time.perf_counter()
        self.draft.inject(dq.rows, np.arange(dq.pos0, dq.pos0 + dq.n, dtype=np.int32), seq_id)
        self.n_deferred_injections += 1
        self._catch_up_ms += (time.perf_counter() - t0) * 1e3

    def catch_up_ms(self) -> float:
        return self._catch_up_ms

    def llama_ms(self) -> float:
        return self.draft.llama_ms

    def deferred_rows(self, seq_id: int = 0) -> int:
        dq = self._deferred.get(seq_id)
        return 0 if dq is None else dq.n

    def propose(self, anchor: int, pos0: int, n_draft: int, seq_id: int = 0) -> Proposal:
        return self.propose_batch([BlockRequest(anchor, pos0, n_draft, seq_id)])[0]

    def propose_batch(self, requests: Sequence[BlockRequest]) -> List[Proposal]:
        """Every request's block in one draft decode per block size (llama.cpp's DSpark graph
        needs equal blocks within a ubatch): greedy requests take each row's argmax (the greedy
        Markov chain runs inside the graph), sampled ones draw left to right (see
        :meth:`propose_sampled`)."""
        out = [EMPTY] * len(requests)
        by_size: Dict[int, List[int]] = {}
        for i, r in enumerate(requests):
            if r.n_draft > 0:
                by_size.setdefault(min(r.n_draft, self._max), []).append(i)
        for n_draft, idx in by_size.items():
            for i, p in zip(idx, self._blocks(n_draft, [requests[i] for i in idx])):
                out[i] = p
        return out

    def _blocks(self, n_draft: int, requests: Sequence[BlockRequest]) -> List[Proposal]:
        d, m, off = self.draft, self.meta, self.offset
        R, nb = len(requests), n_draft + self.offset
        for r in requests:
            self.catch_up(r.seq_id)
            d.samplers.want(r.seq_id, r.sampler is None)   # greedy rows read out on the device
        bs = self._sampler() if any(r.sampler is not None for r in requests) else None
        block = np.full(R * nb, m.mask_token_id, dtype=np.int32)
        block[::nb] = [r.anchor for r in requests]
        pos0 = np.asarray([r.pos0 for r in requests], dtype=np.int32)
        seqs = np.asarray([r.seq_id for r in requests], dtype=np.int32)
        d.decode_blocks(block, nb, pos0, seqs, hidden=bs is not None and bs.conf is not None
                        and bs.conditioning == "sampled")
        ids = margin = conf = None
        if bs is None or any(r.sampler is None for r in requests):
            ids = np.zeros(R * nb, dtype=np.int32)
            margin = np.zeros(R * nb, dtype=np.float32)
            d.argmax(0, R * nb, ids, margin)
            if m.has_confidence:
                conf = np.zeros(R * nb, dtype=np.float32)
                d.confidence(0, R * nb, conf)
        out = []
        for i, r in enumerate(requests):
            a = i * nb + off
            if r.sampler is None:
                out.append(Proposal(ids[a:a + n_draft].copy(), None if conf is None else conf[a:a + n_draft].copy()))
            else:
                tokens, q, c = bs.sample(a, n_draft, r.sampler)
                out.append(Proposal(tokens, c, q))
        # the block is non-causal: its noise K/V must not survive into the next block
        for r in requests:
            d.seq_rm(r.seq_id, r.pos0, -1)
        return out

    @property
    def block_sampler(self):
        """The :class:`~.draft_sampling.BlockSampler` T > 0 proposals use (built on first use)."""
        return self._sampler()

    def _sampler(self):
        if self._block_sampler is None:
            from pyllama_dspark.speculative.draft_sampling import BlockSampler, read_conf_head, read_d2t
            from pyllama_dspark.llama.markov_head import MarkovHead
            from pyllama_dspark.llama.rpc import local_gpu_devices

            d, m = self.draft, self.meta
            markov = conf = d2t = None
            if m.has_markov:
                s = d.settings
                # one thread: a [rank x n_vocab] product per call is too small to gain from a pool,
                # and a pool on a busy machine costs far more than it saves
                # on a local GPU when the draft is offloaded, never on an RPC device (a round trip
                # per drafted position for a [rank x n_vocab] product)
                markov = MarkovHead(d.path, use_gpu=s.offloaded and bool(local_gpu_devices()), n_threads=1)
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
        return self.propose_batch([BlockRequest(anchor, pos0, n_draft, seq_id, sampler)])[0]

    def rollback(self, p0: int, seq_id: int = 0) -> None:
        dq = self._deferred.get(seq_id)
        if dq is not None:
            dq.truncate(p0)
        self.draft.seq_rm(seq_id, p0, -1)

    def state_size(self, seq_id: int = 0) -> int:
        dq = self._deferred.get(seq_id)
        return seq_state_size(self.draft.ctx, seq_id) + (0 if dq is None else dq.nbytes)

    def save_state(self, seq_id: int = 0) -> "DraftState":
        """The draft's memory of ``seq_id`` and the feature rows kept on the host for it."""
        dq = self._deferred.get(seq_id)
        pending = None if dq is None or dq.n == 0 else (dq.pos0, dq.rows.copy())
        return DraftState(SeqBytes(self.draft.ctx, seq_id, seq_state_size(self.draft.ctx, seq_id)), pending)

    def load_state(self, state, seq_id: int = 0) -> None:
        self.reset(seq_id)
        if state is None:
            return
        state.memory.restore(self.draft.ctx, seq_id)
        if state.pending is not None:
            pos0, rows = state.pending
            dq = self._deferred[seq_id] = _Deferred(pos0, rows.shape[1])
            dq.add(rows)

    def close(self) -> None:
        self._deferred.clear()
        if self._markov is not None:
            self._markov.close()
            self._markov = None
        self.draft.close()


class DraftState:
    """A draft's part of a prompt state: its memory of the sequence and the pending feature rows
    (position of the first, rows [n, width]) not yet injected."""

    __slots__ = ("memory", "pending")

    def __init__(self, memory: SeqBytes, pending=None):
        self.memory, self.pending = memory, pending

    @property
    def nbytes(self) -> int:
        return self.memory.nbytes + (0 if self.pending is None else int(self.pending[1].nbytes))


def propose_one(prop, r: BlockRequest) -> Proposal:
    """``prop.propose`` / ``prop.propose_sampled`` for one request (a duck-typed proposer without
    ``propose_sampled`` makes a deterministic proposal, which speculative sampling verifies too)."""
    fn = getattr(prop, "propose_sampled", None) if r.sampler is not None else None
    if fn is not None:
        return fn(r.anchor, r.pos0, r.n_draft, r.sampler, r.seq_id)
    return prop.propose(r.anchor, r.pos0, r.n_draft, r.seq_id)


def _defined_in(cls: type, name: str) -> Optional[type]:
    return next((c for c in cls.__mro__ if name in c.__dict__), None)


def propose_all(prop, requests: Sequence[BlockRequest]) -> List[Proposal]:
    """One proposal per request: the proposer's ``propose_batch`` when its class has one that is no
    older than its ``propose`` / ``propose_sampled`` (a subclass that overrides only ``propose``,
    or a wrapper forwarding attributes to another proposer, is asked per request, so that its own
    methods run)."""
    cls = type(prop)
    batch = _defined_in(cls, "propose_batch")
    if batch is not None and all(issubclass(batch, o) for o in (_defined_in(cls, "propose"),
                                                                  _defined_in(cls, "propose_sampled")) if o):
        return batch.propose_batch(prop, requests)
    return [propose_one(prop, r) for r in requests]


def hidden_ms_of(prop) -> float:
    """``prop.hidden_ms()`` (milliseconds of a proposer's own work that is not a drafter's, such as
    the oracle computing its truth: kept out of every timing) for any proposer (0 without it)."""
    fn = getattr(prop, "hidden_ms", None)
    return float(fn()) if fn is not None else 0.0


def llama_ms_of(prop) -> float:
    """``prop.llama_ms()`` for any proposer (0 for None or a duck-typed one without it)."""
    fn = getattr(prop, "llama_ms", None)
    return float(fn()) if fn is not None else 0.0


def observe_later(prop, row0: int, n: int, pos0: int, seq_id: int = 0) -> None:
    """``prop.observe_later`` for any proposer (a duck-typed one without it observes now)."""
    fn = getattr(prop, "observe_later", None)
    (fn or prop.observe)(row0, n, pos0, seq_id)


def check_n_max(n_max: int) -> int:
    """The one check of a requested draft size (before any model is opened)."""
    if int(n_max) <= 0:
        raise ValueError(f"n_max must be >= 1, got {n_max}")
    return int(n_max)


def clamp_n_max(n_max: int, proposer: Proposer) -> int:
    """Validate n_max and clamp it to what the drafter was trained for (with a warning, as llama.cpp)."""
    check_n_max(n_max)
    limit = proposer.max_draft()
    if isinstance(proposer, NoDraft):
        return 0
    if n_max > limit:
        warnings.warn(
            f"requested n_max={n_max} exceeds what the {proposer.name} draft can produce per block "
            f"({limit}); clamping to {limit}", stacklevel=3)
        return limit
    return int(n_max)
