"""Opening GGUF files and decoding their metadata: the structural checks (magic, truncation) done
before llama.cpp sees a file, typed field values, the tokenizer fingerprint, the tensor table, and
the per-file caches of readers and of the infos parsed from them (:mod:`pyllama_dspark.gguf.info`,
:mod:`pyllama_dspark.gguf.target_info`)."""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from typing import Any, Callable, Dict, Tuple

import numpy as np

from pyllama_dspark.errors import DSparkError, ModelFileError
from pyllama_dspark.gguf import info_store
from pyllama_dspark.gguf.structure import check_structure

__all__ = ["read_gguf", "field_value", "scalar_field", "tokenizer_fingerprint", "n_tokens", "tensor_map",
           "ggml_ne", "check_path", "cached_info"]

GGUF_MAGIC = b"GGUF"

_CACHE_LOCK = threading.Lock()
_READER_CACHE: "OrderedDict[tuple, Any]" = OrderedDict()
_INFO_CACHE: "OrderedDict[tuple, Any]" = OrderedDict()
_CACHE_SIZE = 6
_INFO_CACHE_SIZE = 64   # small records (infos, passed checks), several per model file


def _file_key(path: str) -> tuple:
    st = os.stat(path)
    return (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _cache_get(cache: OrderedDict, key: tuple):
    with _CACHE_LOCK:
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
    return None


def _cache_put(cache: OrderedDict, key: tuple, value, limit: int = _CACHE_SIZE) -> None:
    with _CACHE_LOCK:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > limit:
            cache.popitem(last=False)


def cached_info(kind: str, path: str, use_cache: bool, build: Callable[[], Any], cls: Any = None) -> Any:
    """The info of ``kind`` (``"draft"`` / ``"target"``) parsed from the checked ``path``: cached per
    (kind, real path, inode, size, mtime) unless ``use_cache`` is false, in this process and, for a
    record class ``cls``, on disk for later processes (:mod:`.info_store`); ``build()`` parses it."""
    file_key = _file_key(path)
    key = (kind,) + file_key
    if use_cache:
        cached = _cache_get(_INFO_CACHE, key)
        if cached is not None:
            return cached
        if cls is not None:
            stored = info_store.load(kind, file_key, cls, path)
            if stored is not None:
                _cache_put(_INFO_CACHE, key, stored, _INFO_CACHE_SIZE)
                return stored
    try:
        info = build()
    except DSparkError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
        # a value of an unexpected type (a string block count, ...): the file is broken, not our code
        raise ModelFileError(f"{os.path.basename(path)}: unexpected {kind} GGUF metadata "
                             f"({type(e).__name__}: {e})") from e
    if use_cache:
        _cache_put(_INFO_CACHE, key, info, _INFO_CACHE_SIZE)
        if cls is not None:
            info_store.save(kind, file_key, info)
    return info


def check_path(path) -> str:
    """``path`` as a str, or :class:`ModelFileError` when it is None, not a path, missing or not a file."""
    if path is None:
        raise ModelFileError("no model path given")
    try:
        path = os.fspath(path)
    except TypeError:
        raise ModelFileError(f"model path must be a str or os.PathLike, got {type(path).__name__}") from None
    if not os.path.exists(path):
        raise ModelFileError(f"model file not found: {path!r}")
    if os.path.isdir(path):
        raise ModelFileError(f"model path is a directory, not a GGUF file: {path!r}")
    if not os.path.isfile(path):
        raise ModelFileError(f"model path is not a regular file: {path!r}")
    return path


_READER_CLASS = None


def _reader_class():
    """gguf.GGUFReader whose mapped buffer is held as a plain ndarray view of the memmap.

    GGUFReader slices its ``np.memmap`` once per metadata item; every slice of the memmap
    subclass pays for ``memmap.__array_finalize__``, which makes parsing a 50k-token vocabulary
    take seconds.  Viewing the same mapping as a plain ndarray (same memory, same lifetime) keeps
    the reader's behaviour and is about three times faster.
    """
    global _READER_CLASS
    if _READER_CLASS is None:
        import gguf

        class _PlainViewReader(gguf.GGUFReader):
            @property
            def data(self):
                return self._pyllama_buf

            @data.setter
            def data(self, value):
                self._pyllama_buf = value.view(np.ndarray) if isinstance(value, np.memmap) else value

        _READER_CLASS = _PlainViewReader
    return _READER_CLASS


def read_gguf(path, *, use_cache: bool = True):
    """Open ``path`` with :class:`gguf.GGUFReader` and check it is a complete GGUF file.

    Raises :class:`ModelFileError` for a missing path, a directory, a file that is not GGUF
    (bad magic), a corrupt or truncated header / metadata / tensor table, and a truncated file (any
    tensor's data extending past the end of the file -- the reader memory-maps the file and may
    not notice this itself): :func:`~pyllama_dspark.gguf.structure.check_structure`, before
    gguf-py parses anything.

    Readers are cached per (real path, inode, size, mtime) because parsing a large vocabulary
    takes seconds; pass ``use_cache=False`` for a fresh reader.
    """
    path = check_path(path)
    key = _file_key(path)
    if use_cache:
        cached = _cache_get(_READER_CACHE, key)
        if cached is not None:
            return cached

    size = key[3]
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelFileError(f"cannot read model file {path!r}: {exc}") from exc
    if len(magic) < 4 or magic != GGUF_MAGIC:
        shown = magic[:4]
        raise ModelFileError(
            f"not a GGUF file (bad magic {shown!r}, expected b'GGUF'): {path!r}"
            + (" (empty file)" if size == 0 else ""))

    check_structure(path, size)   # bounds, types, offsets, alignment: what llama.cpp's reader checks
    try:
        reader = _reader_class()(path, "r")
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError,
            MemoryError, OSError, AssertionError, EOFError) as exc:
        raise ModelFileError(
            f"cannot parse GGUF file {path!r} (truncated or corrupt: {type(exc).__name__}: {exc})"
        ) from exc

    if use_cache:
        _cache_put(_READER_CACHE, key, reader)
    return reader


_MISSING = object()


def field_value(reader, key: str, default: Any = _MISSING) -> Any:
    """The value of metadata ``key`` as plain Python (str / int / float / bool / list).

    Strings that are not valid UTF-8 are returned as ``bytes``.  Without ``default`` a missing
    key raises ``KeyError``.
    """
    import gguf

    f = reader.fields.get(key)
    if f is None:
        if default is _MISSING:
            raise KeyError(key)
        return default
    vt = gguf.GGUFValueType
    main = f.types[0] if f.types else None

    def _str(arr) -> Any:
        raw = arr.tobytes()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw

    if main == vt.STRING:
        return _str(f.parts[f.data[0]])
    if main == vt.ARRAY:
        sub = f.types[-1]
        if sub == vt.STRING:
            return [_str(f.parts[i]) for i in f.data]
        if sub == vt.ARRAY:  # nested arrays: not used by any key we read
            return [f.parts[i].tolist() for i in f.data]
        if not f.data:
            return []
        vals = np.concatenate([np.asarray(f.parts[i]).reshape(-1) for i in f.data])
        return [bool(v) for v in vals] if sub == vt.BOOL else vals.tolist()
    arr = np.asarray(f.parts[f.data[0]]).reshape(-1)
    if main == vt.BOOL:
        return bool(arr[0])
    return arr[0].item()


def scalar_field(reader, key: str, default: Any = None, *, kind=int) -> Any:
    """Scalar metadata that llama.cpp also accepts as a per-layer array (``get_key_or_arr``)."""
    v = field_value(reader, key, None)
    if v is None:
        return default
    if isinstance(v, list):
        if not v:
            return default
        v = max(v) if kind in (int, float) else v[0]
    try:
        return kind(v)
    except (TypeError, ValueError):
        raise ModelFileError(f"metadata key {key!r} has an unexpected value {v!r}") from None


def tokenizer_fingerprint(reader) -> str:
    """sha256 (hex) of the tokenizer model name and the ordered token list (raw bytes)."""
    h = hashlib.sha256()
    f = reader.fields.get("tokenizer.ggml.model")
    h.update(f.parts[f.data[0]].tobytes() if f is not None else b"")
    h.update(b"\x00\x01")
    toks = reader.fields.get("tokenizer.ggml.tokens")
    if toks is not None:
        h.update(b"\x00".join(toks.parts[i].tobytes() for i in toks.data))
    return h.hexdigest()


def n_tokens(reader) -> int:
    toks = reader.fields.get("tokenizer.ggml.tokens")
    return len(toks.data) if toks is not None else 0


def tensor_map(reader) -> Dict[str, Any]:
    return {t.name: t for t in reader.tensors}


def ggml_ne(t) -> Tuple[int, ...]:
    """ggml ne (fastest dimension first), as llama.cpp's create_tensor shapes are written."""
    return tuple(int(x) for x in t.shape)

