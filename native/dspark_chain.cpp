// Concern: the sampler chain (dspark_chain_dist / dspark_chain_dense in dspark_shim.h): llama.cpp's
// chain on one float logits row, its arguments checked, its result sparse or dense.
//
// The chain is llama.cpp's (src/llama-sampler.cpp, order of common/sampling.cpp): logit bias -inf
// on banned ids -> penalties -> top_k -> top_p -> min_p -> temperature -> softmax.  The kept set
// and the probabilities are the same as llama.cpp's; what differs is the work: nothing is sorted
// but the few candidates around a cut.  top_p over the whole vocabulary (top_k off) finds its cut
// by bracketing: masses above several thresholds in one vectorized pass, then the same inside the
// bracket, until a few thousand candidates are left to sort.  Every kept set is a prefix of the
// row in (logit desc, id asc) order, so the output is one predicate scan in id order.
//
// Built on the whole-row scans (dspark_scan.h) and the result kernels (dspark_result.h); calls down
// into those and dspark_status.cpp, and nothing calls into this file but the C ABI.
#include "dspark_internal.h"
#include "dspark_result.h"
#include "dspark_scan.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace dspark {

namespace {

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
            r = emit_list(s.list, x, c, tmin, m, P.temperature, out_ids, out_probs, cap);
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

// ---- the arguments, checked -------------------------------------------------------------------------

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

}  // namespace dspark

using dspark::chain;
using dspark::check_chain_args;
using dspark::fail;
using dspark::ok;

// ---- C entry points --------------------------------------------------------------------------------

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
