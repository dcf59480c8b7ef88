"""The draft's hyper-parameters (:class:`DraftConfig`), resolved from its GGUF metadata as
llama.cpp resolves them (:func:`read_hparams`).

The reference reads the metadata keys itself rather than through
:func:`pyllama_dspark.gguf.info.read_draft_info`: it must stay an independent check of what
llama.cpp computes, it needs hyper-parameters ``DraftInfo`` does not carry (RoPE scaling, key /
value lengths, activation, attention / embedding / value scales), and it accepts drafts that
``read_draft_info`` rejects before llama.cpp would (no ``block_size`` or mask token)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

import numpy as np

from pyllama_dspark.reference.gguf_tensors import GGUFFile

__all__ = ["DraftConfig", "read_hparams"]

_REQUIRED = object()


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


def read_hparams(d: GGUFFile, causal: Optional[bool]) -> Dict[str, Any]:
    """:class:`DraftConfig` fields from the draft's metadata: all but ``n_vocab``,
    ``n_vocab_draft`` and ``markov_rank``, which its tensors give.  ``causal`` (None: the
    ``dflash.attention.causal`` key) overrides the block attention mask.

    Raises ``NotImplementedError`` for drafts the reference does not model (DeepSeek-V4
    hyper-connections, DFlash2, sliding window, per-layer head counts, other RoPE scalings)."""
    arch = d.field("general.architecture")
    if arch != "dflash":
        raise ValueError(f"not a dflash-arch draft: general.architecture = {arch!r}")
    a = arch

    def key(k: str, default: Any = _REQUIRED) -> Any:
        return d.field(f"{a}.{k}") if default is _REQUIRED else d.field(f"{a}.{k}", default)

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

    return dict(
        n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_k,
        n_rot=n_rot, rms_eps=eps, target_layers=target_layers,
        n_embd_inp=len(target_layers) * n_embd, block_size=block_size,
        sample_from_anchor=sample_from_anchor, causal=bool(causal),
        has_confidence_head_meta=None if hc is None else bool(hc),
        mask_token_id=None if mask_tok is None else int(mask_tok),
        rope_sections=sections, freq_base=freq_base, freq_scale=freq_scale,
        ext_factor=ext_factor, attn_factor=attn_factor, beta_fast=32.0, beta_slow=1.0,
        n_ctx_orig=n_ctx_orig, kq_scale=kq_scale,
        embedding_scale=float(key("embedding_scale", 0.0) or 0.0),
        value_scale=float(key("attention.value_scale", 0.0) or 0.0),
        ffn_act=ffn_act,
    )
