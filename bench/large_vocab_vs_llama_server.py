"""Sampling at a 262,144-token vocabulary, no draft: our loop against llama-server, interleaved.

    python bench/large_vocab_vs_llama_server.py [--arch gemma4] [--n-vocab 262144] [-n 64]
        [--prompts 4] [--repeats 2] [--threads 2] [--peaked 4]

Writes a random-weight target (``make-test-target``: default weights, and with ``--peaked`` the
output logits scaled so that top-p keeps a model-like handful of tokens), then for each target and
each sampling chain runs the same token prompts through llama-server (``POST /completion``, its
``timings.predicted_per_second``) and through ``Speculator`` without a draft (``Stats
.tokens_per_second``), alternating which goes first.  Chains: T = 0.8 with top-k 0 and top-p 0.9
(min-p 0: what an OpenAI client sends, llama.cpp's min-p switched off too) and llama.cpp's default
chain (top-k 40, top-p 0.95, min-p 0.05).  Prints median tok/s and the median per-prompt ratio
ours / llama-server.  Run it on an idle machine: llama.cpp's threads spin-wait.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.gguf.target_writer import make_test_target
from pyllama_dspark.speculative.sampling_params import SamplingParams
from pyllama_dspark.upstream.llama_server import LlamaServer
from pyllama_dspark.upstream.llama_server_build import ensure_llama_server

CHAINS = {
    "T0.8 top-k 0 top-p 0.9 min-p 0": dict(temperature=0.8, top_k=0, top_p=0.9, min_p=0.0),
    "llama.cpp defaults (T0.8 k40 p0.95 m0.05)": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="gemma4")
    ap.add_argument("--n-vocab", type=int, default=262144)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peaked", type=float, default=4.0)
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="large-vocab-"))
    targets = {
        "default weights": make_test_target(tmp / "t.gguf", a.arch, n_vocab=a.n_vocab, seed=0),
        f"peaked x{a.peaked:g}": make_test_target(tmp / "tp.gguf", a.arch, n_vocab=a.n_vocab, seed=0, peaked=a.peaked),
    }
    binary = ensure_llama_server()
    texts = ["The capital of France is", "def add(a, b):", "Once upon a time", "A list of fruits:",
             "In 1905 Einstein", "The quick brown fox"][:a.prompts]
    print(f"{a.arch}, n_vocab {a.n_vocab}, {len(texts)} prompts x {a.repeats} repeats x {a.n} tokens, "
          f"{a.threads} threads, ignore_eos")
    for tname, target in targets.items():
        with LlamaServer(binary, target, None, ctx=1024, threads=a.threads, n_batch=512, n_ubatch=512,
                         flash_attn="auto") as srv, \
                Speculator(target, None, n_ctx=1024, n_threads=a.threads) as sp:
            prompts = [list(sp.target.tokenize(t)) for t in texts]
            for cname, chain in CHAINS.items():
                ours, theirs, ratios, sample_ms = [], [], [], []
                for rep in range(a.repeats):
                    for i, p in enumerate(prompts):
                        seed = 1000 * rep + i
                        got = {}
                        order = ("cpp", "py") if (i + rep) % 2 == 0 else ("py", "cpp")
                        for who in order:
                            if who == "cpp":
                                r = srv.complete(p, a.n, ignore_eos=True, seed=seed, **chain)
                                got["cpp"] = r["timings"]["predicted_per_second"]
                            else:
                                st = sp.generate(p, a.n, ignore_eos=True,
                                                 sampling=SamplingParams(seed=seed, **chain)).stats
                                got["py"] = st.tokens_per_second
                                sample_ms.append(st.ms_sample / max(st.n_generated, 1))
                        ours.append(got["py"])
                        theirs.append(got["cpp"])
                        ratios.append(got["py"] / got["cpp"])
                print(f"{tname:16s} {cname:42s} llama-server {statistics.median(theirs):7.2f} tok/s  "
                      f"ours {statistics.median(ours):7.2f} tok/s  ratio {statistics.median(ratios):.3f}  "
                      f"(our sampling {statistics.median(sample_ms):.3f} ms/token)")


if __name__ == "__main__":
    main()
