// llama.cpp's sampler chain on one float logits row, returning the distribution sparse (see
// dspark_chain_dist in dspark_shim.h), plus the read-out helpers that scan whole vocabulary rows
// (argmax/top-2, top-k, inverse-CDF draws).
//
// The chain is llama.cpp's (src/llama-sampler.cpp, order of common/sampling.cpp): logit bias -inf
// on banned ids -> penalties -> top_k -> top_p -> min_p -> temperature -> softmax.  The kept set
// and the probabilities are the same as llama.cpp's; what differs is the work: nothing is sorted
// but the few candidates around a cut.  top_p over the whole vocabulary (top_k off) finds its cut
// by bracketing: masses above several thresholds in one vectorized pass, then the same inside the
// bracket, until a few thousand candidates are left to sort.  Every kept set is a prefix of the
// row in (logit desc, id asc) order, so the output is one predicate scan in id order.
#include "dspark_internal.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

using dspark::fail;
using dspark::ok;

namespace {

// ---- candidates and cuts --------------------------------------------------------------------------

// candidate order: logit descending, then id ascending (the tie rule of every cut)
struct cand {
    float   x;
    int32_t id;
};

inline bool before(const cand & a, const cand & b) { return a.x > b.x || (a.x == b.x && a.id < b.id); }

// The kept set is {x > v} U {x == v, id <= id_v} (a prefix in candidate order); v = -inf with
// id_v = INT32_MAX means "every finite logit".
struct cut {
    float   v    = -INFINITY;
    int32_t id_v = INT32_MAX;
};

// ---- vector kernels ----------------------------------------------------------------------------------
// Written once over a GCC/Clang vector type V (16 lanes under AVX-512, 8 under AVX2+FMA, picked at
// run time on x86-64; else 4 lanes: SSE2 / NEON), always inlined into the per-ISA entry points below.

#define DSPARK_INLINE inline __attribute__((always_inline))
#if defined(__GNUC__)
#    pragma GCC diagnostic ignored "-Wpsabi"  // 32/64-byte vectors only inside the AVX2/AVX-512 functions
#endif

typedef float   f4 __attribute__((vector_size(16)));
typedef float   f8 __attribute__((vector_size(32)));
typedef double  d2 __attribute__((vector_size(16)));
typedef double  d4 __attribute__((vector_size(32)));
typedef uint64_t u8x2 __attribute__((vector_size(16)));
typedef uint64_t u8x4 __attribute__((vector_size(32)));
typedef float   f16 __attribute__((vector_size(64)));
typedef double  d8 __attribute__((vector_size(64)));
typedef uint64_t u8x8 __attribute__((vector_size(64)));

// exp(x) for x <= 0 (x = logit - max): relative error ~1.1e-7 in float (2e-9 in the polynomial's
// coefficients); 0 below -87.3 (and for -inf / NaN).  Cody-Waite reduction x = n ln2 + r,
// |r| <= ln2/2, a degree-6 polynomial fitted here for relative error on that interval (iteratively
// reweighted least squares), 2^n from the bits.
constexpr float kExpLo = -87.3f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;  // 9 significant bits: n * kLn2Hi is exact
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kRound = 12582912.0f;   // 1.5 * 2^23: (v + kRound) - kRound rounds to nearest
constexpr int   kFirst = 8;  // thresholds of the first (fused with exp) top-p bracketing pass
constexpr float kC2    = 0.49999991059303284f;
constexpr float kC3    = 0.1666642129421234f;
constexpr float kC4    = 0.04166822507977486f;
constexpr float kC5    = 0.008374778553843498f;
constexpr float kC6    = 0.0013836706057190895f;

template <class V>
struct K {
    using VI = decltype(V{} > V{});
    static constexpr int L = (int) (sizeof(V) / sizeof(float));

    static DSPARK_INLINE V load(const float * p) {
        V v;
        std::memcpy(&v, p, sizeof(v));
        return v;
    }
    static DSPARK_INLINE void store(float * p, V v) { std::memcpy(p, &v, sizeof(v)); }
    static DSPARK_INLINE V splat(float x) { return V{} + x; }
    template <class A, class B, class C>
    using by_width = typename std::conditional<sizeof(V) == 64, A,
                                               typename std::conditional<sizeof(V) == 32, B, C>::type>::type;
    using VU = by_width<u8x8, u8x4, u8x2>;
    // doubles at the native width (half the lanes of V: a wider generic vector would be split
    // through memory by the compiler)
    using VD = by_width<d8, d4, d2>;
    static constexpr int LD = L / 2;
    static DSPARK_INLINE VD lo_d(V v) {
        if constexpr (L == 16) {
            return __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7), VD);
        } else if constexpr (L == 8) {
            return __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3), VD);
        } else {
            return __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1), VD);
        }
    }
    static DSPARK_INLINE VD hi_d(V v) {
        if constexpr (L == 16) {
            return __builtin_convertvector(__builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15), VD);
        } else if constexpr (L == 8) {
            return __builtin_convertvector(__builtin_shufflevector(v, v, 4, 5, 6, 7), VD);
        } else {
            return __builtin_convertvector(__builtin_shufflevector(v, v, 2, 3), VD);
        }
    }
    static DSPARK_INLINE VD widen_sum(V v) { return lo_d(v) + hi_d(v); }
    static DSPARK_INLINE VD load_d(const double * p) {
        VD v;
        std::memcpy(&v, p, sizeof(v));
        return v;
    }
    static DSPARK_INLINE void store_d(double * p, VD v) { std::memcpy(p, &v, sizeof(v)); }
    static DSPARK_INLINE bool any(VI m) {
        const VU u = (VU) m;
        uint64_t a = 0;
        for (int j = 0; j < (int) (sizeof(V) / 8); ++j) a |= u[j];
        return a != 0;
    }
    static DSPARK_INLINE bool all(VI m) {
        const VU u = (VU) m;
        uint64_t a = ~uint64_t(0);
        for (int j = 0; j < (int) (sizeof(V) / 8); ++j) a &= u[j];
        return a == ~uint64_t(0);
    }

    template <class T>
    static DSPARK_INLINE T exp_neg(T x) {  // T = V or float
        if constexpr (std::is_same<T, float>::value) {
            const bool  zero = !(x >= kExpLo);
            const float xc   = zero ? 0.0f : x;
            const float n    = (xc * kLog2e + kRound) - kRound;
            float       r    = xc - n * kLn2Hi;
            r                = r - n * kLn2Lo;
            float p = kC6;
            p = p * r + kC5;
            p = p * r + kC4;
            p = p * r + kC3;
            p = p * r + kC2;
            p = p * r + 1.0f;
            p = p * r + 1.0f;
            int32_t bits = ((int32_t) n + 127) << 23;
            float   sc;
            std::memcpy(&sc, &bits, sizeof(sc));
            return zero ? 0.0f : p * sc;
        } else {
            const VI zero = !(x >= splat(kExpLo));
            const V  xc   = zero ? splat(0.0f) : x;
            const V  n    = (xc * kLog2e + kRound) - kRound;
            V        r    = xc - n * kLn2Hi;
            r             = r - n * kLn2Lo;
            V p = splat(kC6);
            p = p * r + kC5;
            p = p * r + kC4;
            p = p * r + kC3;
            p = p * r + kC2;
            p = p * r + 1.0f;
            p = p * r + 1.0f;
            const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
            return zero ? splat(0.0f) : p * (V) bits;
        }
    }

    // exp(x) for masses only: x clamped at -87.3 instead of a zero select (two operations less;
    // a -inf logit weighs 1.6e-38 there, nothing next to the max's 1)
    static DSPARK_INLINE V exp_mass(V x) {
        const V xc = x >= splat(kExpLo) ? x : splat(kExpLo);
        const V n  = (xc * kLog2e + kRound) - kRound;
        V       r  = xc - n * kLn2Hi;
        r          = r - n * kLn2Lo;
        V p = splat(kC6);
        p = p * r + kC5;
        p = p * r + kC4;
        p = p * r + kC3;
        p = p * r + kC2;
        p = p * r + 1.0f;
        p = p * r + 1.0f;
        const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
        return p * (V) bits;
    }

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

    // Sums: float lanes over 16 blocks, then double lanes (the float partial sums stay exact to
    // ~1e-7 of a 16-term sum; the totals to double rounding of those).
    static constexpr int64_t kChunk = 16 * L;
    static DSPARK_INLINE double hsum(VD a) {
        double t = 0.0;
        for (int j = 0; j < LD; ++j) t += a[j];
        return t;
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

    // The tempered softmax over the kept set (x >= tmin, and the prefix up to cut c) in ascending id
    // order; returns the count, or -1 when cap is too small.  Like llama.cpp: exp(x / T - max / T).
    static DSPARK_INLINE int32_t emit(const float * x, int64_t n, const cut & c, float tmin, float m, float temp,
                                      int32_t * ids, double * probs, int32_t cap) {
        const float mt    = m / temp;
        const float lb    = std::max(tmin, c.v);  // nothing below is kept
        int32_t     r     = 0;
        int64_t     i     = 0;
        VD          acc   = VD{};
        VI          lane;
        for (int j = 0; j < L; ++j) lane[j] = j;
        for (; i + L <= n; i += L) {
            const V  v  = load(x + i);
            const VI ge = v >= splat(lb);
            if (!any(ge)) continue;
            const VI id   = lane + (int32_t) i;
            const VI keep = ge & (v >= splat(tmin)) & ((v > splat(c.v)) | ((v == splat(c.v)) & (id <= c.id_v)));
            V        ev   = exp_neg(v / temp - mt);
            ev            = keep ? ev : splat(0.0f);
            const VD plo  = lo_d(ev), phi = hi_d(ev);
            acc += plo + phi;  // the kept weights as written, summed in double
            if (all(ev > splat(0.0f)) && r + L <= cap) {  // the whole block is kept
                const VI vid = id;
                std::memcpy(ids + r, &vid, sizeof(vid));
                store_d(probs + r, plo);
                store_d(probs + r + LD, phi);
                r += L;
                continue;
            }
            for (int j = 0; j < L; ++j) {
                if (!(ev[j] > 0.0f)) continue;
                if (r >= cap) return -1;
                ids[r]   = (int32_t) (i + j);
                probs[r] = ev[j];
                ++r;
            }
        }
        double total = hsum(acc);
        for (; i < n; ++i) {
            const float v = x[i];
            if (!(v >= tmin && (v > c.v || (v == c.v && (int32_t) i <= c.id_v)))) continue;
            const float ev = exp_neg(v / temp - mt);
            if (!(ev > 0.0f)) continue;
            if (r >= cap) return -1;
            ids[r]   = (int32_t) i;
            probs[r] = ev;
            total += ev;
            ++r;
        }
        scale(probs, r, 1.0 / total);
        return r;
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

    static DSPARK_INLINE void scale(double * p, int64_t n, double f) {
        int64_t i = 0;
        for (; i + LD <= n; i += LD) store_d(p + i, load_d(p + i) * f);
        for (; i < n; ++i) p[i] *= f;
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

    // Dense output: probs[i] for every id (0 where not kept; kept as in emit), normalized; returns
    // the number kept.  One pass writing the weights, one scaling them.  exp((x - max) / T): the
    // same as llama.cpp's exp(x / T - max / T) to float rounding.
    static DSPARK_INLINE int32_t emit_dense(const float * x, int64_t n, const cut & c, float tmin, float m,
                                            float temp, float * probs) {
        const float   cv = c.v, inv_t = 1.0f / temp;
        const int32_t cid = c.id_v;
        const float   lb  = std::max(tmin, cv);
        const bool    all_kept = !(lb > -INFINITY);
        VD            acc  = VD{};
        VI            kept = VI{};
        VI            lane;
        for (int j = 0; j < L; ++j) lane[j] = j;
        int64_t i = 0;
        const int64_t nv = n - n % L;
        while (i < nv) {  // float sums over chunks of 16 blocks, then double lanes
            V             accf = splat(0.0f);
            const int64_t end  = std::min<int64_t>(nv, i + kChunk);
            if (all_kept) {  // every finite logit (exp(-inf) is 0)
                for (; i < end; i += L) {
                    const V ev = exp_neg((load(x + i) - m) * inv_t);
                    store(probs + i, ev);
                    accf += ev;
                    kept -= ev > splat(0.0f);
                }
            } else {
                for (; i < end; i += L) {
                    const V  v  = load(x + i);
                    const VI ge = v >= splat(lb);
                    if (!any(ge)) {
                        store(probs + i, splat(0.0f));
                        continue;
                    }
                    const VI id   = lane + (int32_t) i;
                    const VI keep = ge & (v >= splat(tmin)) & ((v > splat(cv)) | ((v == splat(cv)) & (id <= cid)));
                    const V  ev   = keep ? exp_neg((v - m) * inv_t) : splat(0.0f);
                    store(probs + i, ev);
                    accf += ev;
                    kept -= ev > splat(0.0f);
                }
            }
            acc += widen_sum(accf);
        }
        double  total = hsum(acc);
        int64_t r     = 0;
        for (int j = 0; j < L; ++j) r += kept[j];
        for (; i < n; ++i) {
            const float v = x[i];
            float       ev = 0.0f;
            if (v >= tmin && (v > cv || (v == cv && (int32_t) i <= cid))) ev = exp_neg((v - m) * inv_t);
            probs[i] = ev;
            total += ev;
            r += ev > 0.0f;
        }
        if (r == 0) return 0;
        const float f = (float) (1.0 / total);
        int64_t     k = 0;
        for (; k + L <= n; k += L) store(probs + k, load(probs + k) * f);
        for (; k < n; ++k) probs[k] *= f;
        return (int32_t) r;
    }
};

// ---- per-ISA entry points ---------------------------------------------------------------------------

// X(wide, ...): wide = 1 when the kernel runs at 16 lanes under AVX-512.  The kernels with 0 build
// lane masks that GCC 12 lowers to scalar code at 64 bytes (measured 2x slower), so they stay AVX2.
#define DSPARK_KERNELS(X)                                                                                             \
    X(0, float, vmax, (const float * x, int64_t n), (x, n))                                                           \
    X(0, int64_t, vtop2, (const float * x, int64_t n, float * first, float * second), (x, n, first, second))          \
    X(1, double, vexp_mass8, (const float * x, int64_t n, float m, float * e, const float * t, double * mass,         \
                           int64_t * count), (x, n, m, e, t, mass, count))                                            \
    X(1, void, vmass8, (const float * x, const float * e, int64_t n, const float * t, double * mass,                  \
                     int64_t * count), (x, e, n, t, mass, count))                                                     \
    X(1, double, vmass_ge, (const float * x, const float * e, int64_t n, float t), (x, e, n, t))                      \
    X(0, void, vcollect, (const float * x, int64_t n, float lo, float hi, std::vector<int32_t> & out),                \
      (x, n, lo, hi, out))                                                                                            \
    X(0, float, top_k_scan, (const float * x, int64_t n, int32_t k, std::vector<cand> & buf,                          \
                          std::vector<float> & bmax), (x, n, k, buf, bmax))                                           \
    X(0, int32_t, emit_row,                                                                                           \
      (const float * x, int64_t n, const cut & c, float tmin, float m, float temp, int32_t * ids,                     \
       double * probs, int32_t cap),                                                                                  \
      (x, n, c, tmin, m, temp, ids, probs, cap))                                                                      \
    X(1, int64_t, sample_f64, (const double * p, int64_t n, double u), (p, n, u))                                     \
    X(1, int64_t, sample_f32, (const float * p, int64_t n, double u), (p, n, u))                                      \
    X(0, int32_t, emit_dense_row,                                                                                     \
      (const float * x, int64_t n, const cut & c, float tmin, float m, float temp, float * probs),                    \
      (x, n, c, tmin, m, temp, probs))

#define DSPARK_KMAP_vmax vmax
#define DSPARK_KMAP_vtop2 top2
#define DSPARK_KMAP_vexp_mass8 exp_mass8
#define DSPARK_KMAP_vmass8 mass8
#define DSPARK_KMAP_vmass_ge mass_ge
#define DSPARK_KMAP_vcollect collect
#define DSPARK_KMAP_top_k_scan top_k
#define DSPARK_KMAP_emit_row emit
#define DSPARK_KMAP_sample_f64 sample_f64
#define DSPARK_KMAP_sample_f32 sample_f32
#define DSPARK_KMAP_emit_dense_row emit_dense
#define DSPARK_CAT_(a, b) a##b
#define DSPARK_CAT(a, b) DSPARK_CAT_(a, b)

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#    define DSPARK_DEF(W, ret, name, params, args)                                                         \
        __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma"))) ret name##_avx512 params {  \
            return K<f16>::DSPARK_CAT(DSPARK_KMAP_, name) args;                                             \
        }                                                                                                    \
        __attribute__((target("avx2,fma"))) ret name##_avx2 params {                                        \
            return K<f8>::DSPARK_CAT(DSPARK_KMAP_, name) args;                                              \
        }                                                                                                    \
        ret name##_base params { return K<f4>::DSPARK_CAT(DSPARK_KMAP_, name) args; }                      \
        ret name params { return (W && g_avx512) ? name##_avx512 args : g_avx2 ? name##_avx2 args : name##_base args; }
bool cpu_has_avx2_fma() {
    __builtin_cpu_init();  // this runs from a static initializer, maybe before libgcc's own
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
// DSPARK_NO_AVX512 set (non-empty) keeps the AVX2 kernels, e.g. to compare the two
bool cpu_has_avx512() {
    const char * off = std::getenv("DSPARK_NO_AVX512");
    if (off && *off) return false;
    return cpu_has_avx2_fma() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}
const bool g_avx2   = cpu_has_avx2_fma();
const bool g_avx512 = cpu_has_avx512();
#else
#    define DSPARK_DEF(W, ret, name, params, args) \
        ret name params { return K<f4>::DSPARK_CAT(DSPARK_KMAP_, name) args; }
#endif
DSPARK_KERNELS(DSPARK_DEF)

float exp_neg(float x) { return K<f4>::exp_neg(x); }

// ---- the chain ------------------------------------------------------------------------------------

struct scratch {
    std::vector<float>   row;    // banned / penalized copy of the input row
    std::vector<float>   e;      // exp(x - max)
    std::vector<cand>    cands;
    std::vector<int32_t> idx, idx2;
    std::vector<float>   bx, be;  // gathered band values / exps
    std::vector<int32_t> list;    // ids with x > lo of the last top_p_full, ascending
    bool                 list_valid = false;
    std::vector<int32_t> win;
    std::vector<float>   bmax;    // top_k's block maxima
};

thread_local scratch g_s;

// The thresholds of the first bracketing pass (logits below the max).
void first_thresholds(float m, float * t) {
    // spaced ~x1.45 where top-p 0.9 .. 0.95 cuts model-like rows (the bracket around the cut then
    // holds hundreds to a few thousand tokens even in a 262k vocabulary)
    static const float d[kFirst] = { 0.5f, 1.0f, 2.0f, 3.0f, 4.5f, 6.5f, 9.5f, 14.0f };
    for (int j = 0; j < kFirst; ++j) t[j] = m - d[j];
}

// top_p over the whole row x[0..n-1] (e = exp(x - max), total their sum): the smallest prefix in
// candidate order whose mass reaches p * total.  Brackets the cut with passes over the row (mass and
// count above several thresholds each: first at fixed distances below the max -- that pass is fused
// with the exp pass, mass0/count0 -- then evenly inside the bracket) until it holds at most 64k
// candidates, gathers those and goes on inside them until a few thousand are left to sort.
cut top_p_full(const float * x, const float * e, int64_t n, float m, double total, double p, const float * t0,
               const double * mass0, const int64_t * count0) {
    scratch &    s       = g_s;
    const double target  = p * total;
    double       above   = 0.0;  // mass of x > hi
    int64_t      n_above = 0;    // count of x > hi
    int64_t      n_gt_lo = n;    // count of x > lo (an upper bound while lo = -inf)
    float        hi      = INFINITY;
    float        lo      = -INFINITY;
    for (int pass = 0; pass < 16; ++pass) {
        float   t[8];
        double  mass[8];
        int64_t count[8];
        int     nt = 8;
        if (pass == 0) {
            nt = kFirst;
            for (int j = 0; j < kFirst; ++j) {
                t[j]     = t0[j];
                mass[j]  = mass0[j];
                count[j] = count0[j];
            }
        } else {
            const float top = std::min(hi, m), bot = lo;
            for (int j = 0; j < 8; ++j) t[j] = top - (top - bot) * (float) (j + 1) / 9.0f;
            if (!(t[0] < top) || !(t[7] > bot) || !std::isfinite(bot)) break;  // cannot split further
            vmass8(x, e, n, t, mass, count);
        }
        int j = 0;
        while (j < nt && !(mass[j] >= target)) ++j;
        if (j > 0) {
            hi      = t[j - 1];
            above   = mass[j - 1];
            n_above = count[j - 1];
        }
        if (j < nt) {
            lo      = t[j];
            n_gt_lo = count[j];
        }
        if (n_gt_lo - n_above <= 65536) break;
    }
    // the candidates above lo, in id order, when few: the kept set is among them, so the output
    // needs no second scan of the row (s.list_valid); the bracket (lo, hi] is taken from them
    s.list_valid = n_gt_lo <= 65536;
    s.idx.clear();
    if (s.list_valid) {
        s.list.clear();
        vcollect(x, n, lo, INFINITY, s.list);
        for (int32_t i : s.list) {
            if (x[i] <= hi) s.idx.push_back(i);
        }
    } else {
        vcollect(x, n, lo, hi, s.idx);
    }
    // refine inside the gathered bracket
    for (int iter = 0; iter < 32 && s.idx.size() > 4096; ++iter) {
        const size_t nb = s.idx.size();
        s.bx.resize(nb);
        s.be.resize(nb);
        float bmin = INFINITY, bmax = -INFINITY;
        for (size_t i = 0; i < nb; ++i) {
            const float v = x[s.idx[i]];
            s.bx[i]       = v;
            s.be[i]       = e[s.idx[i]];
            bmin          = std::min(bmin, v);
            bmax          = std::max(bmax, v);
        }
        if (!(bmax > bmin)) break;  // all equal: ties, sorted below
        float   t[8];
        double  mass[8];
        int64_t count[8];
        for (int j = 0; j < 8; ++j) t[j] = bmax - (bmax - bmin) * (float) (j + 1) / 9.0f;
        vmass8(s.bx.data(), s.be.data(), (int64_t) nb, t, mass, count);
        int j = 0;
        while (j < 8 && !(above + mass[j] >= target)) ++j;
        const float  nhi    = j > 0 ? t[j - 1] : hi;
        const float  nlo    = j < 8 ? t[j] : lo;
        const double nabove = j > 0 ? above + mass[j - 1] : above;
        s.idx2.clear();
        for (size_t i = 0; i < nb; ++i) {
            if (s.bx[i] > nlo && s.bx[i] <= nhi) s.idx2.push_back(s.idx[i]);
        }
        if (s.idx2.size() == nb) break;  // no progress (rounding): sort what is left
        s.idx.swap(s.idx2);
        hi    = nhi;
        lo    = nlo;
        above = nabove;
    }
    s.cands.clear();
    for (int32_t i : s.idx) s.cands.push_back({ x[i], i });
    // the cut: the first candidate (in candidate order) where the running mass from `above` reaches
    // the target.  Quickselect on mass: partition around a middle element, keep the side the cut
    // is on, until a few are left to sort and walk.
    cand * lo_p = s.cands.data();
    cand * hi_p = s.cands.data() + s.cands.size();
    double cum  = above;
    while (hi_p - lo_p > 64) {
        cand * mid = lo_p + (hi_p - lo_p) / 2;
        std::nth_element(lo_p, mid, hi_p, before);
        double left = 0.0;  // mass of [lo_p, mid]
        for (cand * k = lo_p; k <= mid; ++k) left += e[k->id];
        if (cum + left >= target) {
            hi_p = mid + 1;
        } else {
            cum += left;
            lo_p = mid + 1;
        }
    }
    std::sort(lo_p, hi_p, before);
    cut c;
    for (cand * k = lo_p; k < hi_p; ++k) {
        cum += e[k->id];
        if (cum >= target) {
            c.v    = k->x;
            c.id_v = k->id;
            return c;
        }
    }
    // rounding left the target unreached inside the bracket: keep the bracket and all above it
    if (!s.cands.empty()) {
        const cand * last = &s.cands[0];
        for (const cand & k : s.cands) {
            if (before(*last, k)) last = &k;
        }
        c.v    = last->x;
        c.id_v = last->id;
    } else if (hi < INFINITY) {
        c.v    = hi;  // (x > hi) only; nothing equals hi outside the empty bracket
        c.id_v = -1;
    }
    return c;
}

// The tempered softmax over the kept members of s.list (ids ascending): emit_row without a scan.
int32_t emit_list(const float * x, const cut & c, float tmin, float m, float temp, int32_t * ids, double * probs,
                  int32_t cap) {
    const float mt    = m / temp;
    int32_t     r     = 0;
    double      total = 0.0;
    for (int32_t i : g_s.list) {
        const float v = x[i];
        if (!(v >= tmin && (v > c.v || (v == c.v && i <= c.id_v)))) continue;
        const float ev = exp_neg(v / temp - mt);
        if (!(ev > 0.0f)) continue;
        if (r >= cap) return -1;
        ids[r]   = i;
        probs[r] = ev;
        total += ev;
        ++r;
    }
    const double inv = 1.0 / total;
    for (int32_t j = 0; j < r; ++j) probs[j] *= inv;
    return r;
}

// The chain; the result goes sparse to out_ids / out_probs (cap entries) or, when dense is not
// null, to dense[0..n_vocab-1] (float, zeros outside the kept set).
int32_t chain(const float * row_in, int32_t n_vocab, const dspark_chain_params & P, const int32_t * window,
              int32_t n_window, const int32_t * banned, int32_t n_banned, int32_t * out_ids, double * out_probs,
              int32_t cap, float * dense = nullptr) {
    scratch &     s = g_s;
    const float * x = row_in;
    const int64_t n = n_vocab;

    // logit bias (-inf) and penalties on a copy of the row
    const bool pen = n_window > 0 &&
                     (P.repeat_penalty != 1.0f || P.frequency_penalty != 0.0f || P.presence_penalty != 0.0f);
    if (pen || n_banned > 0) {
        s.row.assign(row_in, row_in + n);
        for (int32_t i = 0; i < n_banned; ++i) s.row[banned[i]] = -INFINITY;
        if (pen) {
            s.win.assign(window, window + n_window);
            std::sort(s.win.begin(), s.win.end());
            for (size_t i = 0; i < s.win.size();) {
                size_t j = i;
                while (j < s.win.size() && s.win[j] == s.win[i]) ++j;
                const int   count = (int) (j - i);
                float &     l     = s.row[s.win[i]];
                if (l <= 0) {
                    l *= P.repeat_penalty;
                } else {
                    l /= P.repeat_penalty;
                }
                l -= float(count) * P.frequency_penalty + float(count > 0) * P.presence_penalty;
                i = j;
            }
        }
        x = s.row.data();
    }

    // top_k: its scan finds the k candidates (unordered, in s.cands) and the max in one pass
    const bool  top_k = P.temperature > 0.0f && P.top_k > 0 && P.top_k < n_vocab;
    const float m     = top_k ? top_k_scan(x, n, P.top_k, s.cands, s.bmax) : vmax(x, n);
    if (!(m > -INFINITY)) return fail(DSPARK_E_INVALID, "no finite logit survives the sampler chain");

    if (P.temperature <= 0.0f) {  // greedy: the first maximum
        int64_t i = 0;
        while (!(x[i] == m)) ++i;
        if (dense) {
            std::fill(dense, dense + n, 0.0f);
            dense[i] = 1.0f;
            return 1;
        }
        if (cap < 1) return fail(DSPARK_E_INVALID, "output capacity %d < 1", cap);
        out_ids[0]   = (int32_t) i;
        out_probs[0] = 1.0;
        return 1;
    }

    const float tmin = P.min_p > 0.0f ? m + logf(P.min_p) : -INFINITY;
    const bool  top_p = P.top_p < 1.0f;

    int32_t r;
    if (!top_k && !top_p) {
        r = dense ? emit_dense_row(x, n, cut{}, tmin, m, P.temperature, dense)
                  : emit_row(x, n, cut{}, tmin, m, P.temperature, out_ids, out_probs, cap);
    } else if (!top_k) {
        // top_p over the whole row; when min_p alone already cuts above top_p's prefix, no sort at all
        s.e.resize((size_t) n);
        float        t0[kFirst];
        double       mass0[kFirst];
        int64_t      count0[kFirst];
        first_thresholds(m, t0);
        const double total = vexp_mass8(x, n, m, s.e.data(), t0, mass0, count0);
        cut          c;
        bool         need_cut = true;
        if (P.min_p > 0.0f) {
            // mass of x >= tmin: min_p's set is the smaller one when it stays below top_p's target
            need_cut = vmass_ge(x, s.e.data(), n, tmin) >= (double) P.top_p * total;
        }
        s.list_valid = false;
        if (need_cut) c = top_p_full(x, s.e.data(), n, m, total, (double) P.top_p, t0, mass0, count0);
        if (dense) {
            r = emit_dense_row(x, n, c, tmin, m, P.temperature, dense);
        } else if (s.list_valid) {
            r = emit_list(x, c, tmin, m, P.temperature, out_ids, out_probs, cap);
        } else {
            r = emit_row(x, n, c, tmin, m, P.temperature, out_ids, out_probs, cap);
        }
    } else {
        // top_k: the k candidates, sorted; top_p / min_p / softmax on them
        std::sort(s.cands.begin(), s.cands.end(), before);
        size_t keep = s.cands.size();
        if (top_p && keep > 0) {
            const float mk = s.cands[0].x;
            double      total = 0.0;
            s.be.resize(keep);
            for (size_t i = 0; i < keep; ++i) {
                s.be[i] = exp_neg(s.cands[i].x - mk);
                total += s.be[i];
            }
            const double target = (double) P.top_p * total;
            double       cum    = 0.0;
            for (size_t i = 0; i < keep; ++i) {
                cum += s.be[i];
                if (cum >= target) {
                    keep = i + 1;
                    break;
                }
            }
        }
        while (keep > 1 && !(s.cands[keep - 1].x >= tmin)) --keep;
        s.cands.resize(keep);
        std::sort(s.cands.begin(), s.cands.end(), [](const cand & a, const cand & b) { return a.id < b.id; });
        const float mt    = m / P.temperature;
        double      total = 0.0;
        r                 = 0;
        if (dense) std::fill(dense, dense + n, 0.0f);
        for (const cand & c : s.cands) {
            const float ev = exp_neg(c.x / P.temperature - mt);
            if (!(ev > 0.0f)) continue;
            if (dense) {
                dense[c.id] = ev;
            } else {
                if (r >= cap) return fail(DSPARK_E_INVALID, "output capacity %d too small", cap);
                out_ids[r]   = c.id;
                out_probs[r] = ev;
            }
            total += ev;
            ++r;
        }
        if (dense) {
            for (const cand & c : s.cands) dense[c.id] = (float) (dense[c.id] / total);
        } else {
            for (int32_t i = 0; i < r; ++i) out_probs[i] /= total;
        }
    }
    if (r < 0) return fail(DSPARK_E_INVALID, "output capacity %d too small (n_vocab %d always suffices)", cap, n_vocab);
    if (r == 0) return fail(DSPARK_E_INVALID, "no finite logit survives the sampler chain");
    return r;
}

// argmax and top-2 gap of one row: the first maximum, then the largest value at any other index
void argmax_row(const float * x, int64_t n, int32_t * id, float * gap) {
    float a, b;
    *id = (int32_t) vtop2(x, n, &a, &b);
    if (gap) *gap = a - b;
}

}  // namespace

// ---- C entry points --------------------------------------------------------------------------------

namespace {
int32_t check_chain_args(const float * logits, int32_t n_vocab, const dspark_chain_params * params,
                         const int32_t * window, int32_t n_window, const int32_t * banned, int32_t n_banned) {
    if (!logits || !params) return fail(DSPARK_E_INVALID, "null argument");
    if (n_vocab <= 0) return fail(DSPARK_E_INVALID, "n_vocab %d must be > 0", n_vocab);
    if (n_window < 0 || (n_window > 0 && !window)) return fail(DSPARK_E_INVALID, "bad penalty window");
    if (n_banned < 0 || (n_banned > 0 && !banned)) return fail(DSPARK_E_INVALID, "bad banned list");
    const dspark_chain_params & P = *params;
    if (!std::isfinite(P.temperature) || !std::isfinite(P.top_p) || !std::isfinite(P.min_p) ||
        !std::isfinite(P.repeat_penalty) || !std::isfinite(P.frequency_penalty) || !std::isfinite(P.presence_penalty)) {
        return fail(DSPARK_E_INVALID, "sampler parameters must be finite");
    }
    if (P.top_p < 0.0f || P.top_p > 1.0f) return fail(DSPARK_E_INVALID, "top_p %g outside [0, 1]", (double) P.top_p);
    if (P.min_p < 0.0f || P.min_p > 1.0f) return fail(DSPARK_E_INVALID, "min_p %g outside [0, 1]", (double) P.min_p);
    if (!(P.repeat_penalty > 0.0f)) return fail(DSPARK_E_INVALID, "repeat_penalty %g must be > 0", (double) P.repeat_penalty);
    for (int32_t i = 0; i < n_window; ++i) {
        if (window[i] < 0 || window[i] >= n_vocab) return fail(DSPARK_E_INVALID, "penalty window token %d out of vocab (%d)", window[i], n_vocab);
    }
    for (int32_t i = 0; i < n_banned; ++i) {
        if (banned[i] < 0 || banned[i] >= n_vocab) return fail(DSPARK_E_INVALID, "banned token %d out of vocab (%d)", banned[i], n_vocab);
    }
    return DSPARK_OK;
}
}  // namespace

extern "C" int32_t dspark_chain_dist(const float * logits, int32_t n_vocab, const dspark_chain_params * params,
                                     const int32_t * window, int32_t n_window, const int32_t * banned,
                                     int32_t n_banned, int32_t * out_ids, double * out_probs, int32_t cap) {
    return dspark::guard(__func__, [&]() -> int32_t {
        const int32_t rc = check_chain_args(logits, n_vocab, params, window, n_window, banned, n_banned);
        if (rc != DSPARK_OK) return rc;
        if (!out_ids || !out_probs) return fail(DSPARK_E_INVALID, "null argument");
        if (cap <= 0) return fail(DSPARK_E_INVALID, "output capacity %d must be > 0", cap);
        const int32_t r = chain(logits, n_vocab, *params, window, n_window, banned, n_banned, out_ids, out_probs, cap);
        if (r > 0) ok();
        return r;
    });
}

extern "C" int32_t dspark_chain_dense(const float * logits, int32_t n_vocab, const dspark_chain_params * params,
                                      const int32_t * window, int32_t n_window, const int32_t * banned,
                                      int32_t n_banned, float * out_probs) {
    return dspark::guard(__func__, [&]() -> int32_t {
        const int32_t rc = check_chain_args(logits, n_vocab, params, window, n_window, banned, n_banned);
        if (rc != DSPARK_OK) return rc;
        if (!out_probs) return fail(DSPARK_E_INVALID, "null argument");
        const int32_t r = chain(logits, n_vocab, *params, window, n_window, banned, n_banned, nullptr, nullptr, 0,
                                out_probs);
        if (r == 0) return fail(DSPARK_E_INVALID, "no finite logit survives the sampler chain");
        if (r > 0) ok();
        return r;
    });
}

namespace {
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

extern "C" int32_t dspark_sample_cdf_f32(const float * probs, int32_t n, double u) {
    return sample_cdf<float, sample_f32>(__func__, probs, n, u);
}

extern "C" int32_t dspark_sample_cdf(const double * probs, int32_t n, double u) {
    return sample_cdf<double, sample_f64>(__func__, probs, n, u);
}

extern "C" int32_t dspark_argmax_f32(const float * x, int32_t n_rows, int32_t n, int32_t * ids, float * margin) {
    return dspark::guard(__func__, [&]() -> int32_t {
        if (!x || !ids || n_rows <= 0 || n <= 0) return fail(DSPARK_E_INVALID, "bad argument");
        for (int32_t r = 0; r < n_rows; ++r) {
            argmax_row(x + (size_t) r * n, n, ids + r, margin ? margin + r : nullptr);
        }
        ok();
        return DSPARK_OK;
    });
}

namespace dspark {
// used by dspark_argmax_rows (dspark_shim.cpp) on llama.cpp's output rows
void argmax_row_f32(const float * x, int64_t n, int32_t * id, float * gap) { argmax_row(x, n, id, gap); }

// the k largest (ties: lower index), for dspark_top_k_f32
void top_k_f32(const float * x, int64_t n, int32_t k, int32_t * ids) {
    top_k_scan(x, n, k, g_s.cands, g_s.bmax);
    size_t r = 0;
    for (const cand & c : g_s.cands) ids[r++] = c.id;
    // fewer than k finite values: fill with the lowest-index non-candidates (-inf / NaN) like nth_element
    if (r < (size_t) k) {
        std::vector<char> taken((size_t) n, 0);
        for (size_t j = 0; j < r; ++j) taken[(size_t) ids[j]] = 1;
        for (int64_t i = 0; i < n && r < (size_t) k; ++i) {
            if (!taken[(size_t) i]) ids[r++] = (int32_t) i;
        }
    }
}
}  // namespace dspark
