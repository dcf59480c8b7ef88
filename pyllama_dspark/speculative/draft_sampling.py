"""Semi-autoregressive DSpark drafting at temperature > 0.

llama.cpp's draft graph runs the Markov chain itself, greedily: output row k of a DSpark block is
``U_k + B(a_{k-1})`` where ``a_{k-1}`` is the argmax of the previous *output* row (the anchor for
the first prediction slot) and ``B(prev) = W2 . W1[prev]``.  Sampling needs the chain conditioned
on the token actually drawn at k-1 instead:

    p_d,k  ∝  chain( U_k + B(x_{k-1}) )  =  chain( row_k - B(a_{k-1}) + B(x_{k-1}) )

with ``chain`` the same sampler chain the target goes through (:mod:`.chain`).  Where the drawn
token equals the argmax the row is already right; elsewhere one small device call on the shim's
Markov graph returns ``B(a_{k-1})``, ``B(x_{k-1})`` and ``W1[x_{k-1}]`` (no host-side W2.W1
product), and the confidence is recomputed with the drawn token:
``c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b)`` from the draft's hidden state ``h_k``.

Reduced-vocabulary drafts (``d2t``): the bias rows live in the draft vocabulary and are scattered
to the target ids (``row_k`` is -inf on every other id, so those stay impossible).

On the shim's Markov head the re-conditioning is one product, ``B(x) - B(a) = s W2 . d`` with
``d = W1[x] - W1[a]`` (:class:`MarkovDelta`), and when the chain has a filter that bounds what it
keeps (top-k; min-p without top-p; the greedy pick) it is computed exactly only where a token can
pass it (``dspark_markov_candidates``).  A 7-bit copy of W2 and an 8-bit one of d give every
token's bias up to a rigorous bound (the norms of both quantization errors, plus the float rounding
of the exact product), i.e. an interval [lo, hi] for each biased logit; the k-th largest lo is a value k tokens
reach whatever the exact bias, so a token whose hi stays below it cannot enter the top k (min-p:
below max lo + log(min_p)).  The remaining candidates (tens of tokens) get their exact bias, then
the same chain (ids in the same order, penalties / logit bias / bans remapped; those ids are always
candidates) gives the same distribution as the whole row.  top-p without top-k weighs the whole
vocabulary: there the whole row is biased.  (A norm bound |s| ||W2[v]|| ||d|| alone is too loose:
on a random draft it keeps most of the vocabulary.)

``conditioning="argmax"`` keeps llama.cpp's greedy conditioning (q_k = chain(row_k) as returned
by the graph).  That proposal is still verified losslessly, but it is not the DSpark draft
distribution; it exists to compare against (and to show that the tests notice the difference).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from pyllama_dspark.errors import DraftMismatchError, NativeError
from pyllama_dspark.speculative.chain import chain_dist_native
from pyllama_dspark.speculative.dist import Dist
from pyllama_dspark.speculative.sampling import TokenSampler
from pyllama_dspark.speculative.shim import native_chain

CONDITIONING = ("sampled", "argmax")


@dataclass
class ConfHead:
    """conf_proj split at n_embd: c = sigmoid(w_h . h + w_r . W1[prev] + b)."""
    w_h: np.ndarray   # float64 [n_embd]
    w_r: np.ndarray   # float64 [rank]
    b: float

    def __call__(self, h: np.ndarray, w1_prev: np.ndarray) -> float:
        z = float(np.dot(self.w_h, h)) + float(np.dot(self.w_r, w1_prev)) + self.b
        return float(1.0 / (1.0 + np.exp(-z)))


def _tensor_values(reader, name: str) -> Optional[np.ndarray]:
    """A tensor's values, flattened (dequantized to float32 for quantized / half types)."""
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import dequantize

    for t in reader.tensors:
        if t.name == name:
            data = np.asarray(t.data)
            if t.tensor_type not in (QT.F32, QT.F16, QT.I8, QT.I16, QT.I32, QT.I64, QT.F64):
                data = dequantize(data, t.tensor_type)
            return np.asarray(data).reshape(-1)
    return None


@dataclass(frozen=True)
class _DraftHeadValues:
    """The few tensor values T > 0 drafting reads from a draft file (kept across processes by the
    gguf layer's store, so a process need not parse the file's metadata again to get them)."""
    path: str
    conf_w: Optional[tuple]
    conf_b: Optional[float]
    d2t: Optional[tuple]


def _head_values(path: str) -> _DraftHeadValues:
    from pyllama_dspark.gguf.reader import cached_info, read_gguf

    def build() -> _DraftHeadValues:
        r = read_gguf(path)
        w, b, d2t = (_tensor_values(r, n) for n in ("conf_proj.weight", "conf_proj.bias", "d2t"))
        return _DraftHeadValues(path, None if w is None else tuple(float(x) for x in w),
                                None if b is None else float(b[0]),
                                None if d2t is None else tuple(int(x) for x in d2t))

    return cached_info("draft-heads", path, True, build, _DraftHeadValues)


def read_conf_head(path: str, n_embd: int, rank: int) -> Optional[ConfHead]:
    """The confidence head of a DSpark draft GGUF (None when it has none)."""
    v = _head_values(os.fspath(path))
    if v.conf_w is None:
        return None
    w = np.asarray(v.conf_w, dtype=np.float64)
    if w.size != n_embd + rank:
        raise DraftMismatchError(f"conf_proj.weight has {w.size} values, expected n_embd + rank = {n_embd + rank}")
    return ConfHead(w[:n_embd].copy(), w[n_embd:].copy(), v.conf_b if v.conf_b is not None else 0.0)


def read_d2t(path: str) -> Optional[np.ndarray]:
    """The draft-row -> target-id table of a reduced-vocabulary draft (None for a full vocabulary)."""
    v = _head_values(os.fspath(path))
    return None if v.d2t is None else np.asarray(v.d2t, dtype=np.int64)


def bias_delta(b_graph: np.ndarray, b_sampled: np.ndarray, d2t: Optional[np.ndarray], n_vocab: int) -> np.ndarray:
    """B(x) - B(a) on the target vocabulary (float32 [n_vocab]): what turns llama.cpp's row
    conditioned on a into the row conditioned on x.  Reduced-vocabulary drafts scatter the draft
    rows to their target ids through ``d2t`` (every other id gets 0)."""
    d = np.asarray(b_sampled, dtype=np.float32) - np.asarray(b_graph, dtype=np.float32)
    if d2t is None:
        if d.size != n_vocab:
            raise ValueError(f"bias rows have {d.size} entries for a {n_vocab}-token vocabulary and no d2t")
        return d
    if d2t.size != d.size:
        raise ValueError(f"d2t has {d2t.size} entries, the bias rows {d.size}")
    full = np.zeros(n_vocab, dtype=np.float32)
    full[d2t] = d
    return full


#: more candidates than 1 / PRUNE_SHARE of the vocabulary: the whole row is biased instead
PRUNE_SHARE = 8


def bound_filter(smp, n_vocab: int):
    """(top_k, min_p) that bound what ``smp``'s chain can keep, or None when it may weigh the whole
    vocabulary (top-p without top-k normalizes over every token; no filter keeps everything)."""
    if smp.greedy:
        return 1, 0.0            # the (penalized) argmax: a top 1
    p = smp.params
    if 0 < p.top_k < n_vocab:
        return int(p.top_k), 0.0
    if p.top_p >= 1.0 and p.min_p > 0.0:
        return 0, float(p.min_p)
    return None


class MarkovDelta:
    """``B(x) - B(a) = s W2 . d`` (``d = W1[x] - W1[a]``) on the shim's Markov head, in target ids:
    the whole row (:meth:`full`) or only where the chain can keep a token (:meth:`dist`, see the
    module's doc; the shim's ``dspark_markov_candidates`` bounds the bias with a 7-bit copy of W2).
    ``prune`` False: always the whole row."""

    def __init__(self, nat, markov, d2t: Optional[np.ndarray], n_vocab: int):
        self.nat, self.markov, self.n_vocab = nat, markov, n_vocab
        self.d2t = d2t
        self.t2d = None
        if d2t is not None:
            self.t2d = np.full(n_vocab, -1, dtype=np.int32)
            self.t2d[d2t] = np.arange(d2t.size, dtype=np.int32)
        cap = max(256, n_vocab // PRUNE_SHARE)
        self.ids = np.empty(cap, dtype=np.int32)
        self.vals = np.empty(cap, dtype=np.float32)
        self.prune = True
        self.n_pruned = self.n_full = 0
        self.last_candidates = 0     # candidates of the last pruned row

    def prepare(self) -> None:
        """Build the shim's 7-bit copy of W2 now (else on the first pruned row: ~n_vocab_draft x rank
        bytes, tens of ms at 262k x 32)."""
        self.nat.check(self.nat.markov_prune_prepare(self.markov.handle), "Markov 7-bit copy")

    def full(self, d: np.ndarray) -> np.ndarray:
        """The delta on the whole target vocabulary (float32 [n_vocab]; 0 off the draft vocabulary)."""
        self.n_full += 1
        b = np.empty(self.markov.n_vocab_draft, dtype=np.float32)
        self.nat.check(self.nat.markov_bias_dot(self.markov.handle, d.ctypes.data, None, b.size, b.ctypes.data),
                       "Markov bias")
        if self.d2t is None:
            return b
        out = np.zeros(self.n_vocab, dtype=np.float32)
        out[self.d2t] = b
        return out

    def dist(self, logits: np.ndarray, d: np.ndarray, smp, extra) -> Optional[Dist]:
        """``smp.draft_probs(logits + delta, extra)`` with the delta computed only on the candidates
        the chain can keep; None when no bound applies (then bias the whole row: :meth:`full`)."""
        n = self.n_vocab
        filt = bound_filter(smp, n) if self.prune and isinstance(smp, TokenSampler) and smp._nat else None
        if filt is None:
            return None
        x = np.asarray(logits)
        if x.dtype != np.float32 or not x.flags.c_contiguous or x.size != n:
            return None
        window = smp.window(extra)
        # ids whose value the chain changes (penalties, bans, logit bias): always candidates, no bound
        parts = [a for a in (window, smp._banned32, smp._bias_ids) if a is not None and len(a)]
        forced = np.ascontiguousarray(np.concatenate(parts), dtype=np.int32) if parts else None
        nat, ids, vals = self.nat, self.ids, self.vals
        cnt = nat.markov_candidates(self.markov.handle, x.ctypes.data, n,
                                    None if self.t2d is None else self.t2d.ctypes.data, d.ctypes.data,
                                    filt[0], filt[1], None if forced is None else forced.ctypes.data,
                                    0 if forced is None else forced.size, ids.ctypes.data, vals.ctypes.data, ids.size)
        if cnt < 0:
            raise NativeError(f"Markov candidates: {nat.error_message()}")
        if cnt == 0:
            return None
        c = ids[:cnt].copy()
        # the candidates' exact values and a -inf sentinel: the compact row stays longer than top_k,
        # so the chain takes the same top-k path as on the whole row
        y = np.empty(cnt + 1, dtype=np.float32)
        y[:cnt] = vals[:cnt]
        y[cnt] = -np.inf
        if smp._bias_ids is not None:
            y[np.searchsorted(c, smp._bias_ids)] += smp._bias_vals

        def remap(a):
            return None if a is None or not len(a) else np.searchsorted(c, a).astype(np.int32)

        q = chain_dist_native(nat, y, smp.params, remap(window), remap(smp._banned32), smp._cparams)
        self.n_pruned += 1
        self.last_candidates = cnt
        return Dist(c[q.ids], np.array(q.probs, copy=True), n)


def markov_delta(markov, d2t: Optional[np.ndarray], n_vocab: int) -> Optional[MarkovDelta]:
    """A :class:`MarkovDelta` on ``markov`` when it is the shim's head and the shim has the entry
    points (else None: the two bias rows of ``bias_w1``)."""
    nat = native_chain()
    if not nat or getattr(nat, "markov_candidates", None) is None or getattr(markov, "handle", None) is None:
        return None
    return MarkovDelta(nat, markov, d2t, n_vocab)


class BlockSampler:
    """Draws the drafts of one decoded block, left to right, with the sampled-token Markov chain.

    ``markov`` is the shim's :class:`~.handles.MarkovHead` (None for a DFlash draft: its block
    rows are independent, q_k = chain(row_k)); ``conf`` the confidence head (or None); ``d2t``
    the reduced-vocabulary table (or None)."""

    def __init__(self, draft, markov=None, conf: Optional[ConfHead] = None, d2t: Optional[np.ndarray] = None,
                 conditioning: str = "sampled"):
        if conditioning not in CONDITIONING:
            raise ValueError(f"conditioning must be one of {CONDITIONING}, got {conditioning!r}")
        self.draft = draft
        self.markov = markov
        self.conf = conf
        self.d2t = d2t
        self.conditioning = conditioning
        self.n_vocab = draft.n_vocab
        cap = draft.meta.block_size + 1
        self._argmax = np.zeros(cap, dtype=np.int32)
        self._margin = np.zeros(cap, dtype=np.float32)
        self._conf = np.zeros(cap, dtype=np.float32)
        self.n_bias_calls = 0
        self._delta = False          # the MarkovDelta (None: not on this head), built on first use

    def sample(self, row0: int, n: int, smp, with_conf: bool = True):
        """Drafts from rows row0..row0+n-1 of the last block decode: (tokens, q rows, confidence)."""
        d = self.draft
        d.argmax(row0, n, self._argmax, self._margin)
        conf = None
        if with_conf and self.conf is not None:
            d.confidence(row0, n, self._conf)
            conf = self._conf[:n].copy()
        a = self._argmax
        tokens: List[int] = []
        q_rows: List[np.ndarray] = []
        for k in range(n):
            logits = d.logits_view(row0 + k)
            q = None
            if self.markov is not None and k > 0 and self.conditioning == "sampled":
                prev_graph, prev = int(a[k - 1]), tokens[k - 1]
                if prev != prev_graph:
                    self.n_bias_calls += 1
                    q, logits, w1x = self._recondition(logits, prev_graph, prev, smp, tokens)
                    if conf is not None:
                        conf[k] = self.conf(d.hidden(row0 + k), w1x)
            if q is None:
                q = smp.draft_probs(logits, tokens)
            tokens.append(smp.sample(q))
            q_rows.append(q)
        return np.asarray(tokens, dtype=np.int32), q_rows, conf

    @property
    def delta(self) -> Optional[MarkovDelta]:
        """The :class:`MarkovDelta` on this sampler's head (None: the head is not the shim's)."""
        if self._delta is False:
            self._delta = None if self.markov is None else markov_delta(self.markov, self.d2t, self.n_vocab)
        return self._delta

    def _recondition(self, logits, prev_graph: int, prev: int, smp, tokens):
        """Row re-conditioned from the graph's token to the drawn one: (q or None, logits, W1[prev]);
        q is the chain's distribution when computed on the candidates alone, else None and the
        logits are the whole biased row."""
        md = self.delta
        if md is None:
            bias, w1 = self.markov.bias_w1([prev_graph, prev])
            return None, logits + bias_delta(bias[0], bias[1], self.d2t, self.n_vocab), w1[1]
        w1 = self.markov.w1_rows([prev_graph, prev])
        dv = np.ascontiguousarray(w1[1] - w1[0], dtype=np.float32)
        q = md.dist(logits, dv, smp, tokens)
        if q is None:
            logits = logits + md.full(dv)
        return q, logits, w1[1]
