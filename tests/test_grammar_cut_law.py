"""A grammar cut at T > 0 keeps the law (a mutant that once survived: mutation/survivors.md).

When the grammar rejects a draft x drawn from q, the loop cuts the block before it; the target's
token at that position must then come from norm(max(p - q, 0)), as for any rejected draft (x has
p = 0 under the grammar, so it is rejected with certainty), not from p.  The mutant that draws
it from p (``grammar_cut`` returning no q) survived every earlier test: its law differs only when
q is not one-hot, i.e. for a sampled drafter, and only a statistical test through the loop sees it.

Here, through the real loop (``Speculator`` -> ``Decoder`` over SmolLM2, T = 1, top-k 4, a GBNF
grammar, fixed one-draft blocks), a proposer draws its one draft from
q = w * onehot(A) + (1 - w) * onehot(X), where A is the constrained target's likeliest second token
(w = its probability: the choice that separates the two laws most) and X a token the grammar
rejects: about 40% of the cycles are cut with a q that is not one-hot.  Reference: the exact law of
the first two tokens from ``llama_cpp.Llama`` and llama.cpp's own sampler chain with its grammar
sampler (first_tokens_law.two_token_law).  The samples must fit it (chi-square p > 1e-3, nothing
outside its support) and reject, at p < 1e-6, the law the mutant emits (computed exactly from the
same reference and q): the test has that power whatever code runs.  With the mutant planted the
samples fail the first check (p ~ 1e-22 with 400 samples, ~30 s).
"""

from __future__ import annotations

import os
from typing import Dict, Tuple

import numpy as np
import pytest

from first_tokens_law import first_two, law_check, two_token_law
from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.speculative.drafter import EMPTY, Proposal, Proposer
from pyllama_dspark.speculative.sampling_params import SamplingParams

GBNF = r'''root ::= " " [a-z] [a-z ]*'''
PARAMS = SamplingParams(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0)
N = int(os.environ.get("PYLLAMA_DSPARK_CUT_SAMPLES", "400"))


class CutProposer(Proposer):
    """One draft per block, at the second token only: A with probability w, else X (the grammar
    rejects X), and the q it was drawn from."""

    name = "cut-proposer"

    def __init__(self, pos0: int, table: Dict[int, Tuple[int, float]], bad: int, n_vocab: int, seed: int = 0):
        self.pos0, self.table, self.bad, self.n_vocab = pos0, table, bad, n_vocab
        self.rng = np.random.default_rng(seed)
        self.cuts = self.drafts = 0

    def max_draft(self) -> int:
        return 1

    def propose_sampled(self, anchor, pos0, n_draft, sampler, seq_id=0):
        if pos0 != self.pos0 or int(anchor) not in self.table or n_draft < 1:
            return EMPTY
        a, w = self.table[int(anchor)]
        q = np.zeros(self.n_vocab)
        q[a], q[self.bad] = w, 1.0 - w
        tok = a if self.rng.random() < w else self.bad
        self.drafts += 1
        self.cuts += tok == self.bad
        return Proposal(np.array([tok], dtype=np.int32), probs=[q])


def mutant_law(law, table, bad: int):
    """The law of (t1, t2) when a cut draws t2 from p instead of norm(max(p - q, 0))."""
    out = {}
    for t1, (a, w) in table.items():
        p = {k[1]: v for k, v in law.items() if len(k) == 2 and k[0] == t1}
        p1 = sum(p.values())
        p = {t: v / p1 for t, v in p.items()}
        q = {a: w, bad: 1.0 - w}
        res = {t: max(v - q.get(t, 0.0), 0.0) for t, v in p.items()}
        z = sum(res.values())
        acc_a = w * min(1.0, p[a] / w)                 # A drafted and accepted
        rej = w - acc_a                                # A drafted and rejected: the residual, both ways
        for t in p:
            emitted = (acc_a if t == a else 0.0) + (rej * res[t] / z if z > 0 else 0.0) + (1.0 - w) * p[t]
            out[(t1, t)] = p1 * emitted
    return out


@pytest.fixture(scope="module")
def setup(llama_refs):
    llm = llama_refs.llm
    prompt = llm.tokenize(b"My favourite word is", add_bos=True, special=True)
    law = two_token_law(llm, prompt, PARAMS, grammar=GBNF)
    bad = llm.tokenize(b"7", add_bos=False, special=False)
    assert len(bad) == 1
    bad = bad[0]
    table = {}
    for t1 in {k[0] for k in law}:
        cond = {k[1]: v for k, v in law.items() if len(k) == 2 and k[0] == t1}
        assert bad not in cond                         # the grammar rejects X after every t1
        a = max(cond, key=cond.get)
        table[t1] = (a, cond[a] / sum(cond.values()))
    return prompt, law, table, bad, llm.n_vocab()


def test_a_grammar_cut_draws_from_the_residual(target_path, setup):
    prompt, law, table, bad, n_vocab = setup
    wrong = mutant_law(law, table, bad)
    prop = CutProposer(len(prompt), table, bad, n_vocab, seed=1)
    with Speculator(target_path, n_threads=1, n_ctx=512, n_max=1, proposer=prop, schedule="off") as sp:
        # max_tokens 3: the cycle after the first token may draft one token
        samples = [first_two(sp, prompt, 3, sampling=PARAMS.with_seed(900 + i), grammar=GBNF, reuse_prefix=True)
                   for i in range(N)]
    assert prop.drafts == N and 0.2 * N < prop.cuts < 0.8 * N, (prop.drafts, prop.cuts)   # frequent cuts
    law_check(samples, law, wrong, f"grammar cuts at T > 0 ({prop.cuts} of {N} cycles cut)",
              "the law of a cut drawing from p")
