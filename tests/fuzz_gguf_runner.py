"""Runs a batch of GGUF fuzz cases (see :mod:`fuzz_gguf`): ``python fuzz_gguf_runner.py cases.json``.

The public loading paths are imported once here; each case runs in a forked child (a llama.cpp
abort kills only the child) with its stdout / stderr in files and its address space limited (a
bogus tensor size must fail to allocate, not take the machine's memory).  One JSON line per case
on stdout: ``{"id", "outcome", "detail"}``.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fuzz_gguf import apply_ops  # noqa: E402

AS_LIMIT = 6 << 30


def _speculator(target: str, draft) -> str:
    from pyllama_dspark import Speculator

    with Speculator(target, draft, n_ctx=64, n_threads=1, schedule="off") as sp:
        n = min(3, sp.target.n_vocab)
        # 6 tokens: past the first (from the prompt's logits) into draft blocks (Markov head, confidence)
        done = sp.generate(list(range(1, n + 1)), 6, ignore_eos=True)
        return f"decoded {done.tokens}"


def _cli(args) -> int:
    from pyllama_dspark.cli.main import main

    try:
        main(args, prog_name="pyllama-dspark", standalone_mode=True)
    except SystemExit as e:
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


def _child(case: dict, base: bytes, work: str, res_path: str) -> None:
    out = os.open(os.path.join(work, f"{case['id']}.out"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err_path = os.path.join(work, f"{case['id']}.err")
    err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(err, 2)
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))
    path = os.path.join(work, f"{case['id']}.gguf")
    with open(path, "wb") as f:
        f.write(apply_ops(base, case["ops"]))
    target, draft = case["target"], case["draft"]
    if case["kind"] == "target":
        target = path
    else:
        draft = path
    res = {"id": case["id"]}
    mode = case["mode"]
    try:
        if mode in ("speculator", "nodraft"):
            try:
                res.update(outcome="ok", detail=_speculator(target, draft if mode == "speculator" else None))
            except Exception as e:   # noqa: BLE001 - classified below
                from pyllama_dspark.errors import DSparkError

                if isinstance(e, DSparkError):
                    res.update(outcome="error", detail=f"{type(e).__name__}: {e}"[:400])
                else:
                    res.update(outcome="exception", detail=traceback.format_exc()[-2000:])
        else:
            args = (["inspect", draft, "--target", target] if mode == "inspect" else
                    ["run", "-m", target, "-md", draft, "-p", "hi", "-n", "6", "-t", "1", "-c", "64", "--temp", "0",
                     "--raw", "--schedule", "off", "--ignore-eos"])
            rc = _cli(args)
            sys.stdout.flush()
            sys.stderr.flush()
            with open(err_path, errors="replace") as f:
                text = f.read()
            errors = [ln for ln in text.splitlines() if ln.startswith("Error:")]
            if rc == 0:
                res.update(outcome="ok", detail="rc 0")
            elif rc in (1, 2) and len(errors) == 1 and "Traceback" not in text:
                res.update(outcome="error", detail=f"rc {rc}: {errors[0]}"[:400])
            else:
                res.update(outcome="cli-bad", detail=f"rc {rc}: {text[-2000:]}")
    except BaseException:   # noqa: BLE001 - anything that escaped is a finding
        res.update(outcome="exception", detail=traceback.format_exc()[-2000:])
    with open(res_path, "w") as f:
        json.dump(res, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    work, timeout = spec["work"], float(spec["timeout"])
    # what every child needs, imported (not initialised) once
    import pyllama_dspark.cli.main  # noqa: F401
    from pyllama_dspark import Speculator  # noqa: F401

    # the good partners' metadata parsed once here (pure Python), inherited by every child
    from pyllama_dspark.gguf.target_info import read_target_info

    for t in {c["target"] for c in spec["cases"] if c["kind"] == "draft"}:
        try:
            read_target_info(t)
        except Exception:   # noqa: BLE001 - the child reports it
            pass
    bases = {}
    for case in spec["cases"]:
        b = case["base"]
        if b not in bases:
            with open(b, "rb") as f:
                bases[b] = f.read()
    for case in spec["cases"]:
        res_path = os.path.join(work, f"{case['id']}.json")
        sys.stdout.flush()
        sys.stderr.flush()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            try:
                _child(case, bases[case["base"]], work, res_path)
            finally:
                os._exit(3)
        status = None
        while time.monotonic() - t0 < timeout:
            got, st = os.waitpid(pid, os.WNOHANG)
            if got:
                status = st
                break
            time.sleep(0.005)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            res = {"id": case["id"], "outcome": "timeout", "detail": f"no end after {timeout} s"}
        elif os.WIFSIGNALED(status) or os.WEXITSTATUS(status) != 0 or not os.path.exists(res_path):
            try:
                with open(os.path.join(work, f"{case['id']}.err"), errors="replace") as f:
                    tail = f.read()[-1500:]
            except OSError:
                tail = ""
            how = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}")
            res = {"id": case["id"], "outcome": "signal", "detail": f"{how}: {tail}"}
        else:
            with open(res_path) as f:
                res = json.load(f)
        res["seconds"] = round(time.monotonic() - t0, 3)
        for ext in (".gguf", ".out", ".err", ".json"):
            try:
                os.unlink(os.path.join(work, case["id"] + ext))
            except OSError:
                pass
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
