"""Real model shapes for ``make-test-target --size``: one :class:`SizeSpec` per (``--arch``,
``--size``), the single source of truth of the numbers (the writer, the CLI choices and the tests
read them from here).

Where the numbers come from:

* Qwen3 0.6B / 1.7B / 4B / 8B: ``config.json`` of ``Qwen/Qwen3-0.6B`` ... ``Qwen/Qwen3-8B`` on
  Hugging Face (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
  ``num_key_value_heads``, ``head_dim``, ``intermediate_size``, ``vocab_size`` 151,936,
  ``tie_word_embeddings`` (true up to 4B, false for 8B), ``rope_theta`` 1e6, ``rms_norm_eps`` 1e-6,
  ``max_position_embeddings`` 40,960).
* Llama 3.2 1B / 3B: ``config.json`` of ``meta-llama/Llama-3.2-1B`` / ``-3B`` (``vocab_size``
  128,256, tied, ``rope_theta`` 500,000, ``rms_norm_eps`` 1e-5, ``max_position_embeddings``
  131,072).  Their ``rope_scaling`` (llama3, factor 32) becomes a ``rope_freqs`` tensor in real GGUFs;
  it is not written here (no shape or cost that matters: RoPE without it).
* Gemma 4 12B (``google/gemma-4-12B-it``, ``gemma4_unified``, released 2026-05): its
  ``text_config`` as quoted verbatim by public code that parses it (``hidden_size`` 3840,
  ``intermediate_size`` 15360, ``num_hidden_layers`` 48, ``num_attention_heads`` 16,
  ``num_key_value_heads`` 8, ``num_global_key_value_heads`` 1, ``head_dim`` 256, ``global_head_dim``
  512, ``attention_k_eq_v`` true, ``sliding_window`` 1024, ``vocab_size`` 262,144,
  ``num_kv_shared_layers`` 0, ``hidden_size_per_layer_input`` 0, ``layer_types`` five
  ``sliding_attention`` then one ``full_attention``, ``rope_parameters`` full 1e6 (proportional,
  ``partial_rotary_factor`` 0.25) / sliding 1e4, ``max_position_embeddings`` 262,144,
  ``final_logit_softcapping`` 30, tied embeddings); the model card gives 11.95B parameters (text
  decoder plus its small vision / audio embedders).  How llama.cpp at our commit turns them into
  GGUF keys: ``conversion/gemma.py`` (``Gemma4Model.set_gguf_parameters``: ``head_count_kv`` per
  layer, ``key_length`` = ``global_head_dim``, ``key_length_swa`` = ``head_dim``,
  ``rope.dimension_count`` = ``global_head_dim``, ``shared_kv_layers``,
  ``embedding_length_per_layer_input`` 0); ``src/models/gemma4.cpp`` reads them (no ``attn_v``: K is
  used as V, which is ``attention_k_eq_v``; no per-layer embeddings when their width is 0).  Its
  model-type table has no 48-layer entry (E2B 35, E4B 42, 26B-A4B 30, 31B 60 layers), which only
  affects the printed size label.
* Qwen3.5 4B (``Qwen/Qwen3.5-4B``, arch ``qwen35``), its text backbone (the vision tower is not
  written): 32 layers, hidden 2560, FFN 9216, 16 attention heads, 4 KV heads of 256, gated attention,
  partial RoPE 0.25 with base 1e7, RMS eps 1e-6, vocabulary 248,320 -- the Megatron arguments of
  slime's ``scripts/models/qwen3.5-4B.sh`` (``z76316/slime-n`` carries the file that THUDM/slime's
  sources), whose missing ``--untie-embeddings-and-output-weights`` (the 27B script has it) is read as
  tied embeddings; Gated DeltaNet 16 key / 32 value heads of 128, conv kernel 4, one full-attention
  layer in every 4 (8 of 32) -- a public comparison table of the 4B and 27B ``config.json`` files, and
  the same numbers as the class defaults of transformers' ``Qwen3_5TextConfig`` (head sizes 128,
  kernel 4, interval 4).  About 4.2B parameters so counted.
* Nemotron-H 8B (``nvidia/Nemotron-H-8B-Base-8K``, arch ``nemotron_h``): its ``config.json`` as
  NVIDIA-NeMo/Megatron-Bridge's ``tests/unit_tests/models/nemotronh/test_nemotron_h_bridge.py`` copies
  it (``nemotronh_8b_config_dict``): 52 layers by ``hybrid_override_pattern``
  ``M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-`` (24 Mamba-2, 4 attention, 24 MLP), hidden
  4096, 32 attention heads, 8 KV heads of 128, squared-ReLU MLP of 21504, Mamba-2 128 heads of 64
  (expand 2), state 128, 8 groups, conv kernel 4, eps 1e-5, vocabulary 131,072, untied.  About 8.1B
  parameters so counted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional, Tuple

import numpy as np

__all__ = ["SizeSpec", "TARGET_SIZES", "ALL_SIZES", "sizes_for", "get_size", "is_full_layer", "RandomPool",
           "uniform_chunks", "TARGET_TYPES"]

_CHUNK = 1 << 20          # elements per generated chunk (2 MiB of F16)
_POOL = 1 << 23           # the random pool of the --size targets (8M numbers)


@dataclass(frozen=True)
class SizeSpec:
    arch: str                 # --arch value (pyllama_dspark.gguf.target_archs.ARCH_SPECS)
    size: str                 # --size value
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int            # KV heads (of the sliding-window layers for gemma4)
    head_dim: int             # head size (of the sliding-window layers for gemma4)
    n_ff: int
    n_vocab: int
    tied: bool                # output matrix = token embeddings (no output.weight)
    rope_theta: float
    rms_eps: float
    context_length: int
    # gemma4: every `swa_period`-th layer (and the last) is a full-attention layer with its own
    # head size / KV heads, K used as V there (no attn_v); sliding window `n_swa`
    swa_period: int = 0
    head_dim_full: int = 0
    n_head_kv_full: int = 0
    k_eq_v: bool = False
    n_swa: int = 0
    rope_theta_swa: float = 0.0
    final_logit_softcapping: float = 0.0
    # qwen35: Gated DeltaNet key / value heads and their head size, one full-attention layer every
    # `attn_interval` (the others Gated DeltaNet)
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_head_dim: int = 0
    attn_interval: int = 0
    # nemotron_h: Mamba-2 head size, state size and groups, and the hybrid_override_pattern
    mamba_head_dim: int = 0
    mamba_d_state: int = 0
    mamba_groups: int = 0
    layer_pattern: str = ""


_Q3 = dict(arch="qwen3", n_vocab=151936, rope_theta=1e6, rms_eps=1e-6, context_length=40960, head_dim=128)
_L32 = dict(arch="llama", n_vocab=128256, tied=True, rope_theta=500000.0, rms_eps=1e-5, context_length=131072)

TARGET_SIZES: "OrderedDict[Tuple[str, str], SizeSpec]" = OrderedDict(((s.arch, s.size), s) for s in (
    # Qwen/Qwen3-*/config.json
    SizeSpec(size="0.6b", n_layer=28, n_embd=1024, n_head=16, n_head_kv=8, n_ff=3072, tied=True, **_Q3),
    SizeSpec(size="1.7b", n_layer=28, n_embd=2048, n_head=16, n_head_kv=8, n_ff=6144, tied=True, **_Q3),
    SizeSpec(size="4b", n_layer=36, n_embd=2560, n_head=32, n_head_kv=8, n_ff=9728, tied=True, **_Q3),
    SizeSpec(size="8b", n_layer=36, n_embd=4096, n_head=32, n_head_kv=8, n_ff=12288, tied=False, **_Q3),
    # meta-llama/Llama-3.2-*/config.json
    SizeSpec(size="1b", n_layer=16, n_embd=2048, n_head=32, n_head_kv=8, head_dim=64, n_ff=8192, **_L32),
    SizeSpec(size="3b", n_layer=28, n_embd=3072, n_head=24, n_head_kv=8, head_dim=128, n_ff=8192, **_L32),
    # google/gemma-4-12B-it config.json text_config (see the module docstring)
    SizeSpec(arch="gemma4", size="12b", n_layer=48, n_embd=3840, n_head=16, n_head_kv=8, head_dim=256,
             n_ff=15360, n_vocab=262144, tied=True, rope_theta=1e6, rms_eps=1e-6, context_length=262144,
             swa_period=6, head_dim_full=512, n_head_kv_full=1, k_eq_v=True, n_swa=1024,
             rope_theta_swa=10000.0, final_logit_softcapping=30.0),
    # Qwen/Qwen3.5-4B text backbone (see the module docstring)
    SizeSpec(arch="qwen35", size="4b", n_layer=32, n_embd=2560, n_head=16, n_head_kv=4, head_dim=256, n_ff=9216,
             n_vocab=248320, tied=True, rope_theta=1e7, rms_eps=1e-6, context_length=262144,
             linear_k_heads=16, linear_v_heads=32, linear_head_dim=128, attn_interval=4),
    # nvidia/Nemotron-H-8B-Base-8K config.json (see the module docstring)
    SizeSpec(arch="nemotron_h", size="8b", n_layer=52, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_ff=21504,
             n_vocab=131072, tied=False, rope_theta=10000.0, rms_eps=1e-5, context_length=8192,
             mamba_head_dim=64, mamba_d_state=128, mamba_groups=8,
             layer_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"),
))

#: ``make-test-target --type`` values: the type of every weight matrix (quantized by llama.cpp:
#: :mod:`pyllama_dspark.llama.quantize`, whose ``QUANT_TYPES`` maps them to its file types)
TARGET_TYPES: Tuple[str, ...] = ("f16", "q8_0", "q4_0", "q4_k_m")

#: every --size value (the CLI's choices; which arch takes which: :func:`sizes_for`)
ALL_SIZES: Tuple[str, ...] = tuple(OrderedDict.fromkeys(s for _, s in TARGET_SIZES))


def sizes_for(arch: str) -> Tuple[str, ...]:
    """The ``--size`` values of ``arch`` (empty when it has none)."""
    return tuple(s for a, s in TARGET_SIZES if a == arch)


def get_size(arch: str, size: str) -> SizeSpec:
    """The :class:`SizeSpec` of (``arch``, ``size``); ValueError naming the valid sizes otherwise."""
    spec = TARGET_SIZES.get((arch, str(size).lower()))
    if spec is None:
        ok = sizes_for(arch)
        raise ValueError(f"no size {size!r} for arch {arch!r}; " + (
            f"choose one of {', '.join(ok)}" if ok else
            "--size exists for " + ", ".join(f"{a} ({'/'.join(sizes_for(a))})"
                                              for a in OrderedDict.fromkeys(a for a, _ in TARGET_SIZES))))
    return spec


def is_full_layer(spec: SizeSpec, il: int, n_layer: Optional[int] = None) -> bool:
    """gemma4: whether layer ``il`` is a full-attention layer (every ``swa_period``-th, and the last)."""
    n = spec.n_layer if n_layer is None else n_layer
    return bool(spec.swa_period) and ((il + 1) % spec.swa_period == 0 or il == n - 1)


# ---- cheap random numbers for targets this large (8e9 normals would take minutes here)

class RandomPool:
    """Cheap random rows for the --size targets: windows of one N(0, 1) pool at random offsets
    (scaled copies cached per std), F16, no copy until written."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.base = None          # drawn at the first write (planning alone costs nothing)
        self.scaled = {}

    def chunks(self, shape: Tuple[int, ...], std: float) -> Iterable[np.ndarray]:
        pool = self.scaled.get(std)
        if pool is None:
            if self.base is None:
                self.base = self.rng.standard_normal(_POOL, dtype=np.float32)
            pool = self.scaled[std] = (self.base * np.float32(std)).astype(np.float16)
        cols = int(shape[-1])
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        per = max(1, _CHUNK // cols)
        for r0 in range(0, rows, per):
            n = min(per, rows - r0) * cols
            off = int(self.rng.integers(0, _POOL - n + 1))
            yield pool[off:off + n].reshape(-1, cols)


def uniform_chunks(rng: np.random.Generator, shape: Tuple[int, ...], std: float) -> Iterable[np.ndarray]:
    """Fresh uniform numbers of standard deviation ``std``, in row blocks."""
    a = np.float32(std * np.sqrt(3.0))
    cols = int(shape[-1])
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    per = max(1, _CHUNK // cols)
    for r0 in range(0, rows, per):
        u = rng.random((min(per, rows - r0), cols), dtype=np.float32)
        u *= 2 * a
        u -= a
        yield u
