"""``-md oracle:P`` and the auto schedule's memory across processes.

The oracle, against independent references:
* its reference continuation is ``llama_cpp.Llama``'s greedy output, and ``run -md oracle:P``
  emits exactly that (lossless), drafting;
* it pays a real draft pass (the draft context decodes once per proposal) and reports no confidences;
* the planted error follows its documented law (a block right with probability P, else one wrong
  draft at a uniform position): binomial / chi-square bounds over 4,000 blocks;
* bad specs and T > 0 are usage errors (exit 2), not tracebacks.

The memory (each run a fresh process, as users run ``run``): a steep cost curve on which a random
draft never pays.  The first process learns it and writes it beside the cost curve; the second
starts from it and makes no draft pass at all (and no draft decode of the prompt); with the memory
off, or for another proposer, a process drafts from its first cycles again.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from greedy_ref import TEST_THREADS
from cli_runner import cli
from pyllama_dspark.speculative import costprofile

PROMPT = "The capital of France is"


_cli = cli


def _prompt_ids(llama_refs):
    return llama_refs.llm.tokenize(PROMPT.encode(), add_bos=True, special=True)


# ---- the oracle ----------------------------------------------------------------------------------

def test_greedy_reference_is_llama_greedy(target_path, llama_refs):
    from pyllama_dspark.decode.api import Speculator
    from pyllama_dspark.speculative.oracle import greedy_reference

    prompt = _prompt_ids(llama_refs)
    with Speculator(target_path, None, n_ctx=512, n_threads=TEST_THREADS, schedule="off") as sp:
        assert greedy_reference(sp.target, prompt, 24) == llama_refs.greedy(prompt, 24)


def test_run_oracle_is_lossless_drafts_and_pays_a_draft_pass(target_path, llama_refs, tmp_path):
    prompt = _prompt_ids(llama_refs)
    p = _cli("run", "-m", target_path, "-md", "oracle:0.9", "-p", PROMPT, "--raw", "-n", "32", "--temp", "0", "-t", str(TEST_THREADS),
             "-c", "512", "--schedule", "off", "--json", env={"PYLLAMA_DSPARK_CACHE": str(tmp_path)})
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["tokens"] == llama_refs.greedy(prompt, 32)
    st = out["stats"]
    # fixed blocks of 7 from an oracle right 9 times in 10: most drafts accepted, and a draft pass paid
    assert st["drafted"] >= 5 * (st["cycles"] - 2) and st["accepted"] >= 0.6 * st["drafted"]
    assert st["ms"]["draft"] > 0


def test_oracle_draft_pass_is_real_and_reports_no_confidence(target_path, llama_refs):
    from pyllama_dspark.decode.api import Speculator
    from pyllama_dspark.speculative.drafter import BlockRequest
    from pyllama_dspark.speculative.oracle import OracleDraft

    prompt = _prompt_ids(llama_refs)
    ref = llama_refs.greedy(prompt, 16)
    with Speculator(target_path, "oracle:1.0", n_ctx=512, n_threads=TEST_THREADS, schedule="off") as sp:
        o = sp.proposer
        assert isinstance(o, OracleDraft) and o.has_confidence is False and sp.policy is None
        o.prepare([prompt], 16)
        o.bind(0, prompt)
        calls = []
        real = sp.draft.decode_blocks
        sp.draft.decode_blocks = lambda *a, **k: (calls.append(a[1]), real(*a, **k))
        props = o.propose_batch([BlockRequest(ref[0], len(prompt), 7, 0)])
        assert calls == [7]                              # one real block decode of the draft
        assert props[0].confidence is None and props[0].probs is None
        assert props[0].tokens.tolist() == ref[1:8]      # P = 1: the reference itself
        smp = object()
        with pytest.raises(ValueError, match="greedy only"):
            o.propose_batch([BlockRequest(ref[0], len(prompt), 7, 0, smp)])
    with Speculator(target_path, "oracle:0.5", n_ctx=512, n_threads=TEST_THREADS) as sp:
        # auto works from the running acceptance (no confidences): a policy, and lossless output
        assert sp.policy is not None and sp.policy.mode == "auto"
        seen = []
        real_cycle = sp.policy.observe_cycle
        sp.policy.observe_cycle = lambda R, rows, ms: (seen.append((R, rows, ms)), real_cycle(R, rows, ms))
        done = sp.generate(prompt, 16)
        assert done.tokens == ref
        # every cycle reports its rows and time to the policy (the cycle costs over the curve)
        assert len(seen) == done.stats.cycles
        assert [rows for _, rows, _ in seen] == [1 + k for k in done.stats.verify_lengths]
        assert all(R == 1 and ms > 0 for R, _, ms in seen)


def test_planted_error_law():
    """The drafter's full block of B = 7 is right with probability P, else one draft, uniform over
    0..B-1, is wrong; a request for n < B drafts is the block's prefix, right with probability
    P + (1 - P)(B - n)/B, its wrong draft uniform over 0..n-1 (the law, not the code, gives the
    expected counts)."""
    from pyllama_dspark.speculative.oracle import OracleProposer

    ref = list(range(100, 140))
    n_blocks, B = 4000, 7
    for P in (0.3, 0.8):
        for n in (B, 3):
            o = OracleProposer(ref, 1000, block_size=B, p_error=1.0 - P, seed=11)
            wrong_at = []
            for _ in range(n_blocks):
                toks = o.propose(ref[10], 10, n).tokens.tolist()
                bad = [i for i, (a, b) in enumerate(zip(toks, ref[11:11 + n])) if a != b]
                assert len(bad) <= 1
                wrong_at.extend(bad)
            right = n_blocks - len(wrong_at)
            p_right = P + (1 - P) * (B - n) / B
            sd = np.sqrt(n_blocks * p_right * (1 - p_right))
            assert abs(right - n_blocks * p_right) < 4.5 * sd, (P, n, right)
            counts = np.bincount(wrong_at, minlength=n)
            exp = len(wrong_at) / n
            chi2 = float(((counts - exp) ** 2 / exp).sum())
            assert chi2 < 3 * (n - 1) + 12.0, (P, n, counts)   # p < 0.001 at n - 1 = 2 .. 6 dof


def test_a_shorter_request_is_the_full_blocks_prefix():
    """Same seed, same blocks: asking for n drafts gives the first n of what asking for all 7 gives
    (a block drafter's first drafts do not depend on the verify length)."""
    from pyllama_dspark.speculative.oracle import OracleProposer

    ref = list(range(100, 400))
    full = OracleProposer(ref, 1000, block_size=7, p_error=0.6, seed=5)
    blocks = [full.propose(ref[b], b, 7).tokens.tolist() for b in range(200)]
    assert sum(blk != ref[b + 1:b + 8] for b, blk in enumerate(blocks)) > 80   # errors were planted
    for n in (1, 2, 4):
        short = OracleProposer(ref, 1000, block_size=7, p_error=0.6, seed=5)
        for b in range(200):
            assert short.propose(ref[b], b, n).tokens.tolist() == blocks[b][:n], (n, b)


@pytest.mark.parametrize("args, msg", [(["-md", "oracle:1.5"], "in [0, 1]"), (["-md", "oracle:x"], "oracle:P"),
                                       (["-md", "oracle:0.9", "--temp", "0.8"], "greedy only")])
def test_oracle_bad_input_is_a_usage_error(target_path, args, msg):
    p = _cli("run", "-m", target_path, "-p", "hi", "-n", "4", "--temp", "0", *args)
    assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


# ---- the memory of what auto learned --------------------------------------------------------------

def _steep_profile(path: Path) -> str:
    """A compute-bound curve (t(B) = 10 B ms) with learned draft costs: a random draft never pays."""
    b = list(range(1, 33))
    path.write_text(json.dumps({
        "key": "steep", "settings": {}, "batch_sizes": b, "verify_ms": [10.0 * x for x in b],
        "verify_p10": [10.0 * x for x in b], "verify_p90": [10.0 * x for x in b], "draft_ms": 0.0,
        "draft_spread": [0.0, 0.0], "overhead_ms": 0.0, "repeats": 1,
        "version": costprofile.PROFILE_VERSION, "fixed": False}))
    return str(path)


def _run(target_path, cache, profile, memory="1", draft="random", n=24):
    p = _cli("run", "-m", target_path, "-md", draft, "-p", PROMPT, "--raw", "-n", n, "--temp", "0", "-t", str(TEST_THREADS), "-c", "512",
             "--json", env={"PYLLAMA_DSPARK_CACHE": str(cache), "PYLLAMA_DSPARK_COST_PROFILE": profile,
                            "PYLLAMA_DSPARK_SCHEDULE_MEMORY": memory})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def test_memory_carries_what_auto_learned_to_the_next_process(target_path, llama_refs, tmp_path):
    cache = tmp_path / "cache"
    profile = _steep_profile(tmp_path / "steep.json")
    ref = llama_refs.greedy(_prompt_ids(llama_refs), 24)
    first = _run(target_path, cache, profile)
    assert first["tokens"] == ref
    # a fresh process starts optimistic: its first cycles draft (two passes to learn the draft's cost)
    assert first["stats"]["ms"]["draft"] > 0
    learned = list((cache / "profiles").glob("learned-*.json"))
    assert len(learned) == 1
    state = json.loads(learned[0].read_text())["state"]
    assert state["acc"][0] < 0.9 and state["draft_ms"]          # it learned the draft does not pay
    # probes are spaced across processes (the plain cycles since the last one are remembered): on a
    # loaded machine one can come due within 24 tokens, so the count restarts here and the next is
    # 64 plain cycles away (the in-process test below lets one come due and checks nothing touches
    # the draft before it)
    data = json.loads(learned[0].read_text())
    data["state"].update(skipped=0, probe_gap=max(64, data["state"]["probe_gap"]))
    learned[0].write_text(json.dumps(data))
    second = _run(target_path, cache, profile)
    assert second["tokens"] == ref
    # it starts from that: no draft pass, no draft decode of the prompt, nothing verified
    assert second["stats"]["drafted"] == 0 and second["stats"]["ms"]["draft"] == 0
    assert set(second["stats"]["verify_lengths"]) == {0}
    # the negative controls: memory off, and another proposer (its own memory, none yet)
    off = _run(target_path, cache, profile, memory="0")
    assert off["tokens"] == ref and off["stats"]["ms"]["draft"] > 0
    oracle = _run(target_path, cache, profile, draft="oracle:0.9")
    assert oracle["tokens"] == ref and oracle["stats"]["ms"]["draft"] > 0
    assert len(list((cache / "profiles").glob("learned-*.json"))) == 2


def test_memory_ignores_a_damaged_file(target_path, llama_refs, tmp_path):
    from pyllama_dspark.speculative import policy_memory
    from pyllama_dspark.speculative.policy import VerifyPolicy
    from pyllama_dspark.speculative.schedule import CostModel

    f = tmp_path / "learned.json"
    for text in ("not json", json.dumps([1, 2]), json.dumps({"version": 99, "state": {}}),
                 json.dumps({"version": 1, "state": {"gamma": 7, "acc": "x"}})):
        f.write_text(text)
        pol = VerifyPolicy(mode="auto", cost=CostModel([10.0, 20.0]), gamma=7)
        pol.memory_path = str(f)
        data_ok = False
        try:
            data = json.loads(f.read_text())
            data_ok = isinstance(data, dict) and data.get("version") == 1 and pol.restore(data["state"])
        except ValueError:
            pass
        assert not data_ok and pol._acc.tolist() == [0.9] * 7
    assert policy_memory.save(pol) is False   # no cycle seen in this process: nothing written


def test_restored_policy_makes_no_draft_decode_at_all(monkeypatch, tmp_path, target_path, dspark_draft_path,
                                                     llama_refs):
    """In-process form of the above, watching the draft context: the second Speculator neither
    injects the prompt's features into the draft nor decodes a block (the cold costs are paid only
    when a probe runs).  Probes are spaced across processes (the plain cycles since the last one are
    remembered), so on a slow or loaded machine a probe can come due inside the second run: then the
    draft context is touched only from that probe on, and no cycle drafts because the plan says so."""
    from pyllama_dspark.decode.api import Speculator

    monkeypatch.setenv("PYLLAMA_DSPARK_SCHEDULE_MEMORY", "1")
    monkeypatch.setenv("PYLLAMA_DSPARK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PYLLAMA_DSPARK_COST_PROFILE", _steep_profile(tmp_path / "steep.json"))
    prompt = _prompt_ids(llama_refs)
    ref = llama_refs.greedy(prompt, 24)
    for i in range(2):
        with Speculator(target_path, dspark_draft_path, n_ctx=512, n_threads=TEST_THREADS) as sp:
            calls, wants = [], []
            for name in ("inject", "inject_captured", "decode_blocks", "decode_block"):
                real = getattr(sp.draft, name)
                setattr(sp.draft, name, lambda *a, _n=name, _r=real, **k: (calls.append(_n), _r(*a, **k))[1])
            pol, want = sp.policy, sp.policy.want_draft

            def watched(r, _pol=pol, _want=want):
                yes = _want(r)
                if yes:
                    wants.append("probe" if _pol._probing else "plan")
                    calls.append(wants[-1])
                return yes
            pol.want_draft = watched
            assert sp.generate(prompt, 24).tokens == ref
            if i == 0:
                assert "decode_blocks" in calls          # a fresh memory: it drafts to learn
            else:
                # it knows: the draft context is never touched, but by a probe that came due
                assert "plan" not in wants, calls
                first = calls.index("probe") if "probe" in calls else len(calls)
                assert calls[:first] == [], calls
                if "probe" in calls:
                    warnings.warn(f"a probe came due in the second process ({calls}): tested that "
                                  f"nothing touched the draft before it")
