"""GPT-OSS (harmony) tool calls on ``serve`` against llama.cpp's own llama-server ``--jinja``: a random
``gpt-oss`` target carrying the real GPT-OSS template and its special tokens (``tool_targets.py``:
``<|return|>`` and ``<|call|>`` end generation), the same file on both sides.

* the prompt: llama-server's ``/apply-template`` (tools, a developer message, a tool call with its
  reasoning (``reasoning_content`` -> the template's ``thinking``), its result, a later turn);
* the parser: llama-server's parse of a text.  GPT-OSS continues an assistant prefill as reasoning
  (gpt-oss.cpp: the generation prompt becomes ``<|start|>assistant<|channel|>analysis<|message|>`` +
  the prefill's ``reasoning_content``), so a text after an opened analysis block is given as that
  reasoning and the model's end-of-generation forced: llama-server parses exactly that text.  Texts it
  answers with HTTP 500 ("does not match") are whole content here.  And its parse of what it generated
  itself (``verbose``: the raw text beside the message);
* the constrained decode: our prompt tokens and our grammar through llama-server's ``/completion`` (a
  strict grammar, or lazy with our trigger words), in process without a draft and through ``serve``
  with a random draft verifying every block: the same tokens (lossless), serve's message the parse;
* end to end: ``serve`` and llama-server ``--jinja`` (its own prompt, grammar and parser) give the same
  call for ``tool_choice: "required"`` where both grammars admit the same replies: the request bans the
  tokens that start with whitespace (the two JSON-schema converters place whitespace differently,
  docs/serve.md "Tools") except `` to``, which the harmony headers need.  ``"auto"`` is not compared
  there: llama-server's lazy grammar starts at a reply's leading `` to``, ours at `` to=functions``
  (:data:`~pyllama_dspark.chat.harmony.TRIGGERS`), and a random target writes neither;
  its trigger words are checked in process instead;
* streaming chunks reassemble to the call; a conversation goes on after the tool's result.

A random target writes a call only when pushed: ``logit_bias`` on `` to`` (the role-header recipient)
or ``<|channel|>`` (the channel header) and on ``<|message|>`` (ends the header's content type, which
the grammar lets run on).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

import tool_targets as tt
from greedy_ref import TEST_THREADS
from serve_helpers import SESSION, ServeProcess, sse_json
from tool_targets import TIME, USER, WEATHER, calls as _calls, post as _post, strip_ids as _no_ids
from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.gguf.testing import make_test_draft
from pyllama_dspark.chat import harmony
from pyllama_dspark.chat.tool_prompt import tool_chat_for
from pyllama_dspark.chat.formats import FORMATS
from pyllama_dspark.chat.parse import ReplyText, message_json
from pyllama_dspark.chat.tool_request import check_tool_choice, check_tools, plan_tools

pytestmark = pytest.mark.slow

TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
N = 40
A = "<|channel|>analysis<|message|>"
REQUIRED = "required"
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _history() -> list:
    cid = "call_abc123"
    call = {"id": cid, "type": "function", "function": {"name": "get_weather",
                                                        "arguments": '{"city": "Paris", "unit": "c"}'}}
    return [{"role": "system", "content": "You are terse."}] + USER + [
        {"role": "assistant", "content": None, "tool_calls": [call],
         "reasoning_content": "Need the <weather> & 'unit'."},
        {"role": "tool", "tool_call_id": cid, "content": '{"temperature": 21, "sky": "<clear> é"}'}]


# ---- fixtures: one target, its draft, llama-server --jinja, serve with the draft ------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools-gptoss")
    target = tt.build("gptoss", d)
    return target, make_test_draft(target, str(d / "draft.gguf"), kind="dspark", seed=5), d


@pytest.fixture(scope="module")
def cpp(files):
    from pyllama_dspark.upstream.llama_server import LlamaServer
    from pyllama_dspark.upstream.llama_server_build import ensure_llama_server

    target, _, d = files
    s = LlamaServer(ensure_llama_server(), target, None, ctx=4096, threads=TEST_THREADS, extra_args=["--jinja"],
                    trace=False, log_path=d / "ls.log").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def serve(files):
    target, draft, d = files
    s = ServeProcess(target, draft, d / "serve.log", n_ctx=4096, extra=["--schedule", "off"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def sp(files):
    with Speculator(files[0], None, n_ctx=2048, n_threads=TEST_THREADS) as s:
        yield s


def _tok(sp, text: str) -> int:
    ids = sp.target.tokenize(text, False, True)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def _parse(text: str, partial: bool = False) -> dict:
    return message_json(harmony.parse(text, FORMATS["harmony"], ["get_weather", "get_time"], partial=partial))


# ---- the prompt -----------------------------------------------------------------------------------------
def test_prompt_with_tools_and_tool_turns_is_llama_servers(serve, cpp):
    later = _history() + [{"role": "assistant", "content": "It is 21 C.", "reasoning_content": "easy"},
                          {"role": "user", "content": "And in Tokyo?"}]
    dev = [{"role": "developer", "content": "Answer in French."}] + USER
    for body in ({"messages": USER, "tools": TOOLS}, {"messages": _history(), "tools": TOOLS},
                 {"messages": later, "tools": [WEATHER]}, {"messages": dev, "tools": TOOLS},
                 {"messages": USER, "tools": TOOLS, "tool_choice": "none"},
                 {"messages": _history(), "tools": TOOLS, "chat_template_kwargs": {"reasoning_effort": "high"}}):
        a, b = _post(serve, "/apply-template", body), _post(cpp, "/apply-template", body)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        assert a.json()["prompt"] == b.json()["prompt"], body
        assert a.json()["prompt"].endswith("<|start|>assistant")


# ---- the parser -----------------------------------------------------------------------------------------
CALL_W = 'get_weather <|constrain|>json<|message|>{"city": "Paris", "unit": "c"}'
TEXTS = [   # each follows an opened analysis block (module doc)
    "Think.<|end|><|start|>assistant<|channel|>commentary to=functions." + CALL_W,                # channel header
    'Hm<|end|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"city":"Tokyo"}',
    "Done thinking.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny in Paris.",     # final answer
    "a<|end|><|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant"
    '<|channel|>commentary to=functions.get_time<|message|>{"city": "Paris"}',                   # preamble
    'a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|><|start|>assistant<|channel|>analysis'
    ' to=functions.get_weather<|constrain|>json<|message|>{"city": "Lima", "unit": "f", "x": {"n": [1, 2.5e3, '
    '{"k": null}], "s": "q\\"é"}}  ',                                                             # nested JSON
    "x<|end|><|start|>assistant<|channel|>commentary<|channel|>analysis<|message|>y<|end|><|start|>assistant"
    "<|channel|>commentary to=assistant<|channel|>final<|message|>ok<|end|>trailing",            # stray commentary
    "  <|end|><|start|>assistant<|channel|>commentary to=functions.get_weather\n json<|message|>[1]",
    "x<|end|><|start|>assistant<|channel|>commentary to=functions." + CALL_W[:-8],               # cut: partial args
    "x<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>js",  # cut in the header
    'x<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{"a": "b\\u12',
    "only reasoning<|en",
    "\n r \n<|end|><|start|>assistant<|channel|>final<|message|>  Hi é \n",                     # whitespace kept
    "x<|end|><|start|>assistant<|channel|>commentary<|message|> pre \n<|end|><|start|>assistant<|channel|>final"
    "<|message|>\nA\n<|end|>",                                                                 # preamble + final
]
REFUSED = [   # llama-server: HTTP 500 "does not match the expected format"
    "x<|end|><|start|>assistant<|channel|>commentary to=functions.unknown<|message|>{}",
    'x<|end|><|start|>assistant<|channel|>commentary to=functions.get_time<|message|>{"a": 01}',
    "x<|end|>plain text",
]


def _cpp_parse(cpp, eog: int, text: str, choice: str = "auto"):
    body = {"messages": USER + [{"role": "assistant", "content": "", "reasoning_content": text}], "tools": TOOLS,
            "max_tokens": 1, "logit_bias": [[eog, 100]], "temperature": 0, "tool_choice": choice}
    return _post(cpp, "/v1/chat/completions", body)


def test_parse_of_a_text_is_llama_servers(cpp, sp):
    eog = _tok(sp, "<|return|>")
    for text in TEXTS:
        r = _cpp_parse(cpp, eog, text)
        assert r.status_code == 200, (text, r.text)
        assert _no_ids(_parse(A + text)) == _no_ids(r.json()["choices"][0]["message"]), text
    for text in REFUSED:
        r = _cpp_parse(cpp, eog, text)
        assert r.status_code == 500 and "does not match" in r.text, (text, r.text)
        assert _parse(A + text) == {"role": "assistant", "content": A + text}
    # tool_choice "none": llama-server's parser without tools; a call is an "unsolicited" message,
    # read as nothing once its <|end|> comes.  partial: a text that parses to nothing is not given
    # whole (llama-server gives the generated text whole, here nothing; the generated case is below)
    def none(t, partial=True):
        return message_json(harmony.parse(t, FORMATS["harmony"], ["get_weather"], partial=partial, calls=False))
    for text in TEXTS + NONE_TEXTS:
        r = _cpp_parse(cpp, eog, text, "none")
        assert r.status_code == 200, (text, r.text)
        assert none(A + text) == r.json()["choices"][0]["message"], text
    r = _cpp_parse(cpp, eog, "x<|end|>plain text", "none")
    assert r.status_code == 500 and "does not match" in r.text, r.text
    assert none(A + "x<|end|>plain text", False) == {"role": "assistant", "content": A + "x<|end|>plain text"}


NONE_TEXTS = ["T<|end|><|start|>assistant<|channel|>commentary to=functions." + CALL_W + "<|end|>",
              'T<|end|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|end|>',
              "T<|end|><|start|>assistant to=functions.x<|message|>{}<|end|><|start|>assistant<|channel|>final"]


def test_parse_of_what_llama_server_generated_is_its_own(cpp, sp):
    ch, to, msg = _tok(sp, "<|channel|>"), _tok(sp, " to"), _tok(sp, "<|message|>")
    cases = [{"tool_choice": "required", "logit_bias": [[to, 30], [msg, 30]]},
             {"tool_choice": "required", "logit_bias": [[ch, 30], [to, 20], [msg, 10]]},
             {"tool_choice": "required"},
             {"tool_choice": "auto", "logit_bias": [[to, 30], [msg, 20]]},   # its lazy grammar starts at " to"
             {"tool_choice": "required", "logit_bias": [[ch, 10], [msg, 30]], "max_tokens": 12}]
    for extra in cases:
        body = {"messages": USER, "tools": TOOLS, "max_tokens": N, "temperature": 0, "verbose": True, **extra}
        r = _post(cpp, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        j = r.json()
        raw, theirs = j["__verbose"]["content"], j["choices"][0]["message"]
        ours = _parse(raw, partial=False)
        assert _no_ids(ours) == _no_ids(theirs), (extra, raw)


# ---- the same grammar, the same tokens --------------------------------------------------------------------
def _plan(sp, choice, messages=USER, tools=TOOLS):
    tools = check_tools(tools)
    plan = plan_tools(tool_chat_for(sp.target), messages, tools, check_tool_choice(choice, tools), None)
    return plan, sp.target.tokenize(plan.prompt, add_special=not plan.added_special, parse_special=True)


def _cpp_grammar_fields(plan) -> dict:
    g = plan.grammar
    if not g.lazy:
        return {"grammar": g.gbnf}
    return {"grammar": g.gbnf, "grammar_lazy": True, "grammar_triggers": [{"type": 1, "value": w} for w in g.words],
            "preserved_tokens": list(plan.fmt.markers)}


DECODES = [(REQUIRED, {" to": 30, "<|message|>": 30}, "get_time"),                    # role header
           (REQUIRED, {"<|channel|>": 30, " to": 20, "<|message|>": 10}, "get_time"),  # channel header
           (NAMED, {" to": 30, "<|message|>": 30}, "get_weather"),
           (REQUIRED, {"<|channel|>": 30, "comment": 25, " to": 20, "<|message|>": 10}, None),  # stray + analysis
           ("auto", {" to": 30, "<|message|>": 30}, None)]                              # never triggers


@pytest.mark.parametrize("choice,bias,name", DECODES, ids=["role", "channel", "named", "analysis", "auto"])
def test_constrained_decode_is_llama_cpps_with_and_without_a_draft(cpp, serve, sp, choice, bias, name):
    target = sp.target
    lb = {_tok(sp, k): float(v) for k, v in bias.items()}
    plan, toks = _plan(sp, choice)
    theirs = cpp.complete(toks, N, logit_bias=[[t, b] for t, b in lb.items()], **_cpp_grammar_fields(plan))
    ours = sp.generate(toks, N, grammar=plan.compile(target), logit_bias=lb)
    assert ours.tokens == theirs["tokens"], (ours.text, theirs["content"])
    body = {"messages": USER, "tools": TOOLS, "tool_choice": choice, "max_tokens": N, "temperature": 0,
            "logit_bias": [[t, b] for t, b in lb.items()]}
    r = _post(serve, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    text = ReplyText(target.token_to_piece, target.is_eog, plan.special_ids(target))
    text.push(ours.tokens)
    reply = harmony.parse(text.finish(), plan.fmt, plan.names, partial=ch["finish_reason"] == "length")
    assert _no_ids(ch["message"]) == _no_ids(message_json(reply)), text.text
    assert [c.name for c in reply.calls] == ([name] if name else [])
    if name:
        assert ch["finish_reason"] == "tool_calls"
        jsonschema.validate(json.loads(reply.calls[0].arguments), SCHEMAS[name])


def test_lazy_grammar_triggers_where_llama_servers_patterns_do(sp):
    """auto: the trigger words start the grammar after the reply's analysis (never inside it), at a
    later message's recipient, and the grammar then holds the call to a tool's schema."""
    target = sp.target
    plan, _ = _plan(sp, "auto")
    cases = [(A + "I could say to=functions here.<|end|><|start|>assistant to=functions.get_time", True),
             (A + "x<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather", True),
             ("<|channel|>commentary to=functions.get_weather", True),
             ("<|channel|>final<|message|>Nothing to do.", False),
             (A + "<|channel|>commentary to=functions.get_weather", False)]      # inside the analysis block
    for text, fires in cases:
        g = plan.compile(target)
        try:
            for t in target.tokenize(text, False, True):
                g.accept(t)
            assert g.triggered == fires, text
            if fires:
                good = target.tokenize('<|channel|>commentary<|message|>{"city": "Paris"}' if "get_time" in text
                                       else '<|message|>{"city": "Lima", "unit": "f"}', False, True)
                bad = target.tokenize('<|message|>{"city": "Rome"}', False, True)
                assert g.valid_prefix(good) == len(good) and g.valid_prefix(bad) < len(bad), text
        finally:
            g.close()


# ---- end to end against llama-server --jinja ------------------------------------------------------------
@pytest.fixture(scope="module")
def no_leading_space(sp):
    """logit_bias banning every token whose text starts with whitespace, but `` to`` (module doc)."""
    t = sp.target
    to = _tok(sp, " to")
    return [[i, False] for i in range(t.n_vocab) if i != to and t.token_to_piece(i, False)[:1].isspace()]


@pytest.mark.parametrize("bias", [{" to": 30, "<|message|>": 30}, {"<|channel|>": 30, " to": 20, "<|message|>": 10}],
                         ids=["role", "channel"])
def test_call_is_llama_server_jinjas(cpp, serve, sp, no_leading_space, bias):
    lb = [[_tok(sp, k), v] for k, v in bias.items()]
    body = {"messages": USER, "tools": TOOLS, "tool_choice": REQUIRED, "max_tokens": N, "temperature": 0,
            "logit_bias": lb + no_leading_space}
    theirs = _post(cpp, "/v1/chat/completions", body)
    ours = _post(serve, "/v1/chat/completions", body)
    assert theirs.status_code == ours.status_code == 200, (theirs.text, ours.text)
    a, b = ours.json()["choices"][0], theirs.json()["choices"][0]
    assert _calls(a["message"]) and _no_ids(a["message"]) == _no_ids(b["message"]), (a, b)
    assert a["finish_reason"] == b["finish_reason"] == "tool_calls"
    name, args = _calls(a["message"])[0]
    jsonschema.validate(args, SCHEMAS[name])


# ---- streaming, a conversation, errors --------------------------------------------------------------------
def test_streamed_chunks_reassemble_to_the_call(serve, sp):
    lb = [[_tok(sp, "<|channel|>"), 30], [_tok(sp, " to"), 20], [_tok(sp, "<|message|>"), 10]]
    body = {"messages": USER, "tools": TOOLS, "tool_choice": REQUIRED, "max_tokens": N, "temperature": 0,
            "logit_bias": lb}
    full = _post(serve, "/v1/chat/completions", body).json()["choices"][0]
    events = sse_json(SESSION.post(serve.url + "/v1/chat/completions", json={**body, "stream": True}, stream=True,
                                   timeout=600))
    calls = tt.check_streamed_call(events, full, reasoning=True)
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])


def test_a_tool_result_goes_back_in_and_the_conversation_goes_on(serve, cpp, sp):
    lb = [[_tok(sp, " to"), 30], [_tok(sp, "<|message|>"), 30]]
    first = _post(serve, "/v1/chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": REQUIRED,
                                                   "max_tokens": N, "temperature": 0, "logit_bias": lb}).json()
    msg = first["choices"][0]["message"]
    call = msg["tool_calls"][0]
    convo = USER + [msg, {"role": "tool", "tool_call_id": call["id"], "content": '{"time": "12:00"}'}]
    ours = _post(serve, "/apply-template", {"messages": convo, "tools": TOOLS})
    theirs = _post(cpp, "/apply-template", {"messages": convo, "tools": TOOLS})
    assert ours.status_code == 200 and ours.json()["prompt"] == theirs.json()["prompt"]
    assert "to=functions." + call["function"]["name"] in ours.json()["prompt"]
    second = _post(serve, "/v1/chat/completions", {"messages": convo, "tools": TOOLS, "tool_choice": REQUIRED,
                                                    "max_tokens": N, "temperature": 0, "logit_bias": lb})
    assert second.status_code == 200, second.text
    calls = second.json()["choices"][0]["message"]["tool_calls"]
    assert calls and calls[0]["id"] != call["id"]


def test_a_conversation_the_template_refuses_is_a_400(serve):
    bad = [USER + [{"role": "assistant", "content": A + "x<|end|>"}, {"role": "user", "content": "?"}],
           USER + [{"role": "tool", "tool_call_id": "c1", "content": "21"}]]
    for messages in bad:
        r = _post(serve, "/v1/chat/completions", {"messages": messages, "tools": TOOLS, "max_tokens": 2})
        assert r.status_code == 400, r.text
    assert _post(serve, "/v1/chat/completions", {"messages": USER, "tools": TOOLS, "max_tokens": 2}).status_code == 200


def test_dspark_gives_serves_call_and_streams_it(files, serve, sp):
    """The Python API (``DSpark.create_chat_completion``, with the draft) ends in serve's message."""
    from pyllama_dspark.integrations.dspark import DSpark

    target, draft, _ = files
    bias = {_tok(sp, "<|channel|>"): 30.0, _tok(sp, " to"): 20.0, _tok(sp, "<|message|>"): 10.0}
    kw = dict(tools=TOOLS, tool_choice=REQUIRED, max_tokens=N, temperature=0)
    theirs = _post(serve, "/v1/chat/completions", {"messages": USER, **kw,
                                                    "logit_bias": [[t, b] for t, b in bias.items()]})
    with DSpark(target, draft, n_ctx=2048, n_threads=TEST_THREADS, schedule="off") as ds:
        ours = ds.create_chat_completion(USER, logit_bias=bias, **kw)["choices"][0]
        chunks = list(ds.create_chat_completion(USER, logit_bias=bias, stream=True, **kw))
    want = theirs.json()["choices"][0]
    assert _no_ids(ours["message"]) == _no_ids(want["message"]) and ours["finish_reason"] == want["finish_reason"]
    args = "".join(tc.get("function", {}).get("arguments", "") for ch in chunks
                   for tc in ch["choices"][0]["delta"].get("tool_calls", []))
    assert ours["message"]["tool_calls"] and args == ours["message"]["tool_calls"][0]["function"]["arguments"]


def test_any_text_parses_and_streams_without_error():
    """Model output is arbitrary where no grammar ran: any text parses, in any cut, and the streamed
    deltas reassemble to the stream's last message, which is the text's parse unless the text turned
    out not to fit (then the whole text is content: a stream cannot take back what it sent)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from pyllama_dspark.chat.parse import ReplyDiffer

    fmt = FORMATS["harmony"]
    pieces = st.sampled_from(["<|start|>assistant", "<|channel|>", "analysis", "commentary", "final", "<|message|>",
                              "<|end|>", " to=functions.ping", " to=functions.pong", " to=assistant", " json",
                              "<|constrain|>", "{}", "{", "}", '"a"', ":", "1", "[", " ", "x", "\\", '"', "<|en",
                              "<|channel|>commentary to=functions.ping <|constrain|>json<|message|>{}",
                              A + "r<|end|><|start|>assistant", "<|channel|>final<|message|>done"])

    @settings(max_examples=300, deadline=None)
    @given(st.lists(pieces, max_size=24), st.integers(1, 7))
    def check(parts, step):
        text = "".join(parts)
        final = harmony.parse(text, fmt, ["ping"])
        d = ReplyDiffer(fmt, ["ping"], parse=harmony.parse)
        got = tt.merge_deltas(delta for k in list(range(step, len(text), step)) + [len(text)]
                              for delta in d.update(text[:k], final=k == len(text))[1])
        content, reasoning = got["content"], got["reasoning_content"]
        args = {i: c["arguments"] for i, c in got["tool_calls"].items()}
        last = d.prev
        assert len(last.calls) <= 1 and sorted(args) == list(range(len(last.calls))), (text, args)
        assert [args[i] for i in range(len(last.calls))] == [c.arguments for c in last.calls], text
        if final.content != text:      # the text fit: the stream is its parse
            assert (content, reasoning, [(c.name, c.arguments) for c in last.calls]) == \
                (final.content, final.reasoning, [(c.name, c.arguments) for c in final.calls]), text

    check()


NONE_BIAS = [{}, {"<|channel|>": 10}, {"<|channel|>": 30, " to": 20, "<|message|>": 10}, {" to": 30, "<|message|>": 30},
             {"<|channel|>": 8, "<|message|>": 7, "<|end|>": 6}]


def test_tool_choice_none_reply_is_llama_servers_and_streams_to_it(cpp, serve, sp):
    """tool_choice "none", greedy: serve's message is llama-server's (analysis channels as
    reasoning_content, the final channel as content, a reply that parses to nothing given whole), and
    its streamed deltas reassemble to it.  A reply llama-server answers with HTTP 500 ("does not match")
    is whole content here (docs/serve.md): a random target writes no harmony message on its own, so
    the split itself is checked against llama-server on fixed texts above."""
    for bias in NONE_BIAS:
        body = {"messages": USER, "tools": TOOLS, "tool_choice": "none", "max_tokens": N, "temperature": 0,
                "logit_bias": [[_tok(sp, t), v] for t, v in bias.items()]}
        a, b = _post(serve, "/v1/chat/completions", body), _post(cpp, "/v1/chat/completions", body)
        assert a.status_code == 200, a.text
        mine = a.json()["choices"][0]
        if b.status_code == 500 and "does not match" in b.text:
            assert set(mine["message"]) == {"role", "content"}, mine
        else:
            theirs = b.json()["choices"][0]
            assert mine["message"] == theirs["message"] and mine["finish_reason"] == theirs["finish_reason"], bias
        events = sse_json(SESSION.post(serve.url + "/v1/chat/completions", json={**body, "stream": True},
                                       stream=True, timeout=600))
        assert tt.streamed_text(events[:-1]) == tt.message_text(mine["message"]), bias
