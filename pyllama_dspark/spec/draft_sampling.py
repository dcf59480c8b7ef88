"""Semi-autoregressive DSpark drafting at temperature > 0.

llama.cpp's draft graph runs the Markov chain itself, greedily: output row k of a DSpark block is
``U_k + B(a_{k-1})`` where ``a_{k-1}`` is the argmax of the previous *output* row (the anchor for
the first prediction slot) and ``B(prev) = W2 . W1[prev]``.  Sampling needs the chain conditioned
on the token actually drawn at k-1 instead:

    p_d,k  ∝  chain( U_k + B(x_{k-1}) )  =  chain( row_k - B(a_{k-1}) + B(x_{k-1}) )

with ``chain`` the same sampler chain the target goes through (:mod:`.chain`).  Where the drawn
token equals the argmax the row is already right; elsewhere one small device call on the shim's
Markov graph returns ``B(a_{k-1})``, ``B(x_{k-1})`` and ``W1[x_{k-1}]`` (no host-side W2.W1
product), and the confidence is recomputed with the drawn token:
``c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b)`` from the draft's hidden state ``h_k``.

Reduced-vocabulary drafts (``d2t``): the bias rows live in the draft vocabulary and are scattered
to the target ids (``row_k`` is -inf on every other id, so those stay impossible).

``conditioning="argmax"`` keeps llama.cpp's greedy conditioning (q_k = chain(row_k) as returned
by the graph).  That proposal is still verified losslessly, but it is not the DSpark draft
distribution; it exists to compare against (and to show that the tests notice the difference).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from pyllama_dspark.errors import DraftMismatchError

CONDITIONING = ("sampled", "argmax")


@dataclass
class ConfHead:
    """conf_proj split at n_embd: c = sigmoid(w_h . h + w_r . W1[prev] + b)."""
    w_h: np.ndarray   # float64 [n_embd]
    w_r: np.ndarray   # float64 [rank]
    b: float

    def __call__(self, h: np.ndarray, w1_prev: np.ndarray) -> float:
        z = float(np.dot(self.w_h, h)) + float(np.dot(self.w_r, w1_prev)) + self.b
        return float(1.0 / (1.0 + np.exp(-z)))


def _tensor_values(reader, name: str) -> Optional[np.ndarray]:
    """A tensor's values, flattened (dequantized to float32 for quantized / half types)."""
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import dequantize

    for t in reader.tensors:
        if t.name == name:
            data = np.asarray(t.data)
            if t.tensor_type not in (QT.F32, QT.F16, QT.I8, QT.I16, QT.I32, QT.I64, QT.F64):
                data = dequantize(data, t.tensor_type)
            return np.asarray(data).reshape(-1)
    return None


def read_conf_head(path: str, n_embd: int, rank: int) -> Optional[ConfHead]:
    """The confidence head of a DSpark draft GGUF (None when it has none)."""
    from pyllama_dspark.gguf.reader import read_gguf

    r = read_gguf(os.fspath(path))
    w = _tensor_values(r, "conf_proj.weight")
    if w is None:
        return None
    if w.size != n_embd + rank:
        raise DraftMismatchError(f"conf_proj.weight has {w.size} values, expected n_embd + rank = {n_embd + rank}")
    b = _tensor_values(r, "conf_proj.bias")
    w = w.astype(np.float64)
    return ConfHead(w[:n_embd].copy(), w[n_embd:].copy(), float(b[0]) if b is not None else 0.0)


def read_d2t(path: str) -> Optional[np.ndarray]:
    """The draft-row -> target-id table of a reduced-vocabulary draft (None for a full vocabulary)."""
    from pyllama_dspark.gguf.reader import read_gguf

    t = _tensor_values(read_gguf(os.fspath(path)), "d2t")
    return None if t is None else t.astype(np.int64)


def bias_delta(b_graph: np.ndarray, b_sampled: np.ndarray, d2t: Optional[np.ndarray], n_vocab: int) -> np.ndarray:
    """B(x) - B(a) on the target vocabulary (float32 [n_vocab]): what turns llama.cpp's row
    conditioned on a into the row conditioned on x.  Reduced-vocabulary drafts scatter the draft
    rows to their target ids through ``d2t`` (every other id gets 0)."""
    d = np.asarray(b_sampled, dtype=np.float32) - np.asarray(b_graph, dtype=np.float32)
    if d2t is None:
        if d.size != n_vocab:
            raise ValueError(f"bias rows have {d.size} entries for a {n_vocab}-token vocabulary and no d2t")
        return d
    if d2t.size != d.size:
        raise ValueError(f"d2t has {d2t.size} entries, the bias rows {d.size}")
    full = np.zeros(n_vocab, dtype=np.float32)
    full[d2t] = d
    return full


class BlockSampler:
    """Draws the drafts of one decoded block, left to right, with the sampled-token Markov chain.

    ``markov`` is the shim's :class:`~.handles.MarkovHead` (None for a DFlash draft: its block
    rows are independent, q_k = chain(row_k)); ``conf`` the confidence head (or None); ``d2t``
    the reduced-vocabulary table (or None)."""

    def __init__(self, draft, markov=None, conf: Optional[ConfHead] = None, d2t: Optional[np.ndarray] = None,
                 conditioning: str = "sampled"):
        if conditioning not in CONDITIONING:
            raise ValueError(f"conditioning must be one of {CONDITIONING}, got {conditioning!r}")
        self.draft = draft
        self.markov = markov
        self.conf = conf
        self.d2t = d2t
        self.conditioning = conditioning
        self.n_vocab = draft.n_vocab
        cap = draft.meta.block_size + 1
        self._argmax = np.zeros(cap, dtype=np.int32)
        self._margin = np.zeros(cap, dtype=np.float32)
        self._conf = np.zeros(cap, dtype=np.float32)
        self.n_bias_calls = 0

    def sample(self, row0: int, n: int, smp, with_conf: bool = True):
        """Drafts from rows row0..row0+n-1 of the last block decode: (tokens, q rows, confidence)."""
        d = self.draft
        d.argmax(row0, n, self._argmax, self._margin)
        conf = None
        if with_conf and self.conf is not None:
            d.confidence(row0, n, self._conf)
            conf = self._conf[:n].copy()
        a = self._argmax
        tokens: List[int] = []
        q_rows: List[np.ndarray] = []
        for k in range(n):
            logits = d.logits_view(row0 + k)
            if self.markov is not None and k > 0 and self.conditioning == "sampled":
                prev_graph, prev = int(a[k - 1]), tokens[k - 1]
                if prev != prev_graph:
                    bias, w1 = self.markov.bias_w1([prev_graph, prev])
                    self.n_bias_calls += 1
                    logits = logits + bias_delta(bias[0], bias[1], self.d2t, self.n_vocab)
                    if conf is not None:
                        conf[k] = self.conf(d.hidden(row0 + k), w1[1])
            q = smp.draft_probs(logits, tokens)
            tokens.append(smp.sample(q))
            q_rows.append(q)
        return np.asarray(tokens, dtype=np.int32), q_rows, conf
