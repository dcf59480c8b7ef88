// Concern: the chain's result written out (dspark_result.h): the sparse and dense softmax kernels,
// written once over a vector type on K<V> (dspark_simd.h), their per-ISA entry points, and the
// sparse write-out over a list of candidate ids.  Calls down into dspark_simd.cpp only.
#include "dspark_result.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace dspark {

namespace {

template <class V>
struct KEmit : K<V> {
    DSPARK_K_BASE(V)

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

    static DSPARK_INLINE void scale(double * p, int64_t n, double f) {
        int64_t i = 0;
        for (; i + LD <= n; i += LD) store_d(p + i, load_d(p + i) * f);
        for (; i < n; ++i) p[i] *= f;
    }

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

}  // namespace

#define DSPARK_KMAP_emit_row emit
#define DSPARK_KMAP_emit_dense_row emit_dense
#define DSPARK_DEF_RESULT(W, ret, name, params, args) DSPARK_DEF(KEmit, W, ret, name, params, args)
DSPARK_RESULT_KERNELS(DSPARK_DEF_RESULT)

// The tempered softmax over the kept members of list (ids ascending): emit_row without a scan.
int32_t emit_list(const std::vector<int32_t> & list, const float * x, const cut & c, float tmin, float m, float temp,
                  int32_t * ids, double * probs, int32_t cap) {
    const float mt    = m / temp;
    int32_t     r     = 0;
    double      total = 0.0;
    for (int32_t i : list) {
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

}  // namespace dspark
