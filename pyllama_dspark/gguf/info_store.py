"""What a model file's metadata says, kept on disk across processes.

Parsing a GGUF's metadata with gguf-py walks every entry of the tokenizer's arrays: about 0.6 s for
a 49k-token vocabulary on this CPU, paid by every process that opens the file (every ``run``, twice
with a draft).  The infos parsed from a file (:class:`~.target_info.TargetInfo`,
:class:`~.info.DraftInfo`: flat records of numbers, strings and tuples) are kept as JSON, one file
per (kind, real path, device, inode, size, mtime), so a later process reads them in a millisecond.  A
file that changed has another key and is parsed again; an entry that cannot be read or does not fit
the record's fields is ignored and rewritten.

The folder is set by the layer that knows where the cache lives (:mod:`pyllama_dspark.paths`
calls :func:`use_folder`); without one nothing is stored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

#: entries kept (the oldest go first): test drafts and conversions come and go
MAX_ENTRIES = 256
#: bumped when what a parse produces changes without the record's fields changing
FORMAT = 1

_folder: Optional[Callable[[], Path]] = None


def use_folder(folder: Optional[Callable[[], Path]]) -> None:
    """Keep infos under ``folder()`` (called when first needed), or nowhere (None)."""
    global _folder
    _folder = folder


def _entry(kind: str, key: tuple, cls) -> Optional[Path]:
    if _folder is None:
        return None
    fields = ",".join(f.name for f in dataclasses.fields(cls))
    h = hashlib.sha1(repr((FORMAT, kind, key, cls.__name__, fields)).encode()).hexdigest()[:20]
    return _folder() / "gguf-info" / f"{kind}-{h}.json"


def load(kind: str, key: tuple, cls, path: str) -> Optional[Any]:
    """The ``cls`` record stored for the file ``key`` (its ``path`` field set to ``path``), or None."""
    try:
        entry = _entry(kind, key, cls)
        if entry is None or not entry.is_file():
            return None
        data = json.loads(entry.read_text())
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            return None
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        values["path"] = path
        return cls(**values)
    except (OSError, ValueError, TypeError):
        return None


def save(kind: str, key: tuple, info) -> None:
    """Store ``info`` (a dataclass record) for the file ``key``; a failure to write is ignored."""
    try:
        entry = _entry(kind, key, type(info))
        if entry is None:
            return
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(dataclasses.asdict(info), f)
        os.replace(tmp, entry)
        _prune(entry.parent)
    except (OSError, TypeError, ValueError):
        return


def _prune(folder: Path) -> None:
    entries = list(folder.glob("*.json"))
    if len(entries) <= MAX_ENTRIES:
        return
    entries.sort(key=lambda p: p.stat().st_mtime)
    for p in entries[:len(entries) - MAX_ENTRIES]:
        try:
            p.unlink()
        except OSError:
            pass
