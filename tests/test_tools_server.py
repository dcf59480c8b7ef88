"""Tool calls on ``serve`` against llama.cpp's own llama-server (``--jinja``, same files, same template).

Targets: random ones carrying a real model's chat template and special tokens (``tool_targets.py``:
Qwen3 / Hermes ``<tool_call>``, Llama 3.2 JSON, Mistral Nemo ``[TOOL_CALLS]``), and the shipped SmolLM2
(no tool syntax: the generic form).  References:

* the prompt: llama-server's ``/apply-template`` with the same tools and conversation;
* the parser: llama-server's own parse of a text (an assistant prefill it continues by nothing), and
  of what it generated itself (``verbose``: the raw text beside its message);
* the constrained decode: llama-server's ``/completion`` with our prompt tokens and our grammar
  (strict, or lazy with the same triggers: llama.cpp's own lazy sampler): the same tokens, ours with
  and without a draft (every block verified);
* the end to end call: llama-server ``--jinja``'s parsed call (function, arguments as JSON), where both
  grammars admit the same replies: the request bans tokens that start with whitespace, because the
  two JSON-schema converters place whitespace differently (docs/serve.md "Tools"); llama-server's
  Qwen3 grammar admits any text before a call, so a random Qwen3 target never starts one there (its
  end to end check is the parse and the same-grammar decode);
* ``jsonschema`` for every parsed call's arguments; the ``openai`` client for the round trip.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

import tool_targets as tt
from greedy_ref import TEST_THREADS
from serve_helpers import SESSION, ServeProcess, sse_json
from tool_targets import PARAMS, TIME, USER, WEATHER, calls as _calls, post as _post, strip_ids as _strip_ids
from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.gguf.testing import make_test_draft
from pyllama_dspark.chat.tool_prompt import tool_chat_for
from pyllama_dspark.chat import tool_codecs
from pyllama_dspark.chat.parse import ReplyDiffer, ReplyText, message_json, parse_reply

pytestmark = pytest.mark.slow

TOOLS = [WEATHER, TIME]
N = 48
KINDS = ("qwen3", "llama3", "mistral")


def _history(kind: str) -> list:
    cid = "abcDEF123"       # Mistral's template wants 9 alphanumerics
    call = {"id": cid, "type": "function", "function": {"name": "get_weather",
                                                        "arguments": '{"city": "Paris", "unit": "c"}'}}
    return [{"role": "system", "content": "You are terse."}] + USER + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": cid, "content": '{"temperature": 21}'}]


# ---- fixtures: targets, drafts, servers ------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools-server")
    out = {}
    for kind in KINDS:
        target = tt.build(kind, d)
        out[kind] = (target, make_test_draft(target, str(d / f"draft-{kind}.gguf"), kind="dspark", seed=5))
    return out


@pytest.fixture(scope="module")
def llama_server_bin():
    from pyllama_dspark.upstream.llama_server_build import ensure_llama_server

    return ensure_llama_server()


class _Servers:
    """One llama-server --jinja, one serve without a draft and one with a random draft (every block
    verified) per target, started on first use."""

    def __init__(self, files, binary, tmp):
        self.files, self.binary, self.tmp, self._up = files, binary, tmp, {}

    def get(self, kind: str, which: str):
        key = (kind, which)
        if key not in self._up:
            target, draft = self.files[kind]
            if which == "cpp":
                from pyllama_dspark.upstream.llama_server import LlamaServer

                s = LlamaServer(self.binary, target, None, ctx=4096, threads=TEST_THREADS, extra_args=["--jinja"],
                                trace=False, log_path=self.tmp / f"ls-{kind}.log").start()
            else:
                s = ServeProcess(target, draft if which == "draft" else None, self.tmp / f"serve-{kind}-{which}.log",
                                 n_ctx=4096, extra=["--schedule", "off"] if which == "draft" else [])
            self._up[key] = s
        return self._up[key]

    def close(self):
        for s in self._up.values():
            s.stop()


@pytest.fixture(scope="module")
def servers(files, llama_server_bin, tmp_path_factory):
    s = _Servers(files, llama_server_bin, tmp_path_factory.mktemp("tools-logs"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def targets(files):
    """The targets opened in this process (tokenizer, template): our plan of a request."""
    out = {}
    for kind, (path, _) in files.items():
        out[kind] = Speculator(path, None, n_ctx=2048, n_threads=TEST_THREADS)
    yield out
    for sp in out.values():
        sp.close()


# ---- the prompt -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_prompt_with_tools_and_tool_turns_is_llama_servers(servers, kind):
    ours, cpp = servers.get(kind, "plain"), servers.get(kind, "cpp")
    for body in ({"messages": USER, "tools": TOOLS}, {"messages": _history(kind), "tools": TOOLS},
                 {"messages": USER, "tools": TOOLS, "tool_choice": "none"},
                 {"messages": _history(kind), "tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": False}}):
        a, b = _post(ours, "/apply-template", body), _post(cpp, "/apply-template", body)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        assert a.json()["prompt"] == b.json()["prompt"], body


# ---- the parser ---------------------------------------------------------------------------------------
TEXTS = {
    "qwen3": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
              'Sure.<tool_call>\n{"name":"get_time","arguments":{"city":"Tokyo"}}\n</tool_call>',
              '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "unit": "f"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>',
              "Just an answer, no call.", '<tool_call>\n{"name": "get_time",\n "arguments": {\n  "city": "Paris"\n }}'
                                         '\n</tool_call>'],
    "llama3": ['{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}',
               '{"name":"get_time","parameters":{"city":"Tokyo"}}', "It is sunny."],
    "mistral": ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}, "id": "a1b2c3d4e"}]',
                '[TOOL_CALLS][{"name": "get_time", "arguments": {"city": "Tokyo"}, "id": "A1b2c3d4e"}, {"name": '
                '"get_weather", "arguments": {"city": "Lima", "unit": "f"}, "id": "B1b2c3d4e"}]', "No call here."],
}


@pytest.mark.parametrize("kind", KINDS)
def test_parse_of_a_text_is_llama_servers(servers, targets, kind):
    """llama-server continues an assistant prefill by nothing (its EOG forced) and parses the prefill."""
    cpp = servers.get(kind, "cpp")
    target = targets[kind].target
    eog = target.tokenize(tt.TARGETS[kind].eos, False, True)[0]
    fmt = tool_chat_for(target).format
    for text in TEXTS[kind]:
        body = {"messages": USER + [{"role": "assistant", "content": text}], "tools": TOOLS, "max_tokens": 1,
                "logit_bias": [[eog, 100]], "temperature": 0}
        r = _post(cpp, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        theirs = r.json()["choices"][0]["message"]
        ours = message_json(parse_reply(text, fmt, ["get_weather", "get_time"]))
        assert _strip_ids(ours) == _strip_ids(theirs), text
    # tool_choice "none": no calls, the text is content (a continued prefill follows a closed
    # reasoning block, so a <think> in it is content too and leading whitespace is kept)
    for text in TEXTS[kind] + NONE_TEXTS:
        body = {"messages": USER + [{"role": "assistant", "content": text}], "tools": TOOLS, "max_tokens": 1,
                "logit_bias": [[eog, 100]], "temperature": 0, "tool_choice": "none"}
        r = _post(cpp, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        theirs = r.json()["choices"][0]["message"]
        ours = message_json(tool_codecs.parser(fmt, calls=False)(text, fmt, ["get_weather", "get_time"], lstrip=False))
        assert ours == theirs, text


NONE_TEXTS = ["<think>\nhm\n</think>\n\nHello", "  <think>r</think>  x  ", "\n\nplain\n", "a<think>b</think>c"]


def _ours(raw: str, fmt, extra: dict, finish: str) -> dict:
    """Our message of a reply to the request ``extra`` (ReplyDiffer's last update, as serve's)."""
    closed = extra.get("chat_template_kwargs", {}).get("enable_thinking") is False
    d = ReplyDiffer(fmt, ["get_weather", "get_time"], not closed,
                    parse=tool_codecs.parser(fmt, calls=extra["tool_choice"] != "none"))
    return message_json(d.finish(raw, cut=finish == "length")[0])


@pytest.mark.parametrize("kind", KINDS)
def test_parse_of_what_llama_server_generated_is_its_own(servers, targets, kind):
    """Whatever llama-server --jinja writes (random targets write whitespace, runaway strings, loops of
    the start token), our parser splits its raw text as its parser did."""
    cpp = servers.get(kind, "cpp")
    target = targets[kind].target
    start = target.tokenize(tt.TARGETS[kind].start, False, True)[0]
    fmt = tool_chat_for(target).format
    cases = [{"tool_choice": "auto"}, {"tool_choice": "required", "logit_bias": [[start, 30]]},
             {"tool_choice": "required", "logit_bias": [[start, 8]]}, {"tool_choice": "none"}]
    if kind == "qwen3":
        think, close = (target.tokenize(t, False, True)[0] for t in ("<think>", "</think>"))
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        cases += [{"tool_choice": "auto", "logit_bias": [[think, 6]]},
                  {"tool_choice": "required", **off, "logit_bias": [[start, 5]]},
                  {"tool_choice": "none", "logit_bias": [[think, 6]]},                   # reasoning, cut
                  {"tool_choice": "none", "logit_bias": [[think, 6], [close, 5]]},       # <think></think> content
                  {"tool_choice": "none", "logit_bias": [[start, 20]]},                  # a call's start: content
                  {"tool_choice": "none", **off, "logit_bias": [[think, 6]]},            # closed: <think> is content
                  {"tool_choice": "auto", **off, "logit_bias": [[think, 6], [close, 5]]}]
    for extra in cases:
        body = {"messages": USER, "tools": TOOLS, "max_tokens": N, "temperature": 0, "verbose": True,
                "parallel_tool_calls": False, **extra}
        r = _post(cpp, "/v1/chat/completions", body)
        if r.status_code != 200:   # llama-server's 500 "does not match the expected format": we return content
            assert "does not match" in r.text, r.text
            continue
        j = r.json()
        raw, theirs = j["__verbose"]["content"], j["choices"][0]["message"]
        if extra["tool_choice"] == "none":
            assert "tool_calls" not in theirs
        ours = _ours(raw, fmt, extra, j["choices"][0]["finish_reason"])
        assert _strip_ids(ours) == _strip_ids(theirs), (extra, raw)


# ---- the same grammar, the same tokens ---------------------------------------------------------------
def _plan(sp, choice, parallel=False, kw=None, messages=USER, tools=TOOLS):
    return tt.planned(sp.target, choice, tools, messages, parallel, kw)


def _cpp_grammar_fields(plan, target) -> dict:
    g = plan.grammar
    if g is None:
        return {}
    if not g.lazy:
        return {"grammar": g.gbnf}
    trig, keep = [], []
    for w in g.words:
        if g.at_start:
            trig.append({"type": 3, "value": r"\s*(" + _re_escape(w) + r")[\s\S]*"})   # PATTERN_FULL
        else:
            trig.append({"type": 1, "value": w})                                       # WORD
            if len(target.tokenize(w, False, True)) == 1:
                keep.append(w)           # a one-token word: llama-server makes it a token trigger
    return {"grammar": g.gbnf, "grammar_lazy": True, "grammar_triggers": trig, "preserved_tokens": keep}


def _re_escape(s: str) -> str:
    import re

    return re.escape(s)


CHOICES = [("qwen3", "required"), ("qwen3", {"type": "function", "function": {"name": "get_time"}}),
           ("qwen3", "auto"), ("llama3", "required"), ("llama3", "auto"), ("mistral", "required"),
           ("mistral", {"type": "function", "function": {"name": "get_time"}}), ("mistral", "auto")]


@pytest.mark.parametrize("kind,choice", CHOICES,
                         ids=[f"{k}-{c if isinstance(c, str) else 'named'}" for k, c in CHOICES])
def test_constrained_decode_is_llama_cpps_with_and_without_a_draft(servers, targets, files, kind, choice):
    """Our prompt and grammar, decoded by llama-server's /completion (strict or lazy), by us in process
    without a draft, and by serve with a random draft verifying every block: the same tokens, and
    serve's message is the parse of them."""
    sp = targets[kind]
    target = sp.target
    start = target.tokenize(tt.TARGETS[kind].start, False, True)[0]
    bias = {start: 30.0} if choice == "auto" else None      # a random target starts a call only if pushed
    kw = {"enable_thinking": False} if kind == "qwen3" else None
    plan, toks = _plan(sp, choice, kw=kw)
    cpp = servers.get(kind, "cpp").complete(toks, N, logit_bias=[[t, b] for t, b in (bias or {}).items()],
                                            **_cpp_grammar_fields(plan, target))
    done = sp.generate(toks, N, grammar=plan.compile(target), logit_bias=bias)
    assert done.tokens == cpp["tokens"], (done.text, cpp["content"])
    body = {"messages": USER, "tools": TOOLS, "tool_choice": choice, "max_tokens": N, "temperature": 0,
            "parallel_tool_calls": False}
    if kw:
        body["chat_template_kwargs"] = kw
    if bias:
        body["logit_bias"] = [[t, b] for t, b in bias.items()]
    r = _post(servers.get(kind, "draft"), "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice0 = r.json()["choices"][0]
    text = ReplyText(target.token_to_piece, target.is_eog, plan.special_ids(target))
    text.push(cpp["tokens"])
    parsed = parse_reply(text.finish(), plan.fmt, plan.names, partial=choice0["finish_reason"] == "length",
                         lstrip=plan.lstrip)
    assert _calls(choice0["message"]) == [(c.name, json.loads(c.arguments)) for c in parsed.calls]
    # auto: Mistral's pushed start token is its trigger; Qwen3's trigger is "<tool_call>\n" and Llama
    # 3's a reply that starts '{"name"': a random target pushed to "<tool_call>" or "{" repeats it and
    # never triggers, on both sides (the same tokens: unconstrained)
    assert bool(parsed.calls) == (choice != "auto" or kind == "mistral"), text.text
    if choice != "auto":
        assert choice0["finish_reason"] == "tool_calls" and len(_calls(choice0["message"])) == 1
        name, args = _calls(choice0["message"])[0]
        if isinstance(choice, dict):
            assert name == choice["function"]["name"]
        jsonschema.validate(args, {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name])


# ---- end to end against llama-server --jinja ---------------------------------------------------------
@pytest.fixture(scope="module")
def no_leading_space(targets):
    """logit_bias banning every token whose text starts with whitespace (both converters then admit
    the same replies; see the module doc)."""
    out = {}
    for kind, sp in targets.items():
        t = sp.target
        out[kind] = [[i, False] for i in range(t.n_vocab) if t.token_to_piece(i, False)[:1].isspace()]
    return out


@pytest.mark.parametrize("kind,choice", [("llama3", "required"), ("mistral", "required"), ("mistral", "auto")])
def test_call_is_llama_server_jinjas(servers, targets, no_leading_space, kind, choice):
    target = targets[kind].target
    start = target.tokenize(tt.TARGETS[kind].start, False, True)[0]
    body = {"messages": USER, "tools": [WEATHER], "tool_choice": choice, "max_tokens": N, "temperature": 0,
            "parallel_tool_calls": False, "logit_bias": [[start, 30]] + no_leading_space[kind]}
    theirs = _post(servers.get(kind, "cpp"), "/v1/chat/completions", body)
    assert theirs.status_code == 200, theirs.text
    for which in ("plain", "draft"):
        ours = _post(servers.get(kind, which), "/v1/chat/completions", body)
        assert ours.status_code == 200, ours.text
        calls = _calls(ours.json()["choices"][0]["message"])
        assert calls and calls == _calls(theirs.json()["choices"][0]["message"]), (ours.text, theirs.text)
        jsonschema.validate(calls[0][1], PARAMS)


# ---- streaming, conversations, errors, the openai client --------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_streamed_chunks_reassemble_to_the_call(servers, kind):
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": N, "temperature": 0,
            "parallel_tool_calls": False, "chat_template_kwargs": {"enable_thinking": False}}
    srv = servers.get(kind, "draft")
    full = _post(srv, "/v1/chat/completions", body).json()["choices"][0]
    r = SESSION.post(srv.url + "/v1/chat/completions", json={**body, "stream": True}, stream=True, timeout=600)
    tt.check_streamed_call(sse_json(r), full)


def test_a_tool_result_goes_back_in_and_the_conversation_goes_on(servers):
    """Qwen3: call, result (role "tool"), then the reply to it: the prompt is llama-server's (see
    test_prompt_...), the reply decodes, and its call ids are new."""
    srv = servers.get("qwen3", "plain")
    first = _post(srv, "/v1/chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": "required",
                                                 "max_tokens": N, "temperature": 0,
                                                 "chat_template_kwargs": {"enable_thinking": False}}).json()
    msg = first["choices"][0]["message"]
    call = msg["tool_calls"][0]
    convo = USER + [msg, {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 21}'}]
    second = _post(srv, "/v1/chat/completions", {"messages": convo, "tools": TOOLS, "tool_choice": "required",
                                                  "max_tokens": N, "temperature": 0, "parallel_tool_calls": False,
                                                  "chat_template_kwargs": {"enable_thinking": False}})
    assert second.status_code == 200, second.text
    calls = second.json()["choices"][0]["message"]["tool_calls"]
    assert calls and calls[0]["id"] != call["id"]
    cpp = _post(servers.get("qwen3", "cpp"), "/apply-template", {"messages": convo, "tools": TOOLS,
                                                                 "chat_template_kwargs": {"enable_thinking": False}})
    ours = _post(srv, "/apply-template", {"messages": convo, "tools": TOOLS,
                                           "chat_template_kwargs": {"enable_thinking": False}})
    assert ours.json()["prompt"] == cpp.json()["prompt"]


BAD = [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name must be"),
    ({"tools": "get_weather"}, "must be an array"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in 'tools'"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "must be one of"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "must be a boolean"),
    ({"tools": [WEATHER], "grammar": 'root ::= "x"'}, "grammar constraints with tools"),
    ({"tools": [WEATHER], "stream": True, "logprobs": True}, "logprobs is not supported"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]},
     "not a valid JSON schema"),
    ({"messages": USER + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]}],
      "tools": [WEATHER]}, "is not JSON"),
    ({"messages": USER + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c9", "content": "21"}], "tools": [WEATHER]}, "matches no earlier"),
]


@pytest.mark.parametrize("extra,msg", BAD, ids=[m for _, m in BAD])
def test_bad_tool_input_is_a_400_and_the_server_keeps_serving(servers, extra, msg):
    srv = servers.get("qwen3", "plain")
    body = {"messages": USER, "max_tokens": 4, **extra}
    r = _post(srv, "/v1/chat/completions", body)
    assert r.status_code == 400 and msg in r.json()["error"]["message"], r.text
    ok = _post(srv, "/v1/chat/completions", {"messages": USER, "tools": [WEATHER], "max_tokens": 2})
    assert ok.status_code == 200 and srv.get("/health").status_code == 200


def test_a_format_we_do_not_build_is_a_400_that_names_it(tmp_path):
    from pyllama_dspark.gguf.target_writer import make_test_target

    path = tmp_path / "kimi-k2-template.gguf"
    make_test_target(path, "qwen3", n_vocab=tt.N_VOCAB, seed=2, vocab_type="f32",
                     tokenizer_extra=dict(chat_template=tt.template_text("moonshotai-Kimi-K2.jinja")))
    srv = ServeProcess(str(path), None, tmp_path / "serve.log", n_ctx=2048)
    try:
        r = _post(srv, "/v1/chat/completions", {"messages": USER, "tools": [WEATHER], "max_tokens": 4})
        assert r.status_code == 400 and "Kimi K2" in r.json()["error"]["message"], r.text
        assert _post(srv, "/v1/chat/completions", {"messages": USER, "max_tokens": 2}).status_code == 200
    finally:
        srv.stop()


def test_openai_client_tools_round_trip(servers):
    from openai import OpenAI

    srv = servers.get("mistral", "draft")
    client = OpenAI(base_url=srv.url + "/v1", api_key="none")
    r = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=N,
                                       temperature=0, parallel_tool_calls=False)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls
    call = msg.tool_calls[0]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name])
    r2 = client.chat.completions.create(model="m", messages=USER + [msg.model_dump(exclude_none=True), {
        "role": "tool", "tool_call_id": call.id, "content": "21 C"}], tools=TOOLS, max_tokens=8, temperature=0)
    assert r2.choices[0].message is not None


# ---- SmolLM2: the generic form, "auto" triggered by the prompt, the shipped drafter -----------------
def test_generic_auto_on_smollm2_emits_the_call_as_llama_cpps_lazy_grammar(target_path, llama_server_bin, tmp_path):
    from pyllama_dspark.paths import default_draft
    from pyllama_dspark.upstream.llama_server import LlamaServer

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather in a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    msgs = [{"role": "user", "content": "Reply with a <tool_call> that calls get_weather for Paris."}]
    with Speculator(target_path, default_draft(), n_ctx=2048, n_threads=TEST_THREADS, schedule="off") as sp:
        plan, toks = _plan(sp, "auto", parallel=False, messages=msgs, tools=tools)
        assert plan.fmt.name == "generic" and plan.grammar.lazy
        drafted = sp.generate(toks, 64, grammar=plan.compile(sp.target))
        fields = _cpp_grammar_fields(plan, sp.target)
    with Speculator(target_path, None, n_ctx=2048, n_threads=TEST_THREADS) as sp:
        plain = sp.generate(toks, 64, grammar=plan.compile(sp.target))
    assert drafted.tokens == plain.tokens
    assert drafted.stats.accepted > 0, drafted.stats   # drafts were accepted under the lazy grammar
    with LlamaServer(llama_server_bin, target_path, None, ctx=2048, threads=TEST_THREADS, trace=False,
                     log_path=tmp_path / "ls.log") as srv:
        cpp = srv.complete(toks, 64, **fields)
    assert cpp["tokens"] == plain.tokens, (cpp["content"], plain.text)
    reply = parse_reply(plain.text, plan.fmt, plan.names)
    assert [c.name for c in reply.calls] == ["get_weather"], plain.text
    jsonschema.validate(json.loads(reply.calls[0].arguments), tools[0]["function"]["parameters"])


def test_tool_choice_none_keeps_the_requests_own_schema(servers):
    """tool_choice "none": the tools are only in the prompt, and a JSON response_format still holds."""
    r = _post(servers.get("qwen3", "plain"), "/v1/chat/completions", {
        "messages": USER, "tools": TOOLS, "tool_choice": "none", "max_tokens": 8, "temperature": 0,
        "response_format": {"type": "json_object"}, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert "tool_calls" not in msg and msg["content"].lstrip().startswith("{"), msg


def test_a_stop_string_cuts_the_streamed_reply_where_it_cuts_the_reply(servers):
    srv = servers.get("qwen3", "plain")
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 24, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False}}
    text = _post(srv, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    stop = text[len(text) // 2:len(text) // 2 + 5]
    assert len(text) > 20 and stop.strip(), text
    full = _post(srv, "/v1/chat/completions", {**body, "stop": [stop]}).json()["choices"][0]
    events = sse_json(SESSION.post(srv.url + "/v1/chat/completions", json={**body, "stop": [stop], "stream": True},
                                   stream=True, timeout=600))
    streamed = "".join(ev["choices"][0]["delta"].get("content") or "" for ev in events[:-1])
    assert full["message"]["content"] == streamed == text[:text.index(stop)]


NONE_CASES = [("qwen3", [["<think>", 6]]), ("qwen3", [["<think>", 6], ["</think>", 5]]), ("qwen3", [["<tool_call>", 20]]),
              ("llama3", [["{", 20]]), ("mistral", [["[TOOL_CALLS]", 20]])]


@pytest.mark.parametrize("kind,bias", NONE_CASES, ids=["qwen3-think", "qwen3-think-closed", "qwen3-call", "llama3",
                                                       "mistral"])
def test_tool_choice_none_reply_is_llama_servers_and_streams_to_it(servers, targets, kind, bias):
    """tool_choice "none", greedy: serve's message is llama-server's (reasoning split, a call written
    as text left in content), and its streamed deltas reassemble to it."""
    target = targets[kind].target
    lb = [[target.tokenize(t, False, True)[0], v] for t, v in bias]
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "none", "max_tokens": 32, "temperature": 0,
            "logit_bias": lb}
    ours, cpp = servers.get(kind, "plain"), servers.get(kind, "cpp")
    a, b = _post(ours, "/v1/chat/completions", body), _post(cpp, "/v1/chat/completions", body)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    mine, theirs = a.json()["choices"][0], b.json()["choices"][0]
    assert mine["message"] == theirs["message"] and mine["finish_reason"] == theirs["finish_reason"]
    if kind == "qwen3" and len(bias) == 1 and bias[0][0] == "<think>":
        assert mine["message"].get("reasoning_content"), mine
    events = sse_json(SESSION.post(ours.url + "/v1/chat/completions", json={**body, "stream": True}, stream=True,
                                   timeout=600))
    assert events[-1] == "[DONE]"
    assert tt.streamed_text(events[:-1]) == tt.message_text(mine["message"])
