"""OpenAI Responses on ``serve`` (``POST /v1/responses``, ``/v1/responses/input_tokens``), against
llama.cpp's own llama-server ``--jinja`` on the same files and with the official ``openai`` SDK:

* greedy replies on the real SmolLM2 target, with the shipped drafter and without: the same text and
  token counts as llama-server's ``/v1/responses``;
* ``input_tokens`` equal to llama-server's on Codex-shaped requests (``instructions``, message items,
  ``function_call`` / ``function_call_output`` items, function tools): the conversion renders the
  prompt llama-server renders;
* the SDK: ``responses.create``, ``responses.stream`` (its accumulator rebuilds the non-streamed
  response from our events), a forced function call whose arguments ``jsonschema`` validates and its
  ``function_call_output`` turn, ``text.format`` JSON schema output;
* bad input: a 400 in OpenAI's error shape (the SDK raises ``BadRequestError``), the server serving on.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from agent_servers import Servers, post as _post, url as _url
from serve_helpers import SESSION
from tool_targets import WEATHER

pytestmark = pytest.mark.slow

TOOL = {"type": "function", "name": "get_weather", "description": "Get the weather",
        "parameters": WEATHER["function"]["parameters"]}
INPUT = "Write one sentence about the sea."


def _codex_body() -> dict:
    """A request shaped like Codex CLI's: instructions, message items with input_text parts, a
    function call and its output, function tools plus one it cannot run here."""
    return {"model": "gpt-5-codex", "instructions": "You are a coding agent.", "store": False, "stream": False,
            "include": ["reasoning.encrypted_content"], "parallel_tool_calls": False,
            "tools": [TOOL, {"type": "web_search"}], "tool_choice": "auto",
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
                      {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                       "arguments": '{"city": "Paris", "unit": "c"}'},
                      {"type": "function_call_output", "call_id": "call_1", "output": "21 C"}]}


@pytest.fixture(scope="module")
def servers(target_path, tmp_path_factory):
    get = Servers(target_path, tmp_path_factory.mktemp("responses"))
    yield get
    get.stop()


def _client(srv):
    return openai.OpenAI(base_url=_url(srv) + "/v1", api_key="none", max_retries=0)


def _text(resp: dict) -> str:
    return "".join(p["text"] for it in resp["output"] if it["type"] == "message" for p in it["content"]
                   if p["type"] == "output_text")


@pytest.mark.parametrize("kind", ["plain", "draft"])
def test_greedy_reply_is_llama_servers(servers, kind):
    cpp, ours = servers("smol-cpp"), servers(f"smol-{kind}")
    for body in ({"model": "m", "input": INPUT, "max_output_tokens": 24, "temperature": 0, "instructions": "Be terse."},
                 {"model": "m", "input": [{"role": "user", "content": INPUT}], "max_output_tokens": 400,
                  "temperature": 0}):
        a, b = _post(ours, "/v1/responses", body), _post(cpp, "/v1/responses", body)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        a, b = a.json(), b.json()
        assert (a["object"], a["model"]) == ("response", "m")
        assert _text(a) and _text(a) == _text(b), (a, b)
        ua, ub = a["usage"], b["usage"]
        assert (ua["input_tokens"], ua["output_tokens"], ua["total_tokens"]) == \
            (ub["input_tokens"], ub["output_tokens"], ub["total_tokens"])
        # the status says whether max_output_tokens cut it (llama-server says "completed" either way)
        cut = ua["output_tokens"] == body["max_output_tokens"]
        assert a["status"] == ("incomplete" if cut else "completed"), a
        assert (a["incomplete_details"] or {}).get("reason") == ("max_output_tokens" if cut else None)


def test_function_call_is_llama_servers(servers):
    """A required call on a Llama 3.2-templated target, steered into its call at once and with every
    token that starts with whitespace banned (the two JSON-schema converters then admit the same
    replies; docs/serve.md "Tools"): the same function call as llama-server's /v1/responses, with the
    draft and without."""
    import tool_targets as tt
    from pyllama_dspark.decode.api import Speculator

    cpp = servers("llama3-cpp")
    with Speculator(servers.files["llama3"][0], None, n_ctx=256, n_threads=1) as sp:
        target = sp.target
        start = target.tokenize(tt.TARGETS["llama3"].start, False, True)[0]
        bias = [[start, 30]] + [[i, False] for i in range(target.n_vocab) if target.token_to_piece(i, False)[:1].isspace()]
    body = {"model": "m", "input": "Weather in Paris?", "tools": [TOOL], "tool_choice": "required",
            "max_output_tokens": 48, "temperature": 0, "parallel_tool_calls": False, "logit_bias": bias}
    theirs = _post(cpp, "/v1/responses", body)
    assert theirs.status_code == 200, theirs.text
    want = [(o["name"], json.loads(o["arguments"])) for o in theirs.json()["output"] if o["type"] == "function_call"]
    assert want, theirs.text
    for kind in ("plain", "draft"):
        ours = _post(servers(f"llama3-{kind}"), "/v1/responses", body)
        assert ours.status_code == 200, ours.text
        got = [(o["name"], json.loads(o["arguments"])) for o in ours.json()["output"] if o["type"] == "function_call"]
        assert got == want, (ours.text, theirs.text)
        jsonschema.validate(got[0][1], TOOL["parameters"])


def test_input_tokens_is_llama_servers(servers):
    cpp, ours = servers("qwen-cpp"), servers("qwen-plain")
    codex = _codex_body()
    bodies = [{"model": "m", "input": INPUT}, {"model": "m", "input": INPUT, "instructions": "Be terse."}, codex,
              {**codex, "tools": [TOOL]}, {"model": "m", "tools": [TOOL], "input": INPUT},
              {"model": "m", "input": [{"role": "user", "content": "Hi"},
                                       {"type": "message", "role": "assistant",
                                        "content": [{"type": "output_text", "text": "Hello."}]},
                                       {"role": "user", "content": "More."}]}]
    for body in bodies:
        a, b = _post(ours, "/v1/responses/input_tokens", body), _post(cpp, "/v1/responses/input_tokens", body)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        assert a.json() == b.json(), body
    # Codex resends its reasoning as encrypted_content only: llama-server refuses the item, we skip it
    sealed = {**codex, "input": codex["input"][:1] + [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}]
              + codex["input"][1:]}
    assert _post(cpp, "/v1/responses/input_tokens", sealed).status_code == 400
    assert _post(ours, "/v1/responses/input_tokens", sealed).json() == _post(cpp, "/v1/responses/input_tokens", codex).json()


def test_sdk_create_and_stream_give_the_same_response(servers):
    client = _client(servers("smol-draft"))
    kw = dict(model="m", input=INPUT, max_output_tokens=400)
    made = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        deltas = [ev.delta for ev in stream if ev.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert made.status == "completed" and made.output_text, made
    assert "".join(deltas) == made.output_text == final.output_text
    assert [(o.type, o.status) for o in final.output] == [(o.type, o.status) for o in made.output]
    assert (final.status, final.usage.output_tokens) == (made.status, made.usage.output_tokens)
    # cut by max_output_tokens: the stream ends with response.incomplete, as OpenAI's does
    events = list(client.responses.create(**{**kw, "max_output_tokens": 4}, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_sdk_function_call_round_trip_streamed_and_not(servers):
    client = _client(servers("qwen-draft"))
    kw = dict(model="m", input="Weather in Paris?", tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
              max_output_tokens=64, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    made = client.responses.create(**kw)
    calls = [o for o in made.output if o.type == "function_call"]
    assert made.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather", made
    jsonschema.validate(json.loads(calls[0].arguments), TOOL["parameters"])
    with client.responses.stream(**kw) as stream:
        args = "".join(ev.delta for ev in stream if ev.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    fc = [o for o in final.output if o.type == "function_call"]
    assert [(o.name, o.arguments) for o in fc] == [(o.name, o.arguments) for o in calls] and args == calls[0].arguments
    again = client.responses.create(**{**kw, "tool_choice": "none", "max_output_tokens": 8, "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C"}]})
    assert not [o for o in again.output if o.type == "function_call"], again


def test_text_format_json_schema_is_followed(servers):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}}, "required": ["answer"]}
    client = _client(servers("smol-draft"))
    r = client.responses.create(model="m", input="Name a colour as JSON.", max_output_tokens=64,
                                text={"format": {"type": "json_schema", "name": "colour", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)


BAD = [({"model": "m"}, "input"), ({"model": "m", "input": 3}, "input"),
       ({"model": "m", "input": INPUT, "previous_response_id": "resp_1"}, "previous_response_id"),
       ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
        "input_image"),
       ({"model": "m", "input": [{"type": "hologram"}]}, "hologram"),
       ({"model": "m", "input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, "call_9"),
       ({"model": "m", "input": INPUT, "text": {"format": {"type": "xml"}}}, "text.format")]


@pytest.mark.parametrize("body,word", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_a_400_and_the_server_keeps_serving(servers, body, word):
    srv = servers("smol-plain")
    for path in ("/v1/responses", "/v1/responses/input_tokens"):
        r = _post(srv, path, body)
        assert r.status_code == 400, r.text
        assert word in r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error", r.text
    with pytest.raises(openai.BadRequestError):
        _client(srv).responses.create(**body)
    assert SESSION.get(srv.url + "/health").status_code == 200
