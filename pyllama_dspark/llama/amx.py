"""llama.cpp's AMX weight repacking crashes on this commit (Sapphire Rapids class CPUs).

At the llama.cpp commit vendored in llama-cpp-python 0.3.36, a model whose weights were repacked
into the CPU's AMX buffer type segfaults in ``ggml_backend_amx_mul_mat``: on every decode of a
target once ``llama_set_embeddings_layer_inp`` (the capture DSpark reads) is on, and on multi-token
decodes of a plain ``llama_cpp.Llama`` too (upstream: ggml-org/llama.cpp#20824, closed without a
fix).  On a CPU with AMX this package therefore loads models without the extra (repacked) buffer
types, as llama-server's ``--no-repack`` does, and does the same for ``llama_cpp.Llama`` models
loaded after it is imported.  A ``Llama`` loaded before that, with repacked weights, is refused
(when a draft is attached to it) with a clear error instead of a crash.  Nothing changes on CPUs
without AMX.
"""

from __future__ import annotations

import functools
import os
from typing import Set

from pyllama_dspark.errors import DSparkError

_SAFE_MODELS: Set[int] = set()      # llama_model pointers loaded without repacking


@functools.lru_cache(maxsize=1)
def cpu_has_amx() -> bool:
    """True on a CPU with AMX tiles ($PYLLAMA_DSPARK_AMX=0/1 overrides the detection)."""
    env = os.environ.get("PYLLAMA_DSPARK_AMX")
    if env in ("0", "1"):
        return env == "1"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        pass
    return False


_orig = {}


def model_params():
    """``llama_model_default_params()`` with repacking off where AMX would crash with capture."""
    from llama_cpp import llama_cpp as ll

    mp = _orig.get("params", ll.llama_model_default_params)()
    if cpu_has_amx():
        mp.use_extra_bufts = False
    return mp


def check_model(model_ptr) -> None:
    """Refuse to capture on a model that may hold AMX-repacked weights (it would segfault)."""
    if not cpu_has_amx():
        return
    import ctypes

    addr = ctypes.cast(model_ptr, ctypes.c_void_p).value if model_ptr is not None else None
    if addr not in _SAFE_MODELS:
        raise DSparkError(
            "this CPU has AMX and the Llama was loaded with llama.cpp's weight repacking, which crashes "
            "once a draft's layer capture is on (llama.cpp bug at this commit): import pyllama_dspark "
            "before creating the Llama (it then loads models without repacking), or set "
            "PYLLAMA_DSPARK_AMX=0 if you know this model is not repacked")


def _load_recording(path, params):
    import ctypes

    model = _orig["load"](path, params)
    if model and not params.use_extra_bufts:
        _SAFE_MODELS.add(ctypes.cast(model, ctypes.c_void_p).value)
    return model


def install() -> None:
    """Route llama-cpp-python's model loading through :func:`model_params` (AMX CPUs only): every
    model loaded afterwards, by this package or by ``llama_cpp.Llama``, skips repacking."""
    if not cpu_has_amx() or _orig:
        return
    import llama_cpp
    from llama_cpp import llama_cpp as ll

    _orig["params"] = ll.llama_model_default_params
    _orig["load"] = ll.llama_model_load_from_file
    for mod in (ll, llama_cpp):   # the bindings module and the package's re-export of it
        mod.llama_model_default_params = model_params
        mod.llama_model_load_from_file = _load_recording


