// Concern: the base of the vector kernels and their per-ISA dispatch (not installed, not part of
// the ABI).  The GCC/Clang vector types; K<V>, the primitives every kernel is written with (loads,
// splats, widening to double, masks, exp of x <= 0, horizontal sums); DSPARK_DEF, which turns one
// kernel written over V into its AVX-512 / AVX2+FMA / baseline entry points and a dispatcher picking
// one by the CPU's features (read once, in dspark_simd.cpp).  The kernels themselves live with their
// concern: dspark_scan.cpp (whole-row scans), dspark_result.cpp (the kept set written out).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

// Written once over a GCC/Clang vector type V (16 lanes under AVX-512, 8 under AVX2+FMA, picked at
// run time on x86-64; else 4 lanes: SSE2 / NEON), always inlined into the per-ISA entry points.

#define DSPARK_INLINE inline __attribute__((always_inline))
#if defined(__GNUC__)
#    pragma GCC diagnostic ignored "-Wpsabi"  // 32/64-byte vectors only inside the AVX2/AVX-512 functions
#endif

namespace dspark {

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

    // 2^n for a float n holding an integer in [-126, 127], from the exponent bits
    static DSPARK_INLINE float pow2i(float n) {
        const int32_t bits = ((int32_t) n + 127) << 23;
        float         sc;
        std::memcpy(&sc, &bits, sizeof(sc));
        return sc;
    }
    static DSPARK_INLINE V pow2i(V n) { return (V) ((__builtin_convertvector(n, VI) + 127) << 23); }

    // exp(xc) for xc in [kExpLo, 0]: the reduction, the polynomial and 2^n (T = V or float)
    template <class T>
    static DSPARK_INLINE T exp_core(T xc) {
        const T n = (xc * kLog2e + kRound) - kRound;
        T       r = xc - n * kLn2Hi;
        r         = r - n * kLn2Lo;
        T p = T{} + kC6;
        p = p * r + kC5;
        p = p * r + kC4;
        p = p * r + kC3;
        p = p * r + kC2;
        p = p * r + 1.0f;
        p = p * r + 1.0f;
        return p * pow2i(n);
    }

    template <class T>
    static DSPARK_INLINE T exp_neg(T x) {  // T = V or float
        if constexpr (std::is_same<T, float>::value) {
            const bool zero = !(x >= kExpLo);
            return zero ? 0.0f : exp_core(zero ? 0.0f : x);
        } else {
            const VI zero = !(x >= splat(kExpLo));
            return zero ? splat(0.0f) : exp_core(zero ? splat(0.0f) : x);
        }
    }

    // Sums: float lanes over 16 blocks, then double lanes (the float partial sums stay exact to
    // ~1e-7 of a 16-term sum; the totals to double rounding of those).
    static constexpr int64_t kChunk = 16 * L;
    static DSPARK_INLINE double hsum(VD a) {
        double t = 0.0;
        for (int j = 0; j < LD; ++j) t += a[j];
        return t;
    }
};

// The members of K<V> a kernel struct derived from it uses unqualified (a dependent base's names
// are not found otherwise).
#define DSPARK_K_BASE(V)                                                                                \
    using B  = K<V>;                                                                                    \
    using VI = typename B::VI;                                                                          \
    using VD = typename B::VD;                                                                          \
    using B::L;                                                                                         \
    using B::LD;                                                                                        \
    using B::kChunk;                                                                                    \
    using B::load;                                                                                      \
    using B::store;                                                                                     \
    using B::splat;                                                                                     \
    using B::lo_d;                                                                                      \
    using B::hi_d;                                                                                      \
    using B::widen_sum;                                                                                 \
    using B::exp_core;                                                                                  \
    using B::load_d;                                                                                    \
    using B::store_d;                                                                                   \
    using B::any;                                                                                       \
    using B::all;                                                                                       \
    using B::exp_neg;                                                                                   \
    using B::hsum;

// exp(x) for x <= 0, one float (the kernels' polynomial; 0 below -87.3)
inline float exp_neg(float x) { return K<f4>::exp_neg(x); }

// ---- per-ISA entry points ---------------------------------------------------------------------------

// A kernel list X(wide, ret, name, params, args) per concern (DSPARK_SCAN_KERNELS in dspark_scan.h,
// DSPARK_RESULT_KERNELS in dspark_result.h): wide = 1 when the kernel runs at 16 lanes under
// AVX-512.  The kernels with 0 build lane masks that GCC 12 lowers to scalar code at 64 bytes
// (measured 2x slower), so they stay AVX2.  DSPARK_DECL declares the dispatcher `name`; DSPARK_DEF,
// in the kernels' own file, defines it over KS<V>::DSPARK_KMAP_name (a macro naming KS's member).
#define DSPARK_DECL(W, ret, name, params, args) ret name params;
#define DSPARK_CAT_(a, b) a##b
#define DSPARK_CAT(a, b) DSPARK_CAT_(a, b)

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// the CPU's features, read once at load time (dspark_simd.cpp); DSPARK_NO_AVX512 set (non-empty)
// keeps the AVX2 kernels, e.g. to compare the two
extern const bool g_avx2;
extern const bool g_avx512;
#    define DSPARK_DEF(KS, W, ret, name, params, args)                                                   \
        static __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma"))) ret name##_avx512 \
            params {                                                                                     \
            return KS<f16>::DSPARK_CAT(DSPARK_KMAP_, name) args;                                         \
        }                                                                                                \
        static __attribute__((target("avx2,fma"))) ret name##_avx2 params {                              \
            return KS<f8>::DSPARK_CAT(DSPARK_KMAP_, name) args;                                          \
        }                                                                                                \
        static ret name##_base params { return KS<f4>::DSPARK_CAT(DSPARK_KMAP_, name) args; }          \
        ret name params { return (W && g_avx512) ? name##_avx512 args : g_avx2 ? name##_avx2 args : name##_base args; }
#else
#    define DSPARK_DEF(KS, W, ret, name, params, args) \
        ret name params { return KS<f4>::DSPARK_CAT(DSPARK_KMAP_, name) args; }
#endif

}  // namespace dspark
