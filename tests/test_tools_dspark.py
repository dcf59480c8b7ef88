"""``DSpark.create_chat_completion(tools=...)`` gives ``serve``'s calls: the same request to a ``serve``
process and to a ``DSpark`` over the same target (with a random draft verifying every block) ends in
the same message (function, arguments, content; ids are drawn per reply) and finish reason; its
stream's deltas reassemble to it; legacy ``functions`` / ``function_call`` read as tools; bad tool
input raises ValueError.  (What ``serve`` gives is checked against llama-server in
``test_tools_server.py``.)"""

from __future__ import annotations

import json

import pytest

import tool_targets as tt
from greedy_ref import TEST_THREADS
from serve_helpers import SESSION, ServeProcess
from pyllama_dspark.gguf.testing import make_test_draft
from pyllama_dspark.integrations.dspark import DSpark

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                                     "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city", "unit"]}}}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
USER = [{"role": "user", "content": "Weather in Tokyo, please."}]


@pytest.fixture(scope="module", params=["qwen3", "mistral"])
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"tools-dspark-{request.param}")
    target = tt.build(request.param, d)
    draft = make_test_draft(target, str(d / "draft.gguf"), kind="dspark", seed=5)
    srv = ServeProcess(target, draft, d / "serve.log", n_ctx=2048, extra=["--schedule", "off"])
    ds = DSpark(target, draft, n_ctx=2048, n_threads=TEST_THREADS, schedule="off")
    start = ds.target.tokenize(tt.TARGETS[request.param].start, False, True)[0]
    yield request.param, srv, ds, start
    ds.close()
    srv.stop()


def _serve(srv, **body):
    r = SESSION.post(srv.url + "/v1/chat/completions", data=json.dumps(body), timeout=600)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _no_ids(msg: dict) -> dict:
    msg = json.loads(json.dumps(msg))
    for c in msg.get("tool_calls") or []:
        c.pop("id")
    return msg


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "ping"}}, "auto"],
                         ids=["required", "named", "auto"])
def test_dspark_gives_serves_calls_and_streams_them(pair, choice):
    kind, srv, ds, start = pair
    kw = dict(tools=[WEATHER, PING], tool_choice=choice, max_tokens=40, temperature=0, parallel_tool_calls=False,
              chat_template_kwargs={"enable_thinking": False} if kind == "qwen3" else None)
    bias = {start: 30.0} if choice == "auto" else None
    theirs = _serve(srv, messages=USER, **kw, logit_bias=[[start, 30]] if bias else None)
    ours = ds.create_chat_completion(USER, logit_bias=bias, **kw)
    c = ours["choices"][0]
    assert _no_ids(c["message"]) == _no_ids(theirs["message"]) and c["finish_reason"] == theirs["finish_reason"]
    assert set(ours) >= {"id", "object", "created", "model", "choices", "usage", "timings"}
    calls, content = {}, ""
    for ch in ds.create_chat_completion(USER, logit_bias=bias, stream=True, **kw):
        d = ch["choices"][0]["delta"]
        content += d.get("content") or ""
        for tc in d.get("tool_calls", []):
            e = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            e["name"] += tc.get("function", {}).get("name", "")
            e["arguments"] += tc.get("function", {}).get("arguments", "")
        last = ch
    assert last["choices"][0]["finish_reason"] == c["finish_reason"] and "timings" in last
    assert content == c["message"]["content"]
    assert [(e["name"], e["arguments"]) for e in calls.values()] == \
        [(t["function"]["name"], t["function"]["arguments"]) for t in c["message"].get("tool_calls") or []]
    if choice != "auto" or kind == "mistral":
        assert c["message"]["tool_calls"], c


def test_legacy_functions_and_bad_tool_input(pair):
    kind, _, ds, _ = pair
    r = ds.create_chat_completion(USER, functions=[WEATHER["function"]], function_call={"name": "get_weather"},
                                  max_tokens=40, temperature=0,
                                  chat_template_kwargs={"enable_thinking": False} if kind == "qwen3" else None)
    assert r["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    with pytest.raises(ValueError, match="not in 'tools'"):
        ds.create_chat_completion(USER, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}})
    with pytest.raises(ValueError, match="matches no earlier"):
        ds.create_chat_completion(USER + [{"role": "tool", "tool_call_id": "nope", "content": "1"}], tools=[WEATHER])
