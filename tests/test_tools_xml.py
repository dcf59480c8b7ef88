"""Qwen3-Coder XML tool calls (``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>...``:
Qwen3.5 / 3.6, Qwen3-Coder, Nemotron 3 Nano) on ``serve`` and in process,
against llama.cpp's own llama-server ``--jinja`` on random targets carrying the real templates
(``tool_targets.py`` ``qwen35``, ``qwen3coder``, ``nemotron3``; llama-server logs "Using specialized
template: Qwen3-Coder" on each).  References:

* the prompt: llama-server's ``/apply-template`` (tools, calls with string / number / bool / null /
  object arguments, tool results, reasoning, thinking on and off) on all three templates;
* the parser: llama-server's parse of assistant prefills (as content after a closed reasoning block,
  and as reasoning the prompt opened), ``tool_choice`` "none" too, and of what it generated itself;
* the constrained decode: llama-server's ``/completion`` with our prompt tokens and our grammar, ours
  with and without a draft (every block verified): the same tokens;
* the end to end call: llama-server ``--jinja`` with string parameters (its grammar is ours there);
* streaming reassembles to the same call; ``jsonschema`` validates the arguments; the ``DSpark``
  class gives serve's call.
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
from pyllama_dspark.chat import xml_calls
from pyllama_dspark.chat.tool_prompt import ToolChat, tool_chat_for
from pyllama_dspark.chat.tool_grammar import ToolSchemaError
from pyllama_dspark.chat.parse import ReplyDiffer, ReplyText, message_json
from pyllama_dspark.chat.tool_request import check_tools, plan_tools

pytestmark = pytest.mark.slow

NOTE_PARAMS = {"type": "object", "required": ["text", "count"], "properties": {
    "text": {"type": "string"}, "count": {"type": "integer"}, "flag": {"type": "boolean"},
    "meta": {"type": "object", "properties": {"k": {"type": "string", "enum": ["x"]}}, "required": ["k"]},
    "tags": {"type": "array", "items": {"type": "number"}, "maxItems": 2}, "any": {"type": ["string", "number", "null"]}}}
NOTE = {"type": "function", "function": {"name": "note", "description": "Take a note", "parameters": NOTE_PARAMS}}
LEVEL_PARAMS = {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 30]}, "on": {"type": "boolean"}},
                "required": ["level", "on"]}
LEVEL = {"type": "function", "function": {"name": "set_level", "description": "Set the level", "parameters": LEVEL_PARAMS}}
TOOLS = [WEATHER, NOTE]
NAMES = ["get_weather", "note"]
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "note": NOTE_PARAMS, "set_level": LEVEL_PARAMS}
N = 48
OFF = {"enable_thinking": False}
KINDS = ("qwen35", "qwen3coder", "nemotron3")


def _fmt(kind: str):
    return ToolChat(tt.template_text(tt.TARGETS[kind].template), "", "<|im_end|>").format


def _call(i: int, name: str, args: dict) -> dict:
    return {"id": f"call{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _history(content: str = "", reasoning: str = "") -> list:
    args = {"text": 'say "hi"\nnow é', "count": -3, "flag": True, "meta": {"k": "x", "n": None}, "tags": [1.5, 2],
            "any": None}
    msg = {"role": "assistant", "content": content, "tool_calls": [_call(1, "note", args),
                                                                   _call(2, "get_weather", {"city": "Paris", "unit": "c"})]}
    if reasoning:
        msg["reasoning_content"] = reasoning
    return [{"role": "system", "content": "You are terse."}] + USER + [msg] + [
        {"role": "tool", "tool_call_id": "call1", "content": "noted"},
        {"role": "tool", "tool_call_id": "call2", "content": '{"temperature": 21}'}]


# ---- fixtures ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools-xml")
    targets = {k: tt.build(k, d) for k in KINDS}
    return targets, make_test_draft(targets["qwen35"], str(d / "draft-qwen35.gguf"), kind="dspark", seed=5), d


@pytest.fixture(scope="module")
def servers(files, tmp_path_factory):
    from pyllama_dspark.upstream.llama_server import LlamaServer
    from pyllama_dspark.upstream.llama_server_build import ensure_llama_server

    targets, draft, d = files
    logs = tmp_path_factory.mktemp("tools-xml-logs")
    binary = ensure_llama_server()
    up = {}

    def get(which: str):
        if which not in up:
            if which in KINDS:
                up[which] = LlamaServer(binary, targets[which], None, ctx=4096, threads=TEST_THREADS,
                                        extra_args=["--jinja", "--verbose"], trace=False,
                                        log_path=logs / f"ls-{which}.log").start()
                up[which].log = logs / f"ls-{which}.log"
            else:
                up[which] = ServeProcess(targets["qwen35"], draft if which == "draft" else None,
                                         logs / f"serve-{which}.log", n_ctx=4096,
                                         extra=["--schedule", "off"] if which == "draft" else [])
        return up[which]

    yield get
    for s in up.values():
        s.stop()


@pytest.fixture(scope="module")
def sp(files):
    with Speculator(files[0]["qwen35"], None, n_ctx=2048, n_threads=TEST_THREADS) as s:
        yield s


_tok = tt.token_of


# ---- format, grammar and parser in process -----------------------------------------------------------
def test_format_and_the_templates_own_calls_are_in_our_grammar_and_parse_back(sp):
    from pyllama_dspark.llama.grammar import Grammar

    target = sp.target
    chat = tool_chat_for(target)
    assert chat.format.name == "xml" and chat.format.codec == "xml_calls" and chat.format.think == ("<think>", "</think>")
    assert _fmt("nemotron3").think and _fmt("qwen3coder").think is None and _fmt("qwen3coder").codec == "xml_calls"
    assert chat.caps.supports_object_arguments and chat.caps.supports_parallel_tool_calls
    # what the template renders parses back (booleans it writes as True / False: not JSON, left out here)
    args = [{"city": "Lima", "unit": "f"},
            {"text": 'say "hi"\n  now é {}', "count": -3, "tags": [2.5, -1], "meta": {"k": "x"}, "any": 7},
            {"count": 0, "text": "", "any": "free text"}]
    calls = [("get_weather", args[0]), ("note", args[1]), ("note", args[2])]
    msgs = USER + [{"role": "assistant", "content": "", "tool_calls": [_call(i, n, a) for i, (n, a) in enumerate(calls)]}]
    tools = check_tools(TOOLS)
    prompt = chat.render(msgs, tools).prompt
    turn = prompt.index("<|im_start|>assistant")
    reply = prompt[prompt.index("<tool_call>\n<function=", turn):prompt.rindex("</tool_call>") + 12]
    g = xml_calls.grammar(chat.format, tools, "required", True, think=False)
    toks = target.tokenize(reply, False, True)
    with Grammar.compile(g.gbnf, target) as gr:
        assert gr.valid_prefix(toks) == len(toks), (reply, g.gbnf)
    parsed = xml_calls.parse(reply, chat.format, NAMES, tools=tools)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls, reply
    assert parsed.calls[1].arguments == '{"text":"say \\"hi\\"\\n  now é {}","count":-3,"tags":[2.5, -1],' \
                                        '"meta":{"k": "x"},"any":7}'
    for name, a in calls:
        jsonschema.validate(a, SCHEMAS[name])
    # the required parameters in any order, optional ones after them; a number typed as a number
    g2 = xml_calls.grammar(chat.format, tools, {"name": "note"}, True, think=False)
    ok = "<tool_call>\n<function=note>\n<parameter=count>\n5\n</parameter>\n<parameter=text>\nt\n</parameter>\n" \
         "<parameter=flag>\ntrue\n</parameter>\n</function>\n</tool_call>"
    with Grammar.compile(g2.gbnf, target) as gr:
        for text, want in ((ok, True), (ok.replace("\n5\n", '\n"5"\n'), False), (ok.replace("\n5\n", "\n5 \n"), False),
                           (ok.replace("true", "True"), False), ("<tool_call>\n<function=get_weather>\n", False)):
            t = target.tokenize(text, False, True)
            assert (gr.valid_prefix(t) == len(t)) == want, text
    # "auto": lazy at the one-token trigger; Qwen3-Coder also at <function=NAME> (its first call may omit <tool_call>)
    auto = xml_calls.grammar(chat.format, tools, "auto", False)
    assert auto.lazy and auto.words == ("<tool_call>",) and len(target.tokenize("<tool_call>", False, True)) == 1
    coder = xml_calls.grammar(_fmt("qwen3coder"), tools, "auto", True)
    assert coder.words == ("<tool_call>", "<function=get_weather>", "<function=note>")


@pytest.mark.parametrize("params,msg", [
    ({"type": "object", "properties": {"a>b": {"type": "string"}}}, "cannot be written"),
    ({"type": "object", "properties": {"a": {"type": "integer", "$ref": "#/$defs/nope"}}}, "'odd'"),
    ({"type": "object", "properties": {"a": {"enum": []}}}, "admits no value"),
    ({"type": "string"}, "must be an object"),
])
def test_a_schema_we_cannot_write_is_a_tool_schema_error_naming_the_tool(params, msg):
    tools = check_tools([{"type": "function", "function": {"name": "odd", "parameters": params}}])
    with pytest.raises(ToolSchemaError, match=f"'odd'.*{msg}|{msg}"):
        xml_calls.grammar(_fmt("qwen35"), tools, "required", False)


STREAM = ("hm </think>\n\nOk <tool_call>\n<function=note>\n<parameter=text>\na \"q\"\n\n</parameter>\n"
          "<parameter=count>\n-12\n</parameter>\n<parameter=meta>\n{\"k\": \"x\"}\n</parameter>\n<parameter=any>\n"
          "null\n</parameter>\n<parameter=any>\n1.5e3x\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
          "<function=get_weather>\n<parameter=unit>\nf\n</parameter>\n<parameter=city>\nLima\n</parameter>\n"
          "</function>\n</tool_call>")


def test_partial_parses_stream_to_the_final_parse():
    """Every prefix of a reply: content / reasoning / arguments only grow, and the deltas add up."""
    fmt = _fmt("qwen35")
    tools = check_tools(TOOLS)
    parse = lambda *a, **k: xml_calls.parse(*a, tools=tools, **k)   # noqa: E731
    d = ReplyDiffer(fmt, NAMES, parse=parse)
    text = STREAM
    merged = tt.merge_deltas(x for k in range(1, len(text) + 1) for x in d.update(text[:k], final=k == len(text))[1])
    args = {i: c["arguments"] for i, c in merged["tool_calls"].items()}
    final = parse(text, fmt, NAMES)
    assert (merged["content"], merged["reasoning_content"]) == (final.content, final.reasoning) == ("Ok ", "hm ")
    assert [args[i] for i in sorted(args)] == [c.arguments for c in final.calls]
    assert json.loads(final.calls[0].arguments) == {"text": 'a "q"\n', "count": -12, "meta": {"k": "x"}, "any": "1.5e3x"}
    assert final.calls[0].arguments.endswith(',"any":null,"any":"1.5e3x"}')   # repeats kept, as llama-server
    assert json.loads(final.calls[1].arguments) == {"unit": "f", "city": "Lima"}


def test_any_text_parses_and_streams_without_error():
    """Where no grammar ran the text is arbitrary: any text parses in any cut, the streamed deltas
    reassemble to the stream's last message, and that is the text's parse unless a call already sent
    turned out not to be one."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    tools = check_tools(TOOLS)
    pieces = st.sampled_from(["<tool_call>\n", "<tool_call>", "<function=", "note>\n", "get_weather>\n", "nope>",
                              "<parameter=", "text>\n", "count>\n", "any>\n", "city>\n", "\n</parameter>\n", "</param",
                              "</function>\n", "</tool_call>", "</think>", "<think>", "x", " ", "\n", "1", "-", "{",
                              "}", '"', "true", "nul", "[1, 2]", '{"k": "x"}',
                              "<tool_call>\n<function=note>\n<parameter=count>\n1\n</parameter>\n<parameter=text>\n"
                              "t\n</parameter>\n</function>\n</tool_call>"])

    @settings(max_examples=200, deadline=None)
    @given(st.lists(pieces, max_size=30), st.integers(1, 5), st.sampled_from(["qwen35", "qwen3coder"]),
           st.booleans())
    def check(parts, step, kind, opened):
        fmt = _fmt(kind)
        text = "".join(parts)
        parse = lambda *a, **k: xml_calls.parse(*a, tools=tools, **k)   # noqa: E731
        final = parse(text, fmt, NAMES, lstrip=opened)
        d = ReplyDiffer(fmt, NAMES, lstrip=opened, parse=parse)
        merged = tt.merge_deltas(delta for k in list(range(step, len(text), step)) + [len(text)]
                                 for delta in d.update(text[:k], final=k == len(text))[1])
        args = {i: c["arguments"] for i, c in merged["tool_calls"].items()}
        last = d.prev
        assert (merged["content"], merged["reasoning_content"]) == (last.content, last.reasoning), text
        assert [args[i] for i in sorted(args)] == [c.arguments for c in last.calls], text
        if len(final.calls) >= len(args):
            assert (last.content, last.reasoning, [(c.name, c.arguments) for c in last.calls]) == \
                (final.content, final.reasoning, [(c.name, c.arguments) for c in final.calls]), text

    check()


# ---- the prompt --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_prompt_with_tools_and_tool_turns_is_llama_servers(servers, kind):
    """Our rendering (the tool path :func:`plan_tools` takes) is llama-server's /apply-template, and
    llama-server picked its Qwen3-Coder handler for the template."""
    cpp = servers(kind)
    chat = ToolChat(tt.template_text(tt.TARGETS[kind].template), "", "<|im_end|>")
    convo = _history("Let me check.", "Need the weather.") + [{"role": "assistant", "content": "It is 21 C."},
                                                              {"role": "user", "content": "And Lima?"}]
    for msgs, kw in ((USER, None), (_history(), None), (_history(), OFF), (convo, None), (convo, OFF),
                     (_history("", "Need two tools."), None)):
        body = {"messages": msgs, "tools": TOOLS, **({"chat_template_kwargs": kw} if kw else {})}
        theirs = _post(cpp, "/apply-template", body)
        assert theirs.status_code == 200, theirs.text
        assert plan_tools(chat, msgs, check_tools(TOOLS), "auto", None, kw).prompt == theirs.json()["prompt"], (kind, kw)
    assert "Using specialized template: Qwen3-Coder" in cpp.log.read_text(errors="replace")


def test_serves_prompt_is_llama_servers(servers):
    ours, cpp = servers("plain"), servers("qwen35")
    for body in ({"messages": _history(), "tools": TOOLS}, {"messages": USER, "tools": TOOLS, "tool_choice": "none"},
                 {"messages": _history("x", "r"), "tools": [WEATHER], "chat_template_kwargs": OFF}):
        a, b = _post(ours, "/apply-template", body), _post(cpp, "/apply-template", body)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        assert a.json()["prompt"] == b.json()["prompt"], body


# ---- the parser --------------------------------------------------------------------------------------
def _xml(name: str, *kv, close: bool = True) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in kv)
    return f"<tool_call>\n<function={name}>\n{body}" + ("</function>\n</tool_call>" if close else "")


TEXTS = [   # (kind, text, as reasoning the prompt opened)
    ("qwen35", _xml("get_weather", ("city", "Paris"), ("unit", "c")), False),
    ("qwen35", "Sure.\n\n" + _xml("note", ("count", "3"), ("text", "a\n b "), ("flag", "false")) + " trailing", False),
    ("qwen35", "hmm\n</think>\n\nAnswer  ", True),
    ("qwen35", "hmm, no close", True),
    ("qwen35", "  hmm " + _xml("note", ("text", "x"), ("count", "1")) + "\n", True),
    ("qwen35", _xml("note", ("flag", "true"), ("text", "x"), ("count", "1")), False),        # optional first
    ("qwen35", _xml("note", ("text", "t"), ("count", "2"), ("any", "3.5"), ("meta", '{"k": "x"}'), ("any", "null"),
                    ("any", "abc"), ("any", "3 "), ("any", '"s"'), ("tags", "[1, 2.5]")), False),
    ("qwen35", _xml("note", ("text", "t"), ("count", "2 ")), False),                          # not JSON
    ("qwen35", _xml("note", ("text", "t"), ("count", '"2"')), False),                         # JSON, not typed
    ("qwen35", _xml("note", ("text", "t"), ("count", "1"), ("flag", "True")), False),         # as templates write it
    ("qwen35", "A" + _xml("nope", ("city", "Paris")), False),
    ("qwen35", _xml("get_weather", ("city", "</parameter>"), ("unit", "")), False),
    ("qwen35", _xml("get_weather", ("city", "Par"), close=False)[:-14], False),               # cut off
    ("qwen35", _xml("note", ("text", "t"), ("count", "12"), close=False)[:-14], False),
    ("qwen35", _xml("get_weather", ("city", "P"), ("unit", "c")) [:-5], False),
    ("qwen35", "a</think>b</think>c<tool_call>", True),
    ("qwen35", "  lead " + _xml("get_weather", ("city", "a"), ("unit", "c")) + "\n\n"
     + _xml("get_weather", ("unit", "f"), ("city", " b ")) + "\n" + _xml("get_weather"), False),
    ("qwen3coder", _xml("get_weather", ("city", "x"), ("unit", "c"))[12:] + "\n" + _xml("note", ("text", "y"),
                                                                                         ("count", "0")), False),
    ("qwen3coder", "x <function=note> " + _xml("note", ("text", "y"), ("count", "0"))[12:], False),
    ("nemotron3", "r\n</think>\n  A " + _xml("get_weather", ("city", '"q" \\ é\t😀'), ("unit", "")), True),
    ("nemotron3", "  x " + _xml("note", ("text", "t"), ("count", "-0.5e2"), ("meta", '{"k":[true, {}]}')), False),
]


def _prefill(cpp, target, kind: str, text: str, opened: bool, choice: str):
    """llama-server continues an assistant prefill by nothing (its end of turn forced) and parses it:
    as content after the reasoning block its prompt closed, or as the reasoning it opened."""
    msg = {"role": "assistant", "content": "" if opened else text}
    if opened:
        msg["reasoning_content"] = text
    body = {"messages": USER + [msg], "tools": TOOLS, "max_tokens": 1, "temperature": 0, "tool_choice": choice,
            "logit_bias": [[_tok(target, "<|im_end|>"), 100]]}
    r = _post(cpp, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def test_parse_of_a_text_is_llama_servers(servers, sp):
    tools = check_tools(TOOLS)
    for kind, text, opened in TEXTS:
        fmt = _fmt(kind)
        for choice in ("auto", "none"):
            theirs = _prefill(servers(kind), sp.target, kind, text, opened, choice)
            ours = message_json(xml_calls.parse(text, fmt, NAMES, lstrip=opened, calls=choice == "auto", tools=tools))
            assert _strip_ids(ours) == _strip_ids(theirs), (kind, choice, text)


def test_parse_of_what_llama_server_generated_is_its_own(servers, sp):
    """llama-server's own grammar on a random target: whatever it wrote, our parser splits the raw
    text as its parser did."""
    start = _tok(sp.target, "<tool_call>")
    tools = check_tools(TOOLS)
    cases = [("qwen35", {"tool_choice": "auto", "logit_bias": [[start, 30]], "chat_template_kwargs": OFF}),
             ("qwen35", {"tool_choice": "required", "chat_template_kwargs": OFF}),
             ("qwen35", {"tool_choice": "auto", "parallel_tool_calls": True, "max_tokens": 24}),
             ("qwen3coder", {"tool_choice": "required", "logit_bias": [[start, 30]]}),
             ("nemotron3", {"tool_choice": "required", "logit_bias": [[start, 30]], "chat_template_kwargs": OFF})]
    seen = 0
    for kind, extra in cases:
        body = {"messages": USER, "tools": TOOLS, "max_tokens": N, "temperature": 0, "verbose": True,
                "parallel_tool_calls": False, **extra}
        r = _post(servers(kind), "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        j = r.json()
        raw, theirs = j["__verbose"]["content"], j["choices"][0]["message"]
        seen += bool(theirs.get("tool_calls"))
        opened = _fmt(kind).think is not None and "chat_template_kwargs" not in extra
        ours = message_json(xml_calls.parse(raw, _fmt(kind), NAMES, partial=j["choices"][0]["finish_reason"] == "length",
                                            lstrip=opened, tools=tools))
        assert _strip_ids(ours) == _strip_ids(theirs), (kind, extra, raw)
    assert seen


# ---- the same grammar, the same tokens ---------------------------------------------------------------
def _plan(sp, choice, kw=None, tools=TOOLS, messages=USER, parallel=False):
    return tt.planned(sp.target, choice, tools, messages, parallel, kw)


CHOICES = [("required", OFF, TOOLS), ("required", None, [LEVEL, NOTE]),
           ({"type": "function", "function": {"name": "note"}}, OFF, TOOLS), ("auto", OFF, TOOLS)]


@pytest.mark.parametrize("choice,kw,tools", CHOICES, ids=["required", "required-thinking", "named", "auto"])
def test_constrained_decode_is_llama_cpps_with_and_without_a_draft(servers, sp, choice, kw, tools):
    """Our prompt and grammar, decoded by llama-server's /completion, by us in process without a draft,
    and by serve with a random draft verifying every block: the same tokens, and serve's message is
    our parse of them."""
    target = sp.target
    start, close = _tok(target, "<tool_call>"), _tok(target, "</tool_call>")
    bias = {start: 30.0, close: 8.0}
    plan, toks = _plan(sp, choice, kw, tools=tools)
    cpp = servers("qwen35").complete(toks, N, logit_bias=[[t, b] for t, b in bias.items()],
                                     **_cpp_grammar_fields(plan, target))
    done = sp.generate(toks, N, grammar=plan.compile(target), logit_bias=bias)
    assert done.tokens == cpp["tokens"], (done.text, cpp["content"])
    body = {"messages": USER, "tools": tools, "tool_choice": choice, "max_tokens": N, "temperature": 0,
            "parallel_tool_calls": False, "logit_bias": [[t, b] for t, b in bias.items()]}
    if kw:
        body["chat_template_kwargs"] = kw
    r = _post(servers("draft"), "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice0 = r.json()["choices"][0]
    text = ReplyText(target.token_to_piece, target.is_eog, plan.special_ids(target))
    text.push(cpp["tokens"])
    raw = text.finish()
    parsed = xml_calls.parse(raw, plan.fmt, plan.names, partial=choice0["finish_reason"] == "length",
                             lstrip=plan.lstrip, tools=plan.tools)
    assert _strip_ids(choice0["message"]) == _strip_ids(message_json(parsed)), raw
    assert parsed.calls and "<tool_call>\n<function=" in raw, raw
    if isinstance(choice, dict):
        assert {c.name for c in parsed.calls} == {"note"}
    if choice0["finish_reason"] != "length":
        assert choice0["finish_reason"] == "tool_calls"
        for c in parsed.calls:
            jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])


# ---- end to end against llama-server --jinja ---------------------------------------------------------
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_call_is_llama_server_jinjas(servers, sp, choice):
    """String parameters (raw text in both grammars): both write the same call."""
    start, close = _tok(sp.target, "<tool_call>"), _tok(sp.target, "</tool_call>")
    body = {"messages": USER, "tools": [WEATHER], "tool_choice": choice, "max_tokens": N, "temperature": 0,
            "parallel_tool_calls": False, "logit_bias": [[start, 30], [close, 8]], "chat_template_kwargs": OFF}
    theirs = _post(servers("qwen35"), "/v1/chat/completions", body)
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
    close = _tok(sp.target, "</tool_call>")
    body = {"messages": USER, "tools": [LEVEL], "tool_choice": "required", "max_tokens": 2 * N, "temperature": 0,
            "parallel_tool_calls": False, "chat_template_kwargs": OFF, "logit_bias": [[close, 8]]}
    full = _post(srv, "/v1/chat/completions", body).json()["choices"][0]
    events = sse_json(SESSION.post(srv.url + "/v1/chat/completions", json={**body, "stream": True}, stream=True,
                                   timeout=600))
    tt.check_streamed_call(events, full)
    call = full["message"]["tool_calls"][0]
    jsonschema.validate(json.loads(call["function"]["arguments"]), LEVEL_PARAMS)
    convo = USER + [full["message"], {"role": "tool", "tool_call_id": call["id"], "content": "done"}]
    again = {"messages": convo, "tools": [LEVEL], "chat_template_kwargs": OFF}
    assert _post(srv, "/apply-template", again).json()["prompt"] == \
        _post(servers("qwen35"), "/apply-template", again).json()["prompt"]
    second = _post(srv, "/v1/chat/completions", {**body, "messages": convo})
    assert second.status_code == 200, second.text
    msg2 = second.json()["choices"][0]["message"]
    assert msg2.get("tool_calls") and msg2["tool_calls"][0]["id"] != call["id"], second.text


def test_a_schema_the_format_cannot_write_is_a_400_and_the_server_keeps_serving(servers):
    srv = servers("plain")
    odd = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"a>b": {"type": "string"}}}}}
    r = _post(srv, "/v1/chat/completions", {"messages": USER, "tools": [odd], "max_tokens": 4})
    assert r.status_code == 400 and "'odd'" in r.json()["error"]["message"], r.text
    ok = _post(srv, "/v1/chat/completions", {"messages": USER, "tools": [WEATHER], "max_tokens": 2,
                                             "chat_template_kwargs": OFF})
    assert ok.status_code == 200 and srv.get("/health").status_code == 200


def test_dspark_python_api_gives_serves_calls(servers, files, sp):
    from pyllama_dspark.integrations.dspark import DSpark

    targets, draft, _ = files
    kw = dict(tools=[LEVEL], tool_choice="required", max_tokens=2 * N, temperature=0, parallel_tool_calls=False,
              chat_template_kwargs=OFF, logit_bias={str(_tok(sp.target, "</tool_call>")): 8})
    theirs = _post(servers("draft"), "/v1/chat/completions", {"messages": USER, **kw}).json()["choices"][0]
    with DSpark(targets["qwen35"], draft, n_ctx=2048, n_threads=TEST_THREADS, schedule="off") as ds:
        ours = ds.create_chat_completion(USER, **kw)["choices"][0]
        streamed = tt.merge_deltas(ch["choices"][0]["delta"]
                                   for ch in ds.create_chat_completion(USER, stream=True, **kw))
    assert (ours["finish_reason"], _strip_ids(ours["message"])) == (theirs["finish_reason"],
                                                                    _strip_ids(theirs["message"]))
    assert ours["finish_reason"] == "tool_calls" and ours["message"]["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"].values()] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in ours["message"]["tool_calls"]]
