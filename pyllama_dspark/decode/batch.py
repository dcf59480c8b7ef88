"""Batched DSpark decoding of R sequences: one draft decode and one target decode per step.

Each step:
  1. the policy decides whether a draft pass can pay (profiled schedule; else always);
  2. one draft decode holds every active sequence's block [anchor, mask...] (equal-size blocks, as
     llama.cpp's DSpark graph requires per ubatch), noise blocks purged afterwards; greedy
     sequences take each row's argmax, sampled ones draw from the rows left to right with the
     Markov head conditioned on the token they drew (as :class:`~.engine.SpecDecoder` does);
  3. the policy picks each sequence's verify length l_r (Algorithm 1 across all R for `profiled`);
  4. one target decode holds every sequence's [anchor, drafts[:l_r]] (l_r = 0: plain decoding);
  5. per sequence: greedy accept (T = 0) or speculative sampling (T > 0), inject all its verify
     rows into the draft, roll back the rejected tail of both memories, emit; finished sequences
     free their slot and queued prompts join.

Greedy output of every sequence equals its own plain greedy output; sampled output is distributed
as plain sampling from the target with the same sampler chain.

Requests: :meth:`BatchDecoder.submit` queues one (its own sampling parameters, stop strings,
max_tokens), :meth:`step` advances every active one, :meth:`poll` hands out what each step
produced (``(rid, Started)``, ``(rid, Chunk)`` ... ``(rid, Done)``) when ``streaming`` is on, :meth:`cancel` drops a
request at a step boundary.  :meth:`run` drives a list of prompts to the end.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from pyllama_dspark.spec.drafter import DraftModelProposer, NoDraft, Proposer, check_n_max, observe_later
from pyllama_dspark.decode.cycle import Chunk, Done, OneHotRows, Stats, TargetRows, TextStream, propose_sampled
from pyllama_dspark.errors import ContextOverflowError
from pyllama_dspark.llama.handles import Draft, Target
from pyllama_dspark.spec.policy import VerifyPolicy
from pyllama_dspark.spec.sampling import SamplingParams, TokenSampler
from pyllama_dspark.spec.verify import greedy_accept, speculative_accept


@dataclass
class Started:
    """Streaming event: the request got sequence slot ``slot`` and its prompt was decoded."""
    slot: int


@dataclass
class _Seq:
    rid: int
    seq_id: int
    prompt: np.ndarray
    max_tokens: int
    text: TextStream
    smp: Optional[TokenSampler] = None
    ignore_eos: bool = False
    out: List[int] = field(default_factory=list)
    pending: List[int] = field(default_factory=list)   # emitted, not yet handed out by poll()
    anchor: int = 0
    pos0: int = 0
    finish: Optional[str] = None
    stats: Stats = field(default_factory=Stats)
    t_start: float = 0.0


class BatchDecoder:
    """Speculative decoding of up to ``target.settings.n_seq_max`` sequences at once."""

    def __init__(self, target: Target, proposer: Union[Draft, Proposer, None] = None, *, n_max: int = 7,
                 policy: Optional[VerifyPolicy] = None, streaming: bool = False, tie_eps: float = 1e-3):
        """``proposer``: a Draft (its blocks are decoded together in one draft decode), any other
        Proposer (asked per sequence, e.g. the oracle), or None (plain batched decoding).
        ``streaming``: keep per-step events for :meth:`poll` (results are then not kept for
        :meth:`result`).  ``tie_eps``: a greedy verify row whose top-2 logit gap is below it counts
        as a numerical near-tie in the sequence's stats (as in the single-sequence engine)."""
        self.target = target
        self.tie_eps = float(tie_eps)
        self.n_slots = int(target.settings.n_seq_max)
        if isinstance(proposer, Draft):
            if int(proposer.settings.n_seq_max) < self.n_slots:
                raise ValueError("the draft context needs as many sequences as the target's")
            proposer = DraftModelProposer(proposer)
        self.prop: Optional[Proposer] = proposer if not isinstance(proposer, NoDraft) else None
        self.n_max = 0
        if self.prop is not None:
            self.n_max = min(check_n_max(n_max), self.prop.max_draft())
        self.policy = policy or VerifyPolicy()
        if (self.policy.needs_confidence and isinstance(self.prop, DraftModelProposer)
                and not self.prop.meta.has_confidence):
            raise ValueError(f"the {self.policy.mode} schedule needs a draft with a confidence head")
        self.streaming = streaming
        # every sequence's verify rows go into one target decode (and its block into one draft
        # decode): llama.cpp aborts on a batch larger than n_batch, so refuse the settings here
        rows = self.n_slots * (self.n_max + 1)
        if rows > target.n_batch:
            raise ValueError(f"{self.n_slots} sequences x {self.n_max + 1} verify rows = {rows} exceeds the "
                             f"target's n_batch {target.n_batch}: raise n_batch or lower n_max / the slots")
        if isinstance(self.prop, DraftModelProposer):
            blocks = self.n_slots * (self.n_max + self.prop.offset)
            if blocks > self.prop.draft.n_batch:
                raise ValueError(f"{self.n_slots} draft blocks of {self.n_max + self.prop.offset} rows exceed the "
                                 f"draft's n_batch {self.prop.draft.n_batch}")
        self.n_ctx_seq = target.n_ctx // self.n_slots
        self.eog = target.eog_mask
        self._free = list(range(self.n_slots))[::-1]
        self._active: List[_Seq] = []
        self._queue: Deque[_Seq] = deque()
        self._done: Dict[int, Done] = {}
        self._events: List[Tuple[int, Union[Started, Chunk, Done]]] = []
        self._next_rid = 0
        cap = target.n_batch
        self._ids = np.zeros(cap, dtype=np.int32)
        self._margin = np.zeros(cap, dtype=np.float32)
        self.steps = 0
        self.verify_batches: List[int] = []
        # (raw confidences of the drafted block, verified length, accepted) per sequence-step, for
        # calibration; only kept when ``record`` is set
        self.record = False
        self.records: List[tuple] = []

    # ---- requests -------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], max_tokens: int = 256, stop: Sequence[str] = (), *,
               sampling: Optional[SamplingParams] = None, ignore_eos: bool = False) -> int:
        """Queue one request; returns its id.  ``sampling`` None (or temperature 0) is greedy."""
        toks = np.asarray(list(prompt), dtype=np.int32)
        if toks.size == 0:
            raise ValueError("the prompt is empty")
        if toks.min() < 0 or toks.max() >= self.target.n_vocab:
            raise ValueError(f"prompt token ids must be in 0..{self.target.n_vocab - 1}")
        if toks.size + 1 > self.n_ctx_seq:
            raise ContextOverflowError(
                f"prompt of {toks.size} tokens does not fit the per-sequence context of {self.n_ctx_seq}")
        if max_tokens <= 0:
            raise ValueError("max_tokens must be >= 1")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
        smp = None
        if sampling is not None and (not sampling.is_greedy or sampling.has_penalties):
            # (T = 0 with penalties: one-hot rows at the penalized argmax, as llama.cpp picks)
            banned = np.flatnonzero(self.eog) if ignore_eos else None
            smp = TokenSampler(sampling, toks.tolist(), banned=banned)
        rid = self._next_rid
        self._next_rid += 1
        s = _Seq(rid, -1, toks, int(max_tokens), TextStream(self.target, stop), smp=smp, ignore_eos=ignore_eos)
        s.stats.seed = None if smp is None else smp.seed
        self._queue.append(s)
        return rid

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

    def _admit(self) -> None:
        while self._queue and self._free:
            s = self._queue.popleft()
            s.seq_id = self._free.pop()
            if self.streaming:
                self._events.append((s.rid, Started(s.seq_id)))
            if hasattr(self.prop, "bind"):  # per-sequence proposers (e.g. one oracle per prompt)
                self.prop.bind(s.seq_id, s.prompt)
            try:
                self._prefill(s)
            except BaseException:
                self._release(s)
                raise
            if s.finish is None:
                self._active.append(s)
            else:
                self._finish(s)

    def _prefill(self, s: _Seq) -> None:
        tgt, seq = self.target, s.seq_id
        s.t_start = time.perf_counter()
        tgt.seq_rm(seq, 0, -1)
        if self.prop is not None:
            self.prop.reset(seq)
        nb = tgt.n_batch
        for c0 in range(0, s.prompt.size, nb):
            chunk = s.prompt[c0:c0 + nb]
            tgt.decode(chunk, c0, seq, all_outputs=False)
            if self.prop is not None:
                self.prop.observe(0, len(chunk), c0, seq)
        if s.smp is None:
            tgt.argmax(len(chunk) - 1, 1, self._ids, self._margin)
            s.anchor = int(self._ids[0])
        else:
            s.anchor = s.smp.sample(s.smp.probs(tgt.logits_view(len(chunk) - 1)))
            s.smp.accept((s.anchor,))
        s.stats.n_prompt = int(s.prompt.size)
        s.stats.ms_prefill = (time.perf_counter() - s.t_start) * 1e3
        s.pos0 = int(s.prompt.size)
        self._emit(s, [s.anchor])

    def _emit(self, s: _Seq, toks: List[int]) -> None:
        for t in toks:
            s.out.append(int(t))
            s.pending.append(int(t))
            if not s.ignore_eos and self.eog[t]:
                s.finish = "stop"
                return
            s.text.push(int(t))
            if s.text.stopped:
                s.finish = "stop"
                return
            if len(s.out) >= s.max_tokens:
                s.finish = "length"
                return
        if s.pos0 + 1 >= self.n_ctx_seq:
            s.finish = "length"

    def _release(self, s: _Seq) -> None:
        self.target.seq_rm(s.seq_id, 0, -1)
        if self.prop is not None:
            self.prop.reset(s.seq_id)
        self._free.append(s.seq_id)

    def _finish(self, s: _Seq) -> None:
        tail = s.text.flush(final=True)
        s.stats.n_generated = len(s.out)
        if self.prop is not None:
            s.stats.schedule = self.policy.summary(s.stats.verify_lengths)
        s.stats.ms_total = (time.perf_counter() - s.t_start) * 1e3 - s.stats.ms_prefill
        done = Done(s.out, s.text.text, s.finish, s.stats)
        if self.streaming:
            if s.pending or tail:
                self._events.append((s.rid, Chunk(s.pending, tail)))
            self._events.append((s.rid, done))
        else:
            self._done[s.rid] = done
        s.pending = []
        self._release(s)

    # ---- one step for every active sequence -------------------------------------------------------
    def step(self) -> None:
        self._admit()
        act = self._active
        if not act:
            return
        R = len(act)
        tgt = self.target
        t0 = time.perf_counter()
        # 1-2. draft all blocks in one decode
        drafts: List[np.ndarray] = [np.zeros(0, dtype=np.int32)] * R
        confs: List[Optional[np.ndarray]] = [None] * R   # (a sequence without room drafts nothing)
        qs: List[Optional[list]] = [None] * R
        limits = [min(self.n_ctx_seq - s.pos0 - 2, s.max_tokens - len(s.out) - 1) for s in act]
        # sequences that may still draft (a draft model's block must also fit the context)
        nb = self.n_max + getattr(self.prop, "offset", 0)
        room = [r for r, l in enumerate(limits) if l > 0 and act[r].pos0 + nb <= self.n_ctx_seq]
        if self.prop is not None and room and self.policy.want_draft(len(room)):
            dr, cf, qq = self._draft_all([act[r] for r in room])
            for r, d_, c_, q_ in zip(room, dr, cf, qq):
                drafts[r], confs[r], qs[r] = d_[:limits[r]], c_, q_
        t1 = time.perf_counter()
        # 3. verify lengths
        lengths = self.policy.lengths(confs, [len(d) for d in drafts]) if self.prop is not None else [0] * R
        if any(len(d) for d in drafts):
            # after the cut: at T > 0 the pass's time depends on the drafted tokens themselves
            self.policy.observe_draft(len(room), (t1 - t0) * 1e3)
        # 4. one target decode with every sequence's verify rows
        rows_tok, rows_pos, rows_seq, offs = [], [], [], []
        for s, d, l in zip(act, drafts, lengths):
            offs.append(len(rows_tok))
            v = [s.anchor] + d[:l].tolist()
            rows_tok += v
            rows_pos += list(range(s.pos0, s.pos0 + len(v)))
            rows_seq += [s.seq_id] * len(v)
        n = len(rows_tok)
        tgt.decode_rows(np.asarray(rows_tok, dtype=np.int32), np.asarray(rows_pos, dtype=np.int32),
                        np.asarray(rows_seq, dtype=np.int32), np.ones(n, dtype=np.int8))
        tgt.argmax(0, n, self._ids, self._margin)
        t2 = time.perf_counter()
        self.verify_batches.append(n)
        # 5. accept, inject, roll back, emit
        ms_sample = [0.0] * R
        for r, (s, d, l, off) in enumerate(zip(act, drafts, lengths, offs)):
            k = l
            eog = None if s.ignore_eos else self.eog
            if s.smp is None:
                ids = self._ids[off:off + k + 1]
                n_acc = greedy_accept(d[:k], ids, eog)
                s.stats.near_ties += int(np.count_nonzero(self._margin[off:off + n_acc + 1] < self.tie_eps))
                emitted = ids[:n_acc + 1].tolist()
            else:
                ts = time.perf_counter()
                dk = np.asarray(d[:k], dtype=np.int32).copy()
                q_rows = OneHotRows(dk, tgt.n_vocab) if qs[r] is None else qs[r][:k]
                n_acc, emitted = speculative_accept(dk, q_rows, TargetRows(tgt, s.smp, dk, off), s.smp.rng.random, eog)
                s.smp.accept(emitted)
                ms_sample[r] = (time.perf_counter() - ts) * 1e3
            s.stats.record(k, n_acc)
            self.policy.update(k, n_acc, confs[r])
            if self.record and k > 0 and confs[r] is not None:
                self.records.append((confs[r][:len(d)].copy(), k, n_acc))
            if self.prop is not None:
                if k:
                    self.prop.observe(off, k + 1, s.pos0, s.seq_id)
                else:   # no drafts this step: the row waits on the host for the next block
                    observe_later(self.prop, off, 1, s.pos0, s.seq_id)
            if n_acc < k:
                tgt.seq_rm(s.seq_id, s.pos0 + n_acc + 1, -1)
                if self.prop is not None:
                    self.prop.rollback(s.pos0 + n_acc + 1, s.seq_id)
            s.pos0 += n_acc + 1
            s.anchor = emitted[-1]
            self._emit(s, emitted)
        t3 = time.perf_counter()
        inject_share = ((t3 - t2) * 1e3 - sum(ms_sample)) / R
        in_pass = set(room) if (self.prop is not None and any(len(d) for d in drafts)) else set()
        for r, s in enumerate(act):
            # the draft pass is shared by the sequences that were in it, not by those without room
            s.stats.ms_draft += (t1 - t0) * 1e3 / len(in_pass) if r in in_pass else 0.0
            s.stats.ms_verify += (t2 - t1) * 1e3 / R
            s.stats.ms_sample += ms_sample[r]
            s.stats.ms_inject += inject_share
        self.steps += 1
        still = []
        for s in act:
            if s.finish is None:
                still.append(s)
                if self.streaming and s.pending:
                    self._events.append((s.rid, Chunk(s.pending, s.text.flush())))
                    s.pending = []
            else:
                self._finish(s)
        self._active = still

    def _draft_all(self, act: List[_Seq]):
        """Drafts, raw confidences and (sampled sequences) the q rows they were drawn from."""
        p = self.prop
        R = len(act)
        if not isinstance(p, DraftModelProposer):
            props = [p.propose(s.anchor, s.pos0, self.n_max, s.seq_id) if s.smp is None else
                     propose_sampled(p, s.anchor, s.pos0, self.n_max, s.smp, s.seq_id) for s in act]
            return ([np.asarray(q.tokens, dtype=np.int32) for q in props], [q.confidence for q in props],
                    [q.probs for q in props])
        d = p.draft
        for s in act:
            p.catch_up(s.seq_id)
        nb = self.n_max + p.offset
        sampled = any(s.smp is not None for s in act)
        bs = p.block_sampler if sampled else None
        block = np.full(R * nb, p.meta.mask_token_id, dtype=np.int32)
        block[::nb] = [s.anchor for s in act]
        pos0 = np.asarray([s.pos0 for s in act], dtype=np.int32)
        seqs = np.asarray([s.seq_id for s in act], dtype=np.int32)
        d.decode_blocks(block, nb, pos0, seqs,
                        hidden=bs is not None and bs.conf is not None and bs.conditioning == "sampled")
        ids = np.zeros(R * nb, dtype=np.int32)
        margin = np.zeros(R * nb, dtype=np.float32)
        d.argmax(0, R * nb, ids, margin)
        conf_all = None
        if p.meta.has_confidence:
            conf_all = np.zeros(R * nb, dtype=np.float32)
            d.confidence(0, R * nb, conf_all)
        drafts, confs, qs = [], [], []
        for r, s in enumerate(act):
            a = r * nb + p.offset
            if s.smp is None:
                drafts.append(ids[a:a + self.n_max].copy())
                confs.append(conf_all[a:a + self.n_max].copy() if conf_all is not None else None)
                qs.append(None)
            else:
                toks, q, conf = bs.sample(a, self.n_max, s.smp)
                drafts.append(toks)
                confs.append(conf)
                qs.append(q)
        for s in act:
            d.seq_rm(s.seq_id, s.pos0, -1)  # purge the noise blocks before any injection
        return drafts, confs, qs

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
