"""Throughput and latency of 1 and 2 ``serve`` replicas behind HAProxy (``deploy/replicas.py``).

    python bench/replicas_haproxy.py [--replicas 1,2] [--requests 40] [--rounds 2] [--clients 4] [-n 16]
        [-np 2] [-t T] [-m TARGET] [-md DRAFT | --no-draft]

Each replica count gets its own replicas (default target and shipped drafter, ``-np`` slots and
``-t`` threads each, continuous batching) behind its own HAProxy, all started first; two warm-up
requests each.  Then the same ``--requests`` greedy chat requests (the first turns of the bundled
prompt sets, interleaved: gsm8k, math500, mbpp, humaneval, mt-bench; ``max_tokens`` -n with
``ignore_eos``, so every request generates exactly -n tokens) go to every configuration, in
``--rounds`` slices that alternate between the configurations (so a change in the machine's load
hits all of them alike), sent by ``--clients`` threads that each take the next request when their
last one is done.  Prints requests/s and completion tokens/s (over the time spent sending) and the
p50 / p95 request latency.  Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import zip_longest
from pathlib import Path

import requests
from tabulate import tabulate

from pyllama_dspark.paths import default_draft, default_target
from pyllama_dspark.prompts import load_prompts

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("dspark_deploy_replicas", REPO / "deploy" / "replicas.py")
replicas = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(replicas)


def request_mix(n: int):
    by_source = {}
    for it in load_prompts():
        by_source.setdefault(it.source, []).append(it.turns[0])
    mixed = [p for row in zip_longest(*by_source.values()) for p in row if p is not None]
    return [mixed[i % len(mixed)] if i < len(mixed) else f"({i}) {mixed[i % len(mixed)]}" for i in range(n)]


def percentile(xs, q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def run_load(url: str, prompts, clients: int, n_tok: int):
    local = threading.local()

    def one(prompt):
        s = getattr(local, "session", None)
        if s is None:
            s = local.session = requests.Session()
            s.trust_env = False   # never through an environment proxy
        t0 = time.perf_counter()
        r = s.post(url + "/v1/chat/completions", timeout=600,
                   json={"messages": [{"role": "user", "content": prompt}], "max_tokens": n_tok,
                         "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        return time.perf_counter() - t0, r.json()["usage"]["completion_tokens"], r.headers.get("X-Served-By")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        out = list(pool.map(one, prompts))
    return time.perf_counter() - t0, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", default="1,2", help="replica counts to run (default 1,2)")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2, help="slices of the requests, alternating configurations")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("-n", "--max-tokens", type=int, default=16)
    ap.add_argument("-np", "--parallel", type=int, default=2, help="slots per replica")
    ap.add_argument("-t", "--threads", type=int, default=None,
                    help="threads per replica (default: cores / replicas, so every row uses the same cores)")
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-md", "--model-draft", default=None)
    ap.add_argument("--no-draft", action="store_true")
    args = ap.parse_args()
    target = args.model or default_target()
    draft = None if args.no_draft else (args.model_draft or default_draft())
    cores = os.cpu_count() or 1
    serve_args = ["-m", target, "-np", str(args.parallel), "-c", str(2048 * args.parallel), "--temp", "0"] \
        + (["-md", draft] if draft else [])
    prompts = request_mix(args.requests)
    print(f"serve {' '.join(serve_args)} -t T  (per replica, behind HAProxy: deploy/haproxy.cfg)")
    print(f"{args.requests} requests, {args.clients} client threads, {args.max_tokens} tokens each "
          f"(ignore_eos), greedy; {cores} CPU cores\n", flush=True)
    if os.getloadavg()[0] > 0.5:
        print(f"warning: load average {os.getloadavg()[0]:.2f}: the machine is not idle\n", flush=True)
    counts = [int(x) for x in args.replicas.split(",")]
    threads = {n: args.threads or max(1, cores // n) for n in counts}
    res = {n: [0.0, []] for n in counts}   # wall seconds, [(latency, tokens, replica)]
    with contextlib.ExitStack() as stack:
        sets = {}
        for n in counts:
            logs = stack.enter_context(tempfile.TemporaryDirectory(prefix="dspark-bench-replicas-"))
            sets[n] = stack.enter_context(replicas.Replicas(n, serve_args + ["-t", str(threads[n])], workdir=logs))
            run_load(sets[n].url, prompts[:2], 2, args.max_tokens)   # warm-up
        print(f"started: {', '.join(f'{n} replica(s) at {r.url}' for n, r in sets.items())}", flush=True)
        for r in range(args.rounds):
            part = prompts[r::args.rounds]
            for n in (counts if r % 2 == 0 else counts[::-1]):
                wall, out = run_load(sets[n].url, part, args.clients, args.max_tokens)
                res[n][0] += wall
                res[n][1] += out
                print(f"round {r + 1}: {n} replica(s), {len(part)} requests in {wall:.1f} s", flush=True)
    rows = []
    for n in counts:
        wall, out = res[n]
        lat = [o[0] for o in out]
        served = {name: sum(o[2] == name for o in out) for name in sorted({o[2] for o in out})}
        rows.append([n, threads[n], f"{len(out) / wall:.2f}", f"{sum(o[1] for o in out) / wall:.1f}",
                     f"{statistics.median(lat):.2f}", f"{percentile(lat, 0.95):.2f}", f"{wall:.1f}",
                     " ".join(f"{k}:{v}" for k, v in served.items())])
    print()
    print(tabulate(rows, headers=["replicas", "-t", "req/s", "tok/s", "p50 s", "p95 s", "wall s",
                                  "requests per replica"]))
    print(f"\nNote: every row runs on the same {cores} cores (-t = cores / replicas unless -t is given): "
          "a second replica splits the compute one replica already used, so on this machine the numbers "
          "do not scale (with 2 cores: one replica at -t 2 against two at -t 1).  What scales is compute "
          "per replica: one replica per GPU (CUDA_VISIBLE_DEVICES), per machine, or per disjoint set of "
          "cores on a many-core host (taskset -c, -t = its cores); then requests/s grows with the replica "
          "count until HAProxy or the clients are the limit, and the hash routing keeps each "
          "conversation's prompt cache on one replica.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
