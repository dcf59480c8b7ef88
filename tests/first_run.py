"""Every marked snippet of the README and the docs, run once as a new user runs it: a fresh cache
folder, none of the suite's environment variables (no fake cost profile, the schedule's memory on,
the default thread count), the default schedule.  Run serially by ``conftest.pytest_sessionstart``
before the test workers start (a cost curve measured beside them is contended by construction);
``test_readme.py`` checks what each run printed and left in its cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: where the controller leaves the results for the workers
RESULTS_ENV = "PYLLAMA_DSPARK_TEST_FIRST_RUN"
#: the suite's own variables a user never sets: none of them may reach a first run
KEEP = ("PYLLAMA_DSPARK_CACHE", "PYLLAMA_DSPARK_SHIM")


def user_env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYLLAMA_DSPARK_") or k in KEEP}
    env["PYLLAMA_DSPARK_CACHE"] = str(cache)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def argvs(lang: str, code: str):
    """The processes a snippet is: python -c CODE, or each command of a bash block
    (``pyllama-dspark`` run as ``python -m pyllama_dspark.cli.main``, its console script's entry)."""
    import shlex

    if lang == "python":
        return [[sys.executable, "-c", code]]
    out = []
    for line in code.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        argv = shlex.split(line)
        if argv[0] == "pyllama-dspark":
            argv = [sys.executable, "-m", "pyllama_dspark.cli.main"] + argv[1:]
        out.append(argv)
    return out


def run_one(lang: str, code: str, target: str, draft: str, base: Path) -> dict:
    """Run one snippet in a fresh folder with a fresh cache; what each process printed and the
    files its cache holds afterwards."""
    work = Path(tempfile.mkdtemp(prefix="snippet-", dir=base))
    cache = work / "cache"
    os.symlink(target, work / "target.gguf")
    os.symlink(draft, work / "draft.gguf")
    env = user_env(cache)
    runs = []
    for argv in argvs(lang, code):
        p = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=900)
        runs.append(dict(argv=argv, rc=p.returncode, stdout=p.stdout, stderr=p.stderr))
        if p.returncode != 0:
            break
    profiles = sorted(f.name for f in (cache / "profiles").glob("*.json")) if (cache / "profiles").is_dir() else []
    return dict(cwd=str(work), cache=str(cache), env_keys=sorted(k for k in env if k.startswith("PYLLAMA_DSPARK_")),
                runs=runs, profiles=profiles)


def run_all(snippets, target: str, draft: str, base: Path) -> Path:
    """Run every ``(lang, code, where)`` serially; the results as JSON in ``base``, keyed by the
    snippet's first place."""
    out = {}
    for lang, code, where in snippets:
        out[where[0]] = run_one(lang, code, target, draft, base)
    path = base / "first-run.json"
    path.write_text(json.dumps(out))
    return path


def results():
    """What the controller's first runs left, or None (not run in this session)."""
    path = os.environ.get(RESULTS_ENV)
    if not path or not os.path.isfile(path):
        return None
    return json.loads(Path(path).read_text())
