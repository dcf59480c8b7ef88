"""DSparkDraftModel inside llama-cpp-python: ``Llama.create_*`` unchanged, lossless, draft KV in sync.

Reference: a plain ``Llama`` (same settings) at temperature 0.  The plug-in must give the same text
on 10 benchmark prompts (chat, streaming and not) while it really drafts; with a draft that gets
accepted (bigrams planted in its Markov head) the output is still the reference.  Feature capture
and KV sync are checked against our own engine: for the same tokens, the plug-in must propose
exactly what :class:`SpecDecoder` + :class:`DraftModelProposer` propose at every step (a random
draft's argmax is a sensitive function of every injected feature row), on a prompt spanning
several n_batch chunks, after draft rollbacks, after llama-cpp-python reused a prompt prefix and
after attaching to a Llama that had already decoded (re-derived features).
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

from integration_refs import (N_TOKENS, THREADS, chat_cases, content, greedy_chat, open_llama,
                              streamed_content)
from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.speculative.drafter import DraftModelProposer
from pyllama_dspark.errors import ClosedError, ModelFileError
from pyllama_dspark.integrations.llama_plugin import DSparkDraftModel
from pyllama_dspark.gguf.testing import make_test_draft, plant_markov_bigrams


@pytest.fixture(scope="module")
def cases(llama_refs):
    """(name, messages, plain greedy text from a fresh prefill) for 10 benchmark prompts (computed
    once per run)."""
    out = [(name, msgs, content(llama_refs.chat(msgs, N_TOKENS))) for name, msgs in chat_cases()]
    assert len(out) >= 10
    return out


@pytest.fixture()
def spec_llm(target_path, dspark_draft_path):
    llm = open_llama(target_path)
    # every block verified: these tests check what the speculative path emits, so it must run
    # whatever the default (auto) would choose for this random draft (that choice:
    # test_plugin_accepts_drafts_and_stays_lossless and test_auto_schedule); blocks of 3, as the
    # DSpark class's tests run them (test_integration_dspark's `ds`: why); the trace tests below
    # keep blocks of 7
    drafter = DSparkDraftModel(llm, dspark_draft_path, n_max=3, schedule="off")
    yield llm, drafter
    llm.close()


def test_plugin_chat_equals_plain_greedy(cases, target_path, spec_llm):
    """Same calls, same order, on a plain Llama and on one with the plug-in.  No reset between
    calls: llama-cpp-python reuses cached prompt prefixes in both, which changes its own greedy
    output slightly (a plain Llama asked the same prompt twice can answer differently), so the
    reference is the plain Llama in the same state, call for call."""
    llm, drafter = spec_llm
    plain = open_llama(target_path)
    assert llm.draft_model is drafter
    failures, n = [], 0
    try:
        # one prompt per benchmark file, then two streamed: one whose prompt is cached by now, one
        # new (the other half: the fresh-prompt test's)
        calls = ([(name, msgs, False) for name, msgs, _ in cases[::2]]
                 + [(name, msgs, True) for name, msgs, _ in cases[:2]])
        for name, msgs, stream in calls:
            if stream:   # llama-cpp-python's own stream chunking
                ref, _ = streamed_content(greedy_chat(plain, msgs, stream=True))
                got, chunks = streamed_content(greedy_chat(llm, msgs, stream=True))
                assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
            else:
                ref, got = content(greedy_chat(plain, msgs)), content(greedy_chat(llm, msgs))
            n += 1
            if got != ref:
                failures.append(f"{name}{' (stream)' if stream else ''}: {got!r} != {ref!r}")
    finally:
        plain.close()
    print(f"\nplug-in, {n} calls: {drafter.stats()}")
    assert drafter.n_drafted > 10 * len(calls), "the speculative path did not run"
    assert drafter.n_skipped == 0 and drafter.n_refilled == 0
    assert not failures, "\n".join(failures)


def test_plugin_fresh_prompts_equal_fresh_greedy(cases, spec_llm):
    llm, drafter = spec_llm
    for name, msgs, ref in cases[1::2]:   # one prompt per file (the other half: the test above)
        llm.reset()
        assert content(greedy_chat(llm, msgs)) == ref, name
    assert drafter.n_drafted > 0


def test_plugin_text_completion_stream_matches(target_path, spec_llm):
    llm, drafter = spec_llm
    plain = open_llama(target_path)
    try:
        for prompt, stop in [("The three primary colors are", []), ("def fibonacci(n):", ["\n\n"])]:
            kw = dict(max_tokens=N_TOKENS, temperature=0, stop=stop)
            plain.reset(), llm.reset()
            ref = plain.create_completion(prompt, **kw)
            got = llm.create_completion(prompt, **kw)
            llm.reset()
            chunks = list(llm.create_completion(prompt, stream=True, **kw))
            assert got["choices"][0]["text"] == ref["choices"][0]["text"]
            assert got["choices"][0]["finish_reason"] == ref["choices"][0]["finish_reason"]
            assert got["usage"] == ref["usage"]
            assert "".join(c["choices"][0]["text"] for c in chunks) == ref["choices"][0]["text"]
    finally:
        plain.close()


@pytest.fixture(scope="module")
def bigram_draft(target_path, cases, tmp_path_factory):
    """A DSpark draft whose Markov head proposes the reference continuations (real acceptances)."""
    path = tmp_path_factory.mktemp("plugin") / "bigram.gguf"
    make_test_draft(target_path, path, kind="dspark", markov_rank=256, seed=5)
    llm = open_llama(target_path)
    seqs = []
    for _, msgs, ref in cases[:3]:
        seqs.append(llm.tokenize(ref.encode("utf-8"), add_bos=False, special=False))
    llm.close()
    assert plant_markov_bigrams(path, seqs, drop_every=5) > 20
    return str(path)


def test_plugin_accepts_drafts_and_stays_lossless(cases, target_path, bigram_draft):
    llm = open_llama(target_path)
    try:
        drafter = DSparkDraftModel(llm, bigram_draft, n_max=7)
        for name, msgs, ref in cases[:3]:
            llm.reset()
            assert content(greedy_chat(llm, msgs)) == ref, name
        print(f"\nbigram draft: {drafter.stats()}")
        assert drafter.n_accepted > 10, "no draft was accepted: llama-cpp-python never took the fast path"
        assert drafter.n_accepted < drafter.n_drafted
    finally:
        llm.close()


# ---- features of every chunk, KV sync: the plug-in proposes what our engine proposes ------------

class _Recording(DraftModelProposer):
    """Our engine's proposer, recording (pos0, anchor, drafts) of every proposal."""

    def __init__(self, draft, skip_first_chunk_rows: int = 0):
        super().__init__(draft)
        self.trace, self.skip = [], skip_first_chunk_rows

    def observe(self, row0, n, pos0, seq_id=0):
        if pos0 == 0 and self.skip:   # a deliberately broken drafter: loses the first chunk
            return
        super().observe(row0, n, pos0, seq_id)

    def propose(self, anchor, pos0, n_draft, seq_id=0):
        p = super().propose(anchor, pos0, n_draft, seq_id)
        self.trace.append((pos0, int(anchor), tuple(int(t) for t in p.tokens)))
        return p


def _engine_trace(target_path, draft_path, prompt_tokens, n_batch, n_tokens, skip=0):
    # the fixed block, as the plug-in runs in the tests that compare with it: every chunk's rows
    # injected as the prefill decodes them (a cost-driven schedule defers the prompt's rows and
    # injects them in one batch at the first block), every block proposed
    with Speculator(target_path, draft_path, n_ctx=4096, n_batch=n_batch, n_ubatch=n_batch, flash_attn="on",
                    n_threads=THREADS, n_max=7, schedule="off") as sp:
        rec = _Recording(sp.draft, skip)
        sp.decoder.proposer = rec
        done = sp.generate(list(prompt_tokens), n_tokens)
    return rec.trace, done.tokens


def _chat_tokens(llm, msgs):
    """The prompt tokens Llama.create_chat_completion builds (its own chat handler, intercepted)."""
    from llama_cpp import llama_chat_format as lcf

    grabbed = []

    class _Grab:
        verbose = False

        def tokenize(self, b, add_bos=True, special=False):
            return llm.tokenize(b, add_bos=add_bos, special=special)

        def create_completion(self, prompt, **kw):
            grabbed.extend(prompt)
            return {"id": "x", "created": 0, "model": "m", "usage": {},
                    "choices": [{"text": "", "logprobs": None, "finish_reason": "stop"}]}

    handler = (llm.chat_handler or llm._chat_handlers.get(llm.chat_format)
               or lcf.get_chat_completion_handler(llm.chat_format))
    handler(llama=_Grab(), messages=msgs)
    return grabbed


def _trace_until(trace, n_tokens_generated, prompt_len):
    """The proposals our engine also makes: it drafts only while a draft can still be emitted
    (the anchor at pos0 is token pos0 - prompt_len + 1 of the output; at least one more must fit)."""
    return [t for t in trace if (t[0] - prompt_len + 1) + 1 < n_tokens_generated]


def test_features_of_every_n_batch_chunk(cases, target_path, dspark_draft_path):
    n_batch = 32
    name, msgs, _ = cases[0]
    llm = open_llama(target_path, n_batch=n_batch, n_ubatch=n_batch)
    try:
        prompt = _chat_tokens(llm, msgs)
        assert len(prompt) > 2 * n_batch, "the prompt must span several n_batch chunks"
        drafter = DSparkDraftModel(llm, dspark_draft_path, n_max=7, trace=True, schedule="off")
        out = llm.create_completion(prompt, max_tokens=N_TOKENS, temperature=0)
        n_out = out["usage"]["completion_tokens"]
        assert drafter.n_refilled == 0 and drafter.n_skipped == 0
        ours = _trace_until(drafter.trace, n_out, len(prompt))
    finally:
        llm.close()
    ref, ref_tokens = _engine_trace(target_path, dspark_draft_path, prompt, n_batch, N_TOKENS)
    broken, _ = _engine_trace(target_path, dspark_draft_path, prompt, n_batch, N_TOKENS, skip=1)
    assert len(ours) >= 5
    # the check can fail: a drafter that misses the first chunk proposes something else
    assert broken[: len(ours)] != ref[: len(ours)]
    assert ours == ref[: len(ours)]


def test_partial_acceptance_rollbacks_match_engine(cases, target_path, bigram_draft):
    """With accepted drafts, llama-cpp-python rolls back after 0..n_max-1 accepted tokens; the draft
    KV must follow each time: the proposals still equal our engine's, step for step."""
    n_batch = 32
    name, msgs, _ = cases[0]
    llm = open_llama(target_path, n_batch=n_batch, n_ubatch=n_batch)
    try:
        prompt = _chat_tokens(llm, msgs)
        drafter = DSparkDraftModel(llm, bigram_draft, n_max=7, trace=True, schedule="off")
        out = llm.create_completion(prompt, max_tokens=N_TOKENS, temperature=0)
        ours = _trace_until(drafter.trace, out["usage"]["completion_tokens"], len(prompt))
    finally:
        llm.close()
    ref, _ = _engine_trace(target_path, bigram_draft, prompt, n_batch, N_TOKENS)
    steps = {b[0] - a[0] - 1 for a, b in zip(ours, ours[1:])}     # accepted drafts per cycle
    assert len(steps - {0, 7}) >= 1, f"no partial acceptance happened: {sorted(steps)}"
    assert ours == ref[: len(ours)]


def test_prefix_reuse_and_refill_keep_the_draft_in_sync(cases, target_path, dspark_draft_path):
    n_batch = 32
    name, msgs, _ = cases[1]
    llm = open_llama(target_path, n_batch=n_batch, n_ubatch=n_batch)
    try:
        base = _chat_tokens(llm, msgs)
        longer = base + llm.tokenize(b" Please answer briefly.", add_bos=False)
        # the Llama decodes before the drafter exists: its first call must re-derive the features
        llm.create_completion(base, max_tokens=4, temperature=0)
        drafter = DSparkDraftModel(llm, dspark_draft_path, n_max=7, trace=True, schedule="off")
        llm.create_completion(base, max_tokens=N_TOKENS, temperature=0)
        assert drafter.n_refilled > 0
        first = list(drafter.trace)
        # llama-cpp-python now reuses the cached prefix of `base` and evaluates only the rest
        drafter.trace.clear()
        refilled = drafter.n_refilled
        out = llm.create_completion(longer, max_tokens=N_TOKENS, temperature=0)
        assert drafter.n_refilled == refilled, "prefix reuse must be mirrored, not re-derived"
        second = _trace_until(drafter.trace, out["usage"]["completion_tokens"], len(longer))
    finally:
        llm.close()
    ref_first, _ = _engine_trace(target_path, dspark_draft_path, base, n_batch, N_TOKENS)
    ref_second, _ = _engine_trace(target_path, dspark_draft_path, longer, n_batch, N_TOKENS)
    assert first[:5] == ref_first[:5]
    # positions and anchors (the target's greedy) all equal; the blocks drafted from them equal but
    # for the draft's own near-ties under other batch shapes (one block in 30 differed in its first
    # draft on an AVX2-only CPU): a draft out of sync (features missing or misplaced) changes
    # nearly every block
    assert len(second) >= 5 and [e[:2] for e in second] == [e[:2] for e in ref_second[: len(second)]]
    assert sum(a == b for a, b in zip(second, ref_second)) >= 0.9 * len(second)


# ---- T > 0: llama-cpp-python samples every row itself, so a seeded run is sample-identical ------

def test_seeded_sampling_equals_plain_llama(cases, target_path, spec_llm):
    llm, _ = spec_llm
    plain = open_llama(target_path)
    try:
        for name, msgs, _ in cases[:2]:
            kw = dict(temperature=0.9, top_k=40, top_p=0.95, seed=1234, max_tokens=N_TOKENS)
            assert content(llm.create_chat_completion(msgs, **kw)) == content(plain.create_chat_completion(msgs, **kw))
    finally:
        plain.close()


# ---- lifetime and bad input ----------------------------------------------------------------------

def test_close_detaches_and_frees(target_path, dspark_draft_path):
    llm = open_llama(target_path)
    try:
        before = llm.create_completion("Hello", max_tokens=6, temperature=0)["choices"][0]["text"]
        drafter = DSparkDraftModel(llm, dspark_draft_path)
        draft = drafter.draft
        assert llm.create_completion("Hello", max_tokens=6, temperature=0)["choices"][0]["text"] == before
        drafter.close()
        drafter.close()  # idempotent
        assert llm.draft_model is None and "decode" not in vars(llm._ctx)
        assert draft.ctx is None and drafter.target.handle is None
        with pytest.raises(ClosedError):
            drafter(np.array([1, 2, 3], dtype=np.intc))
        assert llm.create_completion("Hello", max_tokens=6, temperature=0)["choices"][0]["text"] == before
        # a new drafter can be attached after the old one is closed
        DSparkDraftModel(llm, dspark_draft_path).close()
    finally:
        llm.close()


def test_closing_the_llama_closes_the_drafter_first(target_path, dspark_draft_path):
    llm = open_llama(target_path)
    drafter = DSparkDraftModel(llm, dspark_draft_path)
    llm.create_completion("Hi", max_tokens=3, temperature=0)
    llm.close()
    assert drafter.draft.ctx is None and drafter.target.ctx is None
    with pytest.raises(ClosedError):
        drafter(np.array([1, 2], dtype=np.intc))
    del llm
    gc.collect()


def test_bad_input(target_path, dspark_draft_path, tmp_path):
    llm = open_llama(target_path)
    try:
        with pytest.raises(TypeError):
            DSparkDraftModel(object(), dspark_draft_path)
        with pytest.raises(ModelFileError):
            DSparkDraftModel(llm, str(tmp_path / "missing.gguf"))
        with pytest.raises(ValueError):
            DSparkDraftModel(llm, dspark_draft_path, n_max=0)
        d = DSparkDraftModel(llm, dspark_draft_path)
        with pytest.raises(ValueError, match="already has a DSpark"):
            DSparkDraftModel(llm, dspark_draft_path)
        d.close()
    finally:
        llm.close()
    with pytest.raises(ClosedError):
        DSparkDraftModel(llm, dspark_draft_path)
