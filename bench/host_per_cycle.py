"""The host's own work per cycle, in one process (issue 44): ``ms.host_per_cycle`` of ``--json``
(the generation's time outside llama.cpp's decodes, per cycle) for the loop without a draft, with
``auto`` not drafting (a random draft), with ``auto`` drafting (the oracle), and for a fixed block.

    python bench/host_per_cycle.py [-m TARGET] [-n 96] [--repeats 5] [-ngl auto] [--backend-sampling auto]

Each configuration is one Speculator; its first generation warms it up, then ``--repeats``
generations of the same prompt alternate across configurations.  Prints the median per cycle of
the host's work and of the time inside llama.cpp, and the cycles that drafted.  Run it on an idle
machine: llama.cpp's threads spin-wait, so anything else running inflates both columns.
"""

from __future__ import annotations

import argparse
import statistics

from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.drafts.made import random_draft_for
from pyllama_dspark.paths import default_target

PROMPT = "Write a long, detailed essay about the history of the printing press in Europe."


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("-ngl", default="auto")
    ap.add_argument("--backend-sampling", default="auto")
    a = ap.parse_args()
    target = a.model or default_target()
    random = random_draft_for(target, "dspark")
    kw = dict(n_threads=a.threads, n_gpu_layers=a.ngl, backend_sampling=a.backend_sampling)
    configs = {
        "no draft": Speculator(target, None, **kw),
        "auto, random draft": Speculator(target, random, **kw),
        "auto, oracle 0.9": Speculator(target, "oracle:0.9", **kw),
        "fixed block, random": Speculator(target, random, schedule="off", **kw),
    }
    host = {k: [] for k in configs}
    llama = {k: [] for k in configs}
    drafting = {k: [] for k in configs}
    try:
        for k, sp in configs.items():
            sp.generate(PROMPT, a.n, ignore_eos=True)   # warm-up (the auto curve, first decodes)
        for _ in range(a.repeats):
            for k, sp in configs.items():
                st = sp.generate(PROMPT, a.n, ignore_eos=True).stats
                host[k].append(st.ms_host / st.cycles)
                llama[k].append(st.ms_llama / st.cycles)
                drafting[k].append(sum(1 for v in st.verify_lengths if v) / st.cycles)
    finally:
        for sp in configs.values():
            sp.close()
    print(f"{a.n} tokens x {a.repeats} generations per configuration (median per cycle)")
    print(f"{'configuration':22s} {'host ms':>8s} {'llama ms':>9s} {'drafting':>9s}")
    for k in configs:
        print(f"{k:22s} {statistics.median(host[k]):8.4f} {statistics.median(llama[k]):9.3f} "
              f"{statistics.median(drafting[k]):9.2f}")


if __name__ == "__main__":
    main()
