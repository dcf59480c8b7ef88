"""Targeted cycle scenarios on the real target, driven by the oracle proposer.

Each test states the situation it forces (full blocks + bonus, rejection at every block position,
EOS inside an accepted block, max_tokens inside a block, stop strings) and checks both that the
situation happened and that the output is still the target's greedy output.
"""

from __future__ import annotations

import numpy as np
import pytest

from greedy_ref import greedy, open_llama, TEST_THREADS
from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.speculative.drafter import NoDraft
from pyllama_dspark.speculative.oracle import OracleProposer
from pyllama_dspark.speculative.verify import greedy_accept, greedy_emitted

THREADS = TEST_THREADS


# ---- the pure accept rule ----------------------------------------------------------------------

@pytest.mark.parametrize("drafted, target, n_acc", [
    ([], [5], 0),
    ([5, 6, 7], [5, 6, 7, 8], 3),          # full block, bonus 8
    ([5, 6, 7], [5, 9, 7, 8], 1),          # mismatch at 1
    ([5, 6, 7], [4, 6, 7, 8], 0),          # mismatch at 0: only the target's token
    ([1, 1, 1, 1], [1, 1, 1, 2, 3], 3),
])
def test_greedy_accept(drafted, target, n_acc):
    d, t = np.array(drafted, dtype=np.int32), np.array(target, dtype=np.int32)
    assert greedy_accept(d, t) == n_acc
    assert greedy_emitted(d, t).tolist() == target[: n_acc + 1]


def test_greedy_accept_eog_rule():
    # llama.cpp: an accepted EOG draft that is not the last draft ends acceptance (not counted);
    # a trailing EOG draft is accepted
    eog = np.zeros(10, dtype=bool)
    eog[2] = True
    t = np.array([5, 2, 7, 8], dtype=np.int32)
    assert greedy_accept(np.array([5, 2, 7], dtype=np.int32), t, eog) == 1
    assert greedy_emitted(np.array([5, 2, 7], dtype=np.int32), t, eog).tolist() == [5, 2]
    assert greedy_accept(np.array([5, 7, 2], dtype=np.int32), np.array([5, 7, 2, 8]), eog) == 3
    assert greedy_accept(np.array([2, 7], dtype=np.int32), np.array([2, 7, 8]), eog) == 0
    assert greedy_accept(np.array([2, 7], dtype=np.int32), np.array([2, 7, 8]), None) == 2


def test_greedy_accept_needs_enough_rows():
    with pytest.raises(ValueError):
        greedy_accept(np.array([1, 2]), np.array([1, 2]))


# ---- scenarios -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sp(target_path):
    with Speculator(target_path, n_threads=THREADS) as s:
        yield s


@pytest.fixture(scope="module")
def llm(target_path):
    m = open_llama(target_path)
    yield m
    m.close()


def _prompt(sp, text):
    return sp.chat_prompt([{"role": "user", "content": text}]).tokens


def _run(sp, prompt, ref, max_tokens, **oracle_kw):
    sp.decoder.proposer = OracleProposer(list(prompt) + list(ref), sp.target.n_vocab, **oracle_kw)
    try:
        return sp.generate(prompt, max_tokens), sp.decoder.proposer
    finally:
        sp.decoder.proposer = NoDraft()


def test_full_blocks_with_bonus(sp, llm):
    prompt = _prompt(sp, "Write a short paragraph about the history of the bicycle.")
    ref = greedy(llm, prompt, 64)
    done, _ = _run(sp, prompt, ref, 64, error_at=[None])
    assert done.tokens == ref
    s = done.stats
    # every full block emits 7 drafts + the bonus: 8 tokens per cycle until the end is near
    assert s.accepted == s.drafted
    assert s.tau > 6.0, s.summary()
    assert s.accept_per_position == [1.0] * 7


def test_rejection_at_every_position(sp, llm):
    prompt = _prompt(sp, "List five fruits and describe each in one sentence.")
    ref = greedy(llm, prompt, 96)
    done, oracle = _run(sp, prompt, ref, 96, error_at=[0, 1, 2, 3, 4, 5, 6])
    assert done.tokens == ref
    s = done.stats
    # a planted error at index e accepts exactly e tokens, so each position gets rejected somewhere
    assert {e for _, e in oracle.planted} == set(range(7))
    assert all(0.0 < a < 1.0 for a in s.accept_per_position[:6]), s.accept_per_position
    assert s.accepted < s.drafted


def test_eos_inside_an_accepted_block(sp, llm):
    prompt = _prompt(sp, "What is 2+2? Answer with just the number.")
    ref = greedy(llm, prompt, 64)
    assert sp.target.is_eog(ref[-1]) and len(ref) < 20, "needs a short answer that ends with EOS"
    done, _ = _run(sp, prompt, ref, 64, error_at=[None])
    assert done.tokens == ref
    assert done.finish_reason == "stop"
    # the oracle proposes past the EOS: EOS arrived among accepted tokens, not as a lone token
    assert done.stats.accepted >= 1 and done.stats.cycles <= (len(ref) + 7) // 8 + 1


@pytest.mark.parametrize("max_tokens", [1, 2, 8, 9, 10, 15])
def test_max_tokens_inside_a_block(sp, llm, max_tokens):
    prompt = _prompt(sp, "Explain what a hash table is.")
    ref = greedy(llm, prompt, 40)
    done, _ = _run(sp, prompt, ref, max_tokens, error_at=[None])
    assert done.tokens == ref[:max_tokens]
    assert done.finish_reason == "length"
    assert done.stats.n_generated == max_tokens


def test_stop_string_cuts_text(sp, llm):
    prompt = _prompt(sp, "Write two sentences about the sea.")
    ref = greedy(llm, prompt, 60)
    full = sp.target.detokenize(ref).decode("utf-8", "replace")
    k = len(full) // 2
    word = full[k:k + 4]  # a stop string that occurs mid-generation, inside some block
    sp.decoder.proposer = OracleProposer(list(prompt) + ref, sp.target.n_vocab, p_error=0.3)
    try:
        chunks, done = [], None
        for ev in sp.stream(prompt, 60, stop=[word]):
            if hasattr(ev, "finish_reason"):
                done = ev
            else:
                chunks.append(ev.text)
    finally:
        sp.decoder.proposer = NoDraft()
    assert done.finish_reason == "stop"
    assert done.text == full[: full.index(word)]
    assert "".join(chunks) == done.text  # streamed text never shows any part of the stop string
