"""Prefill: the prompts of the requests a step admits, decoded together.

Each request first learns where its decode starts (the prompt cache, :mod:`.prompt_cache`: only what
its slot's memories lack).  Then the remaining prompt tokens of all of them are packed, in order,
into target decodes of at most ``n_batch`` rows -- several sequences per decode, as llama-server
batches the prompts of its slots -- each decode's feature rows observed by the proposer per
sequence.  A request's first token is picked from its last prompt row right after the decode that
holds it.  One request alone is decoded exactly as before: its prompt in chunks of ``n_batch``.
"""

from __future__ import annotations

import time
from typing import List, Sequence

import numpy as np

from pyllama_dspark.decode.request import Request, device_greedy, token_probs
from pyllama_dspark.speculative.drafter import observe_later


def prefill(dec, reqs: Sequence[Request]) -> None:
    """Decode the prompts of ``reqs`` (admitted, slots assigned) and emit each one's first token
    (``dec``: the :class:`~.loop.Decoder`)."""
    tgt, prop, cache = dec.target, dec._prop, dec.cache
    t0 = time.perf_counter()
    todo: List[list] = []   # [request, next position to decode, checkpoint stop or None]
    for s in sorted(reqs, key=lambda r: r.seq_id):   # rows in sequence order (see .loop's step)
        s.t_start = t0
        seq = s.seq_id
        start, row = cache.resume(tgt, prop, seq, s.prompt, device_greedy(s)) if s.reuse else (0, None)
        if not s.reuse:
            cache.forget(seq)
        s.stats.n_cached = int(start)
        if row is not None:   # the same prompt again: its row was kept, nothing to decode
            _first_token(dec, s, row=row)
            continue
        if start == 0:
            tgt.seq_rm(seq, 0, -1)
            if prop is not None:
                prop.reset(seq)
        # the first token: from the device's top 2 where the request is greedy (the prompt cache
        # then keeps that token, not a row: llama/backend_sampling.py), else from the logits row
        tgt.samplers.want(seq, device_greedy(s))
        # a hybrid slot that keeps its memories stops short of the prompt's end for a checkpoint
        cut = cache.checkpoint_at(tgt, seq, start, s.prompt.size) if dec.keep_memory else None
        todo.append([s, start, cut])
    # with a cost-driven policy the prompt's feature rows wait on the host until a block is drafted:
    # a run in which drafting never pays makes no draft decode at all (the first is a cold one)
    defer = prop is not None and dec._policy is not None and dec._policy.uses_cost
    nb = tgt.n_batch
    tok, pos, seqs = np.zeros(nb, dtype=np.int32), np.zeros(nb, dtype=np.int32), np.zeros(nb, dtype=np.int32)
    outs = np.zeros(nb, dtype=np.int8)
    while todo:
        n, pieces = 0, []
        for item in todo:
            if n == nb:
                break
            s, c0, cut = item
            k = min(s.prompt.size - c0, nb - n, cut - c0 if cut is not None and c0 < cut else nb)
            tok[n:n + k] = s.prompt[c0:c0 + k]
            pos[n:n + k] = np.arange(c0, c0 + k, dtype=np.int32)
            seqs[n:n + k] = s.seq_id
            outs[n:n + k] = 0
            done = c0 + k == s.prompt.size
            if done:
                outs[n + k - 1] = 1
            pieces.append((item, n, k, done))
            item[1] = c0 + k
            n += k
        tgt.decode_rows(tok[:n], pos[:n], seqs[:n], outs[:n])
        for (s, c_end, cut), row0, k, _ in pieces:
            if c_end == cut:
                cache.add_checkpoint(tgt, s.seq_id)
            if defer:
                observe_later(prop, row0, k, c_end - k, s.seq_id)
            elif prop is not None:
                prop.observe(row0, k, c_end - k, s.seq_id)
        for (s, _, _), row0, k, done in pieces:
            if done:
                _first_token(dec, s, idx=row0 + k - 1)
        todo = [p[0] for p in pieces if not p[3]] + todo[len(pieces):]


def _first_token(dec, s: Request, idx: int = -1, row=None) -> None:
    """The request's first token from its last prompt row (output ``idx`` of the last decode, or
    the kept ``row``), then the bookkeeping of a finished prefill."""
    tgt = dec.target
    if isinstance(row, (int, np.integer)):   # a kept greedy token (prompt cache, device read-out)
        s.anchor = int(row)
    elif row is None and tgt.samplers.has(s.seq_id):   # greedy, read out on the device: no row here
        tgt.argmax(idx, 1, dec._ids, dec._margin)
        s.anchor = int(dec._ids[0])
        if dec.keep_memory:
            dec.cache.prompt_row[s.seq_id] = (s.prompt.copy(), None, s.anchor)
    elif row is None:
        row = tgt.logits_view(idx)
        if dec.keep_memory:
            dec.cache.prompt_row[s.seq_id] = (s.prompt.copy(), row.copy(), int(np.argmax(row)))
        if s.smp is None:
            tgt.argmax(idx, 1, dec._ids, dec._margin)
            s.anchor = int(dec._ids[0])
        else:
            s.anchor = s.smp.sample(s.smp.probs(row))
    else:
        s.anchor = int(np.argmax(row)) if s.smp is None else s.smp.sample(s.smp.probs(row))
    if s.n_probs:
        s.pending_probs = token_probs(s, tgt, 0, [s.anchor], row=row)
    if s.smp is not None:
        s.smp.accept((s.anchor,))
    s.stats.n_prompt = int(s.prompt.size)
    s.stats.ms_prefill = (time.perf_counter() - s.t_start) * 1e3
    s.pos0 = int(s.prompt.size)
    dec._emit(s, [s.anchor])
