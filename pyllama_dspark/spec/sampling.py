"""Sampling parameters and llama.cpp's sampler chain as probability vectors (numpy, no llama.cpp).

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

``temperature <= 0`` means greedy.  Without penalties the engine takes its exact greedy path and
never calls into this module.  With penalties (llama.cpp applies them before the greedy pick) a
:class:`TokenSampler` stands in: its rows are one-hot at the argmax of the penalized row, so the
speculative accept rule reduces to "draft == penalized argmax", the history including the drafted
prefix.

The chain runs in the native shim (``dspark_chain_dist``: one pass or a few over the row, no sort
of the vocabulary; see native/dspark_sampler.cpp) and returns the distribution sparse, as a
:class:`Dist`; :func:`chain_dist_numpy` is the same chain in numpy (the fallback when the loaded
shim predates it, and the "before" of ``bench/sampler_rows.py``).
"""

from __future__ import annotations

import math
import sys
import threading
from dataclasses import dataclass, replace
from typing import Iterable, Optional, Sequence

import numpy as np

__all__ = ["Dist", "SamplingParams", "TokenSampler", "chain_dist", "chain_dist_numpy", "chain_probs", "greedy_dist",
           "sample_from", "resolve_seed"]

# llama.cpp's LLAMA_DEFAULT_SEED: "pick a random seed"
LLAMA_DEFAULT_SEED = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp sampling parameters; the defaults are llama.cpp's (``common_params_sampling``).

    ``seed`` None, -1 or 0xFFFFFFFF draws a random seed per generation; any other value makes the
    generation deterministic.  ``penalty_last_n`` -1 means the whole sequence, 0 disables the
    penalties.  ``penalize_prompt``: the penalties count the prompt's tokens too, as llama-server
    feeds them to its sampler (``run``, ``serve``); llama-cpp-python's ``Llama`` counts only the
    generated tokens (the ``DSpark`` class sets it False).
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: Optional[int] = None
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    penalize_prompt: bool = True

    def __post_init__(self):
        self.validate()

    @classmethod
    def greedy(cls) -> "SamplingParams":
        return cls(temperature=0.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def has_penalties(self) -> bool:
        return self.penalty_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0)

    def with_seed(self, seed: Optional[int]) -> "SamplingParams":
        return replace(self, seed=seed)

    def validate(self) -> None:
        def num(name, integral=False):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise TypeError(f"sampling parameter {name} must be a number, got {v!r}")
            if integral and float(v) != int(v):
                raise ValueError(f"sampling parameter {name} must be an integer, got {v!r}")
            if not math.isfinite(float(v)):
                raise ValueError(f"sampling parameter {name} must be finite, got {v!r}")
            return v

        for n in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            num(n)
        num("top_k", True)
        num("penalty_last_n", True)
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repeat_penalty <= 0.0:
            raise ValueError(f"repeat_penalty must be > 0 (1.0 = off), got {self.repeat_penalty}")
        if not isinstance(self.penalize_prompt, (bool, np.bool_)):
            raise TypeError(f"penalize_prompt must be a bool, got {self.penalize_prompt!r}")
        if self.penalty_last_n < -1:
            raise ValueError(f"penalty_last_n must be >= -1 (-1 = whole sequence, 0 = off), got {self.penalty_last_n}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
                raise TypeError(f"seed must be an integer or None, got {self.seed!r}")
            if self.seed < -1:
                raise ValueError(f"seed must be >= 0 (or -1 / None for a random seed), got {self.seed}")

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def resolve_seed(seed: Optional[int]) -> int:
    """The seed a generation uses: ``seed`` itself, or a fresh random one for None / -1 / 0xFFFFFFFF."""
    if seed is None or seed == -1 or seed == LLAMA_DEFAULT_SEED:
        return int(np.random.SeedSequence().entropy % (1 << 63))
    return int(seed)


# ---- the chain ---------------------------------------------------------------------------------

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


_nat = None


def _native():
    """The shim's ctypes module, or False when it cannot be loaded (this module stays usable)."""
    global _nat
    if _nat is None:
        try:
            from pyllama_dspark.llama import _native as n

            _nat = n
        except Exception:  # the pure-numpy fallback keeps this module usable without the shim
            _nat = False
    return _nat


def _native_chain():
    """The shim's ctypes module when it has the C sampler chain, else False."""
    n = _native()
    return n if n and n.chain_dist is not None and n.chain_dense is not None else False


def _top_k_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries of x (any order): the shim's top-k scan, else numpy."""
    nat = _native()
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
        u * total (the shim's blockwise sums above 512 ids, numpy's cumsum below; zero entries are
        never drawn)."""
        n = self.ids.size
        if n == 1:
            return int(self.ids[0])
        nat = _native_chain()
        pr = self.probs
        if nat and n > 512 and pr.flags.c_contiguous and pr.dtype in (np.float64, np.float32):
            if pr.dtype == np.float32:
                j = nat.sample_cdf_f32(nat.ptr_f32(pr), n, float(u))
            else:
                j = nat.sample_cdf(nat.ptr_f64(pr), n, float(u))
            if j < 0:
                raise ValueError(f"cannot sample: {nat.error_message()}")
            return int(self.ids[j])
        c = np.cumsum(pr, dtype=np.float64)
        j = int(np.searchsorted(c, u * c[-1], side="right"))
        if j >= n:   # rounding: the last id with a positive probability
            j = int(np.flatnonzero(pr)[-1])
        return int(self.ids[j])


def _row(logits) -> np.ndarray:
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
        pair = (np.empty(n, dtype=np.int32), np.empty(n, dtype=np.float64))
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


def _chain_native(nat, x: np.ndarray, params: SamplingParams, window, banned, cparams=None) -> Dist:
    n = x.size
    w = _ids_i32(window, n, "penalty window") if params.has_penalties else None
    b = _ids_i32(banned, n, "banned")
    if cparams is None:
        cparams = _c_params(nat, params)
    wp, wn = (nat.ptr_i32(w), w.size) if w is not None else (None, 0)
    bp, bn = (nat.ptr_i32(b), b.size) if b is not None else (None, 0)
    if n > 4096 and _keeps_everything(params, n):
        probs = _scratch.take_dense(n)
        r = nat.chain_dense(nat.ptr_f32(x), n, cparams, wp, wn, bp, bn, nat.ptr_f32(probs))
        if r <= 0:
            raise ValueError(f"sampler chain: {nat.error_message()}")
        return Dist(_all_ids(n), probs, n)
    ids, probs = _scratch.take(n)
    r = nat.chain_dist(nat.ptr_f32(x), n, cparams, wp, wn, bp, bn, nat.ptr_i32(ids), nat.ptr_f64(probs), ids.size)
    if r <= 0:
        raise ValueError(f"sampler chain: {nat.error_message()}")
    if r > n // 16:
        return Dist(ids[:r], probs[:r], n)   # views of the pooled pair (see _Scratch)
    return Dist(ids[:r].copy(), probs[:r].copy(), n)


def _c_params(nat, params: SamplingParams):
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
    x = _row(logits)
    nat = _native_chain()
    if nat:
        return _chain_native(nat, x, params, window, banned)
    return chain_dist_numpy(x, params, window, banned)


def greedy_dist(logits: np.ndarray, params: SamplingParams, window: Optional[np.ndarray] = None,
                banned: Optional[np.ndarray] = None) -> Dist:
    """One-hot at the first argmax of the banned / penalized row: llama.cpp's pick at temperature
    0 (its penalties come before the greedy choice; top-k / top-p / min-p always keep the max)."""
    x = _row(logits)
    nat = _native_chain()
    if nat:
        return _chain_native(nat, x, replace(params, temperature=0.0), window, banned)
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
    x = _row(logits)
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


class TokenSampler:
    """Sampler state for one generation: parameters, a seeded RNG and the penalty history
    (``history``, the prompt, is kept only when ``params.penalize_prompt``).

    At temperature <= 0 (only needed with penalties: llama.cpp's greedy pick over the penalized
    row) :meth:`probs` is one-hot at that pick and the seed is None."""

    def __init__(self, params: SamplingParams, history: Iterable[int] = (), banned: Optional[Sequence[int]] = None):
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(params).__name__}")
        self.params = params
        self.greedy = params.is_greedy
        self.seed = None if self.greedy else resolve_seed(params.seed)
        self.rng = np.random.default_rng(self.seed)
        self.history: list = list(history) if params.has_penalties and params.penalize_prompt else []
        self.banned = None if banned is None or not len(banned) else np.unique(np.asarray(banned, dtype=np.int64))
        self._banned32 = None if self.banned is None else self.banned.astype(np.int32)
        nat = _native_chain()
        self._nat = nat
        self._cparams = _c_params(nat, replace(params, temperature=0.0) if self.greedy else params) if nat else None

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
        """Chain distribution of a logits row, the sequence being history + ``extra`` (one-hot at
        the penalized argmax at temperature <= 0)."""
        if self._nat:
            return _chain_native(self._nat, _row(logits), self.params, self.window(extra), self._banned32,
                                 self._cparams)
        if self.greedy:
            return greedy_dist(logits, self.params, self.window(extra), self.banned)
        return chain_dist(logits, self.params, self.window(extra), self.banned)

    def sample(self, probs) -> int:
        return sample_from(probs, self.rng.random())

    def accept(self, tokens: Iterable[int]) -> None:
        """Tokens committed to the sequence (only tracked when penalties are on)."""
        if self.params.has_penalties:
            self.history.extend(int(t) for t in tokens)
