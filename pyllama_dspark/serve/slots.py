"""Server slots: N generation workers, each owning a Speculator, fed from one FIFO queue.

llama-server's ``-np N`` gives N slots; a request waits in the queue until a slot is free.  Here a
slot is a thread with its own target + draft contexts (the GGUF weights are memory-mapped, so the
N copies share the model pages).  llama.cpp calls release the GIL, so the slots really decode
concurrently.  This is ``serve -np N -nocb``; by default N > 1 slots are decoded together by one
batched decoder behind the same interface (:class:`~.batch_pool.BatchedPool`).

Each slot keeps its memories between requests (the prompt cache): a dispatcher hands the next
queued job to the free slot whose memories share the largest part of its prompt, by llama-server's
rule (:func:`~pyllama_dspark.decode.prompt_cache.pick_slot`), and the slot decodes only what they
lack (``Job.cache_prompt``).

A :class:`Job` carries a cancel flag (a client that went away): a queued job is dropped when a slot
takes it, a running one stops at the next cycle boundary, and the slot is free again.  Events
(``Chunk``, ``Done``, or an exception) reach the caller through ``job.on_event`` from the worker
thread; the server forwards them into its event loop.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

from pyllama_dspark.decode.cycle import Done
from pyllama_dspark.decode.prompt_cache import CTX_CHECKPOINTS, SLOT_PROMPT_SIMILARITY, pick_slot
from pyllama_dspark.decode.timings import timing_log_lines

log = logging.getLogger("pyllama_dspark.serve.server")


class Cancelled(Exception):
    """The job was cancelled before it finished (the client disconnected)."""


@dataclass
class Job:
    prompt_tokens: List[int]
    max_tokens: int
    on_event: Callable[[Any], None]
    stop: Sequence[str] = ()
    sampling: Any = None
    ignore_eos: bool = False
    grammar: Any = None                    # GBNF text (json_schema / response_format converted) or a Grammar
    logit_bias: Optional[dict] = None      # token id -> bias (-inf: never drawn), ids already checked
    n_probs: int = 0                       # > 0: TokenProb per generated token (Chunk.probs / Done.probs)
    post_sampling_probs: bool = False      # probabilities after the sampler chain instead of the raw softmax
    cache_prompt: bool = True              # reuse what the slot's memories hold of the prompt
    reply: Any = None                      # a chat request with tools: its tool_serving.ToolReply
    n_max: Optional[int] = None            # this request's draft block (None: the server's; 0: no draft)
    trace: bool = False                    # streamed chunks carry the cycle trace and the timings so far
    task_id: int = -1
    slot: int = -1
    cancel_event: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancel_event.set()

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()


def memory_ranges(sp, seq: int) -> dict:
    """[smallest, largest] position the target's and the draft's memories hold for ``seq``
    (llama.cpp's ``llama_memory_seq_pos_min`` / ``_max``; [-1, -1]: none): read on the slot's own
    worker thread when a request ends, never under a running decode."""
    target, draft = getattr(sp, "target", None), getattr(sp, "draft", None)
    if not hasattr(target, "seq_pos_range"):   # a stand-in generator (tests) has no memories
        return None
    return {"target": target.seq_pos_range(seq), "draft": draft.seq_pos_range(seq) if draft is not None else None}


class JobQueue:
    """What every pool shares: the FIFO of jobs, task ids, counters and the lock over them."""

    store = None   # the RAM prompt cache (llama.prompt_state.PromptStore), if any

    def store_info(self) -> Optional[dict]:
        """The RAM prompt cache's counts (``--cache-ram``; None when it is off)."""
        return None if self.store is None else self.store.info()

    def _init_jobs(self) -> None:
        self._queue: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._task_ids = itertools.count()
        self._lock = threading.Lock()
        self.n_done = 0
        self.n_cancelled = 0
        self._closed = False
        self._close_done = threading.Event()
        # per slot: the positions its memories held when its last request ended (GET /slots)
        self.memory: dict = {}

    @property
    def n_queued(self) -> int:
        return self._queue.qsize()

    def submit(self, job: Job) -> Job:
        # under the lock: a job is either queued before close() drains the queue, or refused
        with self._lock:
            if self._closed:
                raise RuntimeError("the slot pool is closed")
            job.task_id = next(self._task_ids)
            self._queue.put(job)
        return job

    def _mark_closed(self) -> bool:
        """Refuse new jobs from now on; True for the call that closes the pool (it calls
        :meth:`_closed_now` when done).  Any later call waits until that close is over, so that
        nobody frees what the pool uses while it is still being shut down."""
        with self._lock:
            first = not self._closed
            self._closed = True
        if not first:
            self._close_done.wait()
        return first

    def _closed_now(self) -> None:
        self._close_done.set()

    def _count(self, cancelled: bool = False) -> None:
        with self._lock:
            if cancelled:
                self.n_cancelled += 1
            else:
                self.n_done += 1

    def _cancel_queued(self) -> None:
        """Every job still in the queue is cancelled and told so (shutdown); sentinels are dropped."""
        pending = []
        while True:
            try:
                j = self._queue.get_nowait()
            except queue.Empty:
                break
            if j is not None:
                j.cancel()
                pending.append(j)
        for j in pending:
            _deliver(j, Cancelled("server shutting down"))


class SlotPool(JobQueue):
    """``n_slots`` workers over Speculators made by ``factory(slot_index)``."""

    def __init__(self, factory: Callable[[int], Any], n_slots: int = 1,
                 slot_similarity: float = SLOT_PROMPT_SIMILARITY, store=None, n_checkpoints: int = CTX_CHECKPOINTS):
        if int(n_slots) < 1:
            raise ValueError(f"the number of slots must be >= 1, got {n_slots}")
        self.speculators: List[Any] = []
        try:
            for i in range(int(n_slots)):
                self.speculators.append(factory(i))
        except BaseException:
            for sp in self.speculators:
                sp.close()
            raise
        self.store = store   # one RAM prompt cache that every slot's decoder saves to and restores from
        for sp in self.speculators:
            dec = getattr(sp, "decoder", None)
            if dec is not None and hasattr(dec, "loop"):
                dec.store = store
                dec.loop.cache.n_checkpoints = int(n_checkpoints)
        self._init_jobs()
        self.similarity = float(slot_similarity)
        n = len(self.speculators)
        self.busy = [False] * n
        self._running: List[Optional[Job]] = [None] * n
        self._last_used: List[Optional[int]] = [None] * n
        self._clock = itertools.count()
        self._slot_free = threading.Condition(self._lock)
        self._slot_q: List["queue.Queue[Optional[Job]]"] = [queue.Queue() for _ in range(n)]
        self._threads = [threading.Thread(target=self._work, args=(i,), name=f"dspark-slot-{i}", daemon=True)
                         for i in range(n)]
        self._dispatcher = threading.Thread(target=self._dispatch, name="dspark-dispatch", daemon=True)
        for t in self._threads + [self._dispatcher]:
            t.start()

    # ---- properties ------------------------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return len(self.speculators)

    @property
    def front(self):
        """A Speculator for tokenizing and chat templates (read-only vocabulary use, thread-safe)."""
        return self.speculators[0]

    @property
    def n_ctx(self) -> int:
        return int(self.front.target.n_ctx)

    @property
    def n_busy(self) -> int:
        with self._lock:
            return sum(self.busy)

    # ---- jobs --------------------------------------------------------------------------------------

    def close(self, timeout: float = 60.0) -> None:
        """Cancel what is queued or running and stop the workers.  A worker still inside a decode
        after ``timeout`` seconds keeps its contexts (freeing them under a running decode would
        crash the process): they are leaked, with a warning."""
        if not self._mark_closed():
            return
        try:
            self._cancel_queued()
            with self._lock:
                running = [j for j in self._running if j is not None]
            for j in running:
                j.cancel()
            self._queue.put(None)   # the dispatcher stops, then tells every worker to
            with self._slot_free:
                self._slot_free.notify_all()   # a job waiting for a free slot is cancelled now
            self._dispatcher.join(timeout=max(timeout, 10.0))   # it never waits on a decode
            for slot, (t, sp) in enumerate(zip(self._threads, self.speculators)):
                t.join(timeout=timeout)
                if t.is_alive():
                    log.warning("slot %d: still decoding %.0f s after close(); its contexts are not freed", slot,
                                timeout)
                    continue
                sp.close()
        finally:
            self._closed_now()

    def slots_info(self) -> List[dict]:
        """Per slot: llama-server's /slots basics (id, n_ctx, is_processing), the task it runs and
        how many tokens its memories hold for the prompt cache."""
        with self._lock:
            busy, running = list(self.busy), list(self._running)
        return [{"id": i, "n_ctx": self.n_ctx, "is_processing": busy[i],
                 "id_task": running[i].task_id if running[i] is not None else -1,
                 "n_cached": 0 if self._held(i) is None else int(self._held(i).size),
                 "dspark_memory": self.memory.get(i), "dspark_prompt_cache": self.store_info()}
                for i in range(len(self.speculators))]

    def _held(self, slot: int):
        dec = getattr(self.speculators[slot], "decoder", None)
        return None if dec is None else dec.cached_tokens()

    # ---- dispatcher and workers ----------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Hands each queued job to a free slot (the prompt-cache rule), waiting for one if needed."""
        while True:
            job = self._queue.get()
            if job is None:
                for q in self._slot_q:
                    q.put(None)
                return
            if job.cancelled:
                self._count(cancelled=True)
                _deliver(job, Cancelled("cancelled while queued"))
                continue
            with self._slot_free:
                while all(self.busy) and not self._closed:
                    self._slot_free.wait(0.5)
                if self._closed:
                    job.cancel()
                    _deliver(job, Cancelled("server shutting down"))
                    continue
                free = [i for i, b in enumerate(self.busy) if not b]
                prompt = np.asarray(job.prompt_tokens, dtype=np.int32)
                slot = pick_slot(free, prompt, self._held, self._last_used.__getitem__, self.similarity)
                self.busy[slot] = True
                self._running[slot] = job
            self._slot_q[slot].put(job)

    def _work(self, slot: int) -> None:
        sp = self.speculators[slot]
        while True:
            job = self._slot_q[slot].get()
            if job is None:
                return
            job.slot = slot
            log.info("slot launch_slot_: id %2d | task %d | processing task (%d prompt tokens)",
                     slot, job.task_id, len(job.prompt_tokens))
            try:
                self._run(sp, slot, job)
            except BaseException as e:  # never let a request kill the slot
                log.error("slot   send_error: id %2d | task %d | error: %s", slot, job.task_id, e)
                _deliver(job, e)
            finally:
                self._release(sp, slot, job)

    def _release(self, sp, slot: int, job: Job) -> None:
        """The slot is free for the next job (once per job): before its client gets the Done event,
        so that a next turn sent at once finds its slot, and its cached prompt, free."""
        with self._slot_free:
            if self._running[slot] is not job:
                return
        self.memory[slot] = memory_ranges(sp, 0)
        with self._slot_free:
            self.busy[slot] = False
            self._running[slot] = None
            self._last_used[slot] = next(self._clock)
            self._slot_free.notify_all()
        log.info("slot      release: id %2d | task %d | stop processing", slot, job.task_id)

    def _run(self, sp, slot: int, job: Job) -> None:
        if job.cancelled:
            self._count(cancelled=True)
            _deliver(job, Cancelled("cancelled while queued"))
            return
        kw = job_request(job)
        kw["stop"] = list(job.stop)
        if job.sampling is not None:
            kw["sampling"] = job.sampling
        gen = sp.stream(job.prompt_tokens, job.max_tokens, **kw)
        try:
            for ev in gen:
                if job.cancelled:
                    self._count(cancelled=True)
                    why = "cancelled: server shutting down" if self._closed else "cancelled by the client"
                    log.info("slot  cancel_task: id %2d | task %d | %s", slot, job.task_id, why)
                    _deliver(job, Cancelled("server shutting down" if self._closed else "cancelled"))
                    return
                if isinstance(ev, Done):
                    for line in timing_log_lines(slot, job.task_id, ev.stats):
                        log.info(line)
                    self._count()
                    gen.close()   # the generation's end is final in the memories and the cache
                    self._release(sp, slot, job)
                _deliver(job, ev)
        finally:
            gen.close()



def job_request(job: Job) -> dict:
    """The decoder's per-request arguments of a job (besides prompt, max_tokens, stop, sampling)."""
    return {"ignore_eos": job.ignore_eos, "reuse_prefix": job.cache_prompt, "grammar": job.grammar,
            "logit_bias": job.logit_bias, "n_probs": job.n_probs, "post_sampling_probs": job.post_sampling_probs,
            "n_max": job.n_max or None, "draft": job.n_max != 0, "trace": job.trace}


def _deliver(job: Job, ev: Any) -> None:
    try:
        job.on_event(ev)
    except Exception as e:  # the receiver is gone (event loop closed): nothing to do
        log.debug("task %d: event not delivered: %s", job.task_id, e)
