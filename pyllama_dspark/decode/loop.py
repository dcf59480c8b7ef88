"""The decoding loop: R sequences at once (one sequence is R = 1), one step at a time.

A request is admitted into a free sequence slot and its prompt decoded (prefill: n_batch chunks,
every chunk's features observed by the proposer; with ``reuse_prefix`` only what the memories do
not already hold).  Then every step, for all running requests together:

  1. propose: the policy decides whether a draft pass can pay; if so one draft pass proposes a
     block for every request with room (a draft model decodes all blocks in one decode; greedy
     requests take each row's argmax, sampled ones draw left to right through the Markov head);
  2. policy: each request's verify length l_r (Algorithm 1 across the R blocks when cost-driven);
  3. verify: one target decode holds every request's rows [anchor, drafts[:l_r]] (l_r = 0: plain
     decoding);
  4. accept, per request: :func:`~..speculative.verify.greedy_accept` at T = 0, or
     :func:`~..speculative.verify.speculative_accept` at T > 0 (this loop is their only caller);
  5. inject / roll back: the proposer observes the verified rows (or defers them when nothing was
     drafted) and both memories drop the rejected tail;
  6. events: the emitted tokens go through EOG, stop-string and max_tokens checks; a finished
     request frees its slot and a queued one joins.

Greedy output of every request equals its own plain greedy output; sampled output is distributed
as plain sampling from the target with the same sampler chain.

Requests: :meth:`Decoder.submit` queues one (its own sampling parameters, stop strings, max_tokens,
draft size), :meth:`step` advances every running one, :meth:`poll` hands out what each step
produced (``(rid, Started)``, ``(rid, Chunk)`` ... ``(rid, Done)``) when ``streaming`` is on,
:meth:`cancel` drops a request at a step boundary, :meth:`run` drives a list of prompts to the end.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Deque, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from pyllama_dspark.decode.cycle import Chunk, Done, OneHotRows, PieceCache, Started, TargetRows
from pyllama_dspark.decode.prefill import prefill
from pyllama_dspark.decode.prompt_cache import CTX_CHECKPOINTS, SLOT_PROMPT_SIMILARITY, PromptCache
from pyllama_dspark.decode.request import Request, chunk_trace, grammar_cut, make_request, token_probs
from pyllama_dspark.llama.handles import Draft, RowBuffers, Target
from pyllama_dspark.llama.recurrent import VerifyCheckpoints
from pyllama_dspark.speculative.drafter import (BlockRequest, DraftModelProposer, NoDraft, Proposer, check_n_max,
                                                hidden_ms_of, llama_ms_of, observe_later, propose_all)
from pyllama_dspark.speculative.policy import VerifyPolicy
from pyllama_dspark.speculative.sampling import SamplingParams
from pyllama_dspark.speculative.verify import greedy_accept, speculative_accept


class Decoder:
    """Speculative decoding of the requests it is given, up to one per sequence slot at a time."""

    def __init__(self, target: Target, proposer: Union[Draft, Proposer, None] = None, *, n_max: int = 7,
                 policy: Optional[VerifyPolicy] = None, streaming: bool = False, tie_eps: float = 1e-3,
                 slots: Optional[Sequence[int]] = None, keep_memory: bool = False,
                 slot_similarity: float = SLOT_PROMPT_SIMILARITY, store=None,
                 n_checkpoints: int = CTX_CHECKPOINTS, cache_idle_slots: bool = False):
        """``proposer``: a Draft (every block of a step in one draft decode), any other Proposer
        (e.g. the oracle), or None (plain decoding).  ``n_max``: the largest draft block a request
        may ask for (clamped to what the drafter produces).  ``policy``: how much of each block to
        verify (None: all of it, llama.cpp's fixed block).  ``streaming``: keep per-step events for
        :meth:`poll` (results are then not kept for :meth:`result`).  ``tie_eps``: a greedy verify
        row whose top-2 logit gap is below it counts as a numerical near-tie.  ``slots``: the
        sequence ids this decoder may use (default: every sequence of the target's context).
        ``keep_memory``: a finished request's memories stay as they are (instead of being cleared),
        so that a later request with ``reuse_prefix`` decodes only what they do not hold; a request
        then gets its slot by llama-server's rule (:mod:`.prompt_cache`, ``slot_similarity``).
        ``store``: a :class:`~..llama.prompt_state.PromptStore` (``--cache-ram``) that slot states
        are saved to and restored from; ``cache_idle_slots``: every idle slot's state saved to it
        when a request starts; ``n_checkpoints``: checkpoints a slot keeps on a hybrid target."""
        self.target = target
        self.tie_eps = float(tie_eps)
        self._undo = VerifyCheckpoints(target) if VerifyCheckpoints.needed(target) else None
        n_seq = int(target.settings.n_seq_max)
        self.slots = list(range(n_seq)) if slots is None else [int(s) for s in slots]
        if not self.slots or any(not 0 <= s < n_seq for s in self.slots) or len(set(self.slots)) < len(self.slots):
            raise ValueError(f"slots must be distinct sequence ids in 0..{n_seq - 1}")
        self.n_slots = len(self.slots)
        # llama.cpp splits the context evenly among the sequences it was created for (a unified
        # KV buffer lets any one of them use all of it)
        unified = bool(getattr(target.settings, "kv_unified", False))
        self.n_ctx_seq = target.n_ctx if unified else target.n_ctx // n_seq
        if isinstance(proposer, Draft):
            if int(proposer.settings.n_seq_max) < n_seq:
                raise ValueError("the draft context needs as many sequences as the target's")
            proposer = DraftModelProposer(proposer)
        self.n_max = check_n_max(n_max)
        self.streaming = streaming
        self.keep_memory = keep_memory
        self.eog = target.eog_mask
        self._pieces = PieceCache(target)
        self._free = self.slots[::-1]
        self._active: List[Request] = []
        self._queue: Deque[Request] = deque()
        self._done: Dict[int, Done] = {}
        self._events: List[Tuple[int, Union[Started, Chunk, Done]]] = []
        self._next_rid = 0
        # per slot, when keep_memory: what its memories hold (see .prompt_cache)
        self.cache = PromptCache(slot_similarity, store=store if keep_memory else None, n_checkpoints=n_checkpoints)
        self.cache_idle_slots = bool(cache_idle_slots) and store is not None
        self._prop: Optional[Proposer] = None
        self._policy: Optional[VerifyPolicy] = None
        self.proposer = proposer
        self.policy = policy
        self._fixed = VerifyPolicy()   # policy None: verify every drafted token
        cap = target.n_batch
        self._rows = RowBuffers(cap)   # the verify decode's rows and read-out
        self._ids, self._margin = self._rows.ids, self._rows.margin
        self._arange = np.arange(cap, dtype=np.int32)
        self.steps = 0
        self.verify_batches: List[int] = []
        # (raw confidences of the drafted block, verified length, accepted) per request-step, for
        # calibration; only kept when ``record`` is set
        self.record = False
        self.records: List[tuple] = []

    # ---- configuration ------------------------------------------------------------------------
    @property
    def proposer(self) -> Proposer:
        return self._prop if self._prop is not None else NoDraft()

    @proposer.setter
    def proposer(self, proposer: Optional[Proposer]) -> None:
        """Swap the proposer (between requests): what the old one observed is forgotten."""
        if self._active:
            raise RuntimeError("the proposer cannot change while requests are running")
        self._prop = None if proposer is None or isinstance(proposer, NoDraft) else proposer
        self._max_draft = 0 if self._prop is None else min(self.n_max, self._prop.max_draft())
        self.cache.clear()
        # every request's verify rows go into one target decode (and its block into one draft
        # decode): llama.cpp aborts on a batch larger than n_batch, so refuse the settings here
        rows = self.n_slots * (self._max_draft + 1)
        if self.n_slots == 1:
            self._max_draft = min(self._max_draft, self.target.n_batch - 1)
        elif rows > self.target.n_batch:
            raise ValueError(f"{self.n_slots} sequences x {self._max_draft + 1} verify rows = {rows} exceeds the "
                             f"target's n_batch {self.target.n_batch}: raise n_batch or lower n_max / the slots")
        if isinstance(self._prop, DraftModelProposer):
            blocks = self.n_slots * (self._max_draft + self._prop.offset)
            if blocks > self._prop.draft.n_batch:
                raise ValueError(f"{self.n_slots} draft blocks of {self._max_draft + self._prop.offset} rows exceed "
                                 f"the draft's n_batch {self._prop.draft.n_batch}")

    @property
    def policy(self) -> Optional[VerifyPolicy]:
        return self._policy

    @policy.setter
    def policy(self, policy: Optional[VerifyPolicy]) -> None:
        if (policy is not None and policy.needs_confidence and isinstance(self._prop, DraftModelProposer)
                and not self._prop.meta.has_confidence):
            raise ValueError(f"the {policy.mode} schedule needs a draft with a confidence head")
        self._policy = policy

    # ---- requests -------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], max_tokens: int = 256, stop: Sequence[str] = (), *,
               sampling: Optional[SamplingParams] = None, ignore_eos: bool = False,
               n_max: Optional[int] = None, reuse_prefix: bool = False, grammar=None,
               logit_bias: Optional[dict] = None, n_probs: int = 0, post_sampling_probs: bool = False,
               trace: bool = False, draft: bool = True) -> int:
        """Queue one request; returns its id.

        ``sampling`` None (or temperature 0 without penalties) is greedy decoding, otherwise
        speculative sampling with llama.cpp's sampler chain.  ``n_max``: this request's draft
        block (None: the decoder's), clamped to what the drafter produces.  ``reuse_prefix``
        (with ``keep_memory``): keep what the slot's memories already hold of this prompt and
        decode only the rest; the same prompt again costs no target decode.  Off by default: a
        partial re-decode changes batch shapes, hence the last bits of the logits.

        ``grammar``: a GBNF string (or a :class:`~..llama.grammar.Grammar`): the output follows
        the target constrained by it (llama.cpp's grammar engine).  ``logit_bias``: {token id:
        bias} added to the target's logits (-inf: never drawn).  ``n_probs`` > 0: a
        :class:`~..speculative.logprobs.TokenProb` per emitted token (``Chunk.probs`` / ``Done.probs``),
        from the target's rows (``post_sampling_probs``: after the sampler chain).  ``trace``: each
        streamed Chunk says which of its tokens were accepted drafts, per cycle (``Chunk.trace``),
        and carries the request's timings so far.  ``draft`` False: this request drafts nothing."""
        s = make_request(self._next_rid, self.target, self._pieces, self.eog, self.n_ctx_seq, self._max_draft, prompt,
                         max_tokens, stop, sampling=sampling, ignore_eos=ignore_eos, n_max=n_max,
                         reuse_prefix=reuse_prefix, grammar=grammar, logit_bias=logit_bias, n_probs=n_probs,
                         post_sampling_probs=post_sampling_probs, trace=trace, draft=draft)
        self._next_rid += 1
        self._queue.append(s)
        return s.rid

    def free_slots(self) -> List[int]:
        """The slots no admitted request holds (a copy: safe to read from another thread)."""
        return list(self._free)

    def cancel(self, rid: int) -> bool:
        """Drop a queued or running request (its slot is free for the next step); False if unknown."""
        for s in list(self._queue):
            if s.rid == rid:
                self._queue.remove(s)
                return True
        for s in self._active:
            if s.rid == rid:
                self._active.remove(s)
                self._release(s)
                return True
        return False

    def _admit(self) -> bool:
        """Admit queued requests into free slots and prefill them; True if any was admitted."""
        new: List[Request] = []
        while self._queue and self._free:
            s = self._queue.popleft()
            if self.keep_memory:
                s.seq_id = self.cache.pick(self._free, s.prompt)
                self._free.remove(s.seq_id)
            else:
                s.seq_id = self._free.pop()
            new.append(s)
            if self.streaming:
                self._events.append((s.rid, Started(s.seq_id)))
            if hasattr(self._prop, "bind"):  # per-sequence proposers (e.g. one oracle per prompt)
                self._prop.bind(s.seq_id, s.prompt)
        if not new:
            return False
        if self.cache_idle_slots:
            self.cache.save_idle(self.target, self._prop, self._free,
                                 clear=bool(getattr(self.target.settings, "kv_unified", False)))
        try:
            prefill(self, new)   # every new prompt, in shared decodes (.prefill)
        except BaseException:
            for s in new:
                self._release(s, keep=False)
            raise
        for s in new:
            if s.finish is None:
                self._active.append(s)
                self._stream_pending(s)   # the first token, out before the next cycle
            else:
                self._finish(s)
        return True

    # ---- emitting and finishing -------------------------------------------------------------------
    def _emit(self, s: Request, toks: List[int], cycle: tuple = (0, 0, 0)) -> None:
        """Emit ``toks`` (EOG, stop strings, max_tokens cut them); ``cycle``: (drafted, verified, accepted)."""
        n0 = len(s.out)
        self._push(s, toks)
        if s.trace is not None:
            s.trace.append((s.stats.cycles, *cycle, len(s.out) - n0))

    def _push(self, s: Request, toks: List[int]) -> None:
        eog, text = None if s.ignore_eos else self.eog, s.text
        probs, s.pending_probs = s.pending_probs, []
        for j, t in enumerate(toks):
            s.out.append(t)
            s.pending.append(t)
            if probs:
                s.probs.append(probs[j])
            if eog is not None and eog[t]:
                s.finish = "stop"
                return
            text.push(t)
            if text.stopped:
                s.finish = "stop"
                return
            if len(s.out) >= s.max_tokens:
                s.finish = "length"
                return
        if s.pos0 + 1 >= self.n_ctx_seq:
            s.finish = "length"

    def _stream_pending(self, s: Request) -> None:
        """A running request's new tokens as a Chunk event (streaming)."""
        if self.streaming and s.pending:
            self._events.append((s.rid, Chunk(s.pending, s.text.flush(), self._pending_probs(s), *chunk_trace(s))))
            s.pending = []

    @staticmethod
    def _pending_probs(s: Request) -> Optional[list]:
        return s.probs[len(s.out) - len(s.pending):] if s.n_probs else None

    def _release(self, s: Request, keep: Optional[bool] = None) -> None:
        seq = s.seq_id
        if s.smp is not None:
            s.smp.close()   # its grammar, if any
        if self.keep_memory if keep is None else keep:   # the memories hold the prompt and the output before the anchor
            self.cache.keep(seq, np.concatenate([s.prompt, np.asarray(s.out[:s.pos0 - s.prompt.size], dtype=np.int32)]))
        else:
            self.cache.forget(seq)
            self.target.seq_rm(seq, 0, -1)
            if self._prop is not None:
                self._prop.reset(seq)
        self._free.append(seq)

    def _finish(self, s: Request) -> None:
        tail = s.text.flush(final=True)
        if s.text.stopped:   # (also a stop string completed by the final flush)
            s.finish = "stop"
        s.stats.n_generated = len(s.out)
        if self._policy is not None and self._prop is not None:
            s.stats.schedule = self._policy.summary(s.stats.verify_lengths)
        s.stats.ms_total = (time.perf_counter() - s.t_start) * 1e3 - s.stats.ms_prefill - s.stats.ms_hidden
        done = Done(s.out, s.text.text, s.finish, s.stats, s.text.stop_word, s.probs if s.n_probs else None)
        if self.streaming:
            if s.pending or tail:
                self._events.append((s.rid, Chunk(s.pending, tail, self._pending_probs(s), *chunk_trace(s))))
            self._events.append((s.rid, done))
        else:
            self._done[s.rid] = done
        s.pending = []
        self._release(s)

    # ---- one step for every running request -------------------------------------------------------
    def step(self) -> None:
        """One step: admit what fits (their prefills), else one cycle of every running request.
        A streaming step that admitted requests ends there, so that their first tokens reach
        :meth:`poll` before a cycle runs (llama-server sends a first token right after the decode
        that ends its prompt); the next step runs the cycle."""
        if self._admit() and self.streaming:
            return
        act = self._active
        # rows in ascending sequence order: llama.cpp splits a multi-sequence batch per KV stream,
        # and rows out of order cost it more ubatches (a 4-sequence step: 24 instead of 17 ms)
        act.sort(key=lambda s: s.seq_id)
        if not act:
            return
        R = len(act)
        tgt, prop = self.target, self._prop
        pol = self._policy or self._fixed
        clock = time.perf_counter
        llama0 = tgt.llama_ms + llama_ms_of(prop)
        t0 = clock()
        # 1. propose (a request whose block would not fit its context, or that may emit one more
        # token only, drafts nothing)
        drafts: List[Optional[np.ndarray]] = [None] * R
        confs: List[Optional[np.ndarray]] = [None] * R
        qs: List[Optional[list]] = [None] * R
        cut_q: list = [None] * R   # a grammar cut the block before this draft's q (see grammar_cut)
        n_in_pass = 0
        hidden = 0.0
        if prop is not None:
            offset = getattr(prop, "offset", 0)
            room = [r for r, s in enumerate(act)
                    if s.n_max > 0 and min(self.n_ctx_seq - s.pos0 - 2, s.max_tokens - len(s.out) - 1) > 0
                    and s.pos0 + s.n_max + offset <= self.n_ctx_seq]
            if room and pol.want_draft(len(room)):
                # the policy's block: a cost-driven one drafts only what it plans to verify
                n_block = pol.draft_length(len(room), max(act[r].n_max for r in room))
                caught, hidden = prop.catch_up_ms(), hidden_ms_of(prop)
                props = propose_all(prop, [BlockRequest(act[r].anchor, act[r].pos0, min(act[r].n_max, n_block),
                                                        act[r].seq_id, act[r].smp) for r in room])
                for r, p in zip(room, props):
                    s = act[r]
                    limit = min(self.n_ctx_seq - s.pos0 - 2, s.max_tokens - len(s.out) - 1)
                    drafts[r] = np.asarray(p.tokens[:limit], dtype=np.int32)
                    confs[r] = p.confidence
                    qs[r] = p.probs
                    if s.smp is not None and s.smp.constrained and len(drafts[r]):
                        drafts[r], cut_q[r] = grammar_cut(s.smp, drafts[r], qs[r], tgt.n_vocab)
                        if cut_q[r] is not None and confs[r] is not None:
                            confs[r] = confs[r][:len(drafts[r])]
                n_in_pass = len(room)
                caught = prop.catch_up_ms() - caught
                hidden = hidden_ms_of(prop) - hidden
        t1 = clock()
        if hidden:   # a proposer's own work that no drafter does (the oracle's truth): not timed
            t0 += hidden / 1e3
            for r in room:
                act[r].stats.ms_hidden += hidden / len(room)
        # 2. verify lengths
        n_drafted = [0 if d is None else len(d) for d in drafts]
        lengths = pol.lengths(confs, n_drafted) if n_in_pass else n_drafted
        if n_in_pass and any(n_drafted):
            # after the cut: at T > 0 the pass's time depends on the drafted tokens themselves
            pol.observe_draft(n_in_pass, (t1 - t0) * 1e3, n_block, caught_ms=caught)
        # 3. one target decode with every request's verify rows
        tok, pos, seqs = self._rows.tok, self._rows.pos, self._rows.seq
        offs = []
        n = 0
        want_device = tgt.samplers.want
        for s, d, k in zip(act, drafts, lengths):
            want_device(s.seq_id, s.smp is None and not s.n_probs)   # request.device_greedy
            offs.append(n)
            tok[n] = s.anchor
            if k:
                tok[n + 1:n + 1 + k] = d[:k]
            pos[n:n + 1 + k] = self._arange[:1 + k] + s.pos0
            seqs[n:n + 1 + k] = s.seq_id
            n += 1 + k
        undo = self._undo
        if undo is not None:   # a recurrent state without snapshots: checkpoints (llama/recurrent.py)
            for s, k in zip(act, lengths):
                if k:
                    undo.take(s.seq_id)
        tgt.decode_buffers(self._rows, n)
        if any(s.smp is None for s in act):
            tgt.argmax_buffers(self._rows, 0, n)
        t2 = clock()
        self.verify_batches.append(n)
        # 4-6. accept, inject / roll back, emit
        ms_sample = [0.0] * R
        for r, (s, k, off) in enumerate(zip(act, lengths, offs)):
            d = drafts[r][:k] if k else self._ids[:0]
            eog = None if s.ignore_eos else self.eog
            if s.smp is None:
                ids = self._ids[off:off + k + 1]
                n_acc = greedy_accept(d, ids, eog)
                s.stats.near_ties += int(np.count_nonzero(self._margin[off:off + n_acc + 1] < self.tie_eps))
                emitted = ids[:n_acc + 1].tolist()
                if s.n_probs:
                    s.pending_probs = token_probs(s, tgt, off, emitted)
            else:
                ts = clock()
                dk = d.copy()
                q_rows = OneHotRows(dk, tgt.n_vocab) if qs[r] is None else qs[r][:k]
                cq = cut_q[r] if cut_q[r] is not None and k == len(drafts[r]) else None
                n_acc, emitted = speculative_accept(dk, q_rows, TargetRows(tgt, s.smp, dk, off), s.smp.rng.random, eog,
                                                    cut_q=cq)
                if s.n_probs:
                    s.pending_probs = token_probs(s, tgt, off, emitted)
                s.smp.accept(emitted)
                ms_sample[r] = (clock() - ts) * 1e3
            s.stats.record(k, n_acc)
            if prop is not None:
                if self._policy is not None:
                    pol.update(k, n_acc, confs[r])
                if self.record and k > 0 and confs[r] is not None:
                    self.records.append((confs[r][:len(drafts[r])].copy(), k, n_acc))
                # like llama.cpp: the draft gets the features of every verify row, then both
                # memories drop the rejected positions; a step without drafts leaves the row on
                # the host until the next block (no draft decode while drafting is off)
                if k:
                    prop.observe(off, k + 1, s.pos0, s.seq_id)
                else:
                    observe_later(prop, off, 1, s.pos0, s.seq_id)
            if n_acc < k:
                if undo is not None:
                    undo.rollback(s.seq_id, s.pos0, [s.anchor] + d[:n_acc].tolist())
                else:
                    tgt.seq_rm(s.seq_id, s.pos0 + n_acc + 1, -1)
                if prop is not None:
                    prop.rollback(s.pos0 + n_acc + 1, s.seq_id)
            s.pos0 += n_acc + 1
            s.anchor = emitted[-1]
            self._emit(s, emitted, (0 if drafts[r] is None else len(drafts[r]), k, n_acc))
        if undo is not None:
            undo.replay()
        t3 = clock()
        if self._policy is not None and prop is not None:
            self._policy.observe_cycle(R, n, (t3 - t1) * 1e3)
        inject_share = ((t3 - t2) * 1e3 - sum(ms_sample)) / R
        llama_share = (tgt.llama_ms + llama_ms_of(prop) - llama0) / R
        for r, s in enumerate(act):
            s.stats.ms_llama += llama_share
            # the draft pass is shared by the requests that were in it
            if n_in_pass and drafts[r] is not None:
                s.stats.ms_draft += (t1 - t0) * 1e3 / n_in_pass
            s.stats.ms_verify += (t2 - t1) * 1e3 / R
            s.stats.ms_sample += ms_sample[r]
            s.stats.ms_inject += inject_share
        self.steps += 1
        still = []
        for s in act:
            if s.finish is None:
                still.append(s)
                self._stream_pending(s)
            else:
                self._finish(s)
        self._active = still

    # ---- driving ----------------------------------------------------------------------------------
    def pending(self) -> int:
        return len(self._active) + len(self._queue)

    @property
    def n_active(self) -> int:
        return len(self._active)

    def result(self, rid: int) -> Optional[Done]:
        return self._done.get(rid)

    def poll(self) -> List[Tuple[int, Union[Started, Chunk, Done]]]:
        """Events since the last poll (``streaming`` mode): (rid, Started) when the request got
        its slot, (rid, Chunk) per step that emitted tokens, then (rid, Done) when it finished."""
        ev, self._events = self._events, []
        return ev

    def run(self, prompts: Sequence[Sequence[int]], max_tokens=256, stop: Sequence[str] = (),
            sampling: Optional[SamplingParams] = None) -> List[Done]:
        """Decode all prompts (at most n_slots at a time; queued ones join as slots free up).

        ``sampling``: one SamplingParams for all, or a list (one per prompt; each gets its own
        sampler state)."""
        mt = max_tokens if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(prompts)
        sp = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        rids = [self.submit(p, m, stop, sampling=s) for p, m, s in zip(prompts, mt, sp)]
        while self.pending():
            self.step()
        if self.streaming:
            done = {rid: ev for rid, ev in self.poll() if isinstance(ev, Done)}
            return [done[r] for r in rids]
        return [self._done.pop(r) for r in rids]
