"""HTTP request-body fuzzing of ``pyllama-dspark serve``: hypothesis strategies for whole bodies
(any JSON, raw bytes) and for the known fields of each endpoint with values of any type (huge
ints, NaN / Infinity written as raw JSON, lone surrogates escaped in JSON, 10k-level nesting,
long strings), and :func:`check_response`, the assertion every example makes: no 5xx (also
not inside a stream), the server alive and healthy afterwards.

Generations are kept cheap: a body's effective length field (``n_predict``, then
``max_completion_tokens``, then ``max_tokens``, llama-server's order) is drawn in 0..4; when a
fuzzed value would let it run longer (-1, a huge int) the body also gets ``grammar: root ::= "a"``,
which ends it after one token.
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Tuple

from hypothesis import strategies as st

GEN = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/completion": "native"}
ENDPOINTS = list(GEN) + ["/tokenize", "/detokenize", "/apply-template"]
MSGS = [{"role": "user", "content": "hi"}]
BASE: Dict[str, dict] = {
    "/v1/chat/completions": {"messages": MSGS},
    "/v1/completions": {"prompt": "Once"},
    "/completion": {"prompt": "Once"},
    "/tokenize": {"content": "Hello world"},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/apply-template": {"messages": MSGS},
}
LENGTH = ("n_predict", "max_completion_tokens", "max_tokens")
GEN_FIELDS = ["prompt", "messages", *LENGTH, "temperature", "top_k", "top_p", "min_p", "seed", "repeat_penalty",
              "repeat_last_n", "presence_penalty", "frequency_penalty", "stop", "stream", "stream_options",
              "ignore_eos", "n", "model", "cache_prompt", "return_tokens", "id_slot", "grammar", "json_schema",
              "response_format", "logprobs", "top_logprobs", "n_probs", "post_sampling_probs", "logit_bias", "echo",
              "best_of", "suffix"]
FIELDS = {
    "/v1/chat/completions": [f for f in GEN_FIELDS if f != "prompt"],
    "/v1/completions": [f for f in GEN_FIELDS if f != "messages"],
    "/completion": [f for f in GEN_FIELDS if f != "messages"],
    "/tokenize": ["content", "add_special", "parse_special", "with_pieces"],
    "/detokenize": ["tokens"],
    "/apply-template": ["messages"],
}
CHEAP_GRAMMAR = 'root ::= "a"'
BOOL_FIELDS = {"stream", "ignore_eos", "cache_prompt", "return_tokens", "post_sampling_probs", "logprobs", "echo",
               "add_special", "parse_special", "with_pieces"}


class Raw(str):
    """A JSON fragment written into a body verbatim (NaN, Infinity, 10k-level nesting, ...)."""


def dumps(body: Any) -> str:
    """``body`` as JSON text with every :class:`Raw` value (at any depth) inlined verbatim."""
    raws: List[str] = []

    def swap(v):
        if isinstance(v, Raw):
            raws.append(str(v))
            return f"\x00RAW{len(raws) - 1}\x00"
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list):
            return [swap(x) for x in v]
        return v

    text = json.dumps(swap(body))
    for i, r in enumerate(raws):
        text = text.replace(json.dumps(f"\x00RAW{i}\x00"), r)
    return text


# ---- value strategies -------------------------------------------------------------------------

surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
safe_texts = st.one_of(st.text(max_size=40), st.sampled_from(["", " ", "\n", "\ufffd", "\x00", "<|im_end|>", "é" * 50,
                                                             "Hello", "\U0001F600", "a" * 300]))
# lone surrogates (escaped in JSON: "\ud800") in one string of eight: every body holding one is a 400
texts = st.one_of(*[safe_texts] * 7, st.text(st.one_of(st.characters(), surrogates), min_size=1, max_size=12)
                  .filter(lambda t: any(0xD800 <= ord(c) <= 0xDFFF for c in t)))
big_ints = st.sampled_from([10 ** 30, -10 ** 30, 2 ** 63, 2 ** 63 - 1, 2 ** 64, -2 ** 63 - 1, 2 ** 31, -2 ** 31 - 1,
                            2 ** 32, -1, 0, 1])
special = st.sampled_from([Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400"), Raw("-1e400"),
                           Raw("1" * 400), Raw("-0"), Raw("1E-400"), Raw("[" * 10000 + "]" * 10000),
                           Raw('{"a":' * 10000 + "1" + "}" * 10000), Raw("[" * 900 + "]" * 900)])
scalars = st.one_of(st.none(), st.booleans(), st.integers(), big_ints, st.floats(), texts, special)
json_values = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=5),
                                                           st.dictionaries(texts, kids, max_size=5)), max_leaves=12)


def _messages():
    part = st.one_of(json_values, st.fixed_dictionaries({"type": st.just("text"), "text": json_values}))
    content = st.one_of(texts, json_values, st.lists(part, max_size=3))
    role = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer", "function"]), json_values)
    msg = st.one_of(st.fixed_dictionaries({"role": role, "content": content}), json_values)
    return st.one_of(st.lists(msg, max_size=3), json_values)


def field_values(name: str):
    """Values for one known field: anything, plus values close to the field's valid ones."""
    near = {
        "prompt": st.one_of(texts, st.lists(st.one_of(st.integers(-5, 60000), big_ints, texts), max_size=6)),
        "content": st.one_of(texts, st.lists(st.one_of(st.integers(-5, 60000), big_ints, texts), max_size=6)),
        "tokens": st.lists(st.one_of(st.integers(-5, 60000), big_ints, st.floats()), max_size=6),
        "messages": _messages(),
        "stop": st.one_of(texts, st.lists(texts, max_size=3)),
        "logit_bias": st.one_of(
            st.dictionaries(st.one_of(texts, st.integers(-5, 60000).map(str), big_ints.map(str)),
                            st.one_of(st.floats(), big_ints, st.booleans(), special), max_size=3),
            st.lists(st.lists(st.one_of(st.integers(-5, 60000), texts, st.floats(), big_ints), max_size=3),
                     max_size=3)),
        "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": json_values}), json_values),
        "response_format": st.one_of(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml"]),
                                   "schema": json_values, "json_schema": json_values}), json_values),
        "json_schema": st.one_of(st.just({}), st.just({"type": "string", "maxLength": 10 ** 30}), json_values),
        "grammar": st.one_of(texts, st.just(CHEAP_GRAMMAR), st.just("root ::= root"), json_values),
        "model": texts,
        "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "min_p": st.floats(0, 1),
        "top_k": st.integers(-5, 100), "seed": st.integers(-2, 2 ** 33), "repeat_last_n": st.integers(-2, 100),
        "repeat_penalty": st.floats(-1, 3), "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
        "n_probs": st.integers(-2, 30), "top_logprobs": st.integers(-2, 30), "id_slot": st.integers(-2, 3),
        "n": st.integers(0, 2),
    }.get(name)
    if name in BOOL_FIELDS:
        near = st.booleans()
    base = st.one_of(json_values, big_ints, special, st.floats(), st.integers(-3, 5))
    # near-valid values twice as often: a body gets past validation often enough to generate
    return st.one_of(near, near, base) if near is not None else base


def _length_value(v: Any):
    """The length a field value would give (None: not a plain integer the server accepts)."""
    if isinstance(v, Raw):   # what the server will read from it ("1" * 400: a huge int)
        try:
            v = json.loads(v)
        except (ValueError, RecursionError):
            return None
    if isinstance(v, bool):
        return None
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)
    return v if isinstance(v, int) else None


def cheapen(path: str, body: dict, fuzzed: set) -> dict:
    """A small length on generating endpoints (0..4 drawn before); a grammar that ends after one
    token when the fuzzed length is unbounded or large."""
    if GEN.get(path) is None or not isinstance(body, dict):
        return body
    eff = next((body[k] for k in LENGTH if body.get(k) is not None), None)
    if eff is None:                 # no length: llama-server's default -1, until the context is full
        body["n_predict"] = eff = 2
    n = _length_value(eff)
    if n is not None and (n == -1 or n > 4):
        body["grammar"] = CHEAP_GRAMMAR
        for k in ("json_schema", "response_format"):
            body.pop(k, None)
        body["ignore_eos"] = False
    return body


@st.composite
def field_bodies(draw) -> Tuple[str, Any]:
    """(endpoint, body): the endpoint's valid base body with 1-3 known fields set to any value."""
    path = draw(st.sampled_from(ENDPOINTS))
    body = dict(BASE[path])
    if path in GEN:
        key = "n_predict" if GEN[path] == "native" else "max_tokens"
        body[key] = draw(st.one_of(st.integers(1, 4), st.integers(1, 4), st.just(0)))
        if draw(st.booleans()):
            body["stream"] = True
    names = draw(st.lists(st.sampled_from(FIELDS[path]), min_size=1, max_size=3, unique=True))
    for name in names:
        body[name] = draw(field_values(name))
    return path, cheapen(path, body, set(names))


@st.composite
def any_bodies(draw) -> Tuple[str, Any]:
    """(endpoint, any JSON value); a generating endpoint's object body without a length gets a small one."""
    path, value = draw(st.sampled_from(ENDPOINTS)), draw(json_values)
    return path, (cheapen(path, value, set()) if isinstance(value, dict) else value)


@st.composite
def raw_bodies(draw) -> Tuple[str, bytes]:
    """(endpoint, bytes): not JSON, JSON with invalid UTF-8 / an encoded surrogate spliced in, or cut short."""
    path = draw(st.sampled_from(ENDPOINTS))
    body = cheapen(path, dict(BASE[path]), set())
    if path in GEN:   # a splice into the length's key would leave it unbounded: the grammar ends it anyway
        body["grammar"] = CHEAP_GRAMMAR
    good = dumps(body).encode()
    kind = draw(st.sampled_from(["binary", "splice", "cut", "junk"]))
    if kind == "binary":
        return path, draw(st.binary(max_size=200))
    if kind == "cut":
        return path, good[:draw(st.integers(0, len(good) - 1))]
    at = draw(st.integers(0, len(good)))
    bad = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x00", b"\xef\xbb\xbf",
                                b'"', b"\\", b"\\u", b"\\ud800", b"}", b"]]]", b"NaN"]))
    if kind == "splice":
        return path, good[:at] + bad + good[at:]
    return path, good + bad


# ---- the check --------------------------------------------------------------------------------

def post(srv, path: str, data, timeout: float = 120.0):
    """POST ``data`` (JSON text or bytes); returns (status, text), reading a stream to its end."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    r = srv.post(path, raw, timeout=timeout, stream=True)
    try:
        text = r.content.decode("utf-8", "replace")
    finally:
        r.close()
    return r.status_code, text


def stream_errors(text: str) -> List[dict]:
    """Error objects with a 5xx code sent inside a server-sent event stream."""
    out = []
    for line in text.splitlines():
        if line.startswith("data:"):
            payload = line[5:].strip()
            try:
                obj = json.loads(payload)
            except ValueError:
                continue
            err = obj.get("error") if isinstance(obj, dict) else None
            if isinstance(err, dict) and int(err.get("code") or 0) >= 500:
                out.append(err)
    return out


def check_response(srv, path: str, data, timeout: float = 120.0) -> int:
    """Send one body; assert no 5xx (status or in-stream error), the process alive, /health 200."""
    status, text = post(srv, path, data, timeout)
    shown = data[:300] if isinstance(data, (str, bytes)) else data
    assert status < 500, f"{path} -> {status}: {text[:600]}\nbody: {shown!r}"
    errs = stream_errors(text) if status == 200 else []
    assert not errs, f"{path}: 5xx inside the stream: {errs}\nbody: {shown!r}"
    assert srv.proc.poll() is None, f"server died (rc {srv.proc.returncode}) on {path} {shown!r}"
    h = srv.get("/health", timeout=30)
    assert h.status_code == 200, f"/health -> {h.status_code} after {path} {shown!r}"
    return status
