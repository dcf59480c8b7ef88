"""DeepSeek V3.1 tool calls (``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``)
on ``serve`` and in process, against llama.cpp's own llama-server ``--jinja`` on a random target carrying
the real template (``tool_targets.py`` ``dsv31``; llama-server builds its parser with its differential
"autoparser" there and logs the markers it found).  References:

* the prompt: llama-server's ``/apply-template`` (calls, tool results, thinking on and off);
* the parser: llama-server's parse of assistant prefills (as content after a closed reasoning block,
  and as the reasoning the prompt opened), ``tool_choice`` "none" too, texts it answers with HTTP 500,
  and of what it generated itself, after a tool result too (where the template opens no turn);
* the constrained decode: llama-server's ``/completion`` with our prompt tokens and our grammar, ours
  with and without a draft (every block verified): the same tokens;
* the end to end call: llama-server ``--jinja`` from inside its calls block (its grammar and ours
  accept the same language there, whitespace tokens held down);
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
from pyllama_dspark.chat import deepseek31 as ds
from pyllama_dspark.chat.tool_prompt import ToolChat, tool_chat_for
from pyllama_dspark.chat.tool_grammar import ToolSchemaError
from pyllama_dspark.chat.parse import ReplyDiffer, ReplyText, message_json
from pyllama_dspark.chat.tool_request import check_tools, plan_tools

pytestmark = pytest.mark.slow

KIND = "dsv31"
EOS = "<｜end▁of▁sentence｜>"
BEGIN, END, CB, CE, SEP = ds.CALLS_BEGIN, ds.CALLS_END, ds.CALL_BEGIN, ds.CALL_END, ds.SEP
NOTE_PARAMS = {"type": "object", "required": ["text", "count"], "properties": {
    "text": {"type": "string"}, "count": {"type": "integer"}, "flag": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "number"}, "maxItems": 2}}}
NOTE = {"type": "function", "function": {"name": "note", "description": "Take a note", "parameters": NOTE_PARAMS}}
LEVEL_PARAMS = {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 30]}, "on": {"type": "boolean"}},
                "required": ["level", "on"]}
LEVEL = {"type": "function", "function": {"name": "set_level", "description": "Set the level", "parameters": LEVEL_PARAMS}}
TOOLS = [WEATHER, NOTE]
NAMES = ["get_weather", "note"]
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "note": NOTE_PARAMS, "set_level": LEVEL_PARAMS}
N = 48
OFF = {"enable_thinking": False}


def _fmt():
    return ToolChat(tt.template_text(tt.TARGETS[KIND].template), "", EOS).format


def _call(i: int, name: str, args: dict) -> dict:
    return {"id": f"call{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _history(content: str = "") -> list:
    msg = {"role": "assistant", "content": content,
           "tool_calls": [_call(1, "note", {"text": 'say "hi"\nnow é', "count": -3, "flag": True, "tags": [1.5, 2]}),
                          _call(2, "get_weather", {"city": "Paris", "unit": "c"})]}
    return [{"role": "system", "content": "You are terse."}] + USER + [msg] + [
        {"role": "tool", "tool_call_id": "call1", "content": "noted"},
        {"role": "tool", "tool_call_id": "call2", "content": '{"temperature": 21}'}]


def _block(*calls, close: bool = True) -> str:
    """A calls block; ``calls``: (name, arguments as JSON text)."""
    return BEGIN + "".join(f"{CB}{n}{SEP}{a}{CE}" for n, a in calls) + (END if close else "")


# ---- fixtures ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools-ds31")
    target = tt.build(KIND, d)
    return target, make_test_draft(target, str(d / "draft-ds31.gguf"), kind="dspark", seed=5), d


@pytest.fixture(scope="module")
def servers(files, tmp_path_factory):
    from pyllama_dspark.upstream.llama_server import LlamaServer
    from pyllama_dspark.upstream.llama_server_build import ensure_llama_server

    target, draft, d = files
    logs = tmp_path_factory.mktemp("tools-ds31-logs")
    up = {}

    def get(which: str):
        if which not in up:
            if which == "cpp":
                up[which] = LlamaServer(ensure_llama_server(), target, None, ctx=4096, threads=TEST_THREADS,
                                        extra_args=["--jinja", "--verbose"], trace=False,
                                        log_path=logs / "ls.log").start()
                up[which].log = logs / "ls.log"
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


_WS: dict = {}


def _calm(target) -> dict:
    """logit_bias: whitespace-only tokens down (a random target otherwise fills every optional
    whitespace of the grammar), the end of turn up a little."""
    if "calm" not in _WS:
        _WS["calm"] = {t: -8.0 for t in tt.whitespace_tokens(target.token_to_piece, 49152)}
        _WS["calm"][tt.token_of(target, EOS)] = 4.0
    return dict(_WS["calm"])


def _tight(target) -> dict:
    """_calm, and tokens that put whitespace before a closing bracket, a comma or a colon held down
    (llama-server's JSON grammar admits that whitespace, llama-cpp-python's not)."""
    if "tight" not in _WS:
        _WS["tight"] = {t: -8.0 for t in range(49152)
                        if (p := target.token_to_piece(t)) and p[:1].isspace() and p.strip()[:1] in (b"}", b"]", b",", b":")}
    return {**_calm(target), **_WS["tight"]}


# ---- format, grammar and parser in process -----------------------------------------------------------
def _whole(gr, target, text: str) -> bool:
    """The grammar accepts all of ``text`` and may end there."""
    toks = target.tokenize(text, False, True) + [tt.token_of(target, EOS)]
    return gr.valid_prefix(toks) == len(toks)


def test_format_and_the_templates_own_calls_are_in_our_grammar_and_parse_back(sp):
    from pyllama_dspark.llama.grammar import Grammar

    target = sp.target
    chat = tool_chat_for(target)
    assert chat.format.name == "deepseek31" and chat.format.think == ("<think>", "</think>")
    assert chat.caps.supports_object_arguments and chat.caps.supports_parallel_tool_calls
    assert not chat.caps.supports_tools             # the template renders no tool list (nor does llama-server)
    for r1 in ("llama-cpp-deepseek-r1.jinja", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"):
        other = ToolChat(tt.template_text(r1), "", EOS)
        assert other.format is None and "DeepSeek R1" in other.unsupported, other.unsupported
    args = [{"city": "Lima", "unit": "f"}, {"text": 'say "hi"\n  now é {}', "count": -3, "flag": False, "tags": [2.5, -1]},
            {"text": "", "count": 0}]
    calls = [("get_weather", args[0]), ("note", args[1]), ("note", args[2])]
    msgs = USER + [{"role": "assistant", "content": "", "tool_calls": [_call(i, n, a) for i, (n, a) in enumerate(calls)]}]
    tools = check_tools(TOOLS)
    prompt = chat.render(msgs, tools, template_kwargs=OFF).prompt
    reply = prompt[prompt.index("</think>", prompt.index("<｜Assistant｜>")) + 8:prompt.rindex(EOS)]
    g = ds.grammar(chat.format, tools, "required", True, think=False, prompt="<think></think>")
    with Grammar.compile(g.gbnf, target) as gr:
        assert _whole(gr, target, reply), (reply, g.gbnf)
    parsed = ds.parse(reply, chat.format, NAMES, lstrip=False, tools=tools)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls, reply
    assert parsed.calls[1].arguments == json.dumps(args[1], ensure_ascii=False), parsed.calls[1]   # as written
    for name, a in calls:
        jsonschema.validate(a, SCHEMAS[name])
    g2 = ds.grammar(chat.format, tools, {"name": "note"}, True, think=False, prompt="<think></think>")
    ok = _block(("note", '{"text": "t", "count": 5}'))
    with Grammar.compile(g2.gbnf, target) as gr:
        for text, want in ((ok, True), (ok.replace("5", '"5"'), False), (ok.replace("5}", "5} "), False),
                           (ok.replace('"count": 5', '"count": 5, "flag": True'), False),
                           (_block(("get_weather", '{"city": "Lima", "unit": "c"}')), False),
                           (ok + "x", False), (_block(("note", '{"text": "t"}')), False)):
            assert _whole(gr, target, text) == want, text
    auto = ds.grammar(chat.format, tools, "auto", False)
    assert auto.lazy and auto.words == (BEGIN,)
    # the reasoning the prompt opened ends at </think>; after a tool result an optional block comes first
    opened = ds.grammar(chat.format, tools, "required", False, prompt="...<think>").gbnf
    after = ds.grammar(chat.format, tools, "required", False, prompt="...<｜tool▁output▁end｜>").gbnf
    with Grammar.compile(opened, target) as a, Grammar.compile(after, target) as b:
        for text, ok_a, ok_b in (("r</think>\n" + ok.replace("note", "get_weather").replace(
                                     '{"text": "t", "count": 5}', '{"city": "Lima", "unit": "c"}'), True, False),
                                 ("<think>r</think>" + _block(("note", '{"text": "t", "count": 5}')), True, True),
                                 (_block(("note", '{"text": "t", "count": 5}')), False, True)):
            assert (_whole(a, target, text), _whole(b, target, text)) == (ok_a, ok_b), text


@pytest.mark.parametrize("params,msg", [
    ({"type": "object", "properties": {"a": {"type": "integer", "$ref": "#/$defs/nope"}}}, "'odd'"),
    ({"type": "string"}, "must be an object"),
])
def test_a_schema_we_cannot_write_is_a_tool_schema_error_naming_the_tool(params, msg):
    tools = check_tools([{"type": "function", "function": {"name": "odd", "parameters": params}}])
    with pytest.raises(ToolSchemaError, match=msg):
        ds.grammar(_fmt(), tools, "required", False)


def test_partial_parses_stream_to_the_final_parse():
    fmt = _fmt()
    tools = check_tools(TOOLS)
    parse = lambda *a, **k: ds.parse(*a, tools=tools, **k)   # noqa: E731
    d = ReplyDiffer(fmt, NAMES, parse=parse)
    text = "hm </think>\n\nOk" + _block(("note", '{"text": "a \\"q\\"\\n", "count": -12, "tags": [1, {"x": "}"}]}'),
                                        ("get_weather", '{"city": "Lima", "unit": "f"}'))
    merged = tt.merge_deltas(x for k in range(1, len(text) + 1) for x in d.update(text[:k], final=k == len(text))[1])
    args = {i: c["arguments"] for i, c in merged["tool_calls"].items()}
    final = parse(text, fmt, NAMES)
    assert (merged["content"], merged["reasoning_content"]) == (final.content, final.reasoning) == ("\n\nOk", "hm ")
    assert [args[i] for i in sorted(args)] == [c.arguments for c in final.calls]
    assert final.calls[0].arguments == '{"text": "a \\"q\\"\\n", "count": -12, "tags": [1, {"x": "}"}]}'


def test_any_text_parses_and_streams_without_error():
    """Any text parses in any cut, the streamed deltas reassemble to the stream's last message, and
    that is the text's parse unless a call already sent turned out not to be one."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    tools = check_tools(TOOLS)
    fmt = _fmt()
    pieces = st.sampled_from([BEGIN, END, CB, CE, SEP, "note", "get_weather", "\n\n", "</think>", "<think>", "x", " ",
                              "\n", "1", "-", "{", "}", '"', ":", ",", "true", "nul", "[1, 2]", '{"text": "t"}',
                              _block(("note", '{"count": 1}'))])

    @settings(max_examples=200, deadline=None)
    @given(st.lists(pieces, max_size=30), st.integers(1, 5), st.sampled_from(["<think>", "<think></think>", "x"]))
    def check(parts, step, prompt):
        text = "".join(parts)
        parse = lambda *a, **k: ds.parse(*a, tools=tools, prompt=prompt, **k)   # noqa: E731
        final = parse(text, fmt, NAMES)
        d = ReplyDiffer(fmt, NAMES, parse=parse)
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
def test_prompt_with_tools_and_tool_turns_is_llama_servers(servers):
    cpp = servers("cpp")
    chat = ToolChat(tt.template_text(tt.TARGETS[KIND].template), "<｜begin▁of▁sentence｜>", EOS)
    convo = _history("Let me check.") + [{"role": "assistant", "content": "It is 21 C."},
                                         {"role": "user", "content": "And Lima?"}]
    for msgs, kw in ((USER, None), (USER, OFF), (_history(), None), (_history(), OFF), (convo, None), (convo, OFF)):
        body = {"messages": msgs, "tools": TOOLS, **({"chat_template_kwargs": kw} if kw else {})}
        theirs = _post(cpp, "/apply-template", body)
        assert theirs.status_code == 200, theirs.text
        assert plan_tools(chat, msgs, check_tools(TOOLS), "auto", None, kw).prompt == theirs.json()["prompt"], kw
    log = cpp.log.read_text(errors="replace")
    assert "using differential autoparser" in log and f"tool_section_start: '{BEGIN}'" in log


def test_serves_prompt_is_llama_servers(servers):
    ours, cpp = servers("plain"), servers("cpp")
    for body in ({"messages": _history(), "tools": TOOLS}, {"messages": USER, "tools": TOOLS, "tool_choice": "none"},
                 {"messages": _history("x"), "tools": [WEATHER], "chat_template_kwargs": OFF}):
        a, b = _post(ours, "/apply-template", body), _post(cpp, "/apply-template", body)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        assert a.json()["prompt"] == b.json()["prompt"], body


# ---- the parser --------------------------------------------------------------------------------------
def _texts():
    """(text, as reasoning the prompt opened, llama-server answers HTTP 500)."""
    w = ("get_weather", '{"city": "Paris", "unit": "c"}')
    n = ("note", '{"text": "a\\n b ", "count": 3, "flag": false}')
    return [
        (_block(w), False, False),
        ("Sure.\n\n" + _block(n, w), False, False),
        ("  lead\n" + BEGIN + "\n" + CB + "note" + SEP + ' {"count": 1}' + CE + "\n" + END, False, False),
        ("hmm\n</think>\n\nAnswer  ", True, False),
        ("hmm, no close", True, False),
        ("  hmm " + _block(w), True, False),
        ("r</think>  x " + _block(w), True, False),
        ("r</think>" + _block(w), True, False),
        ("  \n</think>ok", True, False),
        (_block(("note", '{"text": "t", "count": 2, "tags": [1, 2.5]}')), False, False),
        (_block(("get_weather", '{"city": "Par'), close=False), False, False),                   # cut off
        (_block(w)[:-3], False, False),
        (_block(w, close=False) + CB + "no", False, False),
        (_block(("note", '{"text": "t", "count": 1} ')), False, True),                            # space after args
        (_block(w) + " trailing", False, True),
        (_block(("nope", "{}")), False, True),                                                    # unknown tool
        (_block(("note", "[1]")), False, False),
        (_block(w) + _block(w), False, True),
        ("x" + BEGIN + "y", False, True),
    ]


def _prefill(cpp, target, text: str, opened: bool, choice: str):
    """llama-server continues an assistant prefill by nothing (its end of turn forced) and parses it:
    as content after the reasoning block its prompt closed, or as the reasoning it opened."""
    msg = {"role": "assistant", "content": "" if opened else text}
    if opened:
        msg["reasoning_content"] = text
    body = {"messages": USER + [msg], "tools": TOOLS, "max_tokens": 1, "temperature": 0, "tool_choice": choice,
            "logit_bias": [[tt.token_of(target, EOS), 100]]}
    return _post(cpp, "/v1/chat/completions", body)


def test_parse_of_a_text_is_llama_servers(servers, sp):
    tools = check_tools(TOOLS)
    fmt = _fmt()
    for text, opened, bad in _texts():
        for choice in ("auto", "none"):
            r = _prefill(servers("cpp"), sp.target, text, opened, choice)
            ours = ds.parse(text, fmt, NAMES, lstrip=opened, calls=choice == "auto", tools=tools)
            if bad and choice == "auto":
                assert r.status_code == 500, (text, r.text)
                assert ours.calls == [], text
                continue
            assert r.status_code == 200, (text, r.text)
            theirs = r.json()["choices"][0]["message"]
            assert _strip_ids(message_json(ours)) == _strip_ids(theirs), (choice, opened, text)


def test_parse_of_what_llama_server_generated_is_its_own(servers, sp):
    """llama-server's own grammar on a random target, also after a tool result (no turn opened):
    whatever it wrote, our parser (given the prompt) splits the raw text as its parser did."""
    target = sp.target
    think, end, begin = (tt.token_of(target, w) for w in ("<think>", "</think>", BEGIN))
    after = _history()
    go = [begin, 30]           # into the calls block at once (llama-server's grammar admits text before it)
    marks = {tt.token_of(target, w): 10.0 for w in (CE, END)}    # the markers as tokens, not spelled out
    cases = [(USER, {"tool_choice": "required", "chat_template_kwargs": OFF, "logit_bias": [go]}),
             (USER, {"tool_choice": "required", "logit_bias": [[end, 20], go]}),
             (USER, {"tool_choice": "auto", "max_tokens": 24}),
             (USER, {"tool_choice": "auto", "chat_template_kwargs": OFF, "logit_bias": [go]}),
             (USER, {"tool_choice": "required", "chat_template_kwargs": OFF, "tools": [LEVEL],
                     "parallel_tool_calls": True, "logit_bias": [go]}),
             (after, {"tool_choice": "auto", "max_tokens": 16}),
             (after, {"tool_choice": "auto", "max_tokens": 16, "logit_bias": [[think, 30], [end, 10]]}),
             (after, {"tool_choice": "required", "tools": [LEVEL], "logit_bias": [[think, 30], [end, 20], go]})]
    seen = 0
    for msgs, extra in cases:
        body = {"messages": msgs, "tools": [LEVEL, NOTE], "max_tokens": N, "temperature": 0, "verbose": True,
                "parallel_tool_calls": False, **extra}
        bias = {**_calm(target), **marks, **dict(extra.get("logit_bias", []))}
        body["logit_bias"] = [[t, b] for t, b in bias.items()]
        r = _post(servers("cpp"), "/v1/chat/completions", body)
        assert r.status_code == 200, (extra, r.text)
        j = r.json()
        raw, theirs = j["__verbose"]["content"], j["choices"][0]["message"]
        seen += bool(theirs.get("tool_calls")) and CE in raw
        used = check_tools(extra.get("tools", [LEVEL, NOTE]))
        plan, _ = tt.planned(target, extra["tool_choice"], used, msgs, False, extra.get("chat_template_kwargs"))
        ours = message_json(ds.parse(raw, plan.fmt, None, tools=used, prompt=plan.prompt))
        assert _strip_ids(ours) == _strip_ids(theirs), (extra, raw)
    assert seen >= 3


# ---- the same grammar, the same tokens ---------------------------------------------------------------
CHOICES = [("required", OFF, [LEVEL]), ("required", None, [LEVEL]),
           ({"type": "function", "function": {"name": "note"}}, OFF, TOOLS), ("auto", OFF, TOOLS)]


@pytest.mark.parametrize("choice,kw,tools", CHOICES, ids=["required", "required-thinking", "named", "auto"])
def test_constrained_decode_is_llama_cpps_with_and_without_a_draft(servers, sp, choice, kw, tools):
    target = sp.target
    bias = {**_calm(target), **{tt.token_of(target, w): 10.0 for w in (CE, END)}}
    if kw is None:
        bias[tt.token_of(target, "</think>")] = 20.0
    plan, toks = tt.planned(target, choice, tools, USER, False, kw)
    n = 2 * N
    cpp = servers("cpp").complete(toks, n, logit_bias=[[t, b] for t, b in bias.items()],
                                  **_cpp_grammar_fields(plan, target))
    done = sp.generate(toks, n, grammar=plan.compile(target), logit_bias=bias)
    assert done.tokens == cpp["tokens"], (done.text, cpp["content"])
    body = {"messages": USER, "tools": tools, "tool_choice": choice, "max_tokens": n, "temperature": 0,
            "parallel_tool_calls": False, "logit_bias": [[t, b] for t, b in bias.items()]}
    if kw:
        body["chat_template_kwargs"] = kw
    r = _post(servers("draft"), "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice0 = r.json()["choices"][0]
    text = ReplyText(target.token_to_piece, target.is_eog, plan.special_ids(target))
    text.push(cpp["tokens"])
    raw = text.finish()
    parsed = ds.parse(raw, plan.fmt, plan.names, tools=plan.tools, prompt=plan.prompt)
    assert _strip_ids(choice0["message"]) == _strip_ids(message_json(parsed)), raw
    if choice != "auto":
        assert parsed.calls and CB in raw, raw
        assert choice0["finish_reason"] == "tool_calls" or tools != [LEVEL], choice0
    if isinstance(choice, dict):
        assert {c.name for c in parsed.calls} == {"note"}
    if choice0["finish_reason"] == "tool_calls":
        for c in parsed.calls:
            jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])


# ---- end to end against llama-server --jinja ---------------------------------------------------------
@pytest.mark.parametrize("parallel", [False, True])
def test_call_is_llama_server_jinjas(servers, sp, parallel):
    """llama-server --jinja steered into its calls block by an assistant prefill, and we from the
    same prompt tokens with our grammar's rest of the block (the same language once whitespace
    tokens are held down): the same text, the same message."""
    target = sp.target
    bias = _tight(target)
    pre = BEGIN
    body = {"messages": USER + [{"role": "assistant", "content": pre}], "tools": [LEVEL], "tool_choice": "required",
            "max_tokens": 2 * N, "temperature": 0, "verbose": True, "parallel_tool_calls": parallel,
            "chat_template_kwargs": OFF, "logit_bias": [[t, b] for t, b in bias.items()]}
    r = _post(servers("cpp"), "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    j = r.json()
    raw, theirs = j["__verbose"]["content"], j["choices"][0]["message"]
    assert theirs.get("tool_calls"), j
    plan, _ = tt.planned(target, "required", [LEVEL], USER, parallel, OFF)
    toks = target.tokenize(plan.prompt + pre, add_special=not plan.added_special, parse_special=True)
    gbnf = plan.grammar.gbnf.replace("root ::= xsp calls", "root ::= calls-rest")
    done = sp.generate(toks, 2 * N, grammar=gbnf, logit_bias=bias)
    text = ReplyText(target.token_to_piece, target.is_eog, plan.special_ids(target))
    text.push(done.tokens)
    ours = text.finish()
    assert ours == raw
    parsed = ds.parse(pre + ours, plan.fmt, plan.names, lstrip=False, tools=plan.tools)
    assert _strip_ids(message_json(parsed)) == _strip_ids(theirs)
    jsonschema.validate(json.loads(parsed.calls[0].arguments), LEVEL_PARAMS)


# ---- streaming, a conversation, bad input, the DSpark class --------------------------------------------
def test_streamed_chunks_reassemble_to_the_call_and_the_conversation_goes_on(servers, sp):
    srv = servers("draft")
    body = {"messages": USER, "tools": [LEVEL], "tool_choice": "required", "max_tokens": 2 * N, "temperature": 0,
            "parallel_tool_calls": False, "chat_template_kwargs": OFF,
            "logit_bias": [[t, b] for t, b in _calm(sp.target).items()]}
    full = _post(srv, "/v1/chat/completions", body).json()["choices"][0]
    events = sse_json(SESSION.post(srv.url + "/v1/chat/completions", json={**body, "stream": True}, stream=True,
                                   timeout=600))
    tt.check_streamed_call(events, full)
    call = full["message"]["tool_calls"][0]
    jsonschema.validate(json.loads(call["function"]["arguments"]), LEVEL_PARAMS)
    convo = USER + [full["message"], {"role": "tool", "tool_call_id": call["id"], "content": "done"}]
    again = {"messages": convo, "tools": [LEVEL], "chat_template_kwargs": OFF}
    assert _post(srv, "/apply-template", again).json()["prompt"] == \
        _post(servers("cpp"), "/apply-template", again).json()["prompt"]
    second = _post(srv, "/v1/chat/completions", {**body, "messages": convo})
    assert second.status_code == 200, second.text
    msg2 = second.json()["choices"][0]["message"]
    assert msg2.get("tool_calls") and msg2["tool_calls"][0]["id"] != call["id"], second.text


def test_a_schema_the_format_cannot_write_is_a_400_and_the_server_keeps_serving(servers):
    srv = servers("plain")
    odd = {"type": "function", "function": {"name": "odd", "parameters": {"type": "string"}}}
    r = _post(srv, "/v1/chat/completions", {"messages": USER, "tools": [odd], "max_tokens": 4})
    assert r.status_code == 400 and "'odd'" in r.json()["error"]["message"], r.text
    ok = _post(srv, "/v1/chat/completions", {"messages": USER, "tools": [WEATHER], "max_tokens": 2,
                                             "chat_template_kwargs": OFF})
    assert ok.status_code == 200 and srv.get("/health").status_code == 200


def test_dspark_python_api_gives_serves_calls(servers, files, sp):
    from pyllama_dspark.integrations.dspark import DSpark

    target, draft, _ = files
    kw = dict(tools=[LEVEL], tool_choice="required", max_tokens=2 * N, temperature=0, parallel_tool_calls=False,
              chat_template_kwargs=OFF, logit_bias={str(t): b for t, b in _calm(sp.target).items()})
    theirs = _post(servers("draft"), "/v1/chat/completions", {"messages": USER, **kw}).json()["choices"][0]
    with DSpark(target, draft, n_ctx=2048, n_threads=TEST_THREADS, schedule="off") as dsp:
        ours = dsp.create_chat_completion(USER, **kw)["choices"][0]
        streamed = tt.merge_deltas(ch["choices"][0]["delta"] for ch in dsp.create_chat_completion(USER, stream=True, **kw))
    assert (ours["finish_reason"], _strip_ids(ours["message"])) == (theirs["finish_reason"],
                                                                    _strip_ids(theirs["message"]))
    assert ours["finish_reason"] == "tool_calls" and ours["message"]["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"].values()] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in ours["message"]["tool_calls"]]
