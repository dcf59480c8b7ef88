"""Sampler chain cost per verify row: the numpy chain (before), the shim's C chain (after) and
llama.cpp's own samplers (through llama-cpp-python's bindings) on the same rows.

    python bench/sampler_rows.py [--repeats 20] [--vocab 49152,151936,262144]

Rows per vocabulary size:
  * ``zipf``: a peaked, model-like profile (logit = -1.3 ln(rank) + N(0, 0.3), shuffled): top-p 0.9
    keeps a few hundred to a few thousand tokens;
  * ``flat``: N(0, 1) logits, where top-p needs (almost) a full sort;
  * ``smollm2`` (49,152 only): real SmolLM2-135M-Instruct verify rows (three prompts).
Then the other per-row scans at these sizes: argmax + top-2 gap, and the Markov bias + W1 rows
(graph + transfer).

Chains: llama.cpp's default (top-k 40, top-p 0.95, min-p 0.05, T 0.8); every filter off at T 1;
top-p 0.9 with top-k 0 (and min-p 0, T 0.8), what OpenAI clients commonly send.

"before" is the numpy chain as it was (its top-k an introselect, like the shim's old nth_element);
"after" is ``TokenSampler.probs`` (the C chain, sparse result) plus one draw from it, the way the
loop uses a row; "llama.cpp" is ``llama_sampler_apply`` of the same chain + dist on a candidate
array filled beforehand (the fill, which llama.cpp does in C++ before sampling, is not timed: it
would cost ours nothing either).  ms per row, median over the repeats; machine noise applies.
The shim runs its AVX-512 kernels where the CPU has them; ``DSPARK_NO_AVX512=1`` in the
environment measures the AVX2 ones.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import statistics
import sys
import time

import numpy as np
from llama_cpp import llama_cpp as ll

from pyllama_dspark.speculative.sampling import TokenSampler
from pyllama_dspark.speculative.sampling_params import SamplingParams

CHAINS = {
    "default (k40 p.95 m.05 T.8)": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1),
    "filters off, T 1": SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1),
    "top-p .9, top-k 0 (T .8)": SamplingParams(temperature=0.8, top_k=0, top_p=0.9, min_p=0.0, seed=1),
}

_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


# ---- before: the numpy chain as it was ------------------------------------------------------------

def _top_k_before(x, k):
    return np.argpartition(x, x.size - k)[x.size - k:]


def _top_p_keep_before(l, p):
    n = l.size
    mx = float(l.max())
    e = np.exp(l.astype(np.float64) - mx)
    total = e.sum()
    k = min(256, n)
    part = _top_k_before(l, k) if k < n else np.arange(n)
    order = part[np.argsort(-l[part], kind="stable")]
    cum = np.cumsum(e[order]) / total
    hit = np.flatnonzero(cum >= p)
    if hit.size == 0 and k < n:
        order = np.argsort(-l, kind="stable")
        cum = np.cumsum(e[order]) / total
        hit = np.flatnonzero(cum >= p)
    m = int(hit[0]) + 1 if hit.size else n
    return order[:m]


def chain_before(x, params):
    n = x.size
    idx = None
    k = int(params.top_k)
    if 0 < k < n:
        idx = _top_k_before(x, k)
        l = x[idx]
    else:
        l = x
    if params.top_p < 1.0:
        keep = _top_p_keep_before(l, params.top_p)
        idx = keep if idx is None else idx[keep]
        l = l[keep]
    if params.min_p > 0.0:
        thr = np.float32(np.float32(l.max()) + np.float32(math.log(params.min_p)))
        keep = np.flatnonzero(l >= thr)
        idx = keep if idx is None else idx[keep]
        l = l[keep]
    z = l.astype(np.float64) / float(params.temperature)
    e = np.exp(z - z.max())
    e /= e.sum()
    if idx is None:
        idx = np.arange(n)
    else:
        order = np.argsort(idx)
        idx, e = idx[order], e[order]
    nz = e > 0.0
    if not nz.all():
        idx, e = idx[nz], e[nz]
    c = np.cumsum(e)                      # one draw, as the loop does with every row it samples
    j = int(np.searchsorted(c, 0.5 * c[-1], side="right"))
    return idx[min(j, idx.size - 1)]


# ---- llama.cpp's samplers ---------------------------------------------------------------------------

class LlamaCppChain:
    def __init__(self, params, n_vocab):
        self.chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        for s in (ll.llama_sampler_init_top_k(params.top_k), ll.llama_sampler_init_top_p(params.top_p, 0),
                  ll.llama_sampler_init_min_p(params.min_p, 0), ll.llama_sampler_init_temp(params.temperature),
                  ll.llama_sampler_init_dist(1)):
            ll.llama_sampler_chain_add(self.chain, s)
        self.data = np.empty(n_vocab, dtype=_TOKEN_DATA)
        self.ids = np.arange(n_vocab, dtype=np.int32)

    def fill(self, row):
        self.data["id"] = self.ids
        self.data["logit"] = row
        self.data["p"] = 0.0
        self.arr = ll.llama_token_data_array(
            data=self.data.ctypes.data_as(ctypes.POINTER(ll.llama_token_data)), size=self.data.size, selected=-1,
            sorted=False)

    def apply(self):
        ll.llama_sampler_apply(self.chain, ctypes.byref(self.arr))

    def close(self):
        ll.llama_sampler_free(self.chain)


# ---- rows ---------------------------------------------------------------------------------------------

def zipf_row(v, rng):
    r = np.arange(1, v + 1, dtype=np.float64)
    l = -1.3 * np.log(r) + rng.normal(0.0, 0.3, v)
    return rng.permutation(l).astype(np.float32)


def smollm2_rows():
    from pyllama_dspark.cli.main import default_target
    from pyllama_dspark.llama.handles import ContextSettings, Target

    out = []
    with Target(default_target(), ContextSettings(n_threads=2, n_ctx=512)) as t:
        for text in ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far"):
            toks = np.asarray(t.tokenize(text), dtype=np.int32)
            t.seq_rm(0, 0, -1)
            t.decode(toks, 0, 0, all_outputs=True)
            out += [t.logits(i) for i in range(len(toks) - 3, len(toks))]
    return out


def timed(fn, repeats):
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def row_scans(vocabs, repeats, rank=32):
    """argmax + top-2 gap (the shim's scan vs numpy), and the Markov graph with its transfer
    (bias row + W1 row for two previous tokens, one device call) at each vocabulary size."""
    import tempfile
    from pathlib import Path

    import gguf

    from pyllama_dspark.llama import _native as nat
    from pyllama_dspark.llama.markov_head import MarkovHead

    rng = np.random.default_rng(1)
    print(f"\n{'vocab':>7} {'argmax+gap shim':>16} {'np.argmax':>10} {'Markov bias+W1 (rank %d)' % rank:>26}  ms/row")
    for v in vocabs:
        row = rng.normal(0, 3, v).astype(np.float32)
        ids, gap = np.zeros(1, np.int32), np.zeros(1, np.float32)
        t_shim = timed(lambda: nat.argmax_f32(nat.ptr_f32(row), 1, v, nat.ptr_i32(ids), nat.ptr_f32(gap)), repeats)
        t_np = timed(lambda: int(np.argmax(row)), repeats)
        with tempfile.TemporaryDirectory() as d:
            path = str(Path(d) / "markov.gguf")
            w = gguf.GGUFWriter(path, "dflash")
            w.add_tensor("markov_w1.weight", rng.normal(0, 1, (v, rank)).astype(np.float16))
            w.add_tensor("markov_w2.weight", rng.normal(0, 1, (v, rank)).astype(np.float16))
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
            with MarkovHead(path, n_threads=1) as m:   # as the drafter opens it
                t_mk = timed(lambda: m.bias_w1([5, 17]), repeats)
        print(f"{v:>7} {t_shim:16.3f} {t_np:10.3f} {t_mk:26.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--vocab", default="49152,151936,262144")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'vocab':>7} {'rows':8} {'chain':28} {'kept':>7} {'before':>8} {'after':>8} {'llama.cpp':>9}  ms/row")
    for v in (int(s) for s in a.vocab.split(",")):
        sets = {"zipf": [zipf_row(v, rng) for _ in range(3)], "flat": [rng.normal(0, 1, v).astype(np.float32)
                                                                        for _ in range(3)]}
        if v == 49152:
            sets["smollm2"] = smollm2_rows()
        for rname, rows in sets.items():
            for cname, params in CHAINS.items():
                smp = TokenSampler(params)
                ref = LlamaCppChain(params, v)
                before, after, theirs, kept = [], [], [], []
                for row in rows:
                    reps = max(3, a.repeats // (4 if (rname == "flat" and params.top_p < 1) else 1))
                    before.append(timed(lambda: chain_before(row, params), reps))
                    after.append(timed(lambda: smp.sample(smp.probs(row)), reps))
                    ts = []
                    for _ in range(reps):
                        ref.fill(row)
                        t0 = time.perf_counter()
                        ref.apply()
                        ts.append(time.perf_counter() - t0)
                    theirs.append(statistics.median(ts) * 1e3)
                    kept.append(smp.probs(row).ids.size)
                ref.close()
                print(f"{v:>7} {rname:8} {cname:28} {int(np.median(kept)):>7} {np.mean(before):8.3f} "
                      f"{np.mean(after):8.3f} {np.mean(theirs):9.3f}")
                sys.stdout.flush()
    row_scans([int(s) for s in a.vocab.split(",")], a.repeats)


if __name__ == "__main__":
    main()
