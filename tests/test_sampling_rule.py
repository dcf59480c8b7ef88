"""The speculative-sampling accept/resample rule as a pure function, on synthetic distributions.

Exact expectation: whatever the draft distribution q, the tokens the rule emits are distributed
as the target's p.  Checked with a chi-square goodness-of-fit test over >= 100k draws against the
exact p (fixed seeds, so each run is deterministic; the threshold is a p-value of 1e-3).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from pyllama_dspark.speculative.dist import sample_from
from pyllama_dspark.speculative.verify import speculative_accept

P_MIN = 1e-3


def chi2_sf(x: float, k: int) -> float:
    """Survival function of the chi-square distribution with k degrees of freedom."""
    # regularized upper incomplete gamma Q(k/2, x/2) by series / continued fraction
    a, z = k / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    if z < a + 1:
        term = s = 1.0 / a
        n = a
        for _ in range(10000):
            n += 1
            term *= z / n
            s += term
            if abs(term) < abs(s) * 1e-15:
                break
        return max(0.0, 1.0 - s * math.exp(-z + a * math.log(z) - math.lgamma(a)))
    b = z + 1 - a
    c = 1e300
    d = 1 / b
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(-z + a * math.log(z) - math.lgamma(a)) * h


def chi2_pvalue(counts: np.ndarray, expected_p: np.ndarray) -> float:
    counts = np.asarray(counts, dtype=np.float64).ravel()
    exp = np.asarray(expected_p, dtype=np.float64).ravel() * counts.sum()
    assert np.all(counts[exp == 0] == 0), "a token with expected probability 0 was emitted"
    m = exp > 0
    stat = float(((counts[m] - exp[m]) ** 2 / exp[m]).sum())
    return chi2_sf(stat, int(m.sum()) - 1)


def test_chi2_helper_is_calibrated():
    assert abs(chi2_sf(3.841458820694124, 1) - 0.05) < 1e-9
    assert abs(chi2_sf(18.307038053275146, 10) - 0.05) < 1e-9
    assert abs(chi2_sf(124.34211340400407, 100) - 0.05) < 1e-9
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.3, 0.2])
    assert chi2_pvalue(np.bincount(rng.choice(3, 10000, p=p), minlength=3), p) > P_MIN
    assert chi2_pvalue(np.bincount(rng.choice(3, 10000, p=p), minlength=3), np.array([0.45, 0.35, 0.2])) < P_MIN


P1 = np.array([0.40, 0.25, 0.20, 0.10, 0.05, 0.0])
Q1 = np.array([0.05, 0.10, 0.30, 0.05, 0.30, 0.20])   # mass where p has none, too


def test_single_position_emits_p():
    rng = np.random.default_rng(1)
    n = 200_000
    counts = np.zeros(6, dtype=np.int64)
    n_acc = 0
    p_bonus = np.full(6, 1 / 6)
    for _ in range(n):
        x = sample_from(Q1, rng.random())
        acc, out = speculative_accept(np.array([x]), [Q1], [P1, p_bonus], rng.random)
        counts[out[0]] += 1
        n_acc += acc
        assert len(out) == acc + 1
    pv = chi2_pvalue(counts, P1)
    print(f"single position: {n} draws, chi-square p = {pv:.4f}")
    assert pv > P_MIN
    # acceptance rate is sum(min(p, q)) = 0.05 + 0.10 + 0.20 + 0.05 + 0.05 = 0.45
    assert abs(n_acc / n - 0.45) < 0.005


def _markov_tables(v: int, seed: int):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(v, 0.7), size=v)
    q = rng.dirichlet(np.full(v, 0.7), size=v)
    p[:, v - 1] = 0.0  # a token the target never emits ...
    p /= p.sum(1, keepdims=True)
    return p, q            # ... but the draft proposes


@pytest.mark.parametrize("block", [1, 3])
def test_two_tokens_of_a_markov_chain(block):
    """Several cycles of draft-then-verify over a synthetic order-1 chain: the first two emitted
    tokens after the anchor are jointly distributed as p(t1|a) p(t2|t1), whatever q and block."""
    v = 5
    p, q = _markov_tables(v, seed=block)
    rng = np.random.default_rng(100 + block)
    anchor = 2
    n = 100_000
    counts = np.zeros((v, v), dtype=np.int64)
    for _ in range(n):
        out = []
        a = anchor
        while len(out) < 2:
            xs, qs = [], []
            prev = a
            for _ in range(block):           # the draft conditions on its own sampled tokens
                x = sample_from(q[prev], rng.random())
                xs.append(x)
                qs.append(q[prev])
                prev = x
            ctx = [a] + xs
            ps = [p[t] for t in ctx]         # target row i follows ctx[i]
            _, emitted = speculative_accept(np.array(xs), qs, ps, rng.random)
            out += emitted
            a = emitted[-1]
        counts[out[0], out[1]] += 1
    expected = p[anchor][:, None] * p
    pv = chi2_pvalue(counts, expected)
    print(f"block {block}: {n} draws, chi-square p = {pv:.4f}")
    assert pv > P_MIN


def test_a_wrong_q_breaks_it():
    """The test can fail: verifying against a q other than the one the drafts came from."""
    rng = np.random.default_rng(7)
    n = 100_000
    counts = np.zeros(6, dtype=np.int64)
    q_claimed = np.array([0.3, 0.1, 0.1, 0.2, 0.1, 0.2])
    for _ in range(n):
        x = sample_from(Q1, rng.random())
        _, out = speculative_accept(np.array([x]), [q_claimed], [P1, P1], rng.random)
        counts[out[0]] += 1
    assert chi2_pvalue(counts, P1) < 1e-6


def test_bonus_after_full_acceptance_and_lazy_rows():
    p = np.array([0.0, 1.0, 0.0])
    read = []

    class Rows:
        def __getitem__(self, i):
            read.append(i)
            return [p, p, np.array([0.0, 0.0, 1.0])][i]

    acc, out = speculative_accept(np.array([1, 1]), [p, p], Rows(), np.random.default_rng(0).random)
    assert (acc, out) == (2, [1, 1, 2])
    assert read == [0, 1, 2]
    read.clear()
    acc, out = speculative_accept(np.array([0, 1]), [np.array([1.0, 0, 0]), p], Rows(), np.random.default_rng(0).random)
    assert (acc, out) == (0, [1])      # rejected at once: p - q leaves only token 1
    assert read == [0]                 # later rows never read


def test_eog_draft_ends_the_block():
    eog = np.array([False, False, True])
    one = lambda t: np.eye(3)[t]
    acc, out = speculative_accept(np.array([2, 1]), [one(2), one(1)], [one(2), one(1), one(0)],
                                  np.random.default_rng(0).random, eog)
    assert (acc, out) == (1, [2])
    acc, out = speculative_accept(np.array([2, 1]), [one(2), one(1)], [one(2), one(1), one(0)],
                                  np.random.default_rng(0).random, None)
    assert (acc, out) == (2, [2, 1, 0])


def test_draft_token_outside_q_is_an_error():
    with pytest.raises(ValueError, match="not drawn from q"):
        speculative_accept(np.array([1]), [np.array([1.0, 0.0])], [np.array([0.5, 0.5])] * 2,
                           np.random.default_rng(0).random)


def test_deterministic_for_a_seed():
    def run(seed):
        rng = np.random.default_rng(seed)
        return [speculative_accept(np.array([sample_from(Q1, rng.random())]), [Q1], [P1, P1], rng.random)
                for _ in range(50)]
    assert run(3) == run(3)
    assert run(3) != run(4)


def _cut_or_verify(rng, cut_rule: bool):
    """One position drafted from Q1 under a constraint that forbids token 5 (P1[5] = 0): a draft
    the target rejects for sure is cut before verification (the block is empty); ``cut_rule``
    gives speculative_accept its q (``cut_q``), else the bonus comes from p as after a full block."""
    x = sample_from(Q1, rng.random())
    if P1[x] == 0.0:
        _, out = speculative_accept(np.zeros(0, dtype=np.int64), [], [P1], rng.random,
                                    cut_q=Q1 if cut_rule else None)
    else:
        _, out = speculative_accept(np.array([x]), [Q1], [P1, P1], rng.random)
    return out[0]


def test_a_block_cut_before_a_doomed_draft_still_emits_p():
    """The grammar cut (speculative/verify.py ``cut_q``): the emitted law stays p exactly; without the
    residual rule at the cut (the bonus drawn from p) it moves by q(doomed) * (p - residual)."""
    rng = np.random.default_rng(11)
    n = 200_000
    good = np.bincount([_cut_or_verify(rng, True) for _ in range(n)], minlength=6)
    bad = np.bincount([_cut_or_verify(rng, False) for _ in range(n)], minlength=6)
    pv, pv_bad = chi2_pvalue(good, P1), chi2_pvalue(bad, P1)
    print(f"cut before a doomed draft: {n} draws, chi-square p = {pv:.4f}; without cut_q p = {pv_bad:.3g}")
    assert pv > P_MIN
    assert pv_bad < 1e-6
