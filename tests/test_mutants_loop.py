"""Mutation-score tests for the accept / roll back block of decode/loop.py (Decoder.step): the
sampled path (T > 0 with top_k = 1, where the sampler chain is one-hot at the target's token) must
emit exactly llama-cpp-python's greedy tokens, and a planted draft error at block index e accepts
exactly min(e, k) drafts of a block of k (the law of both accept rules), whatever rolled back."""

from __future__ import annotations

import pytest

from greedy_ref import TEST_THREADS, greedy, open_llama
from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.spec.drafter import NoDraft
from pyllama_dspark.spec.oracle import OracleProposer
from pyllama_dspark.spec.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def sp(target_path):
    with Speculator(target_path, n_threads=TEST_THREADS) as s:
        yield s


@pytest.fixture(scope="module")
def prompt_ref(sp, target_path):
    prompt = sp.chat_prompt([{"role": "user", "content": "Name three rivers and one fact about each."}]).tokens
    llm = open_llama(target_path)
    try:
        return prompt, greedy(llm, prompt, 40)
    finally:
        llm.close()


def _gen(sp, prompt, ref, n, error_at, sampling=None, stop=()):
    sp.decoder.proposer = OracleProposer(list(prompt) + list(ref), sp.target.n_vocab, error_at=error_at)
    try:
        return sp.generate(prompt, n, sampling=sampling, stop=stop), sp.decoder.proposer
    finally:
        sp.decoder.proposer = NoDraft()


@pytest.mark.parametrize("sampled", [False, True])
def test_planted_errors_accept_exactly_their_index(sp, prompt_ref, sampled):
    prompt, ref = prompt_ref
    sampling = SamplingParams(temperature=0.9, top_k=1, seed=3) if sampled else None
    done, oracle = _gen(sp, prompt, ref, 40, [2, 0, 6, None, 4], sampling)
    assert done.tokens == ref
    s = done.stats
    planned = [2, 0, 6, None, 4]
    for i, (k, acc) in enumerate(zip(s.verify_lengths, s.cycle_accepted)):
        e = planned[i % len(planned)]
        assert acc == (k if e is None else min(e, k)), (i, k, acc, e)
    # the prefill emits the first token, then each cycle its accepted drafts plus one token
    assert 1 + sum(a + 1 for a in s.cycle_accepted) == len(ref) == s.n_generated
    assert s.drafted == sum(s.verify_lengths) and s.accepted == sum(s.cycle_accepted)
    if sampled:
        assert s.ms_sample > 0.0 and s.seed == 3
    else:
        assert s.ms_sample == 0.0


def test_sampled_rejections_then_max_tokens_inside_a_block(sp, prompt_ref):
    prompt, ref = prompt_ref
    sampling = SamplingParams(temperature=0.5, top_k=1, seed=0)
    done, _ = _gen(sp, prompt, ref, 13, [1], sampling)
    assert done.tokens == ref[:13] and done.finish_reason == "length"
    assert done.stats.cycle_accepted[:-1] == [1] * (len(done.stats.cycle_accepted) - 1)
