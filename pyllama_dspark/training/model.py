"""The DSpark draft network in PyTorch, computing exactly what llama.cpp's ``dflash`` graph does.

Mirrors ``src/models/dflash.cpp`` (and :mod:`pyllama_dspark.reference`, its numpy twin):

* context rows (injected): ``g = RMSNorm(fc · features) * enc_norm``; per layer ``K = k_norm(W_k g)``
  roped (NeoX pairing) at the row's position and ``V = W_v g`` -- no ``attn_norm`` on this path;
* block rows ``[anchor, mask × (B-1)]`` at positions ``a .. a+B-1``: token embeddings (the
  target's, frozen) → Qwen3-style layers (attn_norm, Q/K/V, q/k RMS norms, RoPE, attention over
  the context rows ``< a`` and the whole block -- non-causal inside the block -- W_o, residual,
  ffn_norm, SwiGLU, residual) → output_norm = ``h`` → own lm_head over the draft vocabulary;
* Markov head: ``logits_i = U_i + W2 · W1[prev_i]`` with ``prev_0`` = the anchor and ``prev_i`` the
  token at ``a+i`` (teacher forcing; at inference llama.cpp uses the previous argmax, which is
  the same token whenever it matters: after an accepted draft);
* confidence head: ``c_i = sigmoid(w · [h_i ; W1[prev_i]] + b)``.

Many blocks of one sequence are computed together: they share the context K/V, each block's
queries see the context positions before its anchor and the block itself.
"""

from __future__ import annotations

from dataclasses import dataclass, asdict
from typing import Dict, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["DraftSpec", "DSparkDraft"]


@dataclass
class DraftSpec:
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_layers: int
    block_size: int
    markov_rank: int
    rope_base: float
    rms_eps: float
    n_vocab: int            # target vocabulary (Markov W1 rows, token ids)
    n_feat: int             # m * n_embd
    target_layers: Sequence[int]
    mask_token_id: int

    def to_dict(self) -> Dict:
        d = asdict(self)
        d["target_layers"] = [int(x) for x in self.target_layers]
        return d


def _rms(x: torch.Tensor, w: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


class DSparkDraft(nn.Module):
    def __init__(self, spec: DraftSpec, tok_embd: np.ndarray, d2t: np.ndarray, head_init: np.ndarray,
                 train_head: bool = False, seed: int = 0, feat_scale: Optional[np.ndarray] = None):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.spec = spec
        d, H, Hkv, hd, ff = spec.n_embd, spec.n_head, spec.n_head_kv, spec.head_dim, spec.n_ff

        def lin(o, i, std=None):
            std = std if std is not None else i ** -0.5
            return nn.Parameter(torch.randn(o, i, generator=g) * std)

        self.register_buffer("tok_embd", torch.from_numpy(np.ascontiguousarray(tok_embd, dtype=np.float32)),
                             persistent=False)
        self.register_buffer("d2t", torch.from_numpy(np.asarray(d2t, dtype=np.int64)))
        t2d = np.full(spec.n_vocab, -1, dtype=np.int64)
        t2d[np.asarray(d2t)] = np.arange(len(d2t))
        self.register_buffer("t2d", torch.from_numpy(t2d))
        # per-dimension feature scale (RMS over the data): training sees features / scale, the export
        # folds 1/scale into fc.  SmolLM2's layer inputs have "massive activation" dimensions ~1000x
        # the median; unscaled, they would dominate fc's output and flatten the context.
        fs = np.ones(spec.n_feat, dtype=np.float32) if feat_scale is None else np.asarray(feat_scale, np.float32)
        self.register_buffer("feat_scale", torch.from_numpy(fs.copy()))
        self.fc = lin(d, spec.n_feat, std=spec.n_feat ** -0.5)
        self.enc_norm = nn.Parameter(torch.ones(d))
        self.layers = nn.ModuleList()
        for _ in range(spec.n_layers):
            L = nn.Module()
            L.attn_norm = nn.Parameter(torch.ones(d))
            L.wq = lin(H * hd, d)
            L.wk = lin(Hkv * hd, d)
            L.wv = lin(Hkv * hd, d)
            L.wo = lin(d, H * hd, std=(H * hd) ** -0.5 * 0.5)
            L.q_norm = nn.Parameter(torch.ones(hd))
            L.k_norm = nn.Parameter(torch.ones(hd))
            L.ffn_norm = nn.Parameter(torch.ones(d))
            L.gate = lin(ff, d)
            L.up = lin(ff, d)
            L.down = lin(d, ff, std=ff ** -0.5 * 0.5)
            self.layers.append(L)
        self.out_norm = nn.Parameter(torch.ones(d))
        head = torch.from_numpy(np.ascontiguousarray(head_init, dtype=np.float32))
        self.head = nn.Parameter(head, requires_grad=train_head)
        R = spec.markov_rank
        self.w1 = nn.Parameter(torch.randn(spec.n_vocab, R, generator=g) * 0.1)
        self.w2 = nn.Parameter(torch.zeros(len(d2t), R))
        self.conf_w = nn.Parameter(torch.zeros(1, d + R))
        self.conf_b = nn.Parameter(torch.zeros(1))
        half = hd // 2
        self.register_buffer("inv_freq", spec.rope_base ** (-torch.arange(half, dtype=torch.float64) * 2.0 / hd),
                             persistent=False)

    # ------------------------------------------------------------------ pieces
    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """NeoX RoPE on [..., n, heads, hd] with positions [n]."""
        ang = (pos.to(torch.float64)[:, None] * self.inv_freq[None, :]).to(x.dtype)  # [n, half]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        half = x.shape[-1] // 2
        x0, x1 = x[..., :half], x[..., half:]
        return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)

    def encode(self, feats: torch.Tensor) -> torch.Tensor:
        return _rms((feats / self.feat_scale) @ self.fc.t(), self.enc_norm, self.spec.rms_eps)

    def fc_folded(self) -> torch.Tensor:
        """fc as llama.cpp applies it to raw features (the feature scale folded in)."""
        return self.fc / self.feat_scale[None, :]

    def forward_blocks(self, feats: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                       use_markov: bool = True):
        """One sequence, many blocks.

        feats [Lc, n_feat] (features of positions 0..Lc-1), tokens [L] (the sequence; tokens past
        the end are never read for prediction targets), anchors [nb] (block start positions, each
        <= Lc).  Returns (logits [nb, B, V_d], hidden [nb, B, d], w1_prev [nb, B, R])."""
        s = self.spec
        B, H, Hkv, hd = s.block_size, s.n_head, s.n_head_kv, s.head_dim
        nb = anchors.shape[0]
        Lc = feats.shape[0]
        ctx_pos = torch.arange(Lc)
        gctx = self.encode(feats)                                           # [Lc, d]
        qpos = anchors[:, None] + torch.arange(B)[None, :]                  # [nb, B]
        blk_tok = torch.full((nb, B), s.mask_token_id, dtype=torch.long)
        blk_tok[:, 0] = tokens[anchors]
        x = self.tok_embd[blk_tok]                                          # [nb, B, d]
        ctx_keep = ctx_pos[None, :] < anchors[:, None]                      # [nb, Lc]
        grp = H // Hkv
        flat_pos = qpos.reshape(-1)
        for L in self.layers:
            kc = _rms((gctx @ L.wk.t()).view(Lc, Hkv, hd), L.k_norm, s.rms_eps)
            kc = self.rope(kc, ctx_pos)                                     # [Lc, Hkv, hd]
            vc = (gctx @ L.wv.t()).view(Lc, Hkv, hd)
            hn = _rms(x, L.attn_norm, s.rms_eps)
            q = _rms((hn @ L.wq.t()).view(nb * B, H, hd), L.q_norm, s.rms_eps)
            q = self.rope(q, flat_pos).view(nb, B, H, hd)
            kb = _rms((hn @ L.wk.t()).view(nb * B, Hkv, hd), L.k_norm, s.rms_eps)
            kb = self.rope(kb, flat_pos).view(nb, B, Hkv, hd)
            vb = (hn @ L.wv.t()).view(nb, B, Hkv, hd)
            qg = q.view(nb, B, Hkv, grp, hd)
            scale = hd ** -0.5
            s_ctx = torch.einsum("nbkgd,tkd->nbkgt", qg, kc) * scale        # [nb, B, Hkv, grp, Lc]
            s_ctx = s_ctx.masked_fill(~ctx_keep[:, None, None, None, :], float("-inf"))
            s_blk = torch.einsum("nbkgd,nckd->nbkgc", qg, kb) * scale       # [nb, B, Hkv, grp, B]
            p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1)
            o = torch.einsum("nbkgt,tkd->nbkgd", p[..., :Lc], vc) + torch.einsum("nbkgc,nckd->nbkgd", p[..., Lc:], vb)
            att = o.reshape(nb, B, H * hd) @ L.wo.t()
            h1 = x + att
            f = _rms(h1, L.ffn_norm, s.rms_eps)
            x = h1 + (F.silu(f @ L.gate.t()) * (f @ L.up.t())) @ L.down.t()
        h = _rms(x, self.out_norm, s.rms_eps)                               # [nb, B, d]
        u = h @ self.head.t()                                               # [nb, B, V_d]
        prev = tokens[qpos]                                                 # prev_i = token at a+i
        w1p = self.w1[prev]                                                 # [nb, B, R]
        if use_markov:
            u = u + w1p @ self.w2.t()
        return u, h, w1p

    def confidence(self, h: torch.Tensor, w1p: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(torch.cat([h, w1p], dim=-1) @ self.conf_w.t() + self.conf_b).squeeze(-1)
