"""``pyllama-dspark run`` with every ``--schedule`` value and every ``-md`` form that ``run --help``
lists, each once, in a fresh process and from an empty cache (``$PYLLAMA_DSPARK_CACHE`` a new
folder: no random draft, no cost profile, no gguf-info written yet), as a first-time user runs it.

Every run is greedy, so its tokens must be ``llama_cpp.Llama``'s own greedy tokens (an independent
reference); the schedule line of ``--json`` says which policy ran.  ``profiled`` (and ``auto``)
run with ``$PYLLAMA_DSPARK_COST_PROFILE`` (the suite's fixed curve, conftest.py) removed from the
subprocess, so the cost curve is really measured and cached: before the fix of issue 46,
``profiled`` measured through ``Speculator.decoder`` before it existed and died with an
AttributeError.
"""

from __future__ import annotations

import json

import pytest

from cli_runner import cli

PROMPT = "The capital of France is"
N = 12
PROFILE_ENV = "PYLLAMA_DSPARK_COST_PROFILE"


def _run(cache, *args, target=None):
    base = ["run", "-p", PROMPT, "--raw", "-n", str(N), "--temp", "0", "-t", "1", "-c", "512", "--json"]
    if target is not None:
        base += ["-m", target]
    return cli(*base, *args, env={"PYLLAMA_DSPARK_CACHE": str(cache)})


@pytest.fixture(scope="module")
def greedy(llama_refs):
    prompt = llama_refs.llm.tokenize(PROMPT.encode(), add_bos=True, special=True)
    return prompt, llama_refs.greedy(prompt, N)


def _check(p, greedy):
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    out = json.loads(p.stdout)
    prompt, ref = greedy
    assert out["stats"]["n_prompt"] == len(prompt)
    assert out["tokens"] == ref, "greedy output differs from llama_cpp.Llama's"
    return out


# (the schedule options, whether the curve is measured: $PYLLAMA_DSPARK_COST_PROFILE removed)
SCHEDULES = {
    "default": ([], False),
    "auto": (["--schedule", "auto"], True),
    "off": (["--schedule", "off"], False),
    "static": (["--schedule", "static", "--conf-min", "0.3"], False),
    "survival": (["--schedule", "survival", "--p-survival-min", "0.2"], False),
    # -b 16: a batch below the profile's 32 verify sizes (it refused before: "b_max 32 exceeds
    # n_batch 16"), and half the measuring time
    "profiled": (["--schedule", "profiled", "-b", "16"], True),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_from_an_empty_cache(name, target_path, greedy, tmp_path, monkeypatch):
    args, measured = SCHEDULES[name]
    if measured:
        monkeypatch.delenv(PROFILE_ENV, raising=False)   # the subprocess inherits os.environ without it
    cache = tmp_path / "cache"
    p = _run(cache, "-md", "random", *args, target=target_path)
    out = _check(p, greedy)
    mode = "auto" if name == "default" else name
    sched = out["stats"].get("schedule")
    if mode == "off":
        assert sched is None and out["stats"]["drafted"] > 0
    else:
        assert sched.startswith(f"schedule {mode}:"), sched
    profiles = sorted((cache / "profiles").glob("*.json")) if (cache / "profiles").is_dir() else []
    if measured and not profiles:
        # a curve measured beside the suite's other worker can be rejected twice for the load: then
        # it is used for this run only, and the run says so (docs/schedule.md)
        assert "rejected again" in p.stderr and "not cached" in p.stderr, p.stderr[-2000:]
    elif measured:
        assert len(profiles) == 1, profiles   # measured here and cached for the next run
        prof = json.loads(profiles[0].read_text())
        assert prof["verify_ms"] and all(ms > 0 for ms in prof["verify_ms"])
        if mode == "profiled":   # the full profile times the draft block too, B up to n_batch
            assert prof["draft_ms"] > 0 and "profiling this machine" in p.stderr
            assert prof["batch_sizes"] == list(range(1, 17))
    else:
        assert profiles == []   # the suite's fixed curve (or no cost-driven mode): nothing measured
    assert len(list(cache.glob("random-dspark-*.gguf"))) == 1


# -md forms (run --help): a draft path (DSpark, DFlash), random / random-dspark / random-dflash,
# oracle:P, --no-draft, no -md with -m (no draft) and neither (the shipped drafter); (the options,
# whether -m is given, the kind of random draft written into the cache)
MD_FORMS = {
    "path-dspark": (lambda d: ["-md", d["dspark"]], True, None),
    "path-dflash": (lambda d: ["-md", d["dflash"]], True, None),
    "random": (lambda d: ["-md", "random"], True, "dspark"),
    "random-dspark": (lambda d: ["-md", "random-dspark"], True, "dspark"),
    "random-dflash": (lambda d: ["-md", "random-dflash"], True, "dflash"),
    "oracle": (lambda d: ["-md", "oracle:0.7"], True, None),
    "no-draft": (lambda d: ["-md", "random", "--no-draft"], True, None),
    "no-md": (lambda d: [], True, None),
    "shipped": (lambda d: [], False, None),
}


@pytest.mark.parametrize("name", list(MD_FORMS))
def test_every_draft_form_from_an_empty_cache(name, target_path, dspark_draft_path, dflash_draft_path, greedy,
                                              tmp_path):
    args, with_m, random_kind = MD_FORMS[name]
    cache = tmp_path / "cache"
    p = _run(cache, *args({"dspark": dspark_draft_path, "dflash": dflash_draft_path}),
             target=target_path if with_m else None)
    out = _check(p, greedy)
    drafted = out["stats"]["drafted"]
    if name in ("no-draft", "no-md"):
        assert drafted == 0 and "schedule" not in out["stats"]
    else:
        # every form drafted (the suite's fixed curve makes auto verify like a fixed block)
        assert drafted > 0, out["stats"]
    written = sorted(cache.glob("random-*.gguf"))
    assert [w.name.split("-")[1] for w in written] == ([random_kind] if random_kind else []), written
    if name == "oracle":   # the oracle proposes the target's own greedy continuation
        assert out["stats"]["accepted"] > 0


def test_schedules_that_cannot_run_fail_cleanly(target_path, tmp_path):
    """A schedule a draft cannot serve is a one-line error, exit status 1 or 2, no traceback."""
    cache = tmp_path / "cache"
    cases = [(["-md", "random-dflash", "--schedule", "profiled"], "confidence head"),
             (["--no-draft", "--schedule", "survival", "--p-survival-min", "0.2"], "needs a draft"),
             (["-md", "random", "--schedule", "static"], "conf_min"),
             (["-md", "oracle:0.5", "--temp", "0.8"], "greedy only")]
    for args, needle in cases:
        p = _run(cache, *args, target=target_path)
        assert p.returncode in (1, 2), (args, p.returncode, p.stderr[-2000:])
        assert needle in p.stderr and "Traceback" not in p.stderr, (args, p.stderr[-2000:])
