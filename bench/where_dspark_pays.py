"""Where DSpark pays on this CPU, and whether ``auto`` finds the best verify length.

    python bench/where_dspark_pays.py --targets smollm2,/tmp/targets/qwen3-0.6b-q4_0.gguf,... \\
        [--p 0.3,0.5,0.7,0.8,0.9,0.95] [--fixed 1,2,3,5,7] [--rs 1,4] [-n 32] [--prompts 3] \\
        [--repeats 1] [--auto-margins 0] [--auto-bands 0] [--json out.json] [--png out.png]
    python bench/where_dspark_pays.py --from-json a.json,b.json [--png out.png]

For every target: the proposer is ``-md oracle:P``
(:class:`~pyllama_dspark.speculative.oracle.OracleDraft`: the target's greedy continuation, the full block
of 7 drafts entirely right with probability P, else one wrong draft at a uniform position, a block
of n its first n drafts; a real pass of a draft of the target's shape paid every time, its tokens
discarded; no confidences). Configurations: no draft, fixed blocks n (``--schedule off --n-max n``;
n = 3 is llama.cpp's default ``--spec-draft-n-max``, n = 7 the full block) and auto (the default
schedule, one policy per (P, R) kept across the prompts as a server or the memory keeps it). R = 1
(one sequence) and R = 4 (four sequences decoded together), T = 0. Every prompt runs every
configuration back to back in a random order drawn per prompt and pass (``--repeats`` passes); a
sample is one run's tok/s over the no-draft run of the same prompt and pass (paired), and
the table gives the median over the samples. A second no-draft run per sample (the control) measures
what the machine's noise alone does to such a ratio, and each cell's auto / best comes with a
bootstrap 90% interval over the samples (best = the highest of no draft and every fixed n, whose
maximum over noisy columns reads high by itself) and held out (the best chosen on half the samples,
measured on the other half, both ways). Also printed: the target's cost
curve t(k)/t(1), the draft pass time, and for each (target, R, P) auto against the best of (no
draft, every fixed n) and against the physical limit max_l tau(l) t(1) / (t_draft(l) + t(l + 1)),
t_draft(l) the measured pass of a block of l drafts.
``--auto-margins`` and ``--auto-bands`` add auto with another draft margin or explore band (0: no
block tried off the plan), and ``--auto-set field=value`` auto with any other policy field set
(``probe_plan=0``: the full-block probe; comma-separated or the flag repeated, one column each), as more columns of the
same run: an A/B measured side by side.

Run it on an idle machine: llama.cpp's threads spin-wait.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from pyllama_dspark.drafts.made import oracle_draft_for
from pyllama_dspark.decode.loop import Decoder
from pyllama_dspark.chat.prompt import build_chat_prompt
from pyllama_dspark.llama.handles import ContextSettings
from pyllama_dspark.llama.models import open_models
from pyllama_dspark.paths import default_target
from pyllama_dspark.prompts import load_prompts
from pyllama_dspark.speculative import costprofile
from pyllama_dspark.speculative.drafter import BlockRequest, DraftModelProposer
from pyllama_dspark.speculative.oracle import OracleDraft, greedy_reference
from pyllama_dspark.speculative.policy_factory import make_policy


def expected_tau(P: float, ell: int, n: int = 7) -> float:
    """Tokens per cycle when verifying ell of a block of n oracle drafts (the planted-error law)."""
    if ell == 0:
        return 1.0
    e_min = sum(min(ell, u) for u in range(n)) / n
    return 1.0 + P * ell + (1.0 - P) * e_min


def draft_pass_ms(t, d, prompt, R: int, reps: int = 12, n: int = 7) -> float:
    """Median time of one draft pass of R blocks of n drafts (after the prompt's rows are injected)."""
    inner = DraftModelProposer(d)
    for s in range(R):
        t.seq_rm(s, 0, -1)
        inner.reset(s)
    t.decode(np.asarray(prompt, dtype=np.int32), 0, 0, all_outputs=True)
    inner.observe(0, len(prompt), 0, 0)
    for s in range(1, R):
        d.seq_rm(s, 0, -1)
        inner.draft.inject(t.features(0, len(prompt)), np.arange(len(prompt), dtype=np.int32), s)
    reqs = [BlockRequest(int(prompt[-1]), len(prompt), n, s) for s in range(R)]
    inner.propose_batch(reqs)   # cold
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        inner.propose_batch(reqs)
        times.append((time.perf_counter() - t0) * 1e3)
    for s in range(R):
        t.seq_rm(s, 0, -1)
        inner.reset(s)
    return float(np.median(times))


def sweep_target(path, Ps, fixed, rs, n, n_prompts, threads, log, repeats=1, margins=(), bands=(), variants=(),
                 n_gpu_layers="auto", draft_type=None):
    draft = oracle_draft_for(path, draft_type)
    items = load_prompts((), limit_per_file=1)[:n_prompts]
    out = {"target": os.path.basename(path), "draft": os.path.basename(draft), "cells": []}
    for R in rs:
        cs = ContextSettings(n_ctx=1024 * R, n_threads=threads, flash_attn="auto", n_seq_max=R,
                             n_gpu_layers=n_gpu_layers)
        t, d, _ = open_models(path, draft, cs)
        with t:
            prof = costprofile.auto_profile(t)
            curve = prof.verify_ms
            if R == rs[0]:
                out["curve"] = [c / curve[0] for c in curve]
                out["t1_ms"] = curve[0]
                log(f"\n== {out['target']} (draft {out['draft']}): t(1) = {curve[0]:.2f} ms; t(k)/t(1) for k = 1..8: "
                    + " ".join(f"{c / curve[0]:.2f}" for c in curve[:8]) + f"; k = 16: {curve[15] / curve[0]:.2f}, "
                    f"32: {curve[31] / curve[0]:.2f}")
            prompts = [build_chat_prompt(t, [{"role": "user", "content": it.turns[0]}]).tokens for it in items]
            # the reference of each batch: its own no-draft output (a batch of R sequences is decoded
            # with other shapes than one sequence alone; near-ties of a random target differ)
            batch_refs = []
            for i in range(len(prompts)):
                batch = [prompts[(i + j) % len(prompts)] for j in range(R)]
                if R == 1:
                    batch_refs.append([greedy_reference(t, batch[0], n)])
                    continue
                dec = Decoder(t, None, n_max=1)
                rids = [dec.submit(p_, n, ignore_eos=True) for p_ in batch]
                while dec.pending():
                    dec.step()
                batch_refs.append([dec.result(r).tokens for r in rids])
            by_n = [draft_pass_ms(t, d, prompts[0], R, n=k) for k in range(1, 8)]
            tdraft = by_n[-1]
            log(f"R={R}: draft pass of {R} block(s) of n = 1..7 drafts: " + " ".join(f"{x:.2f}" for x in by_n)
                + " ms (n = 1 is " + f"{by_n[0] / tdraft:.2f} of n = 7)")
            out.setdefault("draft_ms", {})[str(R)] = by_n
            inner = DraftModelProposer(d)
            # auto as shipped, and auto with other draft margins or explore bands side by side (an
            # A/B in one run)
            autos = {"auto": {}, **{f"auto m={m:g}": {"draft_margin": m} for m in margins},
                     **{f"auto b={b:g}": {"explore_band": b} for b in bands},
                     **{f"auto {k}={v:g}": {k: v} for k, v in variants}}
            configs = [("none", 0)] + [(f"fixed {k}", k) for k in fixed] + [(a, 7) for a in autos]
            results = {("none", None): [], ("control", None): []}
            policies = {}
            for P in Ps:
                for name, k in configs[1:]:
                    results[(name, P)] = []
                oracle = OracleDraft(t, inner, P)
                for a, overrides in autos.items():
                    policies[(a, P)] = make_policy(t, d, "auto", proposer=oracle, gamma=7, remember=False)
                    for attr, v in overrides.items():
                        setattr(policies[(a, P)], attr, v)
            runs = [("none", None), ("control", None)] + [(name, P) for P in Ps for name, _ in configs[1:]]
            diverged = [0]
            prompt_inject = [0.0]
            catch_up = inner.catch_up

            def timed_catch_up(seq_id=0):   # a deferred injection that holds the prompt's rows
                dq = inner._deferred.get(seq_id)
                t_ = time.perf_counter()
                catch_up(seq_id)
                if dq is not None and dq.pos0 == 0:
                    prompt_inject[0] += time.perf_counter() - t_
            inner.catch_up = timed_catch_up
            for a, P in [(a, P) for P in Ps for a in autos]:   # auto's steady state: what a server,
                warm = OracleDraft(t, inner, P, seed=99)         # or the memory of earlier runs, starts from
                batch0 = [prompts[j % len(prompts)] for j in range(R)]
                for p_, r_ in zip(batch0, batch_refs[0]):
                    warm.set.add(p_, r_)
                dec = Decoder(t, warm, n_max=7, policy=policies[(a, P)])
                for p_ in batch0:
                    dec.submit(p_, n, ignore_eos=True)
                while dec.pending():
                    dec.step()
            kmap = dict(configs)
            for unit in range(len(prompts) * repeats):
                i = unit % len(prompts)
                batch = [prompts[(i + j) % len(prompts)] for j in range(R)]
                brefs = batch_refs[i]
                # a fresh random order per sample: a run is slower after some configurations than
                # after others (the draft's pages, the caches), and a fixed order would charge that
                # to whichever configuration follows them, the no-draft baseline included
                order = np.random.default_rng(1000 * R + unit).permutation(len(runs))
                for name, P in [runs[k] for k in order]:
                    if name in ("none", "control"):
                        prop, pol, nm = None, None, 1
                    else:
                        prop = OracleDraft(t, inner, P, seed=unit)
                        for p_, r_ in zip(batch, brefs):
                            prop.set.add(p_, r_)
                        pol = policies[(name, P)] if name in autos else None
                        nm = kmap[name]
                    dec = Decoder(t, prop, n_max=nm, policy=pol)
                    rids = [dec.submit(p_, n, ignore_eos=True) for p_ in batch]
                    prompt_inject[0] = 0.0
                    t0 = time.perf_counter()
                    while dec.pending():
                        dec.step()
                    done = [dec.result(r) for r in rids]
                    total = time.perf_counter() - t0
                    for dn, r_ in zip(done, brefs):
                        if dn.tokens != r_[:len(dn.tokens)]:
                            diverged[0] += 1
                    ntok = sum(len(dn.tokens) - 1 for dn in done)
                    cyc = sum(dn.stats.cycles for dn in done)
                    acc = sum(dn.stats.accepted for dn in done)
                    ver = sum(sum(dn.stats.verify_lengths) for dn in done)
                    # decoding speed: the prompts' prefill is left out, and with it the draft's
                    # injection of the prompt rows, whether paid in the prefill (a fixed block) or
                    # deferred to the first block auto drafts (the same work, paid once per prompt)
                    dt = total - max(dn.stats.ms_prefill for dn in done) / 1e3 - prompt_inject[0]
                    results[(name, P)].append((ntok / dt, (acc + cyc) / max(cyc, 1), ver / max(cyc, 1)))
            if diverged[0]:
                log(f"R={R}: {diverged[0]} of {len(runs) * len(prompts) * repeats * R} sequences left the reference "
                    "(near-ties decoded with other batch shapes); the oracle is then wrong from there on")
            nones = np.array([x[0] for x in results[("none", None)]])
            base = float(np.median(nones))
            control = np.array([x[0] for x in results[("control", None)]]) / nones
            q = np.percentile(control, [5, 25, 50, 75, 95])
            log(f"R={R}: control (no draft over no draft, {control.size} samples): median {q[2]:.3f}, "
                f"quartiles {q[1]:.3f}-{q[3]:.3f}, 5-95% {q[0]:.3f}-{q[4]:.3f}")
            out.setdefault("control", {})[str(R)] = control.tolist()
            rng = np.random.default_rng(0)
            boot = rng.integers(0, nones.size, size=(2000, nones.size))
            for P in Ps:
                row = {"R": R, "P": P, "none_tps": base, "samples": int(nones.size)}
                ratios = {}
                for name, k in configs[1:]:
                    xs = results[(name, P)]
                    # paired: each run against the same prompt's no-draft run of the same pass (the
                    # machine's speed drifts by ~10% over minutes; one prompt's runs are seconds apart)
                    ratios[name] = np.array([x[0] for x in xs]) / nones
                    row[name] = float(np.median(ratios[name]))
                    row[name + " tau"] = statistics.median(x[1] for x in xs)
                    row[name + " verified"] = statistics.median(x[2] for x in xs)
                row["best"] = float(best_of([row[f"fixed {k}"] for k in fixed]))
                row["auto/best"] = row["auto"] / row["best"]
                b_auto = np.median(ratios["auto"][boot], axis=1)
                b_ab = b_auto / best_of([np.median(ratios[f"fixed {k}"][boot], axis=1) for k in fixed])
                row["auto/best 90%"] = [float(x) for x in np.percentile(b_ab, [5, 95])]
                row["auto 90%"] = [float(x) for x in np.percentile(b_auto, [5, 95])]
                row["auto/best held-out"] = held_out(ratios, fixed)
                row["ratios"] = {name: ratios[name].round(4).tolist() for name in ratios}
                # the pass of a block of l drafts as measured (by_n), verifying all l of them
                lim = [(expected_tau(P, ell) * curve[(R - 1)] / ((by_n[ell - 1] if ell else 0.0)
                        + curve[min(len(curve), R * (ell + 1)) - 1]), ell) for ell in range(0, 8)]
                row["limit"], row["limit_l"] = max(lim)
                out["cells"].append(row)
    return out


def best_of(fixed_speedups):
    """The limit a user reaches by tuning by hand: the best of no draft (1.0) and every fixed n, for
    speedups that are numbers or arrays of bootstrap medians (elementwise)."""
    return np.maximum(1.0, np.max(np.stack([np.asarray(x, dtype=float) for x in fixed_speedups]), axis=0))


def held_out(ratios: dict, fixed) -> float:
    """auto over the best of (no draft, every fixed n), the best chosen on one half of the samples
    and measured on the other, both ways, averaged: chosen and measured on the same samples, the
    highest of several noisy columns reads high by itself."""
    idx = np.arange(ratios["auto"].size)
    out = []
    for pick, meas in ((idx % 2 == 0, idx % 2 == 1), (idx % 2 == 1, idx % 2 == 0)):
        if not pick.any() or not meas.any():
            continue
        picked = [float(np.median(ratios[f"fixed {k}"][pick])) for k in fixed]
        k = fixed[int(np.argmax(picked))] if float(best_of(picked)) > 1.0 else 0   # 0: no draft
        best = float(np.median(ratios[f"fixed {k}"][meas])) if k else 1.0
        out.append(float(np.median(ratios["auto"][meas])) / best)
    return float(np.mean(out)) if out else float("nan")


def print_table(res, log):
    cells = res["cells"]
    fixed = sorted({k for c in cells for k in fixed_of(c)})
    others = sorted({k for c in cells for k in c if k.startswith("auto ") and "=" in k and " " not in k[5:]})

    def num(c, key, fmt="{:.2f}"):
        v = c.get(key)
        return "-" if v is None else fmt.format(*v) if isinstance(v, list) else fmt.format(v)
    hdr = ["R", "P", "no draft tok/s"] + [f"n={k}" for k in fixed] + ["auto", "auto 90%", "auto tau", "auto/best",
                                                                       "auto/best 90%", "held-out"] + others + ["limit (l)"]
    log("\n" + res["target"] + ": speedup over no draft (median tok/s ratio)")
    log(" | ".join(hdr))
    for c in cells:
        log(" | ".join([str(c["R"]), f"{c['P']:.2f}", f"{c['none_tps']:.1f}"]
                       + [num(c, f"fixed {k}") for k in fixed]
                       + [num(c, "auto"), num(c, "auto 90%", "{:.2f}-{:.2f}"), num(c, "auto tau"),
                          num(c, "auto/best", "{:.3f}"), num(c, "auto/best 90%", "{:.2f}-{:.2f}"),
                          num(c, "auto/best held-out", "{:.3f}")]
                       + [num(c, o) for o in others] + [f"{c['limit']:.2f} ({c['limit_l']})"]))


def fixed_of(cell) -> list:
    """The fixed blocks a cell was run with (``fixed k`` keys)."""
    return sorted(int(k[6:]) for k in cell if k.startswith("fixed ") and k[6:].isdigit())


def merge(results) -> list:
    """Runs of the same target (saved by --json, say R = 1 and R = 4 apart) as one result each."""
    out = {}
    for res in results:
        have = out.setdefault(res["target"], dict(res, cells=[]))
        have["cells"] += res["cells"]
        for k in ("draft_ms", "control"):
            have.setdefault(k, {}).update(res.get(k, {}))
    for res in out.values():
        res["cells"].sort(key=lambda c: (c["R"], c["P"]))
    return list(out.values())


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.6), squeeze=False)
    for ax, res in zip(axes[0], results):
        for R, style in ((1, "-"), (4, "--")):
            cells = [c for c in res["cells"] if c["R"] == R]
            if not cells:
                continue
            P = [c["P"] for c in cells]
            lo_hi = np.array([c.get("auto 90%", [c["auto"]] * 2) for c in cells]).T
            ax.errorbar(P, [c["auto"] for c in cells], yerr=np.abs(lo_hi - [c["auto"] for c in cells]),
                        fmt="o" + style, color="C0", capsize=2, label=f"auto R={R} (90%)")
            ax.plot(P, [max(c[f"fixed {k}"] for k in fixed_of(c)) for c in cells], "s" + style, color="C1",
                    label=f"best fixed R={R}")
            for k, mark, color, what in ((3, "^", "C2", "llama.cpp n=3"), (7, "v", "C3", "full block 7")):
                if all(f"fixed {k}" in c for c in cells):
                    ax.plot(P, [c[f"fixed {k}"] for c in cells], mark + style, color=color, label=f"{what} R={R}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(res["target"], fontsize=9)
        ax.set_xlabel("oracle P (block right)")
        ax.set_ylabel("speedup over no draft")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="smollm2")
    ap.add_argument("--p", default="0.3,0.5,0.7,0.8,0.9,0.95")
    ap.add_argument("--fixed", default="1,2,3,5,7")
    ap.add_argument("--rs", default="1,4")
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1, help="passes over the prompts (each run order drawn anew)")
    ap.add_argument("--auto-margins", default="", help="also run auto with these draft margins (A/B)")
    ap.add_argument("--auto-bands", default="", help="also run auto with these explore bands (A/B; 0: no exploring)")
    ap.add_argument("--auto-set", action="append", default=[],
                    help="also run auto with these policy fields set, e.g. probe_plan=0 (A/B; comma-separated or "
                         "the flag repeated: each field=value one more column)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("-ngl", "--n-gpu-layers", dest="ngl", default="auto",
                    help="layers on the GPU, as llama.cpp's -ngl (a number, auto or all; default auto)")
    ap.add_argument("--draft-type", default=None,
                    help="weight type of the random draft whose pass the oracle pays (default: as -md oracle:P)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    ap.add_argument("--from-json", default=None, help="print and plot saved runs (comma-separated --json files)")
    a = ap.parse_args()
    Ps = [float(x) for x in a.p.split(",")]
    fixed = [int(x) for x in a.fixed.split(",")]
    rs = [int(x) for x in a.rs.split(",")]

    def log(m):
        print(m, flush=True)

    results = []
    if a.from_json:
        for f in a.from_json.split(","):
            with open(f) as fh:
                results += json.load(fh)
        results = merge(results)
        for res in results:
            print_table(res, log)
        if a.png:
            plot(results, a.png)
            log(f"wrote {a.png}")
        return 0
    for spec in a.targets.split(","):
        path = default_target() if spec == "smollm2" else spec
        t0 = time.time()
        margins = [float(x) for x in a.auto_margins.split(",") if x]
        bands = [float(x) for x in a.auto_bands.split(",") if x]
        variants = [(kv.split("=")[0], float(kv.split("=")[1])) for kv in ",".join(a.auto_set).split(",") if kv]
        res = sweep_target(path, Ps, fixed, rs, a.n, a.prompts, a.threads, log, repeats=a.repeats, margins=margins,
                           bands=bands, variants=variants, n_gpu_layers=a.ngl, draft_type=a.draft_type)
        print_table(res, log)
        log(f"({time.time() - t0:.0f} s)")
        results.append(res)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=1)
    if a.png:
        plot(results, a.png)
        log(f"wrote {a.png}")


if __name__ == "__main__":
    sys.exit(main())
