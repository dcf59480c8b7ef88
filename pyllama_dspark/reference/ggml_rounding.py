"""ggml-cpu's deterministic roundings, for
:class:`~pyllama_dspark.reference.model.DraftReference` with ``emulate_ggml=True``: the type
activations are converted to before a mat-mul (:func:`vec_dot_type`), that conversion
(:func:`round_activations`) and the F16 / BF16 roundings of the KV cache and the flash-attention
accumulator (:func:`round_f16`, :func:`round_bf16`).

Results are float64 arrays holding the rounded values exactly."""

from __future__ import annotations

from typing import Optional

import numpy as np

from gguf import GGMLQuantizationType as QT

__all__ = ["vec_dot_type", "round_activations", "round_f16", "round_bf16"]

# ggml-cpu type_traits_cpu[type].vec_dot_type: the type the *activations* are converted to before
# a mat-mul against a weight of this type (ggml-cpu.c).
_VEC_DOT_TYPE = {
    QT.F32: QT.F32,
    QT.F16: QT.F16,
    QT.BF16: QT.BF16,
    QT.Q4_0: QT.Q8_0,
    QT.Q4_1: QT.Q8_1,
    QT.Q5_0: QT.Q8_0,
    QT.Q5_1: QT.Q8_1,
    QT.Q8_0: QT.Q8_0,
    QT.Q8_1: QT.Q8_1,
    QT.MXFP4: QT.Q8_0,
    QT.NVFP4: QT.Q8_0,
    QT.IQ4_NL: QT.Q8_0,
    QT.Q2_K: QT.Q8_K,
    QT.Q3_K: QT.Q8_K,
    QT.Q4_K: QT.Q8_K,
    QT.Q5_K: QT.Q8_K,
    QT.Q6_K: QT.Q8_K,
    QT.IQ2_XXS: QT.Q8_K,
    QT.IQ2_XS: QT.Q8_K,
    QT.IQ2_S: QT.Q8_K,
    QT.IQ3_XXS: QT.Q8_K,
    QT.IQ3_S: QT.Q8_K,
    QT.IQ1_S: QT.Q8_K,
    QT.IQ1_M: QT.Q8_K,
    QT.IQ4_XS: QT.Q8_K,
    QT.TQ1_0: QT.Q8_K,
    QT.TQ2_0: QT.Q8_K,
}
if hasattr(QT, "Q1_0"):
    _VEC_DOT_TYPE[QT.Q1_0] = QT.Q8_0



def vec_dot_type(weight_type: QT) -> Optional[QT]:
    """The type ggml's CPU backend converts activations to for a mat-mul with ``weight_type``."""
    return _VEC_DOT_TYPE.get(weight_type)


def round_f16(x: np.ndarray) -> np.ndarray:
    # values above 65504 become inf, as in ggml (hazard 9: an F16 fc.weight overflows)
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float64)


def round_bf16(x: np.ndarray) -> np.ndarray:
    # round-to-nearest-even on the upper 16 bits of the float32 pattern (ggml_compute_fp32_to_bf16)
    f = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    u = f.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    out = (u << 16).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(f), f, out).astype(np.float64)


def _round_q8_0(x: np.ndarray) -> np.ndarray:
    """Values of quantize_row_q8_0 (x86 path): per 32 elements d = amax/127 (stored as f16),
    q = rint(x * 127/amax)."""
    f = np.asarray(x, dtype=np.float32)
    shp = f.shape
    if shp[-1] % 32:
        raise ValueError("Q8_0 activation rounding needs a multiple of 32 columns")
    b = f.reshape(-1, 32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        d = amax / np.float32(127.0)
        inv = np.where(amax != 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(b * inv)
    d16 = d.astype(np.float16).astype(np.float64)
    return (q.astype(np.float64) * d16).reshape(shp)


def _round_q8_k(x: np.ndarray) -> np.ndarray:
    """Values of quantize_row_q8_K_ref: per 256 elements iscale = -127/max (signed max by |x|),
    q = min(127, rint(iscale*x)), d = 1/iscale (float32)."""
    f = np.asarray(x, dtype=np.float32)
    shp = f.shape
    if shp[-1] % 256:
        raise ValueError("Q8_K activation rounding needs a multiple of 256 columns")
    b = f.reshape(-1, 256)
    idx = np.abs(b).argmax(axis=1)
    mx = b[np.arange(b.shape[0]), idx][:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(mx != 0, np.float32(-127.0) / mx, np.float32(0.0)).astype(np.float32)
        d = np.where(mx != 0, np.float32(1.0) / iscale, np.float32(0.0)).astype(np.float32)
    q = np.minimum(127.0, np.rint(iscale * b))
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(shp)


def round_activations(x: np.ndarray, act_type: Optional[QT]) -> np.ndarray:
    """Round activations the way ggml-cpu converts them to ``act_type`` (a vec_dot_type)."""
    if act_type is None or act_type == QT.F32:
        return np.asarray(x, dtype=np.float64)
    if act_type == QT.F16:
        return round_f16(x)
    if act_type == QT.BF16:
        return round_bf16(x)
    if act_type in (QT.Q8_0, QT.Q8_1):
        # Q8_1 carries the same quantized values as Q8_0 (plus a block sum used by *_1 weights)
        return _round_q8_0(x)
    if act_type == QT.Q8_K:
        return _round_q8_k(x)
    raise NotImplementedError(f"activation rounding for {act_type!r}")
