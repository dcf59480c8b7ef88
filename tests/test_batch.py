"""Batched decoding of R sequences (one draft decode + one target decode per step) and schedules."""

from __future__ import annotations

import numpy as np
import pytest

from greedy_ref import greedy, open_llama, TEST_THREADS
from pyllama_dspark.decode.cycle import Started
from pyllama_dspark.decode.loop import Decoder
from pyllama_dspark.llama.draft_meta import read_draft_meta
from pyllama_dspark.llama.handles import ContextSettings, Draft, Target
from pyllama_dspark.speculative.oracle import OracleProposer
from pyllama_dspark.speculative.policy import VerifyPolicy
from pyllama_dspark.prompts import load_prompts
from pyllama_dspark.speculative.schedule import CostModel

THREADS = TEST_THREADS
R = 3


@pytest.fixture(scope="module")
def refs(target_path):
    items = load_prompts(limit_per_file=1)
    llm = open_llama(target_path)
    with Target(target_path, ContextSettings(n_threads=THREADS)) as t:
        from pyllama_dspark.chat.prompt import build_chat_prompt
        prompts = [build_chat_prompt(t, [{"role": "user", "content": it.turns[0]}]).tokens for it in items]
    prompts.append(list(prompts[0][:-3]) + [28, 198])  # a sixth, shorter prompt
    max_toks = [24, 40, 16, 48, 32, 20]
    out = [(p, m, greedy(llm, p, m)) for p, m in zip(prompts, max_toks)]
    llm.close()
    return out


def _open(target_path, draft_path, n_seq):
    meta = read_draft_meta(draft_path)
    s = ContextSettings(n_ctx=2048 * n_seq, n_threads=THREADS, n_seq_max=n_seq)
    t = Target(target_path, s, capture_layers=meta.target_layers)
    return t, Draft(draft_path, t, s)


@pytest.mark.parametrize("mode", ["off", "profiled"])
def test_batched_sequences_equal_their_own_greedy(target_path, dspark_draft_path, refs, mode):
    t, d = _open(target_path, dspark_draft_path, R)
    with t:
        policy = VerifyPolicy(mode=mode, cost=CostModel([6.0 * b for b in range(1, 33)], draft_ms=[10.0]),
                              learn_costs=False)
        # tie_eps = inf: every emitted verify row counts as a near-tie, rejected rows never do
        bd = Decoder(t, d, n_max=7, policy=policy, tie_eps=float("inf") if mode == "off" else 1e-3)
        done = bd.run([p for p, _, _ in refs], [m for _, m, _ in refs])
        if mode == "off":
            assert [dn.stats.near_ties for dn in done] == [dn.stats.accepted + dn.stats.cycles for dn in done]
        bad = [i for i, ((_, _, ref), dn) in enumerate(zip(refs, done)) if dn.tokens != ref]
        assert not bad, [(done[i].tokens, refs[i][2]) for i in bad]
        # 6 prompts through 3 slots: sequences finished at different steps and queued ones joined
        assert max(bd.verify_batches) > 1 and bd.steps < sum(m for _, m, _ in refs)
        if mode == "off":
            assert sum(dn.stats.drafted for dn in done) > 0
            assert max(bd.verify_batches) == R * 8  # three full blocks in one verify decode
        else:
            # a CPU-like linear cost curve: drafting does not pay, so the draft pass only runs as an
            # occasional probe (every 16 skipped steps) and verification stays (nearly) plain
            assert sum(dn.stats.drafted for dn in done) < 0.2 * sum(m for _, m, _ in refs)


def _oracle_run(target_path, ref_prompt, ref, policy, p_error=0.7, seed=5):
    with Target(target_path, ContextSettings(n_threads=THREADS)) as t:
        orc = OracleProposer(list(ref_prompt) + list(ref), t.n_vocab, p_error=p_error, seed=seed)
        bd = Decoder(t, orc, n_max=7, policy=policy)
        (done,) = bd.run([ref_prompt], [len(ref)])
        return done, orc


def test_informative_confidence_static_cut_verifies_only_survivors(target_path, refs):
    prompt, m, ref = refs[3]
    done, orc = _oracle_run(target_path, prompt, ref, VerifyPolicy(mode="static", conf_min=0.5))
    assert done.tokens == ref
    # the oracle reports c = 0 from its planted error on: everything verified is accepted...
    assert done.stats.accepted == done.stats.drafted > 0
    # ...while verifying whole blocks (same oracle seed) does hit the planted errors
    off, _ = _oracle_run(target_path, prompt, ref, VerifyPolicy(mode="off"))
    assert off.tokens == ref and off.stats.drafted > off.stats.accepted


def test_profiled_schedule_drops_low_survival_and_keeps_high(target_path, refs):
    prompt, m, ref = refs[3]
    # a flat (GPU-like) cost curve: any surviving token pays, a dead one (a = 0) never does
    flat = CostModel([10.0 + 0.05 * b for b in range(32)], draft_ms=[1.0])
    # fixed costs (learn_costs=False): the policy never reads the clock, so one stall of a shared
    # machine cannot make it stop drafting (the decision is a function of the cost model alone)
    done, orc = _oracle_run(target_path, prompt, ref, VerifyPolicy(mode="profiled", cost=flat, learn_costs=False))
    assert done.tokens == ref
    assert done.stats.accepted == done.stats.drafted  # only a = 1 prefixes were verified
    assert done.stats.tau > 2.0
    off, _ = _oracle_run(target_path, prompt, ref, VerifyPolicy(mode="off"))
    assert off.tokens == ref and off.stats.drafted > off.stats.accepted  # fixed length wastes rows
    # on a compute-bound curve (each row costs a full step) nothing short of certain pays
    steep = CostModel([10.0 * b for b in range(1, 33)], draft_ms=[8.0])
    done2, _ = _oracle_run(target_path, prompt, ref, VerifyPolicy(mode="profiled", cost=steep, learn_costs=False))
    assert done2.tokens == ref


def test_policy_refuses_bad_settings(target_path, dflash_draft_path):
    with pytest.raises(ValueError):
        VerifyPolicy(mode="nope")
    with pytest.raises(ValueError):
        VerifyPolicy(mode="profiled")
    with pytest.raises(ValueError):
        VerifyPolicy(mode="static", conf_min=1.5)
    t, d = _open(target_path, dflash_draft_path, 1)
    with t:
        with pytest.raises(ValueError, match="confidence head"):
            Decoder(t, d, policy=VerifyPolicy(mode="static", conf_min=0.3))
    # 3 sequences x 8 verify rows do not fit a 16-token batch: refused before llama.cpp sees it
    s = ContextSettings(n_ctx=512 * 3, n_batch=16, n_ubatch=16, n_threads=THREADS, n_seq_max=3)
    with Target(target_path, s) as t:
        with pytest.raises(ValueError, match="n_batch"):
            Decoder(t, OracleProposer([1, 2, 3], t.n_vocab), n_max=7)
        Decoder(t, OracleProposer([1, 2, 3], t.n_vocab), n_max=4)   # 3 x 5 rows fit


def test_batched_sampling_follows_the_targets_law(target_path, refs):
    """T > 0 through the batched decoder (trained drafter: Markov conditioning on the drawn token,
    reduced vocabulary, accepts and rejections; three slots, so each sequence's rows share decodes
    with others'), checked against the target's own law along whole 40-token generations: the
    randomized probability integral transform of every emitted token under llama.cpp's sampler
    chain (top-k 8, T 0.8) on ``llama_cpp.Llama``'s logits given the emitted prefix must be
    uniform, and no token may fall outside the chain's support (a token within 0.5 of the k-th
    logit is a numerical boundary case: excused and reported).  The first tokens' joint law is
    tested exactly in test_sampling_blocks.py.  Negative control: the same tokens under the chain
    at temperature 1.6 (a wrong law) must be rejected."""
    import os
    from dataclasses import replace

    from llama_cpp import Llama

    import pyllama_dspark
    from block_law import pit_values, uniform_chi2
    from greedy_ref import LLAMA_KW
    from pyllama_dspark.speculative.sampling_params import SamplingParams

    draft = os.path.join(os.path.dirname(pyllama_dspark.__file__), "data", "SmolLM2-135M-Instruct-DSpark.gguf")
    base = SamplingParams(temperature=0.8, top_k=8, top_p=1.0, min_p=0.0)
    jobs = [(p, base.with_seed(100 + 10 * i + j)) for i, (p, _, _) in enumerate(refs[:4]) for j in range(3)]
    n = 40
    t, d = _open(target_path, draft, 3)
    with t:
        bd = Decoder(t, d, n_max=7, policy=VerifyPolicy(mode="off"))
        done = bd.run([p for p, _ in jobs], n, sampling=[s for _, s in jobs])
    assert max(bd.verify_batches) > 8   # several sequences' rows verified in one decode
    drafted = sum(dn.stats.drafted for dn in done)
    accepted = sum(dn.stats.accepted for dn in done)
    assert 0 < accepted < drafted
    assert [dn.stats.seed for dn in done] == [s.seed for _, s in jobs]
    llm = Llama(model_path=target_path, n_threads=1, n_threads_batch=1, **LLAMA_KW)
    try:
        rng = np.random.default_rng(0)
        u, outside, excused, u_wrong = [], 0, 0, []
        for (p, s), dn in zip(jobs, done):
            (vals, out, exc), (wrong, _, _) = pit_values(llm, p, dn.tokens, [s, replace(s, temperature=1.6)], rng,
                                                         boundary_eps=0.5)
            u += vals
            outside += out
            excused += exc
            u_wrong += wrong
    finally:
        llm.close()
    st, dof, pv, _ = uniform_chi2(u)
    wst, wdof, wpv, _ = uniform_chi2(u_wrong)
    report = (f"{len(done)} sequences, {len(u)} tokens (drafted {drafted}, accepted {accepted}); outside the "
              f"support {outside}, boundary cases excused {excused}; PIT chi2 {st:.1f} dof {dof} p {pv:.3g}; "
              f"wrong law (T 1.6) chi2 {wst:.1f} p {wpv:.3g}")
    print(report)
    assert outside == 0 and excused <= 2, report
    assert pv > 1e-3, report
    assert wpv < 1e-3, "negative control not rejected: " + report


def test_batched_streaming_events_and_cancel(target_path, refs):
    t, d = _open(target_path, default_draft_path(), 2)
    with t:
        bd = Decoder(t, d, n_max=7, streaming=True)
        (p0, m0, ref0), (p1, _, _), (p2, m2, ref2) = refs[0], refs[1], refs[2]
        r0 = bd.submit(p0, m0)
        r1 = bd.submit(p1, 200)
        r2 = bd.submit(p2, m2, stop=["\n"])   # queued behind the two slots
        events = {r0: [], r1: [], r2: []}
        steps = 0
        while bd.pending():
            bd.step()
            steps += 1
            for rid, ev in bd.poll():
                if isinstance(ev, Started):
                    assert 0 <= ev.slot < 2 and not events[rid]
                    continue
                events[rid].append(ev)
            if steps == 3:
                assert bd.cancel(r1) and not bd.cancel(r1)   # frees its slot for the queued one
        assert not bd.cancel(12345)
        from pyllama_dspark.decode.cycle import Chunk, Done
        for rid, ref in ((r0, ref0),):
            evs = events[rid]
            assert isinstance(evs[-1], Done) and all(isinstance(e, Chunk) for e in evs[:-1])
            assert [tok for e in evs[:-1] for tok in e.tokens] == evs[-1].tokens == ref
            assert "".join(e.text for e in evs[:-1]) == evs[-1].text
        assert events[r1] and not any(isinstance(e, Done) for e in events[r1])   # cancelled: no Done
        d2 = events[r2][-1]
        assert isinstance(d2, Done) and "\n" not in d2.text
        assert d2.tokens == ref2[:len(d2.tokens)]


def default_draft_path():
    from pyllama_dspark.paths import default_draft

    return default_draft()


def test_a_streamed_first_token_comes_out_of_the_admitting_step(target_path, refs):
    """The step that admits a request ends after its prefill and hands out its first token (and
    its text, which cannot begin the stop string) before any cycle runs: llama-server sends a
    first token right after the decode that ends the prompt.  Greedy output is unchanged."""
    from pyllama_dspark.decode.cycle import Chunk, Done

    t, d = _open(target_path, default_draft_path(), 2)
    with t:
        bd = Decoder(t, d, n_max=7, streaming=True)
        p0, m0, ref0 = refs[0]
        rid = bd.submit(p0, m0, stop=["<|im_end|>"])
        bd.step()
        first = [ev for r, ev in bd.poll() if r == rid and not isinstance(ev, Started)]
        assert bd.steps == 0, "a cycle ran in the admitting step"
        assert len(first) == 1 and isinstance(first[0], Chunk) and first[0].tokens == ref0[:1]
        assert first[0].text == t.detokenize(ref0[:1]).decode()   # nothing held back
        events = list(first)
        while bd.pending():
            bd.step()
            events += [ev for r, ev in bd.poll() if r == rid]
        assert isinstance(events[-1], Done) and events[-1].tokens == ref0
        assert "".join(e.text for e in events[:-1]) == events[-1].text
