"""Mutation-score tests for the accept / roll back block of decode/loop.py (Decoder.step): the
sampled path (T > 0 with top_k = 1, where the sampler chain is one-hot at the target's token) must
emit exactly llama-cpp-python's greedy tokens, and a planted draft error at block index e accepts
exactly min(e, k) drafts of a block of k (the law of both accept rules), whatever rolled back."""

from __future__ import annotations

import time

import pytest

from greedy_ref import TEST_THREADS, greedy, open_llama
from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.speculative.drafter import NoDraft
from pyllama_dspark.speculative.oracle import OracleProposer
from pyllama_dspark.speculative.policy import VerifyPolicy
from pyllama_dspark.speculative.sampling_params import SamplingParams
from pyllama_dspark.speculative.schedule import CostModel


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


class _Recorder(OracleProposer):
    """The oracle, recording what the loop tells a proposer (a real drafter's memory follows these)."""

    def __init__(self, *a, **kw):
        self.calls = []
        super().__init__(*a, **kw)

    def observe(self, row0, n, pos0, seq_id=0):
        self.calls.append(("observe", row0, n, pos0, seq_id))

    def observe_later(self, row0, n, pos0, seq_id=0):
        self.calls.append(("later", row0, n, pos0, seq_id))

    def rollback(self, p0, seq_id=0):
        self.calls.append(("rollback", p0, seq_id))


def _expected_calls(p0, ks, accs, seq=0):
    """By hand: a cycle at anchor position p with k drafts shows the proposer its k + 1 verify rows
    (row 0 on: one request), or its one row later when it drafted nothing; a rejection at n_acc < k
    drops positions p + n_acc + 1 on; the next anchor sits at p + n_acc + 1."""
    out, p = [], p0
    for k, a in zip(ks, accs):
        out.append(("observe", 0, k + 1, p, seq) if k else ("later", 0, 1, p, seq))
        if a < k:
            out.append(("rollback", p + a + 1, seq))
        p += a + 1
    return out


@pytest.mark.parametrize("sampled", [False, True])
def test_proposer_memory_ties_records_and_probs(sp, prompt_ref, sampled):
    """12 tokens, errors at [1, None]: cycles of 2 and 8 tokens, then one left (a cycle without
    drafts).  Checks the proposer's observe / observe_later / rollback calls, near_ties with
    tie_eps = inf (every verified row counts), decoder.records (only when record is on), and
    n_probs (each token's pre-sampling probability: with top_k = 1 / greedy, the largest)."""
    prompt, ref = prompt_ref
    sampling = SamplingParams(temperature=0.9, top_k=1, seed=3) if sampled else None
    loop = sp.decoder.loop   # the Decoder under the Speculator
    rec = _Recorder(list(prompt) + list(ref), sp.target.n_vocab, error_at=[1, None])
    sp.decoder.proposer = rec
    tie_eps, loop.tie_eps, loop.record, loop.records = loop.tie_eps, float("inf"), not sampled, []
    try:
        done = sp.generate(prompt, 12, sampling=sampling, n_probs=2)
    finally:
        sp.decoder.proposer, loop.tie_eps, loop.record = NoDraft(), tie_eps, False
    records, loop.records = loop.records, []
    s = done.stats
    ks, accs = s.verify_lengths, s.cycle_accepted
    assert done.tokens == ref[:12] and done.finish_reason == "length"
    assert 0 in ks and any(a < k for k, a in zip(ks, accs)), (ks, accs)
    exp = _expected_calls(len(prompt), ks, accs)
    assert rec.calls[-len(exp):] == exp
    assert 1 + sum(a + 1 for a in accs) == 12
    if not sampled:
        assert s.near_ties == sum(a + 1 for a in accs)
        assert [(r[1], r[2]) for r in records] == [(k, a) for k, a in zip(ks, accs) if k]
        assert all(len(r[0]) >= r[1] for r in records)
    else:
        assert records == []
    assert len(done.probs) == 12
    for t, p in zip(done.tokens, done.probs):
        assert p.id == t and len(p.top) == 2 and 0.0 < p.prob <= 1.0
        assert p.prob == pytest.approx(max(v for _, v in p.top))


@pytest.fixture(scope="module")
def eos_ref(sp, target_path):
    prompt = sp.chat_prompt([{"role": "user", "content": "What is 2+2? Answer with just the number."}]).tokens
    llm = open_llama(target_path)
    try:
        return prompt, greedy(llm, prompt, 64)
    finally:
        llm.close()


def test_eos_inside_a_block_is_not_counted_accepted(sp, eos_ref):
    """llama.cpp's rule: an accepted EOS that is not the block's last draft ends acceptance there
    and is emitted as the target's token, so every token is the prefill's or one of a cycle's
    n_acc + 1 (an EOS accepted as a draft would count one token more than was emitted).  The
    reference is 8 tokens: an error at 3 in the first block puts the EOS at draft 2 of the second."""
    prompt, ref = eos_ref
    assert sp.target.is_eog(ref[-1]) and len(ref) == 8, "written for an 8-token answer that ends with EOS"
    done, _ = _gen(sp, prompt, ref, 64, [3, None])
    assert done.tokens == ref and done.finish_reason == "stop"
    assert 1 + sum(a + 1 for a in done.stats.cycle_accepted) == len(ref)


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



class _CatchingUp(OracleProposer):
    """The oracle, saying that each pass spent 25 ms folding in rows kept from plain cycles (it
    sleeps 30 ms, so the pass the loop times is at least that)."""

    def __init__(self, *a, **kw):
        self.caught = 0.0
        super().__init__(*a, **kw)

    def catch_up_ms(self):
        return self.caught

    def propose_batch(self, requests):
        time.sleep(0.03)
        self.caught += 25.0
        return super().propose_batch(requests)


def test_the_loop_tells_the_policy_what_a_pass_spent_catching_up(sp, prompt_ref, monkeypatch):
    """The draft pass the policy learns from is timed around the proposer, and what the proposer
    spent in it folding in rows decoded plain (a switch's cost, not a pass's) is passed apart:
    exactly this pass's share of the proposer's running total."""
    prompt, ref = prompt_ref
    loop = sp.decoder.loop
    pol = loop._policy or loop._fixed
    seen = []
    monkeypatch.setattr(pol, "observe_draft", lambda r, ms, n=None, caught_ms=0.0: seen.append((ms, caught_ms)))
    sp.decoder.proposer = _CatchingUp(list(prompt) + list(ref), sp.target.n_vocab, error_at=[None])
    try:
        sp.generate(prompt, 12)
    finally:
        sp.decoder.proposer = NoDraft()
    assert seen and all(c == 25.0 and ms >= 30.0 for ms, c in seen)


def test_the_loop_shows_the_policy_a_probe_whole(sp, prompt_ref, monkeypatch):
    """What a probe loses is measured over what the loop reports of its cycle, in its order: the
    pass as timed (the rows it caught up included: a probe pays them), the tokens the request
    emitted, then the cycle; loss = pass + cycle - tokens x plain ms a token (t(1) = 10 here)."""
    prompt, ref = prompt_ref
    loop = sp.decoder.loop
    pol = VerifyPolicy(mode="auto", cost=CostModel([10.0] + [1000.0] * 15, [1.0]), probe_every=1)
    pol._draft_ms, pol._restored_draft = {1: 1.0}, True   # as if from the memory: no pass forced to learn
    pol._skipped = 10 ** 9                                # the first cycle is a probe, then none for long
    seen = []
    for name in ("observe_draft", "update", "observe_cycle"):
        orig = getattr(pol, name)
        monkeypatch.setattr(pol, name, lambda *a, _o=orig, _n=name, **kw: (seen.append((_n, a, kw)), _o(*a, **kw))[1])
    monkeypatch.setattr(loop, "_policy", pol)
    sp.decoder.proposer = _CatchingUp(list(prompt) + list(ref), sp.target.n_vocab, error_at=[None])
    try:
        sp.generate(prompt, 12)
    finally:
        sp.decoder.proposer = NoDraft()
    (d, (_, ms, _n), kw), (u, (k, n_acc, _c), _), (c, (r, rows, cycle), _) = seen[:3]
    assert (d, u, c) == ("observe_draft", "update", "observe_cycle") and kw["caught_ms"] == 25.0 and ms >= 30.0
    assert k > 0 and rows == k + 1 and r == 1
    assert pol._probe_ms == {True: (pytest.approx(ms + cycle - (n_acc + 1) * 10.0), 1)}
