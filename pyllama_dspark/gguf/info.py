"""A DFlash/DSpark draft GGUF: what it says about itself (:class:`DraftInfo`,
:func:`read_draft_info`) and whether it fits a target (:func:`validate_pair`).

Everything llama.cpp would turn into an abort (GGML_ASSERT / GGML_ABORT kills the whole
process) when a draft does not fit its target is checked here first, from the GGUF metadata
alone, and raised as a Python exception instead (see DESIGN.md, "Known hazards").

The facts below, and those in :mod:`pyllama_dspark.gguf.layer_inputs`, were read from the llama.cpp
sources vendored in llama-cpp-python 0.3.36 (``vendor/llama.cpp``); file:line references are to
that tree.

Target layer ids
----------------
``dflash.target_layers`` is stored by the converter as ``HF target_layer_ids + 1``
(conversion/qwen.py:735-738): HF index ``i`` names the *output* of decoder layer ``i``, which is
the *input* of llama.cpp layer ``i + 1``.  llama.cpp then uses the stored numbers verbatim:

* src/models/dflash.cpp:37 reads the array straight into ``llama_model::target_layer_ids``;
* src/llama-model.cpp:3443-3449 ``llama_model_target_layer_ids[_n]`` return that vector as is;
* common/speculative.cpp:1057-1058 passes each value unchanged to
  ``llama_set_embeddings_layer_inp(ctx_tgt, id, true)`` and, :1153-1154, to
  ``llama_get_embeddings_layer_inp``;
* layer-input id ``lid`` is the tensor the target graph stores in ``res->t_layer_inp[lid]``,
  i.e. the input of 0-based layer ``lid`` (``lid == 0``: the token embeddings), e.g.
  src/models/llama.cpp:127 / src/models/qwen3.cpp:72 (``res->t_layer_inp[il] = inpL`` at the top
  of layer ``il``).

So :attr:`DraftInfo.target_layers_raw` (what the file holds) and :attr:`DraftInfo.target_layer_ids`
(what to pass to ``llama_set_embeddings_layer_inp``) are the same numbers; both are exposed so
callers never have to guess, and :attr:`DraftInfo.target_layers_hf` gives the HF (0-based
"hidden state of layer i") view, ``raw - 1``.

Which ids are valid on which target architecture: :mod:`pyllama_dspark.gguf.layer_inputs`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import numpy as np

from pyllama_dspark.errors import DraftMismatchError, UnsupportedArchError
from pyllama_dspark.gguf.hparams import check_hparams, check_tensor_types
from pyllama_dspark.gguf.layer_inputs import DRAFTING_HYBRID_ARCHS, unsupported_arch_message, unsupported_hybrid_message
from pyllama_dspark.gguf.reader import (cached_info, check_path, field_value, ggml_ne, n_tokens, read_gguf,
                                        scalar_field, tensor_map, tokenizer_fingerprint)
from pyllama_dspark.gguf.target_info import TargetInfo

__all__ = [
    "DRAFT_ARCH",
    "SOURCE_PREFIX",
    "DraftInfo",
    "block_offset",
    "read_draft_info",
    "validate_pair",
]

DRAFT_ARCH = "dflash"
#: provenance keys ``pyllama-dspark convert`` writes (``<prefix>config``, ``<prefix>outtype``); llama.cpp ignores them
SOURCE_PREFIX = "pyllama_dspark.source."

# the largest DSpark block size accepted: the Markov head adds ~4 graph nodes per block position and
# llama.cpp's draft graph holds max(1024, 8 * n_tensors) nodes (GGML_ASSERT(obj_new) at 256 positions
# on a 1-layer draft)
MAX_DSPARK_BLOCK = 128

# GGML types llama.cpp keeps fc in without the F16 overflow of hazard 9
_F16_NAMES = ("F16",)


@dataclass(frozen=True)
class DraftInfo:
    """What a DFlash/DSpark draft GGUF says about itself (all from metadata + tensor table)."""

    path: str
    arch: str
    kind: str                              # "dspark" (Markov head present) or "dflash"
    block_size: int                        # dflash.block_size (gamma), required
    target_layers_raw: Tuple[int, ...]     # dflash.target_layers exactly as stored
    target_layer_ids: Tuple[int, ...]      # ids for llama_set_embeddings_layer_inp (== raw)
    sample_from_anchor: bool               # effective value (missing key -> True, as llama.cpp)
    sample_from_anchor_key: Optional[bool]  # as stored, None when absent
    causal: bool                           # dflash.attention.causal (missing -> False)
    causal_key: Optional[bool]
    has_confidence_head: bool              # metadata (missing -> True) AND conf_proj.weight present
    confidence_key: Optional[bool]
    has_conf_tensor: bool
    has_conf_bias: bool
    has_markov: bool                       # markov_w1.weight and markov_w2.weight present
    markov_rank: int                       # 0 when no Markov head
    has_markov_scale: bool                 # markov_w2.scale present
    mask_token_id: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int                           # from the tokenizer (llama.cpp's n_vocab)
    n_vocab_draft: int                     # d2t size for reduced-vocab drafts, else n_vocab
    has_d2t: bool
    has_own_lm_head: bool                  # output.weight or token_embd.weight in the draft
    has_own_tok_embd: bool
    fc_type: str                           # ggml type name of fc.weight
    fc_shape: Tuple[int, ...]              # ggml ne of fc.weight
    has_fc_scale: bool
    rope_type: str                         # "neox" | "mrope" | "norm" (as llama_model_rope_type)
    rope_freq_base: float
    rope_sections: Tuple[int, ...]
    n_ctx_train: int
    rms_eps: float
    is_dflash2: bool                       # DFlash2 conv/selector draft
    is_dsv4: bool                          # DeepSeek-V4 hyper-connection backbone
    tokenizer_model: str
    tokenizer_fingerprint: str
    problems: Tuple[str, ...] = ()         # things validate_pair rejects (e.g. F16 fc)
    notes: Tuple[str, ...] = ()            # non-fatal remarks

    @property
    def target_layers_hf(self) -> Tuple[int, ...]:
        """HF-style ids (hidden state *after* 0-based layer i): ``raw - 1``."""
        return tuple(i - 1 for i in self.target_layers_raw)

    @property
    def n_target_layers(self) -> int:
        return len(self.target_layer_ids)

    @property
    def n_embd_inp_enc(self) -> int:
        """Width of one injected feature row (llama.cpp's n_embd_inp_enc)."""
        return len(self.target_layer_ids) * self.n_embd

    @property
    def fc_is_f16(self) -> bool:
        return self.fc_type.upper() in _F16_NAMES

    @property
    def max_drafts(self) -> int:
        """Draft tokens one block yields (anchor-first DSpark: gamma, DFlash in place: gamma-1)."""
        return self.block_size - block_offset(self.has_markov, self.sample_from_anchor)


def block_offset(has_markov: bool, sample_from_anchor: bool) -> int:
    """Block row of the first draft: 0 for anchor-first DSpark ([anchor, mask x (k-1)], row i
    predicts position pos0+1+i), 1 for DFlash and bonus-anchor DSpark ([anchor, mask x k])."""
    return 0 if (has_markov and sample_from_anchor) else 1


def _bool_key(reader, key: str) -> Optional[bool]:
    v = field_value(reader, key, None)
    if v is None:
        return None
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)):
        return bool(v)
    if isinstance(v, str):
        return v.strip().lower() == "true"
    return bool(v)


def read_draft_info(path, *, use_cache: bool = True) -> DraftInfo:
    """Read and sanity-check a DFlash/DSpark draft GGUF.

    Raises :class:`ModelFileError` for unreadable files and :class:`DraftMismatchError` when the
    file is not a usable ``dflash`` draft: wrong arch, no ``dflash.block_size`` (llama.cpp aborts
    creating a DSpark context without it, hazard 4), no/empty ``dflash.target_layers``, no
    ``tokenizer.ggml.mask_token_id`` or one outside the vocabulary, tensor shapes that do not
    match the metadata, a half-present Markov head, a bad ``d2t`` table.  An F16 ``fc.weight``
    (hazard 9) is recorded in :attr:`DraftInfo.problems` and rejected by :func:`validate_pair`.
    """
    path = check_path(path)
    return cached_info("draft", path, use_cache, lambda: _parse_draft_info(path, use_cache), DraftInfo)


def _parse_draft_info(path: str, use_cache: bool) -> DraftInfo:
    r = read_gguf(path, use_cache=use_cache)
    name = os.path.basename(path)

    arch = field_value(r, "general.architecture", None)
    if arch != DRAFT_ARCH:
        raise DraftMismatchError(
            f"{name}: not a DFlash/DSpark draft: general.architecture is {arch!r}, expected {DRAFT_ARCH!r}")
    a = arch
    check_hparams(r, a, name)
    check_tensor_types(r, name, int_ok=("d2t",))

    def need(k: str, what: str) -> Any:
        v = field_value(r, k, None)
        if v is None:
            raise DraftMismatchError(f"{name}: draft lacks required metadata {k!r} ({what})")
        return v

    block_size = field_value(r, f"{a}.block_size", None)
    if block_size is None:
        raise DraftMismatchError(
            f"{name}: draft lacks '{a}.block_size' (the trained block size gamma); llama.cpp aborts "
            f"creating a DSpark draft context without it")
    if isinstance(block_size, bool) or not isinstance(block_size, int):   # llama.cpp std::stoi()s it
        raise DraftMismatchError(f"{name}: '{a}.block_size' must be an integer, got {block_size!r:.40}")
    if block_size < 1:
        raise DraftMismatchError(f"{name}: '{a}.block_size' is {block_size}, must be >= 1")

    raw_layers = field_value(r, f"{a}.target_layers", None)
    if raw_layers is None:
        raise DraftMismatchError(f"{name}: draft lacks '{a}.target_layers' (llama.cpp refuses to load it)")
    if not isinstance(raw_layers, list):
        raw_layers = [raw_layers]
    raw_layers = tuple(int(x) for x in raw_layers)
    if not raw_layers:
        raise DraftMismatchError(f"{name}: '{a}.target_layers' is empty")
    if any(x < 0 for x in raw_layers):
        raise DraftMismatchError(f"{name}: '{a}.target_layers' has negative ids {list(raw_layers)}")
    if len(set(raw_layers)) != len(raw_layers):
        raise DraftMismatchError(f"{name}: '{a}.target_layers' repeats an id: {list(raw_layers)}")

    n_embd = int(need(f"{a}.embedding_length", "hidden size"))
    n_layer = int(need(f"{a}.block_count", "number of draft layers"))
    n_head = scalar_field(r, f"{a}.attention.head_count", 0)
    n_head_kv = scalar_field(r, f"{a}.attention.head_count_kv", n_head)
    head_dim = scalar_field(r, f"{a}.attention.key_length", (n_embd // n_head) if n_head else 0)
    n_ff = scalar_field(r, f"{a}.feed_forward_length", 0)
    n_ctx_train = scalar_field(r, f"{a}.context_length", 0)
    rms_eps = scalar_field(r, f"{a}.attention.layer_norm_rms_epsilon", 0.0, kind=float)
    rope_freq_base = scalar_field(r, f"{a}.rope.freq_base", 10000.0, kind=float)
    sections = field_value(r, f"{a}.rope.dimension_sections", None)
    sections = tuple(int(x) for x in (sections if isinstance(sections, list) else ([sections] if sections is not None else [])))
    hc_mult = scalar_field(r, f"{a}.hyper_connection.count", 0)   # llama-arch.cpp: %s.hyper_connection.count

    n_vocab = n_tokens(r)
    if n_vocab <= 0:
        raise DraftMismatchError(f"{name}: draft has no tokenizer (tokenizer.ggml.tokens); it must carry the target's")

    mask = field_value(r, "tokenizer.ggml.mask_token_id", None)
    if mask is None:
        raise DraftMismatchError(f"{name}: draft lacks 'tokenizer.ggml.mask_token_id' (the block's mask token)")
    mask = int(mask)
    if not 0 <= mask < n_vocab:
        raise DraftMismatchError(f"{name}: mask_token_id {mask} is outside the vocabulary (0..{n_vocab - 1})")

    tensors = tensor_map(r)
    problems: List[str] = []
    notes: List[str] = []

    fc = tensors.get("fc.weight")
    if fc is None:
        raise DraftMismatchError(f"{name}: draft lacks tensor 'fc.weight'")
    fc_ne = ggml_ne(fc)
    want_fc = (len(raw_layers) * n_embd, n_embd)
    if fc_ne[:2] != want_fc:
        raise DraftMismatchError(
            f"{name}: fc.weight has ne {list(fc_ne)}, expected {list(want_fc)} "
            f"({len(raw_layers)} target layers x n_embd {n_embd} -> n_embd)")
    fc_type = fc.tensor_type.name
    if fc_type.upper() in _F16_NAMES:
        problems.append(
            "fc.weight is F16: on CPU llama.cpp converts the fc input to F16 and target activations "
            "above 65504 become inf/NaN (hazard 9); convert fc to F32, BF16 or Q8_0")

    for tname in ("enc.output_norm.weight", "output_norm.weight"):
        if tname not in tensors:
            raise DraftMismatchError(f"{name}: draft lacks tensor {tname!r}")

    w1 = tensors.get("markov_w1.weight")
    w2 = tensors.get("markov_w2.weight")
    conf = tensors.get("conf_proj.weight")
    d2t = tensors.get("d2t")

    n_vocab_draft = n_vocab
    if d2t is not None:
        n_vocab_draft = int(ggml_ne(d2t)[0])
        vals = np.asarray(d2t.data).reshape(-1)
        if vals.size != n_vocab_draft:
            raise DraftMismatchError(f"{name}: d2t holds {vals.size} entries, its shape says {n_vocab_draft}")
        if vals.size and (int(vals.min()) < 0 or int(vals.max()) >= n_vocab):
            raise DraftMismatchError(
                f"{name}: d2t maps to token ids {int(vals.min())}..{int(vals.max())}, outside the vocabulary 0..{n_vocab - 1}")
        if np.unique(vals).size != vals.size:
            raise DraftMismatchError(f"{name}: d2t contains duplicate target token ids")
        if n_vocab_draft > n_vocab:
            raise DraftMismatchError(f"{name}: d2t size {n_vocab_draft} exceeds the vocabulary {n_vocab}")

    has_markov = w1 is not None
    markov_rank = 0
    if has_markov and block_size > MAX_DSPARK_BLOCK:
        raise DraftMismatchError(
            f"{name}: '{a}.block_size' is {block_size}; llama.cpp builds the Markov head per block position "
            f"and overflows its graph beyond ~255 (DSpark drafts up to {MAX_DSPARK_BLOCK} are accepted)")
    if has_markov:
        if w2 is None:
            raise DraftMismatchError(f"{name}: draft has markov_w1.weight but no markov_w2.weight")
        markov_rank = int(ggml_ne(w1)[0])
        if ggml_ne(w1)[:2] != (markov_rank, n_vocab):
            raise DraftMismatchError(
                f"{name}: markov_w1.weight has ne {list(ggml_ne(w1))}, expected [{markov_rank}, {n_vocab}] (rank, n_vocab)")
        if ggml_ne(w2)[:2] != (markov_rank, n_vocab_draft):
            raise DraftMismatchError(
                f"{name}: markov_w2.weight has ne {list(ggml_ne(w2))}, expected [{markov_rank}, {n_vocab_draft}]")
        if conf is not None and ggml_ne(conf)[:2] != (n_embd + markov_rank, 1):
            raise DraftMismatchError(
                f"{name}: conf_proj.weight has ne {list(ggml_ne(conf))}, expected [{n_embd + markov_rank}, 1]")
    else:
        if w2 is not None:
            raise DraftMismatchError(f"{name}: draft has markov_w2.weight but no markov_w1.weight")
        if conf is not None:
            raise DraftMismatchError(
                f"{name}: draft has conf_proj.weight without a Markov head; llama.cpp only loads the "
                f"confidence head together with markov_w1/markov_w2")

    conf_key = _bool_key(r, f"{a}.has_confidence_head")
    has_conf_tensor = conf is not None
    has_conf = has_conf_tensor and (conf_key is None or conf_key)
    if has_conf_tensor and conf_key is False:
        notes.append("conf_proj.weight is present but dflash.has_confidence_head is false: confidence not used")
    if conf_key and not has_conf_tensor:
        notes.append("dflash.has_confidence_head is true but there is no conf_proj.weight: "
                     "llama.cpp's confidence rows would be garbage, treating the draft as having no confidence head")
    if has_markov and not has_conf:
        notes.append("no confidence head: confidence scheduling (p_min / survival) is unavailable")

    sfa_key = _bool_key(r, f"{a}.sample_from_anchor")
    sample_from_anchor = True if sfa_key is None else sfa_key
    if block_size - block_offset(has_markov, sample_from_anchor) < 1:
        raise DraftMismatchError(f"{name}: '{a}.block_size' is {block_size}: its block (the anchor and "
                                 f"{block_size - 1} masks) leaves no position to draft")
    causal_key = _bool_key(r, f"{a}.attention.causal")
    causal = bool(causal_key) if causal_key is not None else False

    tok_embd = tensors.get("token_embd.weight")
    out = tensors.get("output.weight")
    has_own_lm_head = out is not None or tok_embd is not None
    if n_vocab_draft < n_vocab and out is None:
        raise DraftMismatchError(
            f"{name}: reduced-vocab draft (d2t, {n_vocab_draft} rows) must carry its own output.weight")

    if hc_mult > 0:
        rope_type = "norm"
    elif any(sections):
        rope_type = "mrope"
    else:
        rope_type = "neox"

    is_dflash2 = "selector_hidden.weight" in tensors
    if is_dflash2:
        notes.append("DFlash2 (conv/selector) draft: its proposals come from the selector lattice")
    if not sample_from_anchor:
        notes.append("bonus-anchor layout (sample_from_anchor = false): slot 0 is not a prediction")
    if causal:
        notes.append("draft block attention is causal (dflash.attention.causal = true)")

    tok_model = field_value(r, "tokenizer.ggml.model", "")
    return DraftInfo(
        path=path,
        arch=arch,
        kind="dspark" if has_markov else "dflash",
        block_size=block_size,
        target_layers_raw=raw_layers,
        target_layer_ids=tuple(raw_layers),
        sample_from_anchor=sample_from_anchor,
        sample_from_anchor_key=sfa_key,
        causal=causal,
        causal_key=causal_key,
        has_confidence_head=has_conf,
        confidence_key=conf_key,
        has_conf_tensor=has_conf_tensor,
        has_conf_bias="conf_proj.bias" in tensors,
        has_markov=has_markov,
        markov_rank=markov_rank,
        has_markov_scale="markov_w2.scale" in tensors,
        mask_token_id=mask,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=int(n_head or 0),
        n_head_kv=int(n_head_kv or 0),
        head_dim=int(head_dim or 0),
        n_ff=int(n_ff or 0),
        n_vocab=n_vocab,
        n_vocab_draft=n_vocab_draft,
        has_d2t=d2t is not None,
        has_own_lm_head=has_own_lm_head,
        has_own_tok_embd=tok_embd is not None,
        fc_type=fc_type,
        fc_shape=fc_ne,
        has_fc_scale="fc.scale" in tensors,
        rope_type=rope_type,
        rope_freq_base=float(rope_freq_base),
        rope_sections=sections,
        n_ctx_train=int(n_ctx_train or 0),
        rms_eps=float(rms_eps),
        is_dflash2=is_dflash2,
        is_dsv4=hc_mult > 0,
        tokenizer_model=tok_model if isinstance(tok_model, str) else repr(tok_model),
        tokenizer_fingerprint=tokenizer_fingerprint(r),
        problems=tuple(problems),
        notes=tuple(notes),
    )


def validate_pair(draft_info: DraftInfo, target_info: TargetInfo) -> List[str]:
    """Check that ``draft_info`` can run against ``target_info`` without a llama.cpp abort.

    Raises :class:`UnsupportedArchError` for a target arch without layer-input capture and
    :class:`DraftMismatchError` (naming both values) for: n_embd mismatch (hazard 5), vocabulary
    size mismatch, tokenizer mismatch, a target layer id out of range (hazards 1 and 2), an F16
    ``fc.weight`` (hazard 9).  Returns a list of human-readable warnings for non-fatal things.
    """
    d, t = draft_info, target_info
    dn, tn = os.path.basename(d.path), os.path.basename(t.path)

    if not t.supports_layer_inputs:
        raise UnsupportedArchError(unsupported_arch_message(t.arch, tn))
    if t.hybrid and t.arch not in DRAFTING_HYBRID_ARCHS:
        raise UnsupportedArchError(unsupported_hybrid_message(t.arch, tn))

    if d.n_embd != t.n_embd:
        raise DraftMismatchError(
            f"draft n_embd {d.n_embd} ({dn}) != target n_embd {t.n_embd} ({tn}); "
            f"llama.cpp aborts creating the draft context")
    if d.n_vocab != t.n_vocab:
        raise DraftMismatchError(
            f"draft vocabulary size {d.n_vocab} ({dn}) != target vocabulary size {t.n_vocab} ({tn})")
    if d.tokenizer_fingerprint != t.tokenizer_fingerprint:
        raise DraftMismatchError(
            f"draft tokenizer ({d.tokenizer_model}, fingerprint {d.tokenizer_fingerprint[:16]}) differs "
            f"from the target tokenizer ({t.tokenizer_model}, fingerprint {t.tokenizer_fingerprint[:16]}): "
            f"{dn} was not made for {tn}")

    for lid in d.target_layer_ids:
        if lid < 0 or lid > t.n_layer:
            raise DraftMismatchError(
                f"draft target layer id {lid} ({dn}, dflash.target_layers = {list(d.target_layers_raw)}) "
                f"is out of range for target {tn} ({t.arch}, n_layer {t.n_layer}): valid ids are "
                f"0..{t.max_layer_id}; llama_set_embeddings_layer_inp would abort")
        if lid == t.n_layer and not t.accepts_final_layer_id:
            raise DraftMismatchError(
                f"draft target layer id {lid} ({dn}) equals the target's n_layer {t.n_layer} ({tn}, "
                f"{t.arch}): the {t.arch} graph never fills that layer input and the first target "
                f"decode would abort; valid ids are 0..{t.max_layer_id}")

    if d.fc_is_f16:
        raise DraftMismatchError(
            f"draft fc.weight is F16 ({dn}): target layer inputs of {tn} overflow F16 (> 65504) on "
            f"CPU and the draft produces inf/NaN; convert fc to F32, BF16 or Q8_0")
    for p in d.problems:
        raise DraftMismatchError(f"{dn}: {p}")

    warnings: List[str] = []
    if d.has_own_tok_embd or (d.has_own_lm_head and not d.has_d2t):
        # (a reduced-vocabulary draft needs its own lm_head rows: nothing to warn about)
        warnings.append(f"{dn} carries its own embeddings/lm_head; they are used instead of the target's")
    if d.n_ctx_train and t.n_ctx_train and d.n_ctx_train < t.n_ctx_train:
        warnings.append(f"draft context length {d.n_ctx_train} < target context length {t.n_ctx_train}")
    if d.rope_type == "mrope":
        warnings.append("draft uses M-RoPE sections: injected rows need 4 positions each")
    if d.has_markov and not d.has_confidence_head:
        warnings.append("DSpark draft without a confidence head: use conf_min = 0 (no confidence cuts)")
    warnings.extend(d.notes)
    return warnings
