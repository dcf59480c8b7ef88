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
(:func:`pyllama_dspark.gguf.router_margins.router_margins` measures it in llama.cpp's own
graph).

Tokenizer: :mod:`pyllama_dspark.gguf.target_tokenizer`, at the architecture's real vocabulary size
by default (151,936 for Qwen3, 262,144 for Gemma 4, ...; :mod:`pyllama_dspark.gguf.target_archs`).
Embedding and output matrices are F16 by default (``vocab_type``), everything else F32; a
separate ``output.weight`` is always written, so ``peaked`` can scale the output logits alone.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional, Tuple

import numpy as np

from pyllama_dspark.gguf.target_archs import ARCH_SPECS, TARGET_ARCHS
from pyllama_dspark.gguf.target_tokenizer import MIN_N_VOCAB, tokenizer_meta
from pyllama_dspark.gguf.write import TENSOR_ENCODINGS, encode, gauss, write_gguf

__all__ = ["make_test_target"]


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
    meta.update(tokenizer_meta(n_vocab, tokenizer_source))

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
