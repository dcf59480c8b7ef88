// Concern: the chain's result written out (not installed, not part of the ABI): the tempered
// softmax over the kept set -- a prefix of the row in candidate order, cut by top-p / top-k at a
// `cut`, and the min-p floor -- sparse (ids ascending, double probabilities, as dspark_chain_dist
// returns it) or dense (a float per id, as dspark_chain_dense does).  Defined in dspark_result.cpp.
#pragma once

#include "dspark_simd.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace dspark {

// The kept set is {x > v} U {x == v, id <= id_v} (a prefix in candidate order); v = -inf with
// id_v = INT32_MAX means "every finite logit".
struct cut {
    float   v    = -INFINITY;
    int32_t id_v = INT32_MAX;
};

// The result kernels, each dispatched to the CPU's widest kernel (dspark_simd.h):
//   emit_row        the kept set (x >= tmin, and the prefix up to c) sparse to ids / probs (cap
//                   entries; returns the count, or -1 when cap is too small)
//   emit_dense_row  the same dense to probs[0..n-1], zeros outside it; returns the count
#define DSPARK_RESULT_KERNELS(X)                                                                                      \
    X(0, int32_t, emit_row,                                                                                           \
      (const float * x, int64_t n, const cut & c, float tmin, float m, float temp, int32_t * ids,                     \
       double * probs, int32_t cap),                                                                                  \
      (x, n, c, tmin, m, temp, ids, probs, cap))                                                                      \
    X(0, int32_t, emit_dense_row,                                                                                     \
      (const float * x, int64_t n, const cut & c, float tmin, float m, float temp, float * probs),                    \
      (x, n, c, tmin, m, temp, probs))

DSPARK_RESULT_KERNELS(DSPARK_DECL)

// emit_row restricted to the ids of `list` (ascending, a superset of the kept set): no row scan
int32_t emit_list(const std::vector<int32_t> & list, const float * x, const cut & c, float tmin, float m, float temp,
                  int32_t * ids, double * probs, int32_t cap);

}  // namespace dspark
