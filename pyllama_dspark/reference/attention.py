"""Attention of the block's queries over the sequence's KV cells, with llama.cpp's mask (all
cells, or causal), attention sinks and, under ``emulate_ggml``, the F16 roundings of ggml-cpu's
flash-attention kernel (:func:`fa_f16_accumulate`) or of its soft-max path."""

from __future__ import annotations

from typing import Optional

import numpy as np

from pyllama_dspark.reference.ggml_rounding import round_f16

__all__ = ["Attention", "fa_f16_accumulate"]


class Attention:
    """Mixin of :class:`~pyllama_dspark.reference.model.DraftReference`; reads ``cfg``,
    ``emulate``, ``flash_attn`` and ``kv_type``."""

    def _attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, kpos: np.ndarray,
                qpos: np.ndarray, sinks: Optional[np.ndarray]) -> np.ndarray:
        """q [n, H, D]; k, v [T, Hkv, D] -> [n, H*D]."""
        c = self.cfg
        n, H, D = q.shape
        T = k.shape[0]
        grp = H // c.n_head_kv
        kh = np.repeat(k, grp, axis=1)  # q head h -> kv head h // grp (ggml broadcast)
        vh = np.repeat(v, grp, axis=1)
        if self.emulate:
            q = round_f16(q)  # Q converted to F16 for the dot with the F16 K cache
        s = np.einsum("nhd,thd->nht", q, kh) * c.kq_scale
        keep = np.ones((n, T), dtype=bool)
        if c.causal:
            keep = kpos[None, :] <= qpos[:, None]
        s = np.where(keep[:, None, :], s, -np.inf)
        if self.emulate and self.flash_attn and self.kv_type == "f16":
            out = fa_f16_accumulate(s, vh, keep, sinks)
        else:
            m = s.max(axis=-1, keepdims=True)
            if sinks is not None:
                m = np.maximum(m, sinks[None, :, None])
            e = np.exp(s - m)
            den = e.sum(axis=-1, keepdims=True)
            if sinks is not None:
                den = den + np.exp(sinks[None, :, None] - m)
            p = e / den
            if self.emulate and self.kv_type == "f16":
                p = round_f16(p)  # soft-max output converted to F16 for the V mul_mat
            out = np.einsum("nht,thd->nhd", p, vh)
        return out.reshape(n, H * D)


def fa_f16_accumulate(s: np.ndarray, vh: np.ndarray, keep: np.ndarray,
                      sinks: Optional[np.ndarray]) -> np.ndarray:
    """ggml_compute_forward_flash_attn_ext_f16_one_chunk with an F16 V accumulator."""
    n, H, T = s.shape
    D = vh.shape[-1]
    M = np.full((n, H), -np.inf)
    S = np.zeros((n, H))
    acc = np.zeros((n, H, D))
    for t in range(T):
        live = keep[:, t][:, None]  # masked cells are skipped entirely
        st = s[:, :, t].astype(np.float32).astype(np.float64)
        new_max = live & (st > M)
        with np.errstate(invalid="ignore", over="ignore"):
            ms = np.where(new_max, np.exp(M - st), 1.0)
            vs = np.where(new_max, 1.0, np.exp(st - M))
        ms = np.where(live, ms, 1.0)
        vs = np.where(live, vs, 0.0)
        M = np.where(new_max, st, M)
        acc = np.where(new_max[..., None], round_f16(acc * ms[..., None]), acc)
        upd = round_f16(acc + vh[t][None, :, :] * vs[..., None])
        acc = np.where(live[..., None], upd, acc)
        S = S * ms + vs
    if sinks is not None:
        sk = sinks[None, :]
        big = sk > M
        ms = np.where(big, np.exp(M - sk), 1.0)
        vs = np.where(big, 1.0, np.exp(sk - M))
        acc = acc * ms[..., None]
        S = S * ms + vs
    inv = np.where(S == 0, 0.0, 1.0 / np.where(S == 0, 1.0, S))
    return acc * inv[..., None]
