"""Accept rules: pure functions of arrays, no llama.cpp (unit-testable on synthetic inputs)."""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from pyllama_dspark.speculative.dist import Dist, sample_from


def greedy_accept(drafted: np.ndarray, target_argmax: np.ndarray, eog: Optional[np.ndarray] = None) -> int:
    """Number of leading draft tokens equal to the target's greedy choice.

    ``target_argmax[i]`` is the target's argmax after the verify row i (row 0 = the anchor), so the
    draft token ``drafted[i]`` is checked against ``target_argmax[i]``.  ``target_argmax`` has at
    least ``len(drafted) + 1`` entries; the emitted tokens are ``target_argmax[:n_acc + 1]`` (the
    accepted drafts followed by the target's own token at the first mismatch, or the bonus token).

    ``eog`` (bool per vocabulary id) applies llama.cpp's rule: an accepted end-of-generation draft
    that is not the last draft ends acceptance there (it becomes the emitted target token and is
    not counted as accepted); a trailing one is accepted.
    """
    n = len(drafted)
    if len(target_argmax) < n + 1:
        raise ValueError(f"need {n + 1} target rows for {n} drafts, got {len(target_argmax)}")
    if n == 0:
        return 0
    drafted = np.asarray(drafted)
    miss = np.flatnonzero(drafted != np.asarray(target_argmax[:n]))
    n_acc = int(miss[0]) if miss.size else n
    if eog is not None and n_acc > 0:
        ends = np.flatnonzero(eog[drafted[:min(n_acc, n - 1)]])
        if ends.size:
            n_acc = int(ends[0])
    return n_acc


def greedy_emitted(drafted: np.ndarray, target_argmax: np.ndarray, eog: Optional[np.ndarray] = None) -> np.ndarray:
    """The tokens a greedy verification emits: accepted drafts plus the target's next token."""
    n_acc = greedy_accept(drafted, target_argmax, eog)
    return np.asarray(target_argmax[: n_acc + 1])


def residual(p, q):
    """norm(max(p - q, 0)) unnormalized, the law a rejected position is resampled from (p itself
    when p == q up to rounding: a rejection then had probability ~0).

    With a sparse p (a :class:`~.dist.Dist`) it stays sparse: the residual lives on p's support
    only, so no vocabulary-sized row is built.  A dense p gives a dense vector.  Both draw the same
    token for the same uniform: the support in ascending id order, zeros skipped."""
    if isinstance(p, Dist):
        r = p.probs.astype(np.float64)   # a copy
        if isinstance(q, Dist):
            # q's ids inside p's support (the lookup runs over the smaller side when q is small);
            # two whole-vocabulary rows (every id, ascending) line up as they are
            if q.ids.size == p.ids.size == p.n_vocab:
                r -= q.probs
            elif q.ids.size < p.ids.size:
                j = np.searchsorted(p.ids, q.ids)
                jc = np.minimum(j, p.ids.size - 1)
                hit = p.ids[jc] == q.ids
                r[jc[hit]] -= q.probs[hit]
            else:
                r -= q.at(p.ids)
        else:
            r -= np.asarray(q, dtype=np.float64)[p.ids]
        np.maximum(r, 0.0, out=r)
        if not r.sum() > 0.0:
            return p
        nz = r > 0.0
        return Dist(p.ids[nz], r[nz], p.n_vocab)
    r = np.maximum(np.asarray(p, dtype=np.float64) - np.asarray(q, dtype=np.float64), 0.0)
    return r if r.sum() > 0.0 else np.asarray(p, dtype=np.float64)


def speculative_accept(drafted: np.ndarray, draft_probs, target_probs, uniforms,
                       eog: Optional[np.ndarray] = None, cut_q=None) -> Tuple[int, List[int]]:
    """Speculative sampling (Leviathan et al. / Chen et al.): lossless at any temperature.

    ``drafted[i]`` was drawn from ``draft_probs[i]`` (a probability vector over the vocabulary, or
    a sparse :class:`~.dist.Dist`: with sparse target rows nothing vocabulary-sized is built);
    ``target_probs[i]`` is the target's distribution at the same position (i = 0 follows the
    anchor), with ``len(drafted) + 1`` rows (the last is the bonus row).  Both may be lazy
    sequences: row i is only read once the drafts before it are accepted.  ``uniforms`` yields
    independent U[0, 1) numbers (a callable taking no argument, e.g. ``rng.random``).

    Left to right, draft x_i is accepted with probability min(1, p(x_i) / q(x_i)); at the first
    rejection the emitted token is drawn from norm(max(p - q, 0)); after a fully accepted block the
    bonus is drawn from the last target row.  An accepted end-of-generation draft (``eog``) ends
    the block there (nothing after it is emitted).

    ``cut_q``: the block was cut before a draft the target rejects with certainty (its target
    probability is 0: a grammar forbids it), drawn from ``cut_q``.  That draft is not verified;
    after the accepted block the emitted token is drawn from norm(max(p - cut_q, 0)), which is
    what its certain rejection would have drawn, so the output law is unchanged while no target
    row is spent on the doomed draft.

    Returns ``(n_acc, emitted)``: the number of accepted drafts and the emitted tokens (the
    accepted drafts, then the resampled / bonus token unless an EOG draft ended the block).
    """
    n = len(drafted)
    emitted: List[int] = []
    for i in range(n):
        x = int(drafted[i])
        q = draft_probs[i]
        p = target_probs[i]
        qx = float(q[x])
        if not qx > 0.0:
            raise ValueError(f"draft token {x} at position {i} has draft probability {qx}: it was not drawn from q")
        px = float(p[x])
        u = uniforms()
        if px >= qx or u * qx < px:
            emitted.append(x)
            if eog is not None and eog[x]:
                return i + 1, emitted
            continue
        emitted.append(sample_from(residual(p, q), uniforms()))
        return i, emitted
    last = target_probs[n]
    emitted.append(sample_from(last if cut_q is None else residual(last, cut_q), uniforms()))
    return n, emitted

