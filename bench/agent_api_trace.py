"""One multi-turn agent trace with tool calls, through the three APIs of ``serve``: chat completions,
Anthropic Messages (``/v1/messages``) and OpenAI Responses (``/v1/responses``).

    python bench/agent_api_trace.py [--rounds 3] [--threads 2] [--out FILE]

One ``pyllama-dspark serve`` (SmolLM2-135M-Instruct with the shipped drafter, the default schedule,
greedy). The trace is a coding agent's conversation: a system prompt and two tools; each step a
forced tool call, its result, and a free reply; ``--steps`` steps, the conversation growing each turn.
Every request is streamed. Per API: the time to the first event that carries output (TTFT), the
wall-clock time of each request, and its output tokens from the API's own usage. The APIs take turns
within each round (their order rotates), on a fresh server each round; the three traces of a round
differ only in a session id in the system prompt (so no API reuses another's prompt), and over
``--rounds 3`` each API runs each of the three traces once. Printed: per API, the median TTFT, the output tokens
per second of wall time, and both as ratios to chat completions. Run it on an idle machine:
llama.cpp's threads spin-wait.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_vs_llama_server import OurServer, session   # noqa: E402  (the sibling benchmark)

from pyllama_dspark.paths import default_draft, default_target   # noqa: E402

SYSTEM = ("Session {tag}. You are a coding agent working in a Python repository. Use the tools to read files "
          "and run commands. Keep answers short and precise; show code when it helps.")
READ = {"name": "read_file", "description": "Read a file of the repository",
        "schema": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 24}}, "required": ["path"]}}
RUN = {"name": "run", "description": "Run a shell command",
       "schema": {"type": "object", "properties": {"cmd": {"type": "string", "maxLength": 32}}, "required": ["cmd"]}}
ASKS = ["Open the main module and tell me what it does.", "Run the tests.", "Which function is slowest?",
        "Suggest one fix."]
RESULT = "def add(a, b):\n    return a + b\n\n\ndef main():\n    print(add(2, 3))\n"
N_CALL, N_REPLY = 48, 64


def _sse(resp):
    """(event name, data) of a streamed response."""
    name = None
    for line in resp.iter_lines(decode_unicode=True):
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
            yield name, (data if data == "[DONE]" else json.loads(data))
            name = None


class Chat:
    name = "chat completions"

    def __init__(self, tag):
        self.msgs = [{"role": "system", "content": SYSTEM.format(tag=tag)}]
        self.tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                        "parameters": t["schema"]}} for t in (READ, RUN)]

    def request(self, url, ask, force):
        if ask is not None:
            self.msgs.append({"role": "user", "content": ask})
        body = {"messages": self.msgs, "tools": self.tools, "tool_choice": "required" if force else "none",
                "max_tokens": N_CALL if force else N_REPLY, "stream": True, "stream_options": {"include_usage": True}}
        msg, calls, n, first = {"role": "assistant", "content": ""}, {}, 0, None
        t0 = time.perf_counter()
        with session().post(url + "/v1/chat/completions", json=body, stream=True, timeout=600) as r:
            for _, d in _sse(r):
                if d == "[DONE]":
                    break
                if d.get("usage"):
                    n = d["usage"]["completion_tokens"]
                for ch in d.get("choices", []):
                    delta = ch["delta"]
                    if first is None and (delta.get("content") or delta.get("tool_calls")):
                        first = time.perf_counter() - t0
                    msg["content"] += delta.get("content") or ""
                    for tc in delta.get("tool_calls", []):
                        c = calls.setdefault(tc["index"], {"id": tc.get("id"), "type": "function",
                                                           "function": {"name": "", "arguments": ""}})
                        c["function"]["name"] += tc.get("function", {}).get("name", "")
                        c["function"]["arguments"] += tc.get("function", {}).get("arguments", "")
        wall = time.perf_counter() - t0
        if calls:
            msg["tool_calls"] = list(calls.values())
        self.msgs.append(msg)
        for c in calls.values():
            self.msgs.append({"role": "tool", "tool_call_id": c["id"], "content": RESULT})
        return first, wall, n


class Messages:
    name = "Anthropic /v1/messages"

    def __init__(self, tag):
        self.system = [{"type": "text", "text": SYSTEM.format(tag=tag), "cache_control": {"type": "ephemeral"}}]
        self.msgs = []
        self.tools = [{"name": t["name"], "description": t["description"], "input_schema": t["schema"]}
                      for t in (READ, RUN)]
        self.pending = []

    def request(self, url, ask, force):
        content = list(self.pending) + ([{"type": "text", "text": ask}] if ask is not None else [])
        self.pending = []
        self.msgs.append({"role": "user", "content": content})
        body = {"model": "m", "system": self.system, "messages": self.msgs, "tools": self.tools,
                "tool_choice": {"type": "any"} if force else {"type": "none"},
                "max_tokens": N_CALL if force else N_REPLY, "stream": True}
        blocks, n, first = {}, 0, None
        t0 = time.perf_counter()
        with session().post(url + "/v1/messages", json=body, stream=True, timeout=600) as r:
            for name, d in _sse(r):
                if name == "content_block_start":
                    blocks[d["index"]] = dict(d["content_block"], _json="")
                elif name == "content_block_delta":
                    if first is None:
                        first = time.perf_counter() - t0
                    b, dl = blocks[d["index"]], d["delta"]
                    if dl["type"] == "text_delta":
                        b["text"] += dl["text"]
                    elif dl["type"] == "input_json_delta":
                        b["_json"] += dl["partial_json"]
                elif name == "message_delta":
                    n = d["usage"]["output_tokens"]
        wall = time.perf_counter() - t0
        content = []
        for b in blocks.values():
            if b["type"] == "tool_use":
                b["input"] = json.loads(b["_json"] or "{}")
                self.pending.append({"type": "tool_result", "tool_use_id": b["id"], "content": RESULT})
            b.pop("_json")
            if b["type"] in ("text", "tool_use"):
                content.append(b)
        self.msgs.append({"role": "assistant", "content": content})
        return first, wall, n


class Responses:
    name = "OpenAI /v1/responses"

    def __init__(self, tag):
        self.instructions = SYSTEM.format(tag=tag)
        self.items = []
        self.tools = [{"type": "function", "name": t["name"], "description": t["description"], "parameters": t["schema"]}
                      for t in (READ, RUN)]

    def request(self, url, ask, force):
        if ask is not None:
            self.items.append({"role": "user", "content": [{"type": "input_text", "text": ask}]})
        body = {"model": "m", "instructions": self.instructions, "input": self.items, "tools": self.tools,
                "tool_choice": "required" if force else "none", "max_output_tokens": N_CALL if force else N_REPLY,
                "stream": True, "store": False}
        n, first, out = 0, None, []
        t0 = time.perf_counter()
        with session().post(url + "/v1/responses", json=body, stream=True, timeout=600) as r:
            for name, d in _sse(r):
                if first is None and name in ("response.output_text.delta", "response.function_call_arguments.delta"):
                    first = time.perf_counter() - t0
                if name == "response.output_item.done":
                    out.append(d["item"])
                elif name in ("response.completed", "response.incomplete"):
                    n = d["response"]["usage"]["output_tokens"]
        wall = time.perf_counter() - t0
        for it in out:
            if it["type"] == "message":
                self.items.append({"type": "message", "role": "assistant", "content": it["content"]})
            elif it["type"] == "function_call":
                self.items.append({k: it[k] for k in ("type", "call_id", "name", "arguments")})
                self.items.append({"type": "function_call_output", "call_id": it["call_id"], "output": RESULT})
        return first, wall, n


def run_trace(api, url, steps):
    ttft, wall, toks = [], 0.0, 0
    for s in range(steps):
        for ask, force in ((ASKS[s % len(ASKS)], True), (None, False)):
            f, w, n = api.request(url, ask, force)
            ttft.append(f if f is not None else w)
            wall += w
            toks += n
    return ttft, wall, toks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx", type=int, default=8192)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    apis = [Chat, Messages, Responses]
    raw = {c.name: [] for c in apis}
    with tempfile.TemporaryDirectory() as d:
        for rnd in range(a.rounds):
            srv = OurServer(f"serve-{rnd}", default_target(), n_slots=1, ctx=a.ctx, threads=a.threads,
                            log_dir=Path(d), draft=default_draft())
            srv.start()
            try:
                order = apis[rnd % 3:] + apis[:rnd % 3]
                for k, cls in enumerate(order):
                    ttft, wall, toks = run_trace(cls(str(k)), srv.url, a.steps)
                    raw[cls.name].append({"ttft": ttft, "wall": wall, "tokens": toks, "tag": k})
                    print(f"round {rnd + 1} {cls.name} (trace {k}): {toks} tokens in {wall:.2f} s, "
                          f"TTFT median {1000 * statistics.median(ttft):.1f} ms", flush=True)
            finally:
                srv.stop()
    base = raw[Chat.name]
    rate = lambda runs: sum(r["tokens"] for r in runs) / sum(r["wall"] for r in runs)   # noqa: E731
    ttft = lambda runs: statistics.median(t for r in runs for t in r["ttft"])   # noqa: E731
    rows = [[name, sum(r["tokens"] for r in runs) // len(runs), f"{rate(runs):.1f}", f"{rate(runs) / rate(base):.3f}",
             f"{1000 * ttft(runs):.1f}", f"{ttft(runs) / ttft(base):.3f}"] for name, runs in raw.items()]
    print(tabulate(rows, headers=["API", "tokens / trace", "tok/s (wall)", "vs chat", "TTFT median ms", "vs chat"]))
    if a.out:
        a.out.write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
