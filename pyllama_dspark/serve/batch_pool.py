"""Server slots over one batched decoder: ``serve -np N`` with continuous batching.

One worker thread owns a :class:`~pyllama_dspark.decode.loop.Decoder` over a target + draft opened with N
sequences: every step verifies all running requests' rows in one target decode (and drafts all
their blocks in one draft decode), which is what llama-server does with its slots.  Requests join
as slots free up, each with its own sampling parameters, stop strings and max_tokens; a cancelled
job (client gone) is dropped at the next step boundary.  Each sequence keeps its memories between
requests (the prompt cache): a request gets the free sequence whose memories share the largest part
of its prompt (llama-server's rule, :mod:`~pyllama_dspark.decode.prompt_cache`).  Same interface as
:class:`~.slots.SlotPool` (``submit(Job)``, ``front``, ``n_ctx``, ``n_busy``, ``close``), so the
HTTP front end does not know which one it drives.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Dict, List, Optional

from pyllama_dspark.decode.cycle import Started
from pyllama_dspark.decode.cycle import Done
from pyllama_dspark.decode.prompt_cache import CTX_CHECKPOINTS, SLOT_PROMPT_SIMILARITY
from pyllama_dspark.serve.slots import Cancelled, Job, JobQueue, _deliver, job_request, memory_ranges
from pyllama_dspark.decode.timings import timing_log_lines

log = logging.getLogger("pyllama_dspark.serve.server")


class BatchedPool(JobQueue):
    """``n_slots`` concurrent requests decoded together by one loop (Decoder).

    ``sp``: a :class:`~.api.Speculator` opened with ``n_seq=n_slots`` (it owns the contexts and
    is closed with the pool); ``policy``: an optional :class:`~.policy.VerifyPolicy`."""

    def __init__(self, sp, n_max: int = 7, policy=None, slot_similarity: float = SLOT_PROMPT_SIMILARITY,
                 store=None, cache_idle_slots: bool = False, n_checkpoints: int = CTX_CHECKPOINTS):
        from pyllama_dspark.decode.loop import Decoder

        self.sp = sp
        self.store = store
        self._bd = Decoder(sp.target, sp.proposer if sp.draft is not None else None, n_max=n_max,
                           policy=policy, streaming=True, keep_memory=True, slot_similarity=slot_similarity,
                           store=store, cache_idle_slots=cache_idle_slots, n_checkpoints=n_checkpoints)
        self._init_jobs()
        self._running: Dict[int, Job] = {}     # rid -> job
        self._thread = threading.Thread(target=self._work, name="dspark-batch", daemon=True)
        self._thread.start()

    # ---- properties --------------------------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return self._bd.n_slots

    @property
    def front(self):
        return self.sp

    @property
    def n_ctx(self) -> int:
        """Context per slot."""
        return int(self._bd.n_ctx_seq)

    @property
    def n_busy(self) -> int:
        with self._lock:
            return min(len(self._running), self.n_slots)

    def slots_info(self) -> List[dict]:
        """Per sequence slot: llama-server's /slots basics (id, n_ctx, is_processing), the task it
        runs and how many tokens its memories hold for the prompt cache."""
        with self._lock:
            by_slot = {j.slot: j for j in self._running.values() if j.slot >= 0}
        cache = self._bd.cache
        # a slot is processing from its admission inside a step (before the worker sees its
        # Started event after the step) to its release: what the decoder holds, not only by_slot
        free = set(self._bd.free_slots())
        return [{"id": i, "n_ctx": self.n_ctx, "is_processing": i in by_slot or i not in free,
                 "id_task": by_slot[i].task_id if i in by_slot else -1, "n_cached": cache.n_cached(i),
                 "n_checkpoints": len(cache.checkpoints.get(i, ())),
                 "dspark_memory": self.memory.get(i), "dspark_prompt_cache": self.store_info()}
                for i in self._bd.slots]

    # ---- jobs --------------------------------------------------------------------------------------
    def close(self) -> None:
        if not self._mark_closed():
            return
        try:
            self._queue.put(None)
            # no timeout: the worker stops at the next step boundary, and the contexts must not be
            # freed under a decode that is still running
            self._thread.join()
            self._cancel_queued()   # whatever the worker did not take
            from pyllama_dspark.speculative import policy_memory

            policy_memory.save(getattr(self._bd, "policy", None))   # what auto learned, for the next process
            self.sp.close()
        finally:
            self._closed_now()

    # ---- worker ------------------------------------------------------------------------------------
    def _take(self, job: Job) -> None:
        if job.cancelled:
            self._count(cancelled=True)
            _deliver(job, Cancelled("cancelled while queued"))
            return
        try:
            rid = self._bd.submit(job.prompt_tokens, job.max_tokens, job.stop, sampling=job.sampling,
                                  **job_request(job))
        except Exception as e:   # bad request: the client gets it, the batch goes on
            _deliver(job, e)
            return
        with self._lock:
            self._running[rid] = job

    def _work(self) -> None:
        stop = False
        while not stop:
            try:
                stop = self._cycle()
            except BaseException as e:   # never let the worker die with jobs waiting on it
                log.error("batch worker error: %s", e)
                self._fail_running(e)

    def _fail_running(self, e: BaseException) -> None:
        with self._lock:
            running, self._running = list(self._running.items()), {}
        for rid, job in running:
            try:
                self._bd.cancel(rid)
            except Exception:   # the decoder is broken: the job still gets its error
                pass
            _deliver(job, e)
        self._bd.poll()

    def _cycle(self) -> bool:
        """Take new jobs, drop cancelled ones, run one step, deliver its events; True to stop."""
        bd = self._bd
        stop = False
        # new jobs: wait for one when idle, otherwise take what has arrived
        while True:
            try:
                job = self._queue.get(block=bd.pending() == 0)
            except queue.Empty:
                break
            if job is None:
                stop = True
                break
            self._take(job)
        with self._lock:
            running = list(self._running.items())
        for rid, job in running:
            if job.cancelled or stop:
                bd.cancel(rid)
                with self._lock:
                    self._running.pop(rid, None)
                self._count(cancelled=True)
                why = "cancelled by the client" if job.cancelled else "cancelled: server shutting down"
                if job.slot >= 0:
                    log.info("slot  cancel_task: id %2d | task %d | %s", job.slot, job.task_id, why)
                    self.memory[job.slot] = memory_ranges(self.sp, job.slot)
                log.info("slot      release: id %2d | task %d | stop processing", job.slot, job.task_id)
                _deliver(job, Cancelled("cancelled" if job.cancelled else "server shutting down"))
        if stop or bd.pending() == 0:
            return stop
        try:
            bd.step()
        except BaseException as e:   # one failed step fails the running jobs, not the server
            log.error("batch step failed: %s", e)
            self._fail_running(e)
            return False
        for rid, ev in bd.poll():
            with self._lock:
                job = self._running.get(rid)
                if job is not None and isinstance(ev, Done):
                    self._running.pop(rid, None)
            if job is None:
                continue
            if isinstance(ev, Started):
                job.slot = ev.slot
                log.info("slot launch_slot_: id %2d | task %d | processing task (%d prompt tokens)",
                         ev.slot, job.task_id, len(job.prompt_tokens))
                continue
            if isinstance(ev, Done):
                for line in timing_log_lines(job.slot, job.task_id, ev.stats):
                    log.info(line)
                self.memory[job.slot] = memory_ranges(self.sp, job.slot)
                log.info("slot      release: id %2d | task %d | stop processing", job.slot, job.task_id)
                self._count()
            _deliver(job, ev)
        return False


def open_batched_pool(target: str, draft: Optional[str], *, n_slots: int, n_ctx: int, n_batch: int, n_ubatch: int,
                      threads, flash_attn: str, n_gpu_layers, n_max: int, verbose: bool = False,
                      policy_factory=None, kv_unified: bool = False,
                      slot_similarity: float = SLOT_PROMPT_SIMILARITY, offload: Optional[dict] = None,
                      store=None, cache_idle_slots: bool = False, n_checkpoints: int = CTX_CHECKPOINTS) -> BatchedPool:
    """A Speculator with ``n_slots`` sequences sharing ``n_ctx`` tokens (llama-server's ``-c``:
    ``n_ctx / n_slots`` each, or all of it for any one with ``kv_unified``), wrapped in a
    BatchedPool; ``policy_factory(sp)``: the VerifyPolicy of its decoder (None: verify every draft)."""
    from pyllama_dspark.decode.api import Speculator

    sp = Speculator(target, draft, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=threads,
                    flash_attn=flash_attn, n_gpu_layers=n_gpu_layers, n_max=n_max, verbose=verbose, n_seq=n_slots,
                    schedule="off", kv_unified=kv_unified, **(offload or {}))   # the pool's decoder gets its policy from policy_factory
    try:
        return BatchedPool(sp, n_max=n_max, policy=policy_factory(sp) if policy_factory else None,
                           slot_similarity=slot_similarity, store=store, cache_idle_slots=cache_idle_slots,
                           n_checkpoints=n_checkpoints)
    except BaseException:
        sp.close()
        raise


__all__ = ["BatchedPool", "open_batched_pool"]
