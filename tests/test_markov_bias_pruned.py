"""The T > 0 draft's Markov re-conditioning computed only where the chain can keep a token
(speculative/draft_sampling.MarkovDelta on the shim's ``dspark_markov_candidates``) against the whole
vocabulary in numpy: base logits + the full bias ``scale W2 . (W1[x] - W1[a])`` (float64, from the
weights as written), then the chain (``chain_dist_numpy``; the greedy pick by hand).  The q row must
be the same distribution: ids identical, probabilities within 1e-5.

Markov heads written here (no model): F32 W2 of rank 20 (padded to 32 in the 7-bit copy) with a
negative ``markov_w2.scale``, F16 W2 of rank 32, and a reduced draft vocabulary (``d2t``: 12,000 of
32,768 ids).  Chains: top-k, top-p and min-p alone and combined, penalties / bans / logit bias, the
greedy pick with penalties (all pruned), and top-p without top-k, every filter off, top-k >= vocab
(the whole row; F32 W2 only: with F16 W2 ggml's CPU product rounds d to F16 there).  Adversarial rows: a token far below the top k lifted into it by a large bias, a
logit bias lifting another, and 3,000 tied logits whose top k only the bias decides (a bound that
is too tight loses members there).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from pyllama_dspark.llama.markov_head import MarkovHead
from pyllama_dspark.speculative.chain import apply_penalties, chain_dist_numpy
from pyllama_dspark.speculative.draft_sampling import BlockSampler
from pyllama_dspark.speculative.sampling import TokenSampler
from pyllama_dspark.speculative.sampling_params import SamplingParams

V = 32768
LIFT_A, LIFT_X, LIFT_V = 11, 12, 20001   # W1[LIFT_X] - W1[LIFT_A] points along W2[LIFT_V] (f32 head)
LIFT = 30.0                               # the bias LIFT_V gets from that pair


class _Head:
    """A Markov head GGUF and its weights in float64 (as written: F16 W2 rounded)."""

    def __init__(self, path, rank, w2_type="f32", scale=None, n_draft=None, seed=0):
        rng = np.random.default_rng(seed)
        nd = n_draft or V
        self.w1 = rng.standard_normal((V, rank)).astype(np.float32)
        w2 = (rng.standard_normal((nd, rank)) / np.sqrt(rank)).astype(np.float32)
        if w2_type == "f16":
            w2 = w2.astype(np.float16)
        self.scale = 1.0 if scale is None else float(np.float32(scale))
        if n_draft is None:
            self.d2t = None
        else:
            self.d2t = np.sort(rng.choice(V, size=nd, replace=False)).astype(np.int64)
        if w2_type == "f32" and n_draft is None:
            # the lift pair: W1[x] - W1[a] = LIFT * W2[v] / (scale ||W2[v]||^2), i.e. bias_v = LIFT; W2[v]
            # 5x longer than the other rows, so that their biases along it stay ~LIFT / (5 sqrt(rank))
            w2[LIFT_V] *= 5.0
            v = w2[LIFT_V].astype(np.float64)
            self.w1[LIFT_A] = 0.0
            self.w1[LIFT_X] = (LIFT * v / (self.scale * (v @ v))).astype(np.float32)
        self.w2 = w2.astype(np.float64)
        self.path = str(path)
        w = gguf.GGUFWriter(str(path), "dflash")
        w.add_tensor("markov_w1.weight", self.w1)
        w.add_tensor("markov_w2.weight", w2)
        if scale is not None:
            w.add_tensor("markov_w2.scale", np.array([scale], dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        self.head = MarkovHead(str(path), n_threads=1)
        self.bs = BlockSampler(_Draft(), self.head, None, self.d2t)

    def bias(self, a, x):
        """The full bias delta on the target ids (float32 [V])."""
        d = (self.w1[x] - self.w1[a]).astype(np.float64)     # the float32 difference the shim gets
        b = (self.scale * (self.w2 @ d)).astype(np.float32)
        if self.d2t is None:
            return b
        out = np.zeros(V, dtype=np.float32)
        out[self.d2t] = b
        return out

    def row(self, rng, sd=1.5):
        x = (sd * rng.standard_normal(V)).astype(np.float32)
        if self.d2t is not None:        # llama.cpp's reduced-vocabulary rows: -inf off the draft ids
            off = np.ones(V, dtype=bool)
            off[self.d2t] = False
            x[off] = -np.inf
        return x


class _Draft:
    n_vocab = V

    class meta:
        block_size = 7


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    d = tmp_path_factory.mktemp("markov")
    hs = {"f32": _Head(d / "f32.gguf", 20, scale=-1.5, seed=1),
          "f16": _Head(d / "f16.gguf", 32, w2_type="f16", seed=2),
          "d2t": _Head(d / "d2t.gguf", 24, n_draft=12000, seed=3)}
    yield hs
    for h in hs.values():
        h.head.close()


def _reference(h, x, a, t, smp, extra):
    """Whole vocabulary in numpy: dense float64 q."""
    y = x + h.bias(a, t)
    if smp._bias_ids is not None:
        y[smp._bias_ids] += smp._bias_vals
    window = smp.window(extra)
    if not smp.greedy:
        return chain_dist_numpy(y, smp.params, window, smp.banned).dense()
    if smp.banned is not None:
        y[smp.banned] = -np.inf
    if window is not None and window.size:
        y = apply_penalties(y, window.astype(np.int64), smp.params)
    q = np.zeros(V)
    q[int(np.argmax(y))] = 1.0
    return q


def _q(h, x, a, t, smp, extra):
    """q as BlockSampler.sample computes it for a row drawn off the graph's argmax."""
    q, logits, w1x = h.bs._recondition(x, a, t, smp, extra)
    np.testing.assert_array_equal(w1x, h.w1[t])
    return smp.draft_probs(logits, extra) if q is None else q


def _check(h, x, a, t, smp, extra=(), pruned=True):
    md = h.bs.delta
    before = (md.n_pruned, md.n_full)
    got = np.asarray(_q(h, x, a, t, smp, extra), dtype=np.float64)
    want = _reference(h, x, a, t, smp, extra)
    np.testing.assert_array_equal(np.flatnonzero(got), np.flatnonzero(want))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    if pruned:
        assert (md.n_pruned, md.n_full) == (before[0] + 1, before[1]), "the pruned path was not taken"
        assert md.last_candidates < V // 8
    else:
        assert (md.n_pruned, md.n_full) == (before[0], before[1] + 1), "expected the whole-row path"
    return got


PRUNED = {
    "llama.cpp default": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "top-k": dict(temperature=1.2, top_k=40, top_p=1.0, min_p=0.0),
    "top-k top-p": dict(temperature=1.0, top_k=100, top_p=0.9, min_p=0.0),
    "top-k min-p": dict(temperature=0.7, top_k=64, top_p=1.0, min_p=0.1),
    "top-k 1": dict(temperature=0.8, top_k=1, top_p=1.0, min_p=0.0),
    "min-p": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.05),
}
WHOLE = {
    "top-p": dict(temperature=0.8, top_k=0, top_p=0.9, min_p=0.05),
    "filters off": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "top-k >= vocab": dict(temperature=1.0, top_k=V, top_p=1.0, min_p=0.0),
}


@pytest.mark.parametrize("kind", ["f32", "f16", "d2t"])
def test_pruned_rows_equal_the_whole_vocabulary(heads, kind):
    h = heads[kind]
    rng = np.random.default_rng(7)
    # (the whole-row product of an F16 W2 rounds d to F16 in ggml's CPU mul_mat: not to 1e-5)
    for name, p in {**PRUNED, **(WHOLE if kind != "f16" else {})}.items():
        smp = TokenSampler(SamplingParams(seed=1, **p))
        for _ in range(3):
            a, t = (int(v) for v in (h.d2t if h.d2t is not None else np.arange(V))[rng.integers(0, 12000, 2)])
            _check(h, h.row(rng), a, t, smp, pruned=name in PRUNED)


@pytest.mark.parametrize("kind", ["f32", "d2t"])
def test_penalties_bans_and_logit_bias(heads, kind):
    h = heads[kind]
    rng = np.random.default_rng(8)
    for _ in range(4):
        x = h.row(rng)
        a, t = (int(v) for v in rng.integers(0, V, 2))
        top = np.argsort(-x)[:6]
        far = int(np.argsort(-x)[V // 3])            # a middling token a logit bias lifts to the top
        params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.5,
                                presence_penalty=0.7, frequency_penalty=0.3, penalty_last_n=6, seed=2)
        smp = TokenSampler(params, history=[int(top[1]), int(top[2]), int(top[2]), 5, 6],
                           banned=[int(top[0])], logit_bias={far: 25.0, int(top[3]): -3.0})
        got = _check(h, x, a, t, smp, extra=[int(top[4]), int(top[1])])
        if h.d2t is None or far in set(h.d2t.tolist()):
            assert got[far] > 0, "the logit-biased token is kept"
        assert got[top[0]] == 0.0
        greedy = TokenSampler(SamplingParams(temperature=0.0, repeat_penalty=1.3, penalty_last_n=16),
                              history=[int(v) for v in top[:4]], banned=[int(top[5])])
        _check(h, x, a, t, greedy, extra=[int(top[4])])


def test_bias_lifts_a_token_from_far_below_the_top_k(heads):
    h = heads["f32"]
    rng = np.random.default_rng(9)
    b = h.bias(LIFT_A, LIFT_X)
    assert abs(b[LIFT_V] - LIFT) < 1e-3
    for p in (PRUNED["top-k"], PRUNED["llama.cpp default"], PRUNED["min-p"]):
        x = h.row(rng)
        others = np.delete(x + b, LIFT_V)
        x[LIFT_V] = np.float32(others.max() + 0.5 - LIFT)   # argmax of the biased row, by 0.5
        rank = int((x > x[LIFT_V]).sum())
        assert rank > 1000, f"the lifted token should start far below the top (rank {rank})"
        got = _check(h, x, LIFT_A, LIFT_X, TokenSampler(SamplingParams(seed=3, **p)))
        assert got[LIFT_V] == got.max() > 0


def test_tied_logits_ordered_by_the_bias_alone(heads):
    """3,000 equal logits, everything else far below: the top k is decided by the bias alone, whose
    7-bit estimate orders the tokens near the cut differently from the exact values."""
    for kind in ("f32", "f16"):
        h = heads[kind]
        rng = np.random.default_rng(10)
        tied = rng.choice(V, size=3000, replace=False)
        for _ in range(10):
            x = np.full(V, -30.0, dtype=np.float32)
            x[tied] = 2.0
            a, t = (int(v) for v in rng.integers(0, V, 2))
            for p in (PRUNED["top-k"], PRUNED["top-k top-p"]):
                _check(h, x, a, t, TokenSampler(SamplingParams(seed=4, **p)))


_KERNEL_SCRIPT = """
import sys, numpy as np
from pyllama_dspark.llama import _native as nat
from pyllama_dspark.llama.markov_head import MarkovHead
m = MarkovHead(sys.argv[1], n_threads=1)
rng = np.random.default_rng(11)
ids, vals = np.empty(4096, np.int32), np.empty(4096, np.float32)
for k, min_p in ((40, 0.0), (0, 0.05)):
    x = (1.5 * rng.standard_normal(m.n_vocab)).astype(np.float32)
    d = rng.standard_normal(m.rank).astype(np.float32)
    n = nat.markov_candidates(m.handle, x.ctypes.data, x.size, None, d.ctypes.data, k, min_p, None, 0,
                             ids.ctypes.data, vals.ctypes.data, ids.size)
    print(n, ids[:n].tolist(), vals[:n].tolist())
"""


def test_scalar_and_avx2_kernels_agree(heads, tmp_path):
    """The 7-bit bound kernel without AVX2 (DSPARK_NO_AVX2, read when the shim loads: a fresh
    process) finds the same candidates and values as the vectorized one (same operations, in the
    same order), and both the exact values."""
    import os
    import subprocess
    import sys

    script = tmp_path / "k.py"
    script.write_text(_KERNEL_SCRIPT)
    outs = []
    for off in ("", "1"):
        env = dict(os.environ, DSPARK_NO_AVX2=off, PYTHONPATH=os.pathsep.join(sys.path))
        p = subprocess.run([sys.executable, str(script), heads["f32"].path], env=env, capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0, p.stderr
        outs.append(p.stdout)
    assert outs[0] == outs[1] and outs[0].count("\n") == 2 and not outs[0].startswith("0 ")
