"""ctypes prototypes of the native shim (native/dspark_shim.h).

The shim links libllama / libggml by SONAME only, so it must be loaded after ``llama_cpp`` has
loaded its own copies: then both resolve to the same library (checked by ``same_libllama()``).
Only this module and the handle modules (:mod:`handles`, :mod:`draft_meta`) touch ctypes.
"""

from __future__ import annotations

import ctypes
import os
import sys
from ctypes import POINTER, c_char_p, c_double, c_float, c_int8, c_int32, c_void_p
from pathlib import Path

import llama_cpp  # noqa: F401  (loads libllama/libggml first, RTLD_GLOBAL)
from llama_cpp import llama_cpp as _llama

from pyllama_dspark.errors import NativeError

ABI_VERSION = 1
MAX_TARGET_LAYERS = 64

OK = 0
E_INVALID = -1
E_STATE = -2
E_LLAMA = -3
E_IO = -4
E_UNSUPPORTED = -5
E_INTERNAL = -6   # a C++ exception caught at the shim's C boundary (out of memory, ...)


class DraftMeta(ctypes.Structure):
    # typedef struct dspark_draft_meta {...} dspark_draft_meta;
    _fields_ = [
        ("n_target_layers", c_int32),
        ("target_layers", c_int32 * MAX_TARGET_LAYERS),
        ("block_size", c_int32),
        ("mask_token_id", c_int32),
        ("sample_from_anchor", c_int32),
        ("causal", c_int32),
        ("has_confidence", c_int32),
        ("has_markov", c_int32),
        ("markov_rank", c_int32),
        ("has_d2t", c_int32),
        ("n_vocab_draft", c_int32),
        ("n_embd", c_int32),
    ]


class ChainParams(ctypes.Structure):
    # typedef struct dspark_chain_params {...} dspark_chain_params;
    _fields_ = [
        ("temperature", c_float),
        ("top_k", c_int32),
        ("top_p", c_float),
        ("min_p", c_float),
        ("repeat_penalty", c_float),
        ("frequency_penalty", c_float),
        ("presence_penalty", c_float),
    ]


_SHIM_NAMES = ("libdspark_shim.so", "libdspark_shim.dylib", "dspark_shim.dll")


def _shim_path() -> Path:
    """The built shim: $PYLLAMA_DSPARK_SHIM, next to this module, or in an installed copy of the
    package further down sys.path (a source checkout imported from its root has no build of its own)."""
    override = os.environ.get("PYLLAMA_DSPARK_SHIM")
    if override:
        return Path(override)
    here = Path(__file__).resolve().parent.parent   # installed into the package root
    dirs = [here] + [Path(p) / "pyllama_dspark" for p in sys.path if p]
    for d in dirs:
        for name in _SHIM_NAMES:
            if (d / name).is_file():
                return d / name
    raise NativeError(
        f"the native shim is not installed next to {here} (pip install . builds it); "
        "set PYLLAMA_DSPARK_SHIM to a built libdspark_shim.so to override"
    )


lib = ctypes.CDLL(str(_shim_path()), mode=ctypes.RTLD_GLOBAL)

_p_i32 = POINTER(c_int32)
_p_f32 = POINTER(c_float)
_p_i8 = POINTER(c_int8)
_p_f64 = POINTER(c_double)
_p_meta = POINTER(DraftMeta)
_p_chain = POINTER(ChainParams)


def _proto(name, restype, *argtypes):
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


def _proto_opt(name, restype, *argtypes):
    """An entry point added after ABI 1 (None when the loaded shim predates it: callers fall back)."""
    try:
        return _proto(name, restype, *argtypes)
    except AttributeError:
        return None


# int32_t dspark_abi_version(void);
abi_version = _proto("dspark_abi_version", c_int32)
# const char * dspark_last_error(void);
last_error = _proto("dspark_last_error", c_char_p)
# void * dspark_llama_backend_init_address(void);
llama_backend_init_address = _proto("dspark_llama_backend_init_address", c_void_p)
# int32_t dspark_test_throw(int32_t kind);
test_throw = _proto_opt("dspark_test_throw", c_int32, c_int32)

# dspark_target * dspark_target_new(llama_context * ctx, const int32_t * layer_ids, int32_t n_ids, int32_t allow_last);
target_new = _proto("dspark_target_new", c_void_p, c_void_p, _p_i32, c_int32, c_int32)
# void dspark_target_free(dspark_target * t);
target_free = _proto("dspark_target_free", None, c_void_p)
# int32_t dspark_target_decode(dspark_target * t, const int32_t * tokens, const int32_t * pos,
#                              const int32_t * seq_ids, const int8_t * outputs, int32_t n);
target_decode = _proto("dspark_target_decode", c_int32, c_void_p, _p_i32, _p_i32, _p_i32, _p_i8, c_int32)
# int32_t dspark_target_n_captured(const dspark_target * t);
target_n_captured = _proto("dspark_target_n_captured", c_int32, c_void_p)
# int32_t dspark_target_feature_width(const dspark_target * t);
target_feature_width = _proto("dspark_target_feature_width", c_int32, c_void_p)
# int32_t dspark_target_copy_features(const dspark_target * t, int32_t row0, int32_t n_rows, float * out);
target_copy_features = _proto("dspark_target_copy_features", c_int32, c_void_p, c_int32, c_int32, _p_f32)
# the same entry point, ``out`` as an address (a row inside a buffer the caller grows: no pointer
# object to make per call)
target_copy_features_at = lib["dspark_target_copy_features"]   # a second function object of the symbol
target_copy_features_at.restype = c_int32
target_copy_features_at.argtypes = [c_void_p, c_int32, c_int32, c_void_p]

# int32_t dspark_argmax_rows(llama_context * ctx, int32_t i0, int32_t n, int32_t * ids, float * margin);
argmax_rows = _proto("dspark_argmax_rows", c_int32, c_void_p, c_int32, c_int32, _p_i32, _p_f32)
# int32_t dspark_top_k_f32(const float * x, int32_t n, int32_t k, int32_t * ids);
top_k_f32 = _proto("dspark_top_k_f32", c_int32, _p_f32, c_int32, c_int32, _p_i32)
# int32_t dspark_argmax_f32(const float * x, int32_t n_rows, int32_t n, int32_t * ids, float * margin);
argmax_f32 = _proto_opt("dspark_argmax_f32", c_int32, _p_f32, c_int32, c_int32, _p_i32, _p_f32)

# int32_t dspark_chain_dist(const float * logits, int32_t n_vocab, const dspark_chain_params * params,
#                           const int32_t * window, int32_t n_window, const int32_t * banned, int32_t n_banned,
#                           int32_t * out_ids, double * out_probs, int32_t cap);
# (the arrays as c_void_p: the per-row caller passes cached addresses; ctypes pointers work too)
chain_dist = _proto_opt("dspark_chain_dist", c_int32, c_void_p, c_int32, _p_chain, c_void_p, c_int32, c_void_p,
                        c_int32, c_void_p, c_void_p, c_int32)
# int32_t dspark_chain_dense(const float * logits, int32_t n_vocab, const dspark_chain_params * params,
#                            const int32_t * window, int32_t n_window, const int32_t * banned, int32_t n_banned,
#                            float * out_probs);
chain_dense = _proto_opt("dspark_chain_dense", c_int32, c_void_p, c_int32, _p_chain, c_void_p, c_int32, c_void_p,
                         c_int32, c_void_p)
# int32_t dspark_sample_cdf(const double * probs, int32_t n, double u);
sample_cdf = _proto_opt("dspark_sample_cdf", c_int32, _p_f64, c_int32, c_double)
# int32_t dspark_sample_cdf_f32(const float * probs, int32_t n, double u);
sample_cdf_f32 = _proto_opt("dspark_sample_cdf_f32", c_int32, _p_f32, c_int32, c_double)

# int32_t dspark_read_draft_meta(const char * path, dspark_draft_meta * out);
read_draft_meta = _proto("dspark_read_draft_meta", c_int32, c_char_p, _p_meta)
# dspark_draft * dspark_draft_new(llama_context * dft, const dspark_target * target, const char * path);
draft_new = _proto("dspark_draft_new", c_void_p, c_void_p, c_void_p, c_char_p)
# void dspark_draft_free(dspark_draft * d);
draft_free = _proto("dspark_draft_free", None, c_void_p)
# int32_t dspark_draft_get_meta(const dspark_draft * d, dspark_draft_meta * out);
draft_get_meta = _proto("dspark_draft_get_meta", c_int32, c_void_p, _p_meta)
# int32_t dspark_draft_inject(dspark_draft * d, const float * rows, int32_t n, const int32_t * pos, int32_t seq_id);
draft_inject = _proto("dspark_draft_inject", c_int32, c_void_p, _p_f32, c_int32, _p_i32, c_int32)
# int32_t dspark_draft_inject_captured(dspark_draft * d, int32_t row0, int32_t n, int32_t pos0, int32_t seq_id);
draft_inject_captured = _proto("dspark_draft_inject_captured", c_int32, c_void_p, c_int32, c_int32, c_int32, c_int32)
# int32_t dspark_draft_decode_blocks(dspark_draft * d, const int32_t * tokens, int32_t block_len,
#                                    const int32_t * pos0, const int32_t * seq_ids, int32_t n_seqs);
draft_decode_blocks = _proto("dspark_draft_decode_blocks", c_int32, c_void_p, _p_i32, c_int32, _p_i32, _p_i32, c_int32)
# int32_t dspark_draft_confidence(dspark_draft * d, int32_t i0, int32_t n, float * out);
draft_confidence = _proto("dspark_draft_confidence", c_int32, c_void_p, c_int32, c_int32, _p_f32)

# dspark_markov * dspark_markov_new(const char * draft_path, int32_t use_gpu, int32_t n_threads);
markov_new = _proto("dspark_markov_new", c_void_p, c_char_p, c_int32, c_int32)
# void dspark_markov_free(dspark_markov * m);
markov_free = _proto("dspark_markov_free", None, c_void_p)
# int32_t dspark_markov_rank(const dspark_markov * m);
markov_rank = _proto("dspark_markov_rank", c_int32, c_void_p)
# int32_t dspark_markov_n_vocab(const dspark_markov * m);
markov_n_vocab = _proto("dspark_markov_n_vocab", c_int32, c_void_p)
# int32_t dspark_markov_n_vocab_draft(const dspark_markov * m);
markov_n_vocab_draft = _proto("dspark_markov_n_vocab_draft", c_int32, c_void_p)
# const char * dspark_markov_backend_name(const dspark_markov * m);
markov_backend_name = _proto("dspark_markov_backend_name", c_char_p, c_void_p)
# int32_t dspark_markov_bias(dspark_markov * m, const int32_t * prev, int32_t n, float * out);
markov_bias = _proto("dspark_markov_bias", c_int32, c_void_p, _p_i32, c_int32, _p_f32)
# int32_t dspark_markov_w1_rows(dspark_markov * m, const int32_t * prev, int32_t n, float * out);
markov_w1_rows = _proto("dspark_markov_w1_rows", c_int32, c_void_p, _p_i32, c_int32, _p_f32)
# int32_t dspark_markov_bias_w1(dspark_markov * m, const int32_t * prev, int32_t n, float * out_bias, float * out_w1);
markov_bias_w1 = _proto("dspark_markov_bias_w1", c_int32, c_void_p, _p_i32, c_int32, _p_f32, _p_f32)
# (the arrays of these as c_void_p: the per-row caller passes addresses)
# int32_t dspark_markov_bias_dot(dspark_markov * m, const float * d, const int32_t * rows, int32_t n, float * out);
markov_bias_dot = _proto_opt("dspark_markov_bias_dot", c_int32, c_void_p, c_void_p, c_void_p, c_int32, c_void_p)
# int32_t dspark_markov_candidates(dspark_markov * m, const float * x, int32_t n, const int32_t * t2d, const float * d,
#                                  int32_t top_k, float min_p, const int32_t * forced, int32_t n_forced,
#                                  int32_t * out_ids, float * out_vals, int32_t cap);
markov_candidates = _proto_opt("dspark_markov_candidates", c_int32, c_void_p, c_void_p, c_int32, c_void_p, c_void_p,
                               c_int32, c_float, c_void_p, c_int32, c_void_p, c_void_p, c_int32)
# int32_t dspark_markov_prune_prepare(dspark_markov * m);
markov_prune_prepare = _proto_opt("dspark_markov_prune_prepare", c_int32, c_void_p)

if abi_version() != ABI_VERSION:
    raise NativeError(f"shim ABI {abi_version()} != expected {ABI_VERSION}: reinstall pyllama-dspark")


def error_message() -> str:
    msg = last_error()
    return msg.decode("utf-8", "replace") if msg else "unknown error"


def check(rc: int, what: str) -> int:
    """Raise NativeError for a negative status (or a non-zero llama.cpp code)."""
    if rc != 0:
        raise NativeError(f"{what}: {error_message()} (status {rc})")
    return rc


def check_ptr(ptr, what: str):
    if not ptr:
        raise NativeError(f"{what}: {error_message()}")
    return ptr


def same_libllama() -> bool:
    """True when the shim and llama-cpp-python call into one libllama (same llama_backend_init)."""
    ours = llama_backend_init_address()
    theirs = ctypes.cast(_llama._lib.llama_backend_init, c_void_p).value
    return bool(ours) and ours == theirs


def ptr_i32(a):
    return a.ctypes.data_as(_p_i32)


def ptr_f32(a):
    return a.ctypes.data_as(_p_f32)


def ptr_f64(a):
    return a.ctypes.data_as(_p_f64)


def ptr_i8(a):
    return a.ctypes.data_as(_p_i8)
