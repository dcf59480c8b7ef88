"""Two revisions of this repository against each other, as users run ``pyllama-dspark run``: one
process per run, each revision with its own memory of what auto learned (the same cost curves),
and ``--no-draft`` beside them, rotated per prompt and repeat.

    python bench/cli_ab.py REV_A REV_B [--cells shipped@0.8,random@0,oracle:0.9@0] [--prompts 4]
                           [--repeats 3] [-n 96]

Each revision is checked out with ``git archive`` into a temporary folder (the built shim copied in:
the C side must be the same in both), run with ``PYTHONPATH`` on it and ``PYLLAMA_DSPARK_CACHE`` on a
folder of its own, which starts each cell with the cost profiles of the real cache and no learned
memory.  Printed per cell: the median of the paired tok/s ratios (each run over the no-draft run of
the same prompt and repeat), B over A paired the same way, their geometric means (a rare costly run,
a probe, moves the mean and not the median), and the tokens each run drafted.  Run it
on an idle machine: llama.cpp's threads spin-wait.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from cli_runs import print_table, run_cli   # bench/, beside this script
from pyllama_dspark.llama._native import _shim_path
from pyllama_dspark.paths import cache_dir
from pyllama_dspark.prompts import load_prompts

REPO = Path(__file__).resolve().parent.parent


def snapshot(rev: str, into: Path) -> Path:
    into.mkdir(parents=True)
    tar = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    shutil.copy(_shim_path(), into / "pyllama_dspark")   # the one this checkout loads (installed or built here)
    return into


def fresh_caches(root: Path, names) -> None:
    shutil.rmtree(root, ignore_errors=True)
    for v in names:
        d = root / v / "profiles"
        d.mkdir(parents=True)
        for f in (cache_dir() / "profiles").glob("*.json"):
            if not f.name.startswith("learned-"):
                shutil.copy(f, d / f.name)


def run(code: Path, cache: Path, args) -> tuple:
    # run beside the snapshot, not in this checkout: ``python -m`` puts the working folder first on sys.path
    out, _ = run_cli(args, env=dict(os.environ, PYTHONPATH=str(code), PYLLAMA_DSPARK_CACHE=str(cache)),
                     cwd=code.parent)
    return out["stats"]["tokens_per_second"], out["stats"].get("drafted", 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rev_a")
    ap.add_argument("rev_b")
    ap.add_argument("--cells", default="shipped@0.8,random@0,shipped@0,oracle:0.9@0",
                    help="draft@temperature, comma-separated (shipped: the default draft)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-n", type=int, default=96)
    a = ap.parse_args()
    texts = [it.turns[0] for it in load_prompts((), limit_per_file=a.prompts)[:a.prompts]]
    with tempfile.TemporaryDirectory() as tmp:
        code = {"A": snapshot(a.rev_a, Path(tmp) / "A"), "B": snapshot(a.rev_b, Path(tmp) / "B")}
        code["N"] = code["A"]
        caches = Path(tmp) / "cache"
        rows = []
        for cell in a.cells.split(","):
            draft, temp = cell.rsplit("@", 1)
            fresh_caches(caches, code)
            md = [] if draft == "shipped" else ["-md", draft]
            res = {v: [] for v in code}
            k = 0
            for _ in range(a.repeats):
                for text in texts:
                    for v in (["A", "B", "N"], ["B", "N", "A"], ["N", "A", "B"])[k % 3]:
                        args = ["-p", text, "-n", str(a.n), "--ignore-eos", "--temp", temp, "--seed", "1",
                                "--json"] + (["--no-draft"] if v == "N" else md)
                        res[v].append(run(code[v], caches / v, args))
                    k += 1

            def paired(x, y):
                return round(statistics.median(p[0] / q[0] for p, q in zip(res[x], res[y])), 3)

            def mean(x, y):   # the geometric mean: a rare costly run (a probe) counts, as over many runs
                return round(statistics.geometric_mean(p[0] / q[0] for p, q in zip(res[x], res[y])), 3)

            row = dict(draft=draft, temp=float(temp), runs=len(res["N"]),
                       no_draft_tps=round(statistics.median(x[0] for x in res["N"]), 1),
                       a_paired=paired("A", "N"), b_paired=paired("B", "N"), b_over_a=paired("B", "A"),
                       a_mean=mean("A", "N"), b_mean=mean("B", "N"), b_over_a_mean=mean("B", "A"),
                       a_drafted=[x[1] for x in res["A"]], b_drafted=[x[1] for x in res["B"]])
            rows.append(row)
            print(json.dumps(row), flush=True)
    print_table(["draft", "T", "runs", "no draft tok/s", f"{a.rev_a} / no draft", f"{a.rev_b} / no draft", "B / A",
                 "A (mean)", "B (mean)", "B / A (mean)"],
                rows, ["draft", "temp", "runs", "no_draft_tps", "a_paired", "b_paired", "b_over_a", "a_mean", "b_mean",
                       "b_over_a_mean"])


if __name__ == "__main__":
    sys.exit(main())
