"""Confidence scheduling, as pure functions of arrays (DSpark paper §3.2, Algorithm 1).

* ``static_cut``      verify up to the first position whose confidence is below ``conf_min``
                      (llama.cpp's ``--spec-draft-p-min`` for DSpark);
* ``survival_cut``    verify while the prefix survival a_k = prod_{i<=k} c_i stays >= p_min;
* ``schedule``        Algorithm 1 over R requests on a profiled cost curve, with the early stop
                      that keeps it non-anticipating (hence lossless) -- its stop test reads the
                      cost curve ahead, so a jagged curve does not stop it at the first slow batch
                      size; the draft pass cost is part of the objective and l_r = 0 means plain
                      decoding for request r;
* ``retrospective_schedule`` the global search over the same admission path WITHOUT the early
                      stop — kept only to show (in tests) that it would leak future tokens;
* ``should_draft``    whether a draft pass can pay at all, from survival estimates known before it;
* STS calibration     ``fit_sts`` / ``apply_sts`` (one temperature per position, left to right,
                      minimizing the ECE of the cumulative product), ``ece``, ``roc_auc``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np


# ---- cost model -----------------------------------------------------------------------------------

@dataclass
class CostModel:
    """Milliseconds of one target decode of B tokens (B = 1..len(verify_ms)), plus per-cycle costs.

    ``verify_ms[B-1]`` is the measured time of a target decode with B tokens (all sequences
    together); beyond the table the curve is extrapolated linearly from its last two points.
    ``draft_ms[R-1]`` is one draft pass over R sequences' blocks (one entry: scaled by R).
    """
    verify_ms: Sequence[float]
    draft_ms: Sequence[float] = (0.0,)
    overhead_ms: float = 0.0

    def __post_init__(self):
        v = np.asarray(self.verify_ms, dtype=np.float64)
        if v.ndim != 1 or v.size == 0 or not np.all(v > 0):
            raise ValueError("verify_ms must be a non-empty list of positive times")
        self.verify_ms = v
        d = np.asarray(self.draft_ms, dtype=np.float64).reshape(-1)
        if d.size == 0 or np.any(d < 0):
            raise ValueError("draft_ms must be non-negative")
        self.draft_ms = d
        if v.size >= 2:  # least-squares slope over the last half of the table (one jag cannot flatten it)
            k = max(2, (v.size + 1) // 2)
            # the least-squares slope (np.polyfit's degree 1, without its ~50 us of set-up: the
            # policy rebuilds a cost model whenever a measured cycle cost moves)
            x = np.arange(k, dtype=np.float64)
            x -= x.mean()
            y = v[-k:]
            self._slope = max(0.0, float(np.dot(x, y - y.mean()) / np.dot(x, x)))
        else:
            self._slope = float(v[-1])

    def t_verify(self, b: int) -> float:
        if b < 1:
            raise ValueError("batch size must be >= 1")
        v = self.verify_ms
        if b <= v.size:
            return float(v[b - 1])
        return float(v[-1] + self._slope * (b - v.size))

    def t_verify_range(self, b0: int, b1: int) -> np.ndarray:
        """t_verify(b) for b = b0..b1 as an array."""
        if b0 < 1:
            raise ValueError("batch size must be >= 1")
        v = self.verify_ms
        b = np.arange(b0, b1 + 1)
        inside = b <= v.size
        return np.where(inside, v[np.minimum(b, v.size) - 1], v[-1] + self._slope * (b - v.size))

    def t_draft(self, n_seqs: int) -> float:
        if n_seqs <= 0:
            return 0.0
        d = self.draft_ms
        return float(d[n_seqs - 1]) if n_seqs <= d.size else float(d[-1] * n_seqs / d.size)

    def sps(self, b: int) -> float:
        """Target steps per second at verify batch b."""
        return 1e3 / self.t_verify(b)


# ---- static rules ---------------------------------------------------------------------------------

def survival(conf: Sequence[float]) -> np.ndarray:
    """a_k = prod_{i<=k} c_i."""
    c = np.asarray(conf, dtype=np.float64)
    return np.cumprod(c) if c.size else c


def static_cut(conf: Sequence[float], conf_min: float) -> int:
    """Number of leading positions with c_k >= conf_min (stop at the first one below)."""
    c = np.asarray(conf, dtype=np.float64)
    low = np.flatnonzero(c < conf_min)
    return int(low[0]) if low.size else int(c.size)


def survival_cut(conf: Sequence[float], p_survival_min: float) -> int:
    """Number of leading positions whose prefix survival a_k stays >= p_survival_min."""
    a = survival(conf)
    low = np.flatnonzero(a < p_survival_min)
    return int(low[0]) if low.size else int(a.size)


# ---- Algorithm 1 ----------------------------------------------------------------------------------

@dataclass
class Schedule:
    lengths: List[int]                 # l_r per request (0 = plain decoding)
    throughput: float                  # expected tokens per second of the chosen lengths
    batch: int                         # B = sum(1 + l_r)
    expected_tokens: float             # tau* = sum(1 + sum_{j<=l_r} a_rj)
    path: List[Tuple[int, int, float]] = field(default_factory=list)  # (r, j, theta) admitted in order


def _candidates(surv: Sequence[Sequence[float]]):
    cand = [(a, r, j + 1) for r, s in enumerate(surv)
            for j, a in enumerate(np.asarray(s, dtype=np.float64).reshape(-1).tolist()) if a > 0]
    # descending survival; ties: lower request index, then shorter prefix (keeps prefixes contiguous)
    cand.sort(key=lambda x: (-x[0], x[1], x[2]))
    return cand


def _theta(tau: float, b: int, cost: CostModel, t_fixed: float) -> float:
    return tau / ((cost.t_verify(b) + t_fixed) / 1e3)


def _can_pay(tau: float, a: float, current: float, seconds_ahead: Sequence[float]) -> bool:
    """Could admitting this candidate (survival ``a``) and up to ``len(seconds_ahead) - 1`` more
    raise Theta above ``current``?  Every later candidate has survival <= a (the order is
    descending), so ``tau + m * a`` bounds the tokens of m admissions: the test reads the cost
    curve ahead but no survival beyond this candidate's.  On a convex cost curve (increasing
    marginal cost) it is the paper's one-step test; on a jagged one (a slow batch size between
    fast ones) it can cross the slow step.  ``seconds_ahead[m - 1]`` = (t_verify(b + m) +
    t_fixed) / 1e3, b the batch before this candidate."""
    m = 1.0
    for sec in seconds_ahead:
        if (tau + m * a) / sec > current:
            return True
        m += 1.0
    return False


def schedule(surv: Sequence[Sequence[float]], cost: CostModel, *, drafted: bool = True,
             draft_ms: Optional[float] = None) -> Schedule:
    """Algorithm 1 with early stopping.

    ``surv[r]`` are request r's prefix survivals a_{r,1..gamma} (non-increasing).  The objective is
    expected tokens per second, Theta = tau* / (t_verify(B) + t_fixed) with t_fixed = the draft pass
    (when ``drafted``; ``draft_ms`` overrides the cost model's estimate, e.g. with a measured one)
    plus the per-cycle overhead.  Candidates are admitted in descending survival; admission stops
    at the first candidate that cannot pay, judged only from its own survival, the survivals
    admitted before it and the cost curve (:func:`_can_pay`), and the admitted set is what is
    verified: the decision to verify x_{r,j} never looks at later tokens, so it stays lossless.
    Plain floats and lists: the policy plans several blocks per cycle, and numpy's per-call cost
    dominated these few dozen candidates.
    """
    R = len(surv)
    if R == 0:
        raise ValueError("no requests")
    t_draft = (cost.t_draft(R) if draft_ms is None else float(draft_ms)) if drafted else 0.0
    t_fixed = t_draft + cost.overhead_ms
    lengths = [0] * R
    b, tau = R, float(R)
    theta = _theta(tau, b, cost, t_fixed)
    path = []
    cand = _candidates(surv)
    if not cand:
        return Schedule(lengths, theta, b, tau, path)
    # how many positions could still be admitted: the drafted count, not how many have a > 0 (that
    # would read later survivals); seconds[i] = the cycle with B = R + 1 + i rows
    n_positions = sum(len(s) for s in surv)
    seconds = ((cost.t_verify_range(R + 1, R + n_positions) + t_fixed) / 1e3).tolist()
    for i, (a, r, j) in enumerate(cand):
        if j != lengths[r] + 1:   # survival is non-increasing: only happens on exact ties; keep prefixes
            break
        if not _can_pay(tau, a, theta, seconds[i:]):
            break
        lengths[r] = j
        b += 1
        tau += a
        theta = tau / seconds[i]
        path.append((r, j, theta))
    return Schedule(lengths, theta, b, tau, path)


def retrospective_schedule(surv: Sequence[Sequence[float]], cost: CostModel, *, drafted: bool = True) -> Schedule:
    """The global search along the same admission path, without the early stop.

    NOT lossless: the choice of a prefix can depend on survivals of later positions, which depend
    on the tokens drafted before them (paper, Appendix A).  Never used by the engine.
    """
    R = len(surv)
    t_fixed = (cost.t_draft(R) if drafted else 0.0) + cost.overhead_ms
    lengths = [0] * R
    b, tau = R, float(R)
    best = _theta(tau, b, cost, t_fixed)
    out = Schedule([0] * R, best, b, tau)
    for a, r, j in _candidates(surv):
        if j != lengths[r] + 1:
            continue
        lengths[r] = j
        b += 1
        tau += a
        theta = _theta(tau, b, cost, t_fixed)
        if theta > out.throughput:
            out = Schedule(list(lengths), theta, b, tau)
    return out


def should_draft(expected_surv: Sequence[Sequence[float]], cost: CostModel,
                 draft_ms: Optional[float] = None) -> bool:
    """Can a draft pass pay, given survival estimates known before drafting (e.g. running means)?

    Compares the best scheduled throughput including the draft cost with plain decoding of all R
    requests.  Non-anticipating: it only uses past statistics.
    """
    R = len(expected_surv)
    plain = _theta(float(R), R, cost, cost.overhead_ms)
    return schedule(expected_surv, cost, drafted=True, draft_ms=draft_ms).throughput > plain


# ---- calibration ----------------------------------------------------------------------------------

def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return np.log(p) - np.log1p(-p)


def apply_sts(conf: np.ndarray, temps: Sequence[float]) -> np.ndarray:
    """c'_k = sigmoid(logit(c_k) / T_k) per position (columns of ``conf``)."""
    c = np.asarray(conf, dtype=np.float64)
    t = np.asarray(temps, dtype=np.float64)
    k = c.shape[-1]
    if t.size < k:
        t = np.concatenate([t, np.ones(k - t.size)])
    return 1.0 / (1.0 + np.exp(-_logit(c) / t[:k]))


def ece(prob: Sequence[float], label: Sequence[float], n_bins: int = 10) -> float:
    """Expected calibration error with equal-width bins over [0, 1]."""
    p = np.asarray(prob, dtype=np.float64)
    y = np.asarray(label, dtype=np.float64)
    if p.size == 0:
        return 0.0
    idx = np.minimum((p * n_bins).astype(int), n_bins - 1)
    total = 0.0
    for b in range(n_bins):
        m = idx == b
        if m.any():
            total += m.sum() * abs(p[m].mean() - y[m].mean())
    return float(total / p.size)


def roc_auc(score: Sequence[float], label: Sequence[int]) -> float:
    """Area under the ROC curve (rank statistic, ties counted half); nan without both classes."""
    s = np.asarray(score, dtype=np.float64)
    y = np.asarray(label).astype(bool)
    n1, n0 = int(y.sum()), int((~y).sum())
    if n1 == 0 or n0 == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(s.size)
    sorted_s = s[order]
    i = 0
    while i < s.size:  # average ranks over ties
        j = i
        while j + 1 < s.size and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return float((ranks[y].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))


DEFAULT_GRID = np.exp(np.linspace(np.log(0.25), np.log(8.0), 61))


def joint_labels(n_accepted: np.ndarray, gamma: int) -> np.ndarray:
    """label[i, k] = 1 when block i's first k+1 drafts were all accepted."""
    n = np.asarray(n_accepted).reshape(-1, 1)
    return (n > np.arange(gamma)[None, :]).astype(np.float64)


def fit_sts(conf: np.ndarray, n_accepted: np.ndarray, verified: Optional[np.ndarray] = None,
            grid: Sequence[float] = DEFAULT_GRID, n_bins: int = 10) -> np.ndarray:
    """Sequential Temperature Scaling: one temperature per position, fitted left to right.

    ``conf`` [N, gamma] raw confidences of N drafted blocks; ``n_accepted`` [N] accepted drafts of
    each block; ``verified`` [N] how many positions of each block were verified (default: all), so
    position k only uses blocks that verified it.  At position k the temperature minimizes the ECE
    of the calibrated cumulative product a_k against the joint label (first k+1 accepted), with the
    temperatures of earlier positions fixed.
    """
    c = np.asarray(conf, dtype=np.float64)
    N, gamma = c.shape
    ver = np.full(N, gamma) if verified is None else np.asarray(verified)
    y = joint_labels(n_accepted, gamma)
    temps = np.ones(gamma)
    prefix = np.ones(N)
    for k in range(gamma):
        m = ver > k
        if not m.any():
            break
        best_t, best_e = 1.0, np.inf
        for t in grid:
            a = prefix[m] * apply_sts(c[m, k:k + 1], [t])[:, 0]
            e = ece(a, y[m, k], n_bins)
            if e < best_e - 1e-12:
                best_t, best_e = float(t), e
        temps[k] = best_t
        prefix = prefix * apply_sts(c[:, k:k + 1], [best_t])[:, 0]
    return temps


def calibration_report(conf: np.ndarray, n_accepted: np.ndarray, temps: Sequence[float],
                       verified: Optional[np.ndarray] = None, n_bins: int = 10) -> List[dict]:
    """Per position: samples, empirical joint survival, ECE and ROC-AUC before / after STS."""
    c = np.asarray(conf, dtype=np.float64)
    N, gamma = c.shape
    ver = np.full(N, gamma) if verified is None else np.asarray(verified)
    y = joint_labels(n_accepted, gamma)
    raw_a = np.cumprod(c, axis=1)
    cal_a = np.cumprod(apply_sts(c, temps), axis=1)
    rows = []
    for k in range(gamma):
        m = ver > k
        # conditional label for the per-position AUC: accepted given the prefix was accepted
        cond = m & (np.asarray(n_accepted) >= k)
        rows.append(dict(
            position=k + 1, n=int(m.sum()), survival=float(y[m, k].mean()) if m.any() else float("nan"),
            ece_raw=ece(raw_a[m, k], y[m, k], n_bins), ece_sts=ece(cal_a[m, k], y[m, k], n_bins),
            auc=roc_auc(c[cond, k], (np.asarray(n_accepted)[cond] > k).astype(int)),
            temperature=float(np.asarray(temps)[k]) if k < len(temps) else 1.0))
    return rows
