"""The DSpark draft pass (one full block) at T = 0 against T > 0, at a large vocabulary.

    python bench/draft_pass_temp.py [--target /tmp/g4.gguf] [--draft PATH] [--passes 40] [--threads 2]

Opens a target (default: a random gemma4 target, vocabulary 262,144, written to /tmp/g4.gguf by
``make_test_target`` if missing) with a random DSpark draft (``drafts.made.random_draft_for``, or
``--draft``), injects a prompt's features, then times ``DraftModelProposer.propose_batch`` for a
full block (n_draft = the draft's maximum, 7) at T = 0 (argmax rows) and at T = 0.8 with
llama.cpp's default chain (top-k 40, top-p 0.95, min-p 0.05), interleaved (the order alternates
per pass).  Prints medians over the passes, the T > 0 / T = 0 ratio and, for T > 0, the median
time per stage:

  forward   the block decode (``Draft.decode_blocks``), the same work at T = 0;
  markov    the Markov head calls re-conditioning a row on the drawn token (W1 rows, the bias:
            whole row or candidates with their bound and exact values);
  sampling  the draft's sampler chain on each row (whole or candidates), and the draws;
  other     the rest (argmax / confidence scans, Python).

``--chain off`` runs T = 0.8 with every filter off instead (top-k 0, top-p 1, min-p 0: the
whole-vocabulary path).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from pyllama_dspark.gguf.info import read_draft_info
from pyllama_dspark.llama.handles import ContextSettings, Draft, Target
from pyllama_dspark.drafts.made import random_draft_for
from pyllama_dspark.speculative import draft_sampling as ds
from pyllama_dspark.speculative.drafter import BlockRequest, DraftModelProposer
from pyllama_dspark.speculative.sampling import TokenSampler
from pyllama_dspark.speculative.sampling_params import SamplingParams

CHAINS = {
    "default": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "off": SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0),
}


class Timed:
    """Wraps a callable, adding its wall time to ``acc[key]``."""

    def __init__(self, fn, acc, key):
        self.fn, self.acc, self.key = fn, acc, key

    def __call__(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.acc[self.key] = self.acc.get(self.key, 0.0) + time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="/tmp/g4.gguf")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--passes", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chain", choices=sorted(CHAINS), default="default")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()

    if not os.path.exists(a.target):
        from pyllama_dspark.gguf.target_writer import make_test_target
        make_test_target(a.target, "gemma4", seed=0)
    draft_path = a.draft or random_draft_for(a.target)
    info = read_draft_info(draft_path)
    params = CHAINS[a.chain].with_seed(a.seed)
    settings = ContextSettings(n_threads=a.threads, n_threads_batch=a.threads, n_ctx=1024)
    with Target(a.target, settings, capture_layers=info.target_layer_ids) as tgt:
        draft = Draft(draft_path, tgt, settings)
        prop = DraftModelProposer(draft)
        toks = np.asarray(tgt.tokenize("The quick brown fox jumps over the lazy dog. Once upon a time"), dtype=np.int32)
        tgt.decode(toks, 0, 0, all_outputs=False)
        prop.observe(0, len(toks), 0)
        anchor, pos0, n_draft = int(toks[-1]), len(toks), prop.max_draft()
        bs = prop.block_sampler            # loads the Markov head (not timed)
        acc: dict = {}
        draft.decode_blocks = Timed(draft.decode_blocks, acc, "forward")
        if bs.markov is not None:
            for name in ("bias_w1", "w1_rows"):
                setattr(bs.markov, name, Timed(getattr(bs.markov, name), acc, "markov"))
            md = getattr(bs, "delta", None)       # the pruned path (absent before it existed)
            if md is not None:
                md.prepare()                      # the 7-bit copy of W2 (once, not timed)
                md.full = Timed(md.full, acc, "markov")
                md.nat.markov_candidates = Timed(md.nat.markov_candidates, acc, "markov")
                ds.chain_dist_native = Timed(ds.chain_dist_native, acc, "sampling")
        tsmp = TokenSampler(params)       # its calls timed on the instance (it stays a TokenSampler)
        tsmp.draft_probs = Timed(tsmp.draft_probs, acc, "sampling")
        tsmp.sample = Timed(tsmp.sample, acc, "sampling")
        print(f"target {a.target} (n_vocab {tgt.n_vocab}), draft {draft_path} ({info.kind}, rank "
              f"{info.markov_rank}, block {n_draft}); chain {a.chain}: {params}")
        print(f"threads {a.threads}; load average at start: {os.getloadavg()}")

        t0, t1, stages, calls = [], [], {k: [] for k in ("forward", "markov", "sampling", "other")}, []
        for i in range(a.passes + 3):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for mode in order:
                acc.clear()
                n_calls = bs.n_bias_calls
                req = BlockRequest(anchor, pos0, n_draft, 0, tsmp if mode else None)
                t = time.perf_counter()
                p = prop.propose_batch([req])[0]
                dt = time.perf_counter() - t
                assert len(p.tokens) == n_draft
                if i < 3:
                    continue          # warm-up
                if mode == 0:
                    t0.append(dt)
                else:
                    t1.append(dt)
                    calls.append(bs.n_bias_calls - n_calls)
                    for k in ("forward", "markov", "sampling"):
                        stages[k].append(acc.get(k, 0.0))
                    stages["other"].append(dt - sum(acc.get(k, 0.0) for k in ("forward", "markov", "sampling")))
        m0, m1 = statistics.median(t0) * 1e3, statistics.median(t1) * 1e3
        md = getattr(bs, "delta", None)
        if md is not None:
            print(f"re-conditioned rows: {md.n_pruned} pruned (last: {md.last_candidates} candidates), "
                  f"{md.n_full} whole-row")
        print(f"passes {a.passes} each, interleaved; load average at end: {os.getloadavg()}")
        print(f"T=0    draft pass: median {m0:.3f} ms")
        print(f"T=0.8  draft pass: median {m1:.3f} ms   ({statistics.mean(calls):.2f} Markov calls / pass)")
        print(f"ratio T>0 / T=0: {m1 / m0:.3f}")
        print("T=0.8 stages (median ms per pass): " + ", ".join(
            f"{k} {statistics.median(v) * 1e3:.3f}" for k, v in stages.items()))
        prop.close()


if __name__ == "__main__":
    main()
