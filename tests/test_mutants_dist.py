"""Mutation-score tests for speculative/dist.py: sparse rows and inverse-CDF draws against hand-computed
values and numpy's own cumsum/searchsorted law."""

import numpy as np
import pytest

from pyllama_dspark.speculative.dist import Dist, sample_from


def test_dist_lookup_dense_and_one_hot():
    d = Dist(np.array([1, 4, 6]), np.array([0.2, 0.3, 0.5]), 8)
    assert len(d) == 8 and isinstance(d.n_vocab, int)
    assert [d[i] for i in range(8)] == [0.0, 0.2, 0.0, 0.0, 0.3, 0.0, 0.5, 0.0]
    assert d[np.int64(6)] == 0.5
    np.testing.assert_array_equal(d.at(np.array([0, 1, 4, 5, 6, 7])), [0.0, 0.2, 0.3, 0.0, 0.5, 0.0])
    np.testing.assert_array_equal(d.dense(), [0, 0.2, 0, 0, 0.3, 0, 0.5, 0])
    assert d.dense().dtype == np.float64
    a = np.asarray(d)
    assert a.dtype == np.float64 and a.tolist() == d.dense().tolist()
    a32 = np.asarray(d, dtype=np.float32)
    assert a32.dtype == np.float32 and a32[6] == np.float32(0.5)
    oh = Dist.one_hot(np.int32(3), 5)
    assert oh.ids.tolist() == [3] and oh.probs.tolist() == [1.0] and oh.n_vocab == 5
    assert oh.ids.dtype == np.int64


def _law(probs, u):
    """The inverse-CDF law written out: the first index whose running sum exceeds u * total."""
    c = np.cumsum(np.asarray(probs, dtype=np.float64))
    return int(np.searchsorted(c, u * c[-1], side="right"))


@pytest.mark.parametrize("n", [2, 10, 64, 65, 200, 512, 513, 3000])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_sample_is_the_inverse_cdf(n, dtype):
    rng = np.random.default_rng(n)
    probs = rng.random(n).astype(dtype)
    probs[rng.random(n) < 0.3] = 0.0
    probs[0] = 0.5
    ids = np.sort(rng.choice(10 * n, size=n, replace=False))
    d = Dist(ids, probs, 10 * n)
    for u in [0.0, 0.001, 0.25, 0.5, 0.77, 0.999]:
        j = _law(probs, u)
        assert d.sample(u) == ids[j], (n, u)
        assert sample_from(d, u) == ids[j]


def test_sample_boundaries_by_hand():
    d = Dist(np.array([3, 5, 9]), np.array([0.25, 0.25, 0.5]), 10)
    assert [d.sample(u) for u in (0.0, 0.2499, 0.25, 0.4999, 0.5, 0.99)] == [3, 3, 5, 5, 9, 9]
    assert Dist(np.array([7]), np.array([0.0]), 9).sample(0.9) == 7   # one id: that id
    # rounding past the end: the last id with a positive probability (never a zero entry)
    z = Dist(np.array([1, 2, 4]), np.array([0.5, 0.5, 0.0]), 5)
    assert z.sample(1.0) == 2
    z = Dist(np.array([1, 2, 4, 6]), np.array([0.25, 0.25, 0.5, 0.0]), 7)
    assert z.sample(1.0) == 4
    big = np.zeros(100)
    big[[3, 50]] = 0.5
    assert Dist(np.arange(100), big, 100).sample(1.0) == 50
    huge = np.zeros(1000)
    huge[[3, 700]] = 0.5
    assert Dist(np.arange(1000), huge, 1000).sample(0.9999) == 700
    assert Dist(np.arange(1000), huge, 1000).sample(0.4) == 3
    with pytest.raises(ValueError, match=r"cannot sample: u 1 outside"):   # the shim refuses u = 1
        Dist(np.arange(1000), huge, 1000).sample(1.0)


def test_sample_from_dense_by_hand():
    p = np.array([0.0, 0.2, 0.0, 0.3, 0.5])
    assert [sample_from(p, u) for u in (0.0, 0.1999, 0.2, 0.4999, 0.5, 0.999)] == [1, 1, 3, 3, 4, 4]
    assert sample_from(p, 1.0) == 4                 # clipped to the last positive id
    assert sample_from([0.0, 2.0, 2.0], 0.5) == 2   # unnormalized, a list
    with pytest.raises(ValueError, match="^cannot sample from an all-zero distribution$"):
        sample_from(np.zeros(4), 0.5)


def test_float32_rows_are_summed_in_double():
    # float32 running sums would lose the 1e-8 steps after 1.0 (every sum stays 1.0f): the law sums in
    # double, where u * total = 0.9999995 * 1.000001 is only passed after ~50 steps
    pr = np.full(101, 1e-8, dtype=np.float32)
    pr[0] = 1.0
    d = Dist(np.arange(101), pr, 101)
    j = _law(pr, 0.9999995)
    assert 45 <= j <= 55                         # (float32(1e-8) is not exactly 1e-8)
    assert d.sample(0.9999995) == j              # float32 sums would give 0
