"""Replicas behind a real HAProxy: ``deploy/haproxy.cfg`` run by ``deploy/replicas.py``.

Routing first, on two tiny stand-in backends (no model, a second): every routing key of the config
(X-Session-Id, a chat's first user message after a system / developer message or without one,
content parts, a completion's prompt prefix) keeps a conversation on one backend and spreads
conversations over both.  This checks what HAProxy 2.6's ``json_query`` really does.

Then two real ``serve`` replicas (SmolLM2 and the shipped drafter, ``-np 2 -t 1``), one set for the
module, in this order:

* a conversation's turn 2 reuses turn 1's whole prompt from its replica's cache
  (``timings.cache_n``), for conversations that share a system prompt and for ones told apart by
  X-Session-Id only; a round-robin or system-prompt-only key fails this;
* load from four client threads, one replica SIGKILLed while it is generating: requests started
  after the kill all succeed on the survivor, those in flight are retried or end in a clean error
  (5xx, a reset connection, a cut stream), none hangs, and every greedy reply is the one a single
  server gives.  The replicas run ``-nocb`` (a context per slot) with ``cache_prompt: false``: a
  reply then does not depend on which requests run next to it, so "the same as a single server"
  is an exact comparison;
* HAProxy's health checks mark the dead replica DOWN within seconds, its conversations move to
  the survivor, and when it is started again it is marked UP and gets them back.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from pyllama_dspark.paths import default_draft

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed")

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
_spec = importlib.util.spec_from_file_location("dspark_deploy_replicas", DEPLOY / "replicas.py")
replicas = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(replicas)

N_TOK = 10
SYSTEM = {"role": "system", "content": "You are a concise assistant."}
QUESTIONS = ["What is the capital of France?", "Name a red fruit.", "What is 2+2?", "Say hello.",
             "Which planet is largest?", "Give me a color."]
LOAD_QUESTIONS = [f"In one word, what is the opposite of {w}?" for w in
                  ("hot", "up", "big", "fast", "light", "open", "early", "happy", "wet", "loud", "old", "rich",
                   "soft", "full", "left", "near", "high", "thick", "true", "strong", "first", "clean", "hard", "day")]


def _session() -> requests.Session:
    s = requests.Session()
    s.trust_env = False
    return s


def test_config_is_valid_and_templates_n_replicas(tmp_path):
    replicas.check_config(DEPLOY / "haproxy.cfg")
    path = replicas.write_config([("127.0.0.1", 9001), "127.0.0.1:9002", ("127.0.0.1", 9003)], 9000,
                                 tmp_path / "h.cfg", stats_port=9400)
    replicas.check_config(path)
    text = path.read_text()
    assert [ln.split()[1:] for ln in text.splitlines() if ln.strip().startswith("server ")] == \
        [["r1", "127.0.0.1:9001"], ["r2", "127.0.0.1:9002"], ["r3", "127.0.0.1:9003"]]
    assert "bind 127.0.0.1:9000" in text and "bind 127.0.0.1:9400" in text and "bind 127.0.0.1:8080" not in text
    bad = tmp_path / "bad.cfg"
    bad.write_text("global\n")
    with pytest.raises(ValueError, match="markers"):
        replicas.render_config([("127.0.0.1", 9001)], 9000, template=bad)


# ---- routing, on stand-in backends --------------------------------------------------------------

class _Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True   # headers and body are two writes: no 40 ms delayed-ACK stall

    def _send(self):
        body = b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._send()

    def log_message(self, *a):
        pass


class _EchoServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):   # HAProxy's health checks hang up early
        pass


@pytest.fixture(scope="module")
def echo_lb(tmp_path_factory):
    servers = [_EchoServer(("127.0.0.1", 0), _Echo) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    d = tmp_path_factory.mktemp("echo-lb")
    port, stats = replicas.free_port(), replicas.free_port()
    cfg = replicas.write_config([("127.0.0.1", s.server_address[1]) for s in servers], port, d / "h.cfg",
                                stats_port=stats)
    with open(d / "haproxy.log", "wb") as log:
        proc = subprocess.Popen(["haproxy", "-f", str(cfg), "-db"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if replicas.http_get(f"http://127.0.0.1:{port}/health")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (d / "haproxy.log").read_text()
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for s in servers:
            s.shutdown()
            s.server_close()


def test_routing_keys_keep_a_conversation_on_one_backend_and_spread_conversations(echo_lb):
    s = _session()

    def who(path, body, **headers):
        r = s.post(echo_lb + path, data=json.dumps(body), headers={"Content-Type": "application/json", **headers})
        assert r.status_code == 200, r.text
        return r.headers["X-Served-By"]

    def turns(first, path="/v1/chat/completions", **headers):
        """The backends of turns 1..3 of a chat whose leading messages are ``first``."""
        msgs, out = list(first), []
        for t in range(3):
            out.append(who(path, {"messages": msgs, "max_tokens": 8}, **headers))
            msgs += [{"role": "assistant", "content": f"reply {t}"}, {"role": "user", "content": f"more {t}"}]
        return out

    cases = {
        "shared system prompt": [[SYSTEM, {"role": "user", "content": q}] for q in QUESTIONS],
        "developer message": [[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": q}]
                              for q in QUESTIONS],
        "no system message": [[{"role": "user", "content": q}] for q in QUESTIONS],
        "content parts": [[{"role": "user", "content": [{"type": "text", "text": q}]}] for q in QUESTIONS],
        "same question, other system prompts": [[{"role": "system", "content": f"You are assistant {i}."},
                                                 {"role": "user", "content": "Hello!"}] for i in range(8)],
    }
    for name, convs in cases.items():
        seen = [turns(c) for c in convs]
        assert all(len(set(t)) == 1 for t in seen), (name, seen)   # every turn on the first turn's backend
        assert {t[0] for t in seen} == {"r1", "r2"}, (name, seen)  # conversations spread

    # a history longer than tune.bufsize (256 KiB): HAProxy sees a cut body, still routed by its start
    filler = [{"role": "assistant" if k % 2 == 0 else "user", "content": "x" * 1000} for k in range(300)]
    for q in QUESTIONS:
        first = [SYSTEM, {"role": "user", "content": q}]
        assert who("/v1/chat/completions", {"messages": first + filler}) == \
            who("/v1/chat/completions", {"messages": first}), q

    # X-Session-Id wins over the body: one body, many sessions, both backends; each session stays put
    hello = [{"role": "user", "content": "Hello!"}]
    sessions = [turns(hello, **{"X-Session-Id": f"user-{i}"}) for i in range(8)]
    assert all(len(set(t)) == 1 for t in sessions) and {t[0] for t in sessions} == {"r1", "r2"}, sessions

    # completions: the prompt's first 256 bytes (a growing prompt keeps its backend)
    for path in ("/completion", "/v1/completions"):
        bases = [f"Document {i}: " + "lorem ipsum " * 30 for i in range(8)]
        first = [who(path, {"prompt": b, "n_predict": 4}) for b in bases]
        assert [who(path, {"prompt": b + " and a continuation " * 5}) for b in bases] == first
        assert set(first) == {"r1", "r2"}, first


# ---- two real replicas --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reps(target_path, tmp_path_factory):
    args = ["-m", target_path, "-md", default_draft(), "-np", "2", "-nocb", "-t", "1", "-c", "2048", "--temp", "0"]
    with replicas.Replicas(2, args, workdir=tmp_path_factory.mktemp("replicas"), startup_timeout=240) as r:
        yield r


def _chat(s, url, msgs, timeout=(5, 60), **kw):
    headers = kw.pop("headers", {})
    r = s.post(url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": N_TOK, "temperature": 0, **kw},
               headers=headers, timeout=timeout)
    assert r.status_code == 200, r.text
    out = r.json()
    return r.headers.get("X-Served-By"), out["choices"][0]["message"]["content"], out["timings"]


def _wait_idle(reps, name, timeout=30.0):
    """Until replica ``name`` has no slot processing.  A ``-nocb`` slot is released just after its
    reply is delivered, so a next turn sent at once can find its slot still busy and take the other
    one (a cache miss on the right replica; the batched default has no such window)."""
    url = reps.urls[int(name[1:]) - 1] + "/health"
    deadline = time.monotonic() + timeout
    while json.loads(replicas.http_get(url)[1])["slots_processing"] and time.monotonic() < deadline:
        time.sleep(0.01)


def test_later_turns_hit_the_prompt_cache_of_their_replica(reps):
    s = _session()
    convs = [([SYSTEM, {"role": "user", "content": q}], {}) for q in QUESTIONS]
    convs += [([{"role": "user", "content": "Hello!"}], {"X-Session-Id": f"conv-{i}"}) for i in range(4)]
    served = []
    for msgs, headers in convs:   # one conversation at a time: its slot still holds its last turn
        msgs = list(msgs)
        where, prev_prompt = [], None
        for t in range(2):
            srv, reply, tm = _chat(s, reps.url, msgs, headers=headers)
            where.append(srv)
            if prev_prompt is not None:   # turn 1's whole prompt (and more) came from the cache
                assert tm["cache_n"] >= prev_prompt, (msgs, headers, where, tm, prev_prompt)
            prev_prompt = tm["cache_n"] + tm["prompt_n"]
            msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Tell me more."}]
            _wait_idle(reps, srv)
        assert where[0] == where[1], (msgs, headers, where)
        served.append(where[0])
    assert set(served[:len(QUESTIONS)]) == {"r1", "r2"}, served   # a shared system prompt does not pin
    assert set(served[len(QUESTIONS):]) == {"r1", "r2"}, served   # sessions spread the same first message


def _one_request(url, i, timeout):
    """One load request (every third streamed): its times, outcome and reply."""
    body = {"messages": [{"role": "user", "content": LOAD_QUESTIONS[i]}], "max_tokens": N_TOK, "temperature": 0,
            "cache_prompt": False, "stream": i % 3 == 2}
    rec = {"i": i, "stream": body["stream"], "t0": time.monotonic()}
    s = _session()
    try:
        r = s.post(url + "/v1/chat/completions", json=body, timeout=timeout, stream=body["stream"])
        rec["status"], rec["srv"] = r.status_code, r.headers.get("X-Served-By")
        if r.status_code != 200:
            rec["outcome"] = "http-error"
        elif not body["stream"]:
            rec["reply"], rec["outcome"] = r.json()["choices"][0]["message"]["content"], "ok"
        else:
            parts, done = [], False
            for line in r.iter_lines(decode_unicode=True):
                if line.startswith("data:"):
                    d = line[5:].strip()
                    if d == "[DONE]":
                        done = True
                        break
                    for c in json.loads(d)["choices"]:
                        parts.append(c["delta"].get("content") or "")
            rec["reply"], rec["outcome"] = "".join(parts), "ok" if done else "cut-stream"
    except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:
        rec["outcome"], rec["error"] = "connection-error", type(e).__name__
    except requests.Timeout as e:   # the one outcome that fails the test: something hung
        rec["outcome"], rec["error"] = "timeout", repr(e)
    rec["t1"] = time.monotonic()
    return rec


@pytest.fixture(scope="module")
def kill_run(reps):
    """Single-server references first (r1 directly, one request at a time), then the load through
    HAProxy with r2 SIGKILLed while it is generating."""
    s = _session()
    refs = [_chat(s, reps.urls[0], [{"role": "user", "content": q}], cache_prompt=False)[1] for q in LOAD_QUESTIONS]
    bound = 90.0
    with ThreadPoolExecutor(4) as pool, ThreadPoolExecutor(1) as watch:
        futs = [pool.submit(_one_request, reps.url, i, (5, bound)) for i in range(len(LOAD_QUESTIONS))]
        deadline = time.monotonic() + 120
        while True:   # kill once r2 has answered, some requests are done and r2 is generating
            done = [f.result() for f in futs if f.done()]
            h = json.loads(replicas.http_get(reps.urls[1] + "/health")[1])
            if (len(done) >= 4 and any(r.get("srv") == "r2" for r in done) and h["slots_processing"] > 0) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        t_kill = time.monotonic()
        reps.kill(1)
        down = watch.submit(reps.wait_status, "r2", "DOWN", 30)   # polled from now on
        # at once, most likely before any health check noticed: a request whose key is r2's
        up_at_probe = reps.server_status()["r2"] == "UP"
        probe = _one_request(reps.url, next(r["i"] for r in done if r.get("srv") == "r2"), (5, bound))
        t_down = t_kill + down.result(timeout=60)
        recs = [f.result(timeout=bound + 30) for f in futs]   # a hang fails here, not in CI's timeout
    return {"refs": refs, "recs": recs, "t_kill": t_kill, "t_down": t_down, "busy": h["slots_processing"],
            "done_before": len(done), "probe": probe, "up_at_probe": up_at_probe}


def test_killing_a_replica_under_load(reps, kill_run):
    refs, recs, t_kill = kill_run["refs"], kill_run["recs"], kill_run["t_kill"]
    after = [r for r in recs if r["t0"] > t_kill]
    in_flight = [r for r in recs if r["t0"] <= t_kill < r["t1"]]
    retried = len(re.findall(r" \d+/\d+/\d+/\d+/\+\d+ ", (reps.workdir / "haproxy.log").read_text()))
    print(f"\nkilled r2 with {kill_run['busy']} slot(s) generating, {kill_run['done_before']} requests done; "
          f"in flight (i, outcome, replica): {[(r['i'], r['outcome'], r.get('srv')) for r in in_flight]}; "
          f"started after: {len(after)}, outcomes {sorted({r['outcome'] for r in after})}; "
          f"requests HAProxy retried on r1: {retried}; r2 still UP in HAProxy at the probe: "
          f"{kill_run['up_at_probe']}")
    assert kill_run["busy"] > 0 and kill_run["done_before"] >= 4, "the kill did not happen under load"
    assert in_flight and len(after) >= 8
    assert not [r for r in recs if r["outcome"] == "timeout"], "a request hung"
    assert max(r["t1"] - r["t0"] for r in recs) < 60
    for r in recs:   # every request: the right reply, or (in flight only) a clean error
        if r["outcome"] == "ok":
            assert r["reply"] == refs[r["i"]], (r, refs[r["i"]])
        else:
            assert r in in_flight and (r["outcome"] != "http-error" or r["status"] in (502, 503, 504)), r
    assert all(r["outcome"] == "ok" and r["srv"] == "r1" for r in after), after
    # a request with r2's key sent right after the kill: retried on r1 (redispatch)
    probe = kill_run["probe"]
    assert probe["outcome"] == "ok" and probe["srv"] == "r1" and probe["reply"] == refs[probe["i"]], probe
    assert any(r.get("srv") == "r2" for r in recs if r["t1"] < t_kill)   # r2 served before the kill


def test_health_checks_mark_the_dead_replica_down_and_back_up(reps, kill_run):
    took = kill_run["t_down"] - kill_run["t_kill"]
    print(f"\nHAProxy had marked r2 DOWN {took:.1f} s after the kill")
    assert took < 8   # fall 2 x inter 1 s, plus a check that may be in flight
    assert reps.server_status() == {"r1": "UP", "r2": "DOWN"}
    s = _session()
    moved = [i for i, r in enumerate(kill_run["recs"]) if r.get("srv") == "r2" and r["t1"] < kill_run["t_kill"]]
    assert moved
    for i in moved[:3]:   # r2's conversations now go to r1
        assert _chat(s, reps.url, [{"role": "user", "content": LOAD_QUESTIONS[i]}])[0] == "r1"

    # started again on its port (what a supervisor does): UP after `rise` checks, its keys come back
    port = reps.ports[1]
    reps.procs[1] = replicas._spawn(reps.serve_cmd(port), reps.workdir / "r2-restarted.log", reps.env)
    reps.wait_status("r2", "UP", timeout=240)
    for i in moved[:3]:
        assert _chat(s, reps.url, [{"role": "user", "content": LOAD_QUESTIONS[i]}])[0] == "r2"
