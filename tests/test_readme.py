"""The runnable snippets of the README and of the docs pages (docs/**/*.md) run as written.

Convention: a line ``<!-- readme-test -->`` (invisible on GitHub and on the docs site) right before a
fenced ```bash or ```python block marks it as runnable.  Each one runs as a new user runs it
(tests/first_run.py: a fresh cache folder, none of the suite's variables, the default schedule), in
a fresh process, in a folder where ``target.gguf`` is the SmolLM2 test target and ``draft.gguf`` a
random DSpark draft for it, against this checkout (PYTHONPATH); a ``pyllama-dspark`` command runs as
``python -m pyllama_dspark.cli.main`` (the console script's entry point), so the checkout's code is
what runs.  The runs happen once per session, serially, before the test workers start
(conftest.pytest_sessionstart); the tests here check what they printed.
A snippet that appears word for word in several places (the README's examples are repeated in
docs/usage.md) runs once, under the ids of all its places.  What each snippet prints is checked too:
a bash command by its subcommand, a Python snippet by a line of its code (``CHECKS``).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

import first_run

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
                raise AssertionError(f"line {i + 1}: {MARK} must be followed by a ```lang fence")
            j = i + 2
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            out.append((m.group(1), "\n".join(lines[i + 2:j]) + "\n", i + 1))
            i = j
        i += 1
    return out


#: the files whose marked snippets run: the README, then every docs page
DOC_FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def _all_snippets():
    """{(lang, code): ["FILE:LINE", ...]} in file order: identical snippets run once."""
    found = {}
    for f in DOC_FILES:
        name = f.relative_to(ROOT).as_posix()
        try:
            snippets = marked_snippets(f.read_text(encoding="utf-8"))
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
        for lang, code, line in snippets:
            found.setdefault((lang, code), []).append(f"{name}:{line}")
    return found


FOUND = _all_snippets()
SNIPPETS = [(lang, code, where) for (lang, code), where in FOUND.items()]
README_SNIPPETS = marked_snippets((ROOT / "README.md").read_text(encoding="utf-8"))


def test_readme_has_the_three_ways():
    langs = [lang for lang, _, _ in README_SNIPPETS]
    code = "".join(c for _, c, _ in README_SNIPPETS)
    assert "bash" in langs and langs.count("python") >= 2
    for needle in ("pyllama-dspark run", "DSparkDraftModel(llm", "DSpark(", "DSpark.from_llama(",
                   "create_chat_completion", "stream=True", "timings"):
        assert needle in code, needle


def test_marker_parser():
    text = f"x\n{MARK}\n```python\nprint(1)\n```\n```python\nnot marked\n```\n{MARK}\n```bash\nls\n```\n"
    assert marked_snippets(text) == [("python", "print(1)\n", 2), ("bash", "ls\n", 9)]
    with pytest.raises(AssertionError):
        marked_snippets(f"{MARK}\ntext\n")


def _user(text):
    return [{"role": "user", "content": text}]


def _chat_ref(refs, text, n):
    return refs.chat(_user(text), n)["choices"][0]["message"]["content"]


def _opt(argv, *names, default=None):
    for n in names:
        if n in argv:
            return argv[argv.index(n) + 1]
    return default


def _check_run_cli(argv, out, err, refs, cwd):
    """`pyllama-dspark run` (temperature 0.8 by default, so the text itself cannot be predicted
    unless --temp 0): the prompt is llama-cpp-python's chat prompt for -p (its completion prompt with
    --raw), at most -n tokens came out, none drafted without a draft, and
    stdout is the text the stats line counts (with --json: one JSON object holding text and stats)."""
    prompt, n = _opt(argv, "-p", "--prompt"), int(_opt(argv, "-n", "--n-predict"))
    raw, drafting = "--raw" in argv, _opt(argv, "-md", "--model-draft") is not None and "--no-draft" not in argv
    if "--json" in argv:
        import json

        obj = json.loads(out)
        st = obj["stats"]
        n_prompt, n_gen, drafted, accepted = st["n_prompt"], st["n_generated"], st["drafted"], st["accepted"]
        text = obj["text"]
        assert len(obj["tokens"]) == n_gen
    else:
        m = re.search(r"prompt (\d+) tok, generated (\d+) tok .*drafted (\d+), accepted (\d+)", err)
        assert m, f"no stats line on stderr:\n{err}"
        n_prompt, n_gen, drafted, accepted = map(int, m.groups())
        text = out
    want = refs.completion_tokens(prompt) if raw else refs.chat_tokens(_user(prompt))
    assert n_prompt == len(want), "not the prompt llama-cpp-python builds"
    assert 1 <= n_gen <= n and 0 <= accepted <= drafted
    # a draft named: the auto schedule decides (a process that starts from what earlier ones learned
    # about a random draft may draft nothing); none named: nothing drafted
    if not drafting:
        assert drafted == 0, drafted
    assert text.strip() and len(refs.llm.tokenize(text.strip().encode(), add_bos=False)) <= n + 2
    if _opt(argv, "--temp") == "0" and not raw and not _opt(argv, "-md", "--model-draft", default="").startswith("oracle"):
        ref = _chat_ref(refs, prompt, n)
        assert text.strip() == ref.strip(), f"not Llama's own greedy output:\n{text!r}\n{ref!r}"


def _check_inspect(argv, out, err, refs, cwd):
    assert "draft:" in out and "pairing: OK" in out, out


def _check_make_test_draft(argv, out, err, refs, cwd):
    from pyllama_dspark.gguf.info import read_draft_info

    path = cwd / _opt(argv, "-o", "--output")
    assert path.is_file() and read_draft_info(str(path)) is not None, out


def _check_profile(argv, out, err, refs, cwd):
    """``profile --show`` in a fresh cache: the curve auto would use is not there yet, nothing learned;
    ``--reset``: says what it removed."""
    if "--show" in argv:
        assert "none cached" in out and "nothing yet" in out, out
    else:
        assert "--reset" in argv and "removed 0 cost curve(s) and 0 learned state(s)" in out, out


#: what each bash command must print, by its subcommand
BASH_CHECKS = {"run": _check_run_cli, "inspect": _check_inspect, "make-test-draft": _check_make_test_draft,
               "profile": _check_profile}


def _check_plugin(out, refs):
    chat = _chat_ref(refs, "Write a haiku about rain.", 32)
    text = refs.completion("The three primary colors are", 16)["choices"][0]["text"]
    assert out.startswith(chat + "\n" + text + "\n"), f"not Llama's own greedy output:\n{out!r}\n{chat!r}\n{text!r}"
    m = re.fullmatch(r"drafted (\d+), accepted (\d+)", out[len(chat) + len(text) + 2:].strip())
    assert m and int(m.group(1)) > 0 and int(m.group(2)) <= int(m.group(1)), out


def _check_dspark(out, refs):
    import ast

    ref = refs.chat(_user("Explain RoPE in one sentence."), 32)
    chat = ref["choices"][0]["message"]["content"]
    assert out.startswith(chat + "\n"), f"not Llama's own greedy output:\n{out!r}\n{chat!r}"
    lines = out[len(chat) + 1:].split("\n")
    assert ast.literal_eval(lines[0]) == ref["usage"]
    tps, draft_n, accepted = lines[1].split()
    assert float(tps) > 0 and int(draft_n) > 0 and 0 <= int(accepted) <= int(draft_n)
    last = ast.literal_eval(lines[-2] if lines[-1] == "" else lines[-1])
    cref = refs.completion("Q: What is 2 + 2?\nA:", 8, stop=["\n"])
    assert last["choices"][0]["text"] == cref["choices"][0]["text"]
    assert last["choices"][0]["finish_reason"] == cref["choices"][0]["finish_reason"]
    assert last["usage"] == cref["usage"] and last["timings"]["draft_n"] >= 0


def _check_from_llama(out, refs):
    chat = _chat_ref(refs, "Name a color.", 8)
    assert out.startswith(chat + " "), f"not Llama's own greedy output:\n{out!r}\n{chat!r}"
    assert int(out[len(chat) + 1:].strip()) >= 0


def _check_speculator(out, refs):
    """docs/usage.md's Speculator snippet: greedy by default, so the streamed text is Llama's own
    greedy chat output; then the Done's stats as a dict."""
    import ast

    text, _, stats = out.rpartition("\n ")
    stats = ast.literal_eval(stats.strip())
    ref = _chat_ref(refs, "Explain RoPE in one paragraph.", stats["n_generated"])
    assert text == ref, f"not Llama's own greedy output:\n{text!r}\n{ref!r}"
    assert 1 <= stats["n_generated"] <= 32 and 0 <= stats["accepted"] <= stats["drafted"], stats
    assert stats["schedule"].startswith("schedule auto"), stats


def _check_session(out, refs):
    """docs/usage.md's kept-prompt conversation: both replies are Llama's own greedy output for the
    conversation so far, and the second turn reused at least the first turn's prompt."""
    import ast

    first, second, last = out.rstrip("\n").split("\n")
    chat = _user("Name a fruit.")
    assert first == refs.chat(chat, 8)["choices"][0]["message"]["content"], first
    chat = chat + [{"role": "assistant", "content": first}, {"role": "user", "content": "What colour is it?"}]
    assert second == refs.chat(chat, 8)["choices"][0]["message"]["content"], second
    cache_n, _, info = last.partition(" ")
    assert int(cache_n) >= len(refs.chat_tokens(_user("Name a fruit."))) - 1, last
    assert ast.literal_eval(info)["states"] >= 0, info


#: what each snippet must print, recognised by a line of its code (the prompts are the snippets' own)
CHECKS = [
    ("cache_prompt=True, cache_ram=256", _check_session),
    ("DSparkDraftModel(llm", _check_plugin),
    ("DSpark.from_llama(", _check_from_llama),
    ('with DSpark("target.gguf", "draft.gguf", n_max=7)', _check_dspark),
    ('with Speculator("target.gguf"', _check_speculator),
]


def _user_results(lang, code, where, tmp_path):
    """What the snippet printed run as a user runs it: the controller's first run
    (conftest.pytest_sessionstart, before the workers start), else run here the same way."""
    got = first_run.results()
    if got is not None and where[0] in got:
        return got[where[0]]
    from conftest import _smollm2_path
    from pyllama_dspark.gguf.testing import make_test_draft

    target = _smollm2_path()
    draft = make_test_draft(target, tmp_path / "draft.gguf", kind="dspark", seed=0)
    return first_run.run_one(lang, code, target, str(draft), tmp_path)


@pytest.mark.parametrize("lang, code, where", SNIPPETS, ids=["+".join(w) for _, _, w in SNIPPETS])
def test_snippet_runs(lang, code, where, llama_refs, tmp_path):
    """Each snippet as a new user runs it: a fresh cache folder, none of the suite's variables (no
    fake cost profile, the schedule's memory on), the default schedule; it prints what it should,
    a snippet that drafts leaves the measured cost curve in its cache, and a ``Llama(verbose=False)``
    prints no progress bar."""
    at = where[0]
    if lang not in ("python", "bash"):
        raise AssertionError(f"{at}: no runner for ```{lang}")
    res = _user_results(lang, code, where, tmp_path)
    # the suite's global fixtures must not be what makes a user path pass
    assert set(res["env_keys"]) <= set(first_run.KEEP), res["env_keys"]
    assert "PYLLAMA_DSPARK_COST_PROFILE" not in res["env_keys"]
    assert res["runs"], f"{at}: nothing ran"
    cwd = Path(res["cwd"])
    for run in res["runs"]:
        argv = run["argv"]
        assert run["rc"] == 0, f"{at}: {shlex.join(argv[3:] or argv)} failed ({run['rc']}):\n{run['stdout']}\n{run['stderr']}"
        assert run["stdout"].strip(), f"{at} printed nothing"
        if lang == "bash":
            check = BASH_CHECKS.get(argv[3])
            assert check, f"{at}: no output check for {argv[3:]} (add one to BASH_CHECKS)"
            check(argv, run["stdout"], run["stderr"], llama_refs, cwd)
        else:
            checks = [fn for needle, fn in CHECKS if needle in code]
            assert len(checks) == 1, f"{at}: no output check for this snippet (add one to CHECKS)"
            checks[0](run["stdout"], llama_refs)
    drafts = "draft.gguf" in code or "-md " in code
    if drafts and "--schedule" not in code:
        curves = [f for f in res["profiles"] if not f.startswith("learned-")]
        assert curves, f"{at}: the auto schedule measured no cost curve into the fresh cache {res['profiles']}"
    if "verbose=False" in code:
        err = "".join(r["stderr"] for r in res["runs"])
        assert "cost profile" not in err and "decode/s" not in err, f"{at}: a progress bar with verbose=False:\n{err}"
