"""The ``DSpark`` class: llama-cpp-python's completion API and schema on our speculative engine.

Greedy results through ``DSpark`` (from paths, and over an existing ``Llama``) must equal a plain
``Llama``'s greedy results from a fresh prefill on 10 benchmark prompts; streamed deltas must
concatenate to the non-streaming text; the dicts must have llama-cpp-python's keys plus
llama-server's ``timings``; usage, finish reasons, stop strings, max_tokens, echo and seeds behave
as in llama-cpp-python; closing frees what it owns and later use raises ClosedError.
"""

from __future__ import annotations

import itertools

import pytest

from integration_refs import (DSPARK_KW, N_TOKENS, chat_cases, content, greedy_chat, open_llama,
                              streamed_content)
from first_tokens_law import law_check, two_token_law
from pyllama_dspark.integrations.dspark import DSpark
from pyllama_dspark.decode.cycle import Done
from pyllama_dspark.errors import ClosedError, ContextOverflowError
from pyllama_dspark.speculative.sampling_params import SamplingParams

TIMING_KEYS = {"prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
               "predicted_per_second", "draft_n", "draft_n_accepted"}


@pytest.fixture(scope="module")
def plain(target_path):
    llm = open_llama(target_path)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def cases(llama_refs):
    # Llama's greedy chat completions from a fresh prefill (as DSpark always does), computed once per run
    out = [(name, msgs, llama_refs.chat(msgs, N_TOKENS)) for name, msgs in chat_cases()]
    assert len(out) >= 10
    return out


@pytest.fixture(scope="module")
def ds(target_path, dspark_draft_path):
    """Every block verified (llama.cpp's fixed schedule): these tests check what speculative cycles
    emit, so those cycles must run whatever an automatic schedule would choose for this random draft;
    and which draws a seed's sample uses then does not depend on what a schedule learned from
    earlier calls (README, "Seeds").  The default (auto) is test_auto_schedule's.  Blocks of 3
    (llama.cpp's default --spec-draft-n-max): this random draft is never right, and on a test
    worker's one thread an 8-row verify costs ~6 plain steps where a 4-row one costs ~3; the block
    of 7 is test_lossless's and test_parity_cpp's."""
    with DSpark(target_path, dspark_draft_path, **dict(DSPARK_KW, schedule="off", n_max=3)) as d:
        yield d


def _check_timings(t: dict, stats) -> None:
    assert TIMING_KEYS <= set(t)
    assert t["draft_n"] == stats.drafted and t["draft_n_accepted"] == stats.accepted
    assert t["predicted_n"] == stats.n_generated and t["prompt_n"] + t["cache_n"] == stats.n_prompt
    assert t["prompt_ms"] > 0 and t["predicted_ms"] > 0 and t["predicted_per_second"] > 0


def test_chat_equals_llama_greedy_and_streams_concatenate(ds, cases):
    failures, drafted = [], 0
    for i, (name, msgs, ref) in enumerate(cases[::2]):   # one prompt per benchmark file
        r = greedy_chat(ds, msgs)
        drafted += r["timings"]["draft_n"]
        if content(r) != content(ref):
            failures.append(f"{name}: {content(r)!r} != {content(ref)!r}")
        # llama-cpp-python's schema, plus timings
        assert set(ref) <= set(r) and r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
        assert r["usage"] == ref["usage"], name
        assert r["choices"][0]["finish_reason"] == ref["choices"][0]["finish_reason"], name
        assert r["choices"][0]["message"]["role"] == "assistant"
        _check_timings(r["timings"], ds.last_stats)
        if i >= 2:   # the stream of the first two prompts
            continue
        text, chunks = streamed_content(greedy_chat(ds, msgs, stream=True))
        if text != content(r):
            failures.append(f"{name} (stream): {text!r} != {content(r)!r}")
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        assert chunks[-1]["choices"][0]["finish_reason"] == r["choices"][0]["finish_reason"]
        assert TIMING_KEYS <= set(chunks[-1]["timings"])
    print(f"\nDSpark over {len(cases[::2])} prompts: drafted {drafted}")
    assert drafted > 10 * len(cases[::2]), "the speculative path did not run"
    assert not failures, "\n".join(failures)


def test_from_llama_equals_llama_greedy(target_path, dspark_draft_path, cases):
    llm = open_llama(target_path)
    try:
        ds = DSpark.from_llama(llm, dspark_draft_path, schedule="off")   # drafts verified: see `ds`
        for name, msgs, ref in cases[:3]:
            r = greedy_chat(ds, msgs)
            assert content(r) == content(ref), name
            assert r["usage"] == ref["usage"] and r["timings"]["draft_n"] > 0
        # the Llama still works, unchanged, and shares its model with the DSpark
        llm.reset()
        assert content(greedy_chat(llm, cases[0][1])) == content(cases[0][2])
        assert ds.target.model == llm._model.model
        ds.close()
        with pytest.raises(ClosedError):
            ds.create_completion("Hi", temperature=0)
        llm.reset()
        assert content(greedy_chat(llm, cases[1][1])) == content(cases[1][2])
        # closing the Llama closes a DSpark made over it first
        ds2 = DSpark.from_llama(llm, dspark_draft_path)
    finally:
        llm.close()
    assert ds2.target.ctx is None and ds2.draft.ctx is None
    with pytest.raises(ClosedError):
        ds2.create_chat_completion([{"role": "user", "content": "Hi"}], temperature=0)


@pytest.mark.parametrize("prompt, kw", [
    ("The capital of France is", {}),
    ("def fibonacci(n):", {"stop": ["\n\n"]}),
    ("List three fruits:\n1.", {"stop": "3."}),
    ("Once upon a time", {"max_tokens": 5, "echo": True}),
    ([1, 504, 3458, 282], {}),
])
def test_completion_matches_llama(ds, plain, prompt, kw):
    args = dict(max_tokens=N_TOKENS, temperature=0.0)
    args.update(kw)
    plain.reset()
    ref = plain.create_completion(prompt, **args)
    r = ds.create_completion(prompt, **args)
    assert r["choices"][0]["text"] == ref["choices"][0]["text"]
    assert r["choices"][0]["finish_reason"] == ref["choices"][0]["finish_reason"]
    assert r["usage"] == ref["usage"]
    assert set(ref) <= set(r) and set(ref["choices"][0]) == set(r["choices"][0])
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-") and r["model"] == ds.model_path
    chunks = list(ds.create_completion(prompt, stream=True, **{k: v for k, v in args.items() if k != "echo"}))
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed == ref["choices"][0]["text"][len(prompt) if kw.get("echo") else 0:]
    assert chunks[-1]["choices"][0]["finish_reason"] == ref["choices"][0]["finish_reason"]
    assert chunks[-1]["usage"] == ref["usage"] and TIMING_KEYS <= set(chunks[-1]["timings"])
    if isinstance(prompt, list):   # __call__ is create_completion, as on Llama
        assert ds(prompt, **args)["choices"][0]["text"] == r["choices"][0]["text"]


def test_eos_and_max_tokens(ds, plain):
    msgs = [{"role": "user", "content": "Say hi."}]
    plain.reset()
    ref = greedy_chat(plain, msgs, n=200)
    r = greedy_chat(ds, msgs, n=200)
    assert ref["choices"][0]["finish_reason"] == "stop"          # ended on EOS
    assert content(r) == content(ref) and r["usage"] == ref["usage"]
    assert r["choices"][0]["finish_reason"] == "stop"
    r = ds.create_chat_completion(msgs, temperature=0, max_tokens=3)
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 3


def test_seeded_sampling(ds):
    msgs = [{"role": "user", "content": "Write a short poem about the sea."}]
    kw = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, max_tokens=24)
    first = ds.create_chat_completion(msgs, seed=7, **kw)
    assert first["timings"]["draft_n"] > 0, "the seed must be reproduced through speculative cycles"
    a = content(first)
    b = content(ds.create_chat_completion(msgs, seed=7, **kw))
    others = {content(ds.create_chat_completion(msgs, seed=s, **kw)) for s in (8, 9, 10)}
    assert a == b, "a fixed seed must reproduce the sample"
    assert len(others | {a}) > 1, "different seeds never changed the sample"
    text, _ = streamed_content(ds.create_chat_completion(msgs, seed=7, stream=True, **kw))
    assert text == a


class _Tap:
    """Passes a decoder's events through and keeps the last Done (the tokens behind a response)."""

    def __init__(self, inner):
        self.inner, self.last = inner, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def stream(self, *a, **kw):
        for ev in self.inner.stream(*a, **kw):
            if isinstance(ev, Done):
                self.last = ev
            yield ev


def test_sampling_follows_the_target_law(ds, llama_refs):
    """create_completion at T > 0 draws the first two tokens as llama.cpp's sampler chain on the
    target would (Llama's logits; the second one from a speculative cycle): 160 seeds, chi-square,
    and a negative control (the same samples against another temperature's law are rejected).
    Checks that temperature / top_k / top_p / min_p / seed reach the loop as llama-cpp-python's
    arguments mean them."""
    llm = llama_refs.llm
    prompt = llm.tokenize(b"The capital of France is", add_bos=True, special=True)
    args = dict(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0)
    law = two_token_law(llm, prompt, SamplingParams(**args))
    wrong = two_token_law(llm, prompt, SamplingParams(**dict(args, temperature=2.0)))
    tap = ds.decoder = _Tap(ds.decoder)
    try:
        samples, speculative = [], 0
        for i in range(160):
            r = ds.create_completion(prompt, max_tokens=3, seed=2000 + i, **args)
            toks = tap.last.tokens
            samples.append(tuple(toks[:1]) if ds.target.is_eog(toks[0]) else tuple(toks[:2]))
            assert r["timings"]["draft_n"] == tap.last.stats.drafted
            speculative += tap.last.stats.drafted > 0     # the second token came out of a verify cycle
    finally:
        ds.decoder = tap.inner
    assert speculative == sum(len(x) == 2 for x in samples)
    law_check(samples, law, wrong, "DSpark.create_completion, random DSpark draft")


def test_two_dspark_objects_over_two_targets(target_path, dspark_draft_path, dflash_draft_path, cases):
    msgs, ref = cases[0][1], content(cases[0][2])
    a = DSpark(target_path, dspark_draft_path, **DSPARK_KW)
    b = DSpark(target_path, dflash_draft_path, **DSPARK_KW)
    try:
        assert a.target.ctx != b.target.ctx and a.target.model != b.target.model
        sa = a.create_chat_completion(msgs, temperature=0, max_tokens=N_TOKENS, stream=True)
        sb = b.create_chat_completion(msgs, temperature=0, max_tokens=N_TOKENS, stream=True)
        pa, pb = [], []
        for ca, cb in itertools.zip_longest(sa, sb):      # interleaved generation on both targets
            for c, acc in ((ca, pa), (cb, pb)):
                if c is not None:
                    acc.append(c["choices"][0]["delta"].get("content") or "")
        assert "".join(pa) == ref and "".join(pb) == ref
        a.close()
        assert a.target.ctx is None and a.draft.ctx is None
        with pytest.raises(ClosedError):
            a.create_chat_completion(msgs, temperature=0)
        assert content(greedy_chat(b, msgs)) == ref      # the other one is unaffected
    finally:
        a.close()
        b.close()
    a.close()   # idempotent


def test_bad_input(ds):
    from llama_cpp import LlamaGrammar

    for kw in (dict(grammar=LlamaGrammar.from_string('root ::= "a" (', verbose=False)), dict(logprobs=3),
               dict(logit_bias={10 ** 9: 1.0}), dict(suffix="x"),
               dict(mirostat_mode=2), dict(typical_p=0.5), dict(stopping_criteria=[lambda *a: True]),
               dict(repeat_penalty=0.0)):   # (penalties themselves work at temperature 0: test_penalties_greedy)
        with pytest.raises(ValueError):
            ds.create_completion("Hello", temperature=0, **kw)
    with pytest.raises(TypeError):
        ds.create_completion("Hello", temperature=0, grammar=object())
    with pytest.raises(ValueError):
        ds.create_chat_completion([], temperature=0)
    with pytest.raises(ValueError):
        ds.create_completion("Hello", temperature=-1)
    with pytest.raises(TypeError):
        ds.create_completion(3.5, temperature=0)
    with pytest.raises(ValueError):
        ds.create_completion([1, 10 ** 9], temperature=0)
    with pytest.raises(ContextOverflowError):
        ds.create_completion([1] * 5000, temperature=0)
    with pytest.raises(TypeError):
        DSpark.from_llama(object())


def test_response_format_and_logit_bias_equal_llama(ds, llama_refs):
    """json_object / json_schema response formats (llama-cpp-python's chat handler makes the
    grammar, our loop decodes under it) and a logit bias: the same reply as Llama's."""
    import json

    msgs = [{"role": "user", "content": "Give a fruit and its color as JSON."}]
    schema = {"type": "object", "properties": {"fruit": {"type": "string"}, "color": {"type": "string"}},
              "required": ["fruit", "color"]}
    for rf in ({"type": "json_object"}, {"type": "json_object", "schema": schema}):
        r = ds.create_chat_completion(msgs, temperature=0, max_tokens=40, response_format=rf)
        ref = llama_refs.chat(msgs, 40, response_format=rf)
        assert content(r) == content(ref), rf
        if r["choices"][0]["finish_reason"] == "stop":
            json.loads(content(r))
    bias = {17: 3.0, 28: float("-inf")}
    r = ds.create_completion("The colors of the rainbow are", temperature=0, max_tokens=16, logit_bias=bias)
    ref = llama_refs.completion("The colors of the rainbow are", 16, logit_bias={17: 3.0, 28: -1e30})
    assert r["choices"][0]["text"] == ref["choices"][0]["text"]
