"""Anthropic Messages on ``serve`` (``POST /v1/messages``, ``/v1/messages/count_tokens``), against
llama.cpp's own llama-server ``--jinja`` on the same files and with the official ``anthropic`` SDK:

* greedy replies on the real SmolLM2 target, with the shipped drafter and without: the same text,
  the same stop, the same token counts as llama-server's ``/v1/messages``;
* ``count_tokens`` equal to llama-server's on Claude-Code-shaped requests (system blocks with
  ``cache_control``, the billing header, tools, ``tool_use`` / ``tool_result`` turns, ``metadata``):
  the conversion renders the prompt llama-server renders;
* the SDK: ``messages.create``, ``messages.stream`` (its accumulator rebuilds the non-streamed
  message from our events), a forced tool call whose ``input`` ``jsonschema`` validates, its
  ``tool_result`` turn, ``count_tokens``;
* the billing header's per-request stamp does not break the prompt cache;
* bad input: a 400 in Anthropic's error shape (the SDK raises ``BadRequestError``), the server serving on.
"""

from __future__ import annotations

import anthropic
import jsonschema
import pytest

from agent_servers import Servers, post as _post, url as _url
from serve_helpers import SESSION
from tool_targets import WEATHER
from pyllama_dspark.serve.anthropic import normalize_billing_header

pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "Write one sentence about the sea."}]
TOOL = {"name": "get_weather", "description": "Get the weather", "input_schema": WEATHER["function"]["parameters"]}
BILLING = "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch={};"


def _claude_code_body(cch: str = "a5145") -> dict:
    """A request shaped like Claude Code's: system blocks with cache_control and the billing
    header, tools, a tool_use / tool_result turn, metadata."""
    return {"model": "claude-sonnet-4-5", "max_tokens": 32, "metadata": {"user_id": "u1"},
            "system": [{"type": "text", "text": BILLING.format(cch) + "You are a coding agent."},
                       {"type": "text", "text": " Be brief.", "cache_control": {"type": "ephemeral"}}],
            "tools": [TOOL],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?",
                                                       "cache_control": {"type": "ephemeral"}}]},
                         {"role": "assistant", "content": [
                             {"type": "text", "text": "Let me check."},
                             {"type": "tool_use", "id": "toolu_01", "name": "get_weather",
                              "input": {"city": "Paris", "unit": "c"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                                       "content": [{"type": "text", "text": "21 C"}]}]}]}


@pytest.fixture(scope="module")
def servers(target_path, tmp_path_factory):
    get = Servers(target_path, tmp_path_factory.mktemp("anthropic"))
    yield get
    get.stop()


def _client(srv):
    return anthropic.Anthropic(base_url=_url(srv), api_key="none", max_retries=0)


def _text(msg: dict) -> str:
    return "".join(b["text"] for b in msg["content"] if b["type"] == "text")


# ---- against llama-server ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["plain", "draft"])
def test_greedy_reply_is_llama_servers(servers, kind):
    cpp, ours = servers("smol-cpp"), servers(f"smol-{kind}")
    body = {"model": "m", "max_tokens": 24, "temperature": 0, "system": "You are terse.", "messages": USER}
    a, b = _post(ours, "/v1/messages", body), _post(cpp, "/v1/messages", body)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    a, b = a.json(), b.json()
    assert (a["type"], a["role"], a["model"]) == ("message", "assistant", "m")
    assert _text(a) == _text(b) and a["stop_reason"] == b["stop_reason"], (a, b)
    ua, ub = a["usage"], b["usage"]
    assert ua["output_tokens"] == ub["output_tokens"]
    assert ua["input_tokens"] + ua["cache_read_input_tokens"] == ub["input_tokens"] + ub["cache_read_input_tokens"]
    # a stop sequence from inside that reply: the same text before it, and the sequence named
    word = _text(b).split()[3]
    body["stop_sequences"] = [word]
    a, b = _post(ours, "/v1/messages", body).json(), _post(cpp, "/v1/messages", body).json()
    assert _text(a) == _text(b) and a["stop_sequence"] == b["stop_sequence"] == word, (a, b)
    assert a["stop_reason"] == "stop_sequence"       # Anthropic's; llama-server says "end_turn"


def test_count_tokens_is_llama_servers(servers):
    """The conversion renders the prompt llama-server renders: the same count on every request."""
    cpp, ours = servers("qwen-cpp"), servers("qwen-plain")
    cc = _claude_code_body()
    bodies = [{"model": "m", "messages": USER}, {"model": "m", "system": "Be terse.", "messages": USER},
              cc, {**cc, "tools": []}, {**cc, "system": BILLING.format("00000") + "x"},
              {"model": "m", "tools": [TOOL], "messages": USER},
              {"model": "m", "messages": USER + [{"role": "assistant", "content": [
                  {"type": "thinking", "thinking": "Hmm.", "signature": "s"}, {"type": "text", "text": "The sea."}]},
                  {"role": "user", "content": "More."}]}]
    for body in bodies:
        a, b = _post(ours, "/v1/messages/count_tokens", body), _post(cpp, "/v1/messages/count_tokens", body)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        assert a.json() == b.json(), body
        assert _client(ours).messages.count_tokens(**{k: v for k, v in body.items()
                                                      if k not in ("max_tokens", "metadata")}).input_tokens == \
            a.json()["input_tokens"]


# ---- the SDK -------------------------------------------------------------------------------------
def test_sdk_create_and_stream_give_the_same_message(servers):
    client = _client(servers("smol-draft"))
    kw = dict(model="m", max_tokens=24, messages=USER)          # (serve runs with --temp 0)
    made = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert made.content and made.content[0].type == "text" and made.stop_reason in ("end_turn", "max_tokens")
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in made.content]
    assert "".join(texts) == made.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (made.stop_reason, made.usage.output_tokens)


def test_sdk_tool_use_round_trip_streamed_and_not(servers):
    client = _client(servers("qwen-draft"))
    kw = dict(model="m", max_tokens=64, tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"},
              messages=[{"role": "user", "content": "Weather in Paris?"}],
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    made = client.messages.create(**kw)
    uses = [b for b in made.content if b.type == "tool_use"]
    assert made.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather", made
    jsonschema.validate(uses[0].input, TOOL["input_schema"])
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in final.content] == \
        [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in made.content]
    assert final.stop_reason == "tool_use"
    again = client.messages.create(**{**kw, "tool_choice": {"type": "none"}, "max_tokens": 8, "messages": kw["messages"] + [
        {"role": "assistant", "content": [b.model_dump() for b in made.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "21 C"}]}]})
    assert again.stop_reason in ("end_turn", "max_tokens") and not [b for b in again.content if b.type == "tool_use"]


def test_billing_header_stamp_does_not_break_the_prompt_cache(servers):
    assert normalize_billing_header(BILLING.format("a5145") + "hi") == BILLING.format("fffff") + "hi"
    assert normalize_billing_header("cch=a5145; hi") == "cch=a5145; hi"
    assert normalize_billing_header(BILLING.format("a51") + "hi") == BILLING.format("a51") + "hi"
    srv = servers("qwen-plain")
    first = _post(srv, "/v1/messages", {**_claude_code_body("a5145"), "max_tokens": 2})
    second = _post(srv, "/v1/messages", {**_claude_code_body("9f3e1"), "max_tokens": 2})
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    u = second.json()["usage"]
    assert u["cache_read_input_tokens"] >= u["input_tokens"] + u["cache_read_input_tokens"] - 4, u


# ---- bad input -----------------------------------------------------------------------------------
BAD = [
    ({"max_tokens": 4}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "text"),
    ({"messages": [{"role": "user", "content": [{"type": "hologram", "x": 1}]}]}, "hologram"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
     "image"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]},
     "toolu_9"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "role"),
    ({"messages": USER, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"messages": USER, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
    ({"messages": USER, "top_k": "many"}, "top_k"),
]


@pytest.mark.parametrize("body,word", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_an_anthropic_400_and_the_server_keeps_serving(servers, body, word):
    srv = servers("smol-plain")
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = _post(srv, path, {"model": "m", "max_tokens": 4, **body})
        assert r.status_code == 400, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert word in err["error"]["message"], err
    rest = {k: v for k, v in body.items() if k not in ("messages", "max_tokens")}
    with pytest.raises(anthropic.BadRequestError, match=word if word != "messages" else "non-empty"):
        _client(srv).messages.create(model="m", max_tokens=4, messages=body.get("messages", []), extra_body=rest)
    assert SESSION.get(srv.url + "/health").status_code == 200
