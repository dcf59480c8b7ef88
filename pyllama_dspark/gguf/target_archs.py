"""The target architectures :func:`pyllama_dspark.gguf.target_writer.make_test_target` writes: one
:class:`ArchSpec` per ``--arch`` value (GGUF architecture, real vocabulary size, default depth,
MoE / sliding-window layers)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, Tuple

from pyllama_dspark.gguf.layer_inputs import LAYER_INPUT_ARCHS

__all__ = ["ArchSpec", "ARCH_SPECS", "TARGET_ARCHS"]


@dataclass(frozen=True)
class ArchSpec:
    name: str            # --arch value
    gguf_arch: str       # general.architecture
    real_n_vocab: int    # the released models' vocabulary size (the default --n-vocab)
    n_layer: int
    moe: bool
    swa: bool
    note: str
    hybrid: bool = False  # recurrent + attention layers (pyllama_dspark.gguf.target_hybrid plans them)

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
    ArchSpec("lfm2", "lfm2", 65536, 6, False, False,
             "LFM2 layout: short-conv layers, attention every 3rd (conv conv attn; 350M: 10 conv + 6 attn "
             "of 16), q/k norms, SwiGLU in every layer", hybrid=True),
    ArchSpec("qwen35", "qwen35", 248320, 6, False, False,
             "Qwen3.5 (dense) layout: Gated DeltaNet layers, gated full attention every 3rd (real: every "
             "4th), partial interleaved M-RoPE", hybrid=True),
    ArchSpec("nemotron_h", "nemotron_h", 131072, 6, False, False,
             "Nemotron-H layout: Mamba-2, attention (no RoPE) and squared-ReLU MLP layers, M * - repeated "
             "(8B: M-M-M-M*-...)", hybrid=True),
    ArchSpec("qwen35moe", "qwen35moe", 248320, 6, True, False,
             "Qwen3.5 MoE (35B-A3B) layout: qwen35's layers with 8 routed experts (2 used) and a gated "
             "shared expert", hybrid=True),
    ArchSpec("qwen3next", "qwen3next", 151936, 6, True, False,
             "Qwen3-Next (80B-A3B) layout: as qwen35moe with plain partial RoPE and a fused beta/alpha "
             "projection", hybrid=True),
    ArchSpec("gemma3", "gemma3", 262144, 4, False, True,
             "Gemma 3: llama.cpp cannot capture its layer inputs (refused; tests the refusal)"),
))
TARGET_ARCHS: Tuple[str, ...] = tuple(ARCH_SPECS)
