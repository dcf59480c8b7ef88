"""Router margins of an MoE target as llama.cpp's own graph computes them: a test diagnostic
(it loads the model and decodes one batch) for the deterministic routing of the random MoE
targets (:mod:`pyllama_dspark.gguf.target_writer`)."""

from __future__ import annotations

import os
from typing import Dict, Optional, Sequence

import numpy as np

from pyllama_dspark.gguf.reader import field_value, read_gguf
from pyllama_dspark.gguf.target_info import read_target_info

__all__ = ["router_margins"]


def router_margins(target_path, tokens: Sequence[int], *, n_threads: Optional[int] = None) -> Dict[int, np.ndarray]:
    """Per MoE layer, per token: the router logit of the last chosen expert minus the best
    unchosen one, as llama.cpp's own graph computes them (``ffn_moe_logits-<il>``, read through
    the eval callback) for ``tokens`` decoded in one batch.  Small margins (<< 1) mean expert
    choices that batch-shape rounding can flip.  Returns ``{layer: float64 [n_tokens]}``.
    """
    import ctypes

    import llama_cpp
    from llama_cpp import llama_cpp as ll

    info = read_target_info(target_path, require_layer_inputs=False)
    r = read_gguf(target_path)
    n_used = field_value(r, f"{info.arch}.expert_used_count", 0) or 0
    n_used = int(max(n_used) if isinstance(n_used, list) else n_used)
    if n_used <= 0:
        raise ValueError(f"{target_path}: not an MoE target (no {info.arch}.expert_used_count)")
    toks = np.ascontiguousarray([int(t) for t in tokens], dtype=np.int32)
    if toks.size == 0:
        raise ValueError("need at least one token")
    if toks.min() < 0 or toks.max() >= info.n_vocab:
        raise ValueError(f"token ids must be in 0..{info.n_vocab - 1}")

    libdir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    gb = ctypes.CDLL(os.path.join(libdir, "libggml-base.so"))
    gb.ggml_get_name.restype = ctypes.c_char_p
    gb.ggml_get_name.argtypes = [ctypes.c_void_p]
    gb.ggml_nelements.restype = ctypes.c_int64
    gb.ggml_nelements.argtypes = [ctypes.c_void_p]
    gb.ggml_nbytes.restype = ctypes.c_size_t
    gb.ggml_nbytes.argtypes = [ctypes.c_void_p]
    gb.ggml_backend_tensor_get.restype = None
    gb.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]

    rows: Dict[int, np.ndarray] = {}
    prefix = b"ffn_moe_logits-"

    def cb(t, ask, _ud):
        name = gb.ggml_get_name(t) or b""
        if not name.startswith(prefix):
            return not ask       # not wanted; after computing: carry on
        if ask:
            return True
        nb = gb.ggml_nbytes(t)
        n = gb.ggml_nelements(t)
        if nb != 4 * n:       # not F32: skip
            return True
        buf = np.empty(n, dtype=np.float32)
        gb.ggml_backend_tensor_get(t, buf.ctypes.data, 0, nb)
        rows[int(name[len(prefix):])] = buf
        return True

    cb_c = ll.ggml_backend_sched_eval_callback(cb)
    ll.llama_backend_init()
    mp = ll.llama_model_default_params()
    model = ll.llama_model_load_from_file(os.fsencode(os.fspath(target_path)), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {target_path}")
    ctx = None
    try:
        cp = ll.llama_context_default_params()
        cp.n_ctx = int(max(256, toks.size + 1))
        cp.n_batch = cp.n_ubatch = int(toks.size)
        cp.cb_eval = cb_c
        cp.cb_eval_user_data = None
        if n_threads:
            cp.n_threads = cp.n_threads_batch = int(n_threads)
        ctx = ll.llama_init_from_model(model, cp)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        # every row an output: the last layer keeps all rows (it otherwise drops non-output rows
        # before its FFN, and its router would see only the last token)
        batch = ll.llama_batch_init(int(toks.size), 0, 1)
        try:
            for i, t in enumerate(toks.tolist()):
                batch.token[i] = t
                batch.pos[i] = i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1
            batch.n_tokens = int(toks.size)
            rc = ll.llama_decode(ctx, batch)
        finally:
            ll.llama_batch_free(batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc})")
    finally:
        if ctx:
            ll.llama_free(ctx)
        ll.llama_model_free(model)
    out: Dict[int, np.ndarray] = {}
    for il, flat in sorted(rows.items()):
        logits = flat.reshape(toks.size, -1).astype(np.float64)          # [n_tokens, n_expert]
        srt = np.sort(logits, axis=1)[:, ::-1]
        out[il] = srt[:, n_used - 1] - srt[:, n_used]
    return out

