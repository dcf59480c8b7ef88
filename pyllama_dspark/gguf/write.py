"""The one GGUF writer of this package: metadata/tensor helpers and an atomic file write.

Used by the random-weight draft writer (:mod:`pyllama_dspark.gguf.testing`, and through it the trained
draft export and the cached random drafts of :mod:`pyllama_dspark.paths`), the random-weight target
writer (:mod:`pyllama_dspark.gguf.target_writer`) and :mod:`pyllama_dspark.drafts.dflash_mode`.

Metadata is an ordered ``key -> (value, GGUFValueType, sub_type)`` mapping (``sub_type`` for
arrays); tensors an ordered ``name -> (data, raw_dtype)`` mapping as :func:`encode` returns it
(numpy shapes: the reverse of ggml's ``ne``).  :func:`write_gguf` writes both to a temporary file
in the destination directory and renames it, so a reader never sees a half-written file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Mapping, Sequence, Tuple

import numpy as np

__all__ = ["TENSOR_ENCODINGS", "gauss", "encode", "raw_field", "infer_type", "same_kind_type", "write_gguf"]

#: encodings :func:`encode` understands
TENSOR_ENCODINGS = ("f32", "f16", "bf16", "q8_0", "q4_0", "i64")


def gauss(rng: np.random.Generator, shape: Sequence[int], fan_in: int) -> np.ndarray:
    """N(0, 1/fan_in) weights (std 1/sqrt(fan_in)): activations keep their scale through matmuls."""
    w = rng.standard_normal(size=tuple(shape), dtype=np.float32)
    w *= np.float32(1.0 / np.sqrt(max(1, fan_in)))
    return w


def encode(arr: np.ndarray, kind: str):
    """(data, raw_dtype) for ``GGUFWriter.add_tensor``; ``kind`` one of :data:`TENSOR_ENCODINGS`."""
    import gguf

    if kind == "f32":
        return np.ascontiguousarray(arr, dtype=np.float32), None
    if kind == "f16":
        return np.ascontiguousarray(arr, dtype=np.float16), None
    if kind == "bf16":
        return gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32),
                                    gguf.GGMLQuantizationType.BF16), gguf.GGMLQuantizationType.BF16
    if kind == "i64":
        return np.ascontiguousarray(arr, dtype=np.int64), None
    if kind in ("q8_0", "q4_0"):    # gguf-py's ports of ggml's reference quantizers (bit for bit)
        q = gguf.GGMLQuantizationType.Q8_0 if kind == "q8_0" else gguf.GGMLQuantizationType.Q4_0
        return gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), q), q
    raise ValueError(f"tensor encoding must be one of {TENSOR_ENCODINGS}, got {kind!r}")


def raw_field(reader, key: str) -> Tuple[Any, Any, Any]:
    """(value, vtype, sub_type) of a reader field, strings kept as raw bytes (lossless copy)."""
    import gguf

    vt = gguf.GGUFValueType
    f = reader.fields[key]
    main = f.types[0]
    if main == vt.STRING:
        return f.parts[f.data[0]].tobytes(), main, None
    if main == vt.ARRAY:
        sub = f.types[-1]
        if sub == vt.STRING:
            return [f.parts[i].tobytes() for i in f.data], main, sub
        if sub == vt.ARRAY:
            raise ValueError(f"nested GGUF arrays are not supported (key {key!r})")
        vals = np.concatenate([np.asarray(f.parts[i]).reshape(-1) for i in f.data]) if f.data else np.zeros(0)
        return vals.tolist(), main, sub
    val = np.asarray(f.parts[f.data[0]]).reshape(-1)[0].item()
    return val, main, None


def infer_type(key: str, value: Any) -> Tuple[Any, Any, Any]:
    """(value, vtype, sub_type) for a plain Python value (bool / int / float / str / list)."""
    import gguf

    vt = gguf.GGUFValueType
    if isinstance(value, (bool, np.bool_)):
        return bool(value), vt.BOOL, None
    if isinstance(value, (int, np.integer)):
        return int(value), (vt.UINT32 if int(value) >= 0 else vt.INT32), None
    if isinstance(value, (float, np.floating)):
        return float(value), vt.FLOAT32, None
    if isinstance(value, (str, bytes)):
        return value, vt.STRING, None
    if isinstance(value, (list, tuple, np.ndarray)):
        items = list(value.tolist() if isinstance(value, np.ndarray) else value)
        if not items:
            raise ValueError(f"metadata {key!r}: GGUF arrays cannot be empty")
        first = items[0]
        if isinstance(first, (bool, np.bool_)):
            return [bool(x) for x in items], vt.ARRAY, vt.BOOL
        if isinstance(first, (int, np.integer)):
            return [int(x) for x in items], vt.ARRAY, vt.INT32
        if isinstance(first, (float, np.floating)):
            return [float(x) for x in items], vt.ARRAY, vt.FLOAT32
        if isinstance(first, (str, bytes)):
            return list(items), vt.ARRAY, vt.STRING
    raise ValueError(f"metadata {key!r}: unsupported value {value!r}")


def same_kind_type(value: Any, vtype, sub) -> bool:
    """Whether ``value`` can be written with an existing key's (vtype, sub_type)."""
    import gguf

    vt = gguf.GGUFValueType
    ints = (vt.UINT8, vt.INT8, vt.UINT16, vt.INT16, vt.UINT32, vt.INT32, vt.UINT64, vt.INT64)
    floats = (vt.FLOAT32, vt.FLOAT64)
    if vtype == vt.ARRAY:
        return isinstance(value, (list, tuple)) and len(value) > 0 and same_kind_type(value[0], sub, None)
    if vtype == vt.BOOL:
        return isinstance(value, bool)
    if vtype in ints:
        return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and (
            int(value) >= 0 or vtype in (vt.INT8, vt.INT16, vt.INT32, vt.INT64))
    if vtype in floats:
        return isinstance(value, (float, int, np.floating, np.integer)) and not isinstance(value, bool)
    if vtype == vt.STRING:
        return isinstance(value, (str, bytes))
    return False


@contextlib.contextmanager
def atomic_output(out_path, tmp_prefix: str = ".gguf-"):
    """Yield a temporary path in ``out_path``'s directory (created if missing); on success the file
    becomes mode 0644 (mkstemp makes 0600; a model is an ordinary data file) and is renamed over
    ``out_path``; on any error it is removed."""
    out_path = os.fspath(out_path)
    out_dir = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=tmp_prefix, suffix=".gguf.tmp", dir=out_dir)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o644)
        os.replace(tmp, out_path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_gguf(out_path, arch: str, meta: Mapping[str, Tuple[Any, Any, Any]],
               tensors: Mapping[str, Tuple[Any, Any]], *, tmp_prefix: str = ".gguf-") -> str:
    """Write ``meta`` and ``tensors`` as a GGUF of ``arch`` to ``out_path`` atomically
    (:func:`atomic_output`).  Returns ``out_path`` as a str."""
    import gguf

    out_path = os.fspath(out_path)
    with atomic_output(out_path, tmp_prefix) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        for key, (value, vtype, sub) in meta.items():
            writer.add_key_value(key, value, vtype, sub_type=sub)
        for name, (data, raw_dtype) in tensors.items():
            writer.add_tensor(name, data, raw_dtype=raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return out_path
