"""Test helpers: random-weight DFlash/DSpark drafts matched to any llama.cpp target GGUF.

No trained DSpark draft exists for the small test targets, so :func:`make_test_draft` writes a
real ``dflash`` GGUF -- the keys and tensors llama.cpp's converter (``conversion/qwen.py``
``DFlashModel`` / ``DSparkModel``) would write, with the shapes ``llama_model_dflash``
(``src/models/dflash.cpp``) creates -- filled with random weights.  llama.cpp loads and runs it
like a trained draft; only its proposals are meaningless.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from pyllama_dspark.gguf.draft_types import (DEFAULT_DRAFT_TYPE, DRAFT_TYPES, check_draft_type, draft_file_type,
                                              draft_tensor_type)
from pyllama_dspark.gguf.info import DRAFT_ARCH
from pyllama_dspark.gguf.reader import field_value, read_gguf
from pyllama_dspark.gguf.target_info import read_target_info
from pyllama_dspark.gguf.write import TENSOR_ENCODINGS, encode, gauss, infer_type, raw_field, same_kind_type, write_gguf

__all__ = [
    "make_test_draft",
    "default_target_layers",
    "pick_mask_token_id",
    "DRAFT_OVERRIDE_KEYS",
    "DRAFT_TYPES",
    "DEFAULT_DRAFT_TYPE",
]

#: Pseudo-keys understood by ``make_test_draft(overrides=...)`` besides plain metadata keys.
DRAFT_OVERRIDE_KEYS = (
    "@n_embd",         # int: draft hidden size (default: the target's n_embd)
    "@n_vocab",        # int: cut / pad the copied token list to this many tokens
    "@perturb_token",  # int: token id whose text is changed (same size, different tokenizer)
    "@drop_tensors",   # iterable of tensor names left out of the file
    "@n_ff",           # int: FFN width (default: the target's)
    "@n_head",         # int: attention heads (default: the target's, or n_embd // head_dim)
    "@n_head_kv",      # int: KV heads (default: the target's when it divides n_head)
    "@head_dim",       # int: head size (default: the target's)
    "@markov_scale",   # bool: also write markov_w2.scale (a [1] tensor, value 1.0)
    "@fc_scale",       # bool: also write fc.scale (a [1] tensor, value 1.0)
)

_FC_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")


def default_target_layers(n_layer: int, n: int = 5) -> List[int]:
    """Layer-input ids spread over the target depth, as DFlash/DSpark checkpoints choose them.

    Public checkpoints take ``n`` HF layer indices evenly spread over ``1 .. n_layer - 3`` and the
    converter stores them ``+ 1``; the stored values are the llama.cpp layer-input ids, so they
    fall in ``2 .. n_layer - 2`` -- always valid (``<= n_layer - 1``) for every target arch.
    Small targets get fewer (distinct) ids; a 1-layer target gets ``[0]``.
    """
    n_layer = int(n_layer)
    if n_layer < 1:
        raise ValueError(f"n_layer must be >= 1, got {n_layer}")
    if n_layer == 1:
        return [0]
    lo, hi = 1, max(1, n_layer - 3)          # HF indices
    n = max(1, min(int(n), hi - lo + 1))
    if n == 1:
        hf = [lo + (hi - lo) // 2]
    else:
        hf = [int(lo + i * (hi - lo) / (n - 1) + 0.5) for i in range(n)]
    ids = sorted({min(h + 1, n_layer - 1) for h in hf})
    return ids


def pick_mask_token_id(reader) -> int:
    """Mask token for a draft made for the target behind ``reader``.

    * the target's own ``tokenizer.ggml.mask_token_id`` when it has one;
    * else the highest-id CONTROL token (GGUF token type 3) that is not one of the target's
      BOS / EOS / EOT / EOM / PAD / SEP / UNK / CLS tokens -- a special token ordinary text never
      produces, like the reserved special token DFlash checkpoints use.  For SmolLM2 this is id 16,
      ``<empty_output>``;
    * else the UNK token, else the last token of the vocabulary.
    """
    mask = field_value(reader, "tokenizer.ggml.mask_token_id", None)
    if mask is not None:
        return int(mask)
    toks = reader.fields.get("tokenizer.ggml.tokens")
    n_vocab = len(toks.data) if toks is not None else 0
    if n_vocab <= 0:
        raise ValueError("target has no tokenizer.ggml.tokens")
    reserved = set()
    for k in ("bos", "eos", "eot", "eom", "padding", "seperator", "separator", "unknown", "cls"):
        v = field_value(reader, f"tokenizer.ggml.{k}_token_id", None)
        if v is not None:
            reserved.add(int(v))
    types = field_value(reader, "tokenizer.ggml.token_type", None)
    if types is not None and len(types) == n_vocab:
        arr = np.asarray(types)
        for i in np.nonzero(arr == 3)[0][::-1]:
            if int(i) not in reserved:
                return int(i)
    unk = field_value(reader, "tokenizer.ggml.unknown_token_id", None)
    if unk is not None and 0 <= int(unk) < n_vocab:
        return int(unk)
    return n_vocab - 1


# --------------------------------------------------------------------------------------------
# the draft writer (metadata / weight helpers and the atomic write: pyllama_dspark.gguf.write)
# --------------------------------------------------------------------------------------------

def _bf16_rounded(arr: np.ndarray) -> np.ndarray:
    """``arr`` through BF16 and back to F32 (what a released BF16 checkpoint holds)."""
    import gguf

    bf = gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), gguf.GGMLQuantizationType.BF16)
    return (bf.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(arr.shape)


def _encode(arr: np.ndarray, kind: str):
    """(data, raw_dtype) for GGUFWriter.add_tensor (:func:`encode`, naming ``fc_type`` on a bad kind)."""
    if kind not in TENSOR_ENCODINGS:
        raise ValueError(f"fc_type must be one of {_FC_TYPES}, got {kind!r}")
    return encode(arr, kind)


def make_test_draft(
    target_path,
    out_path,
    kind: str = "dspark",
    n_layers: int = 2,
    block_size: int = 7,
    markov_rank: int = 32,
    confidence: bool = True,
    target_layers: Optional[Sequence[int]] = None,
    seed: int = 0,
    fc_type: Optional[str] = None,
    overrides: Optional[Dict[str, Any]] = None,
    weights: Optional[Dict[str, Tuple[np.ndarray, str]]] = None,
    weight_type: str = "f32",
) -> str:
    """Write a random-weight draft GGUF (arch ``dflash``) matched to the target GGUF.

    * tokenizer: every ``tokenizer.*`` key of the target copied byte for byte (vocabulary, merges,
      special ids, chat template), plus ``tokenizer.ggml.mask_token_id`` from
      :func:`pick_mask_token_id`;
    * hyper-parameters: ``dflash.{context_length, embedding_length (= target n_embd),
      block_count (= n_layers), feed_forward_length, attention.head_count[_kv],
      attention.key_length / value_length, attention.layer_norm_rms_epsilon, rope.freq_base,
      block_size, target_layers, attention.causal (= false)}``, for DSpark also
      ``dflash.sample_from_anchor (= true)`` and ``dflash.has_confidence_head``;
    * tensors (numpy shapes; ggml ne is the reverse): ``fc.weight`` [d, m*d_t],
      ``enc.output_norm.weight`` [d], per layer ``blk.i.{attn_norm [d], attn_q [H*hd, d],
      attn_k / attn_v [Hkv*hd, d], attn_output [d, H*hd], attn_q_norm / attn_k_norm [hd],
      ffn_norm [d], ffn_gate / ffn_up [n_ff, d], ffn_down [d, n_ff]}.weight``,
      ``output_norm.weight`` [d]; DSpark adds ``markov_w1.weight`` [n_vocab, R],
      ``markov_w2.weight`` [n_vocab, R] and, with ``confidence``, ``conf_proj.weight`` [1, d+R]
      and ``conf_proj.bias`` [1].  No token embeddings / lm_head: llama.cpp shares the target's
      through ``ctx_other``.
    * weights ~ N(0, 1/fan_in) (``markov_w1`` ~ N(0, 1) so the Markov bias W2.W1[prev] is O(1)),
      norm weights 1;
    * tensor types: ``weight_type`` (:data:`DRAFT_TYPES`: ``"bf16" | "f32" | "f16" | "q8_0" |
      "q4_0"``), per tensor as llama.cpp's converter / quantizer choose
      (:func:`pyllama_dspark.gguf.draft_types.draft_tensor_type`: norms, biases and 1-D tensors F32,
      rows that do not fit a 32-block F16, ``fc.weight`` never F16).  Except at ``"f32"`` the
      random values are rounded to BF16 first, as a released checkpoint's are.  This function
      defaults to ``"f32"`` (tests edit its tensors in place and compare against F32 references);
      ``make-test-draft`` and ``-md random`` / ``oracle:P`` write :data:`DEFAULT_DRAFT_TYPE`
      (``"bf16"``), the type drafters are released in.  ``fc_type`` (``"f32" | "bf16" | "f16" |
      "q8_0" | "q4_0"``) forces ``fc.weight``'s type, rules aside (``"f16"`` reproduces hazard 9).
      ``general.file_type`` says ``weight_type``.

    ``kind="dflash"`` writes a plain DFlash draft (no Markov / confidence heads, no
    sample_from_anchor key; ``markov_rank`` and ``confidence`` are ignored).  ``target_layers``
    are the values stored in ``dflash.target_layers``, i.e. the llama.cpp layer-input ids
    (default :func:`default_target_layers`); they are not checked, so invalid ones can be written
    on purpose.

    ``overrides`` produces broken or unusual drafts: a plain metadata key maps to its new value
    (``None`` deletes the key, e.g. ``{"dflash.block_size": None}``; an existing key keeps its GGUF
    type when the value fits it); the pseudo-keys in :data:`DRAFT_OVERRIDE_KEYS` change the
    structure (``"@n_embd"``, ``"@n_vocab"``, ``"@perturb_token"``, ``"@drop_tensors"``, ...).

    ``weights`` maps tensor names to ``(array, encoding)`` (numpy shapes as above; encoding
    ``"f32" | "f16" | "bf16" | "q8_0" | "i64"``): those tensors replace the random ones or are added
    (``d2t``, ``output.weight`` of a reduced-vocabulary draft) -- this is how a trained draft is
    exported (:mod:`pyllama_dspark.training.export`).

    Returns ``out_path`` (as a str).  The file is written to a temporary name and renamed.
    """
    import gguf

    if kind not in ("dspark", "dflash"):
        raise ValueError(f"kind must be 'dspark' or 'dflash', got {kind!r}")
    weight_type = check_draft_type(weight_type)
    if fc_type is not None:
        fc_type = str(fc_type).lower()
        if fc_type not in _FC_TYPES:
            raise ValueError(f"fc_type must be one of {_FC_TYPES}, got {fc_type!r}")
    if int(n_layers) < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    if int(block_size) < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if kind == "dspark" and int(markov_rank) < 1:
        raise ValueError(f"markov_rank must be >= 1, got {markov_rank}")

    overrides = dict(overrides or {})
    pseudo = {k: overrides.pop(k) for k in list(overrides) if k.startswith("@")}
    unknown = set(pseudo) - set(DRAFT_OVERRIDE_KEYS)
    if unknown:
        raise ValueError(f"unknown override pseudo-keys {sorted(unknown)}; known: {DRAFT_OVERRIDE_KEYS}")

    out_path = os.fspath(out_path)
    reader = read_gguf(target_path)
    tinfo = read_target_info(target_path, require_layer_inputs=False)
    rng = np.random.default_rng(seed)
    vt = gguf.GGUFValueType
    a = DRAFT_ARCH

    # ---- shapes
    n_embd = int(pseudo.get("@n_embd", tinfo.n_embd))
    head_dim = int(pseudo.get("@head_dim", tinfo.head_dim or 64))
    if "@n_head" in pseudo:
        n_head = int(pseudo["@n_head"])
    elif n_embd == tinfo.n_embd and tinfo.n_head:
        n_head = tinfo.n_head
    else:
        n_head = max(1, n_embd // head_dim)
    if "@n_head_kv" in pseudo:
        n_head_kv = int(pseudo["@n_head_kv"])
    elif tinfo.n_head_kv and n_head % tinfo.n_head_kv == 0:
        n_head_kv = tinfo.n_head_kv
    else:
        n_head_kv = n_head
    if n_head % n_head_kv != 0:
        raise ValueError(f"n_head {n_head} must be a multiple of n_head_kv {n_head_kv}")
    n_ff = int(pseudo.get("@n_ff", tinfo.n_ff or 4 * n_embd))

    layers = list(default_target_layers(tinfo.n_layer) if target_layers is None else target_layers)
    if not layers:
        raise ValueError("target_layers must not be empty")
    layers = [int(x) for x in layers]
    # llama.cpp sizes the fc input as (number of target layers) x (the draft's own n_embd)
    # (src/models/dflash.cpp: n_embd_inp_enc_impl), which is why a usable draft needs
    # n_embd == the target's n_embd; an "@n_embd" draft is self-consistent but fits no such target.
    n_in = len(layers) * n_embd

    # ---- metadata (ordered: key -> (value, vtype, sub_type))
    meta: "OrderedDict[str, Tuple[Any, Any, Any]]" = OrderedDict()
    meta["general.type"] = ("model", vt.STRING, None)
    meta["general.name"] = (f"pyllama-dspark random {kind} test draft", vt.STRING, None)
    meta["general.file_type"] = (draft_file_type(weight_type), vt.UINT32, None)
    meta["general.quantization_version"] = (gguf.GGML_QUANT_VERSION, vt.UINT32, None)
    meta[f"{a}.context_length"] = (int(tinfo.n_ctx_train or 4096), vt.UINT32, None)
    meta[f"{a}.embedding_length"] = (n_embd, vt.UINT32, None)
    meta[f"{a}.block_count"] = (int(n_layers), vt.UINT32, None)
    meta[f"{a}.feed_forward_length"] = (n_ff, vt.UINT32, None)
    meta[f"{a}.attention.head_count"] = (n_head, vt.UINT32, None)
    meta[f"{a}.attention.head_count_kv"] = (n_head_kv, vt.UINT32, None)
    meta[f"{a}.attention.key_length"] = (head_dim, vt.UINT32, None)
    meta[f"{a}.attention.value_length"] = (head_dim, vt.UINT32, None)
    meta[f"{a}.attention.layer_norm_rms_epsilon"] = (float(tinfo.rms_eps or 1e-6), vt.FLOAT32, None)
    meta[f"{a}.rope.freq_base"] = (float(tinfo.rope_freq_base), vt.FLOAT32, None)
    meta[f"{a}.block_size"] = (int(block_size), vt.UINT32, None)
    meta[f"{a}.target_layers"] = (layers, vt.ARRAY, vt.INT32)
    meta[f"{a}.attention.causal"] = (False, vt.BOOL, None)
    if kind == "dspark":
        meta[f"{a}.sample_from_anchor"] = (True, vt.BOOL, None)
        meta[f"{a}.has_confidence_head"] = (bool(confidence), vt.BOOL, None)

    for key in reader.fields:
        if key.startswith("tokenizer."):
            meta[key] = raw_field(reader, key)
    if "tokenizer.ggml.mask_token_id" not in meta:
        meta["tokenizer.ggml.mask_token_id"] = (pick_mask_token_id(reader), vt.UINT32, None)

    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"target {target_path!r} has no tokenizer.ggml.tokens to copy")
    n_vocab = len(meta["tokenizer.ggml.tokens"][0])
    if "@n_vocab" in pseudo:
        nv = int(pseudo["@n_vocab"])
        if nv < 1:
            raise ValueError("@n_vocab must be >= 1")
        for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            if k not in meta:
                continue
            vals, t0, sub = meta[k]
            vals = list(vals[:nv])
            while len(vals) < nv:
                if k == "tokenizer.ggml.tokens":
                    vals.append(f"<pyllama_dspark_extra_{len(vals)}>".encode())
                elif k == "tokenizer.ggml.token_type":
                    vals.append(4)  # USER_DEFINED
                else:
                    vals.append(0.0)
            meta[k] = (vals, t0, sub)
        n_vocab = nv
        mask_val, mt, _ = meta["tokenizer.ggml.mask_token_id"]
        if mask_val >= nv:
            meta["tokenizer.ggml.mask_token_id"] = (nv - 1, mt, None)
    if "@perturb_token" in pseudo:
        tid = int(pseudo["@perturb_token"])
        vals, t0, sub = meta["tokenizer.ggml.tokens"]
        vals = list(vals)
        vals[tid] = vals[tid] + b"\xe2\x80\xa0"  # append a dagger: same size, different vocabulary
        meta["tokenizer.ggml.tokens"] = (vals, t0, sub)

    for key, value in overrides.items():
        if value is None:
            meta.pop(key, None)
            continue
        if key in meta and same_kind_type(value, meta[key][1], meta[key][2]):
            old = meta[key]
            if old[1] == vt.ARRAY:
                meta[key] = (list(value), old[1], old[2])
            else:
                meta[key] = (value, old[1], None)
        else:
            meta[key] = infer_type(key, value)

    # ---- tensors (numpy shape = reversed ggml ne)
    tensors: "OrderedDict[str, Tuple[np.ndarray, Any]]" = OrderedDict()

    def put(name: str, arr: np.ndarray, enc: Optional[str] = None) -> None:
        """``enc`` None: the type :func:`draft_tensor_type` gives at ``weight_type``."""
        if enc is None:
            enc = draft_tensor_type(name, arr.shape, weight_type)
            if weight_type != "f32":          # a released checkpoint's values, also where kept F32
                arr = _bf16_rounded(arr)
        tensors[name] = _encode(arr, enc)

    ones = lambda n: np.ones((n,), dtype=np.float32)  # noqa: E731
    put("fc.weight", gauss(rng, (n_embd, n_in), n_in), fc_type)
    if pseudo.get("@fc_scale"):
        put("fc.scale", np.ones((1,), dtype=np.float32))
    put("enc.output_norm.weight", ones(n_embd))
    for il in range(int(n_layers)):
        p = f"blk.{il}."
        put(p + "attn_norm.weight", ones(n_embd))
        put(p + "attn_q.weight", gauss(rng, (n_head * head_dim, n_embd), n_embd))
        put(p + "attn_k.weight", gauss(rng, (n_head_kv * head_dim, n_embd), n_embd))
        put(p + "attn_v.weight", gauss(rng, (n_head_kv * head_dim, n_embd), n_embd))
        put(p + "attn_output.weight", gauss(rng, (n_embd, n_head * head_dim), n_head * head_dim))
        put(p + "attn_q_norm.weight", ones(head_dim))
        put(p + "attn_k_norm.weight", ones(head_dim))
        put(p + "ffn_norm.weight", ones(n_embd))
        put(p + "ffn_gate.weight", gauss(rng, (n_ff, n_embd), n_embd))
        put(p + "ffn_up.weight", gauss(rng, (n_ff, n_embd), n_embd))
        put(p + "ffn_down.weight", gauss(rng, (n_embd, n_ff), n_ff))
    put("output_norm.weight", ones(n_embd))
    if kind == "dspark":
        r = int(markov_rank)
        put("markov_w1.weight", gauss(rng, (n_vocab, r), 1))
        put("markov_w2.weight", gauss(rng, (n_vocab, r), r))
        if pseudo.get("@markov_scale"):
            put("markov_w2.scale", np.ones((1,), dtype=np.float32))
        if confidence:
            put("conf_proj.weight", gauss(rng, (1, n_embd + r), n_embd + r))
            put("conf_proj.bias", np.full((1,), 0.25, dtype=np.float32))
    for name, (arr, enc) in (weights or {}).items():
        put(name, arr, enc)
    for name in pseudo.get("@drop_tensors", ()) or ():
        tensors.pop(name, None)

    # ---- write (temp file in the same directory, then rename)
    write_gguf(out_path, a, meta, tensors, tmp_prefix=".draft-")
    return out_path


# --------------------------------------------------------------------------------------------
# a draft that actually gets accepted: bigrams planted in the Markov head
# --------------------------------------------------------------------------------------------

def plant_markov_bigrams(draft_path, sequences: Sequence[Sequence[int]], strength: float = 200.0,
                         drop_every: int = 0) -> int:
    """Turn a random DSpark draft's Markov head into a bigram table, in place.

    For every token ``a`` in ``sequences`` the first successor ``b`` seen gets one rank slot:
    ``W1[a, s] = 1`` and ``W2[b, s] = strength``, so ``bias(a) = W2.W1[a]`` puts ``strength`` on
    ``b`` and llama.cpp's in-graph (argmax-conditioned) Markov chain proposes the sequence itself
    wherever it is a deterministic bigram chain.  Tokens with several successors, bigrams beyond
    the rank, and every ``drop_every``-th bigram (when > 0) fall back to the random base logits, so
    the draft gets partial acceptances — a real DSpark draft running entirely inside llama.cpp,
    which makes it a fixture for comparing drivers (ours vs llama.cpp's C++ one).
    The Markov head must be F32 or BF16 (``strength`` is truncated to BF16 there: 200 is exact).
    Returns the number of rank slots used.
    """
    import gguf

    r = gguf.GGUFReader(os.fspath(draft_path), "r+")
    tensors = {t.name: t for t in r.tensors}
    if "markov_w1.weight" not in tensors or "markov_w2.weight" not in tensors:
        raise ValueError(f"{draft_path} has no Markov head")
    views = []
    for name in ("markov_w1.weight", "markov_w2.weight"):   # [n_vocab, R] views of the file
        t = tensors[name]
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            views.append(t.data)
        elif t.tensor_type == gguf.GGMLQuantizationType.BF16:
            views.append(t.data.view(np.uint16))
        else:
            raise ValueError(f"plant_markov_bigrams needs an F32 or BF16 Markov head, {name} is {t.tensor_type.name}")
    rank = views[0].shape[1]
    w1 = np.zeros(views[0].shape, dtype=np.float32)
    w2 = np.zeros(views[1].shape, dtype=np.float32)
    successor: Dict[int, int] = {}
    for seq in sequences:
        for a, b in zip(seq[:-1], seq[1:]):
            successor.setdefault(int(a), int(b))
    slots: Dict[int, int] = {}
    for i, (a, b) in enumerate(successor.items()):
        if drop_every and i % drop_every == drop_every - 1:
            continue
        if b not in slots:
            if len(slots) == rank:
                continue
            slots[b] = len(slots)
            w2[b, slots[b]] = strength
        w1[a, slots[b]] = 1.0
    for view, w in zip(views, (w1, w2)):      # 0, 1 and a strength like 200 are exact in BF16
        view[...] = w if view.dtype == np.float32 else (w.view(np.uint32) >> 16).astype(np.uint16)
    r.data.flush()
    del r
    return len(slots)
