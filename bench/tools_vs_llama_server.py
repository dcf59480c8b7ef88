"""Tool calls on ``serve`` under speculation: a JSON-heavy call with the shipped drafter under ``auto``,
against the same request without a draft and against llama-server doing the same work.

    python bench/tools_vs_llama_server.py [--rounds 5] [--requests 2] [--threads 2] [--choice required|auto]
        [--max-tokens 192] [--schedule-off] [--out FILE] [--smoke]

The request: SmolLM2 (the shipped target; its template has no tool syntax, so ``serve`` uses the generic
form) is asked for a ``create_event`` call with a title, a time, a room and a list of attendees (objects
with name and email): most of the reply is JSON inside the call.  ``--choice required`` (default)
constrains the whole reply with the call grammar, ``auto`` triggers the lazy grammar at
``<tool_call>`` (the prompt asks for one).  Configurations, started once and interleaved round by round
(medians over rounds):

* ``ours, draft, auto``: ``serve -md <shipped drafter>`` (``--schedule auto``, the default);
* ``ours, no draft``: ``serve`` alone;
* ``ours, draft, off`` (``--schedule-off``): every block verified, for reference;
* ``llama-server, no draft``: llama-server ``/completion`` with our prompt tokens and our grammar (strict,
  or lazy with the same trigger): the same tokens, so the same work.  (llama-server ``--jinja`` drops
  the tools of a template with no tool syntax, so its chat endpoint cannot do this request.)

Printed: per configuration the median wall clock of a request over HTTP, completion tokens per second,
whether the reply is the no-draft reply (it must be: greedy), accepted / drafted; then the two ratios
of issue 45: ``ours draft auto / ours no draft`` by tok/s (goal >= 0.97) and llama-server's wall clock /
ours without a draft (goal >= 0.95).  Run it on an idle machine (llama.cpp's threads spin-wait).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_vs_llama_server import BenchError, OurServer, TheirServer, session  # noqa: E402

from pyllama_dspark.decode.api import Speculator  # noqa: E402
from pyllama_dspark.paths import cache_dir, default_draft, default_target  # noqa: E402
from pyllama_dspark.chat.tool_prompt import tool_chat_for  # noqa: E402
from pyllama_dspark.chat.tool_request import check_tool_choice, check_tools, plan_tools  # noqa: E402
from pyllama_dspark.upstream.llama_server_build import ensure_llama_server  # noqa: E402

TOOL = {"type": "function", "function": {
    "name": "create_event", "description": "Create a calendar event",
    "parameters": {"type": "object", "properties": {
        "title": {"type": "string"}, "start": {"type": "string", "description": "ISO 8601 date and time"},
        "duration_minutes": {"type": "integer"}, "room": {"type": "string"},
        "attendees": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "email": {"type": "string"}}, "required": ["name", "email"]}},
        "notes": {"type": "string"}},
        "required": ["title", "start", "duration_minutes", "room", "attendees"]}}}
ASKS = [
    "Reply with a <tool_call> that calls create_event for a team meeting on 2025-03-10 at 10:00 for 45 minutes "
    "in room 4B with Alice Martin (alice@example.com), Bob Chen (bob@example.com) and Carol Diaz "
    "(carol@example.com).",
    "Reply with a <tool_call> that calls create_event for the quarterly review on 2025-04-02 at 14:30 for 90 "
    "minutes in the Orion room with Dana Wu (dana@example.com) and Eli Novak (eli@example.com).",
]


def plan_request(target: str, choice: str, ask: str):
    """Our prompt tokens and grammar for one ask (what serve decodes), computed in this process."""
    tools = check_tools([TOOL])
    with Speculator(target, None, n_ctx=2048, n_threads=1) as sp:
        plan = plan_tools(tool_chat_for(sp.target), [{"role": "user", "content": ask}], tools,
                          check_tool_choice(choice, tools), False)
        toks = sp.target.tokenize(plan.prompt, add_special=not plan.added_special, parse_special=True)
    g = plan.grammar
    fields: Dict[str, Any] = {"grammar": g.gbnf}
    if g.lazy:
        fields.update(grammar_lazy=True, grammar_triggers=[{"type": 1, "value": w} for w in g.words])
    return toks, fields


def timed_post(url: str, path: str, body: dict) -> Dict[str, Any]:
    t0 = time.perf_counter()
    r = session().post(url + path, json=body, timeout=900)
    wall = time.perf_counter() - t0
    if r.status_code != 200:
        raise BenchError(f"{url}{path}: HTTP {r.status_code}: {r.text[:400]}")
    j = r.json()
    t = j.get("timings") or {}
    if path == "/completion":
        return {"wall_s": wall, "n": int(j.get("tokens_predicted") or t.get("predicted_n") or 0),
                "text": j.get("content", ""), "timings": t}
    ch = j["choices"][0]
    return {"wall_s": wall, "n": int(j["usage"]["completion_tokens"]), "timings": t, "finish": ch["finish_reason"],
            "text": json.dumps([(c["function"]["name"], c["function"]["arguments"])
                                for c in ch["message"].get("tool_calls") or []] or ch["message"].get("content"))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="target (default: the shipped SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("-md", "--draft", default=None, help="drafter (default: the shipped one)")
    ap.add_argument("--choice", choices=("required", "auto"), default="required")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=2, help="requests per configuration per round")
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("-c", "--ctx", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--schedule-off", action="store_true", help="also run the draft with every block verified")
    ap.add_argument("--smoke", action="store_true", help="one round, one request, 32 tokens (checks the script)")
    ap.add_argument("--out", default=None, help="raw numbers (JSON; default <cache>/bench/tools_vs_llama_server.json)")
    a = ap.parse_args()
    if a.smoke:
        a.rounds, a.requests, a.max_tokens = 1, 1, 32
    target, draft = a.model or default_target(), a.draft or default_draft()
    log_dir = Path(tempfile.mkdtemp(prefix="tools-vs-llama-server-"))
    kw = dict(n_slots=1, ctx=a.ctx, threads=a.threads, log_dir=log_dir)
    servers = {"ours, draft, auto": OurServer("ours-draft-auto", target, draft=draft, schedule="auto", **kw),
               "ours, no draft": OurServer("ours-nodraft", target, **kw)}
    if a.schedule_off:
        servers["ours, draft, off"] = OurServer("ours-draft-off", target, draft=draft, schedule="off", **kw)
    servers["llama-server, no draft"] = TheirServer("llama-server", ensure_llama_server(), target, **kw)
    asks = [ASKS[k % len(ASKS)] for k in range(a.requests)]
    plans = [plan_request(target, a.choice, q) for q in asks]
    print(f"target {target}\ndraft {draft}\n{a.threads} threads, tool_choice {a.choice}, {a.rounds} rounds x "
          f"{a.requests} requests, at most {a.max_tokens} tokens; logs in {log_dir}")
    for name, s in servers.items():
        print(f"  [{name}] {' '.join(s.command())}")
    rec: Dict[str, List[dict]] = {k: [] for k in servers}
    try:
        for name, s in servers.items():   # started, then one untimed request each (first-use costs)
            s.start()
            if name.startswith("llama-server"):
                timed_post(s.url, "/completion", {"prompt": plans[0][0], "n_predict": 8, **plans[0][1]})
            else:
                timed_post(s.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": asks[0]}],
                                                            "tools": [TOOL], "tool_choice": a.choice, "max_tokens": 8})
        for r in range(a.rounds):
            names = list(servers)
            names = names[r % len(names):] + names[:r % len(names)]     # rotate the order every round
            for name in names:
                url = servers[name].url
                for q, (toks, fields) in zip(asks, plans):
                    if name.startswith("llama-server"):
                        body = {"prompt": toks, "n_predict": a.max_tokens, "temperature": 0, "cache_prompt": False,
                                **fields}
                        rec[name].append(timed_post(url, "/completion", body))
                    else:
                        body = {"messages": [{"role": "user", "content": q}], "tools": [TOOL],
                                "tool_choice": a.choice, "parallel_tool_calls": False, "max_tokens": a.max_tokens,
                                "temperature": 0, "cache_prompt": False}
                        rec[name].append(timed_post(url, "/v1/chat/completions", body))
    finally:
        for s in servers.values():
            s.stop()
    base = rec["ours, no draft"]
    rows, tok_s = [], {}
    for name, xs in rec.items():
        per_round = [xs[i:i + a.requests] for i in range(0, len(xs), a.requests)]
        tok_s[name] = statistics.median(sum(x["n"] for x in g) / sum(x["wall_s"] for x in g) for g in per_round)
        same = sum(x["text"] == y["text"] for x, y in zip(xs, base)) if not name.startswith("llama") else "-"
        dn = sum(x["timings"].get("draft_n", 0) or 0 for x in xs)
        acc = sum(x["timings"].get("draft_n_accepted", 0) or 0 for x in xs)
        rows.append([name, statistics.median(x["wall_s"] for x in xs), statistics.mean(x["n"] for x in xs),
                     tok_s[name], f"{same}/{len(xs)}" if same != "-" else "-", f"{acc}/{dn}" if dn else "-"])
    print(tabulate(rows, headers=["config", "wall s / request (median)", "tokens", "tok/s (median of rounds)",
                                  "same reply as no draft", "accepted / drafted"], floatfmt=".3f"))
    r1 = tok_s["ours, draft, auto"] / tok_s["ours, no draft"]
    wall = {k: statistics.median(x["wall_s"] for x in v) for k, v in rec.items()}
    r2 = wall["llama-server, no draft"] / wall["ours, no draft"]
    print(f"draft under auto / no draft (tok/s): {r1:.3f}  (goal >= 0.97)")
    print(f"llama-server wall / ours wall, no draft: {r2:.3f}  (goal >= 0.95)")
    out = Path(a.out) if a.out else cache_dir() / "bench" / "tools_vs_llama_server.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "records": rec, "ratio_auto_vs_nodraft": r1,
                               "ratio_llama_wall_vs_ours": r2}, indent=1, default=str))
    print(f"raw numbers: {out}")


if __name__ == "__main__":
    main()
