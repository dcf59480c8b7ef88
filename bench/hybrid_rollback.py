"""What rolling back a hybrid target costs, and what DSpark gains on one (docs/benchmarks/hybrid.md).

Random-weight targets of the same width and depth (``make-test-target --arch A --layers L
--n-embd E``), one attention-only (qwen3) beside the hybrids (lfm2, qwen35: snapshots; qwen3next:
checkpoints), each with a random DSpark draft:

* per cycle: a verify decode of 8 rows with and without snapshots (``n_rs_seq`` 7 / 0: what writing
  them costs every decode), a checkpoint of one sequence's recurrent state taken and restored, and
  the replay decode of 4 kept rows (what a cut costs where there are no snapshots);
* end to end, one process per run as users run it: ``run -md oracle:P`` (P = 0.5 / 0.8 / 0.9) with
  the default ``auto`` schedule and with ``--schedule off``, against ``--no-draft``, decode tokens/s.

    python bench/hybrid_rollback.py [--layers 12] [--n-embd 512] [--n 128] [--threads 2] [--json out.json]
    python bench/hybrid_rollback.py --targets a.gguf,b.gguf [--reps 10] [--json out.json]

``--targets``: the per-cycle costs only, on target files you give (a ``--size`` target, say).
``--json``: the figures as data, beside the note that quotes them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pyllama_dspark.gguf.target_writer import make_test_target  # noqa: E402
from pyllama_dspark.gguf.testing import make_test_draft  # noqa: E402
from pyllama_dspark.llama.handles import ContextSettings, Target  # noqa: E402
from pyllama_dspark.llama.recurrent import Checkpoint  # noqa: E402

ARCHS = ("qwen3", "lfm2", "qwen35", "qwen3next")


def _ms(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(out))


def micro(target: str, threads: int, reps: int = 30) -> dict:
    """Per-cycle costs in ms (medians of ``reps``): an 8-row verify decode with and without snapshots,
    and where the target is recurrent a checkpoint taken / restored and a 4-row replay."""
    prompt = np.arange(100, 164, dtype=np.int32)
    rows = np.arange(200, 208, dtype=np.int32)
    res = {}
    for n_rs in (0, 7):
        t = Target(target, ContextSettings(n_ctx=512, n_threads=threads, n_rs_seq=n_rs))
        with t:
            t.decode(prompt, 0, all_outputs=False)
            ck = Checkpoint(t, 0) if t.recurrent else None

            def verify():
                t.decode(rows, len(prompt))
                if ck is not None:
                    ck.restore(t, 0)
                else:
                    t.seq_rm(0, len(prompt), -1)

            res[f"verify8_ms_rs{n_rs}"] = _ms(verify, reps)
            res["n_rs_seq_granted"] = t.n_rs_seq if n_rs else res.get("n_rs_seq_granted", 0)
            if ck is not None and n_rs == 0:
                res["state_bytes"] = ck.nbytes
                res["checkpoint_take_ms"] = _ms(lambda: Checkpoint(t, 0), reps)
                res["checkpoint_restore_ms"] = _ms(lambda: ck.restore(t, 0), reps)

                def replay():
                    t.decode_rows(rows[:4], np.arange(len(prompt), len(prompt) + 4, dtype=np.int32),
                                  np.zeros(4, dtype=np.int32), np.zeros(4, dtype=np.int8))
                    ck.restore(t, 0)

                res["replay4_ms"] = _ms(replay, reps) - res["checkpoint_restore_ms"]
    return res


def run_cli(target: str, extra, n: int, threads: int, cache: str) -> float:
    cmd = [sys.executable, "-m", "pyllama_dspark.cli.main", "run", "-m", target, "--raw", "-p",
           "Once upon a time in a land far away", "-n", str(n), "--temp", "0", "--json", "-t", str(threads),
           "--ignore-eos", *extra]
    env = {"PYLLAMA_DSPARK_CACHE": cache, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    if p.returncode:
        raise RuntimeError(p.stderr[-2000:])
    s = json.loads(p.stdout)["stats"]
    return float(s["tokens_per_second"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--targets", default="", help="comma-separated target files: per-cycle costs only")
    ap.add_argument("--reps", type=int, default=30, help="timed repetitions per per-cycle figure")
    ap.add_argument("--json", default=None, help="write the figures here")
    a = ap.parse_args()
    out = {"command": " ".join(sys.argv), "threads": a.threads, "targets": {}}
    if a.targets:
        for target in a.targets.split(","):
            m = micro(target, a.threads, a.reps)
            out["targets"][target] = {"micro": m}
            print(f"[{Path(target).name}] " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                      for k, v in m.items()))
        _dump(a.json, out)
        return
    work = Path(tempfile.mkdtemp(prefix="hybrid-bench-"))
    cache = str(work / "cache")
    print(f"targets: {a.layers} layers, n_embd {a.n_embd}, F32, 4,096-token vocabulary; {a.threads} threads")
    for arch in ARCHS:
        target = str(make_test_target(work / f"{arch}.gguf", arch, n_vocab=4096, seed=1, vocab_type="f32",
                                      n_layer=a.layers, n_embd=a.n_embd, n_head=a.n_embd // 64, n_head_kv=a.n_embd // 128,
                                      head_dim=64, n_ff=a.n_embd * 3))
        make_test_draft(target, str(work / f"{arch}-draft.gguf"), kind="dspark", seed=5)
        m = micro(target, a.threads, a.reps)
        rec = out["targets"][arch] = {"micro": m, "tok_s": {}}
        print(f"\n[{arch}] " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in m.items()))
        base = rec["tok_s"]["no-draft"] = max(run_cli(target, ["--no-draft"], a.n, a.threads, cache)
                                              for _ in range(a.repeats))
        print(f"[{arch}] --no-draft {base:.1f} tok/s")
        for p in (0.5, 0.8, 0.9):
            for sched in ("auto", "off"):
                tps = rec["tok_s"][f"oracle:{p} {sched}"] = max(
                    run_cli(target, ["-md", f"oracle:{p}", "--schedule", sched], a.n, a.threads, cache)
                    for _ in range(a.repeats))
                print(f"[{arch}] oracle:{p} {sched:4s} {tps:.1f} tok/s  x{tps / base:.2f}")
    _dump(a.json, out)


def _dump(path, out) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
