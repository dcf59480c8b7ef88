"""The reference itself: :class:`DraftReference` (one sequence of a dflash-arch draft as llama.cpp
runs it) and :class:`RefBlock`, its result for one block decode.  The block decode (layers,
lm_head, the DSpark Markov / confidence heads) is here; loading, the KV store, attention, the
graph's primitives and the error bounds are the mixins it is built from (see the package
docstring)."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

from pyllama_dspark.reference.attention import Attention
from pyllama_dspark.reference.error_bounds import ErrorBounds
from pyllama_dspark.reference.gguf_tensors import GGUFFile, open_target, tensor_scalar
from pyllama_dspark.reference.kv_store import KVStore
from pyllama_dspark.reference.loading import WeightLoading
from pyllama_dspark.reference.ops import GraphOps

__all__ = ["DraftReference", "RefBlock"]


@dataclass
class RefBlock:
    """Reference outputs for one block decode (rows are block slots 0..n-1)."""

    tokens: List[int]
    pos0: int
    hidden: np.ndarray                 # [n, n_embd]  output_norm(h) == res->t_embd
    base_logits: np.ndarray            # [n, n_vocab] U (before the Markov bias; -inf off-d2t)
    logits: np.ndarray                 # [n, n_vocab] what llama_get_logits_ith returns per row
    conf: Optional[np.ndarray]         # [n] or None (no confidence head / head skipped)
    prev: np.ndarray                   # [n] conditioning token of each row (-1: unbiased row)
    markov_applied: bool
    layer_k: List[np.ndarray] = field(default_factory=list)  # per layer [n, n_head_kv, head_dim]
    layer_v: List[np.ndarray] = field(default_factory=list)


class DraftReference(KVStore, Attention, GraphOps, ErrorBounds, WeightLoading):
    """Numpy model of a dflash-arch draft as llama.cpp runs it (one sequence).

    ``DraftReference(draft_path, target_path)`` reads the draft and, when the draft lacks them,
    the target's ``token_embd.weight`` (input embedding) and lm_head (``output.weight``, or the
    tied ``token_embd.weight`` as the target's own loader does), mirroring ``ctx_other``.

    The object holds a KV store mirroring the draft context's memory for sequence 0:
    ``inject(features, positions)`` adds cells, ``rollback(pos_from)`` is
    ``llama_memory_seq_rm(mem, 0, pos_from, -1)``, ``block(tokens, pos0)`` decodes a block
    (``keep=True`` leaves the block's K/V in the store, as llama.cpp's memory does until the
    caller removes it).  Positions must stay contiguous, as llama.cpp's batch validation demands.

    ``emulate_ggml=True`` applies ggml-cpu's deterministic roundings: activations rounded to the
    weight's vec_dot_type before every mat-mul (Q8_0 blocks of 32 for Q4_0/Q8_0 weights, Q8_K for
    k-quants, F16 for F16 weights), K and V stored as ``kv_type`` (F16 by default, as
    ``llama_context_default_params``), Q converted to F16 for the K·Q dot, and either the F16
    running accumulator of the CPU flash-attention kernel (``flash_attn=True``, cells visited in
    position order) or, without flash attention, the soft-max probabilities rounded to F16 before
    the V product; RoPE angles follow ggml's float32 recurrence.  What remains against
    llama.cpp is float32-level noise and the F16 rounding flips it occasionally causes (about a
    third of the exact reference's distance; the lm_head from llama.cpp's own hidden state is
    reproduced to ~1e-6).

    Methods: :meth:`encode`, :meth:`inject`, :meth:`rollback`, :meth:`block` (→ :class:`RefBlock`),
    :meth:`forward_hidden` (layers only; ``trace=`` collects intermediates under llama.cpp's
    callback names), :meth:`base_logits`, :meth:`heads` (the in-graph Markov chain / confidence
    from given hidden rows), :meth:`markov_bias`, :meth:`logits_error_bound` and
    :meth:`conf_error_bound` (rigorous per-element bounds of llama.cpp's deviation from the same
    hidden rows), :meth:`clone` (same weights and KV store, other numerics options).
    """

    def __init__(
        self,
        draft_path: str,
        target_path: Optional[str] = None,
        *,
        causal: Optional[bool] = None,
        emulate_ggml: bool = False,
        flash_attn: bool = True,
        kv_type: str = "f16",
    ) -> None:
        self.draft = GGUFFile(draft_path)
        self.target = open_target(str(target_path)) if target_path is not None else None
        self.emulate = bool(emulate_ggml)
        self.flash_attn = bool(flash_attn)
        if kv_type not in ("f16", "f32", "bf16"):
            raise ValueError("kv_type must be 'f16', 'f32' or 'bf16'")
        self.kv_type = kv_type
        self._load(causal)
        # KV store: position -> (list of per-layer K [n_head_kv, head_dim], list of V), kept
        # unrounded; the cache type's rounding is applied when attention reads them
        self._cells: Dict[int, tuple] = {}

    def clone(self, *, emulate_ggml: Optional[bool] = None, flash_attn: Optional[bool] = None,
              kv_type: Optional[str] = None) -> "DraftReference":
        """A reference sharing this one's weights, with a copy of its KV store (same positions)
        and optionally other numerics options."""
        other = copy.copy(self)
        if emulate_ggml is not None:
            other.emulate = bool(emulate_ggml)
        if flash_attn is not None:
            other.flash_attn = bool(flash_attn)
        if kv_type is not None:
            if kv_type not in ("f16", "f32", "bf16"):
                raise ValueError("kv_type must be 'f16', 'f32' or 'bf16'")
            other.kv_type = kv_type
        other._cells = dict(self._cells)
        return other

    # ---------------------------------------------------------------- block decode

    def forward_hidden(self, tokens: Sequence[int], pos0: int, *, keep: bool = False,
                       trace: Optional[Dict[str, np.ndarray]] = None):
        """Layers only: returns (hidden [n, n_embd] after output_norm, per-layer K list, V list).

        ``trace``, when a dict, receives the intermediates under llama.cpp's callback names
        (``noise_norm-0``, ``Qcur-0``, ``kqv_out-0``, ``ffn_inp-0``, ``l_out-0``, ...), each
        [n, ...] with rows = block slots, for comparison with ``cb_eval`` dumps."""
        def tr(name: str, val: np.ndarray) -> None:
            if trace is not None:
                trace[name] = np.array(val)
        c = self.cfg
        toks = np.asarray([int(t) for t in tokens], dtype=np.int64)
        n = toks.size
        if n == 0:
            raise ValueError("empty block")
        qpos = np.arange(pos0, pos0 + n)
        self._check_positions(qpos.tolist())
        ctx_pos = np.asarray(self.positions, dtype=np.int64)
        x = self.tok_embd.data[toks].astype(np.float64)
        if c.embedding_scale != 0.0:
            x = x * c.embedding_scale
        blk_k, blk_v = [], []
        for il, L in enumerate(self.layers):
            hn = self._rms(x, L["attn_norm"])
            tr(f"noise_norm-{il}", hn)
            q = self._mm(L["wq"], hn, L["wq_s"]).reshape(n, c.n_head, c.head_dim)
            q = self._rope(self._rms(q, L["q_norm"]), qpos)
            k, v = self._kv_from_hidden(L, hn, qpos)
            tr(f"Qcur-{il}", q)
            tr(f"Kcur-{il}", k)
            tr(f"Vcur-{il}", v)
            blk_k.append(k)
            blk_v.append(v)
            ck, cv = self.layer_kv(il, ctx_pos.tolist())
            # the cache holds K/V as kv_type: round context and block rows alike
            K = self._round_kv(np.concatenate([ck, k], axis=0))
            V = self._round_kv(np.concatenate([cv, v], axis=0))
            kpos = np.concatenate([ctx_pos, qpos])
            att = self._attend(q, K, V, kpos, qpos, L["sinks"])
            tr(f"kqv_out-{il}", att)
            cur = self._mm(L["wo"], att, L["wo_s"])
            tr(f"attn_out-{il}", cur)
            if c.value_scale != 0.0:
                cur = cur * c.value_scale
            if L["attn_post_norm"] is not None:
                cur = self._rms(cur, L["attn_post_norm"])
            ffn_inp = cur + x
            tr(f"ffn_inp-{il}", ffn_inp)
            cur = self._ffn(L, self._rms(ffn_inp, L["ffn_norm"]))
            tr(f"ffn_out-{il}", cur)
            if L["ffn_post_norm"] is not None:
                cur = self._rms(cur, L["ffn_post_norm"])
            cur = cur + ffn_inp
            if L["out_scale"] is not None:
                cur = cur * L["out_scale"]
            x = cur
            tr(f"l_out-{il}", x)
        hidden = self._rms(x, self.out_norm)
        tr("result_norm", hidden)
        if keep:
            for r, p in enumerate(qpos.tolist()):
                self._cells[p] = ([k[r] for k in blk_k], [v[r] for v in blk_v])
        return hidden, blk_k, blk_v

    def base_logits(self, hidden: np.ndarray) -> np.ndarray:
        """lm_head (+ d2t scatter, -inf on target ids the draft vocabulary lacks)."""
        u = self._mm(self.head, hidden, tensor_scalar(self.head_s))
        if self.d2t is None:
            return u
        out = np.full((u.shape[0], self.cfg.n_vocab), -np.inf)
        out[:, self.d2t] = u
        return out

    def markov_bias(self, prev_ids: Sequence[int]) -> np.ndarray:
        """B(prev, .) = markov_w2 · markov_w1[prev] (x markov_w2.scale; scattered by d2t; 0 off-d2t)."""
        if self.w1 is None:
            raise ValueError("draft has no Markov head")
        prev = np.asarray(prev_ids, dtype=np.int64).reshape(-1)
        w1p = self.w1.data[prev].astype(np.float64)
        b = self._mm(self.w2, w1p, self.w2_s)
        if self.d2t is None:
            return b
        out = np.zeros((b.shape[0], self.cfg.n_vocab))
        out[:, self.d2t] = b
        return out

    def _conf(self, hidden_row: np.ndarray, prev: int) -> float:
        w1p = self.w1.data[int(prev)].astype(np.float64)
        feat = np.concatenate([hidden_row, w1p])[None, :]
        z = float(self._mm(self.conf_w, feat)[0, 0])
        if self.conf_b is not None:
            z += self.conf_b
        return 1.0 / (1.0 + math.exp(-z))

    def heads(self, hidden: np.ndarray, base: np.ndarray, tokens: Sequence[int],
              prev: Optional[Sequence[int]] = None):
        """The in-graph Markov chain of build_dspark_markov_head.

        Returns (logits, conf or None, prev_used, markov_applied).  ``prev`` forces the
        conditioning token of every predicting slot (e.g. to follow llama.cpp's own argmax chain
        through a near-tie); by default it is the anchor, then the argmax of the previous row."""
        c = self.cfg
        n = base.shape[0]
        prev_used = np.full(n, -1, dtype=np.int64)
        if self.w1 is None:
            return base.copy(), None, prev_used, False
        if c.block_size is None:
            raise ValueError("DSpark draft without dflash.block_size (llama.cpp aborts)")
        if n > c.block_size:
            return base.copy(), None, prev_used, False
        has_conf = self.conf_w is not None
        beg = 0 if c.sample_from_anchor else 1
        logits = base.copy()
        conf = np.zeros(n) if has_conf else None
        if not c.sample_from_anchor and has_conf:
            conf[0] = 1.0 / (1.0 + math.exp(-float(base[0, 0])))  # pad column, never read
        cur = int(tokens[0])
        for i in range(beg, n):
            if prev is not None:
                cur = int(prev[i])
            prev_used[i] = cur
            logits[i] = base[i] + self.markov_bias([cur])[0]
            if has_conf:
                conf[i] = self._conf(hidden[i], cur)
            cur = int(np.argmax(logits[i]))
        return logits, conf, prev_used, True

    def block(self, tokens: Sequence[int], pos0: int, *, keep: bool = False,
              prev: Optional[Sequence[int]] = None) -> RefBlock:
        """Decode a block [anchor, mask, ...] at positions pos0.. (all rows are outputs)."""
        hidden, ks, vs = self.forward_hidden(tokens, pos0, keep=keep)
        base = self.base_logits(hidden)
        logits, conf, prev_used, applied = self.heads(hidden, base, tokens, prev)
        return RefBlock(tokens=[int(t) for t in tokens], pos0=int(pos0), hidden=hidden,
                        base_logits=base, logits=logits, conf=conf, prev=prev_used,
                        markov_applied=applied, layer_k=ks, layer_v=vs)
