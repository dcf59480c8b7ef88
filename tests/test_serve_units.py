"""Pure parts of ``serve``: request checks, response dicts, timings, and the slot queue (fake engines)."""

from __future__ import annotations

import re
import threading
import time
from types import SimpleNamespace

import pytest

from pyllama_dspark.serve import openai_format as fmt
from pyllama_dspark.decode.cycle import Done, Stats
from pyllama_dspark.serve.oai_request import RequestError, parse_request
from pyllama_dspark.decode.cycle import Started
from pyllama_dspark.serve.slots import Cancelled, Job, SlotPool
from pyllama_dspark.decode.timings import llama_timings, timing_log_lines
from pyllama_dspark.upstream.llama_server_log import parse_draft_acceptance


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
    # llama-server looks n_predict up first, then max_completion_tokens, then max_tokens
    assert parse_request({"prompt": "hi", "max_tokens": 3, "n_predict": 7}, "completion").max_tokens == 7
    assert parse_request({"prompt": "hi", "max_tokens": 3, "max_completion_tokens": 5}, "native").max_tokens == 5


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
    ({"prompt": "x", "grammar": 5}, "completion", "grammar"),
    ({"prompt": "x", "logprobs": "yes"}, "completion", "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, "chat", "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "chat", "top_logprobs"),
    ({"prompt": "x", "logit_bias": {"5": "down"}}, "native", "logit_bias"),
    ({"prompt": "x", "cache_prompt": "yes"}, "native", "cache_prompt"),
    ({"prompt": "x", "json_schema": "object"}, "native", "json_schema"),
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
    assert c["usage"] == {"completion_tokens": 2, "prompt_tokens": 3, "total_tokens": 5,
                          "prompt_tokens_details": {"cached_tokens": 0}} and "timings" in c
    assert "logprobs" not in c["choices"][0]                     # llama-server: only when there are some
    c = fmt.chat_completion("chatcmpl-x", "m", "hi", "stop", 3, 2, n_cached=2, logprobs=[{"id": 1}])
    assert c["usage"]["prompt_tokens_details"] == {"cached_tokens": 2} and c["usage"]["prompt_tokens"] == 3
    assert c["choices"][0]["logprobs"] == {"content": [{"id": 1}]}
    t = fmt.text_completion("cmpl-x", "m", "hi", "length", 3, 2)
    assert t["choices"][0]["logprobs"] is None                   # OpenAI's default: null
    t = fmt.text_completion("cmpl-x", "m", "hi", "length", 3, 2, logprobs=[{"id": 1}])
    assert t["choices"][0]["logprobs"] == {"content": [{"id": 1}]}   # llama-server's form, not tokens/token_logprobs
    k = fmt.chat_chunk("chatcmpl-x", "m", 1, {"content": "h"}, logprobs=[{"id": 1}])
    assert k["choices"][0]["logprobs"] == {"content": [{"id": 1}]}
    assert fmt.text_chunk("cmpl-x", "m", 1, "h")["choices"][0]["logprobs"] is None
    k = fmt.chat_chunk("chatcmpl-x", "m", 1, {"content": "h"})
    assert k["object"] == "chat.completion.chunk" and "timings" not in k
    assert fmt.error_body("bad", code=400) == {"error": {"code": 400, "message": "bad", "type": "invalid_request_error"}}


class _FakeSp:
    """Yields n chunks (or raises), like Speculator.stream."""

    def __init__(self):
        self.closed = False
        self.gate = threading.Event()
        self.entered = threading.Event()   # set once a [7] job is inside its "decode", held at the gate

    def stream(self, toks, n, **kw):
        if toks == [666]:
            raise ValueError("boom")
        if toks == [7]:
            self.entered.set()
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
    # the worker is inside the decode, held at the gate that only this test opens: no sleeps, no
    # timing; close() cannot see it finish within any timeout (0: do not wait at all)
    assert sps[0].entered.wait(30) and pool.n_busy == 1
    pool.close(timeout=0.0)
    assert not sps[0].closed                   # freeing it now would pull the context from under the decode
    assert queued_done.is_set() and isinstance(queued_ev[-1], Cancelled)   # told within close()
    assert not stuck_done.is_set()
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


# ---- the batched pool (serve -np N, the default mode) over a scripted decoder ---------------------

class _FakeBatchDecoder:
    """Scripted stand-in for the loop (Decoder) (the pool's own logic is under test, not decoding): each
    request emits the tokens 0, 1, ... one per step; at most ``n_slots`` run at once, the rest wait
    in order.  With ``hold`` set, every step announces itself on ``entered`` and then waits for a
    ``ticket``: the test decides when each step runs, so nothing depends on timing."""

    n_slots = 2
    n_ctx_seq = 64
    instances = []

    def __init__(self, target, proposer, *, n_max, policy=None, streaming=False, keep_memory=False, slot_similarity=0.1, **prompt_cache):
        assert streaming, "the pool consumes events"
        self.queue, self.active, self.events = [], [], []
        self.free = list(range(self.n_slots))[::-1]
        self.next_rid = 0
        self.submitted, self.cancelled = [], []
        self.fail_next = None
        self.hold = False
        self.entered, self.tickets = threading.Semaphore(0), threading.Semaphore(0)
        _FakeBatchDecoder.instances.append(self)

    def submit(self, prompt, max_tokens, stop=(), *, sampling=None, ignore_eos=False, **request):
        if list(prompt) == [666]:
            raise ValueError("bad prompt")
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        self.queue.append({"rid": rid, "n": int(max_tokens), "out": []})
        self.submitted.append(list(prompt))
        return rid

    def cancel(self, rid):
        self.cancelled.append(rid)
        for lst in (self.queue, self.active):
            for s in lst:
                if s["rid"] == rid:
                    lst.remove(s)
                    if "slot" in s:
                        self.free.append(s["slot"])
                    return True
        return False

    def pending(self):
        return len(self.queue) + len(self.active)

    def step(self):
        if self.hold:
            self.entered.release()
            assert self.tickets.acquire(timeout=30), "the test never let this step run"
        if self.fail_next is not None:
            e, self.fail_next = self.fail_next, None
            raise e
        while self.queue and self.free:
            s = self.queue.pop(0)
            s["slot"] = self.free.pop()
            self.active.append(s)
            self.events.append((s["rid"], Started(s["slot"])))
        for s in list(self.active):
            t = len(s["out"])
            s["out"].append(t)
            self.events.append((s["rid"], SimpleNamespace(tokens=[t], text=str(t))))
            if len(s["out"]) >= s["n"]:
                self.active.remove(s)
                self.free.append(s["slot"])
                self.events.append((s["rid"], Done(s["out"], "".join(map(str, s["out"])), "length", _stats())))

    def poll(self):
        ev, self.events = self.events, []
        return ev

    def release(self):
        """Let every step run freely from now on."""
        self.hold = False
        for _ in range(1000):
            self.tickets.release()


@pytest.fixture
def batched(monkeypatch):
    """A BatchedPool over the scripted decoder; yields (pool, fake speculator, decoder)."""
    import pyllama_dspark.decode.loop as loop_mod
    from pyllama_dspark.serve.batch_pool import BatchedPool

    monkeypatch.setattr(loop_mod, "Decoder", _FakeBatchDecoder)
    _FakeBatchDecoder.instances = []
    sp = SimpleNamespace(target=object(), proposer=None, draft=None, closed=False)
    sp.close = lambda: setattr(sp, "closed", True)
    pool = BatchedPool(sp, n_max=4)
    (bd,) = _FakeBatchDecoder.instances
    yield pool, sp, bd
    bd.release()
    pool.close()


def _finished(*dones):
    return all(d.wait(30) for d in dones)


def test_batched_pool_streams_events_and_frees_slots(batched, caplog):
    pool, sp, bd = batched
    caplog.set_level("INFO", logger="pyllama_dspark.serve.server")
    assert pool.n_slots == 2 and pool.n_ctx == 64 and pool.front is sp
    runs = [_collect() for _ in range(3)]
    jobs = [pool.submit(Job([1, 2], n, on)) for n, (_, _, on) in zip((3, 5, 2), runs)]
    assert _finished(*(d for _, d, _ in runs))
    for (evs, _, _), n in zip(runs, (3, 5, 2)):
        assert [e.text for e in evs[:-1]] == [str(i) for i in range(n)]     # one chunk per step, in order
        assert isinstance(evs[-1], Done) and evs[-1].tokens == list(range(n))
    # two slots: the third request waited and got the slot the first one left
    assert jobs[0].slot != jobs[1].slot and jobs[2].slot == jobs[0].slot
    assert pool.n_done == 3 and pool.n_cancelled == 0 and pool.n_busy == 0
    # llama-server's log lines, per task: launch, draft acceptance, release
    rows = parse_draft_acceptance(caplog.text)
    for j in jobs:
        assert re.search(rf"id\s+{j.slot} \| task {j.task_id} \| processing task \(2 prompt tokens\)", caplog.text)
        assert any(r["task"] == j.task_id and r["slot"] == j.slot for r in rows)
        assert re.search(rf"id\s+{j.slot} \| task {j.task_id} \| stop processing", caplog.text)


def _steps_until(bd, cond):
    """Run held steps one by one until cond() holds between two steps; the worker is then inside
    the next step, waiting for its ticket."""
    assert bd.entered.acquire(timeout=30)
    while not cond():
        bd.tickets.release()
        assert bd.entered.acquire(timeout=30)


def test_batched_pool_cancels_one_job_and_keeps_the_other(batched, caplog):
    pool, sp, bd = batched
    caplog.set_level("INFO", logger="pyllama_dspark.serve.server")
    bd.hold = True
    e_keep, d_keep, on_keep = _collect()
    e_gone, d_gone, on_gone = _collect()
    j_keep = pool.submit(Job([1], 8, on_keep))
    j_gone = pool.submit(Job([2], 50, on_gone))
    _steps_until(bd, lambda: len(e_gone) >= 2)     # both decode in the same steps
    assert not d_keep.is_set() and pool.n_busy == 2
    j_gone.cancel()                                # the client went away during a step
    bd.release()
    assert _finished(d_gone, d_keep)
    assert isinstance(e_gone[-1], Cancelled) and not any(isinstance(e, Done) for e in e_gone)
    assert isinstance(e_keep[-1], Done) and e_keep[-1].tokens == list(range(8))
    assert [e.text for e in e_keep[:-1]] == [str(i) for i in range(8)]   # nothing lost or repeated
    assert bd.cancelled == [1]                     # the decoder dropped it, by request id
    assert pool.n_cancelled == 1 and pool.n_done == 1 and pool.n_busy == 0
    assert f"task {j_gone.task_id} | cancelled by the client" in caplog.text
    assert f"task {j_keep.task_id} | cancelled" not in caplog.text
    # the freed slot serves the next request
    e3, d3, on3 = _collect()
    pool.submit(Job([3], 2, on3))
    assert _finished(d3) and isinstance(e3[-1], Done)


def test_batched_pool_job_cancelled_while_queued_never_reaches_the_decoder(batched):
    pool, sp, bd = batched
    bd.hold = True
    e1, d1, on1 = _collect()
    pool.submit(Job([1], 2, on1))
    assert bd.entered.acquire(timeout=30)          # the worker is inside a step with the first job
    e2, d2, on2 = _collect()
    pool.submit(Job([2], 2, on2)).cancel()
    bd.release()
    assert _finished(d1, d2)
    assert isinstance(e1[-1], Done) and len(e2) == 1 and isinstance(e2[0], Cancelled)
    assert bd.submitted == [[1]] and bd.cancelled == []
    assert pool.n_cancelled == 1 and pool.n_done == 1


def test_batched_pool_bad_request_and_failed_step_do_not_stop_it(batched):
    pool, sp, bd = batched
    e1, d1, on1 = _collect()
    pool.submit(Job([666], 2, on1))                 # refused by the decoder's checks
    assert _finished(d1) and isinstance(e1[-1], ValueError)
    bd.hold = True
    bd.fail_next = RuntimeError("decode failed")
    e2, d2, on2 = _collect()
    pool.submit(Job([1], 3, on2))
    assert bd.entered.acquire(timeout=30)
    bd.release()                                   # that step raises: its job gets the error
    assert _finished(d2) and isinstance(e2[-1], RuntimeError) and "decode failed" in str(e2[-1])
    e3, d3, on3 = _collect()
    pool.submit(Job([2], 3, on3))
    assert _finished(d3) and isinstance(e3[-1], Done) and e3[-1].tokens == [0, 1, 2]
    assert pool.n_done == 1 and not sp.closed


def test_batched_pool_close_waits_for_the_step_and_answers_everyone(batched, caplog):
    pool, sp, bd = batched
    caplog.set_level("INFO", logger="pyllama_dspark.serve.server")
    bd.hold = True
    runs = [_collect() for _ in range(3)]          # two running, one waiting for a slot
    jobs = [pool.submit(Job([k], 50, on)) for k, (_, _, on) in enumerate(runs)]
    _steps_until(bd, lambda: all(j.slot >= 0 for j in jobs[:2]))
    closer = threading.Thread(target=pool.close)
    closer.start()
    closer.join(timeout=0.2)
    # the worker is inside a decode step: the contexts must not be freed under it
    assert closer.is_alive() and not sp.closed
    with pytest.raises(RuntimeError):
        pool.submit(Job([9], 1, lambda ev: None))   # no new work once closing
    bd.release()
    closer.join(timeout=30)
    assert not closer.is_alive() and sp.closed
    for evs, done, _ in runs:
        assert done.is_set() and isinstance(evs[-1], Cancelled) and "shutting down" in str(evs[-1])
    assert pool.n_cancelled == 3 and pool.n_done == 0
    assert "cancelled: server shutting down" in caplog.text
    pool.close()                                   # a second close is a no-op


def test_batched_pool_submit_racing_close_never_loses_a_job(monkeypatch):
    import pyllama_dspark.decode.loop as loop_mod
    from pyllama_dspark.serve.batch_pool import BatchedPool

    monkeypatch.setattr(loop_mod, "Decoder", _FakeBatchDecoder)
    for _ in range(5):
        sp = SimpleNamespace(target=object(), proposer=None, draft=None, close=lambda: None)
        pool = BatchedPool(sp, n_max=4)
        accepted, lock = [], threading.Lock()
        go = threading.Barrier(5)

        def client():
            go.wait()
            for i in range(40):
                evs, done, on = _collect()
                try:
                    pool.submit(Job([1], 2, on))
                except RuntimeError:
                    return
                with lock:
                    accepted.append(done)

        threads = [threading.Thread(target=client) for _ in range(4)]
        for t in threads:
            t.start()
        go.wait()
        pool.close()
        for t in threads:
            t.join()
        assert all(d.wait(10) for d in accepted), sum(not d.is_set() for d in accepted)
