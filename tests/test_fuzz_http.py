"""Fuzzing ``pyllama-dspark serve``'s request bodies with hypothesis (a fast, seeded subset; the long
run is ``bench/fuzz_long.py``).  One live server for the module (SmolLM2 + a random DSpark draft,
``-np 2``); every example: never a 5xx (status, or an error inside a stream), the process alive,
``/health`` 200 afterwards.

* any JSON value as the body of every endpoint;
* the known fields of /v1/chat/completions, /v1/completions, /completion, /tokenize, /detokenize and
  /apply-template set to values of any type: wrong types, huge ints (10**30), negative, NaN /
  Infinity as raw JSON, lone surrogates escaped in JSON, 10k-level nesting, long strings
  (generations kept to <= 4 tokens, :mod:`fuzz_http`);
* raw bytes: not JSON, invalid UTF-8 or an encoded surrogate spliced into valid JSON, cut short;
* regressions of what the fuzzing found: a lone surrogate (prompt, stop, model, logit_bias key,
  /tokenize content) was a 500 -- now a 400 like any invalid JSON; nesting deeper than Python's
  parser holds was a 500 and a reset connection -- now a 400; an integer too large for a float in
  a sampling field or a logit bias (temperature, penalties, top_k, repeat_last_n) was a 500 -- now a 400.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from fuzz_http import BASE, ENDPOINTS, Raw, any_bodies, check_response, dumps, field_bodies, post, raw_bodies
from serve_helpers import ServeProcess

CI = dict(derandomize=True, deadline=None, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def srv(target_path, dspark_draft_path, tmp_path_factory):
    s = ServeProcess(target_path, dspark_draft_path, tmp_path_factory.mktemp("fuzz-serve") / "serve.log",
                     n_slots=2, n_ctx=512)
    yield s
    s.stop()
    log = s.log_text()
    assert "Traceback" not in log, log[-3000:]


@settings(max_examples=100, **CI)
@given(case=any_bodies())
def test_any_json_body(srv, case):
    path, value = case
    check_response(srv, path, dumps(value))


@settings(max_examples=250, **CI)
@given(case=field_bodies())
def test_known_fields_any_value(srv, case):
    path, body = case
    check_response(srv, path, dumps(body))


@settings(max_examples=80, **CI)
@given(case=raw_bodies())
def test_raw_bytes(srv, case):
    path, raw = case
    check_response(srv, path, raw)


DEEP = Raw("[" * 10000 + "]" * 10000)
REGRESSIONS = [
    ("/v1/completions", {"prompt": "\ud800", "max_tokens": 2}),
    ("/completion", {"prompt": ["a\udc00", 1], "n_predict": 2}),
    ("/completion", {"prompt": "hi", "n_predict": 2, "stop": ["\ud800"]}),
    ("/v1/chat/completions", {"messages": BASE["/v1/chat/completions"]["messages"], "max_tokens": 2, "model": "\udc00"}),
    ("/completion", {"prompt": "hi", "n_predict": 2, "logit_bias": {"\ud800": 1}}),
    ("/tokenize", {"content": "\ud800"}),
    ("/tokenize", {"\udbff": 1}),
    ("/apply-template", {"messages": [{"role": "user", "content": "\udfff"}]}),
    ("/completion", DEEP),
    ("/v1/chat/completions", {"messages": DEEP}),
    ("/tokenize", {"content": Raw('{"a":' * 10000 + "1" + "}" * 10000)}),
]


HUGE = Raw("1" * 400)     # an integer no float holds
NUMBERS = [
    ("/v1/chat/completions", {"messages": BASE["/v1/chat/completions"]["messages"], "max_tokens": 1,
                              "temperature": HUGE}),
    ("/completion", {"prompt": "hi", "n_predict": 1, "temperature": 1, "presence_penalty": Raw("-" + "9" * 400)}),
    ("/completion", {"prompt": "hi", "n_predict": 1, "logit_bias": {"5": HUGE}}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "logit_bias": [[5, HUGE]]}),
    ("/v1/chat/completions", {"messages": BASE["/v1/chat/completions"]["messages"], "max_tokens": 1,
                              "repeat_last_n": HUGE}),
    ("/completion", {"prompt": "hi", "n_predict": 1, "temperature": 1, "top_k": HUGE}),
]


@pytest.mark.parametrize("path,body", REGRESSIONS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(REGRESSIONS)])
def test_found_by_fuzzing_is_a_400(srv, path, body):
    """Each was a 500 (or a reset connection); now a 400 invalid_request_error, the server fine."""
    status = check_response(srv, path, dumps(body))
    assert status == 400
    status, text = post(srv, path, dumps(body))
    assert '"invalid_request_error"' in text and "invalid JSON" in text, text[:300]


@pytest.mark.parametrize("path,body", NUMBERS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(NUMBERS)])
def test_huge_integer_in_a_float_field_is_a_400(srv, path, body):
    """Found by the long run: an integer too large for a float as temperature / a penalty / a logit
    bias / top_k / repeat_last_n was a 500 (OverflowError converting it); now a 400 naming the field."""
    assert check_response(srv, path, dumps(body)) == 400


def test_encoded_surrogate_and_bom(srv):
    """A surrogate encoded as UTF-8 bytes (ED A0 80) is not UTF-8: 400; a UTF-8 BOM is skipped (as
    llama-server's JSON parser skips it)."""
    assert check_response(srv, "/tokenize", b'{"content": "\xed\xa0\x80"}') == 400
    status, text = post(srv, "/tokenize", b'\xef\xbb\xbf{"content": "Hello"}')
    assert status == 200 and '"tokens"' in text, text
    # a valid pair escaped in JSON is one character, fine
    status, text = post(srv, "/tokenize", b'{"content": "\\ud83d\\ude00", "with_pieces": true}')
    assert status == 200, text


def test_huge_prompt_is_a_400(srv):
    status = check_response(srv, "/v1/completions", dumps({"prompt": "word " * 400000, "max_tokens": 1}))
    assert status == 400


@pytest.mark.parametrize("path", ENDPOINTS)
def test_every_endpoint_survives_the_classics(srv, path):
    for data in ("", "null", "[]", "0", '"x"', "{", "NaN", b"\xff\xfe\x00", "{}" * 1000, "9" * 5000):
        check_response(srv, path, data)
