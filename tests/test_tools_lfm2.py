"""LFM2 / LFM2.5 tool calls (``<|tool_call_start|>[name(key="value", n=1)]<|tool_call_end|>``) on ``serve``
and in process, against llama.cpp's own llama-server ``--jinja`` on the same random targets
(``tool_targets.py`` ``lfm25``: LFM2.5-8B-A1B's template, which thinks and renders earlier calls;
``lfm2``: LFM2-8B-A1B's, with the ``<|tool_list_start|>`` tokens, which renders neither).  References:

* the prompt: llama-server's ``/apply-template`` (tools, a call with every kind of argument, its
  reasoning, its result, a later turn), on both templates;
* the parser: llama-server's parse of an assistant prefill (it continues after ``<think></think>`` +
  the prefill, so that is the text both parse), texts it answers with HTTP 500 come back as content
  here; and its parse of what it generated itself;
* the constrained decode: llama-server's ``/completion`` with our prompt tokens and our grammar, ours
  with and without a draft (every block verified): the same tokens;
* the end to end call: llama-server ``--jinja`` with a tool without parameters, where our grammar and
  llama-server's admit the same replies (llama-server's lets any argument come in any order and any
  number of times; ours follows the schema, docs/serve.md "Tools");
* streaming reassembles to the same call; ``jsonschema`` validates the arguments; the ``DSpark`` class
  gives serve's call.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

import tool_targets as tt
from greedy_ref import TEST_THREADS
from serve_helpers import SESSION, ServeProcess, sse_json
from test_tools_server import _cpp_grammar_fields
from tool_targets import USER, WEATHER, post as _post, strip_ids as _strip_ids
from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.gguf.testing import make_test_draft
from pyllama_dspark.chat import lfm2
from pyllama_dspark.chat.tool_prompt import ToolChat, tool_chat_for
from pyllama_dspark.chat.tool_grammar import ToolSchemaError
from pyllama_dspark.chat.parse import ReplyDiffer, ReplyText, message_json
from pyllama_dspark.chat.tool_request import check_tools

pytestmark = pytest.mark.slow

S, E = lfm2.CALL_START, lfm2.CALL_END
NOTE_PARAMS = {"type": "object", "required": ["text", "flag"], "properties": {
    "text": {"type": "string"}, "n": {"type": "integer"}, "score": {"type": "number"}, "flag": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 2},
    "meta": {"type": "object", "properties": {"k": {"type": "string", "enum": ["x"]}, "v": {"type": ["number", "null"]}},
             "required": ["v"]}}}
NOTE = {"type": "function", "function": {"name": "note", "description": "Take a note", "parameters": NOTE_PARAMS}}
PING = {"type": "function", "function": {"name": "ping", "description": "Ping", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, NOTE]
NAMES = ["get_weather", "note"]
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "note": NOTE_PARAMS, "ping": {"type": "object"}}
N = 48          # a random target pads its calls with whitespace: room to finish one
N_DECODE = 32   # where a call cut by max_tokens will do
PRE = "<think></think>"     # llama-server continues a prefill after an empty thought


def _history(content: str = "") -> list:
    call = {"id": "call1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"unit": "c", "city": "Paris", "opt": null, '
                                                                        '"more": [1.5, null, true, "x"], "flag": false, '
                                                                        '"n": 3, "d": {"a": "b"}}'}}
    return [{"role": "system", "content": "You are terse."}] + USER + [
        {"role": "assistant", "content": content, "tool_calls": [call], "reasoning_content": "Need <it>."},
        {"role": "tool", "tool_call_id": "call1", "content": '{"temperature": 21, "sky": "clear"}'}]


# ---- fixtures ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools-lfm2")
    target = tt.build("lfm25", d)
    return target, make_test_draft(target, str(d / "draft-lfm25.gguf"), kind="dspark", seed=5), d


@pytest.fixture(scope="module")
def servers(files, tmp_path_factory):
    from pyllama_dspark.upstream.llama_server import LlamaServer
    from pyllama_dspark.upstream.llama_server_build import ensure_llama_server

    target, draft, d = files
    logs = tmp_path_factory.mktemp("tools-lfm2-logs")
    binary = ensure_llama_server()
    up = {}

    def get(which: str):
        if which not in up:
            if which in ("cpp", "cpp-lfm2"):
                model = target if which == "cpp" else tt.build("lfm2", d)
                # LFM2's (prompts only) --verbose: its log names the handler it picked ("Using specialized
                # template: LFM2"); LFM2.5's shows in its parse of Python-style calls
                verbose = ["--verbose"] if which == "cpp-lfm2" else []
                up[which] = LlamaServer(binary, model, None, ctx=4096, threads=TEST_THREADS,
                                        extra_args=["--jinja"] + verbose, trace=False,
                                        log_path=logs / f"{which}.log").start()
                up[which].log_file = logs / f"{which}.log"
            else:
                model = tt.build("lfm2", d) if which == "plain-lfm2" else target
                up[which] = ServeProcess(model, draft if which == "draft" else None, logs / f"serve-{which}.log",
                                         n_ctx=4096, extra=["--schedule", "off"] if which == "draft" else [])
        return up[which]

    yield get
    for s in up.values():
        s.stop()


@pytest.fixture(scope="module")
def sp(files):
    with Speculator(files[0], None, n_ctx=2048, n_threads=TEST_THREADS) as s:
        yield s


_tok = tt.token_of


# ---- format, grammar and parser in process -----------------------------------------------------------
def test_formats_are_found_as_llama_cpp_finds_them():
    for name, fmt, think in (("LFM2-8B-A1B.jinja", "lfm2", None), ("LFM2.5-Instruct.jinja", "lfm25", None),
                             ("LFM2.5-8B-A1B.jinja", "lfm25", ("<think>", "</think>"))):
        chat = ToolChat(tt.template_text(name), "<|startoftext|>", "<|im_end|>")
        assert (chat.format.name, chat.format.codec, chat.format.think) == (fmt, "lfm2", think), name
    chat = ToolChat(tt.template_text("LFM2.5-8B-A1B.jinja"), "<|startoftext|>", "<|im_end|>")
    assert chat.caps.supports_object_arguments and chat.caps.supports_parallel_tool_calls


def test_the_templates_own_calls_are_in_our_grammar_and_parse_back(sp):
    from pyllama_dspark.llama.grammar import Grammar

    target = sp.target
    chat = tool_chat_for(target)
    args = [{"city": "Lima", "unit": "f"},
            {"text": 'say "hi" now é 😀', "n": -3, "score": 2.5, "flag": True, "tags": ["b", "a"],
             "meta": {"k": "x", "v": -0.5}},
            {"text": "", "flag": False, "meta": {"v": None}}]     # in the schema's order, as the grammar wants
    calls = [("get_weather", args[0]), ("note", args[1]), ("note", args[2])]
    msgs = USER + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(calls)]}]
    prompt = chat.render(msgs, check_tools(TOOLS)).prompt
    reply = prompt[prompt.index(S):prompt.rindex(E) + len(E)]
    g = lfm2.grammar(chat.format, check_tools(TOOLS), "required", True)
    toks = target.tokenize(reply, False, True)
    with Grammar.compile(g.gbnf, target) as gr:
        assert gr.valid_prefix(toks) == len(toks), (reply, g.gbnf)
    parsed = lfm2.parse(reply, chat.format, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls, reply
    for name, a in calls:
        jsonschema.validate(a, SCHEMAS[name])
    named = lfm2.grammar(chat.format, check_tools(TOOLS), {"name": "note"}, True)
    assert "get_weather" not in named.gbnf and '("," space call)*' not in named.gbnf
    auto = lfm2.grammar(chat.format, check_tools(TOOLS), "auto", False)
    assert auto.lazy and auto.words == (S,) and len(target.tokenize(S, False, True)) == 1
    with Grammar.compile(g.gbnf, target) as gr:    # what the schema rules out
        for bad in (f'{S}[get_weather(city="Rome", unit="c")]{E}', f'{S}[note(flag=True)]{E}',
                    f'{S}[note(text=1, flag=True)]{E}', f'{S}[get_weather()]{E}'):
            t = target.tokenize(bad, False, True)
            assert gr.valid_prefix(t) < len(t), bad


@pytest.mark.parametrize("params,msg", [
    ({"type": "object", "properties": {"a=b": {"type": "string"}}}, "cannot be written"),
    ({"type": "object", "properties": {"a": {"allOf": [{"type": "string"}]}}}, "allOf"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}, "unresolved"),
    ({"type": "string"}, "must be an object"),
])
def test_a_schema_we_cannot_write_is_a_tool_schema_error_naming_the_tool(params, msg):
    fmt = ToolChat(tt.template_text("LFM2.5-8B-A1B.jinja"), "<|startoftext|>", "<|im_end|>").format
    tools = check_tools([{"type": "function", "function": {"name": "odd", "parameters": params}}])
    with pytest.raises(ToolSchemaError, match=f"'odd'.*{msg}"):
        lfm2.grammar(fmt, tools, "required", False)


def test_any_text_parses_and_streams_to_its_last_parse():
    """Any text, cut anywhere: the streamed deltas reassemble to the stream's last message, which is
    the text's parse unless a call already sent turned out not to be one; nothing sent changes."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    fmt = ToolChat(tt.template_text("LFM2.5-8B-A1B.jinja"), "<|startoftext|>", "<|im_end|>").format
    pieces = st.sampled_from([S, E, "[", "]", "(", ")", "note", "text", "=", "flag", ",", " ", "\n", '"', "'", "\\",
                              "x", "1", "-", ".", "e", "True", "Non", "nul", "{", "}", ":", "<think>", "</think>",
                              "<|tool", f'{S}[note(text="a", flag=True)]{E}'])

    @settings(max_examples=300, deadline=None)
    @given(st.lists(pieces, max_size=30), st.integers(1, 5))
    def check(parts, step):
        text = "".join(parts)
        final = lfm2.parse(text, fmt, ["note"])
        d = ReplyDiffer(fmt, ["note"], parse=lfm2.parse)
        merged = tt.merge_deltas(delta for k in list(range(step, len(text), step)) + [len(text)]
                                 for delta in d.update(text[:k], final=k == len(text))[1])
        last = d.prev
        assert {"content": merged["content"], "reasoning_content": merged["reasoning_content"]} == \
            {"content": last.content, "reasoning_content": last.reasoning}, text
        args = {i: c["arguments"] for i, c in merged["tool_calls"].items()}
        assert [args[i] for i in sorted(args)] == [c.arguments for c in last.calls], text
        if len(final.calls) >= len(args):
            assert (last.content, last.reasoning, [(c.name, c.arguments) for c in last.calls]) == \
                (final.content, final.reasoning, [(c.name, c.arguments) for c in final.calls]), text

    check()


# ---- the prompt --------------------------------------------------------------------------------------
def test_prompt_with_tools_and_tool_turns_is_llama_servers(servers):
    convo = _history() + [{"role": "assistant", "content": "It is 21 C."}, {"role": "user", "content": "And Lima?"}]
    bodies = [{"messages": USER, "tools": TOOLS}, {"messages": _history(), "tools": TOOLS},
              {"messages": _history("Let me check."), "tools": TOOLS}, {"messages": convo, "tools": TOOLS},
              {"messages": USER, "tools": TOOLS, "tool_choice": "none"}]
    for ours, cpp in (("plain", "cpp"), ("plain-lfm2", "cpp-lfm2")):
        for body in bodies:
            a, b = _post(servers(ours), "/apply-template", body), _post(servers(cpp), "/apply-template", body)
            assert a.status_code == b.status_code == 200, (a.text, b.text)
            assert a.json()["prompt"] == b.json()["prompt"], (cpp, body)
    assert "Using specialized template: LFM2\n" in servers("cpp-lfm2").log_file.read_text(errors="replace")


# ---- the parser --------------------------------------------------------------------------------------
TEXTS = [
    f'{S}[get_weather(city="Paris", unit="c")]{E}',
    f"Sure. {S}[get_weather(city='Lima', unit='f'), note(text='it\\'s \"q\"\\n', n=-12, flag=True)]{E}",
    f'{S}[note(text="a\\u00e9 \\\\ é 😀", meta={{\'k\': None, "v": [1.5e3, true, False]}} , tags=["a"], flag=false)]{E}',
    f"{S}[ note( flag=True,\n text='' ) ]{E}",
    "  Just an answer,\n no call.  ", "x <|tool_c",
    f'{S}[note(text="cut off', f"{S}[note(n=12", f'{S}[get_weather(city="Paris", ', f"{S}[get_wea",
    f'{S}[get_weather(city="Paris"', f"{S}[note(score=Tru", f"{S}[get_weather", f"{S}[note(text",
]
BAD = [f"{S}[unknown(a=1)]{E}", f'{S}[get_weather(city="Paris")]{E} trailing', f"{S}[note(n=01)]{E}",
       f"{S}[get_weather(city=5)]{E}", f'{S}[get_weather(town="x")]{E}', f"{S}[note()]{E}"]   # these three: with tools


def test_parse_of_a_text_is_llama_servers(servers, sp):
    """llama-server continues an assistant prefill by nothing (its end of turn forced) and parses
    ``<think></think>`` + the prefill; a text it cannot parse is its HTTP 500, content here."""
    cpp = servers("cpp")
    eog = _tok(sp.target, "<|im_end|>")
    fmt = tool_chat_for(sp.target).format
    for choice in ("auto", "none"):
        for text in TEXTS + BAD:
            body = {"messages": USER + [{"role": "assistant", "content": text}], "tools": TOOLS, "max_tokens": 1,
                    "logit_bias": [[eog, 100]], "temperature": 0, "tool_choice": choice, "parallel_tool_calls": True}
            r = _post(cpp, "/v1/chat/completions", body)
            ours = lfm2.parse(PRE + text, fmt, NAMES, calls=choice != "none", tools=TOOLS)
            if text in BAD and choice != "none":
                assert r.status_code == 500 and "does not match" in r.text, (text, r.text)
                assert (ours.content, ours.calls) == (text, []), text
                continue
            assert r.status_code == 200, r.text
            assert _strip_ids(message_json(ours)) == _strip_ids(r.json()["choices"][0]["message"]), (choice, text)


def test_parse_of_what_llama_server_generated_is_its_own(servers, sp):
    """llama-server's own grammar (any argument, any order) on a random target: whatever it wrote,
    our parser splits the raw text as its parser did."""
    cpp = servers("cpp")
    start = _tok(sp.target, S)
    fmt = tool_chat_for(sp.target).format
    seen = 0
    for extra in ({"tool_choice": "auto"}, {"tool_choice": "required"},
                  {"tool_choice": "auto", "parallel_tool_calls": True}):
        body = {"messages": USER, "tools": TOOLS, "max_tokens": N_DECODE, "temperature": 0, "verbose": True,
                "parallel_tool_calls": False, "logit_bias": [[start, 30]], **extra}
        r = _post(cpp, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        j = r.json()
        raw, theirs = j["__verbose"]["content"], j["choices"][0]["message"]
        seen += bool(theirs.get("tool_calls"))
        ours = lfm2.parse(raw, fmt, NAMES, partial=j["choices"][0]["finish_reason"] == "length", tools=TOOLS)
        assert _strip_ids(message_json(ours)) == _strip_ids(theirs), (extra, raw)
    assert seen


# ---- the same grammar, the same tokens ---------------------------------------------------------------
def _plan(sp, choice, tools=TOOLS, messages=USER, parallel=False):
    return tt.planned(sp.target, choice, tools, messages, parallel)


# a random target thinks on and on: pushed to write the call at once, or to close its thought soon
CHOICES = [("required", TOOLS, S), ("required", [WEATHER], "</think>"),
           ({"type": "function", "function": {"name": "note"}}, TOOLS, S), ("auto", TOOLS, S)]


@pytest.mark.parametrize("choice,tools,push", CHOICES, ids=["required", "required-think-weather", "named", "auto"])
def test_constrained_decode_is_llama_cpps_with_and_without_a_draft(servers, sp, choice, tools, push):
    """Our prompt and grammar, decoded by llama-server's /completion, by us in process without a draft,
    and by serve with a random draft verifying every block: the same tokens, and serve's message is
    our parse of them."""
    target = sp.target
    bias = {_tok(target, push): 30.0 if push == S else 12.0}
    plan, toks = _plan(sp, choice, tools=tools)
    cpp = servers("cpp").complete(toks, N_DECODE, logit_bias=[[t, b] for t, b in bias.items()],
                                  **_cpp_grammar_fields(plan, target))
    done = sp.generate(toks, N_DECODE, grammar=plan.compile(target), logit_bias=bias)
    assert done.tokens == cpp["tokens"], (done.text, cpp["content"])
    body = {"messages": USER, "tools": tools, "tool_choice": choice, "max_tokens": N_DECODE, "temperature": 0,
            "parallel_tool_calls": False}
    body["logit_bias"] = [[t, b] for t, b in bias.items()]
    r = _post(servers("draft"), "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice0 = r.json()["choices"][0]
    text = ReplyText(target.token_to_piece, target.is_eog, plan.special_ids(target))
    text.push(cpp["tokens"])
    raw = text.finish()
    parsed = lfm2.parse(raw, plan.fmt, plan.names, partial=choice0["finish_reason"] == "length")
    assert _strip_ids(choice0["message"]) == _strip_ids(message_json(parsed)), raw
    assert parsed.calls and S in raw and (push == S or raw.startswith("<think>")), raw
    if isinstance(choice, dict):
        assert {c.name for c in parsed.calls} == {"note"}
    if choice0["finish_reason"] != "length":
        assert choice0["finish_reason"] == "tool_calls"
        for c in parsed.calls:
            jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])


# ---- end to end against llama-server --jinja ---------------------------------------------------------
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_call_is_llama_server_jinjas(servers, sp, choice):
    """A tool without parameters: our grammar is llama-server's, so both write the same call."""
    body = {"messages": USER, "tools": [PING], "tool_choice": choice, "max_tokens": N, "temperature": 0,
            "parallel_tool_calls": True, "logit_bias": [[_tok(sp.target, S), 30]]}
    theirs = _post(servers("cpp"), "/v1/chat/completions", body)
    assert theirs.status_code == 200, theirs.text
    want = theirs.json()["choices"][0]
    assert want["message"].get("tool_calls"), want
    for which in ("plain", "draft"):
        ours = _post(servers(which), "/v1/chat/completions", body)
        assert ours.status_code == 200, ours.text
        got = ours.json()["choices"][0]
        assert (got["finish_reason"], _strip_ids(got["message"])) == (want["finish_reason"],
                                                                        _strip_ids(want["message"])), ours.text


# ---- streaming, a conversation, a 400, the Python API ------------------------------------------------
def test_streamed_chunks_reassemble_to_the_call_and_the_conversation_goes_on(servers, sp):
    srv = servers("draft")
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {"messages": USER, "tools": [WEATHER, NOTE], "tool_choice": named, "max_tokens": N, "temperature": 0,
            "parallel_tool_calls": True, "logit_bias": [[_tok(sp.target, S), 30]]}
    full = _post(srv, "/v1/chat/completions", body).json()["choices"][0]
    events = sse_json(SESSION.post(srv.url + "/v1/chat/completions", json={**body, "stream": True}, stream=True,
                                   timeout=600))
    tt.check_streamed_call(events, full, reasoning=True)
    call = full["message"]["tool_calls"][0]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    convo = USER + [full["message"], {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 21}'}]
    again = {"messages": convo, "tools": [WEATHER, NOTE]}
    assert _post(srv, "/apply-template", again).json()["prompt"] == \
        _post(servers("cpp"), "/apply-template", again).json()["prompt"]
    second = _post(srv, "/v1/chat/completions", {**body, "messages": convo})
    assert second.status_code == 200, second.text
    msg2 = second.json()["choices"][0]["message"]
    assert msg2.get("tool_calls") and msg2["tool_calls"][0]["id"] != call["id"], second.text


def test_a_schema_we_cannot_write_is_a_400_and_the_server_keeps_serving(servers):
    srv = servers("plain")
    odd = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}
    r = _post(srv, "/v1/chat/completions", {"messages": USER, "tools": [odd], "max_tokens": 4})
    assert r.status_code == 400 and "'odd'" in r.json()["error"]["message"], r.text
    ok = _post(srv, "/v1/chat/completions", {"messages": USER, "tools": [WEATHER], "max_tokens": 2})
    assert ok.status_code == 200 and srv.get("/health").status_code == 200


def test_dspark_python_api_gives_serves_calls(servers, files, sp):
    from pyllama_dspark.integrations.dspark import DSpark

    target, draft, _ = files
    close = _tok(sp.target, "</think>")      # a short thought, then the call
    kw = dict(tools=[WEATHER], tool_choice="required", max_tokens=N, temperature=0, parallel_tool_calls=False)
    theirs = _post(servers("draft"), "/v1/chat/completions",
                   {"messages": USER, "logit_bias": [[close, 12]], **kw}).json()["choices"][0]
    kw["logit_bias"] = {close: 12.0}
    with DSpark(target, draft, n_ctx=2048, n_threads=TEST_THREADS, schedule="off") as ds:
        ours = ds.create_chat_completion(USER, **kw)["choices"][0]
    assert (ours["finish_reason"], _strip_ids(ours["message"])) == (theirs["finish_reason"],
                                                                    _strip_ids(theirs["message"]))
    assert ours["finish_reason"] == "tool_calls"
