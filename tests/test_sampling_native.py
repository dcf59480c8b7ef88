"""The shim's sampler chain and row scans at the vocabulary sizes DSpark targets use (49,152,
151,936, 262,144), against llama.cpp's own samplers (through llama-cpp-python's bindings) and
exact laws; the sparse accept rule; the C++ exception guard of the shim.

top-p: llama.cpp sums the softmax total and the running mass in float, we in double, so over a
long tail (a 152k-262k vocabulary) its cut can sit a few tokens away from the exact one.  There our
kept set is checked against the exact law (the smallest prefix by logit whose mass reaches p), and
llama.cpp's against an emulation of its float arithmetic; everywhere else the kept sets must be
identical.
"""

from __future__ import annotations

import numpy as np
import pytest

from greedy_ref import TEST_THREADS
from llama_sampler_ref import LlamaChain
from pyllama_dspark.llama import _native as nat
from pyllama_dspark.errors import NativeError
from pyllama_dspark.speculative.chain import chain_dist
from pyllama_dspark.speculative.dist import Dist, sample_from
from pyllama_dspark.speculative.sampling import TokenSampler
from pyllama_dspark.speculative.sampling_params import SamplingParams
from pyllama_dspark.speculative.verify import residual, speculative_accept
from test_sampling_rule import P1, Q1, P_MIN, chi2_pvalue

VOCABS = [49152, 151936, 262144]

PARAMS = {
    "default": SamplingParams(),
    "off-T1": SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "top-p.9": SamplingParams(temperature=0.8, top_k=0, top_p=0.9, min_p=0.0),
    "top-p.99-min-p": SamplingParams(temperature=1.3, top_k=0, top_p=0.99, min_p=0.01),
    "min-p": SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.1),
    "k1000-p.95": SamplingParams(temperature=1.1, top_k=1000, top_p=0.95, min_p=0.0),
    "penalties": SamplingParams(temperature=0.9, top_k=50, top_p=0.97, min_p=0.0, repeat_penalty=1.3,
                                frequency_penalty=0.2, presence_penalty=0.4, penalty_last_n=16),
    "penalties-top-p": SamplingParams(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0, repeat_penalty=0.8,
                                      penalty_last_n=-1),
}


def _rows(v: int):
    rng = np.random.default_rng(v)
    r = np.arange(1, v + 1, dtype=np.float64)
    zipf = rng.permutation(-1.3 * np.log(r) + rng.normal(0.0, 0.3, v)).astype(np.float32)
    flat = rng.normal(0.0, 1.0, v).astype(np.float32)
    neg = (rng.normal(0.0, 4.0, v) - 20.0).astype(np.float32)
    hist = rng.integers(0, v, 24).tolist()
    hist += hist[:8] + [int(np.argmax(zipf)), int(np.argmax(flat))]  # repeats; the top tokens penalized
    return {"zipf": zipf, "flat": flat, "neg": neg}, hist


def _penalized(row, params, window):
    """llama.cpp's penalties in float32 (the law, written out)."""
    x = row.copy()
    if not params.has_penalties:
        return x
    ids, counts = np.unique(np.asarray(window), return_counts=True)
    rp = np.float32(params.repeat_penalty)
    v = x[ids]
    v = np.where(v <= 0, v * rp, v / rp).astype(np.float32)
    v = v - (counts.astype(np.float32) * np.float32(params.frequency_penalty) + np.float32(params.presence_penalty))
    x[ids] = v
    return x


def _llama_float_top_p_size(x, params):
    """How many tokens llama.cpp's top-p (then min-p) keeps, its float32 arithmetic emulated: the
    softmax total summed in index order, the running mass in sorted order, both in float."""
    xf = x.astype(np.float32)
    e = np.exp(xf - xf.max(), dtype=np.float32)
    total = np.add.accumulate(e, dtype=np.float32)[-1]
    srt = np.sort((e / total).astype(np.float32))[::-1]
    cum = np.add.accumulate(srt, dtype=np.float32)
    hit = np.flatnonzero(cum >= np.float32(params.top_p))
    m = int(hit[0]) + 1 if hit.size else int(np.count_nonzero(np.isfinite(xf)))
    if params.min_p > 0:
        m = min(m, int(np.count_nonzero(xf >= np.float32(xf.max()) + np.float32(np.log(np.float32(params.min_p))))))
    return m


def _check_top_p_law(x, params, ours_ids):
    """ours_ids is the smallest prefix by (logit desc, id asc) whose softmax mass reaches p."""
    order = np.lexsort((np.arange(x.size), -x.astype(np.float64)))
    e = np.exp(x[order].astype(np.float64) - float(x.max()))
    cum = np.cumsum(e) / e.sum()
    m = int(np.searchsorted(cum, np.float32(params.top_p), side="left")) + 1
    if params.min_p > 0:
        thr = np.float32(x.max()) + np.float32(np.log(np.float32(params.min_p)))
        m = min(m, int(np.count_nonzero(x >= thr)))
    assert np.array_equal(np.sort(order[:m]), ours_ids)


@pytest.mark.parametrize("v", VOCABS)
def test_chain_matches_llama_cpp(v):
    rows, hist = _rows(v)
    banned = np.array([3, 7, int(np.argsort(rows["zipf"])[-2])])
    n_boundary = 0
    for pname, params in PARAMS.items():
        for rname, row in rows.items():
            smp = TokenSampler(params.with_seed(0), hist, banned=banned)
            d = smp.probs(row)
            assert d.ids.dtype.kind == "i" and np.all(np.diff(d.ids) > 0)
            # float64 probabilities, or float32 over the whole vocabulary (filters off), zeros included
            assert abs(d.probs.sum(dtype=np.float64) - 1) < (1e-9 if d.probs.dtype == np.float64 else 1e-6)
            if d.probs.dtype == np.float32:
                assert d.ids.size == v and pname == "off-T1"
            nz = d.probs > 0
            ours = Dist(d.ids[nz], d.probs[nz].astype(np.float64), v)
            biased = row.copy()
            biased[banned] = -np.inf
            ref = LlamaChain(params, v, hist)
            try:
                theirs = ref.probs(biased)
            finally:
                ref.close()
            keep = np.flatnonzero(theirs)
            what = f"{pname} on {rname} at {v}: ours {ours.ids.size}, llama.cpp {keep.size}"
            if np.array_equal(ours.ids, keep):
                np.testing.assert_allclose(ours.probs, theirs[keep], rtol=2e-5, atol=1e-12, err_msg=what)
                continue
            # only a top-p cut over a long candidate list may differ, by float rounding of the mass
            assert params.top_p < 1.0 and params.top_k == 0, what
            n_boundary += 1
            x = _penalized(biased, params, smp.window())
            _check_top_p_law(x, params, ours.ids)
            small, big = (ours.ids, keep) if ours.ids.size < keep.size else (keep, ours.ids)
            assert np.isin(small, big).all(), what           # nested prefixes
            # and llama.cpp's cut is its float arithmetic's (emulated: ulp differences of expf aside)
            assert abs(keep.size - _llama_float_top_p_size(x, params)) <= 2, what
            z = x[ours.ids].astype(np.float64) / params.temperature
            law = np.exp(z - z.max())
            np.testing.assert_allclose(ours.probs, law / law.sum(), rtol=2e-5, err_msg=what)
    print(f"{v}: {n_boundary} top-p cuts within llama.cpp's float rounding of the exact one")


def test_ties_follow_one_rule():
    """Tied logits at a cut: llama.cpp's order among equal logits is its sort's; ours keeps the
    lower ids first.  Checked on the law: the kept set is a prefix in (logit desc, id asc) order."""
    v = 262144
    rng = np.random.default_rng(3)
    row = np.round(rng.normal(0.0, 1.0, v) * 4).astype(np.float32)
    for params in (SamplingParams(temperature=1.0, top_k=40, top_p=1.0, min_p=0.0),
                   SamplingParams(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0),
                   SamplingParams(temperature=1.0, top_k=0, top_p=0.999, min_p=0.0)):
        d = chain_dist(row, params)
        order = np.lexsort((np.arange(v), -row.astype(np.float64)))
        if params.top_k:
            assert np.array_equal(d.ids, np.sort(order[:params.top_k]))
        else:
            _check_top_p_law(row, params, d.ids)


@pytest.mark.parametrize("v", VOCABS)
def test_greedy_with_penalties_is_llama_cpp_pick(v):
    rows, hist = _rows(v)
    params = SamplingParams(temperature=0.0, repeat_penalty=1.3, presence_penalty=0.2)
    changed = 0
    for row in rows.values():
        d = TokenSampler(params, hist).probs(row)
        ref = LlamaChain(params, v, hist)
        try:
            theirs = ref.probs(row)
        finally:
            ref.close()
        assert d.ids.tolist() == [int(np.argmax(theirs))] and d.probs.tolist() == [1.0]
        changed += d.ids[0] != int(np.argmax(row))
    assert changed   # the penalties moved at least one pick


def test_chain_bad_input_is_an_exception():
    row = np.zeros(8, dtype=np.float32)
    with pytest.raises(ValueError):
        chain_dist(np.full(8, -np.inf, dtype=np.float32), SamplingParams())
    with pytest.raises(ValueError):
        TokenSampler(SamplingParams(repeat_penalty=1.2), [0, 99]).probs(row)   # a history id out of vocab
    with pytest.raises(ValueError):
        TokenSampler(SamplingParams(), banned=[8]).probs(row)
    ids = np.empty(8, dtype=np.int32)
    probs = np.empty(8)
    p = nat.ChainParams(1.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0)
    assert nat.chain_dist(nat.ptr_f32(row), 8, p, None, 0, None, 0, nat.ptr_i32(ids), nat.ptr_f64(probs), 4) < 0
    assert "capacity" in nat.error_message()
    bad = nat.ChainParams(1.0, 0, 1.5, 0.0, 1.0, 0.0, 0.0)
    assert nat.chain_dist(nat.ptr_f32(row), 8, bad, None, 0, None, 0, nat.ptr_i32(ids), nat.ptr_f64(probs), 8) < 0
    assert nat.sample_cdf(nat.ptr_f64(np.zeros(4)), 4, 0.5) < 0


@pytest.mark.parametrize("n", [3, 64, 65, 700, 262144])
def test_draws_are_the_inverse_cdf(n):
    """Dist.sample (Python sums up to 64 ids, numpy below 512, the shim above) against numpy's
    searchsorted over the cumulative sum, on fixed uniforms."""
    rng = np.random.default_rng(n)
    probs = rng.dirichlet(np.full(n, 0.3))
    ids = np.sort(rng.choice(10 * n, n, replace=False))
    d = Dist(ids, probs, 10 * n)
    c = np.cumsum(probs)
    for u in rng.random(300):
        j = min(int(np.searchsorted(c, u * c[-1], side="right")), n - 1)
        assert d.sample(u) == ids[j]


@pytest.mark.parametrize("n", [40, 300, 5000])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_zero_weights_are_never_drawn(n, dtype):
    """A whole-vocabulary row keeps zeros (banned / cut ids): no u draws one, not even where the
    running sum's rounding falls short of u * total at the very end."""
    rng = np.random.default_rng(n)
    p = rng.random(n).astype(dtype)
    p[::3] = 0
    p[-5:] = 0
    p /= p.sum(dtype=np.float64)
    d = Dist(np.arange(n, dtype=np.int32), p.astype(dtype), n)
    for u in np.concatenate([rng.random(500), [0.0, 1.0 - 1e-16, np.nextafter(1.0, 0.0)]]):
        assert p[d.sample(u)] > 0
    with_banned = TokenSampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3),
                               banned=np.arange(0, 5000, 2))
    row = rng.normal(0, 1, 5000).astype(np.float32)
    q = with_banned.probs(row)
    assert all(with_banned.sample(q) % 2 == 1 for _ in range(300))


def test_sparse_rows_accept_exactly_like_dense_rows():
    """speculative_accept with Dist rows (sparse residual) draws what it draws with dense rows."""
    rng = np.random.default_rng(5)
    v = 300
    for trial in range(200):
        p = rng.dirichlet(np.full(v, 0.2))
        q = rng.dirichlet(np.full(v, 0.2))
        p[p < 1e-3] = 0.0
        q[q < 1e-3] = 0.0
        p /= p.sum()
        q /= q.sum()
        sp = Dist(np.flatnonzero(p), p[p > 0], v)
        sq = Dist(np.flatnonzero(q), q[q > 0], v)
        x = np.array([sample_from(q, rng.random())])
        seed = int(rng.integers(1 << 30))
        dense = speculative_accept(x, [q], [p, p], np.random.default_rng(seed).random)
        sparse = speculative_accept(x, [sq], [sp, sp], np.random.default_rng(seed).random)
        assert dense == sparse
        assert np.array_equal(np.asarray(residual(sp, sq)), residual(p, q))
    one = Dist.one_hot(4, 10)
    assert np.asarray(residual(Dist.one_hot(4, 10), one)).tolist() == np.asarray(one).tolist()
    # whole-vocabulary rows (the shim's float32 dense form) against sparse and dense ones
    ids = np.arange(v, dtype=np.int32)
    wp, wq = Dist(ids, p.astype(np.float32), v), Dist(ids, q.astype(np.float32), v)
    for a, b in ((wp, wq), (wp, sq), (sp, wq)):
        np.testing.assert_allclose(np.asarray(residual(a, b)), residual(np.asarray(a), np.asarray(b)), atol=1e-12)


def test_sparse_single_position_emits_p():
    """The accept rule on sparse rows emits p (chi-square), a q with mass off p's support included."""
    rng = np.random.default_rng(11)
    sp = Dist(np.flatnonzero(P1), P1[P1 > 0], 6)
    sq = Dist(np.arange(6), Q1, 6)
    bonus = Dist(np.arange(6), np.full(6, 1 / 6), 6)
    counts = np.zeros(6, dtype=np.int64)
    for _ in range(100_000):
        x = sq.sample(rng.random())
        _, out = speculative_accept(np.array([x]), [sq], [sp, bonus], rng.random)
        counts[out[0]] += 1
    assert chi2_pvalue(counts, P1) > P_MIN


@pytest.mark.parametrize("v", VOCABS)
def test_argmax_and_top_k_scans(v):
    rng = np.random.default_rng(v + 1)
    rows = np.stack([rng.normal(0, 3, v), rng.normal(0, 3, v), np.round(rng.normal(0, 1, v))]).astype(np.float32)
    rows[1, :100] = -np.inf
    rows[1, 5000] = np.nan
    ids = np.zeros(3, dtype=np.int32)
    gap = np.zeros(3, dtype=np.float32)
    nat.check(nat.argmax_f32(nat.ptr_f32(rows), 3, v, nat.ptr_i32(ids), nat.ptr_f32(gap)), "argmax")
    for r in range(3):
        x = np.where(np.isnan(rows[r]), -np.inf, rows[r])
        assert ids[r] == int(np.argmax(x))
        assert gap[r] == np.float32(x.max() - np.sort(x)[-2])
    out = np.empty(40, dtype=np.int32)
    nat.check(nat.top_k_f32(nat.ptr_f32(rows[2]), v, 40, nat.ptr_i32(out)), "top-k")
    order = np.lexsort((np.arange(v), -rows[2].astype(np.float64)))
    assert np.array_equal(np.sort(out), np.sort(order[:40]))


def _edge_rows(n, rng):
    """Rows that stress a top-k scan's bound: ties, -inf and NaN runs, fewer finite logits than k."""
    normal = rng.normal(0, 1, n).astype(np.float32)
    ties = np.round(rng.normal(0, 1, n)).astype(np.float32)
    half_inf = normal.copy()
    half_inf[: n // 2] = -np.inf
    nans = normal.copy()
    nans[rng.random(n) < 0.3] = np.nan
    few = np.full(n, -np.inf, dtype=np.float32)
    few[rng.choice(n, min(n, 3), replace=False)] = [1.0, 2.0, 1.0][: min(n, 3)]
    rising = np.arange(n, dtype=np.float32)   # the maximum in the last block
    return {"normal": normal, "ties": ties, "equal": np.zeros(n, np.float32), "half_inf": half_inf,
            "nans": nans, "few_finite": few, "rising": rising}


@pytest.mark.parametrize("n", [1, 7, 63, 64, 65, 1000, 4097, 49152])
def test_top_k_scan_edge_rows(n):
    """The shim's top-k (the chain's top_k and its max) against a sort, in candidate order (logit
    desc, id asc; -inf and NaN last, lowest ids first), for k from 1 to n."""
    rng = np.random.default_rng(n)
    ks = sorted({k for k in (1, 2, 40, n // 3, n - 1, n) if 1 <= k <= n})
    for name, row in _edge_rows(n, rng).items():
        cand = ~np.isnan(row) & (row > -np.inf)
        order = np.lexsort((np.arange(n), -np.where(cand, row, 0).astype(np.float64), ~cand))
        for k in ks:
            out = np.empty(k, dtype=np.int32)
            nat.check(nat.top_k_f32(nat.ptr_f32(row), n, k, nat.ptr_i32(out)), "top-k")
            assert np.array_equal(np.sort(out), np.sort(order[:k])), (name, k)
            if k < n and cand.any():
                d = chain_dist(row, SamplingParams(temperature=1.0, top_k=k, top_p=1.0, min_p=0.0))
                keep = np.sort(order[:min(k, int(cand.sum()))])
                z = row.astype(np.float64) - row[keep].max()
                # weights under exp(-87) are float zeros (dropped, as llama.cpp's expf drops them)
                assert set(keep[z[keep] > -80].tolist()) <= set(d.ids.tolist()) <= set(keep.tolist()), (name, k)
                e = np.exp(z[d.ids])
                np.testing.assert_allclose(d.probs, e / e.sum(), rtol=1e-5, atol=1e-30)


def test_markov_bias_and_w1_at_262k(tmp_path):
    """The Markov graph and its transfer with a 262,144-token vocabulary (W1 and W2 only)."""
    import gguf

    from pyllama_dspark.llama.markov_head import MarkovHead

    v, rank = 262144, 8
    rng = np.random.default_rng(0)
    w1 = rng.normal(0, 1, (v, rank)).astype(np.float32)
    w2 = rng.normal(0, 1, (v, rank)).astype(np.float16)
    path = tmp_path / "markov-262k.gguf"
    w = gguf.GGUFWriter(str(path), "dflash")
    w.add_tensor("markov_w1.weight", w1)
    w.add_tensor("markov_w2.weight", w2)
    w.add_tensor("markov_w2.scale", np.array([0.5], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with MarkovHead(str(path)) as m:
        assert (m.n_vocab, m.n_vocab_draft, m.rank) == (v, v, rank)
        prev = [0, 123456, v - 1]
        bias, rows = m.bias_w1(prev)
        assert np.array_equal(rows, w1[prev])
        ref = 0.5 * (w1[prev].astype(np.float64) @ w2.astype(np.float64).T)
        np.testing.assert_allclose(bias, ref, rtol=2e-2, atol=2e-2)
        assert np.abs(bias - ref).mean() < 5e-3


def test_exception_guard():
    """A C++ exception inside the shim is a status + message, never an abort."""
    for kind, text in ((0, "planted exception"), (1, "out of memory"), (2, "unknown C++ exception"),
                       (3, "dspark_test_throw")):
        assert nat.test_throw(kind) == nat.E_INTERNAL
        assert text in nat.error_message()
        with pytest.raises(NativeError, match="dspark_test_throw"):
            nat.check(nat.test_throw(kind), "guard")
    assert nat.test_throw(-1) == nat.OK and nat.last_error() == b""


def test_absurd_inject_is_refused_before_allocating(target_path, dspark_draft_path):
    from pyllama_dspark.llama.draft_meta import read_draft_meta
    from pyllama_dspark.llama.handles import ContextSettings, Draft, Target

    meta = read_draft_meta(dspark_draft_path)
    s = ContextSettings(n_ctx=256, n_threads=TEST_THREADS)
    with Target(target_path, s, capture_layers=meta.target_layers) as t:
        d = Draft(dspark_draft_path, t, s)
        t.decode(np.asarray([1, 2, 3], dtype=np.int32), 0, 0, all_outputs=False)
        with pytest.raises(NativeError, match="captured rows"):
            d.inject_captured(0, 2**31 - 1, 0)
        d.inject_captured(0, 3, 0)
        d.close()


def test_the_avx2_kernels_too():
    """On a CPU with AVX-512 the shim runs its 16-lane kernels; the 8-lane AVX2 ones (what a CPU
    without AVX-512 runs) are checked here too, in a process started with DSPARK_NO_AVX512=1."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, DSPARK_NO_AVX512="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                        "chain_matches or edge_rows or ties or inverse_cdf or top_k_scans or sparse_rows"],
                       cwd=os.path.dirname(__file__), env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout
