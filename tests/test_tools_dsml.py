"""DeepSeek V3.2 / V4 DSML tool calls (``<｜DSML｜function_calls>`` / ``<｜DSML｜tool_calls>`` around
``<｜DSML｜invoke name="NAME">`` and ``<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>``)
on ``serve`` and in process, against llama.cpp's own llama-server ``--jinja`` on random targets carrying
the real templates (``tool_targets.py`` ``dsv32``, ``dsv4``; llama-server logs "Using specialized
template: DeepSeek V3.2/V4" on each).  References:

* the prompt: llama-server's ``/apply-template`` (tools, calls with string / number / bool / null /
  object arguments, tool results (V4: sorted into the calls' order), reasoning, thinking on and off);
* the parser: llama-server's parse of assistant prefills (as content after a closed reasoning block,
  and as reasoning the prompt opened), ``tool_choice`` "none" too, texts it answers with HTTP 500,
  and of what it generated itself;
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
from pyllama_dspark.chat import dsml
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
KINDS = ("dsv32", "dsv4")
MAIN = "dsv4"
EOS = "<｜end▁of▁sentence｜>"


def _fmt(kind: str):
    return ToolChat(tt.template_text(tt.TARGETS[kind].template), "", EOS).format


def _call(i: int, name: str, args: dict) -> dict:
    return {"id": f"call{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _history(content: str = "", reasoning: str = "", swap: bool = False) -> list:
    args = {"text": 'say "hi"\nnow é', "count": -3, "flag": True, "meta": {"k": "x", "n": None}, "tags": [1.5, 2],
            "any": None}
    msg = {"role": "assistant", "content": content, "tool_calls": [_call(1, "note", args),
                                                                   _call(2, "get_weather", {"city": "Paris", "unit": "c"})]}
    if reasoning:
        msg["reasoning_content"] = reasoning
    results = [{"role": "tool", "tool_call_id": "call1", "content": "noted"},
               {"role": "tool", "tool_call_id": "call2", "content": '{"temperature": 21}'}]
    return [{"role": "system", "content": "You are terse."}] + USER + [msg] + (results[::-1] if swap else results)


# ---- fixtures ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools-dsml")
    targets = {k: tt.build(k, d) for k in KINDS}
    return targets, make_test_draft(targets[MAIN], str(d / "draft-dsv4.gguf"), kind="dspark", seed=5), d


@pytest.fixture(scope="module")
def servers(files, tmp_path_factory):
    from pyllama_dspark.upstream.llama_server import LlamaServer
    from pyllama_dspark.upstream.llama_server_build import ensure_llama_server

    targets, draft, d = files
    logs = tmp_path_factory.mktemp("tools-dsml-logs")
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
                up[which] = ServeProcess(targets[MAIN], draft if which == "draft" else None,
                                         logs / f"serve-{which}.log", n_ctx=4096,
                                         extra=["--schedule", "off"] if which == "draft" else [])
        return up[which]

    yield get
    for s in up.values():
        s.stop()


@pytest.fixture(scope="module")
def sp(files):
    with Speculator(files[0][MAIN], None, n_ctx=2048, n_threads=TEST_THREADS) as s:
        yield s


_WS: dict = {}


def _calm(target) -> dict:
    """logit_bias: whitespace-only tokens down (a random target otherwise fills every optional
    whitespace of the grammar), the end of turn up a little."""
    if not _WS:
        _WS.update({t: -8.0 for t in tt.whitespace_tokens(target.token_to_piece, 49152)})
        _WS[_tok(target, EOS)] = 4.0
    return dict(_WS)


_tok = tt.token_of


def _dsml(fmt, name: str, *kv, close: bool = True) -> str:
    """A DSML block with one call; ``kv``: (key, value text, string?)."""
    body = "".join(f'<｜DSML｜parameter name="{k}" string="{"true" if s else "false"}">{v}</｜DSML｜parameter>\n'
                   for k, v, s in kv)
    text = f'{fmt.call_open}\n<｜DSML｜invoke name="{name}">\n{body}'
    return text + (f"</｜DSML｜invoke>\n{fmt.call_close}" if close else "")


# ---- format, grammar and parser in process -----------------------------------------------------------
def test_format_and_the_templates_own_calls_are_in_our_grammar_and_parse_back(sp):
    from pyllama_dspark.llama.grammar import Grammar

    target = sp.target
    chat = tool_chat_for(target)
    assert chat.format.name == "dsml4" and chat.format.codec == "dsml_v4" and chat.format.think == ("<think>", "</think>")
    assert _fmt("dsv32").name == "dsml" and _fmt("dsv32").call_open == "<｜DSML｜function_calls>"
    flash = ToolChat(tt.template_text("deepseek-ai-DeepSeek-V4-Flash-0731.jinja"), "", EOS).format
    assert flash.name == "dsml4"
    assert chat.caps.supports_object_arguments and chat.caps.supports_parallel_tool_calls
    # what the template renders (after </think>) is in our grammar and parses back
    args = [{"city": "Lima", "unit": "f"},
            {"text": 'say "hi"\n  now é {}', "count": -3, "tags": [2.5, -1], "meta": {"k": "x"}, "any": "7",
             "flag": False},
            {"text": "", "count": 0, "any": "free text"}]
    calls = [("get_weather", args[0]), ("note", args[1]), ("note", args[2])]
    msgs = USER + [{"role": "assistant", "content": "", "tool_calls": [_call(i, n, a) for i, (n, a) in enumerate(calls)]}]
    tools = check_tools(TOOLS)
    prompt = chat.render(msgs, tools, template_kwargs=OFF).prompt
    reply = prompt[prompt.index("</think>", prompt.index("<｜Assistant｜>")) + 8:prompt.rindex(EOS)]
    g = dsml.grammar(chat.format, tools, "required", True, think=False)
    toks = target.tokenize(reply, False, True)
    with Grammar.compile(g.gbnf, target) as gr:
        assert gr.valid_prefix(toks) == len(toks), (reply, g.gbnf)
    parsed = dsml.parse(reply, chat.format, NAMES, lstrip=False, tools=tools)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls, reply
    assert parsed.calls[1].arguments == '{"text":"say \\"hi\\"\\n  now é {}","count":-3,"tags":[2.5, -1],' \
                                        '"meta":{"k": "x"},"any":"7","flag":false}'
    for name, a in calls:
        jsonschema.validate(a, SCHEMAS[name])
    # the required parameters in the schema's order, optional ones after them; a number typed as a number
    g2 = dsml.grammar(chat.format, tools, {"name": "note"}, True, think=False)
    ok = _dsml(chat.format, "note", ("text", "t", True), ("count", "5", False), ("flag", "true", False))
    with Grammar.compile(g2.gbnf, target) as gr:
        for text, want in ((ok, True), (ok.replace(">5<", '>"5"<'), False), (ok.replace(">5<", ">5 <"), False),
                           (ok.replace('"count" string="false"', '"count" string="true"'), False),
                           (_dsml(chat.format, "note", ("count", "5", False), ("text", "t", True)), False),
                           (ok.replace("true", "True"), False), (_dsml(chat.format, "get_weather"), False)):
            t = target.tokenize(text, False, True)
            assert (gr.valid_prefix(t) == len(t)) == want, text
    auto = dsml.grammar(chat.format, tools, "auto", False)
    assert auto.lazy and auto.words == ("<｜DSML｜tool_calls>",)


@pytest.mark.parametrize("params,msg", [
    ({"type": "object", "properties": {'a"b': {"type": "string"}}}, "cannot be written"),
    ({"type": "object", "properties": {"a": {"type": "integer", "$ref": "#/$defs/nope"}}}, "'odd'"),
    ({"type": "object", "properties": {"a": {"enum": []}}}, "admits no value"),
    ({"type": "string"}, "must be an object"),
])
def test_a_schema_we_cannot_write_is_a_tool_schema_error_naming_the_tool(params, msg):
    tools = check_tools([{"type": "function", "function": {"name": "odd", "parameters": params}}])
    with pytest.raises(ToolSchemaError, match=f"'odd'.*{msg}|{msg}"):
        dsml.grammar(_fmt(MAIN), tools, "required", False)


def test_v4_sorts_tool_results_into_the_calls_order():
    swapped = _history(swap=True)
    out = dsml.sort_tool_results(swapped)
    assert [m.get("tool_call_id") for m in out] == [None, None, None, "call1", "call2"]
    assert dsml.sort_tool_results(_history()) == _history()


def _stream_text(fmt) -> str:
    return ("hm </think>\n\nOk" + "\n\n" + fmt.call_open + "\n" +
            '<｜DSML｜invoke name="note">\n<｜DSML｜parameter name="text" string="true">a "q"\n</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="count" string="false">-12</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="meta" string="false">{"k": "x"}</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="any" string="true">1.5e3x</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
            '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Lima</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="unit" string="true">f</｜DSML｜parameter>\n</｜DSML｜invoke>\n' + fmt.call_close)


def test_partial_parses_stream_to_the_final_parse():
    """Every prefix of a reply: content / reasoning / arguments only grow, and the deltas add up."""
    fmt = _fmt(MAIN)
    tools = check_tools(TOOLS)
    parse = lambda *a, **k: dsml.parse(*a, tools=tools, **k)   # noqa: E731
    d = ReplyDiffer(fmt, NAMES, parse=parse)
    text = _stream_text(fmt)
    merged = tt.merge_deltas(x for k in range(1, len(text) + 1) for x in d.update(text[:k], final=k == len(text))[1])
    args = {i: c["arguments"] for i, c in merged["tool_calls"].items()}
    final = parse(text, fmt, NAMES)
    assert (merged["content"], merged["reasoning_content"]) == (final.content, final.reasoning) == ("\n\nOk", "hm ")
    assert [args[i] for i in sorted(args)] == [c.arguments for c in final.calls]
    assert final.calls[0].arguments == '{"text":"a \\"q\\"\\n","count":-12,"meta":{"k": "x"},"any":"1.5e3x"}'
    assert json.loads(final.calls[1].arguments) == {"city": "Lima", "unit": "f"}


def test_any_text_parses_and_streams_without_error():
    """Any text parses in any cut, the streamed deltas reassemble to the stream's last message, and
    that is the text's parse unless a call already sent turned out not to be one."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    tools = check_tools(TOOLS)
    fmt = _fmt(MAIN)
    pieces = st.sampled_from([fmt.call_open, fmt.call_close, "\n\n", '<｜DSML｜invoke name="', "note", "get_weather",
                              '">\n', '<｜DSML｜parameter name="', 'text" string="true">', 'count" string="false">',
                              'city" string="true">', "</｜DSML｜parameter>", "</｜DSML｜invoke>", "</｜DSML", "<｜DSML",
                              "</think>", "<think>", "x", " ", "\n", "1", "-", "{", "}", '"', "true", "nul", "[1, 2]",
                              _dsml(fmt, "note", ("text", "t", True), ("count", "1", False))])

    @settings(max_examples=200, deadline=None)
    @given(st.lists(pieces, max_size=30), st.integers(1, 5), st.booleans())
    def check(parts, step, opened):
        text = "".join(parts)
        parse = lambda *a, **k: dsml.parse(*a, tools=tools, **k)   # noqa: E731
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
    llama-server picked its DeepSeek V3.2/V4 handler for the template."""
    cpp = servers(kind)
    chat = ToolChat(tt.template_text(tt.TARGETS[kind].template), "<｜begin▁of▁sentence｜>", EOS)
    convo = _history("Let me check.", "Need the weather.") + [{"role": "assistant", "content": "It is 21 C."},
                                                              {"role": "user", "content": "And Lima?"}]
    for msgs, kw in ((USER, None), (_history(), None), (_history(), OFF), (convo, None), (convo, OFF),
                     (_history("", "Need two tools."), None), (_history(swap=True), None)):
        body = {"messages": msgs, "tools": TOOLS, **({"chat_template_kwargs": kw} if kw else {})}
        theirs = _post(cpp, "/apply-template", body)
        assert theirs.status_code == 200, theirs.text
        assert plan_tools(chat, msgs, check_tools(TOOLS), "auto", None, kw).prompt == theirs.json()["prompt"], (kind, kw)
    assert "Using specialized template: DeepSeek V3.2/V4" in cpp.log.read_text(errors="replace")


def test_serves_prompt_is_llama_servers(servers):
    ours, cpp = servers("plain"), servers(MAIN)
    for body in ({"messages": _history(swap=True), "tools": TOOLS},
                 {"messages": USER, "tools": TOOLS, "tool_choice": "none"},
                 {"messages": _history("x", "r"), "tools": [WEATHER], "chat_template_kwargs": OFF}):
        a, b = _post(ours, "/apply-template", body), _post(cpp, "/apply-template", body)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        assert a.json()["prompt"] == b.json()["prompt"], body


# ---- the parser --------------------------------------------------------------------------------------
def _texts(kind: str):
    """(text, as reasoning the prompt opened, llama-server answers HTTP 500)."""
    f = _fmt(kind)
    w = lambda *kv, **k: _dsml(f, "get_weather", *kv, **k)   # noqa: E731
    n = lambda *kv, **k: _dsml(f, "note", *kv, **k)   # noqa: E731
    paris = (("city", "Paris", True), ("unit", "c", True))
    return [
        ("\n\n" + w(*paris), False, False),
        ("Sure." + "\n\n" + n(("text", "a\n b ", True), ("count", "3", False), ("flag", "false", False)), False, False),
        ("  lead\n" + w(("city", "</x>", True), ("unit", "", True)), False, False),
        ("hmm\n</think>\n\nAnswer  ", True, False),
        ("hmm, no close", True, False),
        ("  hmm " + "\n\n" + n(("text", "x", True), ("count", "1", False)), True, False),
        ("r</think>  x " + w(*paris), True, False),
        (n(("text", "t", True), ("count", "2", False), ("any", "3.5", True), ("meta", '{"k": "x"}', False),
           ("tags", "[1, 2.5]", False), ("any", "abc", True)), False, False),
        (w(("city", "Par", True), close=False)[:-8], False, False),                         # cut off
        (n(("text", "t", True), ("count", "12", False), close=False), False, False),
        (w(*paris)[:-5], False, False),
        (w(*paris) + "\n" + w(("unit", "f", True), ("city", "b", True)), False, True),       # two blocks
        (w(*paris) + " trailing", False, True),
        ("A" + w(("town", "x", True)), False, True),                                          # unknown parameter
        (_dsml(f, "nope", ("city", "x", True)), False, True),
        (n(("count", "1", False), ("text", "t", True)), False, True),                        # required out of order
        (n(("text", "t", True), ("count", '"2"', True)), False, True),                       # wrong string flag
        (n(("text", "t", True), ("count", "2 ", False)), False, True),                       # not JSON
    ]


def _prefill(cpp, target, text: str, opened: bool, choice: str):
    """llama-server continues an assistant prefill by nothing (its end of turn forced) and parses it:
    as content after the reasoning block its prompt closed, or as the reasoning it opened."""
    msg = {"role": "assistant", "content": "" if opened else text}
    if opened:
        msg["reasoning_content"] = text
    body = {"messages": USER + [msg], "tools": TOOLS, "max_tokens": 1, "temperature": 0, "tool_choice": choice,
            "logit_bias": [[_tok(target, EOS), 100]]}
    if not opened:
        body["chat_template_kwargs"] = OFF
    return _post(cpp, "/v1/chat/completions", body)


def test_parse_of_a_text_is_llama_servers(servers, sp):
    tools = check_tools(TOOLS)
    for kind in KINDS:
        fmt = _fmt(kind)
        for text, opened, bad in _texts(kind):
            for choice in ("auto", "none"):
                r = _prefill(servers(kind), sp.target, text, opened, choice)
                ours = dsml.parse(text, fmt, NAMES, lstrip=opened, calls=choice == "auto", tools=tools)
                if bad and choice == "auto":
                    assert r.status_code == 500 and "does not match" in r.text, (kind, text, r.text)
                    assert ours.calls == [], text
                    continue
                assert r.status_code == 200, r.text
                theirs = r.json()["choices"][0]["message"]
                assert _strip_ids(message_json(ours)) == _strip_ids(theirs), (kind, choice, opened, text)


def test_parse_of_what_llama_server_generated_is_its_own(servers, sp):
    """llama-server's own grammar on a random target (steered into its calls block by an assistant
    prefill, which primes its grammar): whatever it wrote, our parser splits the raw text as its
    parser did."""
    end = _tok(sp.target, "</think>")
    cases = [(MAIN, {"tool_choice": "required", "chat_template_kwargs": OFF}, ""),
             (MAIN, {"tool_choice": "required", "logit_bias": [[end, 20]]}, ""),
             (MAIN, {"tool_choice": "auto", "max_tokens": 24}, ""),
             (MAIN, {"tool_choice": "required", "chat_template_kwargs": OFF, "tools": [LEVEL]}, "\n\n{}\n"),
             (MAIN, {"tool_choice": "required", "chat_template_kwargs": OFF, "parallel_tool_calls": True,
                     "tools": [LEVEL]}, "\n\n{}"),
             ("dsv32", {"tool_choice": "required", "chat_template_kwargs": OFF, "tools": [LEVEL]}, "\n\n{}\n")]
    seen = 0
    for kind, extra, pre in cases:
        pre = pre.format(_fmt(kind).call_open)
        body = {"messages": USER + ([{"role": "assistant", "content": pre}] if pre else []), "tools": [LEVEL, NOTE],
                "max_tokens": N, "temperature": 0, "verbose": True, "parallel_tool_calls": False, **extra}
        r = _post(servers(kind), "/v1/chat/completions", body)
        assert r.status_code == 200, (kind, extra, pre, r.text)
        j = r.json()
        raw, theirs = j["__verbose"]["content"], j["choices"][0]["message"]
        seen += bool(theirs.get("tool_calls"))
        opened = "chat_template_kwargs" not in extra
        used = check_tools(extra.get("tools", [LEVEL, NOTE]))
        ours = message_json(dsml.parse(pre + raw, _fmt(kind), None, lstrip=opened, tools=used))
        assert _strip_ids(ours) == _strip_ids(theirs), (kind, extra, pre + raw)
    assert seen >= 3


# ---- the same grammar, the same tokens ---------------------------------------------------------------
def _plan(sp, choice, kw=None, tools=TOOLS, messages=USER, parallel=False):
    return tt.planned(sp.target, choice, tools, messages, parallel, kw)


CHOICES = [("required", OFF, TOOLS), ("required", None, [LEVEL]),
           ({"type": "function", "function": {"name": "note"}}, OFF, TOOLS), ("auto", OFF, TOOLS)]


@pytest.mark.parametrize("choice,kw,tools", CHOICES, ids=["required", "required-thinking", "named", "auto"])
def test_constrained_decode_is_llama_cpps_with_and_without_a_draft(servers, sp, choice, kw, tools):
    """Our prompt and grammar, decoded by llama-server's /completion, by us in process without a draft,
    and by serve with a random draft verifying every block: the same tokens, and serve's message is
    our parse of them."""
    target = sp.target
    bias = {**_calm(target), _tok(target, "</think>"): 20.0}
    plan, toks = _plan(sp, choice, kw, tools=tools)
    n = 4 * N if tools == [LEVEL] else N
    cpp = servers(MAIN).complete(toks, n, logit_bias=[[t, b] for t, b in bias.items()],
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
    parsed = dsml.parse(raw, plan.fmt, plan.names, lstrip=plan.lstrip, tools=plan.tools)
    assert _strip_ids(choice0["message"]) == _strip_ids(message_json(parsed)), raw
    if choice != "auto":
        assert parsed.calls and '<｜DSML｜invoke name="' in raw, raw
        assert choice0["finish_reason"] == "tool_calls" or tools != [LEVEL], choice0
    if isinstance(choice, dict):
        assert {c.name for c in parsed.calls} == {"note"}
    if choice0["finish_reason"] == "tool_calls":
        for c in parsed.calls:
            jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])


# ---- end to end against llama-server --jinja ---------------------------------------------------------
@pytest.mark.parametrize("kind,parallel", [(MAIN, False), (MAIN, True), ("dsv32", False)])
def test_call_is_llama_server_jinjas(servers, sp, files, kind, parallel):
    """llama-server --jinja steered into its calls block by an assistant prefill (its grammar primed
    with it), and we from the same prompt tokens with our grammar's rest of the block (the same
    language: llama-server's grammar is ours there): the same text, the same message."""
    fmt = _fmt(kind)
    pre = "\n\n" + fmt.call_open      # (a newline after it would be the start of the grammar's whitespace)
    body = {"messages": USER + [{"role": "assistant", "content": pre}], "tools": [LEVEL], "tool_choice": "required",
            "max_tokens": 4 * N, "temperature": 0, "verbose": True, "parallel_tool_calls": parallel,
            "chat_template_kwargs": OFF}
    r = _post(servers(kind), "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    j = r.json()
    raw, theirs = j["__verbose"]["content"], j["choices"][0]["message"]
    assert theirs.get("tool_calls"), j
    with Speculator(files[0][kind], None, n_ctx=2048, n_threads=TEST_THREADS) if kind != MAIN else _Same(sp) as s:
        plan, _ = _plan(s, "required", OFF, tools=[LEVEL], parallel=parallel)
        toks = s.target.tokenize(plan.prompt + pre, add_special=not plan.added_special, parse_special=True)
        gbnf = plan.grammar.gbnf.replace("root ::= xsp calls", "root ::= calls-rest")
        done = s.generate(toks, 4 * N, grammar=gbnf)
        text = ReplyText(s.target.token_to_piece, s.target.is_eog, plan.special_ids(s.target))
        text.push(done.tokens)
        ours = text.finish()
    assert ours == raw
    parsed = dsml.parse(pre + ours, fmt, plan.names, lstrip=False, tools=plan.tools)
    assert _strip_ids(message_json(parsed)) == _strip_ids(theirs)
    jsonschema.validate(json.loads(parsed.calls[0].arguments), LEVEL_PARAMS)


class _Same:
    def __init__(self, sp):
        self.sp = sp

    def __enter__(self):
        return self.sp

    def __exit__(self, *a):
        return False


# ---- streaming, a conversation -----------------------------------------------------------------------
def test_streamed_chunks_reassemble_to_the_call_and_the_conversation_goes_on(servers, sp):
    srv = servers("draft")
    body = {"messages": USER, "tools": [LEVEL], "tool_choice": "required", "max_tokens": 4 * N, "temperature": 0,
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
        _post(servers(MAIN), "/apply-template", again).json()["prompt"]
    second = _post(srv, "/v1/chat/completions", {**body, "messages": convo})
    assert second.status_code == 200, second.text
    msg2 = second.json()["choices"][0]["message"]
    assert msg2.get("tool_calls") and msg2["tool_calls"][0]["id"] != call["id"], second.text


def test_a_schema_the_format_cannot_write_is_a_400_and_the_server_keeps_serving(servers):
    srv = servers("plain")
    odd = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {'a"b': {"type": "string"}}}}}
    r = _post(srv, "/v1/chat/completions", {"messages": USER, "tools": [odd], "max_tokens": 4})
    assert r.status_code == 400 and "'odd'" in r.json()["error"]["message"], r.text
    ok = _post(srv, "/v1/chat/completions", {"messages": USER, "tools": [WEATHER], "max_tokens": 2,
                                             "chat_template_kwargs": OFF})
    assert ok.status_code == 200 and srv.get("/health").status_code == 200


def test_dspark_python_api_gives_serves_calls(servers, files, sp):
    from pyllama_dspark.integrations.dspark import DSpark

    targets, draft, _ = files
    kw = dict(tools=[LEVEL], tool_choice="required", max_tokens=4 * N, temperature=0, parallel_tool_calls=False,
              chat_template_kwargs=OFF, logit_bias={str(t): b for t, b in _calm(sp.target).items()})
    theirs = _post(servers("draft"), "/v1/chat/completions", {"messages": USER, **kw}).json()["choices"][0]
    with DSpark(targets[MAIN], draft, n_ctx=2048, n_threads=TEST_THREADS, schedule="off") as ds:
        ours = ds.create_chat_completion(USER, **kw)["choices"][0]
        streamed = tt.merge_deltas(ch["choices"][0]["delta"]
                                   for ch in ds.create_chat_completion(USER, stream=True, **kw))
    assert (ours["finish_reason"], _strip_ids(ours["message"])) == (theirs["finish_reason"],
                                                                    _strip_ids(theirs["message"]))
    assert ours["finish_reason"] == "tool_calls" and ours["message"]["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"].values()] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in ours["message"]["tool_calls"]]
