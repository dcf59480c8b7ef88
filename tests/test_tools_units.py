"""Tool calls without a server: format detection, grammars, the lazy grammar, the parser's stream.

References: llama.cpp's vendored chat templates (a format is what a template renders; our grammar
must accept the template's own rendering of calls), llama.cpp's lazy grammar sampler
(``llama_sampler_init_grammar_lazy_patterns`` through llama-cpp-python: the same allowed tokens at
every step), ``jsonschema`` (the tools' checks).  The server-side behaviour against llama-server is
in ``test_tools_server.py``.
"""

from __future__ import annotations

import ctypes
import json
import re

import numpy as np
import pytest
from llama_cpp import llama_chat_format as lcf
from llama_cpp import llama_cpp as ll

import tool_targets as tt
from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.llama.grammar import Grammar, GrammarCursor, _scratch
from pyllama_dspark.llama.grammar_lazy import LazyGrammar
from pyllama_dspark.chat.tool_prompt import ToolChat
from pyllama_dspark.chat.formats import FORMATS, UnsupportedToolFormat
from pyllama_dspark.chat.tool_grammar import ToolSchemaError, tool_grammar
from pyllama_dspark.chat.parse import ReplyDiffer, parse_reply
from pyllama_dspark.chat.tool_request import (check_tool_choice, check_tool_messages, check_tools,
                                                     plan_tools)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                                                   "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
NOARGS = {"type": "function", "function": {"name": "ping"}}

# vendored template -> the format llama-server's chat.cpp finds for it (hermes / llama3 / mistral are
# built; the rest must be refused naming the format)
EXPECTED = {
    "Qwen-Qwen3-0.6B.jinja": "hermes", "Qwen-Qwen2.5-7B-Instruct.jinja": "hermes", "Qwen-QwQ-32B.jinja": "hermes",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": "hermes",
    "meta-llama-Llama-3.1-8B-Instruct.jinja": "llama3", "meta-llama-Llama-3.2-3B-Instruct.jinja": "llama3",
    "meta-llama-Llama-3.3-70B-Instruct.jinja": "llama3",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": "mistral",
    "google-gemma-2-2b-it.jinja": "generic",
    "google-gemma-4-31B-it.jinja": "gemma4", "google-gemma-4-31B-it-interleaved.jinja": "gemma4",
    "openai-gpt-oss-120b.jinja": "harmony",
    "unsloth-mistral-Devstral-Small-2507.jinja": "[ARGS]", "Mistral-Small-3.2-24B-Instruct-2506.jinja": "[ARGS]",
    "Qwen3-Coder.jinja": "xml", "Qwen3.5-4B.jinja": "xml", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": "xml",
    "StepFun3.5-Flash.jinja": "xml",
    "moonshotai-Kimi-K2.jinja": "Kimi", "GLM-4.6.jinja": "GLM",
    "deepseek-ai-DeepSeek-V3.2.jinja": "dsml", "deepseek-ai-DeepSeek-V4.jinja": "dsml4",
    "deepseek-ai-DeepSeek-V4-Flash-0731.jinja": "dsml4",
    "deepseek-ai-DeepSeek-V3.1.jinja": "deepseek31", "llama-cpp-deepseek-r1.jinja": "DeepSeek R1",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "DeepSeek R1",
}


def _chat(name: str) -> ToolChat:
    return ToolChat(tt.template_text(name), "<s>", "</s>")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_format_of_each_vendored_template(name):
    chat = _chat(name)
    want = EXPECTED[name]
    if want in FORMATS:
        assert chat.format is not None and chat.format.name == want, (chat.format, chat.unsupported)
    else:
        assert chat.format is None and want in chat.unsupported, chat.unsupported
        with pytest.raises(UnsupportedToolFormat, match="does not support"):
            plan_tools(chat, [{"role": "user", "content": "hi"}], check_tools([WEATHER]), "required")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = tt.build("qwen3", tmp_path_factory.mktemp("tools-units"))
    with Speculator(path, None, n_ctx=512, n_threads=1) as sp:
        yield sp.target


def _rendered_reply(chat: ToolChat, calls) -> str:
    """The assistant turn a template renders for ``calls`` (its text between the user turn and
    the end of the prompt)."""
    msgs = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"abcde{i:04d}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(calls)]}]
    with_calls = chat.render(msgs, check_tools([WEATHER, NOARGS])).prompt
    without = chat.render(msgs[:1], check_tools([WEATHER, NOARGS])).prompt
    return with_calls[len(without):] if with_calls.startswith(without) else with_calls[with_calls.rindex("U") + 1:]


@pytest.mark.parametrize("name,fmt", [("Qwen-Qwen3-0.6B.jinja", "hermes"),
                                      ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", "hermes"),
                                      ("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3"),
                                      ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral")])
def test_required_grammar_accepts_the_templates_own_rendering_of_calls(qwen, name, fmt):
    chat = _chat(name)
    assert chat.format.name == fmt
    calls = [("get_weather", {"city": "Paris", "unit": "c"})]
    if chat.caps.supports_parallel_tool_calls:
        calls.append(("ping", {}))
    text = _rendered_reply(chat, calls)
    start = text.find(chat.format.first_marker or "{")
    end = text.rfind(chat.format.call_close.strip() or ("]" if chat.format.array else "}")) + \
        len(chat.format.call_close.strip() or "x")
    reply = text[start:end]
    tools = check_tools([WEATHER, NOARGS])
    g = tool_grammar(chat.format, tools, "required", parallel=len(calls) > 1)
    toks = qwen.tokenize(reply, False, True)
    with Grammar.compile(g.gbnf, qwen) as gr:
        assert gr.valid_prefix(toks) == len(toks), (reply, g.gbnf)
        for t in toks:
            gr.accept(t)
        eog = int(np.flatnonzero(qwen.eog_mask)[0])
        assert gr.allows(eog), reply      # the reply may end after its calls, and only space or
        more = [qwen.token_to_piece(int(t), True) for t in np.flatnonzero(gr.allowed() & ~qwen.eog_mask)]
        assert all(not p.strip() or p.startswith(b"<tool_call>") for p in more), more[:5]   # a next call follow
    parsed = parse_reply(reply, chat.format, ["get_weather", "ping"])
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls


def test_required_grammar_refuses_text_before_the_call_and_named_refuses_other_tools(qwen):
    tools = check_tools([WEATHER, NOARGS])
    fmt = FORMATS["hermes"]
    with Grammar.compile(tool_grammar(fmt, tools, "required", True).gbnf, qwen) as g:
        assert not g.allows(qwen.tokenize("Sure", False, True)[0])
        assert g.allows(qwen.tokenize("<tool_call>", False, True)[0])
    named = tool_grammar(fmt, tools, {"name": "ping"}, True).gbnf
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    with Grammar.compile(named, qwen) as g:
        toks = qwen.tokenize(text, False, True)
        assert g.valid_prefix(toks) < len(toks)
        ok = qwen.tokenize('<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>', False, True)
        assert g.valid_prefix(ok) == len(ok)
    with pytest.raises(ToolSchemaError, match="get_weather"):
        tool_grammar(fmt, check_tools([{"type": "function", "function": {
            "name": "get_weather", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}]),
            "required", True)


# ---- the lazy grammar against llama.cpp's own ---------------------------------------------------------
def _native_lazy(target, gbnf, words, tokens):
    pats = (ctypes.c_char_p * max(1, len(words)))(*[re.escape(w).encode() for w in words])
    tk = (ll.llama_token * max(1, len(tokens)))(*tokens)
    return ll.llama_sampler_init_grammar_lazy_patterns(target.vocab, gbnf.encode(), b"root", pats, len(words), tk,
                                                       len(tokens))


def _native_mask(target, smpl):
    buf, arr, ids = _scratch(target.n_vocab)
    buf["id"] = ids
    buf["logit"] = 0.0
    arr.data = ctypes.cast(buf.ctypes.data, ll.llama_token_data_p)
    arr.size, arr.selected, arr.sorted = target.n_vocab, -1, False
    ll.llama_sampler_apply(smpl, ctypes.byref(arr))
    return buf["logit"] != -np.inf


@pytest.mark.parametrize("words,tokens,text", [
    (["<tool_call>\n"], [], 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
                            '\n</tool_call>'),
    (["<tool_call>"], [], 'ok<tool_call>\n{"name":"get_weather","arguments":{"city":"Tokyo","unit":"f"}}'
                          '\n</tool_call>'),
    (["\n{"], [], 'text then<tool_call>\n{"name":"get_weather","arguments":{"city":"Tokyo","unit":"f"}}'),
    ([], [49152], 'x <tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}\n</tool_call>'),
], ids=["word-two-tokens", "word-one-token-as-text", "word-mid-piece", "token"])
def test_lazy_grammar_allows_what_llama_cpps_lazy_sampler_allows(qwen, words, tokens, text):
    gbnf = tool_grammar(FORMATS["hermes"], check_tools([WEATHER]), "auto", True).gbnf
    if words == ["\n{"]:   # a grammar that starts in the middle of a token's piece
        gbnf = gbnf.replace("root ::= calls", 'root ::= "\\n" call')
    seq = qwen.tokenize(text, False, True)
    nat = _native_lazy(qwen, gbnf, words, tokens)
    ours = LazyGrammar.compile(gbnf, qwen, words=words, tokens=tokens)
    try:
        for i, t in enumerate(seq):
            assert np.array_equal(_native_mask(qwen, nat), ours.allowed()), (i, qwen.token_to_piece(t, True))
            ll.llama_sampler_accept(nat, t)
            ours.accept(t)
        assert np.array_equal(_native_mask(qwen, nat), ours.allowed())
        assert ours.triggered
    finally:
        ll.llama_sampler_free(nat)
        ours.close()


def test_lazy_grammar_under_the_cursor_reasoning_start_and_a_bad_trigger(qwen):
    gbnf = tool_grammar(FORMATS["hermes"], check_tools([WEATHER]), "auto", False).gbnf
    tc = qwen.tokenize("<tool_call>", False, True)[0]
    call = qwen.tokenize('\n{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}\n</tool_call>', False, True)
    # inside <think> the trigger does not count (llama-server's reasoning budget keeps the grammar off)
    g = LazyGrammar.compile(gbnf, qwen, words=["<tool_call>\n"], think=("<think>", "</think>"))
    cur = GrammarCursor(g)
    thought = qwen.tokenize("<think>\nmaybe <tool_call>\n{ no\n</think>\n\n", False, True)
    cur.commit(thought)
    assert not g.triggered and g.allows(qwen.tokenize("Sure", False, True)[0])
    # a drafted block is checked on a scratch state; the committed state does not move
    assert cur.state_after([tc] + call[:3]).triggered and not g.triggered
    assert g.valid_prefix([tc] + call) == len(call) + 1
    cur.commit([tc] + call)
    assert g.triggered and g.done
    cur.close()
    # at_start (llama3): only a reply that starts with the word
    g = LazyGrammar.compile(gbnf, qwen, words=["<tool_call>"], at_start=True)
    g.accept(qwen.tokenize("Hi", False, True)[0])
    assert not g.awaiting and not g.triggered
    g.close()
    # a trigger whose text the grammar rejects ("Hello" replayed into "Help"): unconstrained from
    # then on, where llama.cpp's replay would throw through the C API
    g = LazyGrammar.compile('root ::= "Help"', qwen, words=["Hel"])
    hello = qwen.tokenize("Hello", False, True)
    assert len(hello) == 1
    g.accept(hello[0])
    assert not g.triggered and not g.awaiting and g.allows(qwen.tokenize("anything", False, True)[0])
    g.close()


# ---- parsing, streaming -----------------------------------------------------------------------------
STREAM_CASES = [
    ("hermes", 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'),
    ("hermes", '<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Tokyo", "unit": "f"}}\n</tool_call>'),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}, "id": "a1b2c3d4e"},'
                ' {"name": "ping", "arguments": {}}]'),
    ("hermes", "Just text, no call; a < sign and <tool_ but no call."),
]


@pytest.mark.parametrize("fmt,text", STREAM_CASES)
def test_streamed_deltas_reassemble_to_the_final_message(fmt, text):
    f = FORMATS[fmt]
    if "<think>" in text:
        f = type(f)(**{**f.__dict__, "think": ("<think>", "</think>")})
    names = ["get_weather", "ping"]
    final = parse_reply(text, f, names)
    for step in (1, 3, 7):
        d = ReplyDiffer(f, names)
        content, reasoning, calls = "", "", {}
        for k in list(range(step, len(text), step)) + [len(text)]:
            _, deltas = d.update(text[:k], final=k == len(text))
            for delta in deltas:
                content += delta.get("content", "")
                reasoning += delta.get("reasoning_content", "")
                for tc in delta.get("tool_calls", []):
                    c = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
                    if "id" in tc:
                        assert c["id"] is None
                        c["id"] = tc["id"]
                    c["name"] += tc.get("function", {}).get("name", "")
                    c["arguments"] += tc.get("function", {}).get("arguments", "")
        assert content == final.content and reasoning == final.reasoning, (step, content, final)
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
            [(c.name, c.arguments) for c in final.calls]
        assert [c["id"] for _, c in sorted(calls.items())] == [c.id for c in d.prev.calls]
    assert bool(final.calls) == (fmt != "hermes" or "<tool_call>" in text)


# ---- request checks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("tools,msg", [
    ("x", "must be an array"), ([{"type": "retrieval"}], "only tool type"),
    ([{"type": "function"}], "function must be"),
    ([{"type": "function", "function": {"name": ""}}], "non-empty"),
    ([{"type": "function", "function": {"name": "a", "parameters": {"type": "nope"}}}], "not a valid JSON schema"),
    ([WEATHER, WEATHER], "given twice"),
])
def test_malformed_tools_are_refused_with_a_reason(tools, msg):
    with pytest.raises(ValueError, match=msg):
        check_tools(tools)


def test_tool_choice_and_tool_messages_checks():
    tools = check_tools([WEATHER])
    assert check_tool_choice(None, tools) == "auto"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert check_tool_choice(named, tools) == {"name": "get_weather"}
    for bad, msg in [("sometimes", "must be one of"), ({"function": "get_weather"}, "as an object"),
                     ({"type": "function", "function": {"name": "x"}}, "not in 'tools'")]:
        with pytest.raises(ValueError, match=msg):
            check_tool_choice(bad, tools)
    with pytest.raises(ValueError, match="needs 'tools'"):
        check_tool_choice("required", [])
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    ok = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]},
          {"role": "tool", "tool_call_id": "c1", "content": "21"}]
    check_tool_messages(ok)
    with pytest.raises(ValueError, match="matches no earlier"):
        check_tool_messages(ok[:2] + [{"role": "tool", "tool_call_id": "c2", "content": "21"}])
    bad_args = dict(call, function={"name": "get_weather", "arguments": "{city: Paris"})
    with pytest.raises(ValueError, match="is not JSON"):
        check_tool_messages([ok[0], {"role": "assistant", "content": "", "tool_calls": [bad_args]}])


def test_generic_form_for_a_template_without_tool_syntax():
    """SmolLM2's template renders no tools: the tools go into a system message we write, earlier
    calls into the assistant text, results into user turns."""
    from pyllama_dspark.gguf.reader import read_gguf
    from pyllama_dspark.gguf.target_tokenizer import smollm2_gguf_path

    f = read_gguf(smollm2_gguf_path()).fields["tokenizer.chat_template"]
    template = bytes(f.parts[f.data[0]]).decode()
    plain = lcf.Jinja2ChatFormatter(template=template, eos_token="<|im_end|>", bos_token="<|im_start|>")
    chat = ToolChat(template, "<|im_start|>", "<|im_end|>", plain=plain)
    assert chat.format.name == "generic"
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "21 C"}]
    plan = plan_tools(chat, msgs, check_tools([WEATHER]), "required")
    assert '"name": "get_weather"' in plan.prompt.split("<|im_start|>user")[0]       # the tools, in the system turn
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in plan.prompt
    assert "<tool_response>\n21 C\n</tool_response>" in plan.prompt
    assert plan.grammar is not None and not plan.grammar.lazy and plan.parses


# ---- T > 0: the lazy grammar keeps the constrained law under speculation --------------------------------
def test_lazy_grammar_sampling_follows_llama_cpps_law(target_path, llama_refs):
    """SmolLM2, the generic form's "auto" grammar with "<" as its trigger token (the prompt makes "<"
    a likely first token), the shipped drafter verifying every block, T = 1: the first two tokens follow
    llama.cpp's chain with its grammar sampler from the trigger on (free first token; after "<" the
    grammar advanced by it).  Negative control: the strict grammar's law (the call from the first token)."""
    from first_tokens_law import first_two, law_check, two_token_law
    from llama_sampler_ref import LlamaChain
    from pyllama_dspark.paths import default_draft
    from pyllama_dspark.speculative.sampling_params import SamplingParams
    from pyllama_dspark.chat.tool_prompt import tool_chat_for

    tools = check_tools([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
    params = SamplingParams(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0)
    with Speculator(target_path, default_draft(), n_ctx=2048, n_threads=1, schedule="off") as sp:
        msgs = [{"role": "user", "content": "Reply with a <tool_call> that calls get_weather for Paris."}]
        plan = plan_tools(tool_chat_for(sp.target), msgs, tools, "auto", False)
        prompt = sp.target.tokenize(plan.prompt, add_special=not plan.added_special, parse_special=True)
        (lt,) = sp.target.tokenize("<", False, True)
        gbnf = plan.grammar.gbnf
        lazy = LazyGrammar.compile(gbnf, sp.target, tokens=[lt])
        samples = [first_two(sp, prompt, 4, sampling=params.with_seed(900 + i), grammar=lazy, reuse_prefix=True)
                   for i in range(240)]
        lazy.close()
    llm = llama_refs.llm
    v, vocab = llm.n_vocab(), ll.llama_model_get_vocab(llm.model)

    def row():
        return np.ctypeslib.as_array(ll.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(v,)).copy()

    llm.reset()
    llm.eval(prompt)
    n = llm.n_tokens
    chain = LlamaChain(params, v, prompt)
    p1 = chain.probs(row())
    chain.close()
    law = {}
    for t1 in map(int, np.flatnonzero(p1)):
        llm.n_tokens = n
        llm.eval([t1])
        chain = LlamaChain(params, v, prompt + [t1], grammar=(vocab, gbnf, (t1,)) if t1 == lt else None)
        p2 = chain.probs(row())
        chain.close()
        law.update({(t1, int(t2)): float(p1[t1] * p2[t2]) for t2 in np.flatnonzero(p2)})
    assert p1[lt] > 0.2 and any(t1 == lt for t1, _ in samples)
    strict = two_token_law(llm, prompt, params, grammar=gbnf)
    law_check(samples, law, strict, "lazy grammar, shipped drafter, forced blocks", "the strict grammar's law")


def test_any_text_parses_and_streams_without_error():
    """Model output is arbitrary where no grammar ran: every format parses any text, in any cut; the
    streamed deltas always reassemble to the stream's final message, and that is the text's parse
    unless a call already sent turned out not to be one (a stream cannot take it back)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    pieces = st.sampled_from(['<tool_call>\n', '</tool_call>', '\n', ' ', '{', '}', '"name"', ': ', '"ping"', ',',
                              '"arguments"', '"parameters"', '{}', '[TOOL_CALLS]', '[', ']', '"id"', '"a1b2c3d4e"',
                              '<think>', '</think>', 'x', '\\', '"',
                              '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>',
                              '[TOOL_CALLS][{"name": "ping", "arguments": {}}]', '{"name": "ping", "parameters": {}}',
                              '<tool_call>\n{"name": "pong", "arguments": {}}\n</tool_call>'])
    formats = [FORMATS["hermes"], FORMATS["llama3"], FORMATS["mistral"],
               type(FORMATS["hermes"])(**{**FORMATS["hermes"].__dict__, "think": ("<think>", "</think>")})]

    @settings(max_examples=300, deadline=None)
    @given(st.lists(pieces, max_size=30), st.integers(0, 3), st.integers(1, 5))
    def check(parts, f, step):
        fmt, text = formats[f], "".join(parts)
        final = parse_reply(text, fmt, ["ping"])
        d = ReplyDiffer(fmt, ["ping"])
        content = ""
        args: dict = {}
        for k in list(range(step, len(text), step)) + [len(text)]:
            for delta in d.update(text[:k], final=k == len(text))[1]:
                content += delta.get("content", "")
                for tc in delta.get("tool_calls", []):
                    args[tc["index"]] = args.get(tc["index"], "") + tc.get("function", {}).get("arguments", "")
        last = d.prev
        assert content == last.content, (text, content)
        assert sorted(args) == list(range(len(last.calls))), (text, args)
        assert [args[i] for i in range(len(last.calls))] == [c.arguments for c in last.calls]
        if len(final.calls) >= len(args):
            assert (last.content, [(c.name, c.arguments) for c in last.calls]) == \
                (final.content, [(c.name, c.arguments) for c in final.calls]), text

    check()


NONE_REPLIES = [   # (format, text, cut): a tool_choice "none" reply, streamed character by character
    ("qwen3", "<think>\nhm\n</think>\n\nSure <tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>", False),
    ("qwen3", "<think>\ncut reasoning", True), ("qwen3", "<think>\n \n</think>\n\n", False),
    ("mistral", '  [TOOL_CALLS][{"name": "f", "arguments": {}}]', False),
    ("gemma4", "<|channel>thought\nr<channel|>a <|tool_call>call:f{}<tool_call|> b", False),
    ("gemma4", "<|channel><|channel><|channel>", True),
    ("harmony", "<|channel|>analysis<|message|>r<|end|><|start|>assistant<|channel|>final<|message|>ok", False),
    ("harmony", "<|channel|>commentary to=functions.get_wea", True),
]


@pytest.mark.parametrize("kind,text,cut", NONE_REPLIES)
def test_tool_choice_none_deltas_reassemble_to_the_message_and_hold_no_calls(kind, text, cut):
    """ReplyDiffer with the "none" parser (tool_codecs.parser(calls=False)): no calls, the deltas add
    up to the last message, and one that parses to nothing is the whole text (llama-server's)."""
    from pyllama_dspark.chat import tool_codecs

    fmt = _chat("Qwen-Qwen3-0.6B.jinja").format if kind == "qwen3" else (
        _chat("google-gemma-4-31B-it.jinja").format if kind == "gemma4" else FORMATS[kind])
    d = ReplyDiffer(fmt, ["f", "get_weather"], parse=tool_codecs.parser(fmt, calls=False))
    got = {"content": "", "reasoning_content": ""}
    for k in range(1, len(text)):
        for delta in d.update(text[:k])[1]:
            assert "tool_calls" not in delta
            for key in got:
                got[key] += delta.get(key, "")
    reply, deltas = d.finish(text, cut=cut)
    for delta in deltas:
        for key in got:
            got[key] += delta.get(key, "")
    assert not reply.calls and got == {"content": reply.content, "reasoning_content": reply.reasoning}
    assert reply.content or reply.reasoning
