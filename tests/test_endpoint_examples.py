"""docs/endpoints.md stays true: every documented request, sent to a live ``serve`` as the page
starts it, answers with the documented status and shape (the same keys, recursively; the same
stream framing; the same metric names).  The reference is the page itself, captured from a server
by ``tools/endpoint_examples.py``."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any, List

import pytest

from serve_helpers import SESSION, ServeProcess

PAGE = Path(__file__).resolve().parent.parent / "docs" / "endpoints.md"
BLOCK = re.compile(r"^## (?P<title>.+?)\n.*?```bash\n(?P<curl>.*?)\n```\n\n(?:HTTP (?P<status>\d+)\n\n)?"
                   r"```(?P<kind>json|text)\n(?P<out>.*?)\n```", re.S | re.M)


def examples() -> List[dict]:
    out = []
    for m in BLOCK.finditer(PAGE.read_text(encoding="utf-8")):
        args = shlex.split(m.group("curl").replace("\\\n", " "))
        url = next(a for a in args if a.startswith("http"))
        body = args[args.index("-d") + 1] if "-d" in args else None
        out.append({"title": m.group("title"), "path": url.split("8080", 1)[1], "body": body,
                    "status": int(m.group("status") or 200), "kind": m.group("kind"), "out": m.group("out")})
    return out


def shape(v: Any) -> Any:
    """Keys, recursively (a list: its first item's shape); leaves reduced to their JSON type."""
    if isinstance(v, dict):
        return {k: shape(x) for k, x in v.items()}
    if isinstance(v, list):
        return [shape(v[0])] if v else []
    return "number" if isinstance(v, (int, float)) and not isinstance(v, bool) else type(v).__name__


def keys_of(a: Any, b: Any, where: str = "") -> List[str]:
    """Where the key sets of ``a`` and ``b`` differ (values are free: ids, times, counts)."""
    if isinstance(a, dict) and isinstance(b, dict):
        diff = [f"{where}: {sorted(set(a) ^ set(b))}"] if set(a) != set(b) else []
        return diff + [d for k in set(a) & set(b) for d in keys_of(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and a and b:
        return keys_of(a[0], b[0], where + "[0]")
    return []


@pytest.fixture(scope="module")
def server(target_path, tmp_path_factory):
    from pyllama_dspark.paths import default_draft

    srv = ServeProcess(target_path, default_draft(), tmp_path_factory.mktemp("endpoints") / "serve.log",
                       n_ctx=4096, extra=["--metrics"])
    yield srv
    srv.stop()


def test_the_page_documents_every_route(server):
    docs = {e["path"] for e in examples()}
    for path in ("/v1/chat/completions", "/v1/completions", "/completion", "/v1/messages", "/v1/messages/count_tokens",
                 "/v1/responses", "/v1/responses/input_tokens", "/tokenize", "/detokenize", "/apply-template",
                 "/health", "/v1/models", "/props", "/slots", "/metrics"):
        assert path in docs, path


@pytest.mark.parametrize("ex", examples(), ids=lambda e: e["title"])
def test_each_example_answers_as_documented(server, ex):
    body = json.loads(ex["body"]) if ex["body"] else None
    stream = bool(body and body.get("stream"))
    method = "POST" if body is not None else "GET"
    r = SESSION.request(method, server.url + ex["path"], json=body, timeout=300, stream=stream)
    assert r.status_code == ex["status"]
    if ex["path"] == "/metrics":
        names = {ln.split("{")[0].split()[0] for ln in ex["out"].splitlines() if ln and not ln.startswith("#")}
        assert names and all(n in r.text for n in names), names
    elif stream:
        got = [ln for ln in r.iter_lines(decode_unicode=True) if ln.startswith("data:")]
        doc = [ln for ln in ex["out"].splitlines() if ln.startswith("data:")]
        assert got[-1] == doc[-1] == "data: [DONE]"
        first = lambda lines: json.loads(lines[0][5:])  # noqa: E731
        last = lambda lines: json.loads(lines[-2][5:])  # noqa: E731
        assert not keys_of(shape(first(doc)), shape(first(got)))
        assert not keys_of(shape(last(doc)), shape(last(got)))
    else:
        diff = keys_of(shape(json.loads(ex["out"])), shape(r.json()))
        assert not diff, diff


def test_the_check_bites():
    doc = {"choices": [{"message": {"content": "x", "role": "assistant"}}], "timings": {"draft_n": 1}}
    assert keys_of(shape(doc), shape({"choices": [{"message": {"content": "y"}}], "timings": {"draft_n": 2}}))
    assert not keys_of(shape(doc), shape(json.loads(json.dumps(doc).replace('"x"', '"z"'))))
