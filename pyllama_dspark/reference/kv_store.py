"""The draft context's memory for one sequence: injection of target features (encoder, then each
layer's K with k-norm and RoPE, and V, stored at their positions), rollback, and reading the
stored K / V.  Cells are kept unrounded; the cache type's rounding is applied when attention
reads them."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np

__all__ = ["KVStore"]


class KVStore:
    """Mixin of :class:`~pyllama_dspark.reference.model.DraftReference`: ``_cells`` maps a
    position to (per-layer K [n_head_kv, head_dim] list, V list).  Reads ``cfg``, the encoder and
    layer weights, and calls ``_mm``, ``_rms`` and ``_rope``."""

    def encode(self, features: np.ndarray) -> np.ndarray:
        """fc -> RMSNorm(enc.output_norm): [n, m*d_t] -> [n, n_embd]."""
        f = np.asarray(features, dtype=np.float64)
        if f.ndim == 1:
            f = f[None, :]
        if f.shape[1] != self.cfg.n_embd_inp:
            raise ValueError(f"features must have {self.cfg.n_embd_inp} columns, got {f.shape[1]}")
        g = self._mm(self.fc, f, self.fc_s)
        return self._rms(g, self.enc_norm)

    def _kv_from_hidden(self, L: Dict[str, Any], x: np.ndarray, positions: Sequence[int],
                        e_zero: bool = False):
        c = self.cfg
        n = x.shape[0]
        k = self._mm(L["wk"], x, L["wk_s"])
        shared = L["wv"] is None
        v = k if shared else self._mm(L["wv"], x, L["wv_s"])
        k = k.reshape(n, c.n_head_kv, c.head_dim)
        v = v.reshape(n, c.n_head_kv, c.head_dim)
        k = self._rms(k, L["k_norm"])
        if shared:
            v = self._rms(v, None)
        k = self._rope(k, positions, e_zero)
        return k, v

    def _check_positions(self, positions: Sequence[int]) -> None:
        ps = [int(p) for p in positions]
        if len(set(ps)) != len(ps):
            raise ValueError("duplicate positions in one batch")
        lo, hi = min(ps), max(ps)
        if hi - lo + 1 != len(ps):
            raise ValueError("positions in a batch must be contiguous")
        if self._cells:
            last = max(self._cells)
            if lo != last + 1:
                raise ValueError(
                    f"positions must continue the stored sequence: last stored {last}, got {lo}")

    def inject(self, features: np.ndarray, positions: Sequence[int]) -> np.ndarray:
        """Encode feature rows and store each layer's K (k-norm, RoPE) and V at ``positions``.

        Returns the encoded rows [n, n_embd] (``inp_g``)."""
        positions = [int(p) for p in np.asarray(positions).reshape(-1)]
        g = self.encode(features)
        if g.shape[0] != len(positions):
            raise ValueError("one position per feature row")
        self._check_positions(positions)
        ks, vs = [], []
        for L in self.layers:
            k, v = self._kv_from_hidden(L, g, positions, e_zero=True)
            ks.append(k)
            vs.append(v)
        for r, p in enumerate(positions):
            self._cells[p] = ([k[r] for k in ks], [v[r] for v in vs])
        return g

    def rollback(self, pos_from: int) -> None:
        """Drop every stored position >= pos_from (llama_memory_seq_rm(mem, 0, pos_from, -1))."""
        for p in [p for p in self._cells if p >= pos_from]:
            del self._cells[p]

    def clear(self) -> None:
        self._cells.clear()

    @property
    def positions(self) -> List[int]:
        return sorted(self._cells)

    def layer_kv(self, layer: int, positions: Optional[Sequence[int]] = None):
        """Stored K, V of one layer for ``positions`` (default: all, sorted): [n, n_head_kv, hd]."""
        ps = self.positions if positions is None else [int(p) for p in positions]
        k = np.stack([self._cells[p][0][layer] for p in ps]) if ps else np.zeros(
            (0, self.cfg.n_head_kv, self.cfg.head_dim))
        v = np.stack([self._cells[p][1][layer] for p in ps]) if ps else np.zeros_like(k)
        return k, v
