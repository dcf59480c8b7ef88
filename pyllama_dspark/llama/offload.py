"""How many layers go to the GPU: llama.cpp's ``-ngl N | auto | all``, resolved before a load.

llama.cpp's tools default to ``-ngl auto`` (common/arg.cpp): every layer on the GPU when the model
fits, fewer when it does not, and nothing at all on a build or machine without a GPU.  This module
gives the package the same default, from the public API alone (llama.cpp's fitter lives in its
``common`` library, which llama-cpp-python does not ship):

- ``auto`` with no offload device (no GPU in this build or on this machine, no ``--rpc``): 0, so
  nothing changes on a CPU;
- ``auto`` with devices: all layers when the file, its KV cache and a compute reserve fit the
  devices' free memory (``ggml_backend_dev_memory``), else the share of the layers that fits;
- ``all``: every layer (llama.cpp's ``n_gpu_layers < 0``);
- a number: that many (0 keeps the model on the CPU).
"""

from __future__ import annotations

import ctypes
import os
from typing import Sequence, Union

#: what a model needs beyond its weights and KV cache on a device (compute buffers, CUDA context)
COMPUTE_RESERVE_BYTES = 1 << 30
#: llama.cpp's ``n_gpu_layers`` for "every layer"
ALL_LAYERS = -1

NglValue = Union[int, str]


def parse_n_gpu_layers(value) -> NglValue:
    """``-ngl``'s value as llama.cpp reads it: a count >= 0, ``auto`` or ``all`` (-1 is auto and
    -2 or less all, as in llama.cpp's common_params).  Raises ValueError on anything else."""
    if isinstance(value, bool):
        raise ValueError(f"n_gpu_layers must be a number of layers, 'auto' or 'all', got {value!r}")
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("auto", "all"):
            return v
        try:
            value = int(v)
        except ValueError:
            raise ValueError(f"n_gpu_layers must be a number of layers, 'auto' or 'all', got {value!r}") from None
    if not isinstance(value, int):
        try:
            value = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"n_gpu_layers must be a number of layers, 'auto' or 'all', got {value!r}") from None
    if value == -1:
        return "auto"
    if value <= -2:
        return "all"
    return int(value)


def _dev_free_bytes(devices: Sequence[int]) -> int:
    from pyllama_dspark.llama.rpc import _ggml

    lib = _ggml()
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)]
    lib.ggml_backend_dev_memory.restype = None
    total_free = 0
    for dev in devices:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(ctypes.c_void_p(dev), ctypes.byref(free), ctypes.byref(total))
        total_free += int(free.value)
    return total_free


def _kv_and_layers(path: str, n_ctx: int):
    """(bytes of an F16 KV cache of n_ctx cells, block_count) from the GGUF's metadata."""
    from pyllama_dspark.gguf.reader import field_value, read_gguf, scalar_field

    r = read_gguf(path)
    a = field_value(r, "general.architecture", "llama")
    n_layer = int(field_value(r, f"{a}.block_count", 0) or 0)
    n_embd = int(field_value(r, f"{a}.embedding_length", 0) or 0)
    n_head = int(scalar_field(r, f"{a}.attention.head_count", 0) or 0)
    n_head_kv = int(scalar_field(r, f"{a}.attention.head_count_kv", n_head) or 0)
    head_k = int(scalar_field(r, f"{a}.attention.key_length", (n_embd // n_head) if n_head else 0) or 0)
    head_v = int(scalar_field(r, f"{a}.attention.value_length", head_k) or 0)
    return 2 * n_ctx * n_layer * n_head_kv * (head_k + head_v), n_layer


def layers_that_fit(file_bytes: int, kv_bytes: int, n_layer: int, free_bytes: int,
                    reserve: int = COMPUTE_RESERVE_BYTES) -> int:
    """``auto``'s rule: all layers (:data:`ALL_LAYERS`) when weights + KV + reserve fit
    ``free_bytes``, else the whole layers whose share of weights and KV fits what the reserve
    leaves (the output layer counts as one more, as llama.cpp's n_layer + 1)."""
    if file_bytes + kv_bytes + reserve <= free_bytes:
        return ALL_LAYERS
    per_layer = (file_bytes + kv_bytes) / max(1, n_layer + 1)
    return max(0, min(n_layer, int((free_bytes - reserve) // per_layer))) if per_layer > 0 else 0


def resolve_n_gpu_layers(value: NglValue, path: str, n_ctx: int, devices: Sequence[int]) -> int:
    """The ``n_gpu_layers`` to load ``path`` with, given the offload ``devices`` this process would
    use for it (RPC devices and local GPUs; empty on a CPU)."""
    v = parse_n_gpu_layers(value)
    if isinstance(v, int):
        return v
    if not devices:
        return 0
    if v == "all":
        return ALL_LAYERS
    kv, n_layer = _kv_and_layers(path, n_ctx)
    return layers_that_fit(os.path.getsize(path), kv, n_layer, _dev_free_bytes(devices))
