"""No false alarms: on a quiet machine, how often is a first run's cost curve accepted on the first
try?  Each run is ``pyllama-dspark run`` from an empty cache (a fresh process, as a new user runs
it); printed per run: rejected or not (and why: the stderr line), the load it measured, and whether
the curve was cached.  Goal: accepted on the first try in at least 9 of 10 runs.

    python bench/profile_false_alarms.py [--runs 10] [-m TARGET] [-t THREADS]

Run it on an idle machine (that is the point).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-t", "--threads", type=int, default=None)
    a = ap.parse_args()
    first_try = 0
    for i in range(a.runs):
        with tempfile.TemporaryDirectory() as cache:
            env = {k: v for k, v in os.environ.items() if not k.startswith("PYLLAMA_DSPARK_")}
            env["PYLLAMA_DSPARK_CACHE"] = cache
            argv = [sys.executable, "-m", "pyllama_dspark.cli.main", "run", "-p", "Hi", "-n", "8", "--temp", "0"]
            argv += (["-m", a.model] if a.model else []) + (["-t", str(a.threads)] if a.threads else [])
            p = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)
            if p.returncode != 0:
                raise RuntimeError(p.stderr[-2000:])
            rejected = [ln for ln in p.stderr.splitlines() if "rejected" in ln]
            curves = [f for f in (Path(cache) / "profiles").glob("*.json") if not f.name.startswith("learned-")]
            load = json.loads(curves[0].read_text())["load"] if curves else {}
            first_try += not rejected
            print(f"run {i + 1}: {'accepted' if not rejected else 'REJECTED'}; cached {bool(curves)}; "
                  f"others {load.get('others_cores')} cores, steal {load.get('steal_cores')}, "
                  f"cpu {load.get('cpu_s')} s in {load.get('wall_s')} s" + "".join(f"\n   {ln}" for ln in rejected),
                  flush=True)
    print(f"accepted on the first try: {first_try} of {a.runs}")


if __name__ == "__main__":
    main()
