"""The RAM prompt cache (``--cache-ram``, :mod:`pyllama_dspark.llama.prompt_state`) and hybrid
checkpoints (``--ctx-checkpoints``), on the loop.

References:
* a restored state drafts as a fresh prefill does: the draft's block logits after a conversation
  came back from host RAM equal those after the same prompt prefilled from scratch (the rounding
  floor: a fresh prefill twice); a draft memory or pending feature rows left behind move them far;
* a hybrid target's returning prompts, resumed from a checkpoint, give Llama's own greedy tokens
  (llama-cpp-python on the same file), and the prefix reused is the law's: the whole held state
  when the prompt continues it, else everything before the checkpoint 4 tokens before the last
  prompt's end;
* the store's rules (llama-server's ``server_prompt_cache``) as exact laws on token lists, and its
  limit against the process's resident memory.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from greedy_ref import greedy

from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.decode.loop import Decoder
from pyllama_dspark.decode.prompt_cache import CHECKPOINT_OFFSET
from pyllama_dspark.gguf.target_writer import make_test_target
from pyllama_dspark.gguf.testing import make_test_draft
from pyllama_dspark.llama.prompt_state import MIB, PromptStore, common_prefix
from pyllama_dspark.paths import default_draft
from pyllama_dspark.speculative.drafter import DraftModelProposer
from pyllama_dspark.speculative.policy import VerifyPolicy

A = "Question: name three fruits and say which one is the sweetest.\nAnswer:"
B = "The capital of France is a city that"


def _run(dec, prompt, n, **kw):
    rid = dec.submit(np.asarray(prompt, dtype=np.int32), n, reuse_prefix=True, **kw)
    while dec.pending():
        dec.step()
    return [ev for r, ev in dec.poll() if r == rid][-1]


class _Deferring(VerifyPolicy):
    """Cost-driven for the prefill (its captured feature rows stay on the host until a block is
    drafted) and never drafting: the requests here end at their first token."""

    uses_cost = True

    def want_draft(self, n_requests: int) -> bool:
        return False


def _block_rows(prop, anchor, pos0):
    p = prop.propose(anchor, pos0, prop.max_draft())
    return p.tokens, np.stack([prop.draft.logits(i) for i in range(prop.max_draft())])


@pytest.mark.parametrize("pending", [False, True], ids=["draft-memory", "pending-rows"])
def test_a_restored_state_drafts_as_a_fresh_prefill(target_path, pending):
    """One slot, two conversations: B evicts A into host RAM, A's next turn restores it.  The
    draft's block logits then equal a fresh prefill's; the planted bug (the draft's memory, or the
    feature rows still on the host, not restored) moves them far beyond the rounding floor."""
    with Speculator(target_path, default_draft(), n_ctx=2048, schedule="off") as sp:
        prop = sp.proposer
        assert isinstance(prop, DraftModelProposer)
        pa, pb = sp.tokenize(A), sp.tokenize(B)   # (chat prompts would share their system prompt)
        first = sp.generate(pa, 12, reuse_prefix=True)
        longer = list(pa) + list(first.tokens[:-1]) + sp.tokenize("\nAnd the least sweet?", add_special=False)

        def after(bug=None):
            store = PromptStore(64)
            dec = Decoder(sp.target, prop, streaming=True, keep_memory=True, store=store, slots=[0],
                          policy=_Deferring() if pending else None)
            _run(dec, pa, 1)                          # A's prompt (its rows deferred with `pending`)
            assert (prop.deferred_rows(0) > 0) == pending
            _run(dec, pb, 1)                          # B takes the slot: A's state goes to host RAM
            assert store.info()["saved"] == 1 and store.info()["states"] == 1
            real = prop.load_state
            if bug is not None:
                prop.load_state = bug
            try:
                done = _run(dec, longer, 1)           # A comes back: restored, then its new tokens
            finally:
                prop.load_state = real
            assert store.info()["hits"] == 1 and done.stats.n_cached == len(pa)   # all A held
            prop.catch_up(0)
            return _block_rows(prop, done.tokens[0], len(longer))

        def fresh():
            dec = Decoder(sp.target, prop, streaming=True, keep_memory=True, slots=[0])
            dec.cache.forget(0)
            done = _run(dec, longer, 1)
            assert done.stats.n_cached == 0
            return _block_rows(prop, done.tokens[0], len(longer))

        toks_hit, rows_hit = after()
        toks_fresh, rows_fresh = fresh()
        _, rows_again = fresh()

        def forget_draft(state, seq_id=0):   # the bug: the target restored, the draft not
            DraftModelProposer.reset(prop, seq_id)

        def drop_pending(state, seq_id=0):   # the bug: the rows kept on the host lost
            if state is not None:
                state.pending = None
            DraftModelProposer.load_state(prop, state, seq_id)
        _, rows_bug = after(drop_pending if pending else forget_draft)
    fin = np.isfinite(rows_fresh)

    def gap(rows):
        return float(np.abs(rows[fin] - rows_fresh[fin]).max())
    diff, floor, bug = gap(rows_hit), gap(rows_again), gap(rows_bug)
    print(f"\ndraft block logits after a RAM-cache restore vs a fresh prefill: max |diff| {diff:.4f} "
          f"(fresh twice {floor:.4f}; planted bug {bug:.3f})")
    assert diff < 0.25, diff
    assert bug > 4 * max(diff, 0.05), (bug, diff)
    assert np.array_equal(toks_hit, toks_fresh) or diff < 0.25


# ---- hybrid targets: checkpoints -------------------------------------------------------------------
N_GEN = 12


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    d = tmp_path_factory.mktemp("store-qwen35")
    target = str(make_test_target(d / "target.gguf", "qwen35", n_vocab=4096, seed=11, vocab_type="f32"))
    return target, str(make_test_draft(target, d / "draft.gguf", kind="dspark", seed=5))


def _hybrid_trace(target, draft, off_by: int = 0):
    """4 conversations x 3 turns on 2 slots of a hybrid target: (prompt, our tokens, n_cached, the
    tokens the conversation's state held before, the previous prompt's length) per turn.  Conversations 0 and 1 continue their replies as
    generated; 2 and 3 as a template that re-renders a reply would (its first tokens changed)."""
    from llama_cpp import Llama

    rng = np.random.default_rng(0)
    out = []
    with Speculator(target, draft, n_ctx=1024, n_batch=64, n_ubatch=64, n_seq=2, n_threads=1, schedule="off") as sp:
        dec = Decoder(sp.target, sp.proposer, streaming=True, keep_memory=True, store=PromptStore(256), cache_idle_slots=True)
        if off_by:
            from pyllama_dspark.llama import recurrent

            real = recurrent.Checkpoint.restore

            def restore(self, tgt, seq):   # the planted bug: resumed one position off
                real(self, tgt, seq)
                self.pos += off_by
            recurrent.Checkpoint.restore = restore
        try:
            convs = [list(rng.integers(10, 4000, 24)) for _ in range(4)]
            held, prev = [None] * 4, [0] * 4
            for turn in range(3):
                for c in range(4):
                    p = np.asarray(convs[c], dtype=np.int32)
                    r = _run(dec, p, N_GEN)
                    out.append((p, list(r.tokens), r.stats.n_cached, held[c], prev[c]))
                    held[c] = np.concatenate([p, np.asarray(r.tokens[:-1], dtype=np.int32)])
                    prev[c] = p.size
                    reply = list(r.tokens)
                    if c >= 2:
                        reply[:2] = [7, 8]
                    convs[c] = convs[c] + reply + list(rng.integers(10, 4000, 6))
            restored = dec.cache.n_restored
        finally:
            if off_by:
                recurrent.Checkpoint.restore = real
    llm = Llama(model_path=target, n_ctx=1024, n_batch=64, n_ubatch=64, n_threads=1, n_threads_batch=1,
                flash_attn=True, verbose=False)
    try:
        refs = [greedy(llm, list(p), N_GEN) for p, *_ in out]
    finally:
        llm.close()
    return out, refs, restored


def test_a_hybrid_conversation_resumes_from_its_state_or_a_checkpoint(qwen35):
    out, refs, restored = _hybrid_trace(*qwen35)
    bad = [k for k, ((_, ours, *_), ref) in enumerate(zip(out, refs)) if ours != ref]
    assert not bad, f"turns diverging from Llama greedy: {bad}"
    for k, (p, _, n_cached, held, prev_prompt) in enumerate(out):
        if held is None:
            continue
        lcp = common_prefix(held, p)
        # the whole held state when the prompt continues it (no cut); else the checkpoint taken
        # CHECKPOINT_OFFSET tokens before the previous prompt's end
        want = lcp if lcp == held.size else prev_prompt - CHECKPOINT_OFFSET
        assert n_cached == want, (k, n_cached, want, lcp, held.size)
    assert restored == 4, restored   # conversations 2 and 3, turns 2 and 3


def test_a_checkpoint_restored_one_position_off_is_caught(qwen35):
    out, refs, _ = _hybrid_trace(*qwen35, off_by=1)
    assert any(ours != ref for (_, ours, *_), ref in zip(out, refs))


# ---- the store's rules and limit -------------------------------------------------------------------
class _State:
    def __init__(self, tokens, nbytes):
        self.tokens, self.nbytes = np.asarray(tokens, dtype=np.int32), nbytes


def _save(store, tokens, nbytes):
    t = np.asarray(tokens, dtype=np.int32)
    return store.save(t, nbytes, lambda: _State(t, nbytes))


def test_the_store_follows_llama_servers_rules():
    s = PromptStore(1)   # 1 MiB
    assert _save(s, [1, 2, 3, 4], 300_000)
    assert not _save(s, [1, 2], 10)                      # held by a kept state: not saved again
    assert _save(s, [1, 2, 3, 4, 5, 6], 300_000)         # holds [1..4]: that one is obsolete, dropped
    assert [list(x.tokens) for x in s.states] == [[1, 2, 3, 4, 5, 6]]
    assert _save(s, [9, 9, 9, 9], 300_000) and _save(s, [8, 8, 8, 8], 300_000)
    assert _save(s, [7, 7, 7, 7], 300_000)               # 4 x 300 kB > 1 MiB: the oldest goes
    assert [x.tokens[0] for x in s.states] == [9, 8, 7] and s.info()["evicted"] == 1
    assert not _save(s, [6] * 4, 2 * MIB)                # larger than the whole limit: not kept
    assert s.size() <= MIB
    # take_best: better on both keep and similarity than what the slot holds, keeping >= 1/4
    assert s.take_best(np.asarray([9, 9, 9, 9]), np.asarray([9, 9, 9, 9, 1], dtype=np.int32)) is None
    got = s.take_best(None, np.asarray([8, 8, 8, 5, 5], dtype=np.int32))
    assert list(got.tokens) == [8, 8, 8, 8] and len(s.states) == 2
    got = s.take_best(None, np.asarray([7] + [0] * 20, dtype=np.int32))   # keeps a quarter: the bound is inclusive
    assert list(got.tokens) == [7, 7, 7, 7]
    assert _save(s, [5] * 5, 10) and s.take_best(None, np.asarray([5] + [0] * 20, dtype=np.int32)) is None
    assert s.info()["hits"] == 2 and s.info()["misses"] == 2


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def test_the_limit_holds_in_resident_memory(target_path):
    """Conversations that would keep ~4x the limit in host RAM: the oldest states go first, the
    store stays within its limit and the process's RSS grows by less than the limit plus 32 MiB."""
    limit = 16
    with Speculator(target_path, default_draft(), n_ctx=4096, schedule="off") as sp:
        store = PromptStore(limit)
        dec = Decoder(sp.target, sp.proposer, streaming=True, keep_memory=True, store=store, slots=[0])
        prompts = [sp.chat_prompt([{"role": "user", "content": f"Story {i}: " + "tell me about the sea. " * 40}]).tokens
                   for i in range(12)]
        _run(dec, prompts[0], 2)
        gc.collect()
        rss0, total = _rss(), 0
        for k, p in enumerate(prompts[1:], 1):
            _run(dec, p, 2)
            total = max(total, store.info()["saved"])
            assert store.size() <= limit * MIB
        gc.collect()
        grew = _rss() - rss0
        kept = [int(x.tokens[4:12].sum()) for x in store.states]
        per = store.size() / max(1, len(store.states))
    print(f"\nRAM cache {limit} MiB: {store.info()}, ~{per / MIB:.2f} MiB per state; RSS grew {grew / MIB:.1f} MiB")
    assert store.info()["saved"] == 11 and store.info()["evicted"] >= 11 - limit * MIB // per
    assert per * 11 > 2 * limit * MIB, "the trace must overflow the limit to test it"
    # the newest states survive, in order: their prompts' first tokens are the latest conversations'
    newest = [int(np.asarray(p)[4:12].sum()) for p in prompts[-1 - len(kept):-1]]
    assert kept == newest
    assert grew < (limit + 32) * MIB, grew / MIB
