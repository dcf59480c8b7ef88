"""A poisoned start against a clean one, as users run ``pyllama-dspark run`` (one process per run):
tokens/s over the first 128 and the first 1,024 tokens, from a cache a busy machine poisoned
(tests/poison.py: the issue's figures, every verify size B > 1 at 10x, the learned draft pass at
100x) and from the same cache clean.  With ``--old REV``, that revision runs beside this checkout
(each with a clean cache made by its own first run, poisoned the same way): what healing changed.

    python bench/poisoned_start.py [--old 9aaca50] [-m TARGET] [-md oracle:0.9] [--repeats 2]

Printed per code and cache: decode tokens/s (the stats line's), the wall time of the process (a
curve measured again at start is in it), and the share of cycles that verified drafts.  Run it on
an idle machine: llama.cpp's threads spin-wait.
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from cli_ab import snapshot          # noqa: E402  (bench/, beside this script)
from poison import POISONS           # noqa: E402  (tests/poison.py)

PROMPT = "Write a short story about a dragon who learns to paint."


def run(code: Path, cache: Path, target, draft, n: int, threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYLLAMA_DSPARK_")}
    env.update(PYTHONPATH=str(code), PYLLAMA_DSPARK_CACHE=str(cache))
    argv = [sys.executable, "-m", "pyllama_dspark.cli.main", "run", "-md", draft, "-p", PROMPT, "-n", str(n),
            "--temp", "0", "--ignore-eos", "-c", "2048", "-t", str(threads), "--json"] + (["-m", target] if target else [])
    t0 = time.perf_counter()
    # a neutral folder: ``python -m`` puts the working folder first on sys.path, before PYTHONPATH
    p = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env, cwd=cache.parent)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    st = json.loads(p.stdout)["stats"]
    vl = st["verify_lengths"]
    return dict(tok_s=st["tokens_per_second"], wall=wall, drafting=sum(1 for v in vl if v) / max(1, len(vl)))


def poisoned_copy(clean: Path, into: Path, name: str) -> Path:
    shutil.copytree(clean, into)
    if name == "clean":
        return into
    d = into / "profiles"
    (curve_f,) = [f for f in d.glob("*.json") if not f.name.startswith("learned-")]
    (learned_f,) = list(d.glob("learned-*.json"))
    curve, learned = json.loads(curve_f.read_text()), json.loads(learned_f.read_text())
    POISONS[name](curve, learned)
    curve_f.write_text(json.dumps(curve))
    learned_f.write_text(json.dumps(learned))
    return into


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", default=None, help="a revision to run beside this checkout")
    ap.add_argument("-m", "--model", default=None, help="target (default: SmolLM2)")
    ap.add_argument("-md", "--draft", default="oracle:0.9")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--lengths", default="128,1024")
    ap.add_argument("--only-old", action="store_true", help="run the --old revision alone")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        codes = {} if a.only_old and a.old else {"this": REPO}
        if a.old:
            codes["old " + a.old] = snapshot(a.old, tmp / "old")
        rows = []
        for label, code in codes.items():
            clean = tmp / f"clean-{len(rows)}"
            for _ in range(3):   # a first run measures the curve and learns (a busy machine's curve is not cached)
                run(code, clean, a.model, a.draft, 64, a.threads)
                if any(not f.name.startswith("learned-") for f in (clean / "profiles").glob("*.json")):
                    break
                print("the first run's curve was rejected (is the machine idle?): again", flush=True)
            else:
                raise SystemExit("no curve cached after 3 first runs: run this on an idle machine")
            for name in ["clean"] + list(POISONS):
                for n in lengths:
                    got = []
                    for r in range(a.repeats):
                        cache = poisoned_copy(clean, tmp / f"c-{label.replace(' ', '_')}-{name}-{n}-{r}", name)
                        got.append(run(code, cache, a.model, a.draft, n, a.threads))
                    rows.append(dict(code=label, cache=name, n=n, tok_s=statistics.median(g["tok_s"] for g in got),
                                     wall=statistics.median(g["wall"] for g in got),
                                     drafting=statistics.median(g["drafting"] for g in got)))
                    print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'code':<14} {'cache':<13} {'tokens':>6} {'tok/s':>8} {'vs clean':>9} {'wall s':>7} {'drafting':>9}")
    for r in rows:
        base = next(x for x in rows if x["code"] == r["code"] and x["cache"] == "clean" and x["n"] == r["n"])
        print(f"{r['code']:<14} {r['cache']:<13} {r['n']:>6} {r['tok_s']:>8.1f} {r['tok_s'] / base['tok_s']:>9.3f} "
              f"{r['wall']:>7.1f} {r['drafting']:>9.2f}")


if __name__ == "__main__":
    main()
