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
* the hybrids ``lfm2`` / ``qwen35`` / ``qwen35moe`` / ``qwen3next`` / ``nemotron_h`` (attention beside a
  recurrent state): their layers are planned by :mod:`pyllama_dspark.gguf.target_hybrid`.

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
separate ``output.weight`` is written, so ``peaked`` can scale the output logits alone.

Real shapes (``size``, :mod:`pyllama_dspark.gguf.target_sizes`): Qwen3 0.6B-8B, Llama 3.2 1B/3B,
Gemma 4 12B at their published widths, depths, heads and vocabularies, every weight matrix F16
(``weight_type``; llama.cpp's quantizer makes Q8_0 / Q4_0 / Q4_K_M of it:
:mod:`pyllama_dspark.llama.quantize`).  Tied models have no ``output.weight`` (llama.cpp reads
``token_embd`` for both), so there ``peaked`` scales the shared matrix, and the layers' outputs are
made large against the input embedding (gemma4: post-norms of sqrt(n_embd); llama / qwen3: output
projections x :data:`TIED_RESIDUAL_GAIN`), else the token's own output row wins (greedy repeats the
current token: 22 of 36 steps on Qwen3-0.6B peaked x4 with gain 1, 2 of 36 with 16).  Writing streams: the
header and tensor infos first, then each tensor generated chunk by chunk just before it is written
(an 8B target in well under 1 GB of memory); their weights are windows at random offsets of one
pool of N(0, 1) numbers (the output / tied embedding matrix: fresh uniform numbers of the same
variance, so no two tokens share an output row).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Callable, Iterable, List, NamedTuple, Optional, Tuple

import numpy as np

from pyllama_dspark.gguf.target_archs import ARCH_SPECS, TARGET_ARCHS
from pyllama_dspark.gguf.target_hybrid import add_hybrid
from pyllama_dspark.gguf.target_sizes import RandomPool, SizeSpec, get_size, is_full_layer, uniform_chunks
from pyllama_dspark.gguf.target_tokenizer import MIN_N_VOCAB, tokenizer_meta
from pyllama_dspark.gguf.write import TENSOR_ENCODINGS, atomic_output, encode, gauss

__all__ = ["make_test_target", "plan_test_target", "count_params", "WEIGHT_TYPES"]

#: ``weight_type`` values: the encoding of every weight matrix (1-D tensors stay F32)
WEIGHT_TYPES = ("f32", "f16")
#: tied llama / qwen3 --size targets: gain of the output projections (attn_output, ffn_down)
TIED_RESIDUAL_GAIN = 16.0


class TensorPlan(NamedTuple):
    name: str
    shape: Tuple[int, ...]                       # numpy shape (reversed ggml ne)
    enc: str                                     # one of TENSOR_ENCODINGS
    chunks: Callable[[], Iterable[np.ndarray]]   # row blocks whose concatenation is the tensor


def count_params(plan: List[TensorPlan]) -> Tuple[int, int]:
    """(total, non-embedding) parameters of a plan (non-embedding: without ``token_embd`` and
    ``output``, as the Qwen3 model cards count)."""
    total = emb = 0
    for t in plan:
        n = int(np.prod(t.shape, dtype=np.int64))
        total += n
        emb += n if t.name in ("token_embd.weight", "output.weight") else 0
    return total, total - emb


def _nbytes(shape: Tuple[int, ...], enc: str) -> int:
    import gguf

    n = int(np.prod(shape, dtype=np.int64))
    if enc == "f32":
        return 4 * n
    if enc in ("f16", "bf16"):
        return 2 * n
    if enc == "q8_0":
        return int(np.prod(gguf.quants.quant_shape_to_byte_shape(shape, gguf.GGMLQuantizationType.Q8_0)))
    raise ValueError(f"cannot stream tensor encoding {enc!r}")


def _stream_write(out_path, arch: str, meta, plan: List[TensorPlan]) -> str:
    """Write ``meta`` and the tensors of ``plan`` as a GGUF: header, metadata and tensor infos
    first, then each tensor chunk by chunk as its generator makes it; to a temporary file next to
    ``out_path``, renamed over it at the end (removed on any error)."""
    import gguf

    out_path = os.fspath(out_path)
    raw = {"f32": (np.float32, None), "f16": (np.float16, None),
           "bf16": (np.float32, gguf.GGMLQuantizationType.BF16), "q8_0": (np.float32, gguf.GGMLQuantizationType.Q8_0)}
    with atomic_output(out_path, ".target-") as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        for key, (value, vtype, sub) in meta.items():
            writer.add_key_value(key, value, vtype, sub_type=sub)
        sizes = []
        for t in plan:
            dtype, raw_dtype = raw[t.enc]
            sizes.append(_nbytes(t.shape, t.enc))
            writer.add_tensor_info(t.name, t.shape, np.dtype(dtype), sizes[-1], raw_dtype=raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]
        writer.write_padding(fout, fout.tell())
        for t, nbytes in zip(plan, sizes):
            done = 0
            for chunk in t.chunks():
                data = encode(chunk, t.enc)[0]
                data.tofile(fout)
                done += data.nbytes
            if done != nbytes:
                raise AssertionError(f"{t.name}: wrote {done} bytes, planned {nbytes}")
            writer.write_padding(fout, nbytes)
        writer.close()
    return out_path


def _levels(n_expert: int, n_used: int) -> np.ndarray:
    """Reserved-dimension levels: ``n_used`` high ones 0.5 apart, then the rest from 1.0 down.
    The gap between the last chosen and the first unchosen expert is 1.5 (x the router gain)."""
    hi = 3.0 - 0.5 * np.arange(n_used)
    lo = np.linspace(1.0, 0.0, n_expert - n_used) if n_expert > n_used else np.zeros(0)
    return np.concatenate([hi, lo]).astype(np.float32)


def make_test_target(out_path, arch: str = "qwen3", **kwargs) -> str:
    """Write a random-weight target GGUF of ``arch`` (one of :data:`TARGET_ARCHS`) to ``out_path``
    (streamed; keyword arguments: :func:`plan_test_target`).  Returns ``out_path``."""
    gguf_arch, meta, plan = plan_test_target(arch, **kwargs)
    return _stream_write(out_path, gguf_arch, meta, plan)


def plan_test_target(
    arch: str = "qwen3",
    *,
    size: Optional[str] = None,
    weight_type: Optional[str] = None,
    n_vocab: Optional[int] = None,
    seed: int = 0,
    peaked: Optional[float] = None,
    n_layer: Optional[int] = None,
    n_embd: Optional[int] = None,
    n_head: Optional[int] = None,
    n_head_kv: Optional[int] = None,
    head_dim: Optional[int] = None,
    n_ff: Optional[int] = None,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_exp: int = 64,
    n_swa: int = 32,
    n_embd_per_layer: int = 16,
    context_length: int = 8192,
    router_gain: float = 12.0,
    vocab_type: str = "f16",
    tokenizer_source: Optional[str] = None,
    tokenizer_extra: Optional[dict] = None,
) -> Tuple[str, "OrderedDict[str, Tuple[Any, Any, Any]]", List[TensorPlan]]:
    """(GGUF architecture, metadata, tensor plan) of a random-weight target of ``arch``: the
    tensors' names, shapes and encodings, with generators that make their data when written (so a
    plan costs no memory; :func:`count_params` counts it).

    ``size``: real shapes (:mod:`pyllama_dspark.gguf.target_sizes`: ``0.6b`` ... ``8b`` for qwen3,
    ``1b`` / ``3b`` for llama, ``12b`` for gemma4); the widths and the vocabulary come from the table
    (``n_vocab``, ``n_embd``, ``n_head``, ``n_head_kv``, ``head_dim``, ``n_ff`` must then be None),
    ``n_layer`` may still override the depth.  ``weight_type``: ``"f16"`` / ``"f32"`` for every
    weight matrix (default with ``size``: F16; without: F32 and ``vocab_type`` for the
    vocabulary-sized matrices).  Without ``size``: ``n_vocab`` defaults to the architecture's real
    one (``ArchSpec.real_n_vocab``; at least :data:`MIN_N_VOCAB`), widths 128 / 4 heads / 2 KV heads
    / head 32 / FFN 256.  ``peaked``: multiply the output matrix by this factor (logits std ~
    ``peaked`` instead of ~1, so that top-p keeps a model-like handful of tokens).  ``n_layer``:
    default 4 (6 for Gemma 4, which needs room for its SWA pattern and two shared-KV layers).
    ``n_swa``: sliding window of the SWA layers.  ``vocab_type``: encoding of the vocabulary-sized
    matrices (``token_embd``, ``output``, ``per_layer_token_embd``); ``"f32"`` for bit-exact small
    tests.  Weights ~ N(0, 1/fan_in), norms 1; MoE routing is deterministic per token (see the
    module docstring; ``router_gain`` scales the router).  ``tokenizer_extra``: keyword arguments of
    :func:`~.target_tokenizer.tokenizer_meta` (another model's chat template, its special tokens).
    """
    import gguf

    if arch not in ARCH_SPECS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(TARGET_ARCHS)}")
    spec = ARCH_SPECS[arch]
    sz: Optional[SizeSpec] = None
    widths = (("n_embd", n_embd, 128), ("n_head", n_head, 4), ("n_head_kv", n_head_kv, 2), ("head_dim", head_dim, 32),
              ("n_ff", n_ff, 256))
    if size is not None:
        sz = get_size(arch, size)
        given = [name for name, v, _ in widths + (("n_vocab", n_vocab, 0),) if v is not None]
        if given:
            raise ValueError(f"size {sz.size} fixes {', '.join(given)}: do not pass "
                             f"{'it' if len(given) == 1 else 'them'} with a size")
        n_vocab, n_embd, n_head, n_head_kv, head_dim, n_ff = (sz.n_vocab, sz.n_embd, sz.n_head, sz.n_head_kv,
                                                              sz.head_dim, sz.n_ff)
        context_length = sz.context_length
        weight_type = "f16" if weight_type is None else weight_type
    else:
        n_embd, n_head, n_head_kv, head_dim, n_ff = (int(d if v is None else v) for _, v, d in widths)
    if weight_type is not None and weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight_type must be one of {', '.join(WEIGHT_TYPES)}, got {weight_type!r}")
    n_vocab = int(spec.real_n_vocab if n_vocab is None else n_vocab)
    if n_vocab < MIN_N_VOCAB:
        raise ValueError(f"n_vocab must be >= {MIN_N_VOCAB} (SmolLM2's special and byte tokens), got {n_vocab}")
    if vocab_type not in TENSOR_ENCODINGS or vocab_type == "i64":
        raise ValueError(f"vocab_type must be one of f32, f16, bf16, q8_0; got {vocab_type!r}")
    if peaked is not None and not (float(peaked) > 0 and np.isfinite(float(peaked))):
        raise ValueError(f"peaked must be a positive number, got {peaked!r}")
    n_layer = int((sz.n_layer if sz else spec.n_layer) if n_layer is None else n_layer)
    g4 = spec.gguf_arch == "gemma4"
    min_layer = 6 if (g4 and sz is None) else 1
    if n_layer < min_layer:
        raise ValueError(f"n_layer must be >= {min_layer} for {arch}, got {n_layer}")
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
    wenc = weight_type or "f32"                 # every weight matrix
    venc = weight_type or vocab_type            # the vocabulary-sized ones
    fast = RandomPool(rng) if sz is not None else None
    tied = bool(sz and sz.tied)

    # ---- per-layer structure
    n_shared, hd_full, k_eq_v = 0, head_dim, False
    if g4:
        if sz is not None:
            # every 6th layer and the last full attention, no shared KV, no per-layer embeddings
            is_swa = [not is_full_layer(sz, il, n_layer) for il in range(n_layer)]
            hd_full, kv_full, k_eq_v = sz.head_dim_full, sz.n_head_kv_full, sz.k_eq_v
            n_embd_per_layer, n_swa = 0, sz.n_swa
        else:
            # ... S S S F | S F (shared): the last non-shared pair must be (SWA, full), see
            # llama-model.cpp's gemma4 KV reuse (n_layer_kv_from_start - 2 / - 1)
            n_shared = 2
            is_swa = [True] * n_layer
            is_swa[n_layer - 3] = False
            is_swa[n_layer - 1] = False
            hd_full, kv_full = 2 * head_dim, max(1, n_head_kv // 2)
        has_kv = [il < n_layer - n_shared for il in range(n_layer)]
        hd = [head_dim if s else hd_full for s in is_swa]
        kvh = [n_head_kv if s else kv_full for s in is_swa]
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
    kv("general.name", f"pyllama-dspark random {arch}{' ' + sz.size if sz else ''} test target")
    if weight_type is not None:
        kv("general.file_type", 1 if weight_type == "f16" else 0)   # LLAMA_FTYPE_MOSTLY_F16 / ALL_F32
    kv(f"{a}.context_length", int(context_length))
    kv(f"{a}.embedding_length", int(n_embd))
    kv(f"{a}.block_count", int(n_layer))
    if a != "gpt-oss":
        kv(f"{a}.feed_forward_length", int(n_ff))
    kv(f"{a}.attention.head_count", int(n_head))
    if g4:
        kv(f"{a}.attention.head_count_kv", [int(x) for x in kvh], vt.ARRAY, vt.INT32)
        kv(f"{a}.attention.key_length", int(hd_full))
        kv(f"{a}.attention.value_length", int(hd_full))
        kv(f"{a}.attention.key_length_swa", head_dim)
        kv(f"{a}.attention.value_length_swa", head_dim)
        kv(f"{a}.rope.dimension_count", int(hd_full))
        kv(f"{a}.rope.dimension_count_swa", head_dim)
    else:
        kv(f"{a}.attention.head_count_kv", int(n_head_kv))
        kv(f"{a}.attention.key_length", head_dim)
        kv(f"{a}.attention.value_length", head_dim)
        kv(f"{a}.rope.dimension_count", head_dim)
    kv(f"{a}.attention.layer_norm_rms_epsilon", float(sz.rms_eps) if sz else 1e-6)
    kv(f"{a}.rope.freq_base", float(sz.rope_theta) if sz else
       1000000.0 if a in ("qwen3", "qwen3moe", "gemma4", "gemma3") else 10000.0)
    if a == "llama":
        kv(f"{a}.vocab_size", n_vocab)
    if spec.swa:
        kv(f"{a}.attention.sliding_window", int(n_swa))
        kv(f"{a}.attention.sliding_window_pattern", [bool(s) for s in is_swa], vt.ARRAY, vt.BOOL)
        if a in ("gemma4", "gemma3"):
            kv(f"{a}.rope.freq_base_swa", float(sz.rope_theta_swa) if sz else 10000.0)
    if g4:
        kv(f"{a}.attention.shared_kv_layers", n_shared)
        kv(f"{a}.embedding_length_per_layer_input", int(n_embd_per_layer))
        kv(f"{a}.final_logit_softcapping", 30.0)
    if spec.moe:
        kv(f"{a}.expert_count", int(n_expert))
        kv(f"{a}.expert_used_count", int(n_expert_used))
        kv(f"{a}.expert_feed_forward_length", int(n_ff_exp))
    meta.update(tokenizer_meta(n_vocab, tokenizer_source, **(tokenizer_extra or {})))

    # ---- tensors (numpy shapes: reversed ggml ne), generated in plan order when written
    plan: List[TensorPlan] = []

    def put(name: str, shape, make: Callable[[], np.ndarray], enc: str = "f32") -> None:
        plan.append(TensorPlan(name, tuple(int(d) for d in shape), enc, lambda: (make(),)))

    def weight(name: str, shape, fan_in: int, post=None, enc: Optional[str] = None, gain: float = 1.0) -> None:
        """A random matrix ~ N(0, gain^2/fan_in) (``post`` edits it, ``gain`` scales it: the small / the
        --size targets only)."""
        shape = tuple(int(d) for d in shape)
        if fast is not None:
            assert post is None
            plan.append(TensorPlan(name, shape, enc or wenc,
                                   lambda: fast.chunks(shape, float(gain / np.sqrt(max(1, fan_in))))))
        else:
            put(name, shape, (lambda: post(gauss(rng, shape, fan_in))) if post else (lambda: gauss(rng, shape, fan_in)),
                enc or wenc)

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
    out_std = float((1.0 if peaked is None else float(peaked)) / np.sqrt(n_embd))
    if fast is not None:
        vshape = (n_vocab, n_embd)
        if tied:   # one matrix read as embeddings and as output: scaled for the output logits
            plan.append(TensorPlan("token_embd.weight", vshape, venc, lambda: uniform_chunks(rng, vshape, out_std)))
        else:
            plan.append(TensorPlan("token_embd.weight", vshape, venc, lambda: fast.chunks(vshape, float(emb_scale))))
            plan.append(TensorPlan("output.weight", vshape, venc, lambda: uniform_chunks(rng, vshape, out_std)))
    else:
        def make_emb() -> np.ndarray:
            emb = rng.standard_normal((n_vocab, n_embd), dtype=f32)
            if res.size:
                lev = _levels(n_expert, n_expert_used)
                perm = np.argsort(rng.random((n_vocab, n_expert)), axis=1)
                emb[:, res] = lev[perm]
            emb *= emb_scale
            return emb

        put("token_embd.weight", (n_vocab, n_embd), make_emb, venc)
        weight("output.weight", (n_vocab, n_embd), n_embd, (lambda w: w * f32(peaked)) if peaked is not None else None,
               venc)
    put("output_norm.weight", (n_embd,), lambda: ones(n_embd))
    if g4:
        npl = int(n_embd_per_layer)
        if npl:
            put("per_layer_token_embd.weight", (n_vocab, npl * n_layer),
                lambda: rng.standard_normal((n_vocab, npl * n_layer), dtype=f32) * f32(1.0 / np.sqrt(npl)), venc)
            weight("per_layer_model_proj.weight", (npl * n_layer, n_embd), 1)
            put("per_layer_proj_norm.weight", (npl,), lambda: ones(npl))
        n_rot_full = hd_full // 2 // 4          # proportional RoPE: a quarter of the pairs rotate
        put("rope_freqs.weight", (hd_full // 2,),
            lambda: np.array([1.0] * n_rot_full + [1e30] * (hd_full // 2 - n_rot_full), dtype=f32))

    if spec.hybrid:   # lfm2, qwen35, ...: recurrent + attention layers, planned by gguf/target_hybrid.py
        add_hybrid(arch, kv, plan, put, weight, no_write, rng, res, wenc, n_vocab=n_vocab, n_layer=n_layer,
                   n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, n_ff=n_ff, n_expert=n_expert,
                   n_ff_exp=n_ff_exp, router_gain=float(router_gain),
                   gdn=(sz.linear_k_heads, sz.linear_v_heads, sz.linear_head_dim) if sz and sz.linear_k_heads else (),
                   attn_interval=sz.attn_interval if sz else 0,
                   mamba=(sz.mamba_head_dim, sz.mamba_d_state, sz.mamba_groups) if sz and sz.mamba_head_dim else (),
                   pattern=sz.layer_pattern if sz else "")
        return a, meta, plan
    gain = f32(router_gain)
    # tied gemma4: the input embedding (x sqrt(n_embd) in the graph) is the token's own output row, so
    # the residual must outweigh it or every token predicts itself (logit ~ sqrt(n_embd) peaked^2):
    # post-norms of sqrt(n_embd) make each layer's contribution that large (the others' stay 1)
    post = f32(np.sqrt(n_embd)) if (g4 and tied) else f32(1.0)
    # tied llama / qwen3 (no post-norms): output projections x TIED_RESIDUAL_GAIN, same reason
    res_gain = TIED_RESIDUAL_GAIN if (tied and not g4) else 1.0
    for il in range(n_layer):
        p = f"blk.{il}."
        h, nkv = hd[il], kvh[il]
        put(p + "attn_norm.weight", (n_embd,), lambda: ones(n_embd))
        weight(p + "attn_q.weight", (n_head * h, n_embd), n_embd)
        if has_kv[il]:
            weight(p + "attn_k.weight", (nkv * h, n_embd), n_embd)
            if not (k_eq_v and not is_swa[il]):     # gemma4 12B: K is V on the full layers
                weight(p + "attn_v.weight", (nkv * h, n_embd), n_embd)
        weight(p + "attn_output.weight", (n_embd, n_head * h), n_head * h, no_write if res.size else None,
               gain=res_gain)
        if a in ("qwen3", "qwen3moe", "gemma4", "gemma3"):
            # gemma4 does not scale q.k (f_attention_scale 1): q/k norms of h^-1/4 keep the
            # attention logits ~N(0, 1) instead of ~N(0, h) (a softmax that sharp amplifies rounding)
            qk = (f32(h) ** f32(-0.25)) if g4 else f32(1.0)
            put(p + "attn_q_norm.weight", (h,), lambda h=h, qk=qk: ones(h) * qk)
            if has_kv[il]:
                put(p + "attn_k_norm.weight", (h,), lambda h=h, qk=qk: ones(h) * qk)
        if a in ("gemma4", "gemma3", "gpt-oss"):
            put(p + "post_attention_norm.weight", (n_embd,), lambda: ones(n_embd) * post)
        if a == "gpt-oss":
            put(p + "attn_q.bias", (n_head * h,), lambda h=h: 0.1 * rng.standard_normal(n_head * h, dtype=f32))
            put(p + "attn_k.bias", (nkv * h,), lambda h=h, nkv=nkv: 0.1 * rng.standard_normal(nkv * h, dtype=f32))
            put(p + "attn_v.bias", (nkv * h,), lambda h=h, nkv=nkv: 0.1 * rng.standard_normal(nkv * h, dtype=f32))
            put(p + "attn_output.bias", (n_embd,),
                lambda: no_write(0.1 * rng.standard_normal((n_embd, 1), dtype=f32)).reshape(-1))
            put(p + "attn_sinks.weight", (n_head,), lambda: rng.standard_normal(n_head, dtype=f32))
        if a != "gpt-oss":
            put(p + "ffn_norm.weight", (n_embd,), lambda: ones(n_embd))
        dense = a in ("llama", "qwen3", "gemma3") or g4
        if dense:
            weight(p + "ffn_gate.weight", (n_ff, n_embd), n_embd)
            weight(p + "ffn_up.weight", (n_ff, n_embd), n_embd)
            weight(p + "ffn_down.weight", (n_embd, n_ff), n_ff, no_write if res.size else None, gain=res_gain)
        if a in ("gemma4", "gemma3"):
            put(p + "post_ffw_norm.weight", (n_embd,), lambda: ones(n_embd) * post)
        if spec.moe:
            def make_router() -> np.ndarray:
                router = np.zeros((n_expert, n_embd), dtype=f32)
                # gemma4 scales its router input by 1/sqrt(n_embd) (ffn_gate_inp.scale = 1 here)
                router[np.arange(n_expert), res] = gain * (f32(np.sqrt(n_embd)) if g4 else f32(1.0))
                return router

            put(p + "ffn_gate_inp.weight", (n_expert, n_embd), make_router, wenc)
            weight(p + "ffn_gate_exps.weight", (n_expert, n_ff_exp, n_embd), n_embd)
            weight(p + "ffn_up_exps.weight", (n_expert, n_ff_exp, n_embd), n_embd)
            weight(p + "ffn_down_exps.weight", (n_expert, n_embd, n_ff_exp), n_ff_exp, no_write)
            if a == "gpt-oss":
                put(p + "ffn_gate_inp.bias", (n_expert,), lambda: np.zeros(n_expert, dtype=f32))
                put(p + "ffn_gate_exps.bias", (n_expert, n_ff_exp),
                    lambda: 0.1 * rng.standard_normal((n_expert, n_ff_exp), dtype=f32))
                put(p + "ffn_up_exps.bias", (n_expert, n_ff_exp),
                    lambda: 0.1 * rng.standard_normal((n_expert, n_ff_exp), dtype=f32))
                put(p + "ffn_down_exps.bias", (n_expert, n_embd),
                    lambda: no_write(0.1 * rng.standard_normal((n_expert, n_embd), dtype=f32), -1))
            if g4:
                put(p + "ffn_gate_inp.scale", (n_embd,), lambda: ones(n_embd))
                put(p + "pre_ffw_norm_2.weight", (n_embd,), lambda: ones(n_embd))
                put(p + "post_ffw_norm_1.weight", (n_embd,), lambda: ones(n_embd))
                put(p + "post_ffw_norm_2.weight", (n_embd,), lambda: ones(n_embd))
        if g4 and n_embd_per_layer:
            npl = int(n_embd_per_layer)
            weight(p + "inp_gate.weight", (npl, n_embd), n_embd)
            weight(p + "proj.weight", (n_embd, npl), npl, no_write if res.size else None)
            put(p + "post_norm.weight", (n_embd,), lambda: ones(n_embd))

    return a, meta, plan
