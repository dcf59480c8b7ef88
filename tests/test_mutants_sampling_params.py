"""Mutation-score tests for speculative/sampling_params.py: llama.cpp's defaults and every check, by hand."""

import numpy as np
import pytest

from pyllama_dspark.speculative.sampling_params import LLAMA_DEFAULT_SEED, SamplingParams, resolve_seed


def test_llama_cpp_defaults_and_helpers():
    sp = SamplingParams()
    assert sp.as_dict() == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": None,
                            "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                            "penalty_last_n": 64, "penalize_prompt": True}
    assert LLAMA_DEFAULT_SEED == 4294967295
    assert SamplingParams.greedy().temperature == 0.0 and SamplingParams.greedy().top_k == 40
    assert SamplingParams(temperature=0.0).is_greedy and SamplingParams(temperature=-1.0).is_greedy
    assert not SamplingParams(temperature=1e-6).is_greedy and not sp.is_greedy
    assert sp.with_seed(7).seed == 7 and sp.with_seed(7).top_k == 40 and sp.seed is None
    assert not sp.has_penalties
    assert SamplingParams(repeat_penalty=1.1).has_penalties
    assert SamplingParams(frequency_penalty=0.1).has_penalties
    assert SamplingParams(presence_penalty=-0.1).has_penalties
    assert SamplingParams(repeat_penalty=1.1, penalty_last_n=-1).has_penalties
    assert not SamplingParams(repeat_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5,
                              penalty_last_n=0).has_penalties


def test_accepted_edges():
    for kw in [dict(top_p=0.0), dict(top_p=1.0), dict(min_p=0.0), dict(min_p=1.0), dict(repeat_penalty=1e-9),
               dict(penalty_last_n=-1), dict(penalty_last_n=0), dict(seed=-1), dict(seed=0), dict(seed=np.int64(5)),
               dict(top_k=np.int32(3)), dict(top_k=2.0), dict(temperature=np.float32(0.5)),
               dict(penalize_prompt=np.bool_(False)), dict(penalize_prompt=False), dict(top_k=0), dict(top_k=-1)]:
        SamplingParams(**kw)


@pytest.mark.parametrize("kw,exc,msg", [
    (dict(temperature="0.8"), TypeError, r"sampling parameter temperature must be a number, got '0.8'"),
    (dict(top_p=True), TypeError, r"sampling parameter top_p must be a number, got True"),
    (dict(min_p=None), TypeError, r"sampling parameter min_p must be a number"),
    (dict(repeat_penalty=[1.0]), TypeError, r"sampling parameter repeat_penalty must be a number"),
    (dict(presence_penalty=float("nan")), ValueError, r"sampling parameter presence_penalty must be finite, got nan"),
    (dict(frequency_penalty=float("inf")), ValueError, r"sampling parameter frequency_penalty must be finite"),
    (dict(top_k=1.5), ValueError, r"sampling parameter top_k must be an integer, got 1.5"),
    (dict(top_k=False), TypeError, r"sampling parameter top_k must be a number"),
    (dict(penalty_last_n=2.5), ValueError, r"sampling parameter penalty_last_n must be an integer"),
    (dict(top_p=1.0001), ValueError, r"top_p must be in \[0, 1\], got 1.0001"),
    (dict(top_p=-0.1), ValueError, r"top_p must be in \[0, 1\], got -0.1"),
    (dict(min_p=1.5), ValueError, r"min_p must be in \[0, 1\], got 1.5"),
    (dict(min_p=-1e-9), ValueError, r"min_p must be in \[0, 1\]"),
    (dict(repeat_penalty=0.0), ValueError, r"repeat_penalty must be > 0 \(1.0 = off\), got 0.0"),
    (dict(repeat_penalty=-1.0), ValueError, r"repeat_penalty must be > 0"),
    (dict(penalize_prompt=1), TypeError, r"penalize_prompt must be a bool, got 1"),
    (dict(penalty_last_n=-2), ValueError,
     r"penalty_last_n must be >= -1 \(-1 = whole sequence, 0 = off\), got -2"),
    (dict(seed=True), TypeError, r"seed must be an integer or None, got True"),
    (dict(seed=1.0), TypeError, r"seed must be an integer or None, got 1.0"),
    (dict(seed=-2), ValueError, r"seed must be >= 0 \(or -1 / None for a random seed\), got -2"),
])
def test_rejected(kw, exc, msg):
    with pytest.raises(exc, match=f"^{msg}"):
        SamplingParams(**kw)


def test_resolve_seed():
    assert resolve_seed(0) == 0 and resolve_seed(12345) == 12345 and resolve_seed(np.int64(9)) == 9
    assert type(resolve_seed(np.int64(9))) is int
    assert resolve_seed(LLAMA_DEFAULT_SEED - 1) == LLAMA_DEFAULT_SEED - 1
    for s in (None, -1, LLAMA_DEFAULT_SEED):
        draws = {resolve_seed(s) for _ in range(4)}
        assert len(draws) == 4 and all(isinstance(x, int) and 0 <= x < (1 << 63) for x in draws)
