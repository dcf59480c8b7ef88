"""docs/endpoints.md: a request and its response for every ``serve`` endpoint, captured from a live
server (SmolLM2-135M-Instruct with the shipped drafter, ``--temp 0 --metrics``).

    python tools/endpoint_examples.py            # start serve, send every example, write the page

``tests/test_endpoint_examples.py`` sends every request of the page to a live server again and
checks that each response still has the documented shape (the same keys, recursively, and the same
status), so the page cannot drift from the server.
"""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "endpoints.md"
BASE = "http://localhost:8080"

# (section title, method, path, body or None, what it is for)
CHAT = {"messages": [{"role": "user", "content": "Say hello in one word."}], "max_tokens": 8}
EXAMPLES: List[Tuple[str, str, str, Optional[dict], str]] = [
    ("Chat completions (OpenAI)", "POST", "/v1/chat/completions", CHAT,
     "`/chat/completions` is the same route. Every response carries llama-server's `timings` "
     "(`draft_n` / `draft_n_accepted`: what the draft did)."),
    ("Chat completions, streamed", "POST", "/v1/chat/completions", dict(CHAT, stream=True, dspark_trace=True),
     "Server-sent events ending with `data: [DONE]`; `dspark_trace` marks each chunk's tokens "
     "([the trace](serve.md#the-speculation-trace-dspark_trace)). The last chunk carries `timings`."),
    ("Text completions (OpenAI)", "POST", "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 6},
     "OpenAI's legacy completion form."),
    ("Completion (llama-server's native form)", "POST", "/completion",
     {"prompt": "The capital of France is", "n_predict": 6, "return_tokens": True},
     "`/completions` is the same route."),
    ("Anthropic Messages", "POST", "/v1/messages",
     {"model": "x", "max_tokens": 8, "messages": [{"role": "user", "content": "Say hello in one word."}]},
     "For Claude Code and the `anthropic` SDK ([details](serve.md#anthropic-messages))."),
    ("Anthropic token count", "POST", "/v1/messages/count_tokens",
     {"model": "x", "messages": [{"role": "user", "content": "Say hello in one word."}]}, ""),
    ("OpenAI Responses", "POST", "/v1/responses", {"input": "Say hello in one word.", "max_output_tokens": 8},
     "For Codex CLI and `client.responses` ([details](serve.md#openai-responses)). `/responses` is the same route."),
    ("OpenAI Responses token count", "POST", "/v1/responses/input_tokens", {"input": "Say hello in one word."}, ""),
    ("Tokenize", "POST", "/tokenize", {"content": "Hello world", "with_pieces": True}, ""),
    ("Detokenize", "POST", "/detokenize", {"tokens": [19556, 905]}, ""),
    ("Apply the chat template", "POST", "/apply-template", {"messages": CHAT["messages"]},
     "The prompt a chat request decodes."),
    ("Health", "GET", "/health", None, "`/v1/health` is the same route."),
    ("Models", "GET", "/v1/models", None, "`/models` is the same route."),
    ("Server properties", "GET", "/props", None,
     "The sampling defaults (`serve --temp ...`), the context, the template and, ours, the draft (`dspark`)."),
    ("Slots", "GET", "/slots", None, "Per slot: what it runs and what its memories hold."),
]
METRICS = ("Metrics", "GET", "/metrics", None, "Prometheus text, with `serve --metrics` (else a 501).")

HEADER = """# Endpoints: a request and its response each

<!-- written by `python tools/endpoint_examples.py` from a live server; tests/test_endpoint_examples.py
     sends every request again and checks each response's shape -->

Every endpoint of `serve`, with one request and the response a server gave to it. The server was
started with `pyllama-dspark serve --temp 0 --metrics` (the default models: SmolLM2-135M-Instruct and the
shipped drafter). Ids, times and token counts differ from run to run; the shape does not, and the tests
check it. What each field means: [serve](serve.md). The web page at `GET /`: [the web page](serve.md#the-web-page).
"""


def curl(method: str, path: str, body: Optional[dict]) -> str:
    if body is None:
        return f"curl {BASE}{path}"
    stream = " -N" if body.get("stream") else ""
    return (f"curl{stream} {BASE}{path} -H 'Content-Type: application/json' \\\n"
            f"  -d {shlex.quote(json.dumps(body, ensure_ascii=False))}")


def _trim(v: Any, depth: int = 0) -> Any:
    """Long lists shortened for the page (their first items kept)."""
    if isinstance(v, list) and len(v) > 6 and depth > 0:
        return [_trim(x, depth + 1) for x in v[:3]]
    if isinstance(v, dict):
        return {k: _trim(x, depth + 1) for k, x in v.items()}
    if isinstance(v, list):
        return [_trim(x, depth + 1) for x in v]
    return v


def capture(url: str) -> List[str]:
    import requests

    s = requests.Session()
    s.trust_env = False
    out = [HEADER]
    for title, method, path, body, what in EXAMPLES + [METRICS]:
        r = s.request(method, url + path, json=body, timeout=300, stream=bool(body and body.get("stream")))
        out += [f"## {title}", ""] + ([what, ""] if what else []) + ["```bash", curl(method, path, body), "```", ""]
        if body and body.get("stream"):
            lines = [ln for ln in r.iter_lines(decode_unicode=True) if ln.startswith("data:")]
            shown = lines[:3] + (["..."] if len(lines) > 5 else []) + lines[-2:]
            out += ["```text", *shown, "```", ""]
        elif path == "/metrics":
            text = [ln for ln in r.text.splitlines() if "dspark" in ln or "tokens_predicted_total" in ln][:8]
            out += ["```text", *text, "```", ""]
        else:
            out += [f"HTTP {r.status_code}", "", "```json", json.dumps(_trim(r.json()), indent=2, ensure_ascii=False),
                    "```", ""]
    return out


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from serve_helpers import ServeProcess

    from pyllama_dspark.cli.common import default_target
    from pyllama_dspark.paths import default_draft

    with tempfile.TemporaryDirectory() as d:
        srv = ServeProcess(default_target(), default_draft(), Path(d) / "serve.log", n_ctx=4096, extra=["--metrics"])
        try:
            text = "\n".join(capture(srv.url)).rstrip() + "\n"
        finally:
            srv.stop()
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
