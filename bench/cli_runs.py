"""``pyllama-dspark run`` as users run it: one process per prompt, the default against ``--no-draft``.

    python bench/cli_runs.py [--prompts 5] [--repeats 2] [-n 96] [--drafts shipped,random,oracle:0.9]
                             [--temps 0,0.8] [--fresh-memory | --cold]

Every (draft, temperature) cell runs each prompt as ``run`` (the default: auto schedule) and as
``run --no-draft``, each in its own process, back to back in an order rotated per prompt and repeat.
Reported per cell: the median over runs of the generation's tok/s (the ``--json`` stats: the decode
after the prompt's prefill, what ``run`` prints) as a ratio to no draft, the median and the geometric
mean of the paired ratios (each default run over the no-draft run of the same prompt and repeat, back
to back; a rare costly run, a probe, moves the mean, not the median), and the median wall time of
the whole process (start-up and model loading included) as a ratio.  ``--fresh-memory`` deletes what auto learned
(``learned-*.json`` in the cache) before each cell's first run, so the cell's first run starts cold
(the oracle's first-run figure, one sample per cell); ``--cold`` deletes it before every default run,
so every run is a first run from a cold memory and the first-run column is their median.  Run it on an idle machine: llama.cpp's threads spin-wait.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from pyllama_dspark.paths import cache_dir, default_draft
from pyllama_dspark.prompts import load_prompts


def run_cli(args, env=None, cwd=None):
    """One ``pyllama-dspark run`` process (``env``: its environment, default this one's; ``cwd``: its
    working folder, which ``python -m`` puts before PYTHONPATH on sys.path): its ``--json`` output
    and wall time."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "pyllama_dspark.cli.main", "run", *args], capture_output=True,
                       text=True, timeout=900, env=env, cwd=cwd)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    return json.loads(p.stdout), wall


def forget():
    for f in (cache_dir() / "profiles").glob("learned-*.json"):
        f.unlink()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("--drafts", default="shipped,random")
    ap.add_argument("--temps", default="0,0.8")
    ap.add_argument("--fresh-memory", action="store_true")
    ap.add_argument("--cold", action="store_true", help="forget what auto learned before every default run")
    a = ap.parse_args()
    items = load_prompts((), limit_per_file=a.prompts)[:a.prompts]
    texts = [it.turns[0] for it in items]
    rows = []
    for draft in a.drafts.split(","):
        md = [] if draft == "shipped" else ["-md", draft]
        if draft == "shipped" and not default_draft():
            continue
        for temp in (float(x) for x in a.temps.split(",")):
            if draft.startswith("oracle") and temp > 0:
                continue
            if a.fresh_memory:
                forget()
            res = {"default": [], "no-draft": []}
            first = None
            first_stats = []   # the first runs' drafted tokens and ms parts (what a cold start spent)
            k = 0
            for rep in range(a.repeats):
                for text in texts:
                    order = ["default", "no-draft"] if k % 2 == 0 else ["no-draft", "default"]
                    k += 1
                    for name in order:
                        if a.cold and name == "default":
                            forget()
                        args = ["-p", text, "-n", str(a.n), "--ignore-eos", "--temp", str(temp), "--seed", "1",
                                "--json"] + (md if name == "default" else ["--no-draft"])
                        out, wall = run_cli(args)
                        res[name].append((out["stats"]["tokens_per_second"], wall, out["stats"].get("drafted", 0)))
                        if name == "default" and (first is None or a.cold):
                            first = (first or []) + [out["stats"]["tokens_per_second"]]
                            st = out["stats"]
                            first_stats.append(dict(drafted=st.get("drafted", 0),
                                                    ms={k: round(v, 1) for k, v in st.get("ms", {}).items()}))
            # paired: each default run over the no-draft run of the same prompt and repeat, run back
            # to back (this machine's speed drifts by 10-20% over minutes, which a ratio of medians
            # over a cell's 12 runs each keeps)
            paired = [a[0] / b[0] for a, b in zip(res["default"], res["no-draft"])]
            base_tps = statistics.median(x[0] for x in res["no-draft"])
            base_wall = statistics.median(x[1] for x in res["no-draft"])
            row = dict(draft=draft, temp=temp, runs=len(res["default"]),
                       no_draft_tps=round(base_tps, 1),
                       tps_ratio=round(statistics.median(x[0] for x in res["default"]) / base_tps, 3),
                       paired_ratio=round(statistics.median(paired), 3),
                       paired_mean=round(statistics.geometric_mean(paired), 3),
                       wall_ratio=round(base_wall / statistics.median(x[1] for x in res["default"]), 3),
                       first_run_ratio=round(statistics.median(first) / base_tps, 3), first_runs=first_stats,
                       drafted=[x[2] for x in res["default"]])
            rows.append(row)
            print(json.dumps(row), flush=True)
    print_table(["draft", "T", "runs", "no draft tok/s", "default / no draft (tok/s)", "paired", "paired (mean)",
                 "(wall, per process)", "first run"],
                rows, ["draft", "temp", "runs", "no_draft_tps", "tps_ratio", "paired_ratio", "paired_mean", "wall_ratio",
                       "first_run_ratio"])


def print_table(header, rows, keys):
    """A markdown table of the rows' ``keys`` (ratios with three decimals)."""
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(f"{r[k]:.3f}" if k.endswith(("ratio", "paired", "over_a", "mean")) else str(r[k])
                                for k in keys) + " |")


if __name__ == "__main__":
    sys.exit(main())
