"""Soak: ``serve -np 4`` with the shipped drafter under a mixed load for a long time.

    python bench/soak.py [--minutes 30] [--clients 4] [--seed 0] [--json soak.json]

Client threads (each with its own seeded RNG) pick, request after request:
greedy and sampled chat, streaming and not; three-turn conversations (the prompt cache); native
``/completion`` with ``n_probs``; clients that hang up mid-stream; malformed bodies; prompts longer
than the context; ``max_tokens`` 0.  Every minute: requests so far, 5xx so far, the server's RSS
(``/proc/PID/status``) and ``GET /slots``: each idle slot's memory (target and draft,
``llama_memory_seq_pos_min/max`` as the slot's worker read them when its last request ended)
against what its prompt cache keeps (``n_cached``); a state counts when two snapshots 1.5 s apart
show it unchanged (a slot admitted inside a step shows as idle until the step ends).  At the end, on the idle server, the greedy
requests are sent again one at a time: each reply must equal the reply it got under load, or the
divergence must be a near-tie (the top-2 logprob margin at the first differing token is printed).

Goals (issue "reliability"): 0 5xx; RSS growth after warm-up < 5%; no idle slot holding cells
beyond its cache; greedy replies equal to the idle server's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from serve_helpers import ServeProcess, sse_events  # noqa: E402

KINDS = {"greedy": 5, "sampled_stream": 3, "conversation": 2, "native": 2, "hangup": 1, "malformed": 1,
         "too_long": 1, "max_tokens_0": 1}


class Load:
    def __init__(self, srv, prompts, n_ctx_slot, seed):
        self.srv, self.prompts, self.n_ctx_slot = srv, prompts, n_ctx_slot
        self.lock = threading.Lock()
        self.records = []     # (kind, status, seconds)
        self.greedy = []      # (body, content)
        self.cache_hits = []  # cache_n of later conversation turns
        self.errors = []
        self.seed = seed

    def _post(self, path, body, stream=False, timeout=300):
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return self.srv.post(path, data, stream=stream, timeout=timeout)

    def record(self, kind, status, dt):
        with self.lock:
            self.records.append((kind, status, dt))

    def one(self, rng):
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        q = rng.choice(self.prompts)
        t0 = time.monotonic()
        status = None
        try:
            if kind == "greedy":
                body = {"messages": [{"role": "user", "content": q}], "max_tokens": rng.choice([16, 32, 48]),
                        "temperature": 0}
                r = self._post("/v1/chat/completions", body)
                status = r.status_code
                if status == 200:
                    with self.lock:
                        self.greedy.append((body, r.json()["choices"][0]["message"]["content"]))
            elif kind == "sampled_stream":
                body = {"messages": [{"role": "user", "content": q}], "max_tokens": rng.choice([16, 48]),
                        "temperature": 0.8, "seed": rng.randrange(1 << 30), "stream": True}
                r = self._post("/v1/chat/completions", body, stream=True)
                status = r.status_code
                events = list(sse_events(r))
                if status == 200 and (not events or events[-1] != "[DONE]"):
                    status = "incomplete-stream"
            elif kind == "conversation":
                msgs = [{"role": "user", "content": q}]
                for turn in range(3):
                    r = self._post("/v1/chat/completions", {"messages": msgs, "max_tokens": 16, "temperature": 0})
                    status = r.status_code
                    if status != 200:
                        break
                    d = r.json()
                    if turn:
                        with self.lock:
                            self.cache_hits.append(int(d.get("timings", {}).get("cache_n", 0)))
                    msgs += [d["choices"][0]["message"], {"role": "user", "content": rng.choice(self.prompts)}]
            elif kind == "native":
                r = self._post("/completion", {"prompt": q, "n_predict": 16, "n_probs": 3, "temperature": 0})
                status = r.status_code
            elif kind == "hangup":
                body = {"messages": [{"role": "user", "content": q}], "max_tokens": 200, "stream": True}
                r = self._post("/v1/chat/completions", body, stream=True)
                status = r.status_code
                for i, _ in enumerate(r.iter_lines()):
                    if i >= 2:
                        break
                r.close()
            elif kind == "malformed":
                bad = rng.choice([b'{"messages": [', b'{"messages": "x", "max_tokens": "many"}', b"\xff\xfe",
                                  b'{"prompt": {"a": 1}}', b'[]'])
                r = self._post(rng.choice(["/v1/chat/completions", "/completion"]), bad)
                status = r.status_code
            elif kind == "too_long":
                body = {"prompt": "word " * (self.n_ctx_slot + 64), "n_predict": 4}
                r = self._post("/completion", body)
                status = r.status_code
            elif kind == "max_tokens_0":
                r = self._post("/v1/chat/completions", {"messages": [{"role": "user", "content": q}],
                                                        "max_tokens": 0, "temperature": 0})
                status = r.status_code
        except requests.RequestException as e:
            status = f"error:{type(e).__name__}"
        self.record(kind, status, time.monotonic() - t0)

    def client(self, i, deadline):
        rng = random.Random(self.seed * 1000 + i)
        while time.monotonic() < deadline:
            self.one(rng)


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def slot_violations(slots):
    """Idle slots whose memories hold positions beyond what the prompt cache keeps."""
    bad = []
    for s in slots:
        mem = s.get("dspark_memory")
        if s.get("is_processing") or not mem:
            continue
        n = int(s.get("n_cached", 0))
        t_max = mem["target"][1]
        d_max = mem["draft"][1] if mem.get("draft") else -1
        if t_max + 1 > n or d_max + 1 > n:
            bad.append({"slot": s["id"], "n_cached": n, "memory": mem})
    return bad


def replay(srv, greedy, limit):
    """The greedy requests again on the idle server: (equal, differing with their near-tie margins)."""
    seen, equal, diffs = set(), 0, []
    for body, content in greedy:
        key = json.dumps(body, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        if len(seen) > limit:
            break
        b = dict(body, logprobs=True, top_logprobs=2)
        d = srv.post("/v1/chat/completions", b, timeout=300).json()
        idle = d["choices"][0]["message"]["content"]
        if idle == content:
            equal += 1
            continue
        margin = None
        pos = 0
        for lp in d["choices"][0]["logprobs"]["content"]:
            tok = lp["token"]
            if content[pos:pos + len(tok)] != tok:
                tops = lp["top_logprobs"]
                margin = tops[0]["logprob"] - tops[1]["logprob"] if len(tops) > 1 else None
                break
            pos += len(tok)
        diffs.append({"prompt": body["messages"][0]["content"][:60], "margin": margin})
    return equal, diffs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replay", type=int, default=60, help="Greedy requests replayed on the idle server.")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from pyllama_dspark.paths import default_draft, default_target
    from pyllama_dspark.prompts import load_prompts

    prompts = [it.turns[0] for it in load_prompts(limit_per_file=8)]
    n_ctx_slot = 2048
    log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"soak-serve-{os.getpid()}.log")
    srv = ServeProcess(default_target(), default_draft(), log_path, n_slots=4, n_ctx=n_ctx_slot, extra=["-t", "2"])
    load = Load(srv, prompts, n_ctx_slot, a.seed)
    t0 = time.monotonic()
    deadline = t0 + a.minutes * 60
    threads = [threading.Thread(target=load.client, args=(i, deadline), daemon=True) for i in range(a.clients)]
    minutes = []
    try:
        for th in threads:
            th.start()
        while time.monotonic() < deadline:
            time.sleep(min(60, max(0.0, deadline - time.monotonic())))
            slots = srv.get("/slots").json()
            time.sleep(1.5)   # a slot admitted inside a step shows as idle until the step ends: a held
            again = srv.get("/slots").json()   # state must be seen twice, unchanged, to count
            same = {json.dumps(x, sort_keys=True) for x in again}
            slots = [x for x in slots if json.dumps(x, sort_keys=True) in same]
            with load.lock:
                recs = list(load.records)
            row = {"minute": round((time.monotonic() - t0) / 60, 1), "requests": len(recs),
                   "5xx": sum(1 for r in recs if isinstance(r[1], int) and r[1] >= 500),
                   "rss_mib": round(rss_kib(srv.proc.pid) / 1024, 1), "slot_violations": slot_violations(slots),
                   "slots": [s.get("dspark_memory") for s in slots], "n_cached": [s.get("n_cached") for s in slots]}
            minutes.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "slots"}), flush=True)
        for th in threads:
            th.join(600)
        idle_slots = srv.get("/slots").json()
        equal, diffs = replay(srv, load.greedy, a.replay)
        alive = srv.proc.poll() is None
    finally:
        srv.stop()
    recs = load.records
    lat = sorted(r[2] for r in recs if r[1] == 200)
    by_kind = {}
    for kind, status, _ in recs:
        by_kind.setdefault(kind, {}).setdefault(str(status), 0)
        by_kind[kind][str(status)] += 1
    warm = minutes[min(1, len(minutes) - 1)]["rss_mib"] if minutes else 0
    last = minutes[-1]["rss_mib"] if minutes else 0
    summary = {
        "minutes": a.minutes, "clients": a.clients, "requests": len(recs),
        "5xx": sum(1 for r in recs if isinstance(r[1], int) and r[1] >= 500),
        "client_errors": sum(1 for r in recs if isinstance(r[1], str)),
        "by_kind": by_kind,
        "latency_ok_s": {"p50": round(statistics.median(lat), 3) if lat else None,
                         "p95": round(lat[int(0.95 * (len(lat) - 1))], 3) if lat else None},
        "rss_mib": {"after_warmup": warm, "end": last,
                    "growth_pct": round(100 * (last - warm) / warm, 2) if warm else None},
        "slot_violations": sum(len(m["slot_violations"]) for m in minutes) + len(slot_violations(idle_slots)),
        "idle_slots": idle_slots,
        "cache_hits_later_turns": {"n": len(load.cache_hits), "with_cache": sum(1 for c in load.cache_hits if c > 0)},
        "greedy_replay": {"equal": equal, "differ": diffs},
        "server_alive_at_end": alive, "server_log": log_path,
    }
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "minutes": minutes}, f, indent=1)


if __name__ == "__main__":
    main()
