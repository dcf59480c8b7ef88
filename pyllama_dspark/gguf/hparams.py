"""Metadata and tensor types that llama.cpp asserts on (GGML_ASSERT kills the process) instead of
refusing, checked from a parsed GGUF before llama.cpp loads it (found by GGUF fuzzing).

* ``llama_model::load_hparams`` (src/llama-model.cpp at our commit): ``block_count`` in
  1..LLAMA_MAX_LAYERS (512), ``nextn_predict_layers`` <= ``block_count``, the expert counts
  (``expert_count`` <= 1024, ``expert_used_count`` <= it and > 0 exactly when there are
  experts, the expert groups), a known ``rope.scaling.type``;
* the norms' epsilon: ggml's ``rms_norm`` / ``norm`` assert ``eps >= 0`` at the first decode
  (NaN fails it too);
* tensor types: a weight llama.cpp multiplies by needs a CPU dot product (integer types, F64,
  Q8_1 and Q8_K have none: a crash at the first decode), and a 1-D tensor (norm weights, biases,
  scales) is applied by element-wise ops that take F32 only (converters always write them F32).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

from pyllama_dspark.errors import ModelFileError
from pyllama_dspark.gguf.reader import cached_info, field_value, read_gguf

__all__ = ["check_hparams", "check_loadable", "check_loadable_file", "check_tensor_types", "LLAMA_MAX_LAYERS"]

LLAMA_MAX_LAYERS = 512
LLAMA_MAX_EXPERTS = 1024
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
# ggml types without a CPU dot product: Q8_1, Q8_K, I8, I16, I32, I64, F64
NO_WEIGHT_TYPES = {9: "Q8_1", 15: "Q8_K", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64"}
F32 = 0


def _int(r, key: str, name: str, default: Any = None) -> Any:
    v = field_value(r, key, None)
    if v is None:
        return default
    vals = v if isinstance(v, list) else [v]
    if not vals or not all(isinstance(x, int) and not isinstance(x, bool) for x in vals):
        raise ModelFileError(f"{name}: metadata {key!r} must be an integer (or per-layer integers), got {v!r:.80}")
    return max(vals)


def check_hparams(r, arch: str, name: str) -> None:
    """Raise ModelFileError where llama.cpp's load_hparams or the first decode would abort."""
    a = arch
    n_layer = _int(r, f"{a}.block_count", name)
    if n_layer is not None and not 0 < n_layer <= LLAMA_MAX_LAYERS:
        raise ModelFileError(f"{name}: {a}.block_count is {n_layer}, llama.cpp needs 1..{LLAMA_MAX_LAYERS}")
    nextn = _int(r, f"{a}.nextn_predict_layers", name, 0)
    if n_layer is not None and nextn > n_layer:
        raise ModelFileError(f"{name}: {a}.nextn_predict_layers {nextn} exceeds block_count {n_layer}")
    n_expert = _int(r, f"{a}.expert_count", name, 0)
    n_used = _int(r, f"{a}.expert_used_count", name, 0)
    groups = _int(r, f"{a}.expert_group_count", name, 0)
    group_used = _int(r, f"{a}.expert_group_used_count", name, 0)
    if not 0 <= n_expert <= LLAMA_MAX_EXPERTS:
        raise ModelFileError(f"{name}: {a}.expert_count is {n_expert}, llama.cpp needs 0..{LLAMA_MAX_EXPERTS}")
    if n_expert > 0:
        ok = 0 < n_used <= n_expert and 0 <= groups < n_expert and (
            groups <= 1 or (n_expert % groups == 0 and 0 < group_used < groups))
    else:
        ok = n_used == 0 and groups == 0
    if not ok:
        raise ModelFileError(f"{name}: inconsistent expert counts (expert_count {n_expert}, expert_used_count "
                             f"{n_used}, expert_group_count {groups}, expert_group_used_count {group_used})")
    scaling = field_value(r, f"{a}.rope.scaling.type", None)
    if scaling is not None and scaling not in ROPE_SCALING_TYPES:
        raise ModelFileError(f"{name}: {a}.rope.scaling.type {scaling!r} is not one of {', '.join(ROPE_SCALING_TYPES)}")
    for key in (f"{a}.attention.layer_norm_rms_epsilon", f"{a}.attention.layer_norm_epsilon"):
        eps = field_value(r, key, None)
        if eps is None:
            continue
        if isinstance(eps, list) or isinstance(eps, (str, bytes)) or not math.isfinite(float(eps)) or eps < 0:
            raise ModelFileError(f"{name}: {key} is {eps!r:.40}, must be a finite number >= 0 "
                                 f"(ggml's norm asserts eps >= 0)")


def check_loadable(r, name: str) -> None:
    """Both checks, for any GGUF llama.cpp is about to load (the arch from general.architecture)."""
    arch = field_value(r, "general.architecture", None)
    if isinstance(arch, str) and arch:
        check_hparams(r, arch, name)
    check_tensor_types(r, name, int_ok=("d2t",))


@dataclass(frozen=True)
class LoadableFile:
    """The record that a file version passed :func:`check_loadable` (kept across processes)."""
    path: str


def check_loadable_file(path: str) -> None:
    """:func:`check_loadable` on the file ``path`` (structure checked first by
    :func:`~.reader.read_gguf`), once per file version: a version that passed is remembered, in this
    process and on disk (:mod:`.info_store`), so later loads skip parsing its metadata again."""
    name = os.path.basename(path)

    def build() -> LoadableFile:
        check_loadable(read_gguf(path), name)
        return LoadableFile(path)

    cached_info("loadable", path, True, build, LoadableFile)


def check_tensor_types(r, name: str, int_ok: Sequence[str] = ()) -> None:
    """Raise ModelFileError for a tensor llama.cpp cannot compute with (see the module doc).
    ``int_ok``: tensors that hold integers (a draft's ``d2t`` token map)."""
    for t in r.tensors:
        if t.name in int_ok:
            continue
        gtype = int(t.tensor_type)
        if gtype in NO_WEIGHT_TYPES:
            raise ModelFileError(f"{name}: tensor {t.name!r} has ggml type {NO_WEIGHT_TYPES[gtype]}, which llama.cpp "
                                 f"cannot compute with")
        if len(t.shape) == 1 and gtype != F32:
            raise ModelFileError(f"{name}: 1-D tensor {t.name!r} has ggml type {t.tensor_type.name}; llama.cpp "
                                 f"applies it with F32-only element-wise ops (converters write 1-D tensors as F32)")
