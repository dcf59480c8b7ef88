"""Token probabilities as llama-server reports them (``n_probs``, OpenAI ``logprobs``): pure numpy.

llama-server (``tools/server/server-context.cpp``, ``populate_token_probs``) gives, for every
generated token, its probability and the ``n_probs`` most likely tokens:

* pre-sampling (the default): the softmax of the target's raw logits row, the whole vocabulary,
  sorted by decreasing probability (no penalties, bias or grammar: the row as the model gave it);
* ``post_sampling_probs``: the distribution the sampler chain drew from (penalties, logit bias,
  grammar, top-k / top-p / min-p, temperature), its non-zero entries only; at temperature 0 the
  pick has probability 1.

Under speculation the rows are the target's verify rows (an accepted draft token gets the target's
probability, never the draft's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

import numpy as np


@dataclass
class TokenProb:
    """One generated token: its id, its probability, and the top ``n`` (id, probability) pairs in
    decreasing order (ties by increasing id)."""
    id: int
    prob: float
    top: List[Tuple[int, float]] = field(default_factory=list)


def _top_order(p: np.ndarray, n: int) -> np.ndarray:
    """Indices of the n largest entries of p, by decreasing value then increasing index."""
    n = min(int(n), p.size)
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    if n < p.size:
        part = np.argpartition(-p, n - 1)[:n]
        # entries equal to the n-th value may be cut anywhere by argpartition: take all of them
        thr = p[part].min()
        part = np.flatnonzero(p >= thr)
    else:
        part = np.arange(p.size)
    order = np.lexsort((part, -p[part]))
    return part[order][:n]


def pre_sampling(logits: np.ndarray, token: int, n: int) -> TokenProb:
    """Probabilities from the softmax of a raw logits row (llama-server's default)."""
    x = np.asarray(logits, dtype=np.float64)
    mx = x.max()
    e = np.exp(x - mx)
    p = e / e.sum()
    top = _top_order(p, n)
    return TokenProb(int(token), float(p[int(token)]), [(int(i), float(p[i])) for i in top])


def post_sampling(ids: np.ndarray, probs: np.ndarray, token: int, n: int) -> TokenProb:
    """Probabilities from the sampler chain's distribution (``ids``, ``probs``: its support;
    zero entries dropped, as llama-server drops them)."""
    ids = np.asarray(ids, dtype=np.int64)
    pr = np.asarray(probs, dtype=np.float64)
    nz = pr > 0.0
    ids, pr = ids[nz], pr[nz]
    tot = pr.sum()
    if tot > 0:
        pr = pr / tot
    hit = np.flatnonzero(ids == int(token))
    prob = float(pr[hit[0]]) if hit.size else 0.0
    top = _top_order(pr, n)
    return TokenProb(int(token), prob, [(int(ids[i]), float(pr[i])) for i in top])


def one_hot(token: int) -> TokenProb:
    """A greedy pick after the chain: probability 1, alone in its top list."""
    return TokenProb(int(token), 1.0, [(int(token), 1.0)])
