"""Python loop vs llama.cpp's own C++ driver (llama-server), interleaved per prompt.

    python bench/loop_vs_llama_server.py [--limit 2] [--n-predict 128] [--threads 2] [-ngl auto]
                                         [--draft random|random:TYPE|bigram|PATH] [--json out.json]

For each prompt (chat template applied) and each configuration, in a rotating order so machine
noise hits every configuration alike: llama-server without a draft, llama-server with the draft,
our loop without a draft, our loop with the draft.  Prints decode tok/s per configuration, the
ratio ours / llama-server, and our per-cycle phase times (draft, verify, inject, Python overhead).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.drafts.spec import parse_draft
from pyllama_dspark.paths import default_target
from pyllama_dspark.upstream.llama_server import LlamaServer
from pyllama_dspark.upstream.llama_server_build import ensure_llama_server
from pyllama_dspark.prompts import load_prompts
from pyllama_dspark.gguf.testing import make_test_draft, plant_markov_bigrams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--draft", default="random")
    ap.add_argument("--limit", type=int, default=2, help="prompts per benchmark file")
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("-ngl", "--n-gpu-layers", dest="ngl", default="auto",
                    help="layers on the GPU, both sides (llama.cpp's -ngl: a number, auto or all)")
    ap.add_argument("--json", default=None, help="also write the figures here, as data beside the note")
    a = ap.parse_args()
    place = dict(n_gpu_layers=a.ngl)
    ngl_args = [] if a.ngl == "auto" else ["-ngl", str(a.ngl), "-ngld", str(a.ngl)]

    target = a.model or default_target()
    items = load_prompts(limit_per_file=a.limit)
    with Speculator(target, n_threads=a.threads, **place) as sp:
        prompts = [sp.chat_prompt([{"role": "user", "content": it.turns[0]}]).tokens for it in items]
        refs = [sp.generate(p, a.n_predict).tokens for p in prompts] if a.draft == "bigram" else None
    if a.draft == "bigram":
        draft = str(Path(tempfile.mkdtemp()) / "bigram.gguf")
        make_test_draft(target, draft, kind="dspark", markov_rank=256, seed=3)
        plant_markov_bigrams(draft, [p + r for p, r in zip(prompts, refs)], drop_every=4)
    else:
        draft = parse_draft(a.draft).file(target)   # a path, or random[:TYPE] written into the cache

    binary = ensure_llama_server()
    common = dict(ctx=4096, threads=a.threads, n_batch=512, n_ubatch=512, flash_attn="auto", extra_args=ngl_args)
    res = {k: [] for k in ("cpp_base", "cpp_spec", "py_base", "py_spec")}
    phases = {"draft": [], "verify": [], "inject": [], "overhead": []}
    with LlamaServer(binary, target, None, **common) as s_base, \
            LlamaServer(binary, target, draft, spec_type="draft-dspark", n_max=7, **common) as s_spec, \
            Speculator(target, None, n_threads=a.threads, **place) as p_base, \
            Speculator(target, draft, n_threads=a.threads, n_max=7, schedule="off", **place) as p_spec:   # llama-server's fixed block
        runs = {
            "cpp_base": lambda p: s_base.complete(p, a.n_predict)["timings"]["predicted_per_second"],
            "cpp_spec": lambda p: s_spec.complete(p, a.n_predict)["timings"]["predicted_per_second"],
            "py_base": lambda p: p_base.generate(p, a.n_predict).stats.tokens_per_second,
        }

        def py_spec(p):
            st = p_spec.generate(p, a.n_predict).stats
            c = max(st.cycles, 1)
            for k, v in (("draft", st.ms_draft), ("verify", st.ms_verify), ("inject", st.ms_inject),
                         ("overhead", st.ms_overhead)):
                phases[k].append(v / c)
            return st.tokens_per_second

        runs["py_spec"] = py_spec
        order = list(runs)
        for rep in range(a.repeats):
            for i, p in enumerate(prompts):
                rot = order[(i + rep) % 4:] + order[:(i + rep) % 4]
                for k in rot:
                    res[k].append(runs[k](p))
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"{len(prompts)} prompts x {a.repeats} repeats, {a.n_predict} tokens, {a.threads} threads, draft {a.draft}")
    print(f"{'config':10s} {'median tok/s':>12s}")
    for k, v in med.items():
        print(f"{k:10s} {v:12.2f}")
    ratios_base = [p / c for p, c in zip(res["py_base"], res["cpp_base"])]
    ratios_spec = [p / c for p, c in zip(res["py_spec"], res["cpp_spec"])]
    print(f"ours/llama-server, no draft: median ratio {statistics.median(ratios_base):.3f}")
    print(f"ours/llama-server, DSpark  : median ratio {statistics.median(ratios_spec):.3f}")
    print("our ms per cycle (median): " + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in phases.items()))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"command": " ".join(sys.argv), "target": target, "draft": a.draft, "threads": a.threads,
                       "n_predict": a.n_predict, "prompts": len(prompts), "repeats": a.repeats,
                       "tok_s": res, "median_tok_s": med,
                       "ratio_no_draft": statistics.median(ratios_base), "ratio_dspark": statistics.median(ratios_spec),
                       "ms_per_cycle": {k: statistics.median(v) for k, v in phases.items() if v}}, f, indent=1)


if __name__ == "__main__":
    main()
