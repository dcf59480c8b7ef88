// Concern: llama.cpp's contexts, behind the C ABI (see dspark_shim.h): target capture/decode, draft
// injection and block decode, read-out of llama.cpp's output rows.  Kept small on purpose: Python
// owns the loop.  Every extern "C" entry point runs inside dspark::guard*: no C++ exception crosses
// the C ABI.  The other native files (each header names its one concern): dspark_status.cpp (the
// error message, the guard), dspark_markov.cpp (the Markov graph), dspark_chain.cpp (the sampler
// chain) over dspark_scan.cpp (whole-row scans) and dspark_result.cpp (the kept set written out),
// and dspark_simd.{h,cpp} (the vector kernels' base and their per-ISA dispatch).  This file calls
// down into dspark_status.cpp and dspark_scan.cpp only; nothing calls back into it.
#include "dspark_internal.h"
#include "dspark_scan.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml.h"
#include "gguf.h"
#include "llama.h"

#include <cmath>
#include <cstring>
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

// Staging API of the llama.cpp commit vendored in llama-cpp-python 0.3.36 (src/llama-ext.h, not
// installed).  These are C++ functions exported by libllama; the declarations must match exactly.
LLAMA_API void    llama_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked);
LLAMA_API float * llama_get_embeddings_nextn_ith(struct llama_context * ctx, int32_t i);
LLAMA_API void    llama_set_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid, bool value);
LLAMA_API float * llama_get_embeddings_layer_inp(struct llama_context * ctx, uint32_t lid);

using dspark::fail;
using dspark::ok;
using dspark::gguf_file;

namespace {

// ---- GGUF metadata helpers ----------------------------------------------------------------------

// Integer-like value of a key (any integer or bool type); returns false when absent / not numeric.
bool kv_int(const gguf_context * g, const char * key, int64_t & out) {
    const int64_t id = gguf_find_key(g, key);
    if (id < 0) return false;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT8:  out = gguf_get_val_u8(g, id);  return true;
        case GGUF_TYPE_INT8:   out = gguf_get_val_i8(g, id);  return true;
        case GGUF_TYPE_UINT16: out = gguf_get_val_u16(g, id); return true;
        case GGUF_TYPE_INT16:  out = gguf_get_val_i16(g, id); return true;
        case GGUF_TYPE_UINT32: out = gguf_get_val_u32(g, id); return true;
        case GGUF_TYPE_INT32:  out = gguf_get_val_i32(g, id); return true;
        case GGUF_TYPE_UINT64: out = (int64_t) gguf_get_val_u64(g, id); return true;
        case GGUF_TYPE_INT64:  out = gguf_get_val_i64(g, id); return true;
        case GGUF_TYPE_BOOL:   out = gguf_get_val_bool(g, id) ? 1 : 0; return true;
        case GGUF_TYPE_STRING: {
            const char * s = gguf_get_val_str(g, id);
            if (strcmp(s, "true") == 0)  { out = 1; return true; }
            if (strcmp(s, "false") == 0) { out = 0; return true; }
            return false;
        }
        default: return false;
    }
}

bool kv_int_array(const gguf_context * g, const char * key, std::vector<int64_t> & out) {
    const int64_t id = gguf_find_key(g, key);
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY) return false;
    const size_t n = gguf_get_arr_n(g, id);
    const void * data = gguf_get_arr_data(g, id);
    out.resize(n);
    for (size_t i = 0; i < n; ++i) {
        switch (gguf_get_arr_type(g, id)) {
            case GGUF_TYPE_INT32:  out[i] = ((const int32_t *) data)[i]; break;
            case GGUF_TYPE_UINT32: out[i] = ((const uint32_t *) data)[i]; break;
            case GGUF_TYPE_INT64:  out[i] = ((const int64_t *) data)[i]; break;
            case GGUF_TYPE_UINT64: out[i] = (int64_t) ((const uint64_t *) data)[i]; break;
            case GGUF_TYPE_INT16:  out[i] = ((const int16_t *) data)[i]; break;
            case GGUF_TYPE_UINT16: out[i] = ((const uint16_t *) data)[i]; break;
            default: return false;
        }
    }
    return true;
}

int32_t read_meta(const char * path, dspark_draft_meta * m) {
    if (!path || !m) return fail(DSPARK_E_INVALID, "null argument");
    gguf_file f(path, true);
    if (!f.g) return fail(DSPARK_E_IO, "cannot read GGUF file '%s'", path);
    const gguf_context * g = f.g;
    memset(m, 0, sizeof(*m));

    const int64_t arch_id = gguf_find_key(g, "general.architecture");
    if (arch_id < 0 || gguf_get_kv_type(g, arch_id) != GGUF_TYPE_STRING ||
        strcmp(gguf_get_val_str(g, arch_id), "dflash") != 0) {
        return fail(DSPARK_E_INVALID, "'%s' is not a DFlash/DSpark draft (general.architecture != dflash)", path);
    }
    std::vector<int64_t> layers;
    if (!kv_int_array(g, "dflash.target_layers", layers) || layers.empty()) {
        return fail(DSPARK_E_INVALID, "draft has no dflash.target_layers");
    }
    if (layers.size() > DSPARK_MAX_TARGET_LAYERS) {
        return fail(DSPARK_E_INVALID, "draft lists %zu target layers (max %d)", layers.size(), DSPARK_MAX_TARGET_LAYERS);
    }
    m->n_target_layers = (int32_t) layers.size();
    for (size_t i = 0; i < layers.size(); ++i) m->target_layers[i] = (int32_t) layers[i];

    int64_t v = 0;
    m->block_size    = kv_int(g, "dflash.block_size", v) ? (int32_t) v : 0;
    m->mask_token_id = kv_int(g, "tokenizer.ggml.mask_token_id", v) ? (int32_t) v : -1;
    // llama.cpp: sample_from_anchor defaults to true, causal to false when absent
    m->sample_from_anchor = kv_int(g, "dflash.sample_from_anchor", v) ? (int32_t) (v != 0) : 1;
    m->causal             = kv_int(g, "dflash.attention.causal", v) ? (int32_t) (v != 0) : 0;
    m->n_embd             = kv_int(g, "dflash.embedding_length", v) ? (int32_t) v : 0;

    const int64_t t_w1 = gguf_find_tensor(g, "markov_w1.weight");
    const int64_t t_w2 = gguf_find_tensor(g, "markov_w2.weight");
    m->has_markov = t_w1 >= 0 && t_w2 >= 0;
    if (m->has_markov) {
        const ggml_tensor * w1 = ggml_get_tensor(f.meta, "markov_w1.weight");
        const ggml_tensor * w2 = ggml_get_tensor(f.meta, "markov_w2.weight");
        m->markov_rank   = (int32_t) w1->ne[0];
        m->n_vocab_draft = (int32_t) w2->ne[1];
    }
    const int64_t t_d2t = gguf_find_tensor(g, "d2t");
    m->has_d2t = t_d2t >= 0;
    if (m->has_d2t) {
        m->n_vocab_draft = (int32_t) ggml_get_tensor(f.meta, "d2t")->ne[0];
    }
    // llama.cpp: a missing has_confidence_head key means "has one" when conf_proj is loaded
    const bool conf_key = kv_int(g, "dflash.has_confidence_head", v) ? v != 0 : true;
    m->has_confidence = m->has_markov && conf_key && gguf_find_tensor(g, "conf_proj.weight") >= 0;
    ok();
    return DSPARK_OK;
}

int32_t model_n_embd_of(llama_context * ctx) { return llama_model_n_embd(llama_get_model(ctx)); }

}  // namespace

// ---- misc ---------------------------------------------------------------------------------------

// (these two cannot throw: no guard needed)
extern "C" int32_t dspark_abi_version(void) { return DSPARK_ABI_VERSION; }
extern "C" void * dspark_llama_backend_init_address(void) { return (void *) &llama_backend_init; }

// ---- target -------------------------------------------------------------------------------------

struct dspark_target {
    llama_context *      ctx = nullptr;
    std::vector<int32_t> ids;
    int32_t              n_embd = 0;
    int32_t              n_captured = 0;
    llama_batch          batch = {};
    int32_t              batch_cap = 0;
    ~dspark_target() {
        if (batch.token) llama_batch_free(batch);
    }
};

extern "C" dspark_target * dspark_target_new(llama_context * ctx, const int32_t * layer_ids, int32_t n_ids,
                                             int32_t allow_last) {
    return dspark::guard_ptr<dspark_target>(__func__, [&]() -> dspark_target * {
        if (!ctx) { fail(DSPARK_E_INVALID, "target context is NULL"); return nullptr; }
        if (n_ids < 0 || n_ids > DSPARK_MAX_TARGET_LAYERS || (n_ids > 0 && !layer_ids)) {
            fail(DSPARK_E_INVALID, "need 0..%d target layer ids, got %d", DSPARK_MAX_TARGET_LAYERS, n_ids);
            return nullptr;
        }
        const int32_t n_layer = llama_model_n_layer(llama_get_model(ctx));
        const int32_t max_id  = allow_last ? n_layer : n_layer - 1;
        for (int32_t i = 0; i < n_ids; ++i) {
            if (layer_ids[i] < 0 || layer_ids[i] > max_id) {
                fail(DSPARK_E_INVALID, "target layer id %d out of range 0..%d (target n_layer = %d)", layer_ids[i],
                     max_id, n_layer);
                return nullptr;
            }
        }
        auto t       = std::make_unique<dspark_target>();
        t->ctx       = ctx;
        if (n_ids > 0) t->ids.assign(layer_ids, layer_ids + n_ids);
        t->n_embd    = model_n_embd_of(ctx);
        t->batch_cap = (int32_t) llama_n_batch(ctx);
        t->batch     = llama_batch_init(t->batch_cap, 0, 1);
        for (int32_t id : t->ids) llama_set_embeddings_layer_inp(ctx, (uint32_t) id, true);
        ok();
        return t.release();
    });
}

extern "C" void dspark_target_free(dspark_target * t) {
    // capture stays on the context if it outlives us; turning it off would force a re-reserve
    dspark::guard_void(__func__, [&]() { delete t; });
}

extern "C" int32_t dspark_target_decode(dspark_target * t, const int32_t * tokens, const int32_t * pos,
                                        const int32_t * seq_ids, const int8_t * outputs, int32_t n) {
    return dspark::guard(__func__, [&]() -> int32_t {
        if (!t || !tokens || !pos || !seq_ids || !outputs) return fail(DSPARK_E_INVALID, "null argument");
        if (n <= 0 || n > t->batch_cap) return fail(DSPARK_E_INVALID, "batch of %d rows (must be 1..n_batch=%d)", n, t->batch_cap);
        const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(t->ctx)));
        const int32_t n_seq   = (int32_t) llama_n_seq_max(t->ctx);
        for (int32_t i = 0; i < n; ++i) {
            if (tokens[i] < 0 || tokens[i] >= n_vocab) return fail(DSPARK_E_INVALID, "token %d out of vocab (%d)", tokens[i], n_vocab);
            if (seq_ids[i] < 0 || seq_ids[i] >= n_seq) return fail(DSPARK_E_INVALID, "seq_id %d out of range", seq_ids[i]);
            if (pos[i] < 0) return fail(DSPARK_E_INVALID, "negative position");
            t->batch.token[i]     = tokens[i];
            t->batch.pos[i]       = pos[i];
            t->batch.n_seq_id[i]  = 1;
            t->batch.seq_id[i][0] = seq_ids[i];
            t->batch.logits[i]    = outputs[i] ? 1 : 0;
        }
        t->batch.n_tokens = n;
        t->n_captured     = 0;
        const int32_t rc  = llama_decode(t->ctx, t->batch);
        if (rc < 0) return fail(DSPARK_E_LLAMA, "llama_decode(target) failed with %d", rc);
        if (rc == 0) t->n_captured = n;
        if (rc != 0) return fail(rc, "llama_decode(target) returned %d (no KV slot / aborted)", rc);
        ok();
        return 0;
    });
}

extern "C" int32_t dspark_target_n_captured(const dspark_target * t) { return t ? t->n_captured : 0; }

extern "C" int32_t dspark_target_feature_width(const dspark_target * t) {
    return t ? (int32_t) t->ids.size() * t->n_embd : 0;
}

namespace {
int32_t check_captured(const dspark_target * t, int32_t row0, int32_t n_rows) {
    if (t->ids.empty()) return fail(DSPARK_E_STATE, "capture is not enabled on this target");
    if (t->n_captured <= 0) return fail(DSPARK_E_STATE, "no captured rows: decode on the target through the shim first");
    if (row0 < 0 || n_rows <= 0 || row0 > t->n_captured - n_rows) {
        return fail(DSPARK_E_INVALID, "rows %d..%lld outside the %d captured rows", row0,
                    (long long) row0 + n_rows - 1, t->n_captured);
    }
    return DSPARK_OK;
}
}  // namespace

extern "C" int32_t dspark_target_copy_features(const dspark_target * t, int32_t row0, int32_t n_rows, float * out) {
    return dspark::guard(__func__, [&]() -> int32_t {
        if (!t || !out) return fail(DSPARK_E_INVALID, "null argument");
        const int32_t rc = check_captured(t, row0, n_rows);
        if (rc != DSPARK_OK) return rc;
        const size_t n_embd = (size_t) t->n_embd;
        const size_t width  = t->ids.size() * n_embd;
        for (size_t k = 0; k < t->ids.size(); ++k) {
            const float * layer = llama_get_embeddings_layer_inp(t->ctx, (uint32_t) t->ids[k]);
            if (!layer) return fail(DSPARK_E_STATE, "llama.cpp holds no captured input of layer %d", t->ids[k]);
            for (int32_t i = 0; i < n_rows; ++i) {
                memcpy(out + (size_t) i * width + k * n_embd, layer + (size_t) (row0 + i) * n_embd, n_embd * sizeof(float));
            }
        }
        ok();
        return DSPARK_OK;
    });
}

// ---- read-out -----------------------------------------------------------------------------------

extern "C" int32_t dspark_argmax_rows(llama_context * ctx, int32_t i0, int32_t n, int32_t * ids, float * margin) {
    return dspark::guard(__func__, [&]() -> int32_t {
        if (!ctx || !ids || n <= 0 || i0 < 0) return fail(DSPARK_E_INVALID, "bad argument");
        const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
        for (int32_t r = 0; r < n; ++r) {
            // a row of a sequence with a backend sampler (llama_set_sampler): what the device read
            // out, with no vocabulary-sized row copied: a greedy chain's token (no margin known),
            // or a top-2 chain's two candidates and logits (the larger; a tie to the lower id, as
            // the host scan breaks it)
            const llama_token tok = llama_get_sampled_token_ith(ctx, i0 + r);
            if (tok != LLAMA_TOKEN_NULL) {
                ids[r] = tok;
                if (margin) margin[r] = INFINITY;
                continue;
            }
            if (llama_get_sampled_candidates_count_ith(ctx, i0 + r) == 2 &&
                llama_get_sampled_logits_count_ith(ctx, i0 + r) == 2) {
                const llama_token * c = llama_get_sampled_candidates_ith(ctx, i0 + r);
                const float * l = llama_get_sampled_logits_ith(ctx, i0 + r);
                if (c && l) {
                    const bool first = l[0] > l[1] || (l[0] == l[1] && c[0] < c[1]);
                    ids[r] = first ? c[0] : c[1];
                    if (margin) margin[r] = std::fabs(l[0] - l[1]);
                    continue;
                }
            }
            const float * row = llama_get_logits_ith(ctx, i0 + r);
            if (!row) return fail(DSPARK_E_STATE, "row %d of the last decode has no logits (not an output)", i0 + r);
            dspark::argmax_row_f32(row, n_vocab, ids + r, margin ? margin + r : nullptr);
        }
        ok();
        return DSPARK_OK;
    });
}

// ---- draft --------------------------------------------------------------------------------------

struct dspark_draft {
    llama_context *       ctx = nullptr;
    const dspark_target * target = nullptr;
    dspark_draft_meta     meta = {};
    int32_t               width = 0;     // n_target_layers * n_embd(target)
    int32_t               n_embd = 0;    // draft n_embd (nextn row width)
    int32_t               n_vocab = 0;
    int32_t               n_rows_out = 0;  // rows of the last block decode
    llama_batch_ext *     batch = nullptr;
    int32_t               batch_cap = 0;
    std::vector<float>    buf;           // captured rows on their way to the draft
    ~dspark_draft() {
        if (batch) llama_batch_ext_free(batch);
    }
};

extern "C" int32_t dspark_read_draft_meta(const char * path, dspark_draft_meta * out) {
    return dspark::guard(__func__, [&]() -> int32_t { return read_meta(path, out); });
}

extern "C" dspark_draft * dspark_draft_new(llama_context * dft, const dspark_target * target, const char * path) {
    return dspark::guard_ptr<dspark_draft>(__func__, [&]() -> dspark_draft * {
        if (!dft || !target || !path) { fail(DSPARK_E_INVALID, "null argument"); return nullptr; }
        dspark_draft_meta meta;
        if (read_meta(path, &meta) != DSPARK_OK) return nullptr;
        if ((int32_t) target->ids.size() != meta.n_target_layers) {
            fail(DSPARK_E_INVALID, "target captures %zu layers, draft wants %d", target->ids.size(), meta.n_target_layers);
            return nullptr;
        }
        for (int32_t i = 0; i < meta.n_target_layers; ++i) {
            if (target->ids[i] != meta.target_layers[i]) {
                fail(DSPARK_E_INVALID, "target capture layer %d != draft target layer %d", target->ids[i], meta.target_layers[i]);
                return nullptr;
            }
        }
        if (meta.block_size <= 0) { fail(DSPARK_E_INVALID, "draft has no dflash.block_size"); return nullptr; }
        const llama_model * mdl = llama_get_model(dft);
        if (llama_model_n_embd(mdl) != target->n_embd) {
            fail(DSPARK_E_INVALID, "draft n_embd %d != target n_embd %d", llama_model_n_embd(mdl), target->n_embd);
            return nullptr;
        }
        auto d       = std::make_unique<dspark_draft>();
        d->ctx       = dft;
        d->target    = target;
        d->meta      = meta;
        d->width     = (int32_t) target->ids.size() * target->n_embd;
        d->n_embd    = llama_model_n_embd(mdl);
        d->n_vocab   = llama_vocab_n_tokens(llama_model_get_vocab(mdl));
        d->batch     = llama_batch_ext_init(dft);
        if (!d->batch) { fail(DSPARK_E_LLAMA, "llama_batch_ext_init failed"); return nullptr; }
        d->batch_cap = (int32_t) llama_n_batch(dft);
        llama_set_embeddings_nextn(dft, meta.has_confidence != 0, /*masked*/ true);
        llama_set_causal_attn(dft, meta.causal != 0);
        ok();
        return d.release();
    });
}

extern "C" void dspark_draft_free(dspark_draft * d) {
    dspark::guard_void(__func__, [&]() { delete d; });
}

extern "C" int32_t dspark_draft_get_meta(const dspark_draft * d, dspark_draft_meta * out) {
    if (!d || !out) return fail(DSPARK_E_INVALID, "null argument");
    *out = d->meta;  // a struct copy: cannot throw
    ok();
    return DSPARK_OK;
}

namespace {
int32_t inject_rows(dspark_draft * d, const float * rows, int32_t n, const int32_t * pos, int32_t pos0, int32_t seq_id) {
    const int32_t n_seq = (int32_t) llama_n_seq_max(d->ctx);
    if (seq_id < 0 || seq_id >= n_seq) return fail(DSPARK_E_INVALID, "seq_id %d out of range", seq_id);
    for (int32_t off = 0; off < n; off += d->batch_cap) {
        const int32_t m = std::min(d->batch_cap, n - off);
        llama_batch_ext_clear(d->batch);
        for (int32_t i = 0; i < m; ++i) {
            const float * row = rows + (size_t) (off + i) * d->width;
            llama_embd e = { row, 1, (size_t) d->width };
            const int32_t idx = llama_batch_ext_add_embd(d->batch, seq_id, e);
            if (idx < 0) return fail(DSPARK_E_LLAMA, "llama_batch_ext_add_embd failed (%d)", idx);
            const llama_pos p = pos ? pos[off + i] : pos0 + off + i;
            const llama_pos parr[4] = { p, p, p, 0 };
            llama_batch_ext_set_pos(d->batch, idx, parr);
            llama_batch_ext_set_output_logits(d->batch, idx, false);
        }
        const int32_t rc = llama_process(d->ctx, LLAMA_PROCESS_TYPE_DECODE, d->batch);
        if (rc != 0) return fail(rc < 0 ? DSPARK_E_LLAMA : rc, "llama_process(draft inject) returned %d", rc);
    }
    ok();
    return DSPARK_OK;
}
}  // namespace

extern "C" int32_t dspark_draft_inject(dspark_draft * d, const float * rows, int32_t n, const int32_t * pos, int32_t seq_id) {
    return dspark::guard(__func__, [&]() -> int32_t {
        if (!d || !rows || !pos || n <= 0) return fail(DSPARK_E_INVALID, "bad argument");
        for (int32_t i = 0; i < n; ++i) if (pos[i] < 0) return fail(DSPARK_E_INVALID, "negative position");
        return inject_rows(d, rows, n, pos, 0, seq_id);
    });
}

extern "C" int32_t dspark_draft_inject_captured(dspark_draft * d, int32_t row0, int32_t n, int32_t pos0, int32_t seq_id) {
    return dspark::guard(__func__, [&]() -> int32_t {
        if (!d || n <= 0 || pos0 < 0) return fail(DSPARK_E_INVALID, "bad argument");
        const int32_t chk = check_captured(d->target, row0, n);  // before sizing the buffer
        if (chk != DSPARK_OK) return chk;
        d->buf.resize((size_t) n * d->width);
        const int32_t rc = dspark_target_copy_features(d->target, row0, n, d->buf.data());
        if (rc != DSPARK_OK) return rc;
        return inject_rows(d, d->buf.data(), n, nullptr, pos0, seq_id);
    });
}

extern "C" int32_t dspark_draft_decode_blocks(dspark_draft * d, const int32_t * tokens, int32_t block_len,
                                              const int32_t * pos0, const int32_t * seq_ids, int32_t n_seqs) {
    return dspark::guard(__func__, [&]() -> int32_t {
        if (!d || !tokens || !pos0 || !seq_ids || block_len <= 0 || n_seqs <= 0) return fail(DSPARK_E_INVALID, "bad argument");
        if ((int64_t) block_len * n_seqs > d->batch_cap) {
            return fail(DSPARK_E_INVALID, "%lld block rows exceed the draft n_batch %d", (long long) block_len * n_seqs, d->batch_cap);
        }
        const int32_t n = block_len * n_seqs;
        if (d->meta.has_markov && block_len > d->meta.block_size) {
            // llama.cpp silently skips the Markov head and confidence for longer blocks
            return fail(DSPARK_E_INVALID, "block of %d exceeds the draft's trained block_size %d", block_len, d->meta.block_size);
        }
        const int32_t n_seq = (int32_t) llama_n_seq_max(d->ctx);
        llama_batch_ext_clear(d->batch);
        for (int32_t s = 0; s < n_seqs; ++s) {
            if (seq_ids[s] < 0 || seq_ids[s] >= n_seq) return fail(DSPARK_E_INVALID, "seq_id %d out of range", seq_ids[s]);
            if (pos0[s] < 0) return fail(DSPARK_E_INVALID, "negative position");
            for (int32_t i = 0; i < block_len; ++i) {
                const int32_t tok = tokens[(size_t) s * block_len + i];
                if (tok < 0 || tok >= d->n_vocab) return fail(DSPARK_E_INVALID, "token %d out of vocab", tok);
                const int32_t idx = llama_batch_ext_add_token(d->batch, seq_ids[s], tok);
                if (idx < 0) return fail(DSPARK_E_LLAMA, "llama_batch_ext_add_token failed (%d)", idx);
                const llama_pos p = pos0[s] + i;
                const llama_pos parr[4] = { p, p, p, 0 };
                llama_batch_ext_set_pos(d->batch, idx, parr);
                llama_batch_ext_set_output_logits(d->batch, idx, true);  // hazard: flag every block row
            }
        }
        d->n_rows_out = 0;
        const int32_t rc = llama_process(d->ctx, LLAMA_PROCESS_TYPE_DECODE, d->batch);
        if (rc != 0) return fail(rc < 0 ? DSPARK_E_LLAMA : rc, "llama_process(draft block) returned %d", rc);
        d->n_rows_out = n;
        ok();
        return DSPARK_OK;
    });
}

extern "C" int32_t dspark_draft_confidence(dspark_draft * d, int32_t i0, int32_t n, float * out) {
    return dspark::guard(__func__, [&]() -> int32_t {
        if (!d || !out || i0 < 0 || n <= 0) return fail(DSPARK_E_INVALID, "bad argument");
        if (!d->meta.has_confidence) return fail(DSPARK_E_UNSUPPORTED, "this draft has no confidence head");
        if (i0 > d->n_rows_out - n) return fail(DSPARK_E_STATE, "rows %d..%lld not in the last draft decode (%d rows)", i0, (long long) i0 + n - 1, d->n_rows_out);
        for (int32_t i = 0; i < n; ++i) {
            const float * row = llama_get_embeddings_nextn_ith(d->ctx, i0 + i);
            if (!row) return fail(DSPARK_E_STATE, "no confidence row %d", i0 + i);
            out[i] = row[0];
        }
        ok();
        return DSPARK_OK;
    });
}
