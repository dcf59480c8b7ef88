"""``pyllama-dspark crosscheck``: passes on a sound draft, fails (exit 1) on broken ones.

* sound: the random DSpark draft on the real target, against plain greedy, llama.cpp's own C++
  driver (llama-server, built once from the llama-cpp-python sdist) and the numpy draft graph;
* broken draft that loads and decodes without complaint: value projections scaled so that V
  leaves the F16 range of llama.cpp's KV cache (a silent overflow, like the F16 ``fc`` hazard):
  llama.cpp's draft logits go non-finite while the float64 reference stays finite -> flagged;
* broken draft llama.cpp would silently mis-run: F16 ``fc.weight`` -> refused with a clear message;
* a loop bug (one emitted token changed) and a C++-driver disagreement -> real mismatches;
* the acceptance-curve shape check on synthetic curves (collapse after position 1 = positional bug).
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import gguf
import pytest

from greedy_ref import TEST_THREADS
from click.testing import CliRunner

from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.cli.main import main
from pyllama_dspark.measure.crosscheck import (cpp_compare, curve_warning, first_divergence, open_plain_llama,
                                       run_crosscheck)
from pyllama_dspark.prompts import default_prompt_dir
from pyllama_dspark.gguf.testing import make_test_draft


def _gsm8k():
    d = default_prompt_dir()
    assert d is not None
    return str(d / "gsm8k.jsonl")


# ---- pure checks -----------------------------------------------------------------------------

def test_curve_warning_flags_flat_collapse_after_position_1():
    tried = [200, 150, 20, 15, 12, 10, 10]
    assert curve_warning([0.75, 0.06, 0.05, 0.0, 0.08, 0.0, 0.1], tried) is not None  # positional bug shape
    assert curve_warning([0.75, 0.80, 0.82, 0.85, 0.84, 0.86, 0.9], tried) is None    # trained DSpark: flat
    assert curve_warning([0.75, 0.55, 0.45, 0.40, 0.35, 0.30, 0.3], tried) is None    # DFlash-like decay
    assert curve_warning([0.05, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], tried) is None         # untrained: no signal
    assert curve_warning([0.75, 0.0, 0.0], [200, 3, 1]) is None                       # too few trials
    assert curve_warning([], []) is None


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) == -1
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


# ---- end to end ------------------------------------------------------------------------------

def test_crosscheck_passes_on_a_sound_draft(target_path, dspark_draft_path, tmp_path):
    from pyllama_dspark.upstream.llama_server_build import ensure_llama_server

    binary = ensure_llama_server()
    out = tmp_path / "cc.json"
    r = CliRunner().invoke(main, ["crosscheck", "-m", target_path, "-md", dspark_draft_path,
                                  "--llama-server", str(binary), "--prompts", _gsm8k(), "--limit", "1",
                                  "-n", "16", "-t", "1", "-c", "2048", "--json", str(out)])
    print(r.output)
    assert r.exit_code == 0, r.output
    assert "crosscheck: OK" in r.output
    rep = json.loads(out.read_text())
    p = rep["prompts"][0]
    assert p["greedy"] == "match" and p["cpp"]["ok"] and p["cpp"]["tokens_equal"] and p["cpp"]["steps_equal"]
    assert p["drafted"] > 0 and len(p["blocks"]) == 2 and all(b["ok"] for b in p["blocks"])
    assert all(b["rel_err_logits"] < 0.03 for b in p["blocks"])


@pytest.fixture(scope="module")
def overflow_draft(dspark_draft_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("broken") / "v-overflow.gguf"
    shutil.copyfile(dspark_draft_path, path)
    r = gguf.GGUFReader(str(path), "r+")
    for t in r.tensors:
        if t.name.endswith("attn_v.weight"):
            t.data[...] *= 3e5  # V values far above 65504: inf in llama.cpp's F16 KV cache
    r.data.flush()
    del r
    return str(path)


def test_crosscheck_flags_a_broken_draft_graph(target_path, overflow_draft):
    r = CliRunner().invoke(main, ["crosscheck", "-m", target_path, "-md", overflow_draft, "--prompts", _gsm8k(),
                                  "--limit", "1", "-n", "8", "-t", "1", "-c", "2048"])
    print(r.output)
    assert r.exit_code == 1, r.output
    assert "NON-FINITE" in r.output and "real mismatch" in r.output


def test_crosscheck_refuses_an_f16_fc_draft(target_path, tmp_path):
    bad = make_test_draft(target_path, tmp_path / "f16fc.gguf", kind="dspark", fc_type="f16")
    r = CliRunner().invoke(main, ["crosscheck", "-m", target_path, "-md", bad, "--prompts", _gsm8k(), "--limit", "1"])
    assert r.exit_code == 1 and "F16" in r.output


class _CorruptLoop:
    """A Speculator whose emitted tokens are changed at one position (a simulated loop bug)."""

    def __init__(self, sp, at: int):
        self.sp, self.at = sp, at

    def generate(self, prompt, n):
        done = self.sp.generate(prompt, n)
        done.tokens = list(done.tokens)
        done.tokens[self.at] = (done.tokens[self.at] + 1) % 49152
        return done


def test_greedy_and_cpp_mismatches_are_real_failures(target_path, dspark_draft_path):
    with Speculator(target_path, dspark_draft_path, n_ctx=1024, n_threads=1) as sp:
        prompt = sp.chat_prompt([{"role": "user", "content": "Explain the Pythagorean theorem."}]).tokens
        llm = open_plain_llama(target_path, 1024, 512, "auto", 1)
        good = run_crosscheck(sp, llm, [("p", prompt)], 8, ref_blocks=0)
        assert good.ok and good.prompts[0].greedy == "match"
        bad = run_crosscheck(_CorruptLoop(sp, 3), llm, [("p", prompt)], 8, ref_blocks=0)
        assert not bad.ok
        p = bad.prompts[0]
        assert p.greedy == "MISMATCH" and p.divergence == 3 and p.margin >= 1e-3
        # a C++ driver that drafted/accepted differently (fake llama-server answer)
        ours = sp.generate(prompt, 8)
        steps = [(d, a) for d, a in zip(ours.stats.verify_lengths, ours.stats.cycle_accepted) if d > 0]
        same = SimpleNamespace(complete=lambda p, n: {"tokens": list(ours.tokens), "steps": steps, "timings": {
            "draft_n": ours.stats.drafted, "draft_n_accepted": ours.stats.accepted}})
        assert cpp_compare(same, prompt, ours, 8)["ok"]
        off = SimpleNamespace(complete=lambda p, n: {"tokens": list(ours.tokens), "steps": steps[:-1] + [(7, 1)],
                                                     "timings": {"draft_n": ours.stats.drafted,
                                                                 "draft_n_accepted": ours.stats.accepted + 1}})
        row = cpp_compare(off, prompt, ours, 8)
        assert not row["ok"] and not row["steps_equal"]


def test_crosscheck_reference_handles_a_reduced_vocabulary_draft(target_path, tmp_path):
    """The shipped drafter (own lm_head over a d2t vocabulary, F16 layers): llama.cpp's rows are
    -inf off the draft vocabulary by design, and the reference follows llama.cpp's argmax chain."""
    from pyllama_dspark.paths import default_draft

    out = tmp_path / "cc.json"
    r = CliRunner().invoke(main, ["crosscheck", "-m", target_path, "-md", default_draft(), "--prompts", _gsm8k(),
                                  "--limit", "1", "-n", "24", "-t", str(TEST_THREADS), "-c", "2048", "--ref-blocks", "3",
                                  "--json", str(out)])
    print(r.output)
    assert "draft graph vs numpy reference" in r.output
    assert "MISMATCH: logits" not in r.output and "NON-FINITE" not in r.output
    # exit status 1 on any real mismatch: a greedy divergence from Llama on the shipped drafter fails here
    assert r.exit_code == 0, r.output
    p = json.loads(out.read_text())["prompts"][0]
    assert p["greedy"] == "match" and p["drafted"] > 0 and p["accepted"] > 0
    assert len(p["blocks"]) == 3 and all(b["ok"] for b in p["blocks"])
