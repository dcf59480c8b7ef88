"""GGUF access for the numpy reference: a dequantize-on-demand view of one file
(:class:`GGUFFile`, tensors as float32 arrays in numpy order, metadata through
:func:`pyllama_dspark.gguf.info.field_value`), the shared cache of target files
(:func:`open_target`) and :func:`tensor_scalar` for per-tensor scales."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

from pyllama_dspark.gguf.reader import field_value, read_gguf

__all__ = ["Tensor", "GGUFFile", "open_target", "tensor_scalar"]


@dataclass
class Tensor:
    name: str
    type: QT
    data: np.ndarray  # float32 (dequantized) or the raw integer array; numpy shape = ne reversed


_REQUIRED = object()


class GGUFFile:
    """Dequantize-on-demand view of one GGUF file."""

    def __init__(self, path: str) -> None:
        self.path = str(path)
        self.reader = read_gguf(self.path)   # gguf-py's reader, checked and cached
        self._meta = {t.name: t for t in self.reader.tensors}
        self._cache: Dict[str, Tensor] = {}

    def has(self, name: str) -> bool:
        return name in self._meta

    def names(self) -> List[str]:
        return list(self._meta)

    def type(self, name: str) -> QT:
        return QT(self._meta[name].tensor_type)

    def get(self, name: str) -> Tensor:
        if name in self._cache:
            return self._cache[name]
        t = self._meta[name]
        qt = QT(t.tensor_type)
        ne = [int(v) for v in t.shape]
        shape = tuple(reversed(ne))
        if qt in (QT.I8, QT.I16, QT.I32, QT.I64):
            data = np.array(t.data).reshape(shape)
        elif qt == QT.F32:
            data = np.array(t.data, dtype=np.float32).reshape(shape)
        elif qt == QT.F16:
            data = np.asarray(t.data).view(np.float16).astype(np.float32).reshape(shape)
        elif qt == QT.F64:
            data = np.asarray(t.data, dtype=np.float64).astype(np.float32).reshape(shape)
        else:
            data = np.asarray(gguf.quants.dequantize(t.data, qt), dtype=np.float32).reshape(shape)
        out = Tensor(name, qt, data)
        self._cache[name] = out
        return out

    def opt(self, name: str) -> Optional[Tensor]:
        return self.get(name) if self.has(name) else None

    def field(self, key: str, default: Any = _REQUIRED) -> Any:
        """Metadata ``key`` as plain Python; without ``default`` a missing key raises KeyError."""
        if default is _REQUIRED and key not in self.reader.fields:
            raise KeyError(f"GGUF key {key!r} missing")
        return field_value(self.reader, key, None if default is _REQUIRED else default)


_TARGET_CACHE: Dict[tuple, GGUFFile] = {}


def open_target(path: str) -> GGUFFile:
    """Target GGUFs are shared between references (opening one parses its whole tokenizer and the
    dequantized embedding is the largest array here); keyed by path, size and mtime."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    g = _TARGET_CACHE.get(key)
    if g is None:
        if len(_TARGET_CACHE) >= 2:
            _TARGET_CACHE.pop(next(iter(_TARGET_CACHE)))
        g = _TARGET_CACHE[key] = GGUFFile(path)
    return g


def tensor_scalar(t: Optional[Tensor]) -> Optional[float]:
    """The first element of ``t`` as a float (per-tensor scales), None without a tensor."""
    return None if t is None else float(np.asarray(t.data, dtype=np.float64).reshape(-1)[0])
