// pyllama-dspark native shim: a plain C ABI over the parts of llama.cpp that Python cannot reach
// through llama-cpp-python (the staging C++ API in src/llama-ext.h) plus a small on-device
// Markov-bias graph, and llama.cpp's sampler chain at C speed for large vocabularies.  Every function
// that can fail returns a negative status and leaves a message in dspark_last_error(); nothing here
// aborts on input it can check, and no C++ exception crosses this ABI (DSPARK_E_INTERNAL instead).
#pragma once

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#    define DSPARK_API __declspec(dllexport)
#else
#    define DSPARK_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

struct llama_context;
struct llama_model;

#define DSPARK_ABI_VERSION 1
#define DSPARK_MAX_TARGET_LAYERS 64

enum dspark_status {
    DSPARK_OK            = 0,
    DSPARK_E_INVALID     = -1,  // bad argument (checked before calling llama.cpp)
    DSPARK_E_STATE       = -2,  // call not valid in the current state (e.g. nothing captured yet)
    DSPARK_E_LLAMA       = -3,  // llama.cpp returned an error (its code is in the message)
    DSPARK_E_IO          = -4,  // file could not be read
    DSPARK_E_UNSUPPORTED = -5,  // the model lacks what was asked for (no confidence head, ...)
    DSPARK_E_INTERNAL    = -6,  // a C++ exception inside the shim (out of memory, ...): see the message
};

DSPARK_API int32_t      dspark_abi_version(void);
DSPARK_API const char * dspark_last_error(void);       // thread-local; "" when the last call succeeded
DSPARK_API void *       dspark_llama_backend_init_address(void);  // &llama_backend_init as this library binds it
// Test hook for the exception guard: kind 0 throws std::runtime_error, 1 std::bad_alloc, 2 a
// non-std exception, 3 allocates 2^62 floats; each returns DSPARK_E_INTERNAL.  Other kinds: DSPARK_OK.
DSPARK_API int32_t      dspark_test_throw(int32_t kind);

// ---------------------------------------------------------------------------------------------
// Target: layer-input capture and decoding through a reusable batch.
typedef struct dspark_target dspark_target;

// Enables capture of the inputs of the given layer ids (lid = input of 0-based layer lid, 0 =
// token embeddings).  Valid ids: 0..n_layer-1, or 0..n_layer when allow_last != 0 (architectures
// whose graph fills the last index).  n_ids may be 0 (decode only, no capture).  Must be called before the first decode that should capture.
DSPARK_API dspark_target * dspark_target_new(struct llama_context * ctx, const int32_t * layer_ids, int32_t n_ids,
                                  int32_t allow_last);
DSPARK_API void            dspark_target_free(dspark_target * t);

// Decodes n rows (token, pos, seq_id, output flag) in one llama_decode.  Features of every row are
// captured.  Returns llama_decode's code (0 ok, 1 no KV slot) or a negative dspark_status.
DSPARK_API int32_t dspark_target_decode(dspark_target * t, const int32_t * tokens, const int32_t * pos,
                             const int32_t * seq_ids, const int8_t * outputs, int32_t n);
// Rows captured by the last successful dspark_target_decode (0 before any).
DSPARK_API int32_t dspark_target_n_captured(const dspark_target * t);
// Row width of the gathered features: n_ids * n_embd of the target.
DSPARK_API int32_t dspark_target_feature_width(const dspark_target * t);
// Copies captured rows row0..row0+n_rows-1 token-major into out [n_rows, n_ids*n_embd].
DSPARK_API int32_t dspark_target_copy_features(const dspark_target * t, int32_t row0, int32_t n_rows, float * out);

// ---------------------------------------------------------------------------------------------
// Output read-out helpers (any context): argmax of logits rows i0..i0+n-1 of the last decode, and
// the gap between the best and second-best logit of each row (near-tie detection).  A row of a
// sequence with a backend sampler (llama_set_sampler) is read from what the device sampled: a
// greedy chain's token (margin +inf: unknown) or a top-2 chain's two candidates (no logits row).
DSPARK_API int32_t dspark_argmax_rows(struct llama_context * ctx, int32_t i0, int32_t n, int32_t * ids, float * margin);
// ids[0..k-1] = indices of the k largest of x[0..n-1] (in no particular order; ties go to the
// lower index).  The sampler chain's top-k selection.
DSPARK_API int32_t dspark_top_k_f32(const float * x, int32_t n, int32_t k, int32_t * ids);
// dspark_argmax_rows on n_rows float rows of n values each (row-major x).
DSPARK_API int32_t dspark_argmax_f32(const float * x, int32_t n_rows, int32_t n, int32_t * ids, float * margin);

// ---------------------------------------------------------------------------------------------
// llama.cpp's sampler chain (common/sampling.cpp's order; DRY, typical-p, top-n-sigma, XTC and
// mirostat are not supported): logit bias -inf on banned ids -> penalties -> top_k -> top_p ->
// min_p -> temperature -> softmax, the same kept set and probabilities as llama.cpp's samplers.
typedef struct dspark_chain_params {
    float   temperature;        // <= 0: greedy: the first argmax of the banned / penalized row
    int32_t top_k;              // <= 0 or >= n_vocab: off
    float   top_p;              // in [0, 1]; 1: off
    float   min_p;              // in [0, 1]; 0: off
    float   repeat_penalty;     // > 0; 1: off
    float   frequency_penalty;  // 0: off
    float   presence_penalty;   // 0: off
} dspark_chain_params;

// The distribution the chain samples from for one logits row, sparse: out_ids[0..r-1] the kept
// token ids in ascending order, out_probs[0..r-1] their probabilities (> 0, summing to 1); returns
// r >= 1 or a negative status (DSPARK_E_INVALID also when no finite logit survives, or when more
// than cap tokens are kept: cap = n_vocab always suffices).  window[0..n_window-1]: the token ids
// the penalties count (the last penalty_last_n of the sequence); banned[0..n_banned-1]: ids that
// can never be drawn.  The row is not modified.
DSPARK_API int32_t dspark_chain_dist(const float * logits, int32_t n_vocab, const dspark_chain_params * params,
                                     const int32_t * window, int32_t n_window, const int32_t * banned,
                                     int32_t n_banned, int32_t * out_ids, double * out_probs, int32_t cap);
// The same distribution dense: out_probs[0..n_vocab-1] (float) for every token id, 0 outside the kept
// set; returns the number kept (>= 1) or a negative status.  For chains that keep most of the
// vocabulary (filters off): no ids to write, half the bytes of a double.
DSPARK_API int32_t dspark_chain_dense(const float * logits, int32_t n_vocab, const dspark_chain_params * params,
                                      const int32_t * window, int32_t n_window, const int32_t * banned,
                                      int32_t n_banned, float * out_probs);
// Inverse-CDF draw from weights probs[0..n-1] (>= 0, positive sum), u in [0, 1): the first index
// whose running sum exceeds u * total (when rounding leaves none, the last positive weight); the
// running sums add whole blocks of 256 first, so the last bits can differ from a sequential cumsum.
// Returns the index or a negative status.
DSPARK_API int32_t dspark_sample_cdf(const double * probs, int32_t n, double u);
DSPARK_API int32_t dspark_sample_cdf_f32(const float * probs, int32_t n, double u);

// ---------------------------------------------------------------------------------------------
// Draft: DFlash / DSpark draft context (created by the caller with ctx_other = target context).
typedef struct dspark_draft_meta {
    int32_t n_target_layers;
    int32_t target_layers[DSPARK_MAX_TARGET_LAYERS];
    int32_t block_size;
    int32_t mask_token_id;
    int32_t sample_from_anchor;
    int32_t causal;
    int32_t has_confidence;   // metadata says so AND conf_proj.weight exists
    int32_t has_markov;
    int32_t markov_rank;
    int32_t has_d2t;
    int32_t n_vocab_draft;
    int32_t n_embd;
} dspark_draft_meta;

// Reads the draft metadata from its GGUF file (no model load needed).
DSPARK_API int32_t dspark_read_draft_meta(const char * path, dspark_draft_meta * out);

typedef struct dspark_draft dspark_draft;

// Sets up the draft context like llama.cpp's driver: nextn (confidence) rows on, attention causal
// per metadata.  The target is used for feature-row width checks and direct injection.
DSPARK_API dspark_draft * dspark_draft_new(struct llama_context * dft, const dspark_target * target, const char * path);
DSPARK_API void           dspark_draft_free(dspark_draft * d);
DSPARK_API int32_t        dspark_draft_get_meta(const dspark_draft * d, dspark_draft_meta * out);

// Injects n feature rows [n, width] at positions pos[i] of seq_id.
DSPARK_API int32_t dspark_draft_inject(dspark_draft * d, const float * rows, int32_t n, const int32_t * pos, int32_t seq_id);
// Injects the target's captured rows row0..row0+n-1 at positions pos0..pos0+n-1 (no copy to Python).
DSPARK_API int32_t dspark_draft_inject_captured(dspark_draft * d, int32_t row0, int32_t n, int32_t pos0, int32_t seq_id);
// Decodes n_seqs blocks of block_len tokens each (tokens [n_seqs*block_len], positions from pos0[s]),
// every row flagged as output (the draft graph ignores the output mask).
DSPARK_API int32_t dspark_draft_decode_blocks(dspark_draft * d, const int32_t * tokens, int32_t block_len,
                                   const int32_t * pos0, const int32_t * seq_ids, int32_t n_seqs);
// Confidence c = element 0 of nextn rows i0..i0+n-1 of the last draft decode.
DSPARK_API int32_t dspark_draft_confidence(dspark_draft * d, int32_t i0, int32_t n, float * out);

// ---------------------------------------------------------------------------------------------
// Markov head on the backend: bias(prev) = W2 . W1[prev] (times markov_w2.scale when present).
typedef struct dspark_markov dspark_markov;

// Loads markov_w1/markov_w2 (+ scale) from the draft GGUF onto the first GPU device when use_gpu
// and one exists, else the CPU backend.
DSPARK_API dspark_markov * dspark_markov_new(const char * draft_path, int32_t use_gpu, int32_t n_threads);
DSPARK_API void            dspark_markov_free(dspark_markov * m);
DSPARK_API int32_t         dspark_markov_rank(const dspark_markov * m);
DSPARK_API int32_t         dspark_markov_n_vocab(const dspark_markov * m);        // rows of W1 (target vocab)
DSPARK_API int32_t         dspark_markov_n_vocab_draft(const dspark_markov * m);  // rows of W2 (draft vocab)
DSPARK_API const char *    dspark_markov_backend_name(const dspark_markov * m);
// out [n, n_vocab_draft] = bias rows for prev[0..n-1].
DSPARK_API int32_t dspark_markov_bias(dspark_markov * m, const int32_t * prev, int32_t n, float * out);
// out [n, rank] = W1[prev] rows (the confidence head's second input).
DSPARK_API int32_t dspark_markov_w1_rows(dspark_markov * m, const int32_t * prev, int32_t n, float * out);
// Both in one device call: out_bias [n, n_vocab_draft] = bias rows, out_w1 [n, rank] = W1[prev] rows
// (either output may be NULL, not both).  Used once per block position when sampling at T > 0.
DSPARK_API int32_t dspark_markov_bias_w1(dspark_markov * m, const int32_t * prev, int32_t n, float * out_bias,
                                         float * out_w1);

// The bias of a difference vector d [rank] (e.g. W1[x] - W1[a]: what re-conditions a row from token a
// to token x) on some draft rows only: out[i] = scale * W2[rows[i]] . d, i < n; rows NULL: every draft
// row (out [n_vocab_draft], n ignored).  One device call.
DSPARK_API int32_t dspark_markov_bias_dot(dspark_markov * m, const float * d, const int32_t * rows, int32_t n,
                                          float * out);
// The pruned re-conditioning of a row x [n] (target ids) by the bias of d: the ids (ascending, to
// out_ids, at most cap) that may survive the chain's filter on x + scale * W2 . d -- with top_k > 0
// (< n) those that may enter the top_k, else with min_p > 0 those that may reach max + log(min_p) --
// and their exact values x + bias to out_vals.  t2d [n]: the draft row of each target id (-1: none,
// bias 0), NULL when n == n_vocab_draft.  Every forced id is included and gives no bound (its value
// changes afterwards: banned, penalized, logit bias).  The bound: 7-bit / 8-bit copies of W2 and d, whose
// dot is exact, plus the norms of both quantization errors (and the float rounding of the exact
// product).  Returns the count, or 0 when no bound applies (no filter, fewer than top_k finite
// bounds, more than cap ids): bias the whole row then.
DSPARK_API int32_t dspark_markov_candidates(dspark_markov * m, const float * x, int32_t n, const int32_t * t2d,
                                            const float * d, int32_t top_k, float min_p, const int32_t * forced,
                                            int32_t n_forced, int32_t * out_ids, float * out_vals, int32_t cap);
// Builds the 7-bit copy of W2 the candidates use (otherwise built on their first call).
DSPARK_API int32_t dspark_markov_prune_prepare(dspark_markov * m);

#ifdef __cplusplus
}
#endif
