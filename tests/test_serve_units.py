"""Pure parts of ``serve``: request checks, response dicts, timings, and the slot queue (fake engines)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from pyllama_dspark import openai_format as fmt
from pyllama_dspark.engine import Done, Stats
from pyllama_dspark.oai_request import RequestError, parse_request
from pyllama_dspark.slots import Cancelled, Job, SlotPool
from pyllama_dspark.timings import llama_timings, timing_log_lines
from pyllama_dspark.llama_server import parse_draft_acceptance


def test_parse_chat_request_fields():
    r = parse_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}],
                       "max_completion_tokens": 5, "temperature": 0, "top_k": 1, "seed": 3.0, "stop": "x",
                       "stream": True, "stream_options": {"include_usage": True}, "whatever": {"x": 1}}, "chat")
    assert r.messages == [{"role": "user", "content": "ab"}]
    assert r.max_tokens == 5 and r.stop == ["x"] and r.stream and r.include_usage
    assert r.sampling == {"temperature": 0, "top_k": 1, "seed": 3}
    assert parse_request({"prompt": [1, 2, 3]}, "completion").prompt == [1, 2, 3]
    assert parse_request({"prompt": ["hi"]}, "completion").prompt == "hi"
    assert parse_request({"prompt": "hi", "n_predict": -1}, "completion").max_tokens == -1


@pytest.mark.parametrize("body,kind,param", [
    (None, "chat", None), ([], "chat", None), ({"messages": [{"content": "x"}]}, "chat", "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "chat", "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "chat", "messages"),
    ({"prompt": "x", "max_tokens": 0}, "completion", "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "completion", "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "completion", "temperature"),
    ({"prompt": "x", "min_p": float("nan")}, "completion", "min_p"),
    ({"prompt": "x", "seed": 1.5}, "completion", "seed"),
    ({"prompt": ["a", "b"]}, "completion", "prompt"),
    ({"prompt": "x", "stream_options": 1}, "completion", "stream_options"),
    ({"prompt": "x", "model": 3}, "completion", "model"),
])
def test_parse_rejects(body, kind, param):
    with pytest.raises(RequestError) as e:
        parse_request(body, kind)
    assert e.value.code == 400 and e.value.param == param


def _stats():
    s = Stats(n_prompt=10, n_generated=8, ms_prefill=20.0, ms_total=400.0)
    s.record(7, 3)
    s.record(7, 0)
    return s


def test_timings_and_log_lines_match_llama_server():
    t = llama_timings(_stats())
    assert t["prompt_per_second"] == pytest.approx(500.0) and t["prompt_per_token_ms"] == pytest.approx(2.0)
    assert t["predicted_per_second"] == pytest.approx(20.0) and t["predicted_per_token_ms"] == pytest.approx(50.0)
    assert (t["draft_n"], t["draft_n_accepted"]) == (14, 3)
    rows = parse_draft_acceptance("\n".join(timing_log_lines(1, 42, _stats())))
    assert rows == [{"slot": 1, "task": 42, "ratio": pytest.approx(3 / 14, abs=1e-5), "accepted": 3, "generated": 14}]
    assert "mean len =  2.50" in "\n".join(timing_log_lines(0, 0, _stats()))


def test_response_dicts():
    c = fmt.chat_completion("chatcmpl-x", "m", "hi", "stop", 3, 2, {"draft_n": 0})
    assert c["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert c["usage"] == {"completion_tokens": 2, "prompt_tokens": 3, "total_tokens": 5} and "timings" in c
    k = fmt.chat_chunk("chatcmpl-x", "m", 1, {"content": "h"})
    assert k["object"] == "chat.completion.chunk" and "timings" not in k
    assert fmt.error_body("bad", code=400) == {"error": {"code": 400, "message": "bad", "type": "invalid_request_error"}}


class _FakeSp:
    """Yields n chunks (or raises), like Speculator.stream."""

    def __init__(self):
        self.closed = False
        self.gate = threading.Event()

    def stream(self, toks, n, **kw):
        if toks == [666]:
            raise ValueError("boom")
        if toks == [7]:
            self.gate.wait(30)
        for i in range(n):
            yield SimpleNamespace(tokens=[i], text=str(i))
        yield Done(list(range(n)), "".join(map(str, range(n))), "length", _stats())

    def close(self):
        self.closed = True


def _collect():
    evs, done = [], threading.Event()

    def on(ev):
        evs.append(ev)
        if isinstance(ev, (Done, BaseException)):
            done.set()
    return evs, done, on


def test_slot_queue_errors_and_cancellation():
    sps = []
    pool = SlotPool(lambda i: sps.append(_FakeSp()) or sps[-1], 1)
    try:
        # an error is delivered and the slot keeps serving
        e1, d1, on1 = _collect()
        pool.submit(Job([666], 3, on1))
        assert d1.wait(30) and isinstance(e1[-1], ValueError)
        # a job queued behind a busy slot and cancelled before it starts never runs
        blocker_ev, blocker_done, on_b = _collect()
        pool.submit(Job([7], 2, on_b))
        e2, d2, on2 = _collect()
        j2 = pool.submit(Job([1], 3, on2))
        j2.cancel()
        sps[0].gate.set()
        assert blocker_done.wait(30) and isinstance(blocker_ev[-1], Done)
        assert d2.wait(30) and len(e2) == 1 and isinstance(e2[0], Cancelled)
        e3, d3, on3 = _collect()
        pool.submit(Job([1], 4, on3))
        assert d3.wait(30) and isinstance(e3[-1], Done) and e3[-1].text == "0123"
        assert pool.n_cancelled == 1 and pool.n_done == 2
    finally:
        pool.close()
    assert sps[0].closed
    with pytest.raises(RuntimeError):
        pool.submit(Job([1], 1, lambda ev: None))
    with pytest.raises(ValueError):
        SlotPool(lambda i: _FakeSp(), 0)


def test_slot_pool_close_does_not_free_a_slot_still_decoding():
    sps = []
    pool = SlotPool(lambda i: sps.append(_FakeSp()) or sps[-1], 1)
    stuck_ev, stuck_done, on_s = _collect()
    pool.submit(Job([7], 2, on_s))              # waits on the gate inside the "decode"
    queued_ev, queued_done, on_q = _collect()
    pool.submit(Job([1], 2, on_q))
    for _ in range(100):
        if pool.n_busy:
            break
        time.sleep(0.01)
    pool.close(timeout=0.3)
    assert not sps[0].closed                   # freeing it now would pull the context from under the decode
    assert queued_done.wait(5) and isinstance(queued_ev[-1], Cancelled)
    sps[0].gate.set()
    assert stuck_done.wait(30) and isinstance(stuck_ev[-1], Cancelled)


def test_submit_racing_close_never_loses_a_job():
    for _ in range(5):
        pool = SlotPool(lambda i: _FakeSp(), 2)
        accepted, refused, lock = [], [], threading.Lock()

        def client(k):
            for i in range(40):
                evs, done, on = _collect()
                try:
                    pool.submit(Job([1], 2, on))
                except RuntimeError:
                    with lock:
                        refused.append(k)
                    return
                with lock:
                    accepted.append(done)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.005)
        pool.close()
        for t in threads:
            t.join()
        # every accepted job ends (done or cancelled), none is left in a drained queue
        assert all(d.wait(10) for d in accepted), sum(not d.is_set() for d in accepted)
