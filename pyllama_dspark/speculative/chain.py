"""llama.cpp's sampler chain as probability vectors (the shim's C chain, or numpy; no llama.cpp).

One function, :func:`chain_probs`, turns a logits row into the distribution llama.cpp's default
chain samples from, so the target's p_t and the draft's p_d go through exactly the same
truncation.  The chain follows ``common/sampling.cpp`` (order penalties -> top_k -> top_p ->
min_p -> temperature -> dist; DRY, typical-p, top-n-sigma, XTC and mirostat are not supported):

* penalties: over the last ``penalty_last_n`` tokens of the sequence (prompt + generated, as
  llama-server feeds its sampler), a token seen ``c`` times gets its logit divided by
  ``repeat_penalty`` (multiplied when the logit is <= 0), minus ``c * frequency_penalty +
  presence_penalty``;
* ``top_k`` (<= 0: off): the k largest logits;
* ``top_p`` (>= 1: off): the smallest prefix, by decreasing logit, whose softmax mass (of the
  untempered candidates) reaches p;
* ``min_p`` (<= 0: off): logits >= max + log(min_p);
* temperature: logits / T, softmax.

The penalties are a deterministic function of the sequence prefix, so speculative sampling stays
lossless with them: the draft and the target see the same history (committed tokens plus the
drafted prefix) at every block position.

The chain runs in the native shim (``dspark_chain_dist``: one pass or a few over the row, no sort
of the vocabulary; see native/dspark_chain.cpp) and returns the distribution sparse, as a
:class:`Dist`; :func:`chain_dist_numpy` is the same chain in numpy (the fallback when the loaded
shim predates it, and the "before" of ``bench/sampler_rows.py``).
"""

from __future__ import annotations

import math
import sys
import threading
from dataclasses import replace
from typing import Optional

import numpy as np

from pyllama_dspark.speculative.dist import Dist
from pyllama_dspark.speculative.sampling_params import SamplingParams
from pyllama_dspark.speculative.shim import native, native_chain


def apply_penalties(logits: np.ndarray, window: np.ndarray, params: SamplingParams) -> np.ndarray:
    """A copy of ``logits`` with llama.cpp's repeat/frequency/presence penalties over ``window``."""
    out = np.array(logits, dtype=np.float32, copy=True)
    if window.size == 0:
        return out
    ids, counts = np.unique(window, return_counts=True)
    v = out[ids]
    if params.repeat_penalty != 1.0:
        rp = np.float32(params.repeat_penalty)
        v = np.where(v <= 0, v * rp, v / rp).astype(np.float32)
    v = v - (counts.astype(np.float32) * np.float32(params.frequency_penalty) + np.float32(params.presence_penalty))
    out[ids] = v
    return out


def _top_k_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries of x (any order): the shim's top-k scan, else numpy."""
    nat = native()
    if nat and x.dtype == np.float32 and x.flags.c_contiguous:
        out = np.empty(k, dtype=np.int32)
        nat.check(nat.top_k_f32(nat.ptr_f32(x), x.size, k, nat.ptr_i32(out)), "top-k")
        return out.astype(np.int64)
    return np.argpartition(x, x.size - k)[x.size - k:]


def _top_p_keep(l: np.ndarray, p: float) -> np.ndarray:
    """Indices (into l) of the smallest decreasing-logit prefix whose softmax mass reaches p."""
    n = l.size
    mx = float(l.max())
    e = np.exp(l.astype(np.float64) - mx)
    total = e.sum()
    # adaptive like llama.cpp: try the 256 largest first, sort everything only if they fall short
    k = min(256, n)
    part = _top_k_indices(l, k) if k < n else np.arange(n)
    order = part[np.argsort(-l[part], kind="stable")]
    cum = np.cumsum(e[order]) / total
    hit = np.flatnonzero(cum >= p)
    if hit.size == 0 and k < n:
        order = np.argsort(-l, kind="stable")
        cum = np.cumsum(e[order]) / total
        hit = np.flatnonzero(cum >= p)
    m = int(hit[0]) + 1 if hit.size else n
    return order[:m]


def logits_row(logits) -> np.ndarray:
    """``logits`` as a non-empty contiguous float32 row (converted only when it is not one)."""
    x = np.asarray(logits)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"logits must be a non-empty 1-D row, got shape {x.shape}")
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    return x


def _ids_i32(a, n_vocab: int, what: str) -> Optional[np.ndarray]:
    if a is None or not len(a):
        return None
    out = np.ascontiguousarray(a, dtype=np.int32)
    if out.min() < 0 or out.max() >= n_vocab:
        raise ValueError(f"{what} token ids must be in 0..{n_vocab - 1}")
    return out


_ARANGE: dict = {}


def _all_ids(n: int) -> np.ndarray:
    """0..n-1 as int32, shared and read-only (the ids of a whole-vocabulary Dist)."""
    a = _ARANGE.get(n)
    if a is None:
        a = np.arange(n, dtype=np.int32)
        a.flags.writeable = False
        _ARANGE[n] = a
    return a


class _Scratch(threading.local):
    """Per-thread output buffers of the C chain.  A large kept set (filters off: the whole
    vocabulary) is returned as views of a pooled pair instead of a copy; a pair is reused once no
    Dist refers to it any more (its reference count is back to the pool's own), so steady decoding
    allocates nothing, and a fresh vocabulary-sized allocation (page faults) is not paid per row."""

    def __init__(self):
        self.pool: list = []

    def take(self, n: int):
        for pair in self.pool:
            # an array no view refers to has two references: the pair's tuple and getrefcount's argument
            if pair[0].size >= n and sys.getrefcount(pair[0]) <= 2 and sys.getrefcount(pair[1]) <= 2:
                return pair
        ids, probs = np.empty(n, dtype=np.int32), np.empty(n, dtype=np.float64)
        pair = (ids, probs, ids.ctypes.data, probs.ctypes.data)   # the addresses kept: no ctypes call per row
        if len(self.pool) < 64:
            self.pool.append(pair)
        return pair

    def take_dense(self, n: int) -> np.ndarray:
        dense = self.__dict__.setdefault("dense", [])
        for a in dense:
            # free: referenced by the pool's list, the loop variable and getrefcount's argument only
            if a.size == n and sys.getrefcount(a) <= 3:
                return a
        a = np.empty(n, dtype=np.float32)
        if len(dense) < 64:
            dense.append(a)
        return a


_scratch = _Scratch()


def _keeps_everything(params: SamplingParams, n: int) -> bool:
    """No filter: every finite logit is kept (the dense result pays)."""
    return (not params.is_greedy and (params.top_k <= 0 or params.top_k >= n) and params.top_p >= 1.0
            and params.min_p <= 0.0)


def chain_dist_native(nat, x: np.ndarray, params: SamplingParams, window, banned, cparams=None) -> Dist:
    """The chain in the shim (``nat``: :func:`~.shim.native_chain`) on the row ``x``
    (:func:`logits_row`); ``cparams``: :func:`chain_params_native` of ``params``, when the caller
    keeps them."""
    n = x.size
    w = _ids_i32(window, n, "penalty window") if params.has_penalties else None
    b = _ids_i32(banned, n, "banned")
    if cparams is None:
        cparams = chain_params_native(nat, params)
    wp, wn = (w.ctypes.data, w.size) if w is not None else (None, 0)
    bp, bn = (b.ctypes.data, b.size) if b is not None else (None, 0)
    if n > 4096 and _keeps_everything(params, n):
        probs = _scratch.take_dense(n)
        r = nat.chain_dense(x.ctypes.data, n, cparams, wp, wn, bp, bn, probs.ctypes.data)
        if r <= 0:
            raise ValueError(f"sampler chain: {nat.error_message()}")
        return Dist(_all_ids(n), probs, n)
    ids, probs, ids_p, probs_p = _scratch.take(n)
    r = nat.chain_dist(x.ctypes.data, n, cparams, wp, wn, bp, bn, ids_p, probs_p, ids.size)
    if r <= 0:
        raise ValueError(f"sampler chain: {nat.error_message()}")
    if r > n // 16:
        return Dist(ids[:r], probs[:r], n)   # views of the pooled pair (see _Scratch)
    return Dist(ids[:r].copy(), probs[:r].copy(), n)


def chain_params_native(nat, params: SamplingParams):
    """``params`` as the shim's ``ChainParams``."""
    return nat.ChainParams(float(params.temperature), int(params.top_k) if params.top_k > 0 else 0,
                           float(params.top_p), float(params.min_p), float(params.repeat_penalty),
                           float(params.frequency_penalty), float(params.presence_penalty))


def chain_dist(logits: np.ndarray, params: SamplingParams, window: Optional[np.ndarray] = None,
               banned: Optional[np.ndarray] = None) -> Dist:
    """The distribution llama.cpp's chain samples from for this logits row, as a sparse Dist.

    ``window``: the token ids the penalties look at (already cut to the last ``penalty_last_n``).
    ``banned``: token ids that can never be drawn (llama.cpp's -inf logit bias, applied first;
    ``--ignore-eos`` bans the end-of-generation tokens this way).
    """
    if params.is_greedy:
        raise ValueError("the sampler chain needs temperature > 0 (temperature <= 0 is the greedy path)")
    x = logits_row(logits)
    nat = native_chain()
    if nat:
        return chain_dist_native(nat, x, params, window, banned)
    return chain_dist_numpy(x, params, window, banned)


def greedy_dist(logits: np.ndarray, params: SamplingParams, window: Optional[np.ndarray] = None,
                banned: Optional[np.ndarray] = None) -> Dist:
    """One-hot at the first argmax of the banned / penalized row: llama.cpp's pick at temperature
    0 (its penalties come before the greedy choice; top-k / top-p / min-p always keep the max)."""
    x = logits_row(logits)
    nat = native_chain()
    if nat:
        return chain_dist_native(nat, x, replace(params, temperature=0.0), window, banned)
    if banned is not None and len(banned):
        x = np.array(x, copy=True)
        x[np.asarray(banned, dtype=np.int64)] = -np.inf
    if params.has_penalties and window is not None and len(window):
        x = apply_penalties(x, np.asarray(window, dtype=np.int64), params)
    if not np.isfinite(x.max()):
        raise ValueError("no finite logit survives the sampler chain")
    return Dist.one_hot(int(np.argmax(x)), x.size)


def chain_dist_numpy(logits: np.ndarray, params: SamplingParams, window: Optional[np.ndarray] = None,
                     banned: Optional[np.ndarray] = None) -> Dist:
    """:func:`chain_dist` in numpy (the reference implementation the C chain replaced)."""
    if params.is_greedy:
        raise ValueError("the sampler chain needs temperature > 0 (temperature <= 0 is the greedy path)")
    x = logits_row(logits)
    if banned is not None and len(banned):
        x = np.array(x, dtype=np.float32, copy=True)
        x[banned] = -np.inf
    if params.has_penalties and window is not None and len(window):
        x = apply_penalties(x, np.asarray(window, dtype=np.int64), params)
    n = x.size
    idx = None
    k = int(params.top_k)
    if 0 < k < n:
        idx = _top_k_indices(x, k)
        l = x[idx]
    else:
        l = x
    if params.top_p < 1.0:
        keep = _top_p_keep(l, params.top_p)
        idx = keep if idx is None else idx[keep]
        l = l[keep]
    if params.min_p > 0.0:
        thr = np.float32(np.float32(l.max()) + np.float32(math.log(params.min_p)))
        keep = np.flatnonzero(l >= thr)
        idx = keep if idx is None else idx[keep]
        l = l[keep]
    z = l.astype(np.float64) / float(params.temperature)
    mx = z.max()
    if not np.isfinite(mx):
        raise ValueError("no finite logit survives the sampler chain")
    e = np.exp(z - mx)
    e /= e.sum()
    if idx is None:
        idx = np.arange(n)
    else:
        order = np.argsort(idx)
        idx, e = idx[order], e[order]
    nz = e > 0.0
    if not nz.all():
        idx, e = idx[nz], e[nz]
    return Dist(idx.astype(np.int64, copy=False), e, n)


def chain_probs(logits: np.ndarray, params: SamplingParams, window: Optional[np.ndarray] = None) -> np.ndarray:
    """:func:`chain_dist` as a dense float64 vector (zeros outside the kept set)."""
    return chain_dist(logits, params, window).dense()
