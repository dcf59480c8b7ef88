"""Greedy read-out on the device (llama.cpp's backend sampling, ``backend_sampling="on"``; the
default on a GPU): the verify argmax and the drafted ids come back as each row's top two, with no
logits row copied, and the output stays the target's own greedy output.

On a CPU the same code runs on ggml's CPU backend.  References: ``llama_cpp.Llama`` greedy (the
session's ``llama_refs``) and, for the read-out itself, the full logits row of the same tokens
through ``Llama`` (argmax and top-2 gap).  Requests that need the full row (T > 0, log-probs)
detach their sequence's chain and keep their law."""

from __future__ import annotations

import numpy as np
import pytest
from llama_cpp import llama_cpp as ll

from greedy_ref import TEST_THREADS, explain_mismatch
from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.decode.loop import Decoder
from pyllama_dspark.gguf.testing import make_test_draft, plant_markov_bigrams
from pyllama_dspark.llama.handles import ContextSettings, Target
from pyllama_dspark.speculative.sampling import SamplingParams

N = 48
TIE_EPS = 1e-3
PROMPTS = ["Write a haiku about rain.", "List three prime numbers and explain why they are prime.",
           "What is the capital of France? Answer in one sentence."]


@pytest.fixture(scope="module")
def cases(target_path, llama_refs):
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
    prompts = [llama_refs.chat_tokens(m) for m in msgs]
    return [(p, llama_refs.greedy(p, N)) for p in prompts]


@pytest.fixture(scope="module")
def bigram_draft(target_path, cases, tmp_path_factory):
    """A random DSpark draft whose Markov head proposes the target's continuations (real accepts)."""
    path = tmp_path_factory.mktemp("bs") / "bigram.gguf"
    make_test_draft(target_path, path, kind="dspark", markov_rank=256, seed=3)
    assert plant_markov_bigrams(path, [list(p[-1:]) + list(r) for p, r in cases], drop_every=5) > 20
    return str(path)


def test_greedy_with_device_readout_is_the_targets_greedy(target_path, bigram_draft, cases, llama_refs):
    failures, drafted, accepted = [], 0, 0
    with Speculator(target_path, bigram_draft, n_threads=TEST_THREADS, n_max=7, schedule="off",
                    backend_sampling="on") as sp:
        for prompt, ref in cases:
            done = sp.generate(prompt, N)
            drafted += done.stats.drafted
            accepted += done.stats.accepted
            if done.tokens != ref:
                failures.append(explain_mismatch(llama_refs.llm, prompt, done.tokens, ref, TIE_EPS))
            # the read-out really was the device's: both contexts hold a top-2 chain on sequence 0
            assert sp.target.samplers.has(0) and sp.proposer.draft.samplers.has(0)
        assert sp.target.samplers.n_changes == 1 and sp.proposer.draft.samplers.n_changes == 1
    assert not failures, "\n".join(failures)
    assert drafted > 50 and accepted > 10, (drafted, accepted)


def test_device_top2_is_the_rows_argmax_and_gap(target_path, cases, llama_refs):
    """The read-out of a multi-row decode against the full logits rows of the same tokens."""
    prompt, ref = cases[1]
    toks = np.asarray(list(prompt) + list(ref[:7]), dtype=np.int32)
    n0 = len(prompt) - 1
    s = ContextSettings(n_ctx=1024, n_threads=TEST_THREADS, backend_sampling="on")
    with Target(target_path, s) as t:
        assert t.samplers.want(0, True)
        t.decode(toks[:n0], 0, all_outputs=False)
        rows = len(toks) - n0
        t.decode(toks[n0:], n0)                       # 8 output rows, all with the sequence's sampler
        ids, margin = np.zeros(rows, dtype=np.int32), np.zeros(rows, dtype=np.float32)
        t.argmax(0, rows, ids, margin)
    llm = llama_refs.llm
    for i in range(rows):
        best, second, gap = llama_refs.top2(toks[:n0 + i + 1])
        assert ids[i] == best or gap < TIE_EPS, (i, ids[i], best, gap)
        assert abs(float(margin[i]) - gap) < 2e-2 + 1e-2 * gap, (i, margin[i], gap)
    assert llm is not None


def test_full_rows_come_back_only_for_requests_that_need_them(target_path, bigram_draft, cases, llama_refs):
    """Two sequences in one decoder: a greedy request (device read-out) beside a sampled one (its
    sequence's chain detached, its rows read in full): the sampled tokens are those of the same
    request run with backend sampling off, the greedy ones the target's own."""
    (p_greedy, ref), (p_sampled, _) = cases[0], cases[2]
    sp = SamplingParams(temperature=0.8, seed=1234)
    outs = {}
    for mode in ("off", "on"):
        s = ContextSettings(n_ctx=2048, n_seq_max=2, n_threads=TEST_THREADS, backend_sampling=mode)
        from pyllama_dspark.llama.models import open_models

        t, d, _ = open_models(target_path, bigram_draft, s)
        with t:
            dec = Decoder(t, d, n_max=7)
            a = dec.submit(p_greedy, N)
            b = dec.submit(p_sampled, N, sampling=sp)
            while dec.pending():
                dec.step()
            outs[mode] = (dec.result(a).tokens, dec.result(b).tokens)
            if mode == "on":
                held = [seq for seq in (0, 1) if t.samplers.has(seq)]
                assert len(held) == 1   # the greedy request's sequence only
    assert outs["on"][0] == ref[:len(outs["on"][0])] or \
        "NEAR-TIE" in explain_mismatch(llama_refs.llm, p_greedy, outs["on"][0], ref, TIE_EPS)
    assert outs["on"][1] == outs["off"][1]


def test_one_slot_switches_between_request_kinds(target_path, bigram_draft, cases, llama_refs):
    """Greedy, then log-probs, then T > 0, then greedy again on the same slot: each gets what it
    needs (the chain attached and detached only when the kind changes)."""
    prompt, ref = cases[0]
    with Speculator(target_path, bigram_draft, n_threads=TEST_THREADS, n_max=7, schedule="off",
                    backend_sampling="on") as sp:
        g1 = sp.generate(prompt, 24)
        lp = sp.generate(prompt, 24, n_probs=2)
        smp = sp.generate(prompt, 24, sampling=SamplingParams(temperature=0.8, seed=7))
        g2 = sp.generate(prompt, 24)
        changes = sp.target.samplers.n_changes
    assert g1.tokens == ref[:24] and g2.tokens == ref[:24] and lp.tokens == ref[:24]
    # the log-probs came from the full rows: the greedy token is the most probable one
    assert len(lp.probs) == 24 and all(p.top and p.prob >= max(q for _, q in p.top) - 1e-9 for p in lp.probs)
    assert len(smp.tokens) == 24
    assert changes == 3   # on (g1), off (log-probs), stays off (T > 0), on (g2)


def test_off_and_cpu_default_attach_nothing(target_path):
    with Target(target_path, ContextSettings(n_ctx=256, n_threads=TEST_THREADS)) as t:
        if not t.settings.offloaded:
            assert not t.settings.device_readout
        assert not t.samplers.want(0, True) or t.settings.device_readout
    with Target(target_path, ContextSettings(n_ctx=256, n_threads=TEST_THREADS, backend_sampling="off")) as t:
        assert not t.samplers.want(0, True) and not t.samplers.has(0)
    with pytest.raises(ValueError, match="backend_sampling"):
        ContextSettings(backend_sampling="maybe").validate()
    assert ll.llama_get_sampled_token_ith is not None


def test_argmax_readout_is_lossless_too(target_path, bigram_draft, cases, llama_refs, monkeypatch):
    """``PYLLAMA_DSPARK_DEVICE_READOUT=argmax``: llama.cpp's greedy sampler on the device (the token
    only, no gap: no near-tie can be counted)."""
    monkeypatch.setenv("PYLLAMA_DSPARK_DEVICE_READOUT", "argmax")
    prompt, ref = cases[2]
    with Speculator(target_path, bigram_draft, n_threads=TEST_THREADS, n_max=7, schedule="off",
                    backend_sampling="on") as sp:
        assert sp.target.samplers.kind == "argmax"
        done = sp.generate(prompt, N)
    assert done.tokens == ref, explain_mismatch(llama_refs.llm, prompt, done.tokens, ref, TIE_EPS)
    assert done.stats.near_ties == 0 and done.stats.drafted > 0
    monkeypatch.setenv("PYLLAMA_DSPARK_DEVICE_READOUT", "fastest")
    with pytest.raises(ValueError, match="DEVICE_READOUT"):
        Target(target_path, ContextSettings(n_ctx=256, n_threads=TEST_THREADS, backend_sampling="on"))
