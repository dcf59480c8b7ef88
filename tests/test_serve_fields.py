"""llama-server's request fields and response layouts in ``serve``: grammar / JSON schema,
logit bias, token probabilities, the native ``/completion`` endpoint, ``/tokenize``,
``/detokenize``, ``/apply-template``, ``/props``, ``/slots`` and ``/metrics``.

The references are independent of the code under test: llama-server's documented layouts written
out as JSON schemas and checked with ``jsonschema``, its sources' rules spelled out as expected
values, ``prometheus_client``'s own parser for ``/metrics``, and ``llama_cpp.Llama``'s tokenizer and
chat prompt for the token endpoints.  The first part runs without a model (parsing, layout
builders, metrics); the second against a real server (the default target, no draft) and only
checks what is the server's own doing: layouts, status codes, and that it keeps serving.  Whether
grammars and probabilities are *right* is the engine's test suite's business.
"""

from __future__ import annotations

import json
import math
import random
import sys
import threading
import time
import types
from types import SimpleNamespace

import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pyllama_dspark.decode.cycle import Chunk, Done, Stats
from pyllama_dspark.serve import openai_format as fmt
from pyllama_dspark.serve.metrics import ServerMetrics
from pyllama_dspark.serve.native import final_json, generation_settings, partial_json
from pyllama_dspark.serve.oai_request import (RequestError, check_grammar, grammar_text, parse_request,
                                              resolve_logit_bias, tokenize_mixed)
from pyllama_dspark.serve.routes_misc import detokenize_body, slots_body, tokenize_body
from pyllama_dspark.serve.server import LLAMA_SERVER_SAMPLING, Serving, ServerConfig
from pyllama_dspark.serve.slots import Job
from pyllama_dspark.speculative.logprobs import TokenProb
from serve_helpers import SESSION, ServeProcess, free_port, sse_events

FLOAT_LOWEST = -3.4028234663852886e+38      # std::numeric_limits<float>::lowest(): llama-server's log(0)
NEG_INF = float("-inf")


def chat(**kw):
    return dict({"messages": [{"role": "user", "content": "hi"}]}, **kw)


def cmpl(**kw):
    return dict({"prompt": "hi"}, **kw)


# ---- llama-server's documented layouts, as JSON schemas ---------------------------------------------

def _tok_schema(post: bool) -> dict:
    key = "prob" if post else "logprob"
    val = {"type": "number", "minimum": 0.0, "maximum": 1.0} if post else {"type": "number", "maximum": 0.0}
    return {"type": "object", "additionalProperties": False, "required": ["id", "token", "bytes", key],
            "properties": {"id": {"type": "integer", "minimum": 0}, "token": {"type": "string"},
                           "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}},
                           key: val}}


def probs_schema(post: bool = False) -> dict:
    """README "completion_probabilities": per token {id, logprob, token, bytes, top_logprobs: [...]}
    (post_sampling_probs: prob / top_probs)."""
    entry = _tok_schema(post)
    tops = "top_probs" if post else "top_logprobs"
    entry["required"] = entry["required"] + [tops]
    entry["properties"] = dict(entry["properties"], **{tops: {"type": "array", "items": _tok_schema(post)}})
    return {"type": "array", "items": entry}


NATIVE_FINAL_KEYS = ["index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted", "tokens_evaluated",
                     "generation_settings", "prompt", "has_new_line", "truncated", "stop_type", "stopping_word",
                     "tokens_cached", "timings"]
NATIVE_FINAL = {
    "type": "object", "required": NATIVE_FINAL_KEYS, "additionalProperties": False,
    "properties": {
        "index": {"const": 0}, "content": {"type": "string"},
        "tokens": {"type": "array", "items": {"type": "integer"}}, "id_slot": {"type": "integer"},
        "stop": {"const": True}, "model": {"type": "string"},
        "tokens_predicted": {"type": "integer", "minimum": 0}, "tokens_evaluated": {"type": "integer", "minimum": 1},
        "generation_settings": {"type": "object", "required": ["n_predict", "temperature", "seed", "stop", "n_probs"]},
        "prompt": {"type": "string"}, "has_new_line": {"type": "boolean"}, "truncated": {"type": "boolean"},
        "stop_type": {"enum": ["eos", "word", "limit"]}, "stopping_word": {"type": "string"},
        "tokens_cached": {"type": "integer", "minimum": 0},
        "timings": {"type": "object", "required": ["cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_ms"]},
        "completion_probabilities": probs_schema(),
    },
}
NATIVE_PARTIAL = {
    "type": "object", "additionalProperties": False,
    "required": ["index", "content", "tokens", "stop", "id_slot", "tokens_predicted", "tokens_evaluated"],
    "properties": {"index": {"const": 0}, "content": {"type": "string"},
                   "tokens": {"type": "array", "items": {"type": "integer"}},
                   "stop": {"const": False}, "id_slot": {"type": "integer"},
                   "tokens_predicted": {"type": "integer", "minimum": 1}, "tokens_evaluated": {"type": "integer"},
                   "completion_probabilities": probs_schema()},
}
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"],
         "properties": {"prompt_tokens_details": {"type": "object", "required": ["cached_tokens"],
                                                  "properties": {"cached_tokens": {"type": "integer", "minimum": 0}}}}}


# ---- parsing: grammar / schema precedence ----------------------------------------------------------

S1 = {"type": "string"}
S2 = {"type": "integer"}
G = 'root ::= "a"'


@pytest.mark.parametrize("kind,body,grammar,schema", [
    ("chat", chat(grammar=G), G, None),
    ("chat", chat(json_schema=S1), None, S1),
    ("chat", chat(json_schema={}), None, {"type": "object"}),                  # empty = any object
    ("chat", chat(response_format={"type": "json_object"}), None, {"type": "object"}),
    ("chat", chat(response_format={"type": "json_object", "schema": S1}), None, S1),
    ("chat", chat(response_format={"type": "json_object"}, json_schema=S2), None, S2),  # no rf schema: json_schema stays
    ("chat", chat(response_format={"type": "json_object", "schema": S1}, json_schema=S2), None, S1),
    ("chat", chat(response_format={"type": "json_schema", "json_schema": {"schema": S1}}), None, S1),
    ("chat", chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), None, {"type": "object"}),
    ("chat", chat(response_format={"type": "json_schema", "json_schema": {"schema": S1}}, grammar=G), G, S1),
    ("chat", chat(response_format={"type": "text"}), None, None),
    ("chat", chat(response_format={}), None, None),
    ("completion", cmpl(json_schema=S1), None, S1),
    ("completion", cmpl(json_schema=S1, grammar=G), G, None),                 # /completion: grammar wins
    ("native", cmpl(json_schema=S1, grammar=G), G, None),
    ("native", cmpl(response_format={"type": "json_object"}), None, None),   # read on chat only
    ("completion", cmpl(response_format={"type": "xml"}), None, None),
    ("native", cmpl(grammar=""), None, None),
])
def test_constraint_precedence_is_llama_servers(kind, body, grammar, schema):
    r = parse_request(body, kind)
    assert (r.grammar, r.json_schema) == (grammar, schema)


@pytest.fixture
def fake_grammar(monkeypatch):
    """A stand-in pyllama_dspark.llama.grammar: the parsing side is tested without the engine's."""
    mod = types.ModuleType("pyllama_dspark.llama.grammar")

    class GrammarError(ValueError):
        pass

    compiled = []

    class Grammar:
        @staticmethod
        def compile(gbnf, target):
            if "(" in gbnf:
                raise GrammarError("parse: error parsing grammar: expecting ')' at (")
            g = SimpleNamespace(gbnf=gbnf, closed=False)
            g.close = lambda: setattr(g, "closed", True)
            compiled.append(g)
            return g

    def schema_to_gbnf(schema):
        if schema.get("type") == "bogus":
            raise GrammarError("Unrecognized schema: bogus")
        return "SCHEMA " + json.dumps(schema, sort_keys=True)

    mod.GrammarError, mod.Grammar, mod.schema_to_gbnf, mod.JSON_OBJECT_GBNF = GrammarError, Grammar, schema_to_gbnf, "OBJ"
    monkeypatch.setitem(sys.modules, "pyllama_dspark.llama.grammar", mod)
    import pyllama_dspark.llama as llama_pkg
    monkeypatch.setattr(llama_pkg, "grammar", mod, raising=False)
    return compiled


def test_grammar_text_and_check(fake_grammar):
    r = parse_request(chat(response_format={"type": "json_schema", "json_schema": {"schema": S1}}, grammar=G), "chat")
    assert grammar_text(r) == "SCHEMA " + json.dumps(S1, sort_keys=True)     # the schema wins on chat
    assert grammar_text(parse_request(chat(response_format={"type": "json_object"}), "chat")) == "OBJ"
    assert grammar_text(parse_request(cmpl(grammar=G, json_schema=S1), "native")) == G
    assert grammar_text(parse_request(cmpl(), "native")) is None
    with pytest.raises(RequestError) as e:
        grammar_text(parse_request(cmpl(json_schema={"type": "bogus"}), "native"))
    assert e.value.code == 400 and "Unrecognized schema" in e.value.message and e.value.param == "json_schema"
    check_grammar(G, target=None)
    assert fake_grammar[-1].closed                                           # checked, then freed
    with pytest.raises(RequestError) as e:
        check_grammar("root ::= (", target=None)
    assert e.value.code == 400 and "expecting ')'" in e.value.message


# ---- parsing: probabilities, logit bias, the rest ---------------------------------------------------

def test_probability_fields():
    n = lambda body, kind: parse_request(body, kind).n_probs   # noqa: E731
    assert n(chat(logprobs=True), "chat") == 20                             # llama-server's default top_logprobs
    assert n(chat(logprobs=True, top_logprobs=3), "chat") == 3
    assert n(chat(logprobs=True, top_logprobs=0), "chat") == 0
    assert n(chat(logprobs=True, top_logprobs=2, n_probs=9), "chat") == 2    # n_probs is overwritten
    assert n(chat(logprobs=False), "chat") == 0 and n(chat(n_probs=4), "chat") == 4
    assert n(cmpl(logprobs=5), "completion") == 5 and n(cmpl(logprobs=5, n_probs=2), "completion") == 2
    assert n(cmpl(logprobs=True), "completion") == 1                        # nlohmann reads true as 1
    assert n(cmpl(n_probs=-3), "native") == 0 and n(cmpl(n_probs=7.0), "native") == 7
    assert parse_request(cmpl(n_probs=2, post_sampling_probs=True), "native").post_sampling_probs
    assert not parse_request(cmpl(), "native").post_sampling_probs


def test_logit_bias_forms_resolve_like_llama_server():
    vocab = {"hi": [5, 6], "x": [9]}
    tok = lambda text: vocab.get(text, [])   # noqa: E731
    r = parse_request(cmpl(logit_bias={"12": -1.5, "hi": 2, "-3": 1, "99999": 1, " 7": False}), "native")
    assert resolve_logit_bias(r.logit_bias, tok, 100) == {12: -1.5, 5: 2.0, 6: 2.0, 7: NEG_INF}
    r = parse_request(cmpl(logit_bias=[[12, -1.5], ["hi", False], [500, 3], [12, 0.5], ["x", 1]]), "native")
    assert resolve_logit_bias(r.logit_bias, tok, 100) == {12: -1.0, 5: NEG_INF, 6: NEG_INF, 9: 1.0}
    r = parse_request(chat(logit_bias={"9": -100}), "chat")                  # the OpenAI form, on chat too
    assert resolve_logit_bias(r.logit_bias, tok, 100) == {9: -100.0}
    assert resolve_logit_bias(parse_request(cmpl(logit_bias={}), "native").logit_bias, tok, 100) is None
    assert resolve_logit_bias(parse_request(cmpl(logit_bias=[[1000, 1]]), "native").logit_bias, tok, 100) is None


def test_other_native_fields_and_mixed_prompts():
    r = parse_request(cmpl(cache_prompt=False, return_tokens=True, id_slot=1, repeat_last_n=32, n_predict=5,
                           max_tokens=9), "native")
    assert (r.cache_prompt, r.return_tokens, r.id_slot, r.max_tokens) == (False, True, 1, 5)
    assert r.sampling == {"penalty_last_n": 32}
    assert parse_request(cmpl(), "native").cache_prompt                    # llama-server's default
    assert parse_request({"prompt": ["a", 5, "b"]}, "native").prompt == ["a", 5, "b"]
    with pytest.raises(RequestError):                                   # OpenAI's prompt: text or ids
        parse_request({"prompt": ["a", 5]}, "completion")
    fake = lambda text, add: ([1000] if add else []) + [ord(c) for c in text]   # noqa: E731
    assert tokenize_mixed(["a", 5, "b"], fake, True) == [1000, 97, 5, 98]   # BOS only before a leading text
    assert tokenize_mixed([5, "a"], fake, True) == [5, 97]
    assert tokenize_mixed("ab", fake, False) == [97, 98]


@pytest.mark.parametrize("kind,body,param", [
    ("chat", chat(grammar=5), "grammar"),
    ("native", cmpl(grammar=["a"]), "grammar"),
    ("native", cmpl(json_schema="object"), "json_schema"),
    ("chat", chat(json_schema=[1]), "json_schema"),
    ("chat", chat(json_schema=S1, grammar=G), "grammar"),                   # "Cannot use both json_schema and grammar"
    ("chat", chat(response_format="json"), "response_format"),
    ("chat", chat(response_format={"type": 3}), "response_format"),
    ("chat", chat(response_format={"type": "xml"}), "response_format"),
    ("chat", chat(response_format={"type": "json_object", "schema": 5}), "response_format.schema"),
    ("chat", chat(response_format={"type": "json_schema", "json_schema": "x"}), "response_format.json_schema"),
    ("chat", chat(response_format={"type": "json_schema", "json_schema": {"schema": [1]}}),
     "response_format.json_schema.schema"),
    ("chat", chat(logprobs="yes"), "logprobs"),
    ("chat", chat(logprobs=1), "logprobs"),
    ("chat", chat(top_logprobs=3), "top_logprobs"),
    ("chat", chat(logprobs=False, top_logprobs=3), "top_logprobs"),
    ("chat", chat(logprobs=True, top_logprobs="3"), "top_logprobs"),
    ("chat", chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
    ("completion", cmpl(logprobs="yes"), "logprobs"),
    ("completion", cmpl(logprobs=1.5), "logprobs"),
    ("native", cmpl(n_probs="5"), "n_probs"),
    ("native", cmpl(post_sampling_probs=1), "post_sampling_probs"),
    ("native", cmpl(cache_prompt="no"), "cache_prompt"),
    ("native", cmpl(return_tokens=1), "return_tokens"),
    ("native", cmpl(id_slot="0"), "id_slot"),
    ("native", cmpl(repeat_last_n=-1), "repeat_last_n"),
    ("native", cmpl(n_predict=-2), "n_predict"),
    ("completion", cmpl(echo=True), "echo"),
    ("completion", cmpl(best_of=2), "best_of"),
    ("native", cmpl(logit_bias=5), "logit_bias"),
    ("native", cmpl(logit_bias="x"), "logit_bias"),
    ("native", cmpl(logit_bias={"5": "a"}), "logit_bias"),
    ("native", cmpl(logit_bias={"5": True}), "logit_bias"),
    ("native", cmpl(logit_bias={"5": None}), "logit_bias"),
    ("native", cmpl(logit_bias={"5": float("nan")}), "logit_bias"),
    ("native", cmpl(logit_bias={"5": float("inf")}), "logit_bias"),
    ("native", cmpl(logit_bias=[[5]]), "logit_bias"),
    ("native", cmpl(logit_bias=[5, 1]), "logit_bias"),
    ("native", cmpl(logit_bias=[[5.5, 1]]), "logit_bias"),
    ("native", cmpl(logit_bias=[[None, 1]]), "logit_bias"),
    ("native", cmpl(logit_bias=[[5, "x"]]), "logit_bias"),
    ("native", {"prompt": [1, None]}, "prompt"),
])
def test_bad_fields_are_400(kind, body, param):
    with pytest.raises(RequestError) as e:
        parse_request(body, kind)
    assert e.value.code == 400 and e.value.param == param and e.value.type == "invalid_request_error"


def test_no_body_makes_the_parser_fail_with_anything_but_a_request_error():
    """Random values in every field this issue added: a RequestError (400) or a request, never another
    exception (an HTTP 500)."""
    fields = ["grammar", "json_schema", "response_format", "logprobs", "top_logprobs", "n_probs",
              "post_sampling_probs", "logit_bias", "cache_prompt", "n_predict", "max_tokens", "id_slot",
              "return_tokens", "stop", "temperature", "repeat_last_n", "prompt", "messages", "echo"]
    values = [None, True, False, 0, -1, 7, 2.5, float("nan"), float("-inf"), "", "x", "12", [], [1], [[1, 2]],
              [["a", False]], [[1, 2, 3]], {}, {"type": "json_object"}, {"1": 2}, {"a": [1]}, [None],
              {"type": "json_schema", "json_schema": 5}, {"type": "json_schema", "json_schema": {"schema": 5}},
              {"schema": []}, {"type": None}, [{"role": "user", "content": "x"}], ["a", 1]]
    rng = random.Random(1)
    vocab = lambda text: [len(text) % 7]   # noqa: E731
    n_ok = 0
    for _ in range(4000):
        kind = rng.choice(["chat", "completion", "native"])
        body = chat() if kind == "chat" else cmpl()
        for _ in range(rng.randint(1, 4)):
            body[rng.choice(fields)] = rng.choice(values)
        try:
            r = parse_request(json.loads(json.dumps(body)), kind)
        except RequestError as e:
            assert e.code == 400 and isinstance(e.message, str), body
            continue
        n_ok += 1
        resolve_logit_bias(r.logit_bias, vocab, 10)
    assert n_ok > 100


# ---- response layouts --------------------------------------------------------------------------------

PIECES = {5: b"ab", 7: "\u00e9".encode()[:1], 9: "\u20ac".encode(), 3: "\U0001F600".encode()[:3], 11: b" x"}


def test_probs_json_is_llama_servers_layout():
    probs = [TokenProb(5, 0.5, [(5, 0.5), (7, 0.25)]), TokenProb(9, 0.0, [(3, 1.0)])]
    out = fmt.probs_json(probs, PIECES.__getitem__, False)
    jsonschema.validate(out, probs_schema(False))
    json.dumps(out, allow_nan=False)                                     # valid JSON: no inf / nan
    assert out[0]["logprob"] == pytest.approx(math.log(0.5)) and out[0]["top_logprobs"][1]["logprob"] == \
        pytest.approx(math.log(0.25))
    assert out[1]["logprob"] == FLOAT_LOWEST                              # log(0): the float lowest
    # the text is cut before a multi-byte character cut off at its end (validate_utf8); bytes stay raw
    assert out[0]["top_logprobs"][1]["token"] == "" and out[0]["top_logprobs"][1]["bytes"] == [0xC3]
    assert out[1]["token"] == "\u20ac" and out[1]["bytes"] == [0xE2, 0x82, 0xAC]
    assert out[1]["top_logprobs"][0]["token"] == "" and out[1]["top_logprobs"][0]["bytes"] == [0xF0, 0x9F, 0x98]
    post = fmt.probs_json(probs, PIECES.__getitem__, True)
    jsonschema.validate(post, probs_schema(True))
    assert post[0]["prob"] == 0.5 and post[0]["top_probs"][1]["prob"] == 0.25 and "logprob" not in post[0]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(post, probs_schema(False))                   # the schema can tell them apart


class _FakeTarget:
    n_vocab = 100
    n_decodes = 0
    n_batch = 4

    def detokenize(self, toks, special=False):
        return b"".join(b"<%d>" % t for t in toks)

    def tokenize(self, text, add_special=True, parse_special=True):
        return [ord(c) % 100 for c in (text if isinstance(text, str) else text.decode())]

    def token_to_piece(self, t, special=False):
        return PIECES.get(t, b"<%d>" % t)


def _serving(n_ctx=64):
    pool = SimpleNamespace(front=SimpleNamespace(target=_FakeTarget(), draft=None), n_ctx=n_ctx, n_slots=1, n_busy=0)
    return Serving(pool, ServerConfig(model_id="m", sampling_defaults=dict(LLAMA_SERVER_SAMPLING)))


def _done(finish="stop", stop_word=None, text="a\nb", n_prompt=4, tokens=(5, 9, 11), probs=None):
    st = Stats(n_prompt=n_prompt, n_cached=1, n_generated=len(tokens), ms_prefill=2.0, ms_total=10.0)
    return Done(list(tokens), text, finish, st, stop_word, probs)


def _job(n_probs=0, bias=None, grammar=None, stop=()):
    j = Job([1, 2, 3, 4], 8, lambda ev: None, stop=stop, n_probs=n_probs, logit_bias=bias, grammar=grammar)
    j.slot = 0
    return j


def test_native_final_and_partial_layouts():
    srv = _serving()
    req = parse_request(cmpl(n_predict=8), "native")
    out = final_json(srv, req, _job(), _done(), "m")
    jsonschema.validate(out, NATIVE_FINAL)
    assert list(out) == NATIVE_FINAL_KEYS                                # llama-server's keys, in its order
    assert (out["stop_type"], out["stopping_word"], out["has_new_line"], out["tokens"]) == ("eos", "", True, [])
    assert (out["tokens_predicted"], out["tokens_evaluated"], out["tokens_cached"]) == (3, 4, 4 + 3 - 1)
    assert out["prompt"] == "<1><2><3><4>" and out["content"] == "a\nb" and out["timings"]["cache_n"] == 1
    req = parse_request(cmpl(return_tokens=True, stop=["zz"]), "native")
    out = final_json(srv, req, _job(stop=["zz"]), _done(stop_word="zz", text="ab"), "m")
    assert (out["stop_type"], out["stopping_word"], out["tokens"], out["has_new_line"]) == ("word", "zz", [5, 9, 11],
                                                                                             False)
    assert out["generation_settings"]["stop"] == ["zz"]
    out = final_json(srv, req, _job(), _done(finish="length", n_prompt=60), "m")
    assert out["stop_type"] == "limit" and out["truncated"]              # 60 + 3 + 1 >= n_ctx 64
    assert not final_json(srv, req, _job(), _done(finish="length"), "m")["truncated"]
    # streaming: the last event carries no text, tokens or probabilities (the chunks had them)
    req = parse_request(cmpl(stream=True, return_tokens=True, n_probs=2), "native")
    probs = [TokenProb(t, 0.5, [(t, 0.5)]) for t in (5, 9, 11)]
    out = final_json(srv, req, _job(n_probs=2), _done(probs=probs), "m")
    jsonschema.validate(out, NATIVE_FINAL)
    assert (out["content"], out["tokens"]) == ("", []) and "completion_probabilities" not in out
    part = partial_json(srv, req, _job(n_probs=2), Chunk([5, 9], "x", probs[:2]), 2)
    jsonschema.validate(part, NATIVE_PARTIAL)
    assert part["tokens"] == [5, 9] and [p["id"] for p in part["completion_probabilities"]] == [5, 9]


def test_native_probabilities_drop_the_stop_word_tokens():
    """llama-server's send_final_response: after a stop word, as many probabilities as the stop word
    has tokens are dropped (non-streaming)."""
    srv = _serving()
    probs = [TokenProb(t, 0.25, [(t, 0.25)]) for t in (5, 9, 11, 7)]
    req = parse_request(cmpl(n_probs=1, stop=["qq"]), "native")
    out = final_json(srv, req, _job(n_probs=1), _done(stop_word="qq", tokens=(5, 9, 11, 7), probs=probs), "m")
    jsonschema.validate(out, NATIVE_FINAL)
    assert [p["id"] for p in out["completion_probabilities"]] == [5, 9]  # "qq" is 2 tokens of the fake vocabulary
    out = final_json(srv, req, _job(n_probs=1), _done(tokens=(5, 9, 11, 7), probs=probs), "m")
    assert [p["id"] for p in out["completion_probabilities"]] == [5, 9, 11, 7]
    assert "completion_probabilities" not in final_json(srv, req, _job(), _done(probs=probs[:3]), "m")


def test_generation_settings_are_valid_json():
    g = generation_settings(dict(LLAMA_SERVER_SAMPLING), n_predict=5, logit_bias={5: NEG_INF, 6: 1.5}, grammar=G,
                            n_probs=3)
    json.dumps(g, allow_nan=False)
    assert g["logit_bias"] == [{"bias": None, "token": 5}, {"bias": 1.5, "token": 6}]   # -inf is null, as llama-server
    assert g["seed"] == 0xFFFFFFFF and g["n_predict"] == g["max_tokens"] == 5 and g["grammar"] == G
    short = generation_settings(dict(LLAMA_SERVER_SAMPLING), only_metrics=True)
    assert not {"stop", "logit_bias", "grammar"} & set(short) and short["n_predict"] == -1


# ---- metrics -------------------------------------------------------------------------------------------

LLAMA_COUNTERS = ["llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total", "llamacpp:prompt_seconds_total",
                  "llamacpp:tokens_predicted_total", "llamacpp:tokens_predicted_seconds_total",
                  "llamacpp:n_decode_total", "llamacpp:spec_decode_num_draft_tokens_total",
                  "llamacpp:spec_decode_num_accepted_tokens_total", "llamacpp:spec_decode_num_drafts_total",
                  "llamacpp:dspark_verify_rows_total", "llamacpp:dspark_cycles_drafted_total"]
LLAMA_GAUGES = ["llamacpp:prompt_tokens_seconds", "llamacpp:predicted_tokens_seconds", "llamacpp:requests_processing",
                "llamacpp:requests_deferred", "llamacpp:n_busy_slots_per_decode", "llamacpp:n_tokens_max"]


def parse_metrics(text: str) -> dict:
    """{sample name (+ labels): value} through prometheus_client's own parser, after checking that
    every HELP / TYPE line names its samples exactly."""
    types_ = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types_[name] = kind
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("" if not s.labels else json.dumps(s.labels, sort_keys=True))
            out[key] = s.value
            assert s.name in types_, f"{s.name}: no '# TYPE {s.name}' line"
            out["type:" + s.name] = types_[s.name]
    return out


def test_metrics_text_has_llama_server_names_and_counts():
    tgt = SimpleNamespace(n_decodes=10, n_batch=4)
    pool = SimpleNamespace(front=SimpleNamespace(target=tgt), n_busy=1, n_queued=2)
    m = ServerMetrics(pool)
    st = Stats(n_prompt=10, n_cached=3, n_generated=5, ms_prefill=70.0, ms_total=400.0)
    st.record(4, 2)
    st.record(0, 0)
    st.record(3, 3)
    m.observe(st)
    tgt.n_decodes += 2 + 3                            # 7 prompt tokens in batches of 4, then 3 cycles
    got = parse_metrics(m.render().decode())
    for name in LLAMA_COUNTERS:
        assert got["type:" + name] == "counter", name
    for name in LLAMA_GAUGES:
        assert got["type:" + name] == "gauge", name
    expect = {"prompt_tokens_total": 7, "prompt_tokens_cached_total": 3, "prompt_seconds_total": 0.07,
              "tokens_predicted_total": 5, "tokens_predicted_seconds_total": 0.4, "n_decode_total": 5,
              "spec_decode_num_draft_tokens_total": 7, "spec_decode_num_accepted_tokens_total": 5,
              "spec_decode_num_drafts_total": 2, "dspark_verify_rows_total": 5 + 1 + 4,
              "dspark_cycles_drafted_total": 2, "n_tokens_max": 15, "requests_processing": 1, "requests_deferred": 2,
              "prompt_tokens_seconds": 7 / 0.07, "predicted_tokens_seconds": 4 / 0.4, "n_busy_slots_per_decode": 1.0}
    for k, v in expect.items():
        assert got["llamacpp:" + k] == pytest.approx(v), k
    per_pos = {k: v for k, v in got.items() if k.startswith("llamacpp:spec_decode_num_accepted_tokens_per_pos_total{")}
    assert per_pos == {'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{"position": "%d"}' % i: v
                       for i, v in enumerate([2, 2, 1, 0])}
    # the throughput gauges cover the time since the previous scrape; the counters go on
    again = parse_metrics(m.render().decode())
    assert again["llamacpp:prompt_tokens_seconds"] == 0 and again["llamacpp:predicted_tokens_seconds"] == 0
    assert again["llamacpp:prompt_tokens_total"] == 7


# ---- the small endpoints' bodies -----------------------------------------------------------------------

def test_tokenize_and_detokenize_bodies():
    t = _FakeTarget()
    assert tokenize_body({"content": "ab"}, t) == {"tokens": [97, 98]}
    assert tokenize_body({}, t) == {"tokens": []}
    assert tokenize_body({"content": [5, "a"], "with_pieces": True}, t) == {
        "tokens": [{"id": 5, "piece": "ab"}, {"id": 97, "piece": "<97>"}]}
    assert tokenize_body({"content": [7], "with_pieces": True}, t) == {"tokens": [{"id": 7, "piece": [0xC3]}]}
    assert detokenize_body({"tokens": [1, 2]}, t) == {"content": "<1><2>"} and detokenize_body({}, t) == {"content": ""}
    for body in ([], {"content": 5}, {"content": [1.5]}, {"content": [-1]}, {"content": [100]},
                 {"content": "a", "add_special": "x"}, {"content": "a", "with_pieces": 1}):
        with pytest.raises(RequestError):
            tokenize_body(body, t)
    for body in ("x", {"tokens": "x"}, {"tokens": [1, 100]}, {"tokens": [True]}, {"tokens": [-1]}):
        with pytest.raises(RequestError):
            detokenize_body(body, t)


def test_slots_body():
    pool = SimpleNamespace(slots_info=lambda: [{"id": 0, "n_ctx": 8, "is_processing": True}])
    assert slots_body(pool) == [{"id": 0, "n_ctx": 8, "is_processing": True}]
    pool = SimpleNamespace(n_slots=2, n_ctx=8, n_busy=1, busy=[False, True], front=SimpleNamespace(draft=None))
    assert [s["is_processing"] for s in slots_body(pool)] == [False, True]


# ==== end to end: a real server (default target, no draft) ===============================================

@pytest.fixture(scope="module")
def srv(target_path, tmp_path_factory):
    s = ServeProcess(target_path, None, tmp_path_factory.mktemp("serve-fields") / "serve.log", n_slots=1, n_ctx=512)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def vocab(target_path):
    from llama_cpp import Llama

    llm = Llama(model_path=target_path, vocab_only=True, verbose=False)
    yield llm
    llm.close()


TEXTS = ["Hello world", "  two  spaces\nand a line", "h\u00e9llo \u4e16\u754c \U0001F600",
         "<|im_start|>user\nhi<|im_end|>", ""]


def test_tokenize_matches_llama(srv, vocab):
    for text in TEXTS:
        for add_special, parse_special in ((False, True), (True, True), (False, False), (True, False)):
            r = srv.post("/tokenize", {"content": text, "add_special": add_special, "parse_special": parse_special})
            assert r.status_code == 200, r.text
            assert r.json()["tokens"] == vocab.tokenize(text.encode(), add_bos=add_special, special=parse_special), \
                (text, add_special, parse_special)
        ref = vocab.tokenize(text.encode(), add_bos=False, special=True)
        got = srv.post("/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
        assert [g["id"] for g in got] == ref
        for g in got:
            piece = vocab.detokenize([g["id"]], special=True)
            try:
                assert g["piece"] == piece.decode("utf-8")
            except UnicodeDecodeError:
                assert g["piece"] == list(piece)
    # llama-server's mixed content: text and ids in order, BOS only before a leading text
    got = srv.post("/tokenize", {"content": ["Hello", 42, " world"]}).json()["tokens"]
    out = srv.post("/completion", {"prompt": ["Hello", 42, " world"], "n_predict": 1}).json()
    assert out["tokens_evaluated"] == len(got)
    assert got == vocab.tokenize(b"Hello", add_bos=False, special=True) + [42] + \
        vocab.tokenize(b" world", add_bos=False, special=True)


def test_detokenize_round_trips(srv, vocab):
    for text in TEXTS:
        ids = vocab.tokenize(text.encode(), add_bos=False, special=True)
        r = srv.post("/detokenize", {"tokens": ids})
        assert r.status_code == 200 and r.json()["content"] == text
        assert r.json()["content"] == vocab.detokenize(ids, special=True).decode()


def test_apply_template_is_the_chat_prompt(srv, llama_refs):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}]
    r = srv.post("/apply-template", {"messages": msgs})
    assert r.status_code == 200 and set(r.json()) == {"prompt"}
    prompt = r.json()["prompt"]
    # the text, tokenized as llama-cpp-python tokenizes a chat prompt, is Llama's own chat prompt
    assert llama_refs.llm.tokenize(prompt.encode(), add_bos=False, special=True) == llama_refs.chat_tokens(msgs)
    # and a chat request decodes exactly that prompt
    out = srv.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 1}).json()
    assert out["usage"]["prompt_tokens"] == len(llama_refs.chat_tokens(msgs))


def test_native_completion_layout(srv, vocab):
    body = {"prompt": "The capital of France is", "n_predict": 6, "return_tokens": True, "n_probs": 2}
    for path in ("/completion", "/completions"):
        r = srv.post(path, body)
        assert r.status_code == 200, r.text
        out = r.json()
        jsonschema.validate(out, NATIVE_FINAL)
        assert "completion_probabilities" in out and len(out["completion_probabilities"]) == len(out["tokens"])
        assert out["prompt"] == body["prompt"] and out["tokens_predicted"] == len(out["tokens"])
        toks = srv.post("/tokenize", {"content": body["prompt"], "add_special": True}).json()["tokens"]
        assert out["tokens_evaluated"] == len(toks)
    out = srv.post("/completion", {"prompt": "Count: 1, 2, 3,", "n_predict": 32, "stop": [","]}).json()
    jsonschema.validate(out, NATIVE_FINAL)
    assert (out["stop_type"], out["stopping_word"], out["tokens"]) == ("word", ",", [])
    # streaming: data events (no [DONE]), each chunk's ids, then the final object
    r = srv.post("/completion", {"prompt": "Once upon a time", "n_predict": 8, "stream": True}, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(d) for d in sse_events(r)]
    *parts, last = events
    for p in parts:
        jsonschema.validate(p, NATIVE_PARTIAL)
    jsonschema.validate(last, NATIVE_FINAL)
    ids = [t for p in parts for t in p["tokens"]]
    assert len(ids) == last["tokens_predicted"] and last["stop_type"] in ("limit", "eos")
    assert last["stop_type"] == "eos" or len(ids) == 8
    assert "".join(p["content"] for p in parts) == vocab.detokenize(ids).decode()   # special tokens not rendered


def test_oai_logprobs_layout_and_cached_tokens(srv):
    body = chat(messages=[{"role": "user", "content": "Say hello."}], max_tokens=5, logprobs=True, top_logprobs=3)
    out = srv.post("/v1/chat/completions", body).json()
    content = out["choices"][0]["logprobs"]["content"]
    jsonschema.validate(content, probs_schema())
    jsonschema.validate(out["usage"], USAGE)
    assert len(content) == out["usage"]["completion_tokens"] and all(len(c["top_logprobs"]) == 3 for c in content)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == out["timings"]["cache_n"]
    r = srv.post("/v1/chat/completions", dict(body, stream=True), stream=True)
    chunks = [json.loads(d) for d in sse_events(r) if d != "[DONE]"]
    streamed = [e for c in chunks for e in ((c["choices"][0].get("logprobs") or {}).get("content") or [])]
    jsonschema.validate(streamed, probs_schema())
    assert len(streamed) >= 1
    out = srv.post("/v1/completions", cmpl(prompt="Once upon", max_tokens=4, logprobs=2, post_sampling_probs=True)).json()
    jsonschema.validate(out["choices"][0]["logprobs"]["content"], probs_schema(post=True))
    jsonschema.validate(out["usage"], USAGE)
    assert srv.post("/v1/completions", cmpl(max_tokens=2)).json()["choices"][0]["logprobs"] is None


BAD = [
    ("/v1/chat/completions", chat(grammar=5)),
    ("/v1/chat/completions", chat(logprobs="yes")),
    ("/v1/chat/completions", chat(top_logprobs=2)),
    ("/v1/chat/completions", chat(response_format={"type": "xml"})),
    ("/v1/chat/completions", chat(json_schema={"type": "string"}, grammar=G)),
    ("/v1/chat/completions", chat(logit_bias={"5": "a lot"})),
    ("/v1/completions", cmpl(logprobs="yes")),
    ("/v1/completions", cmpl(logit_bias=[[1]])),
    ("/completion", cmpl(json_schema="object")),
    ("/completion", cmpl(cache_prompt="yes")),
    ("/completion", cmpl(n_probs="2")),
    ("/completion", {"prompt": [1, 10 ** 9]}),
    ("/completions", cmpl(post_sampling_probs="no")),
    ("/tokenize", {"content": 5}),
    ("/tokenize", {"content": [10 ** 9], "with_pieces": True}),
    ("/detokenize", {"tokens": [10 ** 9]}),
    ("/detokenize", {"tokens": "abc"}),
    ("/apply-template", {"messages": "hi"}),
    ("/apply-template", {}),
]


def test_bad_fields_are_400_and_the_server_keeps_serving(srv):
    for path, body in BAD:
        r = srv.post(path, body)
        assert r.status_code == 400, (path, body, r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] == 400 and err["type"] == "invalid_request_error" and err["message"], (path, body)
    assert srv.post("/completion", cmpl(n_predict=2)).status_code == 200


def test_bad_grammar_and_schema_are_400_and_the_server_keeps_serving(srv):
    """The GBNF is compiled against the target's vocabulary before the request is queued: llama.cpp's
    parser message comes back as a 400."""
    for path, body in [("/completion", cmpl(grammar="root ::= (")), ("/v1/chat/completions", chat(grammar="root ::= x")),
                       ("/v1/completions", cmpl(json_schema={"type": "no-such-type"}))]:
        r = srv.post(path, body)
        assert r.status_code == 400, (path, body, r.status_code, r.text)
        assert r.json()["error"]["message"]
    r = srv.post("/completion", cmpl(grammar='root ::= "yes" | "no"', n_predict=4))
    assert r.status_code == 200, r.text


def test_props_and_slots(srv, vocab):
    p = srv.get("/props").json()
    for k in ("default_generation_settings", "total_slots", "model_alias", "model_path", "chat_template",
              "bos_token", "eos_token", "build_info", "endpoint_metrics", "modalities"):
        assert k in p, k
    assert p["total_slots"] == 1 and p["endpoint_metrics"] is False
    assert p["default_generation_settings"]["n_ctx"] == 512
    assert p["default_generation_settings"]["params"]["temperature"] == 0.0      # serve --temp 0
    assert p["chat_template"] == vocab.metadata.get("tokenizer.chat_template", "")
    assert p["eos_token"] == vocab.detokenize([vocab.token_eos()], special=True).decode()
    slots = srv.get("/slots").json()
    assert [s["id"] for s in slots] == [0] and slots[0]["is_processing"] is False and slots[0]["n_ctx"] > 0
    assert srv.get("/slots?fail_on_no_slot=1").status_code == 200


def test_metrics_off_is_llama_servers_501(srv):
    r = srv.get("/metrics")
    assert r.status_code == 501
    assert r.json()["error"] == {"code": 501, "type": "not_supported_error",
                                 "message": "This server does not support metrics endpoint. Start it with `--metrics`"}


@pytest.fixture(scope="module")
def metrics_server(target_path):
    """The app with ``ServerConfig(metrics=True)`` (what ``serve --metrics`` builds) in this process."""
    import uvicorn

    from pyllama_dspark.cli.serve import build_pool
    from pyllama_dspark.serve.server import create_app

    pool = build_pool(target_path, None, n_slots=1, n_ctx=512, n_batch=512, n_ubatch=512, threads=1,
                      flash_attn="auto", n_gpu_layers=0, n_max=7)
    app = create_app(pool, ServerConfig(model_id="m", metrics=True,
                                        sampling_defaults=dict(LLAMA_SERVER_SAMPLING, temperature=0.0)))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while not server.started:
        assert th.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield url
    server.should_exit = True
    th.join(timeout=60)
    pool.close()


def test_metrics_parse_and_count_requests(metrics_server):
    url = metrics_server
    before = SESSION.get(url + "/metrics", timeout=30)
    assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain")
    assert "Process-Start-Time-Unix" in before.headers
    m0 = parse_metrics(before.text)
    for name in LLAMA_COUNTERS:
        assert m0["type:" + name] == "counter"
    for name in LLAMA_GAUGES:
        assert m0["type:" + name] == "gauge"
    outs = [SESSION.post(url + "/completion", json={"prompt": "I believe the meaning of life is", "n_predict": n},
                         timeout=120).json() for n in (3, 5)]
    m1 = parse_metrics(SESSION.get(url + "/metrics", timeout=30).text)
    delta = lambda k: m1["llamacpp:" + k] - m0["llamacpp:" + k]   # noqa: E731
    assert delta("tokens_predicted_total") == sum(o["timings"]["predicted_n"] for o in outs) == 8
    assert delta("prompt_tokens_total") == sum(o["timings"]["prompt_n"] for o in outs)
    assert delta("prompt_tokens_cached_total") == sum(o["timings"]["cache_n"] for o in outs)
    assert delta("n_decode_total") >= 1 + 2 and m1["llamacpp:requests_processing"] == 0
    assert m1["llamacpp:n_tokens_max"] == max(o["tokens_evaluated"] + o["tokens_predicted"] for o in outs)
    assert m1["llamacpp:predicted_tokens_seconds"] > 0
    assert delta("spec_decode_num_draft_tokens_total") == 0                 # no draft
