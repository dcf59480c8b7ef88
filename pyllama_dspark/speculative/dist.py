"""Sparse distributions over the vocabulary (:class:`Dist`) and inverse-CDF draws from them."""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate

import numpy as np

from pyllama_dspark.speculative.shim import native_chain


class Dist:
    """A distribution over the vocabulary kept sparse: ``ids`` (ascending) and their ``probs``
    (float64; float32 for a whole-vocabulary row from the shim, where ``ids`` is every id and some
    ``probs`` may be 0).

    Indexing by a token id gives its probability; ``np.asarray(dist)`` the dense float64 vector,
    so a Dist can stand wherever a probability vector is expected."""

    __slots__ = ("ids", "probs", "n_vocab")

    def __init__(self, ids: np.ndarray, probs: np.ndarray, n_vocab: int):
        self.ids = ids
        self.probs = probs
        self.n_vocab = int(n_vocab)

    def __len__(self) -> int:
        return self.n_vocab

    def __getitem__(self, token) -> float:
        t = int(token)
        j = int(np.searchsorted(self.ids, t))
        return float(self.probs[j]) if j < self.ids.size and self.ids[j] == t else 0.0

    @classmethod
    def one_hot(cls, token: int, n_vocab: int) -> "Dist":
        return cls(np.asarray([int(token)], dtype=np.int64), np.ones(1), n_vocab)

    def at(self, ids: np.ndarray) -> np.ndarray:
        """Probabilities of the token ids ``ids`` (an array; 0.0 outside the support)."""
        ids = np.asarray(ids)
        j = np.searchsorted(self.ids, ids)
        jc = np.minimum(j, self.ids.size - 1)
        hit = (j < self.ids.size) & (self.ids[jc] == ids)
        return np.where(hit, self.probs[jc], 0.0)

    def dense(self) -> np.ndarray:
        out = np.zeros(self.n_vocab, dtype=np.float64)
        out[self.ids] = self.probs
        return out

    def __array__(self, dtype=None, copy=None):
        d = self.dense()
        return d if dtype is None else d.astype(dtype)

    def sample(self, u: float) -> int:
        """Inverse-CDF draw in ascending id order: the first id whose running probability exceeds
        u * total (the shim's blockwise sums above 512 ids, numpy's cumsum below, Python's up to 64
        ids; zero entries are never drawn)."""
        n = self.ids.size
        if n == 1:
            return int(self.ids[0])
        nat = native_chain()
        pr = self.probs
        if nat and n > 512 and pr.flags.c_contiguous and pr.dtype in (np.float64, np.float32):
            if pr.dtype == np.float32:
                j = nat.sample_cdf_f32(nat.ptr_f32(pr), n, float(u))
            else:
                j = nat.sample_cdf(nat.ptr_f64(pr), n, float(u))
            if j < 0:
                raise ValueError(f"cannot sample: {nat.error_message()}")
            return int(self.ids[j])
        if n <= 64:   # the same running sums in Python floats (left to right, double): no numpy calls
            c = list(accumulate(pr.tolist()))
            j = bisect_right(c, u * c[-1])
        else:
            c = np.cumsum(pr, dtype=np.float64)
            j = int(np.searchsorted(c, u * c[-1], side="right"))
        if j >= n:   # rounding: the last id with a positive probability
            j = int(np.flatnonzero(pr)[-1])
        return int(self.ids[j])


def sample_from(probs, u: float) -> int:
    """Inverse-CDF draw (ids in ascending order): the first id whose cumulative probability
    exceeds u * total.  ``probs``: a Dist or a dense probability vector."""
    if isinstance(probs, Dist):
        return probs.sample(u)
    probs = np.asarray(probs)
    nz = np.flatnonzero(probs)
    if nz.size == 0:
        raise ValueError("cannot sample from an all-zero distribution")
    c = np.cumsum(probs[nz])
    j = int(np.searchsorted(c, u * c[-1], side="right"))
    return int(nz[min(j, nz.size - 1)])
