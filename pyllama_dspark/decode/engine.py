"""The anchor-first speculative cycle for one sequence, as a generator of events.

    prefill (n_batch chunks, features of every chunk observed by the proposer)
    repeat: propose -> verify [anchor, drafts] in one target decode -> accept (pure rule)
            -> roll back the target's rejected tail -> proposer observes the committed rows

At temperature 0 the emitted tokens are exactly the target's greedy tokens.  At temperature > 0
(``sampling=SamplingParams(...)``) the anchor after the prompt is sampled from the target, the
proposer draws its drafts (with the distributions they came from) and speculative sampling
(:func:`~.verify.speculative_accept`) makes the output distributed exactly as plain sampling from
the target with the same sampler chain; a fixed seed makes it deterministic.
"""

from __future__ import annotations

import time
from typing import Iterator, List, Optional, Sequence, Union

import numpy as np

from pyllama_dspark.decode.cycle import Chunk, Done, OneHotRows, Stats, TargetRows, TextStream, propose_sampled
from pyllama_dspark.spec.drafter import NoDraft, Proposer, clamp_n_max, observe_later
from pyllama_dspark.errors import ContextOverflowError
from pyllama_dspark.llama.handles import Target
from pyllama_dspark.spec.sampling import SamplingParams, TokenSampler
from pyllama_dspark.spec.verify import greedy_accept, speculative_accept


class SpecDecoder:
    """Speculative decoding of one sequence on a Target with a pluggable Proposer."""

    def __init__(self, target: Target, proposer: Optional[Proposer] = None, *, seq_id: int = 0,
                 tie_eps: float = 1e-3, policy=None):
        self.target = target
        self.proposer = proposer or NoDraft()
        self.seq_id = seq_id
        self.tie_eps = tie_eps
        # a pyllama_dspark.spec.policy.VerifyPolicy (None: verify every drafted token); its decisions use
        # only the draft's own confidences and past cycles, so greedy and sampled output stay lossless
        self.policy = policy
        cap = target.n_batch
        self._verify = np.zeros(cap, dtype=np.int32)
        self._ids = np.zeros(cap, dtype=np.int32)
        self._margin = np.zeros(cap, dtype=np.float32)
        self._mem_state = None    # (proposer, prompt, emitted, pos0) the memories hold, if known
        self._prompt_row = None   # (prompt, logits row after it), kept when reuse_prefix is on

    def check_prompt(self, prompt: Sequence[int]) -> np.ndarray:
        ids = list(prompt)
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)) for t in ids):
            raise TypeError("prompt token ids must be integers")
        if not ids:
            raise ValueError("the prompt is empty")
        if min(ids) < 0 or max(ids) >= self.target.n_vocab:
            raise ValueError(f"prompt token ids must be in 0..{self.target.n_vocab - 1}")
        toks = np.asarray(ids, dtype=np.int32)
        if toks.size + 1 > self.target.n_ctx:
            raise ContextOverflowError(
                f"prompt of {toks.size} tokens does not fit the context of {self.target.n_ctx} tokens")
        return toks

    def stream(self, prompt: Sequence[int], max_tokens: int = 256, *, n_max: int = 7,
               stop: Sequence[str] = (), ignore_eos: bool = False,
               sampling: Optional[SamplingParams] = None,
               reuse_prefix: bool = False) -> Iterator[Union[Chunk, Done]]:
        """Yield a Chunk per cycle, then one Done with the whole result and its Stats.

        ``sampling`` None (or temperature <= 0) is greedy decoding; otherwise speculative sampling
        with llama.cpp's sampler chain and these parameters.

        ``reuse_prefix``: keep what the memories already hold of this prompt (from the previous
        stream on this decoder, finished or abandoned at a Chunk) and decode only the rest; the
        same prompt again costs no target decode at all.  Off by default: a partial re-decode
        changes batch shapes, hence the last bits of the logits, versus a fresh prefill."""
        toks = self.check_prompt(prompt)
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if not all(isinstance(s, str) for s in stop):
            raise TypeError("stop must be a sequence of strings")
        if not all(stop):
            raise ValueError("stop strings must be non-empty (an empty one would match before any text)")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
        smp = None
        if sampling is not None and (not sampling.is_greedy or sampling.has_penalties):
            # (at T = 0 with penalties the sampler's rows are one-hot at the penalized argmax: llama.cpp
            # penalizes before its greedy pick)
            # like llama.cpp's --ignore-eos at T > 0: end-of-generation tokens get a -inf logit bias
            banned = np.flatnonzero(self.target.eog_mask) if ignore_eos else None
            smp = TokenSampler(sampling, toks.tolist(), banned=banned)
        return self._stream(toks, max_tokens, n_max, stop, ignore_eos, smp, reuse_prefix)

    def _memory_tokens(self) -> Optional[np.ndarray]:
        """Tokens at positions 0.. of the memories after the previous stream (None if unknown)."""
        st = self._mem_state
        if st is None or st[0] is not self.proposer:
            return None
        _, toks, out, pos0 = st
        return np.concatenate([toks, np.asarray(out[:pos0 - toks.size], dtype=np.int32)])

    def _prefill_reusing(self, toks: np.ndarray) -> np.ndarray:
        """Brings the memories to exactly toks, decoding only what they do not hold yet; returns
        the logits row after the last prompt token (a view, or the copy kept from an earlier
        stream of the same prompt)."""
        tgt, prop, seq = self.target, self.proposer, self.seq_id
        mem = self._memory_tokens()
        self._mem_state = None
        start = 0
        if mem is not None:
            m = min(mem.size, toks.size)
            diff = np.flatnonzero(mem[:m] != toks[:m])
            start = int(diff[0]) if diff.size else m
            kept = self._prompt_row
            if (start == toks.size and kept is not None and np.array_equal(kept[0], toks)
                    and tgt.can_resume_at(seq, start)):
                tgt.seq_rm(seq, start, -1)
                prop.rollback(start, seq)
                return kept[1]
            start = min(start, toks.size - 1)
            if not tgt.can_resume_at(seq, start):
                start = 0   # an SWA cache no longer holds the window before start: decode it all again
            tgt.seq_rm(seq, start, -1)
            prop.rollback(start, seq)
        else:
            tgt.seq_rm(seq, 0, -1)
            prop.reset(seq)
        self._prompt_row = None
        nb = tgt.n_batch
        for c0 in range(start, toks.size, nb):
            chunk = toks[c0:c0 + nb]
            tgt.decode(chunk, c0, seq, all_outputs=False)
            prop.observe(0, len(chunk), c0, seq)
        row = tgt.logits_view(len(chunk) - 1)
        self._prompt_row = (toks.copy(), row.copy())
        return row

    def _stream(self, toks: np.ndarray, max_tokens: int, n_max: int, stop: Sequence[str], ignore_eos: bool,
                smp: Optional[TokenSampler], reuse: bool = False) -> Iterator[Union[Chunk, Done]]:
        n_max = clamp_n_max(n_max, self.proposer) if not isinstance(self.proposer, NoDraft) else 0
        tgt, prop, seq = self.target, self.proposer, self.seq_id
        stats = Stats(n_prompt=int(toks.size), seed=None if smp is None else smp.seed)
        clock = time.perf_counter

        # ---- prefill ----
        t0 = clock()
        if not reuse:
            self._mem_state = None
            tgt.seq_rm(seq, 0, -1)
            prop.reset(seq)
            nb = tgt.n_batch
            for c0 in range(0, toks.size, nb):
                chunk = toks[c0:c0 + nb]
                tgt.decode(chunk, c0, seq, all_outputs=False)
                prop.observe(0, len(chunk), c0, seq)
            if smp is None:
                tgt.argmax(len(chunk) - 1, 1, self._ids, self._margin)
                anchor = int(self._ids[0])
            else:
                anchor = smp.sample(smp.probs(tgt.logits_view(len(chunk) - 1)))
        else:
            row = self._prefill_reusing(toks)
            anchor = int(np.argmax(row)) if smp is None else smp.sample(smp.probs(row))
        if smp is not None:
            smp.accept((anchor,))
        stats.ms_prefill = (clock() - t0) * 1e3

        out_tokens: List[int] = []
        text = TextStream(tgt, stop)
        t_gen = clock()
        pos0 = int(toks.size)
        pending = [anchor]  # tokens emitted but not yet reported

        def emit(tok: int) -> Optional[str]:
            out_tokens.append(tok)
            if not ignore_eos and tgt.is_eog(tok):
                return "stop"
            text.push(tok)
            if text.stopped:
                return "stop"
            if len(out_tokens) >= max_tokens:
                return "length"
            return None

        finish = emit(anchor)
        eog = None if ignore_eos else tgt.eog_mask
        while finish is None:
            if pos0 + 1 >= tgt.n_ctx:
                finish = "length"
                break
            # llama-server's limit: room in the context, and max_tokens not exceeded inside a block
            n_draft_max = min(tgt.n_ctx - pos0 - 2, max_tokens - len(out_tokens) - 1)
            t1 = clock()
            drafts = self._ids[:0]
            q = None
            pol = self.policy
            if n_max > 0 and n_draft_max > 0 and (pol is None or pol.want_draft(1)):
                n_prop = min(n_max, tgt.n_ctx - pos0 - 2)   # the draft block must fit the context too
                if smp is None:
                    proposal = prop.propose(anchor, pos0, n_prop, seq)
                    drafts = proposal.tokens[:n_draft_max]
                else:
                    proposal = propose_sampled(prop, anchor, pos0, n_prop, smp, seq)
                    drafts = np.asarray(proposal.tokens[:n_draft_max], dtype=np.int32)
                    q = proposal.probs
                t_drafted = clock()
                if pol is not None and pol.mode != "off" and len(drafts):
                    ell = pol.lengths([proposal.confidence], [len(drafts)])[0]
                    drafts = drafts[:ell]
                    if q is not None:
                        q = q[:ell]
                if pol is not None:   # after the cut: at T > 0 the time depends on the drafted tokens
                    pol.observe_draft(1, (t_drafted - t1) * 1e3)
            t2 = clock()
            k = len(drafts)
            v = self._verify[:k + 1]
            v[0] = anchor
            v[1:] = drafts
            tgt.decode(v, pos0, seq, all_outputs=True)
            if smp is None:
                tgt.argmax(0, k + 1, self._ids, self._margin)
                t3 = clock()
                n_acc = greedy_accept(drafts, self._ids, eog)
                stats.near_ties += int(np.count_nonzero(self._margin[:n_acc + 1] < self.tie_eps))
                emitted = self._ids[:n_acc + 1].tolist()
            else:
                t3 = clock()
                drafts = drafts.copy()
                q_rows = OneHotRows(drafts, tgt.n_vocab) if q is None else q
                p_rows = TargetRows(tgt, smp, drafts)
                n_acc, emitted = speculative_accept(drafts, q_rows, p_rows, smp.rng.random, eog)
                smp.accept(emitted)
                t_acc = clock()
                stats.ms_sample += (t_acc - t3) * 1e3
                t3 = t_acc
            stats.record(k, n_acc)
            if pol is not None:
                pol.update(k, n_acc, proposal.confidence if k else None)
            # like llama.cpp: the draft gets the features of every verify row, then both memories
            # drop the rejected positions; a cycle without drafts leaves its row on the host until
            # the next block (no draft decode while the policy keeps drafting off)
            if k:
                prop.observe(0, k + 1, pos0, seq)
            else:
                observe_later(prop, 0, 1, pos0, seq)
            if n_acc < k:
                tgt.seq_rm(seq, pos0 + n_acc + 1, -1)
                prop.rollback(pos0 + n_acc + 1, seq)
            t4 = clock()
            stats.ms_draft += (t2 - t1) * 1e3
            stats.ms_verify += (t3 - t2) * 1e3
            stats.ms_inject += (t4 - t3) * 1e3
            for tok in emitted:
                pending.append(tok)
                finish = emit(tok)
                if finish is not None:
                    break
            anchor = emitted[-1]
            pos0 += n_acc + 1
            if finish is None:
                self._mem_state = (prop, toks, out_tokens, pos0)
                yield Chunk(pending, text.flush())
                self._mem_state = None
                pending = []
        self._mem_state = (prop, toks, out_tokens, pos0)
        stats.ms_total = (clock() - t_gen) * 1e3
        stats.n_generated = len(out_tokens)
        if self.policy is not None and n_max > 0:
            stats.schedule = self.policy.summary(stats.verify_lengths)
        tail = text.flush(final=True)
        if pending or tail:
            yield Chunk(pending, tail)
        yield Done(out_tokens, text.text, finish, stats)

    def generate(self, prompt: Sequence[int], max_tokens: int = 256, **kw) -> Done:
        done = None
        for ev in self.stream(prompt, max_tokens, **kw):
            if isinstance(ev, Done):
                done = ev
        return done
