"""The law of the first two sampled tokens, from ``llama_cpp.Llama`` and llama.cpp's own sampler chain,
and a chi-square goodness-of-fit test against it: the reference of the cheap T > 0 checks of the
engine, the CLI and the ``DSpark`` class.

``two_token_law(llm, prompt, params)`` evaluates the prompt and every token the chain can draw first
(``Llama`` one token at a time) and applies :class:`llama_sampler_ref.LlamaChain` (the
``llama_sampler_*`` chain through the bindings, penalties fed the prompt and t1) to each logits
row: ``{(t1, t2): probability}``; an end-of-generation t1 is an outcome of its own, ``(t1,)``.
A sharp chain (top-k 4-5) keeps it to a few dozen outcomes, so a few hundred samples give the test
real power; :func:`law_check` reports the statistic and a negative control: the same samples
against the law of another temperature must be rejected.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np
from llama_cpp import llama_cpp as ll

from llama_sampler_ref import LlamaChain
from pyllama_dspark.speculative.sampling_params import SamplingParams
from block_law import chi2_law

Law = Dict[Tuple[int, ...], float]


def _row(llm) -> np.ndarray:
    ptr = ll.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def two_token_law(llm, prompt: Sequence[int], params: SamplingParams, grammar: str = None) -> Law:
    """``grammar``: GBNF; the law of constrained sampling (llama.cpp's grammar sampler first)."""
    prompt = [int(t) for t in prompt]
    v = llm.n_vocab()
    vocab = ll.llama_model_get_vocab(llm.model)
    llm.reset()
    llm.eval(prompt)
    n = llm.n_tokens
    hybrid = bool(ll.llama_model_is_hybrid(llm.model) or ll.llama_model_is_recurrent(llm.model))
    g = (lambda gen: (vocab, grammar, gen)) if grammar is not None else (lambda gen: None)
    chain = LlamaChain(params, v, prompt, grammar=g(()))
    p1 = chain.probs(_row(llm))
    chain.close()
    law: Law = {}
    for t1 in np.flatnonzero(p1):
        t1 = int(t1)
        if ll.llama_vocab_is_eog(vocab, t1):
            law[(t1,)] = float(p1[t1])
            continue
        if hybrid:   # a recurrent state cannot be cut back to the prompt (Llama's kv_cache_seq_rm(-1, n, -1))
            llm.reset()
            llm.eval(prompt + [t1])
        else:
            llm.n_tokens = n
            llm.eval([t1])
        chain = LlamaChain(params, v, prompt + [t1], grammar=g((t1,)))
        p2 = chain.probs(_row(llm))
        chain.close()
        for t2 in np.flatnonzero(p2):
            law[(t1, int(t2))] = float(p1[t1] * p2[t2])
    return law


def chi2_vs_law(samples: List[Tuple[int, ...]], law: Law) -> Tuple[float, int, float, int]:
    """(statistic, degrees of freedom, p-value, samples outside the law's support): block_law's
    chi-square (cells expected below 5 pooled with anything outside the support)."""
    stat, dof, p, _tv, outside = chi2_law(samples, law)
    return stat, dof, p, outside


def first_two(sp, prompt: Sequence[int], max_tokens: int, **stream) -> Tuple[int, ...]:
    """The first two tokens ``sp.stream(prompt, max_tokens, **stream)`` emits (the stream is then
    closed)."""
    got: List[int] = []
    it = sp.stream(prompt, max_tokens, **stream)
    for ev in it:
        got += ev.tokens
        if len(got) >= 2:
            break
    it.close()
    return tuple(got[:2])


def law_check(samples, law: Law, wrong_law: Law, what: str, wrong_what: str = "another temperature's law") -> str:
    """Assert that ``samples`` fit ``law`` (p > 1e-3, nothing outside its support) and that the
    same samples reject ``wrong_law`` (p < 1e-6: the test has the power to see such a change)."""
    stat, dof, p, outside = chi2_vs_law(samples, law)
    wstat, wdof, wp, wout = chi2_vs_law(samples, wrong_law)
    report = (f"{what}: {len(samples)} samples over {len(law)} outcomes: chi2 {stat:.1f} dof {dof} p {p:.3g} "
              f"outside {outside}; negative control ({wrong_what}): chi2 {wstat:.1f} dof {wdof} "
              f"p {wp:.3g}")
    print(report)
    assert outside == 0, "an outcome the target's sampler chain can never produce: " + report
    assert p > 1e-3, report
    assert wp < 1e-6, "the negative control was not rejected: the test has no power here: " + report
    return report
