"""The embedded default models: ``pyllama-dspark run`` with no -m/-md runs SmolLM2-135M-Instruct
with the trained DSpark drafter shipped in the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pyllama_dspark.cli import default_draft, default_target
from pyllama_dspark.gguf_info import read_draft_info, read_target_info, validate_pair


def test_shipped_drafter_fits_the_default_target_and_the_size_budget():
    draft = default_draft()
    assert draft is not None and os.path.isfile(draft)
    assert os.path.getsize(draft) <= 30 * 1024 * 1024
    d = read_draft_info(draft)
    t = read_target_info(default_target())
    validate_pair(d, t)       # raises on a mismatched tokenizer / width / layer ids
    assert d.kind == "dspark" and d.has_confidence_head and d.block_size == 7


def _run(*args):
    cmd = [sys.executable, "-m", "pyllama_dspark.cli", "run", "-p", "List three colors.", "-n", "48",
           "--temp", "0", "-t", "2", "--json", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_run_without_models_uses_the_default_target_and_drafter():
    spec = _run()
    plain = _run("--no-draft")
    assert spec["stats"]["drafted"] > 0 and spec["stats"]["accepted"] > 0
    assert plain["stats"]["drafted"] == 0
    assert spec["tokens"] == plain["tokens"]
