"""Our numpy sampler chain == llama.cpp's sampler chain (applied through llama-cpp-python).

Same logits rows (real SmolLM2 rows and synthetic ones), same parameters: the kept token set must
be identical and the probabilities equal to float32 rounding.  Also: parameter validation.
"""

from __future__ import annotations

import numpy as np
import pytest

from llama_sampler_ref import LlamaChain
from pyllama_dspark.llama.handles import ContextSettings, Target
from pyllama_dspark.speculative.chain import chain_probs
from pyllama_dspark.speculative.sampling import TokenSampler
from pyllama_dspark.speculative.sampling_params import SamplingParams, resolve_seed

PARAMS = [
    SamplingParams(),                                                        # llama.cpp defaults
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),          # plain softmax
    SamplingParams(temperature=1.5, top_k=0, top_p=0.9, min_p=0.0),          # top-p over the vocab
    SamplingParams(temperature=0.7, top_k=100, top_p=1.0, min_p=0.1),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.8, min_p=0.2),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.97, min_p=0.0, repeat_penalty=1.3,
                   frequency_penalty=0.2, presence_penalty=0.4, penalty_last_n=16),
    SamplingParams(temperature=1.2, top_k=0, top_p=1.0, min_p=0.02, repeat_penalty=0.8, penalty_last_n=-1),
]


@pytest.fixture(scope="module")
def rows(target_path):
    out = []
    with Target(target_path, ContextSettings(n_threads=1, n_ctx=512)) as t:
        for text in ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far"):
            toks = np.asarray(t.tokenize(text), dtype=np.int32)
            t.seq_rm(0, 0, -1)
            t.decode(toks, 0, 0, all_outputs=True)
            out += [(toks[: i + 1].tolist(), t.logits(i)) for i in range(len(toks) - 3, len(toks))]
    rng = np.random.default_rng(0)
    v = out[0][1].size
    out.append(([1, 2, 3, 2, 2], rng.normal(0, 1, v).astype(np.float32)))      # flat: top-p sorts everything
    out.append(([7, 7, 9], (rng.normal(0, 4, v) - 20).astype(np.float32)))      # all logits negative
    return out


@pytest.mark.parametrize("i", range(len(PARAMS)))
def test_chain_matches_llama_cpp(rows, i):
    params = PARAMS[i]
    for history, row in rows:
        ref = LlamaChain(params, row.size, history)
        try:
            theirs = ref.probs(row)
        finally:
            ref.close()
        ours = TokenSampler(params.with_seed(0), history).probs(row)
        assert np.array_equal(np.flatnonzero(ours), np.flatnonzero(theirs)), \
            f"kept sets differ: ours {np.count_nonzero(ours)} vs llama.cpp {np.count_nonzero(theirs)}"
        np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=1e-9)


def test_penalties_change_the_distribution(rows):
    # guards the test above: with history the penalised chain must differ from the plain one
    history, row = rows[0]
    history = history + [int(np.argmax(row))]
    plain = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    pen = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.5)
    a = TokenSampler(plain.with_seed(0), history).probs(row)
    b = TokenSampler(pen.with_seed(0), history).probs(row)
    assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-3


def test_defaults_are_llama_cpp_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05)
    assert (p.repeat_penalty, p.frequency_penalty, p.presence_penalty, p.penalty_last_n) == (1.0, 0.0, 0.0, 64)
    assert not p.is_greedy and SamplingParams.greedy().is_greedy and SamplingParams(temperature=-1).is_greedy


@pytest.mark.parametrize("kw, err", [
    (dict(top_p=1.5), ValueError), (dict(top_p=-0.1), ValueError), (dict(min_p=2.0), ValueError),
    (dict(temperature=float("nan")), ValueError), (dict(temperature="hot"), TypeError),
    (dict(top_k=2.5), ValueError), (dict(repeat_penalty=0.0), ValueError), (dict(penalty_last_n=-2), ValueError),
    (dict(seed=-5), ValueError), (dict(seed=1.5), TypeError), (dict(top_k=True), TypeError),
])
def test_bad_parameters_raise(kw, err):
    with pytest.raises(err):
        SamplingParams(**kw)


def test_seeds():
    assert resolve_seed(42) == 42
    assert resolve_seed(None) != resolve_seed(None)
    assert resolve_seed(-1) != resolve_seed(0xFFFFFFFF)
    a, b = TokenSampler(SamplingParams(seed=5)), TokenSampler(SamplingParams(seed=5))
    assert [a.rng.random() for _ in range(3)] == [b.rng.random() for _ in range(3)]


def test_chain_refuses_greedy_and_garbage():
    with pytest.raises(ValueError):
        chain_probs(np.zeros(4, dtype=np.float32), SamplingParams.greedy())
    with pytest.raises(ValueError):
        chain_probs(np.zeros((2, 2), dtype=np.float32), SamplingParams())
    with pytest.raises(ValueError):
        chain_probs(np.full(4, -np.inf, dtype=np.float32), SamplingParams(top_k=0, top_p=1.0, min_p=0.0))
    with pytest.raises(TypeError):
        TokenSampler({"temperature": 1.0})


def test_banned_tokens_are_never_kept(rows):
    history, row = rows[0]
    top = np.argsort(row)[-3:]
    d = np.asarray(TokenSampler(SamplingParams(seed=0), history, banned=top).probs(row))
    assert d[top].sum() == 0.0 and abs(d.sum() - 1.0) < 1e-12
