"""The README's runnable snippets run as written.

Convention: a line ``<!-- readme-test -->`` (invisible on GitHub) right before a fenced ```bash or
```python block marks it as runnable.  Each one runs in a fresh process, in a folder where
``target.gguf`` is the SmolLM2 test target and ``draft.gguf`` a random DSpark draft for it, against
this checkout (PYTHONPATH); a ``pyllama-dspark`` command runs as ``python -m pyllama_dspark.cli``
(the console script's entry point), so the checkout's code is what runs.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARK = "<!-- readme-test -->"
FENCE = re.compile(r"^```(\w+)\s*$")


def marked_snippets(text: str):
    """[(language, code, line number)] of the blocks right after a MARK line."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].strip() == MARK:
            m = FENCE.match(lines[i + 1].strip()) if i + 1 < len(lines) else None
            if not m:
                raise AssertionError(f"README line {i + 1}: {MARK} must be followed by a ```lang fence")
            j = i + 2
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            out.append((m.group(1), "\n".join(lines[i + 2:j]) + "\n", i + 1))
            i = j
        i += 1
    return out


SNIPPETS = marked_snippets((ROOT / "README.md").read_text(encoding="utf-8"))


def test_readme_has_the_three_ways():
    langs = [lang for lang, _, _ in SNIPPETS]
    code = "".join(c for _, c, _ in SNIPPETS)
    assert "bash" in langs and langs.count("python") >= 2
    for needle in ("pyllama-dspark run", "DSparkDraftModel(llm", "DSpark(", "DSpark.from_llama(",
                   "create_chat_completion", "stream=True", "timings"):
        assert needle in code, needle


def test_marker_parser():
    text = f"x\n{MARK}\n```python\nprint(1)\n```\n```python\nnot marked\n```\n{MARK}\n```bash\nls\n```\n"
    assert marked_snippets(text) == [("python", "print(1)\n", 2), ("bash", "ls\n", 9)]
    with pytest.raises(AssertionError):
        marked_snippets(f"{MARK}\ntext\n")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, target_path, dspark_draft_path):
    d = tmp_path_factory.mktemp("readme")
    os.symlink(target_path, d / "target.gguf")
    os.symlink(dspark_draft_path, d / "draft.gguf")
    return d


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _bash_commands(code: str):
    for line in code.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        argv = shlex.split(line)
        if argv[0] == "pyllama-dspark":
            argv = [sys.executable, "-m", "pyllama_dspark.cli"] + argv[1:]
        yield argv


@pytest.mark.parametrize("lang, code, line", SNIPPETS, ids=[f"README:{n}" for _, _, n in SNIPPETS])
def test_snippet_runs(lang, code, line, workdir):
    if lang == "python":
        runs = [[sys.executable, "-c", code]]
    elif lang == "bash":
        runs = list(_bash_commands(code))
    else:
        raise AssertionError(f"README line {line}: no runner for ```{lang}")
    for argv in runs:
        p = subprocess.run(argv, cwd=workdir, env=_env(), capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, f"README line {line} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
        assert p.stdout.strip(), f"README line {line} printed nothing"
