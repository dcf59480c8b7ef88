"""The default automatic schedule against no draft (and llama.cpp's fixed block), interleaved.

    python bench/auto_vs_no_draft.py [--prompts 5] [--repeats 2] [-n 96] [--threads 2]

Cells: draft (the shipped SmolLM2 drafter, a random DSpark draft) x R (1 sequence through the
one-sequence engine, as ``run`` / ``DSpark`` / ``serve -np 1`` decode; 4 sequences through the
batched decoder, as ``serve -np 4``) x temperature (0, 0.8), plus an oracle right in 9 blocks of 10
at R = 1 and T = 0.  In every cell each prompt runs no draft / auto / fixed back to back in an order
rotated per prompt, ``--repeats`` times; one policy per configuration is kept across the prompts
(as a server keeps it).  Prints per cell the median tok/s and the median of the per-prompt ratios
to no draft, and the per-cycle cost of auto's cycles that did not draft against a no-draft cycle.
Run it on an idle machine: llama.cpp's threads spin-wait.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from pyllama_dspark.speculative import costprofile
from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.decode.loop import Decoder
from pyllama_dspark.llama.handles import ContextSettings
from pyllama_dspark.llama.models import open_models
from pyllama_dspark.speculative.oracle import OracleProposer
from pyllama_dspark.drafts.made import random_draft_for
from pyllama_dspark.paths import default_draft, default_target
from pyllama_dspark.speculative.policy_factory import policy_for
from pyllama_dspark.prompts import load_prompts
from pyllama_dspark.speculative.sampling_params import SamplingParams


def rotated(xs, i):
    i %= len(xs)
    return xs[i:] + xs[:i]


def sampling_for(temp, seed):
    return None if temp == 0 else SamplingParams(temperature=temp, seed=seed)


def cell_r1(target, draft, prompts, temp, n, repeats, threads, oracle_refs=None, configs=("none", "auto", "fixed")):
    """R = 1: Speculators (one-sequence engine) for no draft, auto, fixed; tok/s per run."""
    res = {"none": [], "auto": [], "fixed": []}
    idle_ms = []
    with Speculator(target, None, n_threads=threads) as plain, \
            Speculator(target, draft, n_threads=threads, schedule="auto") as auto, \
            Speculator(target, draft, n_threads=threads, schedule="off") as fixed:
        if oracle_refs is not None:   # the oracle replaces the draft's proposals (it knows the answer)
            for sp in (auto, fixed):
                sp.proposer = sp.decoder.proposer = OracleProposer([], plain.target.n_vocab, p_error=0.1)
            auto.decoder.policy = policy_for("auto", has_draft=True, has_confidence=True,
                                             cost_source=costprofile.auto_profile(auto.target), gamma=7)
        runs = {name: sp for name, sp in (("none", plain), ("auto", auto), ("fixed", fixed)) if name in configs}
        for rep in range(repeats):
            for i, p in enumerate(prompts):
                for name in rotated(list(runs), i + rep):
                    sp = runs[name]
                    if oracle_refs is not None and name != "none":
                        sp.proposer.ref = np.asarray(list(p) + list(oracle_refs[i]), dtype=np.int32)
                        sp.proposer.reset()
                    t0 = time.perf_counter()
                    d = sp.generate(p, n, ignore_eos=True, sampling=sampling_for(temp, 1000 * rep + i))
                    st = d.stats
                    res[name].append((st.tokens_per_second, st.tau, i, rep))
                    if name == "auto":
                        idle = [v == 0 for v in st.verify_lengths]
                        if sum(idle) and st.cycles:
                            idle_ms.append(st.ms_total / st.cycles)
                    if name == "none":
                        res.setdefault("none_cycle_ms", []).append(st.ms_total / max(st.cycles, 1))
                    _ = time.perf_counter() - t0
    return res, idle_ms


def cell_r4(target, draft, prompts, temp, n, repeats, threads, R=4, configs=("none", "auto", "fixed")):
    settings = ContextSettings(n_ctx=1024 * R, n_threads=threads, n_seq_max=R)
    res = {"none": [], "auto": [], "fixed": []}
    t, d, _ = open_models(target, draft, settings)
    with t:
        prof = costprofile.auto_profile(t)
        pols = {"auto": policy_for("auto", has_draft=True, has_confidence=bool(d.meta.has_confidence),
                                   cost_source=prof, gamma=7), "fixed": None}
        for rep in range(repeats):
            for i in range(len(prompts)):
                batch = [prompts[(i + j) % len(prompts)] for j in range(R)]
                for name in rotated([c for c in ("none", "auto", "fixed") if c in configs], i + rep):
                    bd = Decoder(t, None if name == "none" else d, n_max=7, policy=pols.get(name))
                    smp = [sampling_for(temp, 1000 * rep + 10 * i + j) for j in range(R)]
                    for j in range(R):
                        bd.submit(batch[j], n, sampling=smp[j], ignore_eos=True)
                    t0 = time.perf_counter()
                    while bd.pending():
                        bd.step()
                    dt = time.perf_counter() - t0
                    done = [bd.result(r) for r in range(R)]
                    ntok = sum(len(x.tokens) for x in done)
                    cyc = sum(x.stats.cycles for x in done)
                    acc = sum(x.stats.accepted for x in done)
                    res[name].append((ntok / dt, (acc + cyc) / max(cyc, 1), i, rep))
    return res, []


def capture_cost(target, draft, threads, n=200):
    """ms of a one-row target decode without and with the draft's layer capture on (interleaved)."""
    plain, _, _ = open_models(target, None, ContextSettings(n_ctx=1024, n_threads=threads))
    capt, d, _ = open_models(target, draft, ContextSettings(n_ctx=1024, n_threads=threads))
    out = {"no capture": [], "capture": []}
    with plain, capt:
        toks = np.asarray(plain.tokenize("The quick brown fox jumps over the lazy dog."), np.int32)
        for t in (plain, capt):
            t.decode(toks, 0, all_outputs=False)
        ids, mg = np.zeros(1, np.int32), np.zeros(1, np.float32)
        for i in range(n):
            for name, t in ((("no capture", plain), ("capture", capt)) if i % 2 else
                            (("capture", capt), ("no capture", plain))):
                t0 = time.perf_counter()
                t.decode(np.asarray([100 + i % 50], np.int32), len(toks) + i, all_outputs=True)
                t.argmax(0, 1, ids, mg)
                out[name].append((time.perf_counter() - t0) * 1e3)
    a, b = statistics.median(out["no capture"]), statistics.median(out["capture"])
    print(f"one-row target decode: no capture {a:.3f} ms, with the draft's capture {b:.3f} ms "
          f"({b - a:+.3f} ms, {100 * (b / a - 1):+.1f}%), median of {n} interleaved")


def summarize(label, res, idle_ms=()):
    base = {(i, r): tps for tps, _, i, r in res["none"]}
    out = []
    for name in ("none", "fixed", "auto"):
        rows = res[name]
        if not rows:
            continue
        tps = statistics.median(x[0] for x in rows)
        tau = statistics.median(x[1] for x in rows)
        ratio = statistics.median(x[0] / base[(x[2], x[3])] for x in rows)
        out.append(f"  {name:6s} {tps:8.2f} tok/s  tau {tau:5.2f}  ratio to no draft (median per prompt) {ratio:.3f}")
    print(label)
    print("\n".join(out))
    if idle_ms and res.get("none_cycle_ms"):
        print(f"  ms/cycle: no draft {statistics.median(res['none_cycle_ms']):.2f}, auto runs with idle cycles "
              f"{statistics.median(idle_ms):.2f}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cells", default="capture,r1,r4,oracle")
    ap.add_argument("--configs", default="none,auto,fixed",
                    help="what runs in each cell: none (no draft), auto, fixed (llama.cpp's block)")
    a = ap.parse_args()
    target = default_target()
    items = load_prompts()
    by_src = {}
    for it in items:
        by_src.setdefault(it.source, []).append(it)
    picked = [lst[k] for k in range(3) for lst in by_src.values() if k < len(lst)][:a.prompts]
    with Speculator(target, None, n_threads=a.threads) as sp:
        prompts = [sp.chat_prompt([{"role": "user", "content": it.turns[0]}]).tokens for it in picked]
        costprofile.auto_profile(sp.target)
        refs = [sp.generate(p, a.n, ignore_eos=True).tokens for p in prompts]
    drafts = [("shipped", default_draft()), ("random", random_draft_for(target))]
    cells = a.cells.split(",")
    configs = tuple(a.configs.split(","))
    if "capture" in cells:
        capture_cost(target, default_draft(), a.threads)
    for temp in (0.0, 0.8):
        for dname, dpath in drafts:
            if "r1" in cells:
                res, idle = cell_r1(target, dpath, prompts, temp, a.n, a.repeats, a.threads, configs=configs)
                summarize(f"R=1 T={temp} draft={dname}", res, idle)
            if "r4" in cells:
                res, _ = cell_r4(target, dpath, prompts, temp, a.n, a.repeats, a.threads, configs=configs)
                summarize(f"R=4 T={temp} draft={dname}", res)
    if "oracle" in cells:
        res, idle = cell_r1(target, default_draft(), prompts, 0.0, a.n, a.repeats, a.threads, oracle_refs=refs,
                            configs=configs)
        summarize("R=1 T=0 oracle acc 0.9", res, idle)


if __name__ == "__main__":
    main()
