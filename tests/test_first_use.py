"""The front ends the README snippets do not run (``serve``, ``bench``, ``crosscheck``), each once as
a new user runs it: a fresh process, an empty cache folder, none of the suite's variables (no fake
cost profile, the schedule's memory on), the default schedule with a draft.  Each works, measures
the cost curve ``auto`` needs and leaves it in the cache.  (``run``, ``DSpark`` and the two that
take a user's ``Llama`` are the README's snippets: tests/test_readme.py.)"""

from __future__ import annotations

import json

from first_run import user_env
from serve_helpers import ServeProcess


def _curves(cache):
    d = cache / "profiles"
    return [f for f in d.glob("*.json") if not f.name.startswith("learned-")] if d.is_dir() else []


def _cli(args, cache, tmp_path):
    import subprocess
    import sys

    from first_run import ROOT

    return subprocess.run([sys.executable, "-m", "pyllama_dspark.cli.main", *map(str, args)], capture_output=True,
                          text=True, timeout=900, env=user_env(cache), cwd=tmp_path or ROOT)


def test_serve_from_an_empty_cache(target_path, dspark_draft_path, tmp_path):
    cache = tmp_path / "cache"
    srv = ServeProcess(target_path, dspark_draft_path, tmp_path / "serve.log", env=user_env(cache))
    try:
        r = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a color."}],
                                               "max_tokens": 16})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
    finally:
        srv.stop()
    assert "measuring this machine's verify cost curve" in srv.log_text()
    assert _curves(cache), srv.log_text()[-3000:]


def test_bench_from_an_empty_cache(target_path, dspark_draft_path, tmp_path):
    from pyllama_dspark.prompts import default_prompt_dir

    cache, out = tmp_path / "cache", tmp_path / "bench.json"
    p = _cli(["bench", "-m", target_path, "-md", dspark_draft_path, "--prompts", default_prompt_dir() / "gsm8k.jsonl",
              "--limit", "1", "-n", "8", "-t", "1", "-c", "2048", "--no-progress", "--json", out], cache, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(out.read_text())["greedy_mismatches"] == []
    assert _curves(cache), p.stderr[-3000:]


def test_crosscheck_from_an_empty_cache(target_path, dspark_draft_path, tmp_path):
    from pyllama_dspark.prompts import default_prompt_dir
    from pyllama_dspark.upstream.llama_server_build import ensure_llama_server

    binary = ensure_llama_server()   # built once for the suite (a new user's first crosscheck builds it)
    cache = tmp_path / "cache"
    p = _cli(["crosscheck", "-m", target_path, "-md", dspark_draft_path, "--llama-server", binary,
              "--prompts", default_prompt_dir() / "gsm8k.jsonl", "--limit", "1", "-n", "16", "-t", "1", "-c", "2048"],
             cache, tmp_path)
    assert p.returncode == 0 and "crosscheck: OK" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]
