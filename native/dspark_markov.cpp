// The DSpark Markov head on a ggml backend (see dspark_shim.h): bias(prev) = W2 . W1[prev], with
// W1 / W2 (and the optional scale) loaded from the draft GGUF onto the first GPU device or the CPU.
#include "dspark_internal.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#    include <immintrin.h>
#endif

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
    // the pruned path's 7-bit copy of scale * W2 (dspark_markov_prune_prepare)
    int64_t               rp = 0;            // rank padded to a multiple of 32 (0: not built)
    std::vector<uint8_t>  q8;                // [n_vocab_draft, rp]: q + 64, q in [-63, 63] (padding: 64)
    std::vector<float>    qs;                // scale * W2[j] ~ qs[j] * q[j], qs[j] >= 0
    std::vector<float>    qa;                // qs[j] * ||q[j]||, rounded up
    std::vector<float>    qe;                // ||scale * W2[j] - qs[j] * q[j]||, rounded up
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

// ---- the bias of a difference vector, on some draft rows or all ----------------------------------

namespace {
// out[i] = scale * W2[rows[i]] . d (i < n), or for every draft row when rows is null: one graph
int32_t bias_dot(dspark_markov * m, const float * d, const int32_t * rows, int32_t n, float * out) {
    const int64_t rank = m->w2->ne[0], nv = m->w2->ne[1];
    for (int32_t i = 0; rows && i < n; ++i) {
        if (rows[i] < 0 || rows[i] >= nv) return fail(DSPARK_E_INVALID, "row %d out of the draft vocab (%lld)", rows[i], (long long) nv);
    }
    ggml_init_params ip = { 16 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, /*no_alloc*/ true };
    std::unique_ptr<ggml_context, ggml_ctx_free> owner(ggml_init(ip));
    ggml_context * gctx = owner.get();
    if (!gctx) return fail(DSPARK_E_LLAMA, "ggml_init failed");
    ggml_tensor * dv = ggml_new_tensor_1d(gctx, GGML_TYPE_F32, rank);
    ggml_set_input(dv);
    ggml_tensor * ids = nullptr;
    ggml_tensor * a   = m->w2;
    if (rows) {
        ids = ggml_new_tensor_1d(gctx, GGML_TYPE_I32, n);
        ggml_set_input(ids);
        a = ggml_get_rows(gctx, m->w2, ids);                 // [rank, n] F32
    }
    ggml_tensor * b = ggml_mul_mat(gctx, a, dv);             // [n or n_vocab_draft]
    if (m->w2s) b = ggml_mul(gctx, b, m->w2s);
    ggml_set_output(b);
    ggml_cgraph * gf = ggml_new_graph(gctx);
    ggml_build_forward_expand(gf, b);
    if (!ggml_gallocr_alloc_graph(m->galloc, gf)) return fail(DSPARK_E_LLAMA, "cannot allocate the Markov graph");
    ggml_backend_tensor_set(dv, d, 0, (size_t) rank * sizeof(float));
    if (ids) ggml_backend_tensor_set(ids, rows, 0, (size_t) n * sizeof(int32_t));
    if (ggml_backend_graph_compute(m->backend, gf) != GGML_STATUS_SUCCESS) return fail(DSPARK_E_LLAMA, "Markov graph compute failed");
    ggml_backend_tensor_get(b, out, 0, ggml_nbytes(b));
    return DSPARK_OK;
}
}  // namespace

extern "C" int32_t dspark_markov_bias_dot(dspark_markov * m, const float * d, const int32_t * rows, int32_t n,
                                          float * out) {
    return dspark::guard(__func__, [&]() -> int32_t {
        if (!m || !d || !out || (rows && n <= 0)) return fail(DSPARK_E_INVALID, "bad argument");
        const int32_t rc = bias_dot(m, d, rows, n, out);
        if (rc == DSPARK_OK) ok();
        return rc;
    });
}

// ---- the pruned re-conditioning: candidates from a 7-bit copy of W2 with a rigorous error bound ---
//
// With d = s_d qd + r (qd in [-127, 127]) and scale * W2[j] = qs[j] q[j] + E[j] (q in [-63, 63]):
//   scale * W2[j] . d - qs[j] s_d (q[j] . qd) = qs[j] q[j] . r + E[j] . d,
// at most qa[j] ||r|| + qe[j] ||d|| in magnitude.  q[j] . qd is an exact integer dot, computed as
// (q[j] + 64) . qd - 64 sum(qd): unsigned x signed bytes, whose pair sums (<= 2 * 127 * 127) fit the
// int16 of AVX2's maddubs.  (4 bits halve the bytes read but cost more to unpack than they save, and
// their looser bound keeps ~20x more candidates.)

namespace {
inline float round_up(double v) { return std::nextafter((float) v, INFINITY); }

// scale as stored (any type ggml can read back), 1 without the tensor
int32_t read_scale(dspark_markov * m, double * out) {
    *out = 1.0;
    if (!m->w2s) return DSPARK_OK;
    std::vector<uint8_t> raw(ggml_nbytes(m->w2s));
    ggml_backend_tensor_get(m->w2s, raw.data(), 0, raw.size());
    float v = 0.0f;
    if (m->w2s->type == GGML_TYPE_F32) {
        std::memcpy(&v, raw.data(), sizeof(v));
    } else {
        const ggml_type_traits * st = ggml_get_type_traits(m->w2s->type);
        if (!st || !st->to_float) return fail(DSPARK_E_UNSUPPORTED, "markov_w2.scale type cannot be read back");
        std::vector<float> f((size_t) ggml_blck_size(m->w2s->type));
        st->to_float(raw.data(), f.data(), (int64_t) f.size());
        v = f[0];
    }
    *out = (double) v;
    return DSPARK_OK;
}

int32_t prune_prepare(dspark_markov * m) {
    if (m->rp > 0) return DSPARK_OK;
    const int64_t rank = m->w2->ne[0], nv = m->w2->ne[1];
    const size_t  rb   = m->w2->nb[1];
    const ggml_type_traits * tt = ggml_get_type_traits(m->w2->type);
    if (m->w2->type != GGML_TYPE_F32 && (!tt || !tt->to_float)) {
        return fail(DSPARK_E_UNSUPPORTED, "markov_w2 type %s cannot be read back", ggml_type_name(m->w2->type));
    }
    double scale;
    const int32_t rc = read_scale(m, &scale);
    if (rc != DSPARK_OK) return rc;
    const int64_t        rp = (rank + 31) / 32 * 32;
    std::vector<uint8_t> q8((size_t) (nv * rp), 64);
    std::vector<float>   qs((size_t) nv), qa((size_t) nv), qe((size_t) nv);
    const int64_t        chunk = std::max<int64_t>(1, (int64_t) ((4u << 20) / rb));  // ~4 MiB per read
    std::vector<uint8_t> raw((size_t) std::min(chunk, nv) * rb);
    std::vector<float>   row((size_t) rank);
    for (int64_t j0 = 0; j0 < nv; j0 += chunk) {
        const int64_t nr = std::min(chunk, nv - j0);
        ggml_backend_tensor_get(m->w2, raw.data(), (size_t) j0 * rb, (size_t) nr * rb);
        for (int64_t jj = 0; jj < nr; ++jj) {
            const int64_t   j   = j0 + jj;
            const uint8_t * src = raw.data() + (size_t) jj * rb;
            if (m->w2->type == GGML_TYPE_F32) {
                std::memcpy(row.data(), src, (size_t) rank * sizeof(float));
            } else {
                tt->to_float(src, row.data(), rank);
            }
            double mx = 0.0;
            for (int64_t c = 0; c < rank; ++c) mx = std::max(mx, std::fabs(scale * (double) row[(size_t) c]));
            const float s  = (float) (mx / 63.0);
            uint8_t *   q  = q8.data() + (size_t) (j * rp);
            double      e2 = 0.0, q2 = 0.0;
            for (int64_t c = 0; c < rank; ++c) {
                const double v  = scale * (double) row[(size_t) c];   // exact: float x float in double
                const double qv = s > 0.0f ? std::max(-63.0, std::min(63.0, std::nearbyint(v / (double) s))) : 0.0;
                q[c]            = (uint8_t) (qv + 64.0);
                const double err = v - (double) s * qv;
                e2 += err * err;
                q2 += qv * qv;
            }
            qs[(size_t) j] = s;
            qa[(size_t) j] = round_up(std::sqrt(q2) * (double) s * (1.0 + 1e-12));
            qe[(size_t) j] = round_up(std::sqrt(e2) * (1.0 + 1e-12));
        }
    }
    m->q8.swap(q8);
    m->qs.swap(qs);
    m->qa.swap(qa);
    m->qe.swap(qe);
    m->rp = rp;
    return DSPARK_OK;
}

// The bound of x[j] + bias_j for draft rows j0..j1-1 (identity ids: x has a value per draft row):
// b = qs[j] sd (q[j] . qd), h = qa[j] A + qe[j] E + (|b| + |x[j]|) 2^-21; lo = x + b - h, hi = x + b + h.
// x null: the bias bound alone (b and h to lo / hi: the caller maps the rows to target ids).
struct bound_args {
    const uint8_t * q8;     // q + 64
    int64_t         rp;
    const int8_t *  qd;
    int32_t         off;    // 64 sum(qd)
    const float *   qs;
    const float *   qa;
    const float *   qe;
    float           sd, A, E;
    const float *   x;
    float *         lo;
    float *         hi;
};

inline void bound_one(const bound_args & g, int64_t j, int32_t dot) {
    const float b  = (float) dot * (g.qs[j] * g.sd);
    const float xv = g.x ? g.x[j] : 0.0f;
    const float h  = g.qa[j] * g.A + g.qe[j] * g.E + (std::fabs(b) + std::fabs(xv)) * 0x1p-21f;
    if (g.x) {
        const float c = xv + b;
        g.lo[j]       = c - h;
        g.hi[j]       = c + h;
    } else {
        g.lo[j] = b;
        g.hi[j] = h;
    }
}

void bounds_scalar(const bound_args & g, int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
        const uint8_t * q = g.q8 + j * g.rp;
        int32_t         s = 0;
        for (int64_t c = 0; c < g.rp; ++c) s += (int32_t) q[c] * (int32_t) g.qd[c];
        bound_one(g, j, s - g.off);
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#    define DSPARK_AVX2 __attribute__((target("avx2"), always_inline)) inline
// (q + 64) . qd of one row: maddubs (u8 x s8 -> int16 pairs) then madd (-> int32), 8 lanes
DSPARK_AVX2 __m256i row_dot8(const uint8_t * q, const int8_t * qd, int64_t rp, __m256i ones) {
    __m256i acc = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *) q),
                                                         _mm256_loadu_si256((const __m256i *) qd)), ones);
    for (int64_t c = 32; c < rp; c += 32) {
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *) (q + c)),
                                                                           _mm256_loadu_si256((const __m256i *) (qd + c))),
                                                      ones));
    }
    return acc;
}

// eight rows at a time: the dots reduced together (hadd tree), then their bounds in 8 float lanes
__attribute__((target("avx2"))) void bounds_avx2(const bound_args & g, int64_t n) {
    const __m256i ones = _mm256_set1_epi16(1), off = _mm256_set1_epi32(g.off);
    const __m256  sgn = _mm256_set1_ps(-0.0f), eps = _mm256_set1_ps(0x1p-21f), sd = _mm256_set1_ps(g.sd);
    const __m256  A = _mm256_set1_ps(g.A), E = _mm256_set1_ps(g.E);
    const int64_t rp = g.rp;
    int64_t       j  = 0;
    for (; j + 8 <= n; j += 8) {
        const uint8_t * q  = g.q8 + j * rp;
        const __m256i   d0 = row_dot8(q, g.qd, rp, ones), d1 = row_dot8(q + rp, g.qd, rp, ones);
        const __m256i   d2 = row_dot8(q + 2 * rp, g.qd, rp, ones), d3 = row_dot8(q + 3 * rp, g.qd, rp, ones);
        const __m256i   d4 = row_dot8(q + 4 * rp, g.qd, rp, ones), d5 = row_dot8(q + 5 * rp, g.qd, rp, ones);
        const __m256i   d6 = row_dot8(q + 6 * rp, g.qd, rp, ones), d7 = row_dot8(q + 7 * rp, g.qd, rp, ones);
        const __m256i   h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(d0, d1), _mm256_hadd_epi32(d2, d3));
        const __m256i   h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(d4, d5), _mm256_hadd_epi32(d6, d7));
        const __m256i   dot = _mm256_sub_epi32(_mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20),
                                                                _mm256_permute2x128_si256(h0, h1, 0x31)), off);
        // the operations of bound_one, in its order (no FMA under this target: the same results)
        const __m256 b  = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(_mm256_loadu_ps(g.qs + j), sd));
        const __m256 xv = g.x ? _mm256_loadu_ps(g.x + j) : _mm256_setzero_ps();
        const __m256 ab = _mm256_add_ps(_mm256_andnot_ps(sgn, b), _mm256_andnot_ps(sgn, xv));
        const __m256 h  = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(g.qa + j), A),
                                                      _mm256_mul_ps(_mm256_loadu_ps(g.qe + j), E)),
                                        _mm256_mul_ps(ab, eps));
        if (g.x) {
            const __m256 c = _mm256_add_ps(xv, b);
            _mm256_storeu_ps(g.lo + j, _mm256_sub_ps(c, h));
            _mm256_storeu_ps(g.hi + j, _mm256_add_ps(c, h));
        } else {
            _mm256_storeu_ps(g.lo + j, b);
            _mm256_storeu_ps(g.hi + j, h);
        }
    }
    bounds_scalar(g, j, n);
}

// ids i < n with x[i] >= t appended to out (at most cap; returns false past it)
__attribute__((target("avx2"))) bool collect_ge_avx2(const float * x, int32_t n, float t, int32_t * out, int32_t cap,
                                                     int32_t * cnt) {
    const __m256 vt = _mm256_set1_ps(t);
    int32_t      i  = 0, k = *cnt;
    for (; i + 8 <= n; i += 8) {
        int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vt, _CMP_GE_OQ));
        while (mask) {
            if (k >= cap) return false;
            out[k++] = i + __builtin_ctz((unsigned) mask);
            mask &= mask - 1;
        }
    }
    for (; i < n; ++i) {
        if (x[i] >= t) {
            if (k >= cap) return false;
            out[k++] = i;
        }
    }
    *cnt = k;
    return true;
}

const bool g_has_avx2 = [] {
    __builtin_cpu_init();
    const char * off = std::getenv("DSPARK_NO_AVX2");
    return !(off && *off) && __builtin_cpu_supports("avx2");
}();
#endif

void bounds(const bound_args & g, int64_t n) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (g_has_avx2) return bounds_avx2(g, n);
#endif
    bounds_scalar(g, 0, n);
}

bool collect_ge(const float * x, int32_t n, float t, int32_t * out, int32_t cap, int32_t * cnt) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (g_has_avx2) return collect_ge_avx2(x, n, t, out, cap, cnt);
#endif
    int32_t k = *cnt;
    for (int32_t i = 0; i < n; ++i) {
        if (x[i] >= t) {
            if (k >= cap) return false;
            out[k++] = i;
        }
    }
    *cnt = k;
    return true;
}

struct prune_scratch {
    std::vector<int8_t>  qd;
    std::vector<int32_t> rows, at, fs, tmp, cid;
    std::vector<float>   bt, hw, lo, hi, ex, heap, chi;
};

// The threshold of the lower bounds, fed chunk by chunk: with top_k > 0 the k-th largest finite
// lower bound (a min-heap of the k largest), else the largest one + log(min_p); -inf until defined.
struct lower_cut {
    int32_t              k;
    double               log_min_p;
    std::vector<float> & heap;
    std::vector<int32_t> & tmp;
    float                mx = -INFINITY;
    double               t  = -INFINITY;
    void feed(const float * lo, int32_t nb) {
        const float floor = k > 0 ? ((int32_t) heap.size() == k ? heap.front() : -INFINITY) : mx;
        int32_t     r     = 0;
        collect_ge(lo, nb, std::nextafter(floor, INFINITY), tmp.data(), nb, &r);   // lo > floor
        if (r == 0) return;
        for (int32_t i = 0; i < r; ++i) {
            const float v = lo[tmp[(size_t) i]];
            if (k == 0) {
                mx = std::max(mx, v);
            } else if ((int32_t) heap.size() < k) {
                heap.push_back(v);
                std::push_heap(heap.begin(), heap.end(), std::greater<float>());
            } else if (v > heap.front()) {
                std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
                heap.back() = v;
                std::push_heap(heap.begin(), heap.end(), std::greater<float>());
            }
        }
        if (k > 0) {
            t = (int32_t) heap.size() == k ? (double) heap.front() : -INFINITY;
        } else {
            t = mx > -INFINITY ? (double) mx + log_min_p : -INFINITY;
        }
    }
};

// slack for the float rounding of the bounds themselves (the bound pads the bias's own)
inline float cut_slack(double t) { return t > -INFINITY ? (float) (t - 1e-5 * (1.0 + std::fabs(t))) : -INFINITY; }
thread_local prune_scratch g_p;
}  // namespace

extern "C" int32_t dspark_markov_prune_prepare(dspark_markov * m) {
    return dspark::guard(__func__, [&]() -> int32_t {
        if (!m) return fail(DSPARK_E_INVALID, "bad argument");
        const int32_t rc = prune_prepare(m);
        if (rc == DSPARK_OK) ok();
        return rc;
    });
}

extern "C" int32_t dspark_markov_candidates(dspark_markov * m, const float * x, int32_t n, const int32_t * t2d,
                                            const float * d, int32_t top_k, float min_p, const int32_t * forced,
                                            int32_t n_forced, int32_t * out_ids, float * out_vals, int32_t cap) {
    return dspark::guard(__func__, [&]() -> int32_t {
        if (!m || !x || !d || !out_ids || !out_vals || n <= 0 || cap < 0 || n_forced < 0 || (n_forced > 0 && !forced) ||
            top_k < 0 || !(min_p >= 0.0f && min_p <= 1.0f)) {
            return fail(DSPARK_E_INVALID, "bad argument");
        }
        const int64_t rank = m->w2->ne[0], nv = m->w2->ne[1];
        if (!t2d && n != nv) return fail(DSPARK_E_INVALID, "row of %d for %lld draft rows and no t2d", n, (long long) nv);
        for (int32_t i = 0; i < n_forced; ++i) {
            if (forced[i] < 0 || forced[i] >= n) return fail(DSPARK_E_INVALID, "forced id %d out of range", forced[i]);
        }
        if (top_k > 0 && n_forced > 0 && top_k > n - n_forced) {   // the bound could not hold k ids
            ok();
            return 0;
        }
        if ((top_k == 0 && !(min_p > 0.0f)) || top_k >= n) {   // no filter that bounds the kept set
            ok();
            return 0;
        }
        int32_t rc = prune_prepare(m);
        if (rc != DSPARK_OK) return rc;
        prune_scratch & S  = g_p;
        const int64_t   rp = m->rp;

        // d = s_d qd + r
        double dn2 = 0.0, mx = 0.0;
        for (int64_t c = 0; c < rank; ++c) {
            dn2 += (double) d[c] * d[c];
            mx = std::max(mx, std::fabs((double) d[c]));
        }
        if (!std::isfinite(dn2)) return fail(DSPARK_E_INVALID, "non-finite difference vector");
        const float sd = (float) (mx / 127.0);
        S.qd.assign((size_t) rp, 0);
        double rn2 = 0.0;
        for (int64_t c = 0; c < rank; ++c) {
            const double qv = sd > 0.0f ? std::max(-127.0, std::min(127.0, std::nearbyint((double) d[c] / sd))) : 0.0;
            S.qd[(size_t) c] = (int8_t) qv;
            const double err = (double) d[c] - (double) sd * qv;
            rn2 += err * err;
        }
        const float dn = round_up(std::sqrt(dn2) * (1.0 + 1e-12)), rn = round_up(std::sqrt(rn2) * (1.0 + 1e-12));
        // the float rounding of the exact product (ggml: <= ~rank ulps of |W2[j]| ||d||) and of this one
        const float ulp_r = (float) ((double) (rank + 8) * std::ldexp(1.0, -23));

        // bounds of x + bias on the target ids: lo / hi (forced: no lower bound)
        int32_t sum_qd = 0;
        for (int64_t c = 0; c < rank; ++c) sum_qd += S.qd[(size_t) c];
        bound_args g = { m->q8.data(), rp, S.qd.data(), 64 * sum_qd, m->qs.data(), m->qa.data(), m->qe.data(), sd,
                         round_up((double) rn + (double) dn * ulp_r), round_up((double) dn * (1.0 + ulp_r)),
                         nullptr, nullptr, nullptr };
        lower_cut cut = { top_k, min_p > 0.0f ? std::log((double) min_p) : 0.0, S.heap, S.tmp };
        S.heap.clear();
        int32_t cnt = 0;
        if (!t2d) {
            // one pass in chunks that stay in cache: bounds, the cut so far, the ids whose upper bound
            // reaches it (the cut only rises: filtered again at the end)
            constexpr int32_t CH = 2048;
            S.lo.resize(CH);
            S.hi.resize(CH);
            S.tmp.resize(CH);
            S.fs.assign(forced, forced + n_forced);
            std::sort(S.fs.begin(), S.fs.end());
            S.cid.clear();
            S.chi.clear();
            size_t fp = 0;
            for (int32_t j0 = 0; j0 < n; j0 += CH) {
                const int32_t nb = std::min(CH, n - j0);
                bound_args    gc = g;
                gc.q8 += (size_t) j0 * rp;
                gc.qs += j0;
                gc.qa += j0;
                gc.qe += j0;
                gc.x  = x + j0;
                gc.lo = S.lo.data();
                gc.hi = S.hi.data();
                bounds(gc, nb);
                for (; fp < S.fs.size() && S.fs[fp] < j0 + nb; ++fp) S.lo[(size_t) (S.fs[fp] - j0)] = -INFINITY;
                cut.feed(S.lo.data(), nb);
                int32_t r = 0;
                collect_ge(S.hi.data(), nb, cut_slack(cut.t), S.tmp.data(), nb, &r);
                for (int32_t i = 0; i < r; ++i) {
                    S.cid.push_back(j0 + S.tmp[(size_t) i]);
                    S.chi.push_back(S.hi[(size_t) S.tmp[(size_t) i]]);
                }
                if (S.cid.size() > (size_t) 2 * cap + CH) {   // compact with the cut so far
                    const float te = cut_slack(cut.t);
                    size_t      w  = 0;
                    for (size_t i = 0; i < S.cid.size(); ++i) {
                        if (S.chi[i] >= te) {
                            S.cid[w]   = S.cid[i];
                            S.chi[w++] = S.chi[i];
                        }
                    }
                    S.cid.resize(w);
                    S.chi.resize(w);
                    if (w > (size_t) cap) {
                        ok();
                        return 0;                              // too many: bias the whole row
                    }
                }
            }
            ok();
            if (!(cut.t > -INFINITY)) return 0;   // fewer than k finite bounds (or NaN): no pruning
            const float te = cut_slack(cut.t);
            for (size_t i = 0; i < S.cid.size(); ++i) {
                if (S.chi[i] >= te) {
                    if (cnt >= cap) return 0;
                    out_ids[cnt++] = S.cid[i];
                }
            }
        } else {
            S.lo.resize((size_t) n);
            S.hi.resize((size_t) n);
            S.bt.resize((size_t) nv);
            S.hw.resize((size_t) nv);
            g.lo = S.bt.data();
            g.hi = S.hw.data();
            bounds(g, nv);
            float *       lo = S.lo.data(), *hi = S.hi.data();
            const float * bt = S.bt.data(), *hw = S.hw.data();
            for (int32_t t = 0; t < n; ++t) {
                const int32_t j = t2d[t];
                if (j < 0 || j >= nv) {
                    lo[t] = hi[t] = x[t];
                    continue;
                }
                const float c = x[t] + bt[j], h = hw[j] + std::fabs(x[t]) * 0x1p-21f;
                lo[t]         = c - h;
                hi[t]         = c + h;
            }
            for (int32_t i = 0; i < n_forced; ++i) S.lo[(size_t) forced[i]] = -INFINITY;
            S.tmp.resize((size_t) n);
            cut.feed(S.lo.data(), n);
            ok();
            if (!(cut.t > -INFINITY)) return 0;
            if (!collect_ge(S.hi.data(), n, cut_slack(cut.t), out_ids, cap, &cnt)) return 0;   // too many
        }
        if (n_forced > 0) {
            if (cnt + n_forced > cap) return 0;
            std::memcpy(out_ids + cnt, forced, (size_t) n_forced * sizeof(int32_t));
            std::sort(out_ids, out_ids + cnt + n_forced);
            cnt = (int32_t) (std::unique(out_ids, out_ids + cnt + n_forced) - out_ids);
        }
        // the exact bias of the candidates (ids off the draft vocabulary: none)
        S.rows.clear();
        S.at.clear();
        for (int32_t i = 0; i < cnt; ++i) {
            const int32_t j = t2d ? t2d[out_ids[i]] : out_ids[i];
            out_vals[i]     = x[out_ids[i]];
            if (j >= 0 && j < nv) {
                S.rows.push_back(j);
                S.at.push_back(i);
            }
        }
        if (!S.rows.empty()) {
            S.ex.resize(S.rows.size());
            rc = bias_dot(m, d, S.rows.data(), (int32_t) S.rows.size(), S.ex.data());
            if (rc != DSPARK_OK) return rc;
            for (size_t i = 0; i < S.rows.size(); ++i) out_vals[S.at[i]] = x[out_ids[S.at[i]]] + S.ex[i];
        }
        ok();
        return cnt;
    });
}
