"""Gemma 4 tool calls (``<|tool_call>call:name{key:<|"|>value<|"|>}<tool_call|>``) on ``serve`` and in
process, against llama.cpp's own llama-server ``--jinja`` on the same random target (``tool_targets.py``
``gemma4``: the real Gemma 4 template and its special tokens, the visible ones user-defined as in
llama.cpp's converter).  References:

* the prompt: llama-server's ``/apply-template`` (tools, a call and its result, thinking off, an older
  template whose conversation llama.cpp rewrites);
* the parser: llama-server's parse of an assistant prefill, and of what it generated itself;
* the constrained decode: llama-server's ``/completion`` with our prompt tokens and our grammar, ours
  with and without a draft (every block verified): the same tokens;
* the end to end call: llama-server ``--jinja`` with a free-form tool (``{"type": "object"}``), where
  our grammar is llama-server's (its Gemma 4 grammar ignores the parameters schema; ours follows it,
  docs/serve.md "Tools");
* streaming reassembles to the same call; ``jsonschema`` validates the arguments.
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
from pyllama_dspark.chat import gemma4
from pyllama_dspark.chat.tool_prompt import ToolChat, tool_chat_for
from pyllama_dspark.chat.tool_grammar import ToolSchemaError
from pyllama_dspark.chat.parse import ReplyDiffer, ReplyText, message_json
from pyllama_dspark.chat.tool_request import check_tools, plan_tools

pytestmark = pytest.mark.slow

Q = '<|"|>'
NOTE_PARAMS = {"type": "object", "required": ["text", "flag"], "properties": {
    "text": {"type": "string"}, "count": {"type": "integer"}, "score": {"type": "number"},
    "flag": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]},
                                          "maxItems": 2},
    "meta": {"type": "object", "properties": {"k": {"type": "string", "enum": ["x"]}, "v": {"type": ["number", "null"]}},
             "required": ["v"]}}}
NOTE = {"type": "function", "function": {"name": "note", "description": "Take a note", "parameters": NOTE_PARAMS}}
FREE = {"type": "function", "function": {"name": "log_event", "description": "Log anything",
                                         "parameters": {"type": "object"}}}
TOOLS = [WEATHER, NOTE]
NAMES = ["get_weather", "note"]
N = 64
OFF = {"enable_thinking": False}


def _history(content: str = "") -> list:
    call = {"id": "call1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"unit": "c", "city": "Paris", '
                                                                        '"opt": null, "more": [1.5, null, true]}'}}
    return [{"role": "system", "content": "You are terse."}] + USER + [
        {"role": "assistant", "content": content, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call1", "content": '{"temperature": 21, "sky": "clear"}'}]


# ---- fixtures ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools-gemma4")
    target = tt.build("gemma4", d)
    return target, make_test_draft(target, str(d / "draft-gemma4.gguf"), kind="dspark", seed=5), d


@pytest.fixture(scope="module")
def servers(files, tmp_path_factory):
    from pyllama_dspark.upstream.llama_server import LlamaServer
    from pyllama_dspark.upstream.llama_server_build import ensure_llama_server

    target, draft, d = files
    logs = tmp_path_factory.mktemp("tools-gemma4-logs")
    binary = ensure_llama_server()
    up = {}

    def get(which: str):
        if which not in up:
            if which == "cpp":
                up[which] = LlamaServer(binary, target, None, ctx=4096, threads=TEST_THREADS, extra_args=["--jinja"],
                                        trace=False, log_path=logs / "ls.log").start()
            elif which == "cpp-interleaved":
                tpl = tt.templates_dir() / "google-gemma-4-31B-it-interleaved.jinja"
                up[which] = LlamaServer(binary, target, None, ctx=4096, threads=TEST_THREADS, trace=False,
                                        extra_args=["--jinja", "--chat-template-file", str(tpl)],
                                        log_path=logs / "ls-interleaved.log").start()
            else:
                up[which] = ServeProcess(target, draft if which == "draft" else None, logs / f"serve-{which}.log",
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
def test_the_templates_own_calls_are_in_our_grammar_and_parse_back(sp):
    from pyllama_dspark.llama.grammar import Grammar

    target = sp.target
    chat = tool_chat_for(target)
    assert chat.format.name == "gemma4" and chat.format.codec == "gemma4"
    assert chat.caps.supports_object_arguments and chat.caps.supports_parallel_tool_calls
    args = [{"city": "Lima", "unit": "f"},
            {"text": 'say "hi"\nnow é', "flag": True, "count": -3, "score": 2.5, "tags": ["b", "a"],
             "meta": {"v": -0.5, "k": "x"}},
            {"flag": False, "text": "", "meta": {"v": 1e-3}}]
    calls = [("get_weather", args[0]), ("note", args[1]), ("note", args[2])]
    msgs = USER + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(calls)]}]
    prompt = chat.render(msgs, check_tools(TOOLS)).prompt
    reply = prompt[prompt.index(gemma4.CALL_OPEN):prompt.rindex(gemma4.CALL_CLOSE) + 12]
    g = gemma4.grammar(chat.format, check_tools(TOOLS), "required", True)
    toks = target.tokenize(reply, False, True)
    with Grammar.compile(g.gbnf, target) as gr:
        assert gr.valid_prefix(toks) == len(toks), (reply, g.gbnf)
    parsed = gemma4.parse(reply, chat.format, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls, reply
    for (name, a), c in zip(calls, parsed.calls):
        jsonschema.validate(json.loads(c.arguments), {"get_weather": WEATHER, "note": NOTE}[name]["function"]["parameters"])
    # one call of the named tool; "auto": lazy at the one-token trigger
    named = gemma4.grammar(chat.format, check_tools(TOOLS), {"name": "note"}, True)
    assert "get_weather" not in named.gbnf and "one-call one-call*" not in named.gbnf
    auto = gemma4.grammar(chat.format, check_tools(TOOLS), "auto", False)
    assert auto.lazy and auto.words == ("<|tool_call>",) and len(target.tokenize("<|tool_call>", False, True)) == 1


def test_refs_and_recursion_in_a_schema(sp):
    """Local $refs ($defs, and "#" itself: a tree) become rules; a reply of that shape is in the grammar."""
    from pyllama_dspark.llama.grammar import Grammar

    params = {"type": "object", "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                 "required": ["x"]}},
              "properties": {"at": {"$ref": "#/$defs/pt"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
              "required": ["at"]}
    tools = check_tools([{"type": "function", "function": {"name": "tree", "parameters": params}}])
    fmt = tool_chat_for(sp.target).format
    g = gemma4.grammar(fmt, tools, "required", False)
    reply = "<|tool_call>call:tree{at:{x:1},kids:[{at:{x:-2}},{at:{x:3},kids:[]}]}<tool_call|>"
    toks = sp.target.tokenize(reply, False, True)
    with Grammar.compile(g.gbnf, sp.target) as gr:
        assert gr.valid_prefix(toks) == len(toks), g.gbnf
    args = json.loads(gemma4.parse(reply, fmt, ["tree"]).calls[0].arguments)
    assert args == {"at": {"x": 1}, "kids": [{"at": {"x": -2}}, {"at": {"x": 3}, "kids": []}]}
    jsonschema.validate(args, params)


@pytest.mark.parametrize("params,msg", [
    ({"type": "object", "properties": {"a:b": {"type": "string"}}}, "cannot be written"),
    ({"type": "object", "properties": {"a": {"allOf": [{"type": "string"}]}}}, "allOf"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
    ({"type": "object", "properties": {"a": {"type": "array", "minItems": 1000}}}, "minItems"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}, "unresolved"),
    ({"type": "string"}, "must be an object"),
])
def test_a_schema_we_cannot_write_is_a_tool_schema_error_naming_the_tool(params, msg):
    chat = ToolChat(tt.template_text("google-gemma-4-31B-it.jinja"), "<bos>", "<turn|>")
    tools = check_tools([{"type": "function", "function": {"name": "odd", "parameters": params}}])
    with pytest.raises(ToolSchemaError, match=f"'odd'.*{msg}"):
        gemma4.grammar(chat.format, tools, "required", False)


def test_partial_parses_stream_to_the_final_parse():
    """Every prefix of a reply: content / reasoning / arguments only grow, and the deltas add up."""
    fmt = ToolChat(tt.template_text("google-gemma-4-31B-it.jinja"), "<bos>", "<turn|>").format
    text = (f'<|channel>thought\nhm<channel|>Ok <|tool_call>call:note{{text:{Q}a "q"\n{Q},count:-12,'
            f'meta:{{v:null}},tags:[{Q}a{Q},{Q}b{Q}],flag:true}}<tool_call|><|tool_call>call:get_weather'
            f'{{city:{Q}Lima{Q},unit:{Q}f{Q}}}<tool_call|>')
    d = ReplyDiffer(fmt, NAMES, parse=gemma4.parse)
    merged = tt.merge_deltas(x for k in range(1, len(text) + 1) for x in d.update(text[:k], final=k == len(text))[1])
    got = {"content": merged["content"], "reasoning_content": merged["reasoning_content"]}
    args = {i: c["arguments"] for i, c in merged["tool_calls"].items()}
    final = gemma4.parse(text, fmt, NAMES)
    assert got == {"content": final.content, "reasoning_content": final.reasoning} == {"content": "Ok ",
                                                                                        "reasoning_content": "hm"}
    assert [args[i] for i in sorted(args)] == [c.arguments for c in final.calls]
    assert json.loads(final.calls[0].arguments) == {"text": 'a "q"\n', "count": -12, "meta": {"v": None},
                                                    "tags": ["a", "b"], "flag": True}


def test_any_text_parses_and_streams_without_error():
    """Where no grammar ran the text is arbitrary: any text parses in any cut, the streamed deltas
    reassemble to the stream's last message, and that is the text's parse unless a call already sent
    turned out not to be one."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    fmt = ToolChat(tt.template_text("google-gemma-4-31B-it.jinja"), "<bos>", "<turn|>").format
    pieces = st.sampled_from(["<|tool_call>call:", "note", "nope", "{", "}", Q, "x", ":", ",", "[", "]", " ", "\n",
                              "1", "-", ".", "e", "true", "nul", "<tool_call|>", "<|channel>", "thought", "<channel|>",
                              '"', "\\", "<|", f"<|tool_call>call:note{{text:{Q}a{Q},flag:true}}<tool_call|>"])

    @settings(max_examples=300, deadline=None)
    @given(st.lists(pieces, max_size=30), st.integers(1, 5))
    def check(parts, step):
        text = "".join(parts)
        final = gemma4.parse(text, fmt, ["note"])
        d = ReplyDiffer(fmt, ["note"], parse=gemma4.parse)
        merged = tt.merge_deltas(delta for k in list(range(step, len(text), step)) + [len(text)]
                                 for delta in d.update(text[:k], final=k == len(text))[1])
        got = {"content": merged["content"], "reasoning_content": merged["reasoning_content"]}
        args = {i: c["arguments"] for i, c in merged["tool_calls"].items()}
        last = d.prev
        assert got == {"content": last.content, "reasoning_content": last.reasoning}, text
        assert [args[i] for i in sorted(args)] == [c.arguments for c in last.calls], text
        if len(final.calls) >= len(args):
            assert (last.content, last.reasoning, [(c.name, c.arguments) for c in last.calls]) == \
                (final.content, final.reasoning, [(c.name, c.arguments) for c in final.calls]), text

    check()


# ---- the prompt --------------------------------------------------------------------------------------
def test_prompt_with_tools_and_tool_turns_is_llama_servers(servers):
    ours, cpp = servers("plain"), servers("cpp")
    convo = _history() + [{"role": "assistant", "content": "It is 21 C."}, {"role": "user", "content": "And Lima?"}]
    reasoning = _history()
    reasoning[2] = {**reasoning[2], "reasoning_content": "Need the weather."}
    for body in ({"messages": USER, "tools": TOOLS}, {"messages": _history(), "tools": TOOLS},
                 {"messages": _history("Let me check."), "tools": TOOLS},     # llama.cpp opens the model turn
                 {"messages": convo, "tools": TOOLS}, {"messages": reasoning, "tools": [WEATHER]},
                 {"messages": USER, "tools": TOOLS, "tool_choice": "none"},
                 {"messages": _history(), "tools": [WEATHER], "chat_template_kwargs": OFF}):
        a, b = _post(ours, "/apply-template", body), _post(cpp, "/apply-template", body)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        assert a.json()["prompt"] == b.json()["prompt"], body


def test_an_older_template_gets_llama_cpps_rewritten_conversation(servers):
    """The interleaved template has no "OpenAI Chat Completions" branch: llama.cpp folds the tool
    results into the assistant turn (convert_tool_responses_gemma4); so do we."""
    chat = ToolChat(tt.template_text("google-gemma-4-31B-it-interleaved.jinja"), "<bos>", "<turn|>")
    assert chat.format.name == "gemma4" and chat.format.codec == "gemma4_legacy"
    cpp = servers("cpp-interleaved")
    convo = _history("Checking.") + [{"role": "assistant", "content": "It is 21 C."},
                                     {"role": "user", "content": "Thanks"}]
    for msgs in (_history(), convo):
        plan = plan_tools(chat, msgs, check_tools(TOOLS), "auto")
        theirs = _post(cpp, "/apply-template", {"messages": msgs, "tools": TOOLS})
        assert plan.prompt == theirs.json()["prompt"]


# ---- the parser --------------------------------------------------------------------------------------
TEXTS = [
    f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},unit:{Q}c{Q}}}<tool_call|>",
    f"Sure. <|tool_call>call:get_weather{{city:{Q}Lima{Q},unit:{Q}f{Q}}}<tool_call|>"
    f"<|tool_call>call:note{{ text: {Q}two{Q} ,\n flag:false }}<tool_call|>",
    f'<|tool_call>call:note{{text:{Q}He said "hi"\\ \n\ttab \x01 é 😀 {{}}:,{Q},flag:true}}<tool_call|>',
    f"<|tool_call>call:note{{meta:{{v:-1.5e+3,k:{Q}x{Q}}},tags:[ {Q}a{Q}, {Q}b{Q} ],count:0,score:0.25,"
    f"flag:false,text:{Q}{Q},extra:[1,[true,null],{{}}]}}<tool_call|>",
    "  Just an answer,\n no call.  ", "x<|channel>thought\nhmm \n<channel|> y",
    f"a<|channel>thought r<channel|>b<channel|>dropped<|tool_call>call:note{{text:{Q}t{Q},flag:true}}<tool_call|>",
    "<|tool_call>call:unknown{a:1}<tool_call|>", "<|tool_call>call:note{text:01}<tool_call|>",
    f"<|tool_call>call:note{{text:{Q}t{Q},flag:true}}<tool_call|> trailing <|tool_call>call:note{{}}<tool_call|>",
    f"<|tool_call>call:note{{text:{Q}cut off", "<|tool_call>call:note{count:12",
]


def test_parse_of_a_text_is_llama_servers(servers, sp):
    """llama-server continues an assistant prefill by nothing (its end of turn forced) and parses it."""
    cpp = servers("cpp")
    eog = _tok(sp.target, "<turn|>")
    fmt = tool_chat_for(sp.target).format
    for text in TEXTS:
        body = {"messages": USER + [{"role": "assistant", "content": text}], "tools": TOOLS, "max_tokens": 1,
                "logit_bias": [[eog, 100]], "temperature": 0}
        r = _post(cpp, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        theirs = r.json()["choices"][0]["message"]
        ours = message_json(gemma4.parse(text, fmt, NAMES))
        assert _strip_ids(ours) == _strip_ids(theirs), text
    for text in TEXTS + NONE_TEXTS:    # tool_choice "none": thoughts split, calls left in content
        body = {"messages": USER + [{"role": "assistant", "content": text}], "tools": TOOLS, "max_tokens": 1,
                "logit_bias": [[eog, 100]], "temperature": 0, "tool_choice": "none"}
        r = _post(cpp, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        assert message_json(gemma4.parse(text, fmt, NAMES, calls=False)) == r.json()["choices"][0]["message"], text


NONE_TEXTS = ["<|channel>thought\nhmm \n<channel|>Answer", "x<|channel>thought\nhmm \n<channel|> y<|channel>thought z<channel|>w",
              f"<|channel>thought\nr<channel|>Sure <|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|> more",
              "<|channel>other<|channel>thought t<channel|>c", "a<channel|>dropped"]
NONE_BIAS = [[["<|channel>", 10]], [["<|channel>", 9], ["thought", 8]], [["<|tool_call>", 20]]]


def test_tool_choice_none_reply_is_llama_servers_and_streams_to_it(servers, sp):
    """tool_choice "none", greedy: serve's message is llama-server's (a thought split into
    reasoning_content, a call written as text left in content, a reply that parses to nothing given
    whole), and its streamed deltas reassemble to it."""
    ours, cpp = servers("plain"), servers("cpp")
    thoughts = 0
    for bias in NONE_BIAS:
        lb = [[sp.target.tokenize(t, False, True)[0], v] for t, v in bias]
        body = {"messages": USER, "tools": TOOLS, "tool_choice": "none", "max_tokens": N, "temperature": 0,
                "logit_bias": lb}
        a, b = _post(ours, "/v1/chat/completions", body), _post(cpp, "/v1/chat/completions", body)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        mine, theirs = a.json()["choices"][0], b.json()["choices"][0]
        assert mine["message"] == theirs["message"] and mine["finish_reason"] == theirs["finish_reason"], bias
        thoughts += bool(mine["message"].get("reasoning_content"))
        events = sse_json(SESSION.post(ours.url + "/v1/chat/completions", json={**body, "stream": True}, stream=True,
                                       timeout=600))
        assert tt.streamed_text(events[:-1]) == tt.message_text(mine["message"]), bias
    assert thoughts


def test_parse_of_what_llama_server_generated_is_its_own(servers, sp):
    """llama-server's own grammar (any dict, any whitespace) on a random target: whatever it wrote,
    our parser splits the raw text as its parser did."""
    cpp = servers("cpp")
    start = _tok(sp.target, "<|tool_call>")
    fmt = tool_chat_for(sp.target).format
    cases = [{"tool_choice": "auto", "logit_bias": [[start, 30]]}, {"tool_choice": "required"},
             {"tool_choice": "required", "logit_bias": [[start, 30]], "chat_template_kwargs": OFF},
             {"tool_choice": "auto", "parallel_tool_calls": True, "logit_bias": [[start, 30]]}]
    seen = 0
    for extra in cases:
        body = {"messages": USER, "tools": TOOLS, "max_tokens": N, "temperature": 0, "verbose": True,
                "parallel_tool_calls": False, **extra}
        r = _post(cpp, "/v1/chat/completions", body)
        if r.status_code != 200:
            assert "does not match" in r.text, r.text
            continue
        j = r.json()
        raw, theirs = j["__verbose"]["content"], j["choices"][0]["message"]
        seen += bool(theirs.get("tool_calls"))
        ours = message_json(gemma4.parse(raw, fmt, NAMES, partial=j["choices"][0]["finish_reason"] == "length"))
        assert _strip_ids(ours) == _strip_ids(theirs), (extra, raw)
    assert seen


# ---- the same grammar, the same tokens ---------------------------------------------------------------
def _plan(sp, choice, kw=None, tools=TOOLS, messages=USER, parallel=False):
    return tt.planned(sp.target, choice, tools, messages, parallel, kw)


CHOICES = [("required", OFF, TOOLS), ("required", None, [WEATHER]),
           ({"type": "function", "function": {"name": "note"}}, OFF, TOOLS), ("auto", OFF, TOOLS)]


@pytest.mark.parametrize("choice,kw,tools", CHOICES, ids=["required", "required-thinking-weather", "named", "auto"])
def test_constrained_decode_is_llama_cpps_with_and_without_a_draft(servers, sp, choice, kw, tools):
    """Our prompt and grammar, decoded by llama-server's /completion, by us in process without a draft,
    and by serve with a random draft verifying every block: the same tokens, and serve's message is
    our parse of them (a random target writes runaway strings: a call cut off by max_tokens is sent
    as it stands, as llama-server does)."""
    target = sp.target
    start = _tok(target, "<|tool_call>")
    bias = {start: 30.0} if choice == "auto" else None
    plan, toks = _plan(sp, choice, kw, tools=tools)
    cpp = servers("cpp").complete(toks, N, logit_bias=[[t, b] for t, b in (bias or {}).items()],
                                  **_cpp_grammar_fields(plan, target))
    done = sp.generate(toks, N, grammar=plan.compile(target), logit_bias=bias)
    assert done.tokens == cpp["tokens"], (done.text, cpp["content"])
    body = {"messages": USER, "tools": tools, "tool_choice": choice, "max_tokens": N, "temperature": 0,
            "parallel_tool_calls": False}
    if kw:
        body["chat_template_kwargs"] = kw
    if bias:
        body["logit_bias"] = [[t, b] for t, b in bias.items()]
    r = _post(servers("draft"), "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice0 = r.json()["choices"][0]
    text = ReplyText(target.token_to_piece, target.is_eog, plan.special_ids(target))
    text.push(cpp["tokens"])
    raw = text.finish()
    parsed = gemma4.parse(raw, plan.fmt, plan.names, partial=choice0["finish_reason"] == "length")
    assert _strip_ids(choice0["message"]) == _strip_ids(message_json(parsed)), raw
    assert parsed.calls and raw.startswith("<|tool_call>call:"), raw
    if isinstance(choice, dict):
        assert {c.name for c in parsed.calls} == {"note"}
    if choice0["finish_reason"] != "length":
        assert choice0["finish_reason"] == "tool_calls"
        for c in parsed.calls:
            jsonschema.validate(json.loads(c.arguments), {"get_weather": WEATHER, "note": NOTE}[c.name]
                                ["function"]["parameters"])
    if tools == [WEATHER]:
        assert choice0["finish_reason"] == "tool_calls"


# ---- end to end against llama-server --jinja ---------------------------------------------------------
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_call_is_llama_server_jinjas(servers, sp, choice):
    """A free-form tool: our grammar is llama-server's, so both write the same call."""
    start = _tok(sp.target, "<|tool_call>")
    body = {"messages": USER, "tools": [FREE], "tool_choice": choice, "max_tokens": N, "temperature": 0,
            "parallel_tool_calls": False, "logit_bias": [[start, 30]], "chat_template_kwargs": OFF}
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


# ---- streaming, a conversation -----------------------------------------------------------------------
def test_streamed_chunks_reassemble_to_the_call_and_the_conversation_goes_on(servers, sp):
    srv = servers("draft")
    body = {"messages": USER, "tools": [WEATHER], "tool_choice": "required", "max_tokens": N, "temperature": 0,
            "parallel_tool_calls": False, "chat_template_kwargs": OFF}
    full = _post(srv, "/v1/chat/completions", body).json()["choices"][0]
    events = sse_json(SESSION.post(srv.url + "/v1/chat/completions", json={**body, "stream": True}, stream=True,
                                   timeout=600))
    tt.check_streamed_call(events, full)
    call = full["message"]["tool_calls"][0]
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    convo = USER + [full["message"], {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 21}'}]
    again = {"messages": convo, "tools": [WEATHER], "chat_template_kwargs": OFF}
    assert _post(srv, "/apply-template", again).json()["prompt"] == \
        _post(servers("cpp"), "/apply-template", again).json()["prompt"]
    second = _post(srv, "/v1/chat/completions", {**body, "messages": convo,    # not a thought this time
                                                  "logit_bias": [[_tok(sp.target, "<|tool_call>"), 30]]})
    assert second.status_code == 200, second.text
    msg2 = second.json()["choices"][0]["message"]
    assert msg2.get("tool_calls") and msg2["tool_calls"][0]["id"] != call["id"], second.text


def test_a_schema_gemma_cannot_write_is_a_400_and_the_server_keeps_serving(servers):
    srv = servers("plain")
    odd = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"a:b": {"type": "string"}}}}}
    r = _post(srv, "/v1/chat/completions", {"messages": USER, "tools": [odd], "max_tokens": 4})
    assert r.status_code == 400 and "'odd'" in r.json()["error"]["message"], r.text
    ok = _post(srv, "/v1/chat/completions", {"messages": USER, "tools": [WEATHER], "max_tokens": 2,
                                             "chat_template_kwargs": OFF})
    assert ok.status_code == 200 and srv.get("/health").status_code == 200


def test_dspark_python_api_gives_serves_calls(servers, files):
    from pyllama_dspark.integrations.dspark import DSpark

    target, draft, _ = files
    kw = dict(tools=[WEATHER], tool_choice="required", max_tokens=N, temperature=0, parallel_tool_calls=False,
              chat_template_kwargs=OFF)
    theirs = _post(servers("draft"), "/v1/chat/completions", {"messages": USER, **kw}).json()["choices"][0]
    with DSpark(target, draft, n_ctx=2048, n_threads=TEST_THREADS, schedule="off") as ds:
        ours = ds.create_chat_completion(USER, **kw)["choices"][0]
        streamed = tt.merge_deltas(ch["choices"][0]["delta"]
                                   for ch in ds.create_chat_completion(USER, stream=True, **kw))
    assert (ours["finish_reason"], _strip_ids(ours["message"])) == (theirs["finish_reason"],
                                                                    _strip_ids(theirs["message"]))
    assert ours["finish_reason"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"].values()] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in ours["message"]["tool_calls"]]
