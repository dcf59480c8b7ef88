"""Process-wide llama.cpp setup and the checks before a model is loaded: the backend is
initialised once, the default thread count, and the cheap GGUF file checks that keep llama.cpp from
aborting on a bad path or file."""

from __future__ import annotations

import os
import threading

from llama_cpp import llama_cpp as ll
from llama_cpp import _logger as _ll_logger

from pyllama_dspark.errors import ModelFileError

_backend_lock = threading.Lock()
_backend_ready = False


def ensure_backend(verbose: bool) -> None:
    global _backend_ready
    _ll_logger.set_verbose(verbose)
    with _backend_lock:
        if not _backend_ready:
            ll.llama_backend_init()
            _backend_ready = True


def default_threads() -> int:
    """Like llama.cpp: all cores for batches; leaves the machine usable on a 2-core box."""
    return max(1, os.cpu_count() or 1)


def check_gguf_file(path: str) -> str:
    """Cheap checks before llama_model_load_from_file (which aborts on some bad files)."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise ModelFileError(f"model file not found: {p}")
    if os.path.isdir(p):
        raise ModelFileError(f"model path is a directory, not a GGUF file: {p}")
    from pyllama_dspark.gguf.hparams import check_loadable_file

    # full structural check (magic, truncation), then the metadata / tensor types llama.cpp asserts on
    check_loadable_file(p)
    return p
