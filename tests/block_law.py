"""The exact law of the first few sampled tokens, from llama-cpp-python's ``Llama`` and llama.cpp's
own sampler chain: the independent reference of the T > 0 end-to-end tests with real blocks.

``exact_law(llm, prompt, params, depth)`` returns ``{(t1, ..., t_depth): probability}`` for plain
sampling: ``Llama`` evaluates the prompt and every reachable prefix (one token at a time), and
:class:`llama_sampler_ref.LlamaChain` (``llama_sampler_*`` through the bindings; penalties fed the
prompt and the prefix, as llama.cpp's common sampler is) turns each logits row into the
distribution llama.cpp's ``dist`` sampler draws from.  A sharp chain (top-k 3-5) keeps the law to a
few dozen outcomes, so a few hundred samples give a chi-square test real power.

``text_law`` pushes a token law forward to the text the outcomes decode to, merging outcomes whose
texts are prefixes of one another (a completion's text then determines its cell exactly even when
more tokens follow): what a test sees through ``serve``, which returns text only.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np
from llama_cpp import llama_cpp as ll

from llama_sampler_ref import LlamaChain
from pyllama_dspark.speculative.sampling_params import SamplingParams
from test_sampling_rule import chi2_sf

Law = Dict[Tuple[int, ...], float]


def _row(llm) -> np.ndarray:
    ptr = ll.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def exact_law(llm, prompt: Sequence[int], params: SamplingParams, depth: int) -> Law:
    """Joint law of the first ``depth`` tokens plain sampling draws after ``prompt``; an
    end-of-generation token ends its outcome early (a shorter tuple)."""
    prompt = [int(t) for t in prompt]
    v = llm.n_vocab()
    vocab = ll.llama_model_get_vocab(llm.model)
    llm.reset()
    llm.eval(prompt)
    law: Law = {}

    def walk(prefix: List[int], mass: float, row: np.ndarray) -> None:
        chain = LlamaChain(params, v, prompt + prefix)
        p = chain.probs(row)
        chain.close()
        n = llm.n_tokens
        for t in np.flatnonzero(p):
            key = prefix + [int(t)]
            m = mass * float(p[t])
            if len(key) == depth or ll.llama_vocab_is_eog(vocab, int(t)):
                law[tuple(key)] = m
                continue
            llm.n_tokens = n          # drop what a sibling branch decoded after this prefix
            llm.eval([int(t)])
            walk(key, m, _row(llm))

    walk([], 1.0, _row(llm))
    return law


def text_law(law: Law, piece) -> Tuple[Dict[Tuple[int, ...], int], List[float], List[str]]:
    """Cells of the law seen through text: ``piece(token) -> bytes``.

    Returns ``(cell_of, probs, cell_texts, texts)``: the cell index of each outcome, each cell's
    probability, its shortest text, and each outcome's text (in the law's order).  Outcomes whose texts are prefixes of one another share a cell (the text
    of a longer completion cannot tell them apart); every other pair of outcomes is told apart by
    the text.  :func:`cell_of_text` classifies a completion's text."""
    keys = list(law)
    texts = [b"".join(piece(t) for t in k).decode("utf-8", errors="replace") for k in keys]
    parent = list(range(len(keys)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(len(keys)):
        for j in range(i + 1, len(keys)):
            if texts[i].startswith(texts[j]) or texts[j].startswith(texts[i]):
                parent[find(i)] = find(j)
    roots = sorted({find(i) for i in range(len(keys))})
    index = {r: c for c, r in enumerate(roots)}
    cell_of = {k: index[find(i)] for i, k in enumerate(keys)}
    probs = [0.0] * len(roots)
    cell_texts = [None] * len(roots)
    for i, k in enumerate(keys):
        c = cell_of[k]
        probs[c] += law[k]
        if cell_texts[c] is None or len(texts[i]) < len(cell_texts[c]):
            cell_texts[c] = texts[i]
    return cell_of, probs, cell_texts, texts


def cell_of_text(text: str, cell_of, texts) -> int:
    """The cell of a completion whose text starts with one outcome's text (-1: none does)."""
    for k, t in zip(cell_of, texts):
        if text.startswith(t):
            return cell_of[k]
    return -1


def chi2_cells(counts: Sequence[int], probs: Sequence[float], outside: int = 0):
    """Chi-square goodness of fit of counts to cell probabilities; cells expected below 5 are
    pooled (with the outcomes outside the support).  Returns ``(stat, dof, p_value, tv)``."""
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    n = counts.sum() + outside
    tv = 0.5 * (np.abs(counts / n - probs).sum() + outside / n)
    big = probs * n >= 5
    obs = np.append(counts[big], counts[~big].sum() + outside)
    exp = np.append(probs[big] * n, probs[~big].sum() * n)
    m = exp > 0
    stat = float(((obs[m] - exp[m]) ** 2 / exp[m]).sum())
    if outside and not m[-1]:
        stat = float("inf")      # outcomes the law gives probability 0
    dof = max(1, int(m.sum()) - 1)
    return stat, dof, chi2_sf(stat, dof) if np.isfinite(stat) else 0.0, float(tv)


def chi2_law(samples: Sequence[Tuple[int, ...]], law: Law):
    """Chi-square of token-tuple samples against a law: ``(stat, dof, p, tv, outside)``."""
    keys = list(law)
    index = {k: i for i, k in enumerate(keys)}
    counts = np.zeros(len(keys))
    outside = 0
    for s in samples:
        i = index.get(tuple(s))
        if i is None:
            outside += 1
        else:
            counts[i] += 1
    stat, dof, p, tv = chi2_cells(counts, [law[k] for k in keys], outside)
    return stat, dof, p, tv, outside


def pit_values(llm, prompt: Sequence[int], generated: Sequence[int], params: Sequence[SamplingParams],
               rng: np.random.Generator, boundary_eps: float = 0.0) -> List[Tuple[List[float], int, int]]:
    """Randomized probability integral transform of a sampled continuation under the target's law,
    for each chain of ``params`` (the continuation is evaluated once for all of them).

    For each generated token t_i, with p_i the distribution llama.cpp's chain gives the ``Llama``
    logits after prompt + t_<i (support ordered by decreasing probability, ties by id):
    u_i = F_i(t_i-) + V_i p_i(t_i), V_i ~ U[0, 1) from ``rng``.  If every t_i was drawn from p_i,
    the u_i are i.i.d. uniform (each is uniform given everything before it), whatever the
    positions, blocks or rollbacks that produced them.

    ``Llama`` evaluates the continuation one token at a time (a one-batch evaluation of the whole
    sequence moves this Q4 model's logits by up to ~0.9 on CPU).  A token outside p_i's support
    whose logit is within ``boundary_eps`` of the lowest kept logit is a numerical boundary case
    (excused and counted, no u); any other is outside.  Returns, per chain,
    ``(u values, outside, excused)``."""
    prompt = [int(t) for t in prompt]
    gen = [int(t) for t in generated]
    v = llm.n_vocab()
    llm.reset()
    llm.eval(prompt)
    chains = [LlamaChain(pr, v, prompt) for pr in params]
    res = [([], 0, 0) for _ in params]
    for i, t in enumerate(gen):
        row = _row(llm)
        for c, chain in enumerate(chains):
            out, outside, excused = res[c]
            p = chain.probs(row)
            chain.accept(t)
            if not p[t] > 0.0:
                if row[np.flatnonzero(p)].min() - row[t] < boundary_eps:
                    excused += 1
                else:
                    outside += 1
                res[c] = (out, outside, excused)
                continue
            support = np.flatnonzero(p)
            order = support[np.lexsort((support, -p[support]))]
            rank = int(np.flatnonzero(order == t)[0])
            out.append(float(p[order[:rank]].sum() + rng.random() * p[t]))
        if i + 1 < len(gen):
            llm.eval([t])
    for chain in chains:
        chain.close()
    return res


def uniform_chi2(u: Sequence[float], bins: int = 10):
    """Chi-square of values in [0, 1) against the uniform law on equal bins: (stat, dof, p, tv)."""
    counts = np.bincount(np.minimum((np.asarray(u) * bins).astype(int), bins - 1), minlength=bins)
    return chi2_cells(counts, [1.0 / bins] * bins)
