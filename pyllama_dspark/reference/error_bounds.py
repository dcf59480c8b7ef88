"""Rigorous per-element bounds of llama.cpp's deviation from the reference when both start from
the same hidden rows: one mat-mul (:func:`mm_error_bound`), the logits and the confidence of the
DSpark heads (:meth:`ErrorBounds.logits_error_bound`, :meth:`ErrorBounds.conf_error_bound`)."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from gguf import GGMLQuantizationType as QT

from pyllama_dspark.reference.ggml_rounding import vec_dot_type
from pyllama_dspark.reference.gguf_tensors import Tensor, tensor_scalar

__all__ = ["ErrorBounds", "mm_error_bound"]


def mm_error_bound(w: Tensor, x: np.ndarray, emulated: bool, chunk: int = 8192) -> np.ndarray:
    """Bound on |ggml_mul_mat(w, x) - (this reference's product)| per output element.

    Two terms: (1) unless ``emulated``, the conversion of x to the weight's vec_dot_type
    (F16: |x| 2^-11; BF16: |x| 2^-8; Q8_0/Q8_1 blocks of 32: d (1/2 + 127 * 2^-11) with
    d = amax/127, the 2^-11 being the F16 rounding of d; Q8_K blocks of 256: d/2), weighted by
    |w|; (2) float32 accumulation of n products, gamma = (n + 3) 2^-24 times sum |w| |x^|
    (covers any summation order, the float32 rounding of dequantized *_1 weights and the
    per-tensor scale).  Not covered: the F16 rounding of the Q8_1 block sum (relative 2^-11
    of a term that multiplies the weight block minimum)."""
    x = np.asarray(x, dtype=np.float64)
    act = vec_dot_type(w.type)
    n_in = x.shape[-1]
    if emulated or act in (None, QT.F32):
        e = np.zeros_like(x)
    elif act == QT.F16:
        e = np.abs(x) * 2.0 ** -11 + 2.0 ** -25
    elif act == QT.BF16:
        e = np.abs(x) * 2.0 ** -8
    elif act in (QT.Q8_0, QT.Q8_1):
        b = np.abs(x).reshape(x.shape[0], -1, 32)
        d = b.max(axis=2, keepdims=True) / 127.0
        e = np.broadcast_to(d * (0.5 + 127.0 * 2.0 ** -11), b.shape).reshape(x.shape)
    elif act == QT.Q8_K:
        b = np.abs(x).reshape(x.shape[0], -1, 256)
        d = b.max(axis=2, keepdims=True) / 127.0
        e = np.broadcast_to(d * 0.5, b.shape).reshape(x.shape)
    else:
        raise NotImplementedError(f"error bound for activations of type {act!r}")
    mag = np.abs(x) + e
    gamma = (n_in + 3) * 2.0 ** -24
    rhs = np.concatenate([e, mag * gamma], axis=0)  # one |W| pass for both terms
    W = w.data
    out = np.empty((rhs.shape[0], W.shape[0]), dtype=np.float64)
    for s0 in range(0, W.shape[0], chunk):
        out[:, s0:s0 + chunk] = rhs @ np.abs(W[s0:s0 + chunk].astype(np.float64)).T
    n = x.shape[0]
    return out[:n] + out[n:]


class ErrorBounds:
    """Mixin of :class:`~pyllama_dspark.reference.model.DraftReference`; reads ``cfg``,
    ``emulate``, the lm_head and head weights, and calls its ``_mm``, ``base_logits`` and
    ``markov_bias``."""

    def logits_error_bound(self, hidden: np.ndarray, prev: Sequence[int],
                           emulated: Optional[bool] = None) -> np.ndarray:
        """Per-element bound [n, n_vocab] on |llama.cpp logits - ``heads(hidden, prev)`` logits|
        when llama.cpp computes from the same ``hidden`` and conditions on the same ``prev``
        (``-1`` = unbiased row): lm_head and Markov-bias mat-mul bounds (:func:`mm_error_bound`)
        plus the float32 rounding of the bias addition."""
        emulated = self.emulate if emulated is None else emulated
        hb = mm_error_bound(self.head, hidden, emulated)
        s = tensor_scalar(self.head_s)
        if s is not None:
            hb = hb * abs(s)
        if self.d2t is not None:
            full = np.zeros((hb.shape[0], self.cfg.n_vocab))
            full[:, self.d2t] = hb
            hb = full
        prev = np.asarray(prev, dtype=np.int64).reshape(-1)
        if self.w1 is not None and np.any(prev >= 0):
            rows = np.nonzero(prev >= 0)[0]
            w1p = self.w1.data[prev[rows]].astype(np.float64)
            bb = mm_error_bound(self.w2, w1p, emulated)
            if self.w2_s is not None:
                bb = bb * abs(self.w2_s)
            if self.d2t is not None:
                full = np.zeros((bb.shape[0], self.cfg.n_vocab))
                full[:, self.d2t] = bb
                bb = full
            hb[rows] += bb
            base = self.base_logits(hidden[rows])
            bias = self.markov_bias(prev[rows])
            with np.errstate(invalid="ignore"):
                hb[rows] += np.nan_to_num(np.abs(base + bias), posinf=0.0) * 2.0 ** -24
        return hb

    def conf_error_bound(self, hidden: np.ndarray, prev: Sequence[int],
                         emulated: Optional[bool] = None) -> np.ndarray:
        """Per-row bound [n] on |llama.cpp confidence - this reference's| from the same hidden rows
        and conditioning tokens: 1/4 (the sigmoid's Lipschitz constant) times the conf_proj
        mat-mul bound and the float32 bias addition, plus 4 ulp for expf."""
        if self.conf_w is None:
            raise ValueError("draft has no confidence head")
        emulated = self.emulate if emulated is None else emulated
        prev = np.asarray(prev, dtype=np.int64).reshape(-1)
        feat = np.concatenate([np.asarray(hidden, dtype=np.float64),
                               self.w1.data[prev].astype(np.float64)], axis=1)
        zb = mm_error_bound(self.conf_w, feat, emulated)[:, 0]
        z = self._mm(self.conf_w, feat)[:, 0] + (self.conf_b or 0.0)
        return 0.25 * (zb + np.abs(z) * 2.0 ** -24) + 4 * 2.0 ** -24
