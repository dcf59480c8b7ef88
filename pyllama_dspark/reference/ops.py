"""The graph's building blocks as the reference computes them: ``ggml_mul_mat``
(:meth:`GraphOps._mm`, with ggml-cpu's activation rounding under ``emulate_ggml``), RMS norm, the
KV cache's storage rounding, NeoX RoPE (with YaRN / linear scaling and M-RoPE sections) and the
SwiGLU / GELU feed-forward."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence

import numpy as np

from pyllama_dspark.reference.ggml_rounding import (
    round_activations, round_bf16, round_f16, vec_dot_type)
from pyllama_dspark.reference.gguf_tensors import Tensor

__all__ = ["GraphOps"]


class GraphOps:
    """Mixin of :class:`~pyllama_dspark.reference.model.DraftReference`; reads ``cfg``,
    ``emulate``, ``kv_type`` and ``rope_freqs``."""

    def _mm(self, w: Tensor, x: np.ndarray, scale: Optional[float] = None,
            chunk: int = 8192) -> np.ndarray:
        """ggml_mul_mat(w, x) (+ optional per-tensor scale): x [n, in] -> [n, out]."""
        x = np.asarray(x, dtype=np.float64)
        if self.emulate:
            x = round_activations(x, vec_dot_type(w.type))
        W = w.data
        if W.shape[0] <= chunk:
            y = x @ W.astype(np.float64).T
        else:  # bound the float64 temporary for vocabulary-sized matrices
            y = np.empty((x.shape[0], W.shape[0]), dtype=np.float64)
            for s in range(0, W.shape[0], chunk):
                y[:, s:s + chunk] = x @ W[s:s + chunk].astype(np.float64).T
        if scale is not None:
            y = y * scale
        return y

    def _rms(self, x: np.ndarray, w: Optional[np.ndarray]) -> np.ndarray:
        y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.cfg.rms_eps)
        return y if w is None else y * w

    def _round_kv(self, x: np.ndarray) -> np.ndarray:
        if not self.emulate or self.kv_type == "f32":
            return x
        return round_f16(x) if self.kv_type == "f16" else round_bf16(x)

    def _rope_cos_sin(self, positions: np.ndarray, e_zero: bool = False):
        """cos/sin [n, n_rot/2] as ggml_rope_cache_init builds them (NeoX pairing).

        M-RoPE drafts (``rope.dimension_sections``): a token batch broadcasts its position to all
        four sections; an embedding (injection) batch carries (p, p, p, 0) as
        common/speculative.cpp writes it (``e_zero``), so pairs of the 4th section get angle 0."""
        c = self.cfg
        half = c.n_rot // 2
        p = np.asarray(positions, dtype=np.float64).reshape(-1)
        i = np.arange(half)
        if self.emulate:
            # ggml_rope_cache_init: theta = p, then theta *= theta_scale per pair, in float32
            ts = np.float32(np.power(np.float32(c.freq_base), np.float32(-2.0 / c.n_rot)))
            th = np.empty((p.shape[0], half), dtype=np.float32)
            cur = p.astype(np.float32)
            for k in range(half):
                th[:, k] = cur
                cur = (cur * ts).astype(np.float32)
            theta_extrap = th.astype(np.float64)
        else:
            theta_extrap = p[:, None] * np.power(c.freq_base, -2.0 * i / c.n_rot)[None, :]
        if e_zero and c.rope_sections != (0, 0, 0, 0):
            s = c.rope_sections
            sect = i % max(1, sum(s))
            theta_extrap = np.where(sect[None, :] >= s[0] + s[1] + s[2], 0.0, theta_extrap)
        if self.rope_freqs is not None:
            theta_extrap = theta_extrap / self.rope_freqs[:half][None, :]
        theta_interp = c.freq_scale * theta_extrap
        mscale = c.attn_factor
        if c.ext_factor != 0.0:
            def corr_dim(n_rot_beta: float) -> float:
                return c.n_rot * math.log(c.n_ctx_orig / (n_rot_beta * 2 * math.pi)) / (
                    2 * math.log(c.freq_base))
            lo = max(0.0, math.floor(corr_dim(c.beta_fast)))
            hi = min(c.n_rot - 1.0, math.ceil(corr_dim(c.beta_slow)))
            y = (i - lo) / max(0.001, hi - lo)
            ramp = (1.0 - np.clip(y, 0.0, 1.0)) * c.ext_factor
            theta = theta_interp * (1.0 - ramp) + theta_extrap * ramp
            mscale *= 1.0 + 0.1 * math.log(1.0 / c.freq_scale)
        else:
            theta = theta_interp
        return np.cos(theta) * mscale, np.sin(theta) * mscale

    def _rope(self, x: np.ndarray, positions: Sequence[int], e_zero: bool = False) -> np.ndarray:
        """NeoX RoPE on x [n, heads, head_dim]: pairs (j, j + n_rot/2), dims >= n_rot untouched."""
        cos, sin = self._rope_cos_sin(np.asarray(positions), e_zero)
        half = self.cfg.n_rot // 2
        out = x.copy()
        x0 = x[:, :, :half]
        x1 = x[:, :, half:2 * half]
        cos = cos[:, None, :]
        sin = sin[:, None, :]
        out[:, :, :half] = x0 * cos - x1 * sin
        out[:, :, half:2 * half] = x0 * sin + x1 * cos
        return out

    def _ffn(self, L: Dict[str, Any], x: np.ndarray) -> np.ndarray:
        up = self._mm(L["up"], x, L["up_s"])
        gate = self._mm(L["gate"], x, L["gate_s"])
        if self.cfg.ffn_act == "silu":
            act = gate / (1.0 + np.exp(-gate))
        else:  # ggml_gelu: tanh approximation
            act = 0.5 * gate * (1.0 + np.tanh(math.sqrt(2.0 / math.pi)
                                              * (gate + 0.044715 * gate ** 3)))
        return self._mm(L["down"], act * up, L["down_s"])
