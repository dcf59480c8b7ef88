// Concern: scans of whole rows (dspark_scan.h): the kernels, written once over a vector type on
// K<V> (dspark_simd.h), their per-ISA entry points, and the C entry points that are one scan
// (dspark_argmax_f32, dspark_top_k_f32, dspark_sample_cdf_f32, dspark_sample_cdf).  Calls down into
// dspark_status.cpp and dspark_simd.cpp only.
#include "dspark_scan.h"

#include "dspark_internal.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace dspark {

namespace {

template <class V>
struct KScan : K<V> {
    DSPARK_K_BASE(V)

    // exp(x) for masses only: x clamped at -87.3 instead of a zero select (two operations less;
    // a -inf logit weighs 1.6e-38 there, nothing next to the max's 1)
    static DSPARK_INLINE V exp_mass(V x) { return exp_core(x >= splat(kExpLo) ? x : splat(kExpLo)); }

    // max of x[0..n-1] (NaN ignored; -inf when none is larger)
    static DSPARK_INLINE float vmax(const float * x, int64_t n) {
        V       m0 = splat(-INFINITY), m1 = m0;
        int64_t i  = 0;
        for (; i + 2 * L <= n; i += 2 * L) {
            const V a = load(x + i), b = load(x + i + L);
            m0 = a > m0 ? a : m0;
            m1 = b > m1 ? b : m1;
        }
        m0 = m1 > m0 ? m1 : m0;
        float r = -INFINITY;
        for (int j = 0; j < L; ++j) r = m0[j] > r ? m0[j] : r;
        for (; i < n; ++i) r = x[i] > r ? x[i] : r;
        return r;
    }

    // The largest and second-largest values of x[0..n-1] (a repeated maximum is its own second;
    // NaN ignored; -inf when absent) and the first index of the largest: one pass, then a search
    // that stops at the first block holding it.
    static DSPARK_INLINE int64_t top2(const float * x, int64_t n, float * first, float * second) {
        constexpr int U = 4;  // independent (max, second) pairs: the compare-select chains overlap
        V       m1[U], m2[U];
        for (int u = 0; u < U; ++u) m1[u] = m2[u] = splat(-INFINITY);
        int64_t i = 0;
        for (; i + U * L <= n; i += U * L) {
            for (int u = 0; u < U; ++u) {
                const V v  = load(x + i + u * L);
                const V lo = v > m1[u] ? m1[u] : v;
                m2[u]      = lo > m2[u] ? lo : m2[u];
                m1[u]      = v > m1[u] ? v : m1[u];
            }
        }
        for (; i + L <= n; i += L) {
            const V v  = load(x + i);
            const V lo = v > m1[0] ? m1[0] : v;
            m2[0]      = lo > m2[0] ? lo : m2[0];
            m1[0]      = v > m1[0] ? v : m1[0];
        }
        for (int u = 1; u < U; ++u) {  // merge pairs: the larger max; the best of the rest
            const V lo = m1[u] > m1[0] ? m1[0] : m1[u];
            const V hi = m1[u] > m1[0] ? m1[u] : m1[0];
            V       s2 = m2[u] > m2[0] ? m2[u] : m2[0];
            s2         = lo > s2 ? lo : s2;
            m1[0]      = hi;
            m2[0]      = s2;
        }
        const V m1v = m1[0], m2v = m2[0];
        float a = -INFINITY, b = -INFINITY;
        for (int j = 0; j < L; ++j) {
            const float u = m1v[j], w = m2v[j];
            if (u > a) {
                b = a > b ? a : b;
                a = u;
            } else if (u > b) {
                b = u;
            }
            if (w > b) b = w;
        }
        for (; i < n; ++i) {
            const float v = x[i];
            if (v > a) {
                b = a;
                a = v;
            } else if (v > b) {
                b = v;
            }
        }
        *first  = a;
        *second = b;
        int64_t k = 0;
        for (; k + L <= n; k += L) {
            if (any(load(x + k) == splat(a))) break;
        }
        for (; k < n; ++k) {
            if (x[k] == a) return k;
        }
        return 0;  // every value NaN / -inf
    }

    // e[i] = exp(x[i] - m), returns their sum
    static DSPARK_INLINE double exp_sum(const float * x, int64_t n, float m, float * e) {
        VD            accd = VD{};
        int64_t       i    = 0;
        const int64_t nv   = n - n % L;
        while (i < nv) {
            V             acc = splat(0.0f);
            const int64_t end = std::min<int64_t>(nv, i + kChunk);
            for (; i < end; i += L) {
                const V v = exp_neg(load(x + i) - m);
                store(e + i, v);
                acc += v;
            }
            accd += widen_sum(acc);
        }
        double total = hsum(accd);
        for (; i < n; ++i) {
            e[i] = exp_neg(x[i] - m);
            total += e[i];
        }
        return total;
    }

    // mass[j] = sum of e[i] and count[j] = number of i over x[i] > t[j], j < NT (one pass).
    // With_exp: e[i] = exp(x[i] - m) is computed and stored on the way, and their total returned.
    template <bool with_exp, int NT>
    static DSPARK_INLINE double mass8_impl(const float * x, float * e, int64_t n, float m, const float * t,
                                           double * mass, int64_t * count) {
        V  th[NT];
        VD accd[NT];
        VI cnt[NT];
        VD totd = VD{};
        for (int j = 0; j < NT; ++j) {
            th[j]   = splat(t[j]);
            accd[j] = VD{};
            cnt[j]  = VI{};
        }
        int64_t       i  = 0;
        const int64_t nv = n - n % L;
        while (i < nv) {
            V acc[NT];
            V tot = splat(0.0f);
            for (int j = 0; j < NT; ++j) acc[j] = splat(0.0f);
            const int64_t end = std::min<int64_t>(nv, i + kChunk);
            for (; i < end; i += L) {
                const V v = load(x + i);
                V       ev;
                if constexpr (with_exp) {
                    ev = exp_mass(v - m);
                    store(e + i, ev);
                    tot += ev;
                } else {
                    ev = load(e + i);
                }
                for (int j = 0; j < NT; ++j) {
                    const VI gt = v > th[j];
                    acc[j] += gt ? ev : splat(0.0f);
                    cnt[j] -= gt;
                }
            }
            for (int j = 0; j < NT; ++j) accd[j] += widen_sum(acc[j]);
            totd += widen_sum(tot);
        }
        double total = hsum(totd);
        for (int j = 0; j < NT; ++j) {
            mass[j]  = hsum(accd[j]);
            count[j] = 0;
            for (int l = 0; l < L; ++l) count[j] += cnt[j][l];
        }
        for (; i < n; ++i) {
            if constexpr (with_exp) {
                e[i] = exp_neg(x[i] - m);
                total += e[i];
            }
            for (int j = 0; j < NT; ++j) {
                if (x[i] > t[j]) {
                    mass[j] += e[i];
                    count[j] += 1;
                }
            }
        }
        return total;
    }
    static DSPARK_INLINE void mass8(const float * x, const float * e, int64_t n, const float * t, double * mass,
                                    int64_t * count) {
        mass8_impl<false, 8>(x, const_cast<float *>(e), n, 0.0f, t, mass, count);
    }
    static DSPARK_INLINE double exp_mass8(const float * x, int64_t n, float m, float * e, const float * t,
                                          double * mass, int64_t * count) {
        return mass8_impl<true, kFirst>(x, e, n, m, t, mass, count);
    }

    // mass of x >= t
    static DSPARK_INLINE double mass_ge(const float * x, const float * e, int64_t n, float t) {
        VD            accd = VD{};
        int64_t       i    = 0;
        const int64_t nv   = n - n % L;
        const V       vt   = splat(t);
        while (i < nv) {
            V             acc = splat(0.0f);
            const int64_t end = std::min<int64_t>(nv, i + kChunk);
            for (; i < end; i += L) acc += load(x + i) >= vt ? load(e + i) : splat(0.0f);
            accd += widen_sum(acc);
        }
        double total = hsum(accd);
        for (; i < n; ++i) total += x[i] >= t ? e[i] : 0.0f;
        return total;
    }

    // indices i with lo < x[i] <= hi appended to out (a block with none costs two compares)
    static DSPARK_INLINE void collect(const float * x, int64_t n, float lo, float hi, std::vector<int32_t> & out) {
        const V vlo = splat(lo), vhi = splat(hi);
        int64_t i   = 0;
        for (; i + L <= n; i += L) {
            const V  v  = load(x + i);
            const VI in = (v > vlo) & (v <= vhi);
            if (!any(in)) continue;
            for (int j = 0; j < L; ++j) {
                if (in[j]) out.push_back((int32_t) (i + j));
            }
        }
        for (; i < n; ++i) {
            if (x[i] > lo && x[i] <= hi) out.push_back((int32_t) i);
        }
    }

    // The k first candidates of the row in candidate order, unordered; -inf and NaN are never
    // candidates.  Returns the row's maximum (-inf when no logit is finite).  First the maxima of
    // blocks of B floats (one pass); k blocks hold a value >= the k-th largest of those maxima, so it
    // is a lower bound t of the k-th logit, and only the blocks whose maximum reaches t are read
    // again (about k of them), collecting x >= t.
    static DSPARK_INLINE float top_k(const float * x, int64_t n, int32_t k, std::vector<cand> & buf,
                                     std::vector<float> & bmax) {
        buf.clear();
        int64_t B = 64;  // a multiple of L; at least 4k blocks when the row is long enough
        while (B > L && n / B < 4 * (int64_t) k) B /= 2;
        const int64_t nb      = n / B;
        const bool    bounded = nb >= k;  // else: no bound, every finite logit of the row is collected
        float         m       = -INFINITY;
        float         t       = -INFINITY;
        if (bounded) {
            bmax.resize((size_t) (2 * nb));
            for (int64_t b = 0; b < nb; ++b) {
                const float r    = vmax(x + b * B, B);
                bmax[(size_t) b] = r;
                m                = r > m ? r : m;
            }
            float * sel = bmax.data() + nb;  // the k-th largest block maximum, on a copy
            std::memcpy(sel, bmax.data(), (size_t) nb * sizeof(float));
            std::nth_element(sel, sel + (k - 1), sel + nb, [](float a, float c) { return a > c; });
            t = sel[k - 1];
        }
        const int64_t start = bounded ? nb * B : 0;  // the rest of the row, read directly
        for (int64_t i = start; i < n; ++i) m = x[i] > m ? x[i] : m;
        if (!(m > -INFINITY)) return m;
        // x >= t and finite (t may be -inf when fewer than k blocks hold a finite logit)
        if (bounded) {
            const V vt = splat(t), vinf = splat(-INFINITY);
            for (int64_t b = 0; b < nb; ++b) {
                const float bm = bmax[(size_t) b];
                if (!(bm >= t && bm > -INFINITY)) continue;
                for (int64_t i = b * B; i < (b + 1) * B; i += L) {
                    const V v = load(x + i);
                    if (!any((v >= vt) & (v > vinf))) continue;
                    for (int j = 0; j < L; ++j) {
                        if (v[j] >= t && v[j] > -INFINITY) buf.push_back({ v[j], (int32_t) (i + j) });
                    }
                }
            }
        }
        for (int64_t i = start; i < n; ++i) {
            if (x[i] >= t && x[i] > -INFINITY) buf.push_back({ x[i], (int32_t) i });
        }
        if (buf.size() > (size_t) k) {
            std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), before);
            buf.resize((size_t) k);
        }
        return m;
    }

    static DSPARK_INLINE double sum(const double * p, int64_t n) {
        VD      a = VD{}, b = VD{}, c = VD{}, d = VD{};
        int64_t i = 0;
        for (; i + 4 * LD <= n; i += 4 * LD) {
            a += load_d(p + i);
            b += load_d(p + i + LD);
            c += load_d(p + i + 2 * LD);
            d += load_d(p + i + 3 * LD);
        }
        double t = hsum((a + b) + (c + d));
        for (; i < n; ++i) t += p[i];
        return t;
    }
    static DSPARK_INLINE double sum(const float * p, int64_t n) {  // pairs in float, then double lanes
        VD      a = VD{}, b = VD{};
        int64_t i = 0;
        for (; i + 2 * L <= n; i += 2 * L) {
            const V v = load(p + i) + load(p + i + L);
            a += lo_d(v);
            b += hi_d(v);
        }
        double t = hsum(a + b);
        for (; i < n; ++i) t += p[i];
        return t;
    }

    // inverse-CDF index: the first j whose running sum (blocks of 256 summed first, then the
    // entries of the block the target falls in) exceeds u * total; when rounding leaves none, the
    // last positive weight; -1 when the weights do not sum to a positive finite number
    static constexpr int64_t kBlock = 256;
    template <class T>
    static DSPARK_INLINE int64_t sample(const T * p, int64_t n, double u) {
        const int64_t nb    = n / kBlock;
        double        total = sum(p, nb * kBlock);
        for (int64_t i = nb * kBlock; i < n; ++i) total += p[i];
        if (!(total > 0.0) || !std::isfinite(total)) return -1;
        const double target = u * total;
        double       c      = 0.0;
        int64_t      b      = 0;
        for (; b < nb; ++b) {
            const double t = sum(p + b * kBlock, kBlock);
            if (c + t > target) break;
            c += t;
        }
        for (int64_t i = b * kBlock; i < n; ++i) {
            c += p[i];
            if (c > target) return i;
        }
        int64_t i = n - 1;
        while (i > 0 && !(p[i] > 0)) --i;
        return i;
    }
    static DSPARK_INLINE int64_t sample_f64(const double * p, int64_t n, double u) { return sample(p, n, u); }
    static DSPARK_INLINE int64_t sample_f32(const float * p, int64_t n, double u) { return sample(p, n, u); }
};

}  // namespace

#define DSPARK_KMAP_vmax vmax
#define DSPARK_KMAP_vtop2 top2
#define DSPARK_KMAP_vexp_mass8 exp_mass8
#define DSPARK_KMAP_vmass8 mass8
#define DSPARK_KMAP_vmass_ge mass_ge
#define DSPARK_KMAP_vcollect collect
#define DSPARK_KMAP_top_k_scan top_k
#define DSPARK_KMAP_sample_f64 sample_f64
#define DSPARK_KMAP_sample_f32 sample_f32
#define DSPARK_DEF_SCAN(W, ret, name, params, args) DSPARK_DEF(KScan, W, ret, name, params, args)
DSPARK_SCAN_KERNELS(DSPARK_DEF_SCAN)

// argmax and top-2 gap of one row: the first maximum, then the largest value at any other index
void argmax_row_f32(const float * x, int64_t n, int32_t * id, float * gap) {
    float a, b;
    *id = (int32_t) vtop2(x, n, &a, &b);
    if (gap) *gap = a - b;
}

namespace {

// top_k_f32's buffers (in a struct of this file's own: its destructor is not a std:: one exported
// from the library)
struct top_k_scratch {
    std::vector<cand>  cands;
    std::vector<float> bmax;  // block maxima
};
thread_local top_k_scratch t_s;

// ids[0..k-1] <- the k largest of x[0..n-1] in no particular order (ties: the lower index); when
// fewer than k are finite the lowest-index others fill up.  1 <= k <= n.
void top_k_f32(const float * x, int64_t n, int32_t k, int32_t * ids) {
    top_k_scan(x, n, k, t_s.cands, t_s.bmax);
    size_t r = 0;
    for (const cand & c : t_s.cands) ids[r++] = c.id;
    // fewer than k finite values: fill with the lowest-index non-candidates (-inf / NaN) like nth_element
    if (r < (size_t) k) {
        std::vector<char> taken((size_t) n, 0);
        for (size_t j = 0; j < r; ++j) taken[(size_t) ids[j]] = 1;
        for (int64_t i = 0; i < n && r < (size_t) k; ++i) {
            if (!taken[(size_t) i]) ids[r++] = (int32_t) i;
        }
    }
}

// one inverse-CDF draw through the per-ISA kernel `draw` (sample_f32 / sample_f64), validated
template <class T, int64_t (*draw)(const T *, int64_t, double)>
int32_t sample_cdf(const char * fn, const T * probs, int32_t n, double u) {
    return dspark::guard(fn, [&]() -> int32_t {
        if (!probs || n <= 0) return fail(DSPARK_E_INVALID, "bad argument (n %d)", n);
        if (!(u >= 0.0 && u < 1.0)) return fail(DSPARK_E_INVALID, "u %g outside [0, 1)", u);
        const int32_t j = (int32_t) draw(probs, n, u);
        if (j < 0) return fail(DSPARK_E_INVALID, "weights must be finite, >= 0, with a positive sum");
        ok();
        return j;
    });
}

}  // namespace

}  // namespace dspark

using dspark::fail;
using dspark::ok;

// ---- C entry points --------------------------------------------------------------------------------

extern "C" int32_t dspark_sample_cdf_f32(const float * probs, int32_t n, double u) {
    return dspark::sample_cdf<float, dspark::sample_f32>(__func__, probs, n, u);
}

extern "C" int32_t dspark_sample_cdf(const double * probs, int32_t n, double u) {
    return dspark::sample_cdf<double, dspark::sample_f64>(__func__, probs, n, u);
}

extern "C" int32_t dspark_argmax_f32(const float * x, int32_t n_rows, int32_t n, int32_t * ids, float * margin) {
    return dspark::guard(__func__, [&]() -> int32_t {
        if (!x || !ids || n_rows <= 0 || n <= 0) return fail(DSPARK_E_INVALID, "bad argument");
        for (int32_t r = 0; r < n_rows; ++r) {
            dspark::argmax_row_f32(x + (size_t) r * n, n, ids + r, margin ? margin + r : nullptr);
        }
        ok();
        return DSPARK_OK;
    });
}

extern "C" int32_t dspark_top_k_f32(const float * x, int32_t n, int32_t k, int32_t * ids) {
    return dspark::guard(__func__, [&]() -> int32_t {
        if (!x || !ids || n <= 0 || k <= 0 || k > n) return fail(DSPARK_E_INVALID, "bad argument (n %d, k %d)", n, k);
        dspark::top_k_f32(x, n, k, ids);
        ok();
        return DSPARK_OK;
    });
}
