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
from test_prompt_cache import tie_eps  # noqa: F401  (the fixture: the batch-shape bound of a near-tie)

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
    """Conversations that would keep ~3x the limit in host RAM: the oldest states go first, the
    store stays within its limit and the process's RSS grows by less than the limit plus 16 MiB."""
    limit = 16
    with Speculator(target_path, default_draft(), n_ctx=4096, schedule="off") as sp:
        store = PromptStore(limit)
        dec = Decoder(sp.target, sp.proposer, streaming=True, keep_memory=True, store=store, slots=[0])
        prompts = [sp.chat_prompt([{"role": "user", "content": f"Story {i}: " + "tell me about the sea. " * 40}]).tokens
                   for i in range(8)]
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
    assert store.info()["saved"] == 7 and store.info()["evicted"] >= 7 - limit * MIB // per
    assert per * 7 > 2 * limit * MIB, "the trace must overflow the limit to test it"
    # the newest states survive, in order: their prompts' first tokens are the latest conversations'
    newest = [int(np.asarray(p)[4:12].sum()) for p in prompts[-1 - len(kept):-1]]
    assert kept == newest
    assert grew < (limit + 16) * MIB, grew / MIB


# ---- serve: interleaved conversations ----------------------------------------------------------------
REPLY = 12   # tokens per reply in the serve traces
QUESTIONS = ["Name a fruit.", "Why that one?", "Tell me one more fact.", "Say it shorter.", "Name a colour.",
             "Why?", "Give an example.", "Thanks, one last word?"]


def _trace(srv, refs, n_conv, n_turns, label):
    """``n_conv`` conversations of ``n_turns`` turns sent in turn (1, 2, ..., 1, 2, ...): per
    returning turn, the prefix reused is everything the conversation's state held (the law:
    the common prefix of its previous prompt and reply with the new prompt, Llama's own
    tokenization), and only the rest is prefilled.  Returns the records for the greedy check."""
    from test_prompt_cache import _chat, _reply

    convs = [[{"role": "system", "content": f"You are assistant {c}. Be brief."}] for c in range(n_conv)]
    held = [None] * n_conv
    records, returning = [], 0
    for turn in range(n_turns):
        for c in range(n_conv):
            convs[c].append({"role": "user", "content": QUESTIONS[(c + turn) % len(QUESTIONS)]})
            out = _chat(srv, convs[c], max_tokens=REPLY)
            ids = np.asarray(refs.chat_tokens(convs[c]), dtype=np.int32)
            t = out["timings"]
            assert out["usage"]["prompt_tokens"] == ids.size and t["prompt_n"] + t["cache_n"] == ids.size
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == t["cache_n"]
            if held[c] is not None:
                # the state holds the prompt and the reply but its last token, or all of it where
                # that token was an accepted draft (verified, so in the memories)
                lo, hi = (min(common_prefix(h, ids), ids.size - 1) for h in (held[c][:-1], held[c]))
                assert lo <= t["cache_n"] <= hi, (label, c, turn, t, lo, hi)
                returning += 1
            reply_ids = [x["id"] for x in out["choices"][0]["logprobs"]["content"]]
            held[c] = np.concatenate([ids, np.asarray(reply_ids, dtype=np.int32)])
            records.append((f"{label} conversation {c} turn {turn + 1}", [dict(m) for m in convs[c]], out))
            convs[c].append({"role": "assistant", "content": _reply(out)})
    return records, returning


@pytest.mark.parametrize("n_slots,n_conv,n_turns,extra", [
    (2, 6, 8, []),                  # the trace: -np 2, 6 conversations of 8 turns
    (1, 3, 3, []),                  # a new user's: -np 1 (one slot, its own contexts), 3 conversations
    (2, 3, 2, ["-kvu"]),            # a unified KV buffer: idle slots are saved, then cleared
], ids=["np2-batched", "np1", "np2-kvu"])
def test_returning_conversations_are_never_prefilled_again(target_path, llama_refs, tmp_path, tie_eps,
                                                          n_slots, n_conv, n_turns, extra):
    """With the defaults (``--cache-ram 8192``, ``--cache-idle-slots``): every returning turn
    prefills only what its conversation's state lacks, and every reply is Llama's greedy reply
    (or differs at a counted near-tie); /slots and /metrics count the RAM cache's hits."""
    from test_prompt_cache import _check_records, _report

    from serve_helpers import ServeProcess

    srv = ServeProcess(target_path, default_draft(), tmp_path / "store.log", n_slots=n_slots, n_ctx=2048,
                       extra=["--schedule", "off", "--metrics"] + extra)
    try:
        records, returning = _trace(srv, llama_refs, n_conv, n_turns, f"-np {n_slots} {' '.join(extra)}")
        if "-kvu" in extra:
            # an unrelated prompt takes the slot nothing was similar to; its admission saved the
            # other, idle slot and cleared it (without -kvu both would hold their tokens)
            assert srv.post("/completion", {"prompt": "Once upon a time a dragon", "n_predict": 4}).status_code == 200
            assert sorted(sl["n_cached"] > 0 for sl in srv.get("/slots").json()) == [False, True]
        slots = srv.get("/slots").json()
        info = slots[0]["dspark_prompt_cache"]
        metrics = srv.get("/metrics").text
    finally:
        srv.stop()
    print(f"\n-np {n_slots} {extra}: {returning} returning turns, RAM cache {info}")
    # every conversation beyond the slots came back from host RAM at least once per turn
    assert info["hits"] >= (n_conv - n_slots) * (n_turns - 1), info
    assert f"llamacpp:dspark_prompt_cache_hits_total {float(info['hits'])}" in metrics
    excused: list = []
    _check_records(llama_refs, records, excused, tie_eps, REPLY)
    _report(excused, "conversations from the RAM cache")
    assert len(excused) <= 2, excused


def test_serve_reuses_a_hybrid_conversations_prefix(qwen35, tmp_path):
    """``serve -np 2`` on a hybrid target, 6 conversations x 8 turns through ``/completion`` (token
    prompts): every reply is Llama's greedy reply, and a returning turn whose prompt parts from
    the state inside the previous reply resumes from the checkpoint before the previous prompt's
    end (``cache_n``) instead of decoding the conversation again; with ``--ctx-checkpoints 0``
    it decodes everything again."""
    from llama_cpp import Llama

    from serve_helpers import ServeProcess

    target, draft = qwen35
    llm = Llama(model_path=target, n_ctx=1024, n_batch=64, n_ubatch=64, n_threads=1, n_threads_batch=1,
                flash_attn=True, verbose=False)
    try:
        for ckpts in ("32", "0"):
            srv = ServeProcess(target, draft, tmp_path / f"hybrid-{ckpts}.log", n_slots=2, n_ctx=1024,
                               extra=["--schedule", "off", "-b", "64", "-ub", "64", "--ctx-checkpoints", ckpts])
            rng = np.random.default_rng(1)
            convs = [[int(t) for t in rng.integers(10, 4000, 24)] for _ in range(6)]
            prev = [0] * 6
            try:
                for turn in range(8):
                    for c in range(6):
                        r = srv.post("/completion", {"prompt": convs[c], "n_predict": N_GEN, "temperature": 0,
                                                     "return_tokens": True})
                        assert r.status_code == 200, r.text
                        out = r.json()
                        assert out["tokens"] == greedy(llm, convs[c], N_GEN), (ckpts, c, turn)
                        if turn:   # the reply re-rendered: its first tokens changed
                            want = prev[c] - CHECKPOINT_OFFSET if ckpts != "0" else 0
                            assert out["timings"]["cache_n"] == want, (ckpts, c, turn, out["timings"], prev[c])
                        prev[c] = len(convs[c])
                        convs[c] = convs[c] + [7, 8] + out["tokens"][2:] + [int(t) for t in rng.integers(10, 4000, 6)]
            finally:
                srv.stop()
    finally:
        llm.close()


def test_the_dspark_class_restores_an_interleaved_conversation(target_path, llama_refs, tie_eps):
    """``DSpark(..., cache_prompt=True, cache_ram=64)``: two conversations in turn on one
    sequence; each returning turn restores its own state (``n_cached`` covers its previous
    prompt) and its reply is ``Llama``'s greedy reply (or a counted near-tie)."""
    from greedy_ref import check_near_tie_text

    from pyllama_dspark import DSpark

    excused = []
    with DSpark(target_path, default_draft(), n_ctx=2048, schedule="off", cache_prompt=True, cache_ram=64) as ds:
        convs = [[{"role": "system", "content": f"You are assistant {c}. Be brief."}] for c in range(2)]
        prev = [0, 0]
        for turn in range(3):
            for c in range(2):
                convs[c].append({"role": "user", "content": QUESTIONS[(c + 2 * turn) % len(QUESTIONS)]})
                out = ds.create_chat_completion(convs[c], max_tokens=16, temperature=0)
                text = out["choices"][0]["message"]["content"]
                ids = llama_refs.chat_tokens(convs[c])
                if turn:
                    assert ds.last_stats.n_cached >= prev[c], (c, turn, ds.last_stats.n_cached, prev[c])
                why = check_near_tie_text(llama_refs, ids, 16, text, tie_eps, prefix_ok=True)
                if why:
                    excused.append(why)
                prev[c] = len(ids)
                convs[c].append({"role": "assistant", "content": text})
        info = ds.prompt_cache_info
    assert info["hits"] >= 4, info   # every returning turn came back from host RAM
    assert len(excused) <= 1, excused
