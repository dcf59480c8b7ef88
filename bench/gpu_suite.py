"""Issue 44's measurements in one device call: one ``pyllama-dspark run`` process per config, as
users run it, and a table of what docs/gpu.md reports.

    python bench/gpu_suite.py TARGET [-n 256] [-ngl 99] [--configs NAME=FLAGS;...] [--out DIR]
                              [--budget-s 240] [--cli "python3 -c '...'"]

TARGET may also be ``make:ARCH`` (one of :data:`MADE`: the hybrids lfm2 / qwen35 / qwen3next and
qwen3 beside them, 24 layers of width 2048, F16, a 32,768-token vocabulary): a random target
written into ``--out`` first (``make-test-target``), so that a device run covers the hybrid
targets' rollbacks (snapshots, checkpoints) as docs/targets.md describes them.  ``make:ARCH:SIZE``
writes a ``make-test-target --size SIZE --type q4_0 --peaked 4`` target instead: ``make:qwen35:4b``
(Qwen3.5-4B's shape, a hybrid) beside ``make:qwen3:4b`` (Qwen3-4B), as docs/benchmarks/hybrid.md
compares them on a CPU.

Each config is ``run -m TARGET -ngl N -n N --temp 0 --ignore-eos --raw --json -p PROMPT`` plus its
flags (default set below: no draft twice, ``auto`` with the random draft, ``-md oracle:0.9`` under
``auto`` and as a fixed block, with bf16 and q8_0 drafts, with and without the device read-out, and
its argmax form; leading ``NAME=VALUE`` words set the run's environment).
Per config: decode tok/s (``--json``, after the prefill) and its ratio to the no-draft median; tau;
the draft pass split into llama.cpp's decode and the host's own work; the host's work per cycle;
whether the tokens are the no-draft run's (and where they first differ, with the near-ties
counted).  Configs run in the order given, the no-draft ones first and last; a config that would
start after ``--budget-s`` is skipped (said so).  Writes ``gpu_suite_<target>.json`` into
``--out`` (default ``$OUT``, the device call's folder, or the current one).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

PROMPT = "Write a long, detailed essay about the history of the printing press in Europe."
DEFAULT_CONFIGS = ";".join([
    "nodraft=--no-draft",
    "nodraft_full_rows=--no-draft --no-backend-sampling",
    "auto_random=-md random",
    "auto_random_q8=-md random:q8_0",
    "or9=-md oracle:0.9",
    "or9_q8=-md oracle:0.9:q8_0",
    "or9_fixed=-md oracle:0.9 --schedule off",
    "or9_fixed_full_rows=-md oracle:0.9 --schedule off --no-backend-sampling",
    "or9_fixed_argmax=PYLLAMA_DSPARK_DEVICE_READOUT=argmax -md oracle:0.9 --schedule off",
    "random_fixed=-md random --schedule off",
    "nodraft2=--no-draft",
])


def run_one(cli, target, ngl, n, extra, timeout):
    """One run process; leading ``NAME=VALUE`` words of ``extra`` go to its environment."""
    words, env = shlex.split(extra), dict(os.environ)
    while words and "=" in words[0] and words[0].split("=")[0].isupper():
        k, _, v = words.pop(0).partition("=")
        env[k] = v
    cmd = cli + ["run", "-m", target, "-ngl", str(ngl), "-n", str(n), "--temp", "0", "--ignore-eos", "--raw",
                 "--json", "-p", PROMPT] + words
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode != 0:
        return None, f"rc={p.returncode}: {p.stderr[-1200:]}", time.time() - t0
    return json.loads(p.stdout), None, time.time() - t0


def row(name, d, base_tps, base_tokens):
    s = d["stats"]
    ms = s["ms"]
    c = max(s["cycles"], 1)
    drafted_cycles = sum(1 for v in s.get("verify_lengths", []) if v) or 0
    first = next((i for i, (a, b) in enumerate(zip(d["tokens"], base_tokens)) if a != b), None) \
        if base_tokens is not None else None
    return {
        "name": name, "tok_s": s["tokens_per_second"], "ratio": s["tokens_per_second"] / base_tps if base_tps else None,
        "tau": s["tau"], "drafted": s["drafted"], "accepted": s["accepted"], "cycles": s["cycles"],
        "draft_ms_per_pass": ms["draft"] / drafted_cycles if drafted_cycles else 0.0,
        "verify_ms_per_cycle": ms["verify"] / c, "host_ms_per_cycle": ms.get("host_per_cycle"),
        "hidden_ms": ms.get("hidden", 0.0), "near_ties": s["near_ties"],
        "same_as_nodraft": None if base_tokens is None else d["tokens"] == base_tokens, "first_diff": first,
    }


#: ``make:ARCH`` targets: the same shape for every arch (docs/benchmarks/hybrid.md has the CPU figures)
MADE = ("qwen3", "lfm2", "qwen35", "qwen3next")
MADE_SHAPE = dict(n_layer=24, n_embd=2048, n_head=16, n_head_kv=8, head_dim=128, n_ff=6144, n_vocab=32768,
                  weight_type="f16", seed=1)


def made_target(spec: str, out: str) -> str:
    """The path of TARGET, writing ``make:ARCH`` / ``make:ARCH:SIZE`` targets into ``out`` first."""
    if not spec.startswith("make:"):
        return spec
    _, arch, *rest = spec.split(":")
    size = rest[0] if rest else ""
    os.makedirs(out, exist_ok=True)
    if size:
        from pyllama_dspark.gguf.target_sizes import get_size
        from pyllama_dspark.llama.quantize import write_test_target

        try:
            get_size(arch, size)
        except ValueError as e:
            raise SystemExit(str(e))
        path = os.path.join(out, f"{arch}-{size}-q4_0.gguf")
        if not os.path.exists(path):
            write_test_target(path, arch, qtype="q4_0", size=size, peaked=4.0)
        return path
    if arch not in MADE:
        raise SystemExit(f"make:ARCH takes one of {', '.join(MADE)}")
    from pyllama_dspark.gguf.target_writer import make_test_target

    path = os.path.join(out, f"{arch}-made.gguf")
    if not os.path.exists(path):
        make_test_target(path, arch, **MADE_SHAPE)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("-ngl", default="99")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--timeout-s", type=float, default=180.0)
    ap.add_argument("--cli", default=None, help="how to call the CLI (default: this Python's pyllama_dspark.cli)")
    a = ap.parse_args()
    cli = shlex.split(a.cli) if a.cli else [sys.executable, "-m", "pyllama_dspark.cli"]
    a.target = made_target(a.target, a.out)
    t_start = time.time()
    results, errors = {}, {}
    for cfg in a.configs.split(";"):
        name, _, extra = cfg.partition("=")
        if time.time() - t_start > a.budget_s:
            print(f"{name}: skipped (past the {a.budget_s:.0f} s budget)", flush=True)
            continue
        try:
            d, err, wall = run_one(cli, a.target, a.ngl, a.n, extra, a.timeout_s)
        except subprocess.TimeoutExpired:
            d, err, wall = None, "timed out", a.timeout_s
        if d is None:
            errors[name] = err
            print(f"{name}: {err}", flush=True)
            continue
        results[name] = d
        s = d["stats"]
        print(f"{name:22s} {s['tokens_per_second']:8.1f} tok/s  tau {s['tau']:5.2f}  drafted {s['drafted']:4d}  "
              f"host/cycle {s['ms'].get('host_per_cycle', 0):.3f} ms  wall {wall:5.1f} s", flush=True)
    bases = [results[k] for k in results if k.startswith("nodraft") and "full_rows" not in k]
    base_tps = statistics.median([b["stats"]["tokens_per_second"] for b in bases]) if bases else None
    base_tokens = bases[0]["tokens"] if bases else None
    table = [row(k, d, base_tps, base_tokens) for k, d in results.items()]
    print(f"\n{'config':22s} {'tok/s':>8s} {'/none':>6s} {'tau':>5s} {'pass ms':>8s} {'verify':>7s} {'host':>6s} "
          f"{'same':>5s} {'diff@':>5s} {'ties':>4s}")
    for r in table:
        print(f"{r['name']:22s} {r['tok_s']:8.1f} {r['ratio'] or 0:6.3f} {r['tau']:5.2f} {r['draft_ms_per_pass']:8.3f} "
              f"{r['verify_ms_per_cycle']:7.3f} {r['host_ms_per_cycle'] or 0:6.3f} {str(r['same_as_nodraft'])[:5]:>5s} "
              f"{'' if r['first_diff'] is None else r['first_diff']:>5} {r['near_ties']:4d}")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"gpu_suite_{os.path.basename(a.target)}.json")
    with open(path, "w") as f:
        json.dump({"target": a.target, "n": a.n, "ngl": a.ngl, "table": table, "errors": errors,
                   "stats": {k: v["stats"] for k, v in results.items()}}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
