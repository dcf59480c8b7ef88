"""``pyllama-dspark serve`` end to end on the real SmolLM2 target.

One server (-np 2, run once with continuous batching and once with a thread per slot; a DSpark draft with target bigrams planted in its Markov head, so drafts are
really accepted) serves every endpoint, streaming and not, the error paths, a client that hangs up
mid-stream, concurrent requests, the official ``openai`` client and llama.cpp's own SpeedBench
client (``tools/server/bench/speed-bench/speed_bench.py`` of the vendored llama.cpp, imported
unchanged; its Hugging Face dataset is replaced by samples from the benchmark prompts shipped in the package).
A second, draft-less server checks ``--api-key``.  Greedy output is compared with our engine run
directly (no server) on the same prompt: lossless greedy means the text must be identical.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import sys
import time
import types

import pytest

from pyllama_dspark.api import Speculator
from pyllama_dspark.llama_server import parse_draft_acceptance
from pyllama_dspark.prompts import load_prompts
from pyllama_dspark.testing import make_test_draft, plant_markov_bigrams
from serve_helpers import SESSION, ServeProcess, sse_events, sse_json

N_CTX = 1024
N_TOK = 24


@pytest.fixture(scope="module")
def items():
    return load_prompts(limit_per_file=1)  # one prompt of each of the five sets (mt-bench: two turns)


@pytest.fixture(scope="module")
def local(target_path):
    """Our engine without a server: the reference for the server's greedy output."""
    with Speculator(target_path, n_ctx=N_CTX, n_threads=1) as sp:
        yield sp


@pytest.fixture(scope="module")
def bigram_draft(target_path, local, items, tmp_path_factory):
    seqs = []
    for it in items:
        toks = local.chat_prompt([{"role": "user", "content": it.turns[0]}]).tokens
        seqs.append(list(toks) + local.generate(toks, 48).tokens)
    path = tmp_path_factory.mktemp("serve") / "bigram-dspark.gguf"
    make_test_draft(target_path, path, kind="dspark", markov_rank=256, seed=5)
    assert plant_markov_bigrams(path, seqs, drop_every=5) > 20
    return str(path)


@pytest.fixture(scope="module", params=["cont-batching", "no-cont-batching"])
def server(request, target_path, bigram_draft, tmp_path_factory):
    # -np 2: both slots decoded together by one batched decoder (the default), or (-nocb) one
    # thread with its own contexts per slot
    extra = ["-nocb"] if request.param == "no-cont-batching" else []
    srv = ServeProcess(target_path, bigram_draft, tmp_path_factory.mktemp("serve-log") / "serve.log",
                       n_slots=2, n_ctx=N_CTX, extra=extra)
    try:
        yield srv
    finally:
        srv.stop()


def _chat_body(text, **kw):
    body = {"messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": N_TOK}
    body.update(kw)
    return body


def _check_timings(t, usage=None):
    for k in ("prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n", "predicted_ms",
              "predicted_per_token_ms", "predicted_per_second", "draft_n", "draft_n_accepted"):
        assert k in t, k
    assert 0 <= t["draft_n_accepted"] <= t["draft_n"]
    assert t["predicted_n"] >= 1 and t["prompt_n"] >= 1
    if usage is not None:
        assert usage["completion_tokens"] == t["predicted_n"]
        assert usage["prompt_tokens"] == t["prompt_n"]


# ---- plain endpoints -------------------------------------------------------------------------

def test_health_and_models(server):
    r = server.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    m = server.get("/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["object"] == "model"
    assert m["data"][0]["meta"]["draft_kind"] == "dspark" and m["data"][0]["meta"]["n_slots"] == 2
    assert m["data"][0]["meta"]["cont_batching"] == (server.extra == [])


def test_chat_completion_is_greedy_and_carries_timings(server, local):
    text = "Explain the Pythagorean theorem."
    r = server.post("/v1/chat/completions", _chat_body(text))
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion"
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant"
    ref = local.generate(text, N_TOK, chat=True)
    assert msg["content"] == ref.text
    assert out["choices"][0]["finish_reason"] == ref.finish_reason
    _check_timings(out["timings"], out["usage"])
    assert out["timings"]["draft_n"] > 0


def test_chat_stream_equals_non_stream(server):
    body = _chat_body("Write a haiku about rain.")
    full = server.post("/v1/chat/completions", body).json()
    r = server.post("/v1/chat/completions", dict(body, stream=True), stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_json(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == full["choices"][0]["message"]["content"]
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    _check_timings(last["timings"])
    assert all("timings" not in c for c in chunks[:-1])
    assert last["timings"]["predicted_n"] == full["timings"]["predicted_n"]


def test_stream_include_usage(server):
    r = server.post("/v1/chat/completions", _chat_body("Hi", stream=True, stream_options={"include_usage": True}),
                    stream=True)
    events = sse_json(r)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] >= 1
    _check_timings(usage_chunk["timings"], usage_chunk["usage"])


def test_completions_text_and_token_prompts(server, local):
    prompt = "The capital of France is"
    r = server.post("/v1/completions", {"prompt": prompt, "temperature": 0, "max_tokens": 12, "unknown_field": 1})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion"
    ref = local.generate(prompt, 12)
    assert out["choices"][0]["text"] == ref.text
    _check_timings(out["timings"], out["usage"])
    # the same prompt as token ids, streamed
    toks = local.tokenize(prompt)
    r = server.post("/v1/completions", {"prompt": toks, "temperature": 0, "max_tokens": 12, "stream": True},
                    stream=True)
    events = sse_json(r)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == ref.text
    assert events[-2]["choices"][0]["finish_reason"] == ref.finish_reason
    _check_timings(events[-2]["timings"])


def test_stop_strings_and_sampling(server):
    out = server.post("/v1/completions", {"prompt": "1, 2, 3, 4,", "temperature": 0, "max_tokens": 24,
                                          "stop": [" 7"]}).json()
    assert " 7" not in out["choices"][0]["text"] and out["choices"][0]["finish_reason"] == "stop"
    # T > 0 with a seed: deterministic
    body = _chat_body("Name a color.", temperature=0.9, seed=3, top_k=20, top_p=0.9, min_p=0.05)
    a = server.post("/v1/chat/completions", body).json()
    b = server.post("/v1/chat/completions", body).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    _check_timings(a["timings"], a["usage"])


def test_acceptance_logged_like_llama_server(server):
    r = server.post("/v1/chat/completions", _chat_body("Explain the Pythagorean theorem."))
    t = r.json()["timings"]
    deadline = time.monotonic() + 30
    rows = []
    while time.monotonic() < deadline:
        rows = parse_draft_acceptance(server.log_text())  # the parser of llama-server's own log
        if any(x["generated"] == t["draft_n"] and x["accepted"] == t["draft_n_accepted"] for x in rows):
            break
        time.sleep(0.1)
    assert any(x["generated"] == t["draft_n"] and x["accepted"] == t["draft_n_accepted"] for x in rows), rows


# ---- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", "{not json", None),
    ("/v1/chat/completions", "", None),
    ("/v1/chat/completions", "[1, 2]", None),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": 3, "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 2}, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ("/v1/completions", {"prompt": 42}, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 10 ** 9]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, "stop"),
    ("/v1/completions", {}, "prompt"),
])
def test_bad_requests_are_400(server, path, body, param):
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400 and err["message"]
    if param is not None:
        assert err.get("param") == param
    assert server.get("/health").status_code == 200


def test_too_long_prompt_is_400(server, local):
    long_ids = [local.tokenize("hello")[-1]] * (N_CTX + 10)
    for path, body in (("/v1/completions", {"prompt": long_ids, "max_tokens": 4}),
                       ("/v1/chat/completions", _chat_body("hello " * (N_CTX + 10))),
                       ("/v1/chat/completions", _chat_body("hello " * (N_CTX + 10), stream=True))):
        r = server.post(path, body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "exceed_context_size_error"
    ok = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200


def test_unknown_route_and_method(server):
    assert server.get("/v1/nothing").status_code == 404
    assert server.get("/v1/chat/completions").status_code == 405
    assert "error" in server.get("/v1/nothing").json()


def test_disconnect_mid_stream_cancels_and_frees_the_slot(server):
    body = _chat_body("Write a very long story about a dragon.", max_tokens=N_CTX - 100, stream=True,
                      ignore_eos=True)
    r = server.post("/v1/chat/completions", body, stream=True)
    assert r.status_code == 200
    got = 0
    for d in sse_events(r):
        if d != "[DONE]" and (json.loads(d)["choices"][0]["delta"].get("content")):
            got += 1
        if got >= 2:
            break
    r.close()  # hang up mid-stream
    # the log names the task as cancelled and both slots are idle again (bounded wait, not timed)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if "cancelled by the client" in server.log_text() and server.get("/health").json()["slots_processing"] == 0:
            break
        time.sleep(0.2)
    log = server.log_text()
    m = re.findall(r"id\s+\d+ \| task (\d+) \| cancelled by the client", log)
    assert m, log[-3000:]
    task = m[-1]
    # it never ran to completion: no eval-time line for that task
    assert not re.search(rf"task {task} \|\s+eval time", log)
    assert server.get("/health").json()["slots_processing"] == 0
    assert server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0}).status_code == 200


def test_concurrent_requests_on_two_slots(server, local):
    prompts = ["Name three fruits.", "What is 2 + 2?", "Say hello in French.", "Count to five."]
    refs = [local.generate(p, 16, chat=True).text for p in prompts]

    def one(p):
        return server.post("/v1/chat/completions", _chat_body(p, max_tokens=16)).json()

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as ex:
        outs = list(ex.map(one, prompts))
    assert [o["choices"][0]["message"]["content"] for o in outs] == refs
    log = server.log_text()
    assert re.search(r"id\s+0 \| task \d+ \| processing", log) and re.search(r"id\s+1 \| task \d+ \| processing", log)


# ---- clients nobody here wrote ---------------------------------------------------------------

def test_openai_client(server, local):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    text = "Explain the Pythagorean theorem."
    ref = local.generate(text, N_TOK, chat=True)
    resp = client.chat.completions.create(model="anything", messages=[{"role": "user", "content": text}],
                                          temperature=0, max_tokens=N_TOK)
    assert resp.choices[0].message.content == ref.text
    assert resp.usage.completion_tokens == len(ref.tokens)
    timings = (resp.model_extra or {}).get("timings") or getattr(resp, "timings", None)
    assert timings and timings["draft_n"] > 0
    stream = client.chat.completions.create(model="anything", messages=[{"role": "user", "content": text}],
                                            temperature=0, max_tokens=N_TOK, stream=True)
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == ref.text
    comp = client.completions.create(model="anything", prompt="The capital of France is", temperature=0,
                                     max_tokens=8)
    assert comp.choices[0].text == local.generate("The capital of France is", 8).text
    s = client.completions.create(model="anything", prompt="The capital of France is", temperature=0,
                                  max_tokens=8, stream=True)
    assert "".join(c.choices[0].text for c in s) == comp.choices[0].text
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "x"}], max_tokens=-5)
    models = client.models.list()
    assert models.data[0].object == "model"


def _speed_bench_module():
    """llama.cpp's SpeedBench client from the vendored llama.cpp sources, imported unchanged."""
    from pyllama_dspark import llama_server as ls

    ls.ensure_llama_server()  # extracts (and builds from) the llama-cpp-python sdist once
    root = ls.llama_server_cache_dir()
    d = root / "src" / "tools" / "server" / "bench" / "speed-bench"
    if not (d / "speed_bench.py").is_file():
        ls._extract_llama_cpp(ls._locate_sdist(ls.llama_cpp_python_version(), root, None), root / "src")
    assert (d / "speed_bench.py").is_file(), d
    if "datasets" not in sys.modules:
        try:
            import datasets  # noqa: F401
        except ImportError:
            # the Hugging Face hub is out of reach: the dataset loader is never called here, but
            # speed_bench.py imports it at the top
            stub = types.ModuleType("datasets")

            def _no_hub(*a, **k):
                raise RuntimeError("no Hugging Face hub here; samples come from the packaged benchmark prompts")

            stub.get_dataset_config_names = stub.load_dataset = _no_hub
            sys.modules["datasets"] = stub
    sys.path.insert(0, str(d))
    try:
        import speed_bench
    finally:
        sys.path.remove(str(d))
    return speed_bench


def test_speed_bench_client_runs_unchanged(server, items, capsys):
    sb = _speed_bench_module()
    samples = [sb.Sample(id=f"{it.source}-{it.index}", category=it.category, turns=sb.extract_turns({"turns": it.turns}))
               for it in items]
    endpoint = sb.normalize_base_url(server.url) + "/chat/completions"
    extra = sb.parse_extra_inputs('{"temperature":0}')
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as ex:  # = -np 2
        futures = [ex.submit(sb.run_one, s, endpoint, None, N_TOK, extra, 300) for s in samples]
        results = [f.result() for f in futures]
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert any(r.turns == 2 for r in results)  # mt-bench: the second turn carries the first answer
    cats = list(dict.fromkeys(s.category for s in samples))
    summary = [sb.summarize_group(c, [r for r in results if r.category == c]) for c in cats]
    summary.append(sb.summarize_group("overall", results))
    sb.print_table(summary)
    printed = capsys.readouterr().out
    with capsys.disabled():
        print("\nSpeedBench (llama.cpp's client, unchanged) against pyllama-dspark serve:\n" + printed)
    overall = summary[-1]
    assert overall["requests"] == len(samples) and overall["failed"] == 0
    assert overall["draft_n"] > 0 and overall["accept_rate"] is not None
    assert overall["accepted"] > 0  # the planted bigrams are accepted
    assert overall["avg_pred_t_s"] and overall["avg_pred_t_s"] > 0
    assert "accept_rate" in printed and "overall" in printed


# ---- API key ---------------------------------------------------------------------------------

def test_api_key(target_path, tmp_path):
    srv = ServeProcess(target_path, None, tmp_path / "serve-key.log", extra=["--api-key", "sekrit"])
    try:
        assert srv.get("/health").status_code == 200  # public, as in llama-server
        body = _chat_body("Hi", max_tokens=2)
        r = srv.post("/v1/chat/completions", body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert srv.post("/v1/chat/completions", body, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert srv.get("/v1/models").status_code == 401
        ok = srv.post("/v1/chat/completions", body, headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200
        t = ok.json()["timings"]
        assert t["draft_n"] == 0 and t["draft_n_accepted"] == 0
        assert SESSION.get(srv.url + "/v1/models", headers={"X-Api-Key": "sekrit"}, timeout=30).status_code == 200
    finally:
        srv.stop()


def test_scheduled_verification_on_the_batched_server(target_path, bigram_draft, local, tmp_path):
    """``serve -np 2 --conf-min``: the batched decoder cuts each block at the first low confidence;
    greedy output stays the target's own; a bad schedule setting is a clear startup error."""
    srv = ServeProcess(target_path, bigram_draft, tmp_path / "serve-sched.log", n_slots=2, n_ctx=N_CTX,
                       extra=["--conf-min", "0.3"])
    try:
        texts = ["Explain the Pythagorean theorem.", "Name three fruits."]
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as ex:
            outs = list(ex.map(lambda p: srv.post("/v1/chat/completions", _chat_body(p)).json(), texts))
        for p, o in zip(texts, outs):
            assert o["choices"][0]["message"]["content"] == local.generate(p, N_TOK, chat=True).text
            _check_timings(o["timings"], o["usage"])
    finally:
        srv.stop()
    with pytest.raises(RuntimeError, match="needs --conf-min"):
        ServeProcess(target_path, bigram_draft, tmp_path / "serve-bad.log", n_slots=2, n_ctx=N_CTX,
                     extra=["--schedule", "static"], startup_timeout=60)
