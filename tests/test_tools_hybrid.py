"""A Qwen3.5-templated tool call on a hybrid target (``tool_targets.py`` ``qwen35-hybrid``: the real
Qwen3.5 template on a random Qwen3.5 target, Gated DeltaNet layers beside attention) under
speculation: every block verified (``schedule="off"``), so rejected drafts roll the recurrent state
back through llama.cpp's snapshots.  References: llama-server ``/completion`` with our prompt tokens
and our grammar (the same tokens as ours with the draft and without), and llama-server ``--jinja``'s
own call where its grammar is ours (string parameters); ``jsonschema`` on the arguments."""

from __future__ import annotations

import json

import jsonschema
import pytest

import tool_targets as tt
from greedy_ref import TEST_THREADS
from test_tools_server import _cpp_grammar_fields
from tool_targets import USER, WEATHER, post as _post, strip_ids as _strip_ids
from pyllama_dspark.chat import xml_calls
from pyllama_dspark.chat.parse import ReplyText
from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.gguf.testing import make_test_draft

pytestmark = pytest.mark.slow

N = 40
OFF = {"enable_thinking": False}
LEVEL_PARAMS = {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 30]},
                                                  "on": {"type": "boolean"}}, "required": ["level", "on"]}
LEVEL = {"type": "function", "function": {"name": "set_level", "description": "Set the level",
                                          "parameters": LEVEL_PARAMS}}
# a free string parameter: the grammar admits any text there, so the random draft's blocks are
# verified (and rejected: the recurrent state rolled back) rather than cut by the grammar
LOG_PARAMS = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
LOG = {"type": "function", "function": {"name": "log", "description": "Log a line", "parameters": LOG_PARAMS}}
SCHEMAS = {"set_level": LEVEL_PARAMS, "get_weather": WEATHER["function"]["parameters"], "log": LOG_PARAMS}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools-hybrid")
    target = tt.build("qwen35-hybrid", d)
    return target, make_test_draft(target, str(d / "draft.gguf"), kind="dspark", seed=5), d


@pytest.fixture(scope="module")
def cpp(files, tmp_path_factory):
    from pyllama_dspark.upstream.llama_server import LlamaServer
    from pyllama_dspark.upstream.llama_server_build import ensure_llama_server

    log = tmp_path_factory.mktemp("tools-hybrid-logs") / "ls.log"
    srv = LlamaServer(ensure_llama_server(), files[0], None, ctx=4096, threads=TEST_THREADS,
                      extra_args=["--jinja", "--verbose"], trace=False, log_path=log).start()
    srv.log = log
    yield srv
    srv.stop()


_tok = tt.token_of


def test_an_xml_call_under_speculation_is_llama_cpps(files, cpp):
    target_path, draft, _ = files
    with Speculator(target_path, draft, n_ctx=2048, n_threads=TEST_THREADS, schedule="off") as sp, \
            Speculator(target_path, None, n_ctx=2048, n_threads=TEST_THREADS) as plain:
        target = sp.target
        assert target.recurrent, "the hybrid target's memory is not recurrent"
        assert "Using specialized template: Qwen3-Coder" in cpp.log.read_text()
        # "required": the grammar starts the call, no bias (the draft's rows would get it too and
        # propose what the target then takes)
        plan, toks = tt.planned(target, "required", [LOG], kw=OFF)
        assert plan.fmt.name == "xml", plan.fmt
        theirs = cpp.complete(toks, N, **_cpp_grammar_fields(plan, target))
        ours = sp.generate(toks, N, grammar=plan.compile(target))
        alone = plain.generate(toks, N, grammar=plan.compile(plain.target))
        assert ours.tokens == theirs["tokens"] == alone.tokens, (ours.text, theirs["content"])
        assert ours.stats.drafted > 0 and ours.stats.accepted < ours.stats.drafted, ours.stats   # drafts were rejected
        text = ReplyText(target.token_to_piece, target.is_eog, plan.special_ids(target))
        text.push(theirs["tokens"])
        cut = len(theirs["tokens"]) == N
        parsed = xml_calls.parse(text.finish(), plan.fmt, plan.names, partial=cut, lstrip=plan.lstrip,
                                 tools=plan.tools)
        assert parsed.calls, theirs["content"]
        for c in parsed.calls:
            if c.complete:
                jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])


def test_the_dspark_class_on_a_hybrid_writes_llama_server_jinjas_call(files, cpp):
    from pyllama_dspark.integrations.dspark import DSpark

    target_path, draft, _ = files
    kw = dict(tools=[LOG], tool_choice="required", max_tokens=N, temperature=0, parallel_tool_calls=False,
              chat_template_kwargs=OFF)
    with DSpark(target_path, draft, n_ctx=2048, n_threads=TEST_THREADS, schedule="off") as ds:
        start, close = _tok(ds._sp.target, "<tool_call>"), _tok(ds._sp.target, "</tool_call>")
        bias = [[start, 30], [close, 8]]
        want = _post(cpp, "/v1/chat/completions", {"messages": USER, **kw, "logit_bias": bias})
        assert want.status_code == 200, want.text
        want = want.json()["choices"][0]
        r = ds.create_chat_completion(USER, logit_bias={t: b for t, b in bias}, **kw)
        got, ds_stats = r["choices"][0], r["timings"]
        ds_stats = {"drafted": ds_stats["draft_n"]}
    assert want["message"].get("tool_calls"), want
    assert (got["finish_reason"], _strip_ids(got["message"])) == (want["finish_reason"], _strip_ids(want["message"]))
    assert ds_stats["drafted"] > 0, ds_stats
    if got["finish_reason"] == "tool_calls":
        jsonschema.validate(json.loads(got["message"]["tool_calls"][0]["function"]["arguments"]), LOG_PARAMS)
