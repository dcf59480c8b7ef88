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
