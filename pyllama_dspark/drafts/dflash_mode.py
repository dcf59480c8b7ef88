"""DFlash mode of a DSpark draft: the same GGUF without the Markov and confidence heads.

llama.cpp tells DSpark from DFlash by the presence of ``markov_w1.weight``
(common/speculative.cpp); without it the draft runs as plain parallel DFlash drafting: block
[anchor, mask x k], drafts read from rows 1.. (the anchor-first layout is a DSpark feature), one
independent argmax per row.  :func:`dflash_mode_draft` writes that copy once (tensors and
metadata byte for byte, minus ``markov_*`` / ``conf_proj.*`` and the DSpark-only keys
``dflash.sample_from_anchor`` / ``dflash.has_confidence_head``) into a cache directory and returns
its path; the copy is rewritten when the source file changes.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional, Union

import numpy as np

from pyllama_dspark import paths
from pyllama_dspark.gguf.reader import read_gguf
from pyllama_dspark.gguf.write import write_gguf

DSPARK_TENSOR_PREFIXES = ("markov_", "conf_proj.")
DSPARK_KEYS = ("dflash.sample_from_anchor", "dflash.has_confidence_head")


def is_dspark_tensor(name: str) -> bool:
    return name.startswith(DSPARK_TENSOR_PREFIXES)


def _field(reader, key: str):
    """(value, vtype, sub_type) of a GGUF field, strings as raw bytes (a lossless copy)."""
    import gguf

    vt = gguf.GGUFValueType
    f = reader.fields[key]
    main = f.types[0]
    if main == vt.STRING:
        return bytes(f.parts[f.data[0]]), main, None
    if main == vt.ARRAY:
        sub = f.types[-1] if len(f.types) > 1 else vt.INT32
        if sub == vt.STRING:
            return [bytes(f.parts[i]) for i in f.data], main, sub
        if sub == vt.ARRAY:
            raise ValueError(f"nested GGUF arrays are not supported (key {key!r})")
        vals = [np.asarray(f.parts[i]).reshape(-1)[0].item() for i in f.data]
        return vals, main, sub
    return np.asarray(f.parts[f.data[0]]).reshape(-1)[0].item(), main, None


def _cache_name(src: Path) -> str:
    st = src.stat()
    h = hashlib.sha1(f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return f"dflash-mode-{src.stem}-{h}.gguf"


def write_dflash_mode(src: Union[str, os.PathLike], dst: Union[str, os.PathLike]) -> str:
    """Write ``dst``: the draft ``src`` with its DSpark heads removed. Returns ``dst``."""
    reader = read_gguf(src)   # checked, cached, and the fast gguf-py reader
    arch_f = reader.fields.get("general.architecture")
    arch = bytes(arch_f.parts[arch_f.data[0]]).decode() if arch_f is not None else ""
    if arch != "dflash":
        raise ValueError(f"{src} is not a DFlash/DSpark draft (general.architecture = {arch!r})")
    meta = {key: _field(reader, key) for key in reader.fields
            if key != "general.architecture" and key not in DSPARK_KEYS and not key.startswith("GGUF.")}
    # t.data is shaped as the writer expects it (quantized types: rows of bytes)
    tensors = {t.name: (np.asarray(t.data), t.tensor_type) for t in reader.tensors if not is_dspark_tensor(t.name)}
    return write_gguf(dst, arch, meta, tensors, tmp_prefix=".dflash-mode-")


def dflash_mode_draft(src: Union[str, os.PathLike], cache_dir: Optional[Union[str, os.PathLike]] = None) -> str:
    """Path of the DFlash-mode copy of DSpark draft ``src`` (written once per source version).

    A draft that already has no Markov head is returned unchanged."""
    src = Path(src)
    reader = read_gguf(src)
    if not any(is_dspark_tensor(t.name) for t in reader.tensors):
        return os.fspath(src)
    del reader
    d = Path(cache_dir) if cache_dir is not None else paths.cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    out = d / _cache_name(src)
    if not out.exists():
        write_dflash_mode(src, out)
    return os.fspath(out)
