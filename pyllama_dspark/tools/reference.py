"""Numpy reference of llama.cpp's DFlash / DSpark draft graph.

This re-implements, from the GGUF files alone, what ``src/models/dflash.cpp`` (the non-DSV4
``graph<false>`` decoder and ``build_dspark_markov_head``) computes for one sequence, so that the
numbers llama.cpp returns for a draft can be checked independently:

* **injection** (an embedding batch on the draft context): ``g = RMSNorm(fc · features)`` with
  ``enc.output_norm``; per layer ``K = k_norm(W_k g)`` roped at the row's position and
  ``V = W_v g`` are written to the KV cache.  There is *no* ``attn_norm`` on this path: the
  encoder norm is the only one.
* **block** (a token batch): token embeddings (the target's ``token_embd`` unless the draft has its
  own) pass through Qwen3-style layers: ``attn_norm`` → Q/K/V → q/k RMS norms → RoPE (NeoX
  pairing, see below) → the block's own K/V are *written to the cache* and the queries attend,
  with llama.cpp's KV mask, to every cell of the sequence: all injected context plus all block
  rows (non-causal unless ``dflash.attention.causal`` says otherwise) → ``W_o`` → residual →
  ``ffn_norm`` → SwiGLU → residual.  Then ``output_norm`` gives the hidden state ``h`` (this is
  ``res->t_embd``: it feeds both the lm_head and the confidence head), the lm_head gives ``U``.
* **Markov head** (DSpark drafts, i.e. ``markov_w1.weight`` present): left to right over the
  block, ``logits_i = U_i + W2·W1[prev_i]`` with ``prev`` = the anchor (the block's first token)
  for the first prediction slot and the *argmax of the previous biased row* afterwards; the
  confidence is ``sigmoid(conf_proj · [h_i ; W1[prev_i]] + b)``.  With
  ``dflash.sample_from_anchor = false`` slot 0 is a bonus slot: its logits pass through unbiased
  and its confidence is ``sigmoid(U_0[0])`` (llama.cpp pads it with the first logit; it is never
  read).  A block longer than ``dflash.block_size`` skips the head entirely (logits = U, no
  confidence), exactly like llama.cpp.

Numerics.  Activations are float64 throughout; weights are kept as float32 arrays, which hold the
dequantized GGUF values exactly (every ggml type dequantizes to float32), and are promoted to
float64 inside each product.  The reference's own rounding (~1e-16 relative) is therefore
negligible, and any difference to llama.cpp is llama.cpp's rounding.  With
``emulate_ggml=True`` the reference additionally applies the deterministic roundings ggml's CPU
backend performs (see :class:`DraftReference`), which removes the dominant error terms and lets a
comparison use tight tolerances.

Not covered (the constructor raises ``NotImplementedError``): DeepSeek-V4 DSpark drafts
(hyper-connections), DFlash2 (conv/selector), sliding-window drafts, LongRoPE, multi-section
M-RoPE that differs from NeoX.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

__all__ = [
    "DraftConfig",
    "DraftReference",
    "RefBlock",
    "round_activations",
    "vec_dot_type",
]

_F64 = np.float64

# --------------------------------------------------------------------------------------------
# ggml CPU rounding helpers (used only with emulate_ggml=True)
# --------------------------------------------------------------------------------------------

# ggml-cpu type_traits_cpu[type].vec_dot_type: the type the *activations* are converted to before
# a mat-mul against a weight of this type (ggml-cpu.c).
_VEC_DOT_TYPE = {
    QT.F32: QT.F32,
    QT.F16: QT.F16,
    QT.BF16: QT.BF16,
    QT.Q4_0: QT.Q8_0,
    QT.Q4_1: QT.Q8_1,
    QT.Q5_0: QT.Q8_0,
    QT.Q5_1: QT.Q8_1,
    QT.Q8_0: QT.Q8_0,
    QT.Q8_1: QT.Q8_1,
    QT.MXFP4: QT.Q8_0,
    QT.NVFP4: QT.Q8_0,
    QT.IQ4_NL: QT.Q8_0,
    QT.Q2_K: QT.Q8_K,
    QT.Q3_K: QT.Q8_K,
    QT.Q4_K: QT.Q8_K,
    QT.Q5_K: QT.Q8_K,
    QT.Q6_K: QT.Q8_K,
    QT.IQ2_XXS: QT.Q8_K,
    QT.IQ2_XS: QT.Q8_K,
    QT.IQ2_S: QT.Q8_K,
    QT.IQ3_XXS: QT.Q8_K,
    QT.IQ3_S: QT.Q8_K,
    QT.IQ1_S: QT.Q8_K,
    QT.IQ1_M: QT.Q8_K,
    QT.IQ4_XS: QT.Q8_K,
    QT.TQ1_0: QT.Q8_K,
    QT.TQ2_0: QT.Q8_K,
}
if hasattr(QT, "Q1_0"):
    _VEC_DOT_TYPE[QT.Q1_0] = QT.Q8_0


def vec_dot_type(weight_type: QT) -> Optional[QT]:
    """The type ggml's CPU backend converts activations to for a mat-mul with ``weight_type``."""
    return _VEC_DOT_TYPE.get(weight_type)


def _round_f16(x: np.ndarray) -> np.ndarray:
    # values above 65504 become inf, as in ggml (hazard 9: an F16 fc.weight overflows)
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=np.float32).astype(np.float16).astype(_F64)


def _round_bf16(x: np.ndarray) -> np.ndarray:
    # round-to-nearest-even on the upper 16 bits of the float32 pattern (ggml_compute_fp32_to_bf16)
    f = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    u = f.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    out = (u << 16).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(f), f, out).astype(_F64)


def _round_q8_0(x: np.ndarray) -> np.ndarray:
    """Values of quantize_row_q8_0 (x86 path): per 32 elements d = amax/127 (stored as f16),
    q = rint(x * 127/amax)."""
    f = np.asarray(x, dtype=np.float32)
    shp = f.shape
    if shp[-1] % 32:
        raise ValueError("Q8_0 activation rounding needs a multiple of 32 columns")
    b = f.reshape(-1, 32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        d = amax / np.float32(127.0)
        inv = np.where(amax != 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(b * inv)
    d16 = d.astype(np.float16).astype(_F64)
    return (q.astype(_F64) * d16).reshape(shp)


def _round_q8_k(x: np.ndarray) -> np.ndarray:
    """Values of quantize_row_q8_K_ref: per 256 elements iscale = -127/max (signed max by |x|),
    q = min(127, rint(iscale*x)), d = 1/iscale (float32)."""
    f = np.asarray(x, dtype=np.float32)
    shp = f.shape
    if shp[-1] % 256:
        raise ValueError("Q8_K activation rounding needs a multiple of 256 columns")
    b = f.reshape(-1, 256)
    idx = np.abs(b).argmax(axis=1)
    mx = b[np.arange(b.shape[0]), idx][:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(mx != 0, np.float32(-127.0) / mx, np.float32(0.0)).astype(np.float32)
        d = np.where(mx != 0, np.float32(1.0) / iscale, np.float32(0.0)).astype(np.float32)
    q = np.minimum(127.0, np.rint(iscale * b))
    return (q.astype(_F64) * d.astype(_F64)).reshape(shp)


def round_activations(x: np.ndarray, act_type: Optional[QT]) -> np.ndarray:
    """Round activations the way ggml-cpu converts them to ``act_type`` (a vec_dot_type)."""
    if act_type is None or act_type == QT.F32:
        return np.asarray(x, dtype=_F64)
    if act_type == QT.F16:
        return _round_f16(x)
    if act_type == QT.BF16:
        return _round_bf16(x)
    if act_type in (QT.Q8_0, QT.Q8_1):
        # Q8_1 carries the same quantized values as Q8_0 (plus a block sum used by *_1 weights)
        return _round_q8_0(x)
    if act_type == QT.Q8_K:
        return _round_q8_k(x)
    raise NotImplementedError(f"activation rounding for {act_type!r}")


# --------------------------------------------------------------------------------------------
# GGUF access
# --------------------------------------------------------------------------------------------

_MISSING = object()


def _field(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if default is _MISSING:
            raise KeyError(f"GGUF key {key!r} missing")
        return default
    v = f.contents()
    if isinstance(v, np.generic):
        v = v.item()
    return v


@dataclass
class _Tensor:
    name: str
    type: QT
    data: np.ndarray  # float32 (dequantized) or the raw integer array; numpy shape = ne reversed


class _GGUF:
    """Dequantize-on-demand view of one GGUF file."""

    def __init__(self, path: str) -> None:
        self.path = str(path)
        self.reader = gguf.GGUFReader(self.path)
        self._meta = {t.name: t for t in self.reader.tensors}
        self._cache: Dict[str, _Tensor] = {}

    def has(self, name: str) -> bool:
        return name in self._meta

    def names(self) -> List[str]:
        return list(self._meta)

    def type(self, name: str) -> QT:
        return QT(self._meta[name].tensor_type)

    def get(self, name: str) -> _Tensor:
        if name in self._cache:
            return self._cache[name]
        t = self._meta[name]
        qt = QT(t.tensor_type)
        ne = [int(v) for v in t.shape]
        shape = tuple(reversed(ne))
        if qt in (QT.I8, QT.I16, QT.I32, QT.I64):
            data = np.array(t.data).reshape(shape)
        elif qt == QT.F32:
            data = np.array(t.data, dtype=np.float32).reshape(shape)
        elif qt == QT.F16:
            data = np.asarray(t.data).view(np.float16).astype(np.float32).reshape(shape)
        elif qt == QT.F64:
            data = np.asarray(t.data, dtype=np.float64).astype(np.float32).reshape(shape)
        else:
            data = np.asarray(gguf.quants.dequantize(t.data, qt), dtype=np.float32).reshape(shape)
        out = _Tensor(name, qt, data)
        self._cache[name] = out
        return out

    def opt(self, name: str) -> Optional[_Tensor]:
        return self.get(name) if self.has(name) else None

    def field(self, key: str, default: Any = _MISSING) -> Any:
        return _field(self.reader, key, default)


_TARGET_CACHE: Dict[tuple, _GGUF] = {}


def _open_target(path: str) -> _GGUF:
    """Target GGUFs are shared between references (opening one parses its whole tokenizer and the
    dequantized embedding is the largest array here); keyed by path, size and mtime."""
    import os

    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    g = _TARGET_CACHE.get(key)
    if g is None:
        if len(_TARGET_CACHE) >= 2:
            _TARGET_CACHE.pop(next(iter(_TARGET_CACHE)))
        g = _TARGET_CACHE[key] = _GGUF(path)
    return g


def _scalar(t: Optional[_Tensor]) -> Optional[float]:
    return None if t is None else float(np.asarray(t.data, dtype=_F64).reshape(-1)[0])


# --------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftConfig:
    """Hyper-parameters of a dflash-arch draft, resolved as llama.cpp resolves them."""

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rms_eps: float
    n_vocab: int            # target vocabulary (rows of markov_w1, width of the logits)
    n_vocab_draft: int      # rows of the lm_head (== n_vocab unless d2t)
    target_layers: tuple
    n_embd_inp: int         # len(target_layers) * n_embd
    block_size: Optional[int]
    sample_from_anchor: bool
    causal: bool
    has_confidence_head_meta: Optional[bool]
    mask_token_id: Optional[int]
    # RoPE (rope type NEOX for non-DSV4 dflash drafts; degenerate M-RoPE sections == NEOX)
    rope_sections: tuple
    freq_base: float
    freq_scale: float
    ext_factor: float
    attn_factor: float
    beta_fast: float
    beta_slow: float
    n_ctx_orig: int
    kq_scale: float
    embedding_scale: float
    value_scale: float
    ffn_act: str            # "silu" | "gelu"
    markov_rank: int        # 0 when there is no Markov head


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


# --------------------------------------------------------------------------------------------
# the reference
# --------------------------------------------------------------------------------------------


class DraftReference:
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
        self.draft = _GGUF(draft_path)
        self.target = _open_target(str(target_path)) if target_path is not None else None
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

    # ---------------------------------------------------------------- loading

    def _load(self, causal: Optional[bool]) -> None:
        d = self.draft
        arch = d.field("general.architecture")
        if arch != "dflash":
            raise ValueError(f"not a dflash-arch draft: general.architecture = {arch!r}")
        a = arch

        def key(k: str, default: Any = _MISSING) -> Any:
            return d.field(f"{a}.{k}", default)

        if key("hyper_connection.count", 0):
            raise NotImplementedError("DeepSeek-V4 DSpark drafts (hyper-connections)")
        if d.has("selector_hidden.weight"):
            raise NotImplementedError("DFlash2 drafts (conv/selector)")
        if int(key("attention.sliding_window", 0) or 0) > 0:
            raise NotImplementedError("sliding-window DFlash drafts")

        n_embd = int(key("embedding_length"))
        n_layer = int(key("block_count"))

        def per_layer(v: Any) -> int:
            if isinstance(v, (list, tuple, np.ndarray)):
                vals = {int(x) for x in v}
                if len(vals) != 1:
                    raise NotImplementedError("per-layer head counts")
                return vals.pop()
            return int(v)

        n_head = per_layer(key("attention.head_count"))
        n_head_kv = per_layer(key("attention.head_count_kv", n_head))
        head_k = int(key("attention.key_length", n_embd // n_head))
        head_v = int(key("attention.value_length", n_embd // n_head))
        if head_k != head_v:
            raise ValueError("dflash graph requires key_length == value_length")
        n_rot = int(key("rope.dimension_count", head_k))
        eps = float(key("attention.layer_norm_rms_epsilon"))

        act = str(key("hidden_activation", "silu"))
        if act in ("gelu", "gelu_pytorch_tanh"):
            ffn_act = "gelu"
        elif act == "silu":
            ffn_act = "silu"
        else:
            raise ValueError(f"unsupported DFlash hidden activation: {act}")

        sections = tuple(int(x) for x in (key("rope.dimension_sections", None) or (0, 0, 0, 0)))
        sections = (sections + (0, 0, 0, 0))[:4]

        # --- rope parameters, as llama_context resolves cparams from hparams ------------------
        freq_base = float(key("rope.freq_base", 10000.0))
        scaling = str(key("rope.scaling.type", "linear"))
        factor = float(key("rope.scaling.factor", 0.0) or key("rope.scale_linear", 0.0) or 0.0)
        freq_scale = 1.0 / factor if factor != 0.0 else 1.0
        if scaling == "none":
            freq_scale = 1.0
        elif scaling not in ("linear", "yarn"):
            raise NotImplementedError(f"rope scaling type {scaling!r}")
        ext_factor = 1.0 if scaling == "yarn" else 0.0
        attn_factor = 1.0
        if ext_factor != 0.0:
            f = 1.0 / freq_scale
            mscale = 1.0 if f <= 1.0 else 0.1 * math.log(f) + 1.0
            attn_factor = mscale / (1.0 + 0.1 * math.log(f))
        attn_factor *= float(key("rope.scaling.attn_factor", 1.0))
        n_ctx_train = int(key("context_length", 0) or 0)
        n_ctx_orig = int(key("rope.scaling.original_context_length", n_ctx_train) or n_ctx_train)

        att_scale = float(key("attention.scale", 0.0) or 0.0)
        kq_scale = att_scale if att_scale != 0.0 else 1.0 / math.sqrt(float(head_v))

        target_layers = tuple(int(x) for x in key("target_layers"))
        bs = d.field(f"{a}.block_size", None)
        block_size = None if bs is None else int(bs)
        sfa = d.field(f"{a}.sample_from_anchor", None)
        sample_from_anchor = True if sfa is None else bool(sfa)
        hc = d.field(f"{a}.has_confidence_head", None)
        if causal is None:
            causal = bool(d.field(f"{a}.attention.causal", False))
        mask_tok = d.field("tokenizer.ggml.mask_token_id", None)

        # --- shared embeddings / lm_head (ctx_other) ------------------------------------------
        if d.has("token_embd.weight"):
            self.tok_embd = d.get("token_embd.weight")
        else:
            if self.target is None:
                raise ValueError("draft has no token_embd.weight: pass the target GGUF")
            self.tok_embd = self.target.get("token_embd.weight")
        if d.has("output.weight"):
            self.head, self.head_s = d.get("output.weight"), d.opt("output.scale")
        elif d.has("token_embd.weight"):
            # the draft's tok_embd duplicated as its own head (llama_model_dflash::load_arch_tensors)
            self.head, self.head_s = d.get("token_embd.weight"), None
        else:
            if self.target is None:
                raise ValueError("draft has no lm_head: pass the target GGUF")
            t = self.target
            if t.has("output.weight"):
                self.head, self.head_s = t.get("output.weight"), t.opt("output.scale")
            else:  # tied embeddings: the target's loader duplicates token_embd as its output
                self.head, self.head_s = t.get("token_embd.weight"), None

        self.d2t = d.get("d2t").data.astype(np.int64).reshape(-1) if d.has("d2t") else None
        n_vocab_draft = int(self.head.data.shape[0])
        if self.d2t is not None:
            if self.d2t.size != n_vocab_draft:
                raise ValueError("d2t size != lm_head rows")
            toks = d.field("tokenizer.ggml.tokens", None)
            n_vocab = len(toks) if toks is not None else int(self.tok_embd.data.shape[0])
        else:
            n_vocab = n_vocab_draft

        # --- encoder ---------------------------------------------------------------------------
        self.fc = d.get("fc.weight")
        self.fc_s = _scalar(d.opt("fc.scale"))
        self.enc_norm = d.get("enc.output_norm.weight").data.astype(_F64)
        self.out_norm = d.get("output_norm.weight").data.astype(_F64)
        if self.fc.data.shape != (n_embd, len(target_layers) * n_embd):
            raise ValueError(f"fc.weight shape {self.fc.data.shape} does not match "
                             f"{len(target_layers)} target layers x n_embd {n_embd}")
        rf = d.opt("rope_freqs.weight")
        self.rope_freqs = None if rf is None else rf.data.astype(_F64).reshape(-1)

        # --- layers ----------------------------------------------------------------------------
        self.layers: List[Dict[str, Any]] = []
        for i in range(n_layer):
            p = f"blk.{i}."
            L: Dict[str, Any] = {
                "attn_norm": d.get(p + "attn_norm.weight").data.astype(_F64),
                "wq": d.get(p + "attn_q.weight"),
                "wk": d.get(p + "attn_k.weight"),
                "wv": d.opt(p + "attn_v.weight"),
                "wo": d.get(p + "attn_output.weight"),
                "q_norm": d.get(p + "attn_q_norm.weight").data.astype(_F64),
                "k_norm": d.get(p + "attn_k_norm.weight").data.astype(_F64),
                "ffn_norm": d.get(p + "ffn_norm.weight").data.astype(_F64),
                "gate": d.get(p + "ffn_gate.weight"),
                "up": d.get(p + "ffn_up.weight"),
                "down": d.get(p + "ffn_down.weight"),
            }
            for nm, tn in (("attn_post_norm", "post_attention_norm.weight"),
                           ("ffn_post_norm", "post_ffw_norm.weight")):
                t = d.opt(p + tn)
                L[nm] = None if t is None else t.data.astype(_F64)
            L["out_scale"] = _scalar(d.opt(p + "layer_output_scale.weight"))
            s = d.opt(p + "attn_sinks.weight")
            L["sinks"] = None if s is None else s.data.astype(_F64).reshape(-1)
            for nm, tn in (("wq_s", "attn_q"), ("wk_s", "attn_k"), ("wv_s", "attn_v"),
                           ("wo_s", "attn_output"), ("gate_s", "ffn_gate"),
                           ("up_s", "ffn_up"), ("down_s", "ffn_down")):
                L[nm] = _scalar(d.opt(p + tn + ".scale"))
            self.layers.append(L)

        # --- DSpark heads ----------------------------------------------------------------------
        self.w1 = d.opt("markov_w1.weight")      # numpy [n_vocab, rank]
        self.w2 = d.opt("markov_w2.weight")      # numpy [n_vocab_draft, rank]
        self.w2_s = _scalar(d.opt("markov_w2.scale"))
        self.conf_w = d.opt("conf_proj.weight")  # numpy [1, n_embd + rank]
        cb = d.opt("conf_proj.bias")
        self.conf_b = None if cb is None else float(cb.data.reshape(-1)[0])
        rank = 0
        if self.w1 is not None:
            if self.w2 is None:
                raise ValueError("markov_w1 without markov_w2")
            rank = int(self.w1.data.shape[1])
            if self.w1.data.shape[0] != n_vocab or self.w2.data.shape != (n_vocab_draft, rank):
                raise ValueError("markov weight shapes do not match the vocabulary")
            if self.conf_w is not None and self.conf_w.data.reshape(-1).size != n_embd + rank:
                raise ValueError("conf_proj.weight must have n_embd + rank inputs")

        self.cfg = DraftConfig(
            n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_k,
            n_rot=n_rot, rms_eps=eps, n_vocab=n_vocab, n_vocab_draft=n_vocab_draft,
            target_layers=target_layers, n_embd_inp=len(target_layers) * n_embd,
            block_size=block_size, sample_from_anchor=sample_from_anchor, causal=bool(causal),
            has_confidence_head_meta=None if hc is None else bool(hc),
            mask_token_id=None if mask_tok is None else int(mask_tok),
            rope_sections=sections, freq_base=freq_base, freq_scale=freq_scale,
            ext_factor=ext_factor, attn_factor=attn_factor, beta_fast=32.0, beta_slow=1.0,
            n_ctx_orig=n_ctx_orig, kq_scale=kq_scale,
            embedding_scale=float(key("embedding_scale", 0.0) or 0.0),
            value_scale=float(key("attention.value_scale", 0.0) or 0.0),
            ffn_act=ffn_act, markov_rank=rank,
        )
        if self.tok_embd.data.shape[1] != n_embd or self.head.data.shape[1] != n_embd:
            raise ValueError("shared embedding / lm_head width != draft n_embd")

    # ---------------------------------------------------------------- primitives

    def _mm(self, w: _Tensor, x: np.ndarray, scale: Optional[float] = None,
            chunk: int = 8192) -> np.ndarray:
        """ggml_mul_mat(w, x) (+ optional per-tensor scale): x [n, in] -> [n, out]."""
        x = np.asarray(x, dtype=_F64)
        if self.emulate:
            x = round_activations(x, vec_dot_type(w.type))
        W = w.data
        if W.shape[0] <= chunk:
            y = x @ W.astype(_F64).T
        else:  # bound the float64 temporary for vocabulary-sized matrices
            y = np.empty((x.shape[0], W.shape[0]), dtype=_F64)
            for s in range(0, W.shape[0], chunk):
                y[:, s:s + chunk] = x @ W[s:s + chunk].astype(_F64).T
        if scale is not None:
            y = y * scale
        return y

    def _mm_bound(self, w: _Tensor, x: np.ndarray, emulated: bool, chunk: int = 8192) -> np.ndarray:
        """Bound on |ggml_mul_mat(w, x) - (this reference's product)| per output element.

        Two terms: (1) unless ``emulated``, the conversion of x to the weight's vec_dot_type
        (F16: |x| 2^-11; BF16: |x| 2^-8; Q8_0/Q8_1 blocks of 32: d (1/2 + 127 * 2^-11) with
        d = amax/127, the 2^-11 being the F16 rounding of d; Q8_K blocks of 256: d/2), weighted by
        |w|; (2) float32 accumulation of n products, gamma = (n + 3) 2^-24 times sum |w| |x^|
        (covers any summation order, the float32 rounding of dequantized *_1 weights and the
        per-tensor scale).  Not covered: the F16 rounding of the Q8_1 block sum (relative 2^-11
        of a term that multiplies the weight block minimum)."""
        x = np.asarray(x, dtype=_F64)
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
        out = np.empty((rhs.shape[0], W.shape[0]), dtype=_F64)
        for s0 in range(0, W.shape[0], chunk):
            out[:, s0:s0 + chunk] = rhs @ np.abs(W[s0:s0 + chunk].astype(_F64)).T
        n = x.shape[0]
        return out[:n] + out[n:]

    def logits_error_bound(self, hidden: np.ndarray, prev: Sequence[int],
                           emulated: Optional[bool] = None) -> np.ndarray:
        """Per-element bound [n, n_vocab] on |llama.cpp logits - ``heads(hidden, prev)`` logits|
        when llama.cpp computes from the same ``hidden`` and conditions on the same ``prev``
        (``-1`` = unbiased row): lm_head and Markov-bias mat-mul bounds (:meth:`_mm_bound`) plus
        the float32 rounding of the bias addition."""
        emulated = self.emulate if emulated is None else emulated
        hb = self._mm_bound(self.head, hidden, emulated)
        s = _scalar(self.head_s)
        if s is not None:
            hb = hb * abs(s)
        if self.d2t is not None:
            full = np.zeros((hb.shape[0], self.cfg.n_vocab))
            full[:, self.d2t] = hb
            hb = full
        prev = np.asarray(prev, dtype=np.int64).reshape(-1)
        if self.w1 is not None and np.any(prev >= 0):
            rows = np.nonzero(prev >= 0)[0]
            w1p = self.w1.data[prev[rows]].astype(_F64)
            bb = self._mm_bound(self.w2, w1p, emulated)
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
        feat = np.concatenate([np.asarray(hidden, dtype=_F64),
                               self.w1.data[prev].astype(_F64)], axis=1)
        zb = self._mm_bound(self.conf_w, feat, emulated)[:, 0]
        z = self._mm(self.conf_w, feat)[:, 0] + (self.conf_b or 0.0)
        return 0.25 * (zb + np.abs(z) * 2.0 ** -24) + 4 * 2.0 ** -24

    def _rms(self, x: np.ndarray, w: Optional[np.ndarray]) -> np.ndarray:
        y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.cfg.rms_eps)
        return y if w is None else y * w

    def _round_kv(self, x: np.ndarray) -> np.ndarray:
        if not self.emulate or self.kv_type == "f32":
            return x
        return _round_f16(x) if self.kv_type == "f16" else _round_bf16(x)

    def _rope_cos_sin(self, positions: np.ndarray, e_zero: bool = False):
        """cos/sin [n, n_rot/2] as ggml_rope_cache_init builds them (NeoX pairing).

        M-RoPE drafts (``rope.dimension_sections``): a token batch broadcasts its position to all
        four sections; an embedding (injection) batch carries (p, p, p, 0) as
        common/speculative.cpp writes it (``e_zero``), so pairs of the 4th section get angle 0."""
        c = self.cfg
        half = c.n_rot // 2
        p = np.asarray(positions, dtype=_F64).reshape(-1)
        i = np.arange(half)
        if self.emulate:
            # ggml_rope_cache_init: theta = p, then theta *= theta_scale per pair, in float32
            ts = np.float32(np.power(np.float32(c.freq_base), np.float32(-2.0 / c.n_rot)))
            th = np.empty((p.shape[0], half), dtype=np.float32)
            cur = p.astype(np.float32)
            for k in range(half):
                th[:, k] = cur
                cur = (cur * ts).astype(np.float32)
            theta_extrap = th.astype(_F64)
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

    # ---------------------------------------------------------------- encoder / injection

    def encode(self, features: np.ndarray) -> np.ndarray:
        """fc -> RMSNorm(enc.output_norm): [n, m*d_t] -> [n, n_embd]."""
        f = np.asarray(features, dtype=_F64)
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

    # ---------------------------------------------------------------- attention

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
            q = _round_f16(q)  # Q converted to F16 for the dot with the F16 K cache
        s = np.einsum("nhd,thd->nht", q, kh) * c.kq_scale
        keep = np.ones((n, T), dtype=bool)
        if c.causal:
            keep = kpos[None, :] <= qpos[:, None]
        s = np.where(keep[:, None, :], s, -np.inf)
        if self.emulate and self.flash_attn and self.kv_type == "f16":
            out = self._fa_f16_accumulate(s, vh, keep, sinks)
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
                p = _round_f16(p)  # soft-max output converted to F16 for the V mul_mat
            out = np.einsum("nht,thd->nhd", p, vh)
        return out.reshape(n, H * D)

    @staticmethod
    def _fa_f16_accumulate(s: np.ndarray, vh: np.ndarray, keep: np.ndarray,
                           sinks: Optional[np.ndarray]) -> np.ndarray:
        """ggml_compute_forward_flash_attn_ext_f16_one_chunk with an F16 V accumulator."""
        n, H, T = s.shape
        D = vh.shape[-1]
        M = np.full((n, H), -np.inf)
        S = np.zeros((n, H))
        acc = np.zeros((n, H, D))
        for t in range(T):
            live = keep[:, t][:, None]  # masked cells are skipped entirely
            st = s[:, :, t].astype(np.float32).astype(_F64)
            new_max = live & (st > M)
            with np.errstate(invalid="ignore", over="ignore"):
                ms = np.where(new_max, np.exp(M - st), 1.0)
                vs = np.where(new_max, 1.0, np.exp(st - M))
            ms = np.where(live, ms, 1.0)
            vs = np.where(live, vs, 0.0)
            M = np.where(new_max, st, M)
            acc = np.where(new_max[..., None], _round_f16(acc * ms[..., None]), acc)
            upd = _round_f16(acc + vh[t][None, :, :] * vs[..., None])
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

    # ---------------------------------------------------------------- block decode

    def _ffn(self, L: Dict[str, Any], x: np.ndarray) -> np.ndarray:
        up = self._mm(L["up"], x, L["up_s"])
        gate = self._mm(L["gate"], x, L["gate_s"])
        if self.cfg.ffn_act == "silu":
            act = gate / (1.0 + np.exp(-gate))
        else:  # ggml_gelu: tanh approximation
            act = 0.5 * gate * (1.0 + np.tanh(math.sqrt(2.0 / math.pi)
                                              * (gate + 0.044715 * gate ** 3)))
        return self._mm(L["down"], act * up, L["down_s"])

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
        x = self.tok_embd.data[toks].astype(_F64)
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
        u = self._mm(self.head, hidden, _scalar(self.head_s))
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
        w1p = self.w1.data[prev].astype(_F64)
        b = self._mm(self.w2, w1p, self.w2_s)
        if self.d2t is None:
            return b
        out = np.zeros((b.shape[0], self.cfg.n_vocab))
        out[:, self.d2t] = b
        return out

    def _conf(self, hidden_row: np.ndarray, prev: int) -> float:
        w1p = self.w1.data[int(prev)].astype(_F64)
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
