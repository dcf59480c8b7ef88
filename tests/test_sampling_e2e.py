"""End to end at T > 0 on SmolLM2: speculative sampling emits what plain sampling would.

For each prompt, the engine (``Speculator.stream`` with ``sampling=`` and ``reuse_prefix=True``, so
the prompt is decoded once) produces the first two tokens of many independent continuations
(seeds seed0 + i).  The second token always comes out of a speculative cycle (one draft verified,
accepted or resampled; ``max_tokens=3`` lets the engine draft exactly one token there).  The
expected joint law of (t1, t2) is computed independently: llama-cpp-python's ``Llama`` evaluates
the prompt and every possible t1, and llama.cpp's own sampler chain (``llama_sampler_*``) gives
the distributions plain sampling would draw from.  A chi-square goodness-of-fit test per case and
combined over all cases must not reject (p > 1e-3); the total variation to the exact law is
reported.

Proposers: the random DSpark draft (its q is nearly disjoint from the target: mostly the
resample path) and the table oracle (q = a flattened copy of the target's own distribution plus
junk tokens: partial acceptance).  One configuration adds repeat/presence penalties, whose history
(prompt + t1) must line up between draft, target and reference.

A negative control runs the same harness with a proposer that reports a q other than the one it
drew from; the test must reject it (that is what makes the harness able to fail).

Samples: 1000 per oracle case (no draft decode) and 400 per random-draft case (a block decode per
sample), 3 x 1000 + 2 x 400 = 3.8k in all (the negative control is rejected with 800), ~1 minute on
2 idle cores.  The oracle cases carry the power against a wrong rule: with the residual replaced by
p (a planted bug), the three of them reject it (combined p 1e-4 with 1000 each) and the random
draft's cases add nothing (nothing is accepted, so the residual is p).  The random draft's cases
are the real draft pass at T > 0, with and without penalties: a gross break of that path.
``PYLLAMA_DSPARK_E2E_SAMPLES`` scales them (the value is the oracle cases' count).
The joint law of longer prefixes with whole blocks is test_sampling_blocks.py's.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from llama_cpp import llama_cpp as ll

from first_tokens_law import first_two as first_tokens
from greedy_ref import open_llama, TEST_THREADS
from llama_sampler_ref import LlamaChain
from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.speculative.oracle import TableOracleProposer
from pyllama_dspark.speculative.sampling_params import SamplingParams
from test_sampling_rule import chi2_sf

N_ORACLE = int(os.environ.get("PYLLAMA_DSPARK_E2E_SAMPLES", "1000"))
N_DRAFT = max(1, N_ORACLE * 2 // 5)
THREADS = TEST_THREADS
PARAMS = {
    "plain": SamplingParams(temperature=1.0, top_k=12, top_p=0.95, min_p=0.02),
    "penalties": SamplingParams(temperature=0.9, top_k=12, top_p=1.0, min_p=0.0, repeat_penalty=1.3,
                                presence_penalty=0.5, penalty_last_n=64),
}
PROMPTS = [
    "The capital of France is",
    "Here is a list of fruits: apples, bananas,",
    "def add(a, b):\n    return",
    "She opened the door and saw",
]
# (proposer, params, prompt index): 5 cases, each proposer with and without penalties
CASES = [("dspark", "plain", 0), ("dspark", "penalties", 2),
         ("oracle", "plain", 0), ("oracle", "penalties", 1), ("oracle", "plain", 3)]
SCHEDULED = ("plain", 1)   # the confidence-scheduled case's (params, prompt index)


def n_samples(kind: str) -> int:
    return N_DRAFT if kind == "dspark" else N_ORACLE


def _row(llm) -> np.ndarray:
    ptr = ll.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


class Reference:
    """Exact law of (t1, t2) under plain sampling with llama.cpp's sampler chain."""

    def __init__(self, llm, prompt, params: SamplingParams):
        v = llm.n_vocab()
        llm.reset()
        llm.eval(list(prompt))
        n = llm.n_tokens
        chain = LlamaChain(params, v, prompt)
        self.p1 = chain.probs(_row(llm))
        chain.close()
        self.rows = {}      # t1 -> the target's logits row after prompt + t1
        self.joint = {}
        for t1 in np.flatnonzero(self.p1):
            llm.n_tokens = n
            llm.eval([int(t1)])
            row = _row(llm)
            self.rows[int(t1)] = row
            chain = LlamaChain(params, v, list(prompt) + [int(t1)])
            p2 = chain.probs(row)
            chain.close()
            for t2 in np.flatnonzero(p2):
                self.joint[(int(t1), int(t2))] = self.p1[t1] * p2[t2]


class Recorder:
    """Wraps a proposer and keeps the drafts of its last T > 0 proposal."""

    def __init__(self, inner):
        self.inner = inner
        self.last = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose_sampled(self, *args, **kw):
        prop = self.inner.propose_sampled(*args, **kw)
        self.last = [int(t) for t in prop.tokens]
        return prop


def first_two(sp, prompt, params, seed):
    return first_tokens(sp, prompt, 3, sampling=params.with_seed(seed), reuse_prefix=True)


def chi2_test(samples, joint):
    """Chi-square over cells with expected count >= 5, the rest pooled: (stat, dof, TV, outside)."""
    n = len(samples)
    keys = list(joint)
    probs = np.array([joint[k] for k in keys])
    index = {k: i for i, k in enumerate(keys)}
    counts = np.zeros(len(keys))
    outside = 0
    for s in samples:
        i = index.get(s)
        if i is None:
            outside += 1
        else:
            counts[i] += 1
    tv = 0.5 * (np.abs(counts / n - probs).sum() + outside / n)
    big = probs * n >= 5
    obs = np.append(counts[big], counts[~big].sum() + outside)
    exp = np.append(probs[big] * n, probs[~big].sum() * n)
    m = exp > 0
    stat = float(((obs[m] - exp[m]) ** 2 / exp[m]).sum())
    return stat, int(m.sum()) - 1, tv, outside


@pytest.fixture(scope="module")
def refs(target_path):
    llm = open_llama(target_path)
    out = {}
    try:
        for _, pname, pi in CASES + [(None,) + SCHEDULED]:
            if (pname, pi) not in out:
                prompt = llm.tokenize(PROMPTS[pi].encode(), add_bos=True, special=True)
                out[(pname, pi)] = (prompt, Reference(llm, prompt, PARAMS[pname]))
    finally:
        llm.close()
    return out


def _run_case(sp, kind, pname, pi, refs, seed0, n):
    """n samples of (t1, t2), and how often t2 was the accepted draft (else: resampled)."""
    prompt, ref = refs[(pname, pi)]
    if kind == "oracle":
        table = {(len(prompt), t1): row for t1, row in ref.rows.items()}
        sp.decoder.proposer = TableOracleProposer(table, block_size=1, skew=1.6, junk=0.1, junk_ids=(11, 12, 13))
    rec = sp.decoder.proposer = Recorder(sp.decoder.proposer)
    samples, accepted = [], 0
    for i in range(n):
        rec.last = None
        samples.append(first_two(sp, prompt, PARAMS[pname], seed0 + i))
        assert rec.last is not None and len(rec.last) == 1, "the second token did not come from a speculative cycle"
        accepted += samples[-1][1] == rec.last[0]
    return samples, ref, accepted / n


def test_first_two_tokens_match_plain_sampling(target_path, dspark_draft_path, refs):
    results = []
    # schedule off: every sample's second token must come from a verified draft (the law of the
    # accept rule is under test, not auto's choice of whether drafting pays here)
    with Speculator(target_path, dspark_draft_path, n_threads=THREADS, n_max=1, n_ctx=512, schedule="off") as sp:
        draft_proposer = sp.decoder.proposer
        for c, (kind, pname, pi) in enumerate(CASES):
            sp.decoder.proposer = draft_proposer
            samples, ref, acc = _run_case(sp, kind, pname, pi, refs, 10000 * c, n_samples(kind))
            stat, dof, tv, outside = chi2_test(samples, ref.joint)
            results.append((kind, pname, pi, stat, dof, tv, outside, chi2_sf(stat, dof), acc))
        sp.decoder.proposer = draft_proposer
    total = sum(r[3] for r in results), sum(r[4] for r in results)
    p_all = chi2_sf(*total)
    lines = [f"{k:6s} {pn:9s} prompt {pi}: chi2 {st:7.1f} dof {d:3d} p {p:.3g} TV {tv:.4f} outside {o} "
             f"accepted {a:.1%}" for k, pn, pi, st, d, tv, o, p, a in results]
    n_all = sum(n_samples(k) for k, _, _ in CASES)
    report = (f"\n{len(CASES)} cases, {n_all} samples (random draft {N_DRAFT}, oracle {N_ORACLE} per case); combined chi2 "
              f"{total[0]:.1f} dof {total[1]} p = {p_all:.4f}\n" + "\n".join(lines))
    print(report)
    assert all(r[6] == 0 for r in results), "a pair the target can never emit was emitted" + report
    assert p_all > 1e-3, report
    assert all(r[7] > 1e-4 for r in results), report
    # both paths of the rule were exercised: the oracle's drafts are mostly but not always accepted
    oracle_acc = [r[8] for r in results if r[0] == "oracle"]
    assert all(0.3 < a < 0.98 for a in oracle_acc), report


class _LyingOracle(TableOracleProposer):
    """Draws from a flattened q but reports the sharper one: a broken verification input."""

    def propose_sampled(self, anchor, pos0, n_draft, sampler, seq_id=0):
        prop = super().propose_sampled(anchor, pos0, n_draft, sampler, seq_id)
        if len(prop.tokens):
            key = (pos0, int(anchor))
            prop.probs = [sampler.probs(self.table[key], [])]
            if prop.probs[0][int(prop.tokens[0])] == 0.0:   # keep the rule's precondition satisfied
                q = np.asarray(prop.probs[0]) * 0.9
                q[int(prop.tokens[0])] += 0.1
                prop.probs = [q]
        return prop


def test_negative_control_wrong_q_is_detected(target_path, refs):
    pname, pi = "plain", 0
    prompt, ref = refs[(pname, pi)]
    table = {(len(prompt), t1): row for t1, row in ref.rows.items()}
    with Speculator(target_path, n_threads=THREADS, n_ctx=512, n_max=1) as sp:
        sp.decoder.proposer = _LyingOracle(table, block_size=1, skew=3.0, junk=0.3, junk_ids=(11, 12, 13))
        samples = [first_two(sp, prompt, PARAMS[pname], 7 + i) for i in range(800)]
    stat, dof, tv, outside = chi2_test(samples, ref.joint)
    p = chi2_sf(stat, dof)
    print(f"\nnegative control: 800 samples, chi2 {stat:.1f} dof {dof} p {p:.3g} TV {tv:.4f} outside {outside}")
    assert p < 1e-6 or outside > 0


def test_scheduled_sampling_first_two_tokens_match_plain_sampling(target_path, dspark_draft_path, refs):
    """Confidence-scheduled verification at T > 0: a static cut on the random draft's confidence,
    placed so that the single draft is verified on as close to half of the cycles as the few
    values of t1 allow (the confidence depends on t1) and dropped on the others, leaves the law
    of (t1, t2) unchanged."""
    from pyllama_dspark.speculative.policy import VerifyPolicy

    class Counting(VerifyPolicy):
        def lengths(self, confs, n_drafted):
            out = super().lengths(confs, n_drafted)
            self.seen.append((float(confs[0][0]), out[0]))
            return out

    pname, pi = SCHEDULED
    prompt, ref = refs[(pname, pi)]
    with Speculator(target_path, dspark_draft_path, n_threads=THREADS, n_max=1, n_ctx=512) as sp:
        probe = Counting(mode="static", conf_min=0.0, gamma=1)
        probe.seen = []
        sp.decoder.policy = probe
        t1s = [first_two(sp, prompt, PARAMS[pname], 50000 + i)[0] for i in range(60)]
        conf_of = dict(zip(t1s, (c for c, _ in probe.seen)))   # the first draft's confidence given t1
        # the cut whose chance of verifying (under the law of t1) is closest to one half
        cands = sorted(set(conf_of.values()))
        p_verify = {c: sum(ref.p1[t] for t, ct in conf_of.items() if ct >= c) for c in cands}
        cut = min(cands, key=lambda c: abs(p_verify[c] - 0.5))
        pol = Counting(mode="static", conf_min=cut, gamma=1)
        pol.seen = []
        sp.decoder.policy = pol
        samples = [first_two(sp, prompt, PARAMS[pname], 60000 + i) for i in range(N_DRAFT)]
        sp.decoder.policy = None
    verified = sum(ell for _, ell in pol.seen) / len(pol.seen)
    stat, dof, tv, outside = chi2_test(samples, ref.joint)
    p = chi2_sf(stat, dof)
    print(f"\nscheduled (static conf_min {cut:.4f}): {len(samples)} samples, draft verified on {verified:.1%} "
          f"of the cycles, chi2 {stat:.1f} dof {dof} p {p:.3g} TV {tv:.4f}")
    assert 0.05 < verified < 0.95, "both paths (verify the draft / drop it) must occur"
    assert outside == 0
    assert p > 1e-3
