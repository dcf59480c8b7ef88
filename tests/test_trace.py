"""The speculation trace (``dspark_trace``), ``timings_per_token`` and the per-request
``speculative.n_max`` on ``serve``, and the ``DSpark`` class's ``dspark_trace``.

References: the trace's token ids are ``Llama``'s greedy tokens (llama-cpp-python, one thread),
its counts are the response's ``timings`` (an exact law: summed over a reply, ``verified`` is
``draft_n`` and ``accepted`` is ``draft_n_accepted``), and with the oracle at 1.0 (a drafter that is
always right, so every verified draft is accepted) the marks follow from the law alone: each
cycle's first ``verified`` tokens are drafts, then one token of the target's own.
"""

from __future__ import annotations

from typing import List

import pytest

from greedy_ref import explain_mismatch
from serve_helpers import ServeProcess, sse_json

MESSAGES = [{"role": "user", "content": "List the planets of the solar system, one per line."}]
N = 40
TIE_EPS = 1e-3


@pytest.fixture(scope="module")
def servers(target_path, tmp_path_factory):
    from pyllama_dspark.paths import default_draft

    d = tmp_path_factory.mktemp("trace")
    up = {}

    def get(which: str) -> ServeProcess:
        if which not in up:
            draft = {"smol": default_draft(), "oracle": "oracle:1.0"}[which]
            up[which] = ServeProcess(target_path, draft, d / f"{which}.log", n_ctx=2048,
                                     extra=["--schedule", "off"])
        return up[which]

    yield get
    for s in up.values():
        s.stop()


def stream(srv, body: dict, path: str = "/v1/chat/completions") -> List[dict]:
    r = srv.post(path, dict(body, stream=True), stream=True)
    assert r.status_code == 200, r.text
    return [c for c in sse_json(r) if c != "[DONE]"]


def trace_of(chunks: List[dict]):
    """(tokens, cycles, final timings) of a streamed reply's chunks."""
    toks, cycles = [], []
    for c in chunks:
        tr = c.get("dspark_trace")
        if tr:
            toks += tr["tokens"]
            cycles += tr["cycles"]
    return toks, cycles, chunks[-1]["timings"]


def check_laws(toks, cycles, timings) -> None:
    """The trace's exact laws, against the response's timings."""
    assert [c["cycle"] for c in cycles] == list(range(len(cycles))), "cycles are numbered 0, 1, ... in order"
    assert cycles[0] == {"cycle": 0, "drafted": 0, "verified": 0, "accepted": 0, "tokens": 1}, "cycle 0: the prefill"
    assert sum(c["verified"] for c in cycles) == timings["draft_n"]
    assert sum(c["accepted"] for c in cycles) == timings["draft_n_accepted"]
    assert sum(c["tokens"] for c in cycles) == len(toks) == timings["predicted_n"]
    i = 0
    for c in cycles:
        assert c["accepted"] <= c["verified"] <= c["drafted"]
        assert 1 <= c["tokens"] <= c["accepted"] + 1
        for j in range(c["tokens"]):
            t = toks[i]
            assert (t["cycle"], t["pos"]) == (c["cycle"], j)
            assert t["source"] == ("draft" if j < c["accepted"] else "target"), (c, t)
            i += 1


def assert_greedy(llama_refs, prompt: List[int], ids: List[int]) -> None:
    ref = llama_refs.greedy(prompt, len(ids))
    if ids != ref:
        why = explain_mismatch(llama_refs.llm, prompt, ids, ref, TIE_EPS)
        assert why.startswith("near-tie"), why


def test_the_trace_marks_every_token_and_sums_to_the_timings(servers, llama_refs):
    srv = servers("smol")
    chunks = stream(srv, {"messages": MESSAGES, "max_tokens": N, "dspark_trace": True})
    toks, cycles, timings = trace_of(chunks)
    check_laws(toks, cycles, timings)
    assert timings["draft_n_accepted"] > 0, "the test needs accepted drafts to mark"
    assert_greedy(llama_refs, llama_refs.chat_tokens(MESSAGES), [t["id"] for t in toks])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text.encode() == b"".join(bytes(t["bytes"]) for t in toks)   # an end token's piece is empty
    # every chunk's trace is the tokens of that chunk only: a chunk with text has a trace
    assert all(c.get("dspark_trace") for c in chunks if c["choices"][0]["delta"].get("content"))


def test_the_oracle_marks_are_the_law(servers):
    """A drafter that is always right: each cycle's verified drafts are all accepted and marked."""
    toks, cycles, timings = trace_of(stream(servers("oracle"), {"messages": MESSAGES, "max_tokens": N,
                                                                "dspark_trace": True}))
    check_laws(toks, cycles, timings)
    full = [c for c in cycles[1:] if c["tokens"] == c["accepted"] + 1]
    assert full and all(c["accepted"] == c["verified"] > 0 for c in full)
    marks = [t["source"] for t in toks]
    i = 0
    for c in cycles:
        assert marks[i:i + c["tokens"]] == (["draft"] * c["verified"] + ["target"])[:c["tokens"]]
        i += c["tokens"]


def test_timings_per_token_are_the_totals_so_far(servers):
    chunks = stream(servers("smol"), {"messages": MESSAGES, "max_tokens": N, "timings_per_token": True,
                                      "dspark_trace": True})
    n = verified = accepted = 0
    for c in chunks[:-1]:
        tr = c.get("dspark_trace")
        if not tr:
            continue
        n += len(tr["tokens"])
        verified += sum(x["verified"] for x in tr["cycles"])
        accepted += sum(x["accepted"] for x in tr["cycles"])
        t = c["timings"]
        assert (t["predicted_n"], t["draft_n"], t["draft_n_accepted"]) == (n, verified, accepted)
        assert t["predicted_ms"] >= 0 and t["prompt_n"] + t["cache_n"] > 0


def test_no_new_fields_unless_asked(servers):
    """OpenAI clients see no change: no trace and no per-chunk timings by default."""
    chunks = stream(servers("smol"), {"messages": MESSAGES, "max_tokens": 8})
    assert not any("dspark_trace" in c for c in chunks)
    assert not any("timings" in c for c in chunks[:-1])
    r = servers("smol").post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, "dspark_trace": True})
    assert r.status_code == 200 and "dspark_trace" not in r.json()   # a streaming field


def test_speculative_n_max_per_request(servers, llama_refs):
    srv = servers("smol")
    off = trace_of(stream(srv, {"messages": MESSAGES, "max_tokens": N, "dspark_trace": True,
                                "speculative.n_max": 0}))
    check_laws(*off)
    assert off[2]["draft_n"] == 0 and all(c["drafted"] == 0 for c in off[1])
    assert all(t["source"] == "target" for t in off[0])
    assert_greedy(llama_refs, llama_refs.chat_tokens(MESSAGES), [t["id"] for t in off[0]])
    two = trace_of(stream(srv, {"messages": MESSAGES, "max_tokens": N, "dspark_trace": True,
                                "speculative.n_max": 2}))
    check_laws(*two)
    assert two[2]["draft_n"] > 0 and max(c["drafted"] for c in two[1]) == 2
    # larger than the server's block: clamped to it
    big = trace_of(stream(srv, {"messages": MESSAGES, "max_tokens": 12, "dspark_trace": True,
                                "speculative.n_max": 64}))
    assert max(c["drafted"] for c in big[1]) == 7


@pytest.mark.parametrize("body, what", [({"speculative.n_max": -1}, "speculative.n_max"),
                                        ({"speculative.n_max": "3"}, "speculative.n_max"),
                                        ({"speculative.n_max": True}, "speculative.n_max"),
                                        ({"dspark_trace": "yes"}, "dspark_trace"),
                                        ({"timings_per_token": 1.5}, "timings_per_token")])
def test_bad_fields_are_a_400(servers, body, what):
    srv = servers("smol")
    r = srv.post("/v1/chat/completions", dict({"messages": MESSAGES, "max_tokens": 4, "stream": True}, **body))
    assert r.status_code == 400 and what in r.json()["error"]["message"]
    assert srv.get("/health").status_code == 200


def test_native_completion_stream_carries_the_trace(servers, llama_refs):
    srv = servers("smol")
    prompt = "The capital of France is"
    chunks = stream(srv, {"prompt": prompt, "n_predict": 24, "dspark_trace": True, "timings_per_token": True},
                    path="/completion")
    toks, cycles, timings = trace_of(chunks)
    check_laws(toks, cycles, timings)
    assert_greedy(llama_refs, llama_refs.completion_tokens(prompt), [t["id"] for t in toks])


@pytest.fixture(scope="module")
def dspark(target_path):
    from pyllama_dspark import DSpark
    from pyllama_dspark.paths import default_draft

    ds = DSpark(target_path, default_draft(), schedule="off", n_threads=1)
    yield ds
    ds.close()


def test_dspark_class_streams_the_trace(dspark, llama_refs):
    chunks = list(dspark.create_completion("The capital of France is", max_tokens=24, temperature=0, stream=True,
                                           dspark_trace=True))
    toks, cycles, timings = trace_of(chunks)
    check_laws(toks, cycles, timings)
    assert_greedy(llama_refs, llama_refs.completion_tokens("The capital of France is"), [t["id"] for t in toks])

    chat = list(dspark.create_chat_completion(MESSAGES, max_tokens=N, temperature=0, stream=True, dspark_trace=True))
    toks, cycles, timings = trace_of(chat)
    check_laws(toks, cycles, timings)
    assert timings["draft_n_accepted"] > 0
    assert_greedy(llama_refs, llama_refs.chat_tokens(MESSAGES), [t["id"] for t in toks])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chat)
    assert text.encode() == b"".join(bytes(t["bytes"]) for t in toks)
    plain = list(dspark.create_completion("The capital of France is", max_tokens=8, temperature=0, stream=True))
    assert not any("dspark_trace" in c for c in plain)
