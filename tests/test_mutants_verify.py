"""Mutation-score tests for speculative/verify.py: the accept rules against hand-computed values
(exact laws on tiny vocabularies, scripted uniforms), no llama.cpp."""

import numpy as np
import pytest

from pyllama_dspark.speculative.dist import Dist
from pyllama_dspark.speculative.verify import greedy_accept, greedy_emitted, residual, speculative_accept


def _u(*values):
    it = iter(values)
    return lambda: next(it)


def test_greedy_accept_by_hand():
    assert greedy_accept(np.array([1, 2, 3]), np.array([1, 2, 4, 5])) == 2
    assert greedy_accept(np.array([1, 2, 3]), np.array([1, 2, 3, 5])) == 3
    assert greedy_accept(np.array([7, 2]), np.array([1, 2, 3])) == 0
    assert greedy_accept(np.array([], dtype=np.int32), np.array([4])) == 0
    assert greedy_accept([1, 2], [1, 2, 3, 4]) == 2     # extra rows are fine, lists too
    assert greedy_accept(np.array([5]), np.array([5, 6])) == 1 and greedy_accept(np.array([5]), np.array([4, 6])) == 0
    with pytest.raises(ValueError, match=r"need 3 target rows for 2 drafts, got 2"):
        greedy_accept(np.array([1, 2]), np.array([1, 2]))
    with pytest.raises(ValueError, match=r"need 1 target rows for 0 drafts, got 0"):
        greedy_accept(np.array([], dtype=np.int32), np.array([], dtype=np.int32))


def test_greedy_accept_eog_rule():
    eog = np.zeros(10, dtype=bool)
    eog[9] = True
    # an accepted EOG draft that is not the last ends acceptance there, not counted
    assert greedy_accept(np.array([1, 9, 3]), np.array([1, 9, 3, 7]), eog) == 1
    assert greedy_accept(np.array([9, 1]), np.array([9, 1, 2]), eog) == 0
    assert greedy_accept(np.array([9, 4]), np.array([9, 1, 2]), eog) == 0      # one accepted, an EOG, not last
    assert greedy_accept(np.array([9]), np.array([9, 1]), eog) == 1            # the only draft: trailing
    # a trailing one is accepted
    assert greedy_accept(np.array([1, 9]), np.array([1, 9, 5]), eog) == 2
    # an EOG draft after the first mismatch changes nothing
    assert greedy_accept(np.array([1, 2, 9, 4]), np.array([1, 5, 9, 4, 0]), eog) == 1
    assert greedy_accept(np.array([1, 2, 3]), np.array([1, 2, 3, 9]), eog) == 3
    assert greedy_accept(np.array([4, 9]), np.array([1, 9, 3]), eog) == 0
    np.testing.assert_array_equal(greedy_emitted(np.array([1, 9, 3]), np.array([1, 9, 3, 7]), eog), [1, 9])
    np.testing.assert_array_equal(greedy_emitted(np.array([1, 2, 3]), np.array([1, 2, 4, 5])), [1, 2, 4])
    np.testing.assert_array_equal(greedy_emitted(np.array([1, 2]), np.array([1, 2, 6, 8])), [1, 2, 6])


def test_residual_dense_by_hand():
    r = residual(np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.5, 0.3]))
    assert r.dtype == np.float64
    np.testing.assert_allclose(r, [0.3, 0.0, 0.0], atol=1e-15)
    p = np.array([0.25, 0.75], dtype=np.float32)
    same = residual(p, p.copy())
    assert same.dtype == np.float64
    np.testing.assert_array_equal(same, [0.25, 0.75])


def _dist(ids, probs, n):
    return Dist(np.asarray(ids, dtype=np.int64), np.asarray(probs, dtype=np.float64), n)


def _check(d, ids, probs, n):
    assert isinstance(d, Dist) and d.n_vocab == n
    np.testing.assert_array_equal(d.ids, ids)
    np.testing.assert_allclose(d.probs, probs, atol=1e-15)


def test_residual_sparse_by_hand():
    p = _dist([1, 3, 5], [0.5, 0.3, 0.2], 8)
    # q smaller than p's support, one id inside, one past its last id
    _check(residual(p, _dist([3, 7], [0.9, 0.1], 8)), [1, 5], [0.5, 0.2], 8)
    _check(residual(p, _dist([6], [1.0], 8)), [1, 3, 5], [0.5, 0.3, 0.2], 8)
    _check(residual(p, _dist([0], [1.0], 8)), [1, 3, 5], [0.5, 0.3, 0.2], 8)
    _check(residual(p, _dist([5], [0.1], 8)), [1, 3, 5], [0.5, 0.3, 0.1], 8)
    # q as large as p or larger: looked up at p's ids
    _check(residual(p, _dist([0, 1, 3, 4], [0.1, 0.2, 0.6, 0.1], 8)), [1, 5], [0.3, 0.2], 8)
    _check(residual(p, _dist([1, 2, 3], [0.1, 0.8, 0.1], 8)), [1, 3, 5], [0.4, 0.2, 0.2], 8)
    # a dense q
    _check(residual(p, np.array([0, 0.6, 0, 0.1, 0, 0.3, 0, 0])), [3], [0.2], 8)
    # two whole-vocabulary rows line up
    pf = Dist(np.arange(4), np.array([0.1, 0.4, 0.0, 0.5], dtype=np.float32), 4)
    qf = Dist(np.arange(4), np.array([0.3, 0.2, 0.5, 0.0], dtype=np.float32), 4)
    r = residual(pf, qf)
    assert r.probs.dtype == np.float64
    _check(r, [1, 3], [0.2, 0.5], 4)
    assert pf.probs.tolist() == pytest.approx([0.1, 0.4, 0.0, 0.5])   # p untouched
    # nothing left: p itself
    assert residual(p, p) is p
    assert residual(p, _dist([1, 3, 5, 6], [0.6, 0.3, 0.2, 0.1], 8)) is p


def test_speculative_accept_scripted():
    p = np.array([0.1, 0.9])
    q = np.array([0.9, 0.1])
    # x = 0: p/q = 1/9; u * 0.9 < 0.1 <=> u < 1/9
    assert speculative_accept(np.array([0]), [q], [p, np.array([0.0, 1.0])], _u(0.05, 0.3)) == (1, [0, 1])
    # rejected: residual max(p - q, 0) = [0, 0.8] -> token 1 whatever the uniform
    assert speculative_accept(np.array([0]), [q], [p, p], _u(0.5, 0.0)) == (0, [1])
    # the boundary u * q == p is a rejection (strict <), p >= q an acceptance whatever u
    q2, p2 = np.array([0.5, 0.5]), np.array([0.25, 0.75])
    assert speculative_accept(np.array([0]), [q2], [p2, p2], _u(0.5, 0.0)) == (0, [1])
    assert speculative_accept(np.array([0]), [q2], [p2, p2], _u(0.4999, 0.0)) == (1, [0, 0])
    assert speculative_accept(np.array([1]), [q2], [p2, p2], _u(0.999, 0.8)) == (1, [1, 1])
    assert speculative_accept(np.array([0]), [q2], [q2, p2], _u(0.999, 0.2)) == (1, [0, 0])
    # bonus row: inverse CDF over the last row, u = 0.3 on [0.2, 0.3, 0.5] -> id 1
    last = np.array([0.2, 0.3, 0.5])
    one = np.array([0.0, 0.0, 1.0])
    assert speculative_accept(np.array([2, 2]), [one, one], [one, one, last], _u(0.9, 0.9, 0.3)) == (2, [2, 2, 1])
    assert speculative_accept(np.array([], dtype=np.int32), [], [last], _u(0.1)) == (0, [0])
    assert speculative_accept(np.array([], dtype=np.int32), [], [last], _u(0.6)) == (0, [2])


def test_speculative_accept_second_position_and_lazy_rows():
    q = [np.array([0.0, 1.0, 0.0]), np.array([0.0, 0.5, 0.5])]
    rows = {0: np.array([0.0, 1.0, 0.0]), 1: np.array([0.6, 0.4, 0.0])}

    class Lazy:
        def __init__(self):
            self.read = []

        def __getitem__(self, i):
            self.read.append(i)
            return rows[i]

    lazy = Lazy()
    # pos 0 accepted (p >= q); pos 1: x = 2 has p = 0 -> rejected, residual [0.6, 0, 0] -> 0
    assert speculative_accept(np.array([1, 2]), q, lazy, _u(0.0, 0.0, 0.99)) == (1, [1, 0])
    assert lazy.read == [0, 1]          # the bonus row 2 is never read
    with pytest.raises(ValueError, match=r"draft token 2 at position 0 has draft probability 0.0"):
        speculative_accept(np.array([2]), [np.array([0.5, 0.5, 0.0])], [rows[1], rows[1]], _u(0.1, 0.1))


def test_speculative_accept_eog_and_cut_q():
    eog = np.array([False, False, True])
    one = [np.array([0.0, 0.0, 1.0])]
    # an accepted EOG draft ends the block: no bonus, no uniform for it
    assert speculative_accept(np.array([2]), one, [one[0], np.array([1.0, 0, 0])], _u(0.5), eog) == (1, [2])
    assert speculative_accept(np.array([2]), one, [one[0], np.array([1.0, 0, 0])], _u(0.5, 0.1)) == (1, [2, 0])
    # cut_q: the bonus comes from norm(max(p - cut_q, 0)); here [0.5, 0.5, 0] - [0.5, 0, 0.5] = [0, 0.5, 0]
    last = np.array([0.5, 0.5, 0.0])
    cq = np.array([0.5, 0.0, 0.5])
    assert speculative_accept(np.array([], dtype=np.int32), [], [last], _u(0.1), cut_q=cq) == (0, [1])
    assert speculative_accept(np.array([], dtype=np.int32), [], [last], _u(0.1)) == (0, [0])
