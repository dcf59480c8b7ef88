"""The embedded default models: ``pyllama-dspark run`` with no -m/-md runs SmolLM2-135M-Instruct
with the trained DSpark drafter shipped in the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from greedy_ref import TEST_THREADS

from pyllama_dspark.paths import default_draft, default_target
from pyllama_dspark.gguf.info import read_draft_info, validate_pair
from pyllama_dspark.gguf.target_info import read_target_info


def test_shipped_drafter_fits_the_default_target_and_the_size_budget():
    draft = default_draft()
    assert draft is not None and os.path.isfile(draft)
    assert os.path.getsize(draft) <= 30 * 1024 * 1024
    d = read_draft_info(draft)
    t = read_target_info(default_target())
    validate_pair(d, t)       # raises on a mismatched tokenizer / width / layer ids
    assert d.kind == "dspark" and d.has_confidence_head and d.block_size == 7


PROMPT = "List three colors."
N = 48


def _run(*args):
    cmd = [sys.executable, "-m", "pyllama_dspark.cli.main", "run", "-p", PROMPT, "-n", str(N),
           "--temp", "0", "-t", str(TEST_THREADS), "--json", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_run_without_models_uses_the_default_target_and_drafter(llama_refs):
    """`run` with no -m/-md: the shipped drafter drafts and gets drafts accepted, and the output is
    the default target's own greedy output through llama_cpp.Llama (same chat prompt)."""
    messages = [{"role": "user", "content": PROMPT}]
    prompt = llama_refs.chat_tokens(messages)             # the chat prompt llama-cpp-python builds
    ref = llama_refs.greedy(prompt, N)
    spec = _run()
    plain = _run("--no-draft")
    assert spec["stats"]["drafted"] > 0 and spec["stats"]["accepted"] > 0
    assert plain["stats"]["drafted"] == 0
    assert spec["stats"]["n_prompt"] == plain["stats"]["n_prompt"] == len(prompt)
    assert spec["tokens"] == ref, "the shipped drafter changed the target's greedy output"
    assert plain["tokens"] == ref
    assert spec["text"] == llama_refs.chat(messages, N)["choices"][0]["message"]["content"]
