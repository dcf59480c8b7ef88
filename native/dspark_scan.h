// Concern: scans of whole rows (not installed, not part of the ABI).  One vectorized pass each over
// a float row of the vocabulary: the maximum, the top two, masses and counts above thresholds, the
// ids in a band, the k largest, an inverse-CDF draw.  The sampler chain (dspark_chain.cpp) is built
// on them; the read-out of llama.cpp's rows (dspark_shim.cpp) uses argmax_row_f32.  Defined in
// dspark_scan.cpp, which also holds the entry points that are one scan (dspark_argmax_f32,
// dspark_top_k_f32, dspark_sample_cdf*).
#pragma once

#include "dspark_simd.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace dspark {

// candidate order: logit descending, then id ascending (the tie rule of every cut)
struct cand {
    float   x;
    int32_t id;
};

inline bool before(const cand & a, const cand & b) { return a.x > b.x || (a.x == b.x && a.id < b.id); }

constexpr int kFirst = 8;  // thresholds of the first (fused with exp) top-p bracketing pass (vexp_mass8)

// The scans, each dispatched to the CPU's widest kernel (dspark_simd.h):
//   vmax            the maximum of x[0..n-1] (NaN ignored; -inf when none is larger)
//   vtop2           the first index of the maximum; *first, *second <- the two largest values
//   vexp_mass8      e[i] <- exp(x[i] - m), returns their sum; mass[j], count[j] <- the mass of e and
//                   the count over x > t[j], j < kFirst (one pass)
//   vmass8          the same over a given e, for 8 thresholds
//   vmass_ge        the mass of e over x >= t
//   vcollect        appends to out the ids i with lo < x[i] <= hi (ascending)
//   top_k_scan      buf <- the k first candidates of the row (unordered); returns the maximum
//   sample_f64/_f32 inverse-CDF index of u in the weights p[0..n-1]; -1 when they are not summable
#define DSPARK_SCAN_KERNELS(X)                                                                                        \
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
    X(1, int64_t, sample_f64, (const double * p, int64_t n, double u), (p, n, u))                                     \
    X(1, int64_t, sample_f32, (const float * p, int64_t n, double u), (p, n, u))

DSPARK_SCAN_KERNELS(DSPARK_DECL)

// id <- the first index of the maximum of x[0..n-1]; gap (if not null) <- max - the largest value
// at any other index (NaN ignored).  The read-out of llama.cpp's output rows (dspark_argmax_rows).
void argmax_row_f32(const float * x, int64_t n, int32_t * id, float * gap);

}  // namespace dspark
