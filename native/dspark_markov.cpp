// The DSpark Markov head on a ggml backend (see dspark_shim.h): bias(prev) = W2 . W1[prev], with
// W1 / W2 (and the optional scale) loaded from the draft GGUF onto the first GPU device or the CPU.
#include "dspark_internal.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

using dspark::fail;
using dspark::ok;
using dspark::gguf_file;

struct dspark_markov {
    ggml_backend_t        backend = nullptr;
    ggml_context *        wctx = nullptr;    // weight tensors
    ggml_backend_buffer_t wbuf = nullptr;
    ggml_tensor *         w1 = nullptr;      // ne {rank, n_vocab}
    ggml_tensor *         w2 = nullptr;      // ne {rank, n_vocab_draft}
    ggml_tensor *         w2s = nullptr;     // ne {1} or null
    ggml_gallocr_t        galloc = nullptr;
    std::string           backend_name;
    ~dspark_markov() {
        if (galloc) ggml_gallocr_free(galloc);
        if (wbuf) ggml_backend_buffer_free(wbuf);
        if (wctx) ggml_free(wctx);
        if (backend) ggml_backend_free(backend);
    }
};

namespace {
struct file_closer {
    void operator()(FILE * f) const { fclose(f); }
};
}  // namespace

extern "C" void dspark_markov_free(dspark_markov * m) {
    dspark::guard_void(__func__, [&]() { delete m; });
}

extern "C" dspark_markov * dspark_markov_new(const char * draft_path, int32_t use_gpu, int32_t n_threads) {
    return dspark::guard_ptr<dspark_markov>(__func__, [&]() -> dspark_markov * {
        if (!draft_path) { fail(DSPARK_E_INVALID, "null path"); return nullptr; }
        gguf_file f(draft_path, true);
        if (!f.g) { fail(DSPARK_E_IO, "cannot read GGUF file '%s'", draft_path); return nullptr; }
        const char * names[3] = { "markov_w1.weight", "markov_w2.weight", "markov_w2.scale" };
        ggml_tensor * src[3];
        for (int i = 0; i < 3; ++i) src[i] = ggml_get_tensor(f.meta, names[i]);
        if (!src[0] || !src[1]) { fail(DSPARK_E_UNSUPPORTED, "draft has no Markov head (markov_w1/markov_w2)"); return nullptr; }
        if (src[0]->ne[0] != src[1]->ne[0]) { fail(DSPARK_E_INVALID, "markov_w1/markov_w2 rank mismatch"); return nullptr; }

        auto m = std::make_unique<dspark_markov>();
        if (use_gpu) m->backend = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_GPU, nullptr);
        if (!m->backend) m->backend = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
        if (!m->backend) { fail(DSPARK_E_LLAMA, "no ggml backend available"); return nullptr; }
        m->backend_name = ggml_backend_name(m->backend);
        if (n_threads > 0) {
            ggml_backend_dev_t dev = ggml_backend_get_device(m->backend);
            ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
            auto * set_threads = reg ? (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads") : nullptr;
            if (set_threads) set_threads(m->backend, n_threads);
        }

        ggml_init_params ip = { 4 * ggml_tensor_overhead(), nullptr, /*no_alloc*/ true };
        m->wctx = ggml_init(ip);
        if (!m->wctx) { fail(DSPARK_E_LLAMA, "ggml_init failed"); return nullptr; }
        ggml_tensor ** dst[3] = { &m->w1, &m->w2, &m->w2s };
        for (int i = 0; i < 3; ++i) {
            if (!src[i]) continue;
            *dst[i] = ggml_dup_tensor(m->wctx, src[i]);
            ggml_set_name(*dst[i], names[i]);
        }
        m->wbuf = ggml_backend_alloc_ctx_tensors(m->wctx, m->backend);
        if (!m->wbuf) { fail(DSPARK_E_LLAMA, "cannot allocate Markov weights on %s", m->backend_name.c_str()); return nullptr; }

        std::unique_ptr<FILE, file_closer> fp(fopen(draft_path, "rb"));
        if (!fp) { fail(DSPARK_E_IO, "cannot open '%s'", draft_path); return nullptr; }
        std::vector<uint8_t> tmp;
        const size_t data_off = gguf_get_data_offset(f.g);
        for (int i = 0; i < 3; ++i) {
            if (!src[i]) continue;
            const int64_t tid = gguf_find_tensor(f.g, names[i]);
            const size_t nbytes = ggml_nbytes(src[i]);
            tmp.resize(nbytes);
            if (fseek(fp.get(), (long) (data_off + gguf_get_tensor_offset(f.g, tid)), SEEK_SET) != 0 ||
                fread(tmp.data(), 1, nbytes, fp.get()) != nbytes) {
                fail(DSPARK_E_IO, "truncated tensor data for %s in '%s'", names[i], draft_path);
                return nullptr;
            }
            ggml_backend_tensor_set(*dst[i], tmp.data(), 0, nbytes);
        }
        m->galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(m->backend));
        if (!m->galloc) { fail(DSPARK_E_LLAMA, "cannot create the Markov graph allocator"); return nullptr; }
        ok();
        return m.release();
    });
}

// (plain reads: cannot throw)
extern "C" int32_t dspark_markov_rank(const dspark_markov * m) { return m ? (int32_t) m->w1->ne[0] : 0; }
extern "C" int32_t dspark_markov_n_vocab(const dspark_markov * m) { return m ? (int32_t) m->w1->ne[1] : 0; }
extern "C" int32_t dspark_markov_n_vocab_draft(const dspark_markov * m) { return m ? (int32_t) m->w2->ne[1] : 0; }
extern "C" const char * dspark_markov_backend_name(const dspark_markov * m) { return m ? m->backend_name.c_str() : ""; }

namespace {
struct ggml_ctx_free {
    void operator()(ggml_context * c) const { ggml_free(c); }
};

// Runs get_rows(W1, prev) on the backend and copies it to out_w1 (when given), and W2 . that
// (scaled) to out_bias (when given): one graph, one compute.
int32_t markov_run2(dspark_markov * m, const int32_t * prev, int32_t n, float * out_bias, float * out_w1) {
    if (!m || !prev || (!out_bias && !out_w1) || n <= 0) return fail(DSPARK_E_INVALID, "bad argument");
    const int64_t n_vocab = m->w1->ne[1];
    for (int32_t i = 0; i < n; ++i) {
        if (prev[i] < 0 || prev[i] >= n_vocab) return fail(DSPARK_E_INVALID, "token %d out of vocab (%lld)", prev[i], (long long) n_vocab);
    }
    ggml_init_params ip = { 16 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, /*no_alloc*/ true };
    std::unique_ptr<ggml_context, ggml_ctx_free> owner(ggml_init(ip));
    ggml_context * gctx = owner.get();
    if (!gctx) return fail(DSPARK_E_LLAMA, "ggml_init failed");
    ggml_tensor * ids = ggml_new_tensor_1d(gctx, GGML_TYPE_I32, n);
    ggml_set_input(ids);
    ggml_tensor * rows = ggml_get_rows(gctx, m->w1, ids);  // [rank, n]
    ggml_tensor * w1_out = nullptr;
    ggml_tensor * bias = nullptr;
    ggml_cgraph * gf = ggml_new_graph(gctx);
    if (out_bias) {
        bias = ggml_mul_mat(gctx, m->w2, rows);             // [n_vocab_draft, n]
        if (m->w2s) bias = ggml_mul(gctx, bias, m->w2s);
        ggml_set_output(bias);
        ggml_build_forward_expand(gf, bias);
    }
    if (out_w1) {
        w1_out = rows->type == GGML_TYPE_F32 ? rows : ggml_cast(gctx, rows, GGML_TYPE_F32);
        ggml_set_output(w1_out);
        ggml_build_forward_expand(gf, w1_out);
    }
    if (!ggml_gallocr_alloc_graph(m->galloc, gf)) return fail(DSPARK_E_LLAMA, "cannot allocate the Markov graph");
    ggml_backend_tensor_set(ids, prev, 0, (size_t) n * sizeof(int32_t));
    if (ggml_backend_graph_compute(m->backend, gf) != GGML_STATUS_SUCCESS) return fail(DSPARK_E_LLAMA, "Markov graph compute failed");
    if (bias) ggml_backend_tensor_get(bias, out_bias, 0, ggml_nbytes(bias));
    if (w1_out) ggml_backend_tensor_get(w1_out, out_w1, 0, ggml_nbytes(w1_out));
    ok();
    return DSPARK_OK;
}
}  // namespace

extern "C" int32_t dspark_markov_bias(dspark_markov * m, const int32_t * prev, int32_t n, float * out) {
    return dspark::guard(__func__, [&]() -> int32_t {
        if (!out) return fail(DSPARK_E_INVALID, "bad argument");
        return markov_run2(m, prev, n, out, nullptr);
    });
}

extern "C" int32_t dspark_markov_w1_rows(dspark_markov * m, const int32_t * prev, int32_t n, float * out) {
    return dspark::guard(__func__, [&]() -> int32_t {
        if (!out) return fail(DSPARK_E_INVALID, "bad argument");
        return markov_run2(m, prev, n, nullptr, out);
    });
}

extern "C" int32_t dspark_markov_bias_w1(dspark_markov * m, const int32_t * prev, int32_t n, float * out_bias, float * out_w1) {
    return dspark::guard(__func__, [&]() -> int32_t { return markov_run2(m, prev, n, out_bias, out_w1); });
}
