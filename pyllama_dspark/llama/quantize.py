"""llama.cpp's own quantizer (``llama_model_quantize``) and the quantized random test targets of
``make-test-target --type``.

:func:`quantize_gguf` converts a GGUF with F32 / F16 weights into F16 / Q8_0 / Q4_0 / Q4_K_M with
llama.cpp's type choice per tensor (Q4_K_M mixes Q4_K / Q6_K, the output matrix gets Q6_K, norms
and routers stay F32, rows that do not fit a block size fall back as ``llama-quantize`` does).
:func:`write_test_target` writes a random target (:mod:`pyllama_dspark.gguf.target_writer`) with F16
weights to a temporary file next to the output, quantizes it, and deletes the temporary file.

While llama.cpp quantizes, it reads its input through a read-only ``mmap`` of the whole file: the
pages it has read stay mapped, and count in the process's resident memory, until it returns (16 GB
for an 8B F16 input).  They are clean file pages, but to keep the resident size honest
:func:`quantize_gguf` drops them from the mapping every ``release_s`` seconds
(``madvise(MADV_DONTNEED)``, Linux; a page read again is read again from the page cache).
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import threading
from typing import Optional

from llama_cpp import llama_cpp as ll

from pyllama_dspark.errors import NativeError
from pyllama_dspark.gguf.target_sizes import TARGET_TYPES

__all__ = ["QUANT_TYPES", "TARGET_TYPES", "QuantizeError", "quantize_gguf", "write_test_target"]

# enum llama_ftype (include/llama.h): the ``--type`` values and their file types
#     LLAMA_FTYPE_MOSTLY_F16           = 1,  // except 1d tensors
#     LLAMA_FTYPE_MOSTLY_Q4_0          = 2,  // except 1d tensors
#     LLAMA_FTYPE_MOSTLY_Q8_0          = 7,  // except 1d tensors
#     LLAMA_FTYPE_MOSTLY_Q4_K_M        = 15, // except 1d tensors
QUANT_TYPES = {
    "f16": ll.LLAMA_FTYPE_MOSTLY_F16,
    "q8_0": ll.LLAMA_FTYPE_MOSTLY_Q8_0,
    "q4_0": ll.LLAMA_FTYPE_MOSTLY_Q4_0,
    "q4_k_m": ll.LLAMA_FTYPE_MOSTLY_Q4_K_M,
}
assert tuple(QUANT_TYPES) == TARGET_TYPES   # the --type values (gguf.target_sizes)

# Bytes of tensor rows llama.cpp keeps in memory at once (its default is 8 GiB).
_MAX_BUF = 256 << 20


class QuantizeError(NativeError):
    """llama.cpp's quantizer failed (a non-zero return of ``llama_model_quantize``)."""


# typedef struct llama_model_quantize_params {
#     int32_t nthread;                      // number of threads to use for quantizing, if <=0 will use
#                                           // std::thread::hardware_concurrency()
#     enum llama_ftype ftype;               // quantize to this llama_ftype
#     enum ggml_type output_tensor_type;    // output tensor type
#     enum ggml_type token_embedding_type;  // token embeddings tensor type
#     bool allow_requantize;                // allow quantizing non-f32/f16 tensors
#     bool quantize_output_tensor;          // quantize output.weight
#     bool only_copy;                       // only copy tensors - ftype, allow_requantize and
#                                           // quantize_output_tensor are ignored
#     bool pure;                            // quantize all tensors to the default type
#     bool keep_split;                      // quantize to the same number of shards
#     bool dry_run;                         // calculate and show the final quantization size without
#                                           // performing quantization
#     const struct llama_model_imatrix_data * imatrix;
#     const struct llama_model_kv_override * kv_overrides;
#     const struct llama_model_tensor_override * tt_overrides;
#     const int32_t * prune_layers;
#     size_t max_buf_size;                  // max bytes of tensor rows kept in memory at once, 0 = default (8 GiB)
# } llama_model_quantize_params;
#
# LLAMA_API struct llama_model_quantize_params llama_model_quantize_default_params(void);
#
# // Returns 0 on success
# LLAMA_API uint32_t llama_model_quantize(
#         const char * fname_inp,
#         const char * fname_out,
#         const llama_model_quantize_params * params);
#
# (llama-cpp-python 0.3.36 binds both: llama_cpp.llama_model_quantize_params is the struct above.)


def _quantize_params(ftype: int, nthread: int) -> "ll.llama_model_quantize_params":
    p = ll.llama_model_quantize_default_params()
    p.nthread = int(nthread)
    p.ftype = int(ftype)
    if hasattr(p, "max_buf_size"):
        p.max_buf_size = _MAX_BUF
    return p


class _MapReleaser:
    """While llama.cpp quantizes ``path``: every ``period`` s, ``madvise(MADV_DONTNEED)`` the
    read-only mappings of that file in this process (their pages leave the resident set; a page
    read again faults back in from the page cache, the file does not change)."""

    _MADV_DONTNEED = 4

    def __init__(self, path: str, period: float):
        self.path = os.path.realpath(path)
        self.period = float(period)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._madvise = None
        if period > 0 and os.path.exists("/proc/self/maps"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                self._madvise = libc.madvise
                self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                self._madvise.restype = ctypes.c_int
            except (OSError, AttributeError):
                self._madvise = None

    def _release(self) -> None:
        try:
            with open("/proc/self/maps") as f:
                lines = f.readlines()
        except OSError:
            return
        for line in lines:
            parts = line.split(None, 5)
            if len(parts) < 6 or parts[5].strip() != self.path or "w" in parts[1]:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            self._madvise(lo, hi - lo, self._MADV_DONTNEED)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._release()

    def __enter__(self) -> "_MapReleaser":
        if self._madvise is not None:
            self._thread = threading.Thread(target=self._run, name="quantize-map-release", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def quantize_gguf(src, dst, qtype: str, *, nthread: Optional[int] = None, verbose: bool = False,
                  release_s: float = 0.5) -> str:
    """Quantize the GGUF ``src`` into ``dst`` as ``qtype`` (one of :data:`QUANT_TYPES`) with
    llama.cpp's ``llama_model_quantize`` on ``nthread`` threads (default: all cores).  ``release_s``:
    how often the pages of ``src`` llama.cpp has read are dropped from this process's resident set
    (0: never).  Raises :class:`QuantizeError` (the return code, and llama.cpp's log with
    ``verbose``) when llama.cpp fails.  Returns ``dst``."""
    from pyllama_dspark.llama.backend import ensure_backend

    if qtype not in QUANT_TYPES:
        raise ValueError(f"quantization type must be one of {', '.join(QUANT_TYPES)}, got {qtype!r}")
    src, dst = os.fspath(src), os.fspath(dst)
    if not os.path.isfile(src):
        raise QuantizeError(f"quantize: input GGUF not found: {src}")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError("quantize: the output must be another file than the input")
    ensure_backend(verbose)
    params = _quantize_params(QUANT_TYPES[qtype], nthread or os.cpu_count() or 1)
    with _MapReleaser(src, release_s):
        rc = ll.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise QuantizeError(f"llama_model_quantize({os.path.basename(src)} -> {qtype}) failed with code {rc}"
                            + ("" if verbose else " (run with verbose=True for llama.cpp's log)"))
    return dst


def write_test_target(out_path, arch: str = "qwen3", *, qtype: Optional[str] = None, nthread: Optional[int] = None,
                      verbose: bool = False, **writer_kwargs) -> str:
    """Write a random-weight target of ``arch`` to ``out_path``
    (:func:`pyllama_dspark.gguf.target_writer.make_test_target` and its keyword arguments: ``size``,
    ``seed``, ``peaked``, ``n_layer``, ...) with every weight matrix of type ``qtype``
    (:data:`TARGET_TYPES`; None: the writer's own encodings).  ``f16`` is written directly; the
    quantized types are written as F16 to a temporary file next to ``out_path`` first, quantized
    by llama.cpp, and the temporary file deleted (also on failure).  Returns ``out_path``."""
    from pyllama_dspark.gguf.target_writer import make_test_target

    out_path = os.fspath(out_path)
    if qtype is None:
        return make_test_target(out_path, arch, **writer_kwargs)
    if qtype not in QUANT_TYPES:
        raise ValueError(f"type must be one of {', '.join(TARGET_TYPES)}, got {qtype!r}")
    if qtype == "f16":
        return make_test_target(out_path, arch, weight_type="f16", **writer_kwargs)
    out_dir = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp_f16 = tempfile.mkstemp(prefix=".target-f16-", suffix=".gguf", dir=out_dir)
    os.close(fd)
    fd, tmp_out = tempfile.mkstemp(prefix=".target-q-", suffix=".gguf", dir=out_dir)
    os.close(fd)
    try:
        make_test_target(tmp_f16, arch, weight_type="f16", **writer_kwargs)
        quantize_gguf(tmp_f16, tmp_out, qtype, nthread=nthread, verbose=verbose)
        os.unlink(tmp_f16)
        os.chmod(tmp_out, 0o644)
        os.replace(tmp_out, out_path)
    finally:
        for p in (tmp_f16, tmp_out):
            try:
                os.unlink(p)
            except OSError:
                pass
    return out_path
