"""The event shapers of the agents' APIs (``serve/anthropic.py`` ``EventShaper``, ``serve/responses.py``
``ResponseShaper``) on every kind of output a reply can have (reasoning, text, several tool calls,
arguments in pieces), read back by the official SDKs' own stream accumulators (``anthropic``'s
``accumulate_event``, ``openai``'s ``ResponseStreamState``): what they rebuild from our events is the
non-streamed object we send for the same reply.  (A random target rarely reasons on request, so the
thinking / reasoning shapes are tested here, without a model.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pyllama_dspark.serve import anthropic as an
from pyllama_dspark.serve import responses as rs
from pyllama_dspark.serve.oai_request import RequestError

MESSAGE = {"role": "assistant", "reasoning_content": "Need the weather. Then the time.", "content": "Checking.",
           "tool_calls": [{"id": "call_a", "type": "function",
                           "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}},
                          {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}


def _deltas(msg: dict, step: int = 5):
    """Chat deltas that add up to ``msg``, in pieces of ``step`` characters (as ReplyDiffer sends them)."""
    r, c = msg.get("reasoning_content", ""), msg.get("content", "")
    for i in range(0, len(r), step):
        yield {"reasoning_content": r[i:i + step]}
    for i in range(0, len(c), step):
        yield {"content": c[i:i + step]}
    for k, tc in enumerate(msg.get("tool_calls") or []):
        yield {"tool_calls": [{"index": k, "id": tc["id"], "type": "function",
                               "function": {"name": tc["function"]["name"], "arguments": ""}}]}
        a = tc["function"]["arguments"]
        for i in range(0, len(a), step):
            yield {"tool_calls": [{"index": k, "function": {"arguments": a[i:i + step]}}]}


def _done(finish: str, stop_word=None):
    return SimpleNamespace(finish_reason=finish, stop_word=stop_word,
                           stats=SimpleNamespace(n_prompt=40, n_cached=12, n_generated=30))


@pytest.mark.parametrize("msg,finish,stop_word", [
    (MESSAGE, "tool_calls", None), ({"role": "assistant", "content": "Hi there."}, "stop", "END"),
    ({"role": "assistant", "reasoning_content": "Hmm", "content": "x"}, "length", None)])
def test_anthropic_sdk_rebuilds_our_message_from_our_events(msg, finish, stop_word):
    from anthropic._models import construct_type
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import RawMessageStreamEvent

    sh = an.EventShaper("msg_1", "m")
    events = list(sh.start(40)) + [e for d in _deltas(msg) for e in sh.delta(d)] + list(sh.done(_done(finish, stop_word)))
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    snap, bufs = None, {}
    for name, data in events:
        assert data["type"] == name
        if name == "ping":
            continue
        snap = accumulate_event(event=construct_type(type_=RawMessageStreamEvent, value=json.loads(json.dumps(data))),
                                current_snapshot=snap, json_bufs=bufs)
    want = an.message_object("msg_1", "m", msg, finish, stop_word, 40, 12, 30)
    got = snap.model_dump()
    assert len(got["content"]) == len(want["content"])
    assert [{k: b[k] for k in w} for b, w in zip(got["content"], want["content"])] == want["content"]
    assert (got["stop_reason"], got["stop_sequence"]) == (want["stop_reason"], want["stop_sequence"])
    assert {k: got["usage"][k] for k in want["usage"]} == want["usage"]
    # each block stopped once, in order, before the next one started
    opened = [d["index"] for n, d in events if n == "content_block_start"]
    stopped = [d["index"] for n, d in events if n == "content_block_stop"]
    assert opened == stopped == list(range(len(want["content"])))
    at = {(n, d.get("index")): k for k, (n, d) in enumerate(events)}
    assert all(at[("content_block_stop", i - 1)] < at[("content_block_start", i)] for i in opened[1:]), names


@pytest.mark.parametrize("msg,finish", [(MESSAGE, "tool_calls"), ({"role": "assistant", "content": "Hi."}, "stop"),
                                        ({"role": "assistant", "reasoning_content": "Hmm", "content": "x"}, "length")])
def test_openai_sdk_rebuilds_our_response_from_our_events(msg, finish):
    from openai._models import construct_type
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    sh = rs.ResponseShaper("resp_1", "m")
    events = list(sh.start(40)) + [e for d in _deltas(msg) for e in sh.delta(d)] + list(sh.done(_done(finish)))
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    from openai import omit
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    last = None
    for name, data in events:
        assert data["type"] == name
        ev = construct_type(type_=ResponseStreamEvent, value=json.loads(json.dumps(data)))
        if name in ("response.completed", "response.incomplete"):
            last = ev.response
            continue
        state.handle_event(ev)
    snap = getattr(state, "_ResponseStreamState__current_snapshot")    # what the SDK built from the events
    want = rs.response_object("resp_1", "m", msg, finish, 40, 12, 30)

    def key(items):
        out = []
        for o in items:
            o = o if isinstance(o, dict) else o.model_dump()
            text = "".join(p.get("text", "") for p in o.get("content") or [])
            out.append((o["type"], text, o.get("name"), o.get("call_id"), o.get("arguments")))
        return out

    done = [state._completed_output[i] for i in sorted(state._completed_output)]   # from output_item.done
    assert key(done) == key(last.output) == key(want["output"])
    # the deltas the SDK adds up (message text, call arguments; it does not add up reasoning deltas)
    added = [o for o in key(snap.output) if o[0] != "reasoning"]
    assert added == [o for o in key(want["output"]) if o[0] != "reasoning"]
    reasoning = "".join(d["delta"] for n, d in events if n == "response.reasoning_text.delta")
    assert reasoning == msg.get("reasoning_content", "")
    usage = last.usage.model_dump()
    assert last.status == want["status"] and {k: usage[k] for k in ("input_tokens", "output_tokens", "total_tokens")} == \
        {k: want["usage"][k] for k in ("input_tokens", "output_tokens", "total_tokens")}
    assert usage["input_tokens_details"]["cached_tokens"] == want["usage"]["input_tokens_details"]["cached_tokens"]


def test_errors_take_each_apis_shape():
    e = RequestError("bad block", code=400)
    assert an.error_body(e) == {"type": "error", "error": {"type": "invalid_request_error", "message": "bad block"}}
    assert an.error_body(RequestError("busy", type="unavailable_error", code=503))["error"]["type"] == "overloaded_error"
    assert an.EventShaper("m", "m").error(e) == ("error", an.error_body(e))
    name, data = rs.ResponseShaper("r", "m").error(e)
    assert name == "error" and data["message"] == "bad block" and data["sequence_number"] == 0
