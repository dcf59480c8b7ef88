"""The scheduling commands and their cost profiles: what they write, and that a cached profile is
reused.  Nothing here asserts a speed: the numbers are checked for shape and sanity (positive,
finite, percentiles in order, the table consistent with the file), and every run is small
(-t 1, a few batch sizes, a couple of rounds, a few prompts and tokens).

* ``costprofile.load_or_measure`` / ``auto_profile``: the first call measures and writes the cache
  (``$PYLLAMA_DSPARK_CACHE``), the second reads it without measuring (the measuring function is
  counted), ``remeasure`` / other settings / a stale or unreadable file measure again, and
  ``$PYLLAMA_DSPARK_COST_PROFILE`` overrides everything;
* ``profile``: its JSON file and its table;
* ``calibrate``: the calibration file (bound to the draft's SHA-256, one temperature per draft
  position, ECE / ROC-AUC per position), the reliability PNG, and ``run`` taking the file for that
  draft and refusing it for another one;
* ``bench-schedule``: reuses a cached profile (a planted sentinel curve shows up in its table)
  and reports every configuration for every proposer, losslessly (its own check against the
  no-draft output would raise).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest

from pyllama_dspark.speculative import costprofile

from cli_runner import ROOT, cli
GSM8K = ROOT / "pyllama_dspark" / "data" / "prompts" / "gsm8k.jsonl"


_cli = cli


def _finite_pos(xs):
    return all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in xs)


def _check_profile_dict(p: dict, b_max: int, repeats: int, with_draft: bool):
    assert p["version"] == costprofile.PROFILE_VERSION and isinstance(p["key"], str) and len(p["key"]) == 16
    assert p["batch_sizes"] == list(range(1, b_max + 1))
    for k in ("verify_ms", "verify_p10", "verify_p90"):
        assert len(p[k]) == b_max and _finite_pos(p[k]), (k, p[k])
    assert all(lo <= m <= hi for lo, m, hi in zip(p["verify_p10"], p["verify_ms"], p["verify_p90"]))
    assert p["repeats"] == repeats
    if with_draft:
        lo, hi = p["draft_spread"]
        assert _finite_pos([p["draft_ms"], lo, hi]) and lo <= p["draft_ms"] <= hi
    else:
        assert p["draft_ms"] == 0.0
    assert math.isfinite(p["overhead_ms"]) and p["overhead_ms"] >= 0
    costprofile.Profile(**p).cost_model()     # the scheduler accepts it


# ---- the cache ---------------------------------------------------------------------------------

@pytest.fixture()
def counted(monkeypatch, tmp_path):
    """An empty cache folder, no test-profile override, and call counters on the measuring functions."""
    monkeypatch.setenv("PYLLAMA_DSPARK_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(costprofile.PROFILE_ENV, raising=False)
    calls = {"measure": 0, "measure_target": 0}
    real_measure, real_target = costprofile.measure, costprofile.measure_target

    def measure(sp, **kw):
        calls["measure"] += 1
        return real_measure(sp, **kw)

    def measure_target(target, **kw):
        calls["measure_target"] += 1
        kw.setdefault("repeats", 1)
        kw.setdefault("b_max", 4)
        return real_target(target, **kw)

    monkeypatch.setattr(costprofile, "measure", measure)
    monkeypatch.setattr(costprofile, "measure_target", measure_target)
    return calls


def test_load_or_measure_caches_per_settings(counted, target_path, dspark_draft_path, tmp_path):
    from pyllama_dspark.decode.api import Speculator

    with Speculator(target_path, dspark_draft_path, n_ctx=512, n_threads=1, schedule="off") as sp:
        first = costprofile.load_or_measure(sp, b_max=4, repeats=2)
        assert counted["measure"] == 1
        path = costprofile.default_path(first.key)
        assert path.is_file() and path.parent.parent == tmp_path / "cache"
        _check_profile_dict(json.loads(path.read_text()), 4, 2, with_draft=True)
        assert first.settings["draft"] == dspark_draft_path and first.settings["n_ctx"] == 512
        again = costprofile.load_or_measure(sp, b_max=4, repeats=2)
        assert counted["measure"] == 1 and again == first          # read back, not measured
        # other settings are another key (another file)
        assert costprofile.profile_key(target_path, dspark_draft_path, 512, 1, "auto", 0, 3) != first.key
        assert first.key == costprofile.profile_key(target_path, dspark_draft_path, 512, 1, "auto", 0, 4)
        costprofile.load_or_measure(sp, b_max=4, repeats=1, remeasure=True)
        assert counted["measure"] == 2 and costprofile.load(path).repeats == 1
        # a cache file from another profile version, or a damaged one, is measured again
        for junk in ('{"version": 0}', "{not json"):
            path.write_text(junk)
            prof = costprofile.load_or_measure(sp, b_max=4, repeats=1)
            assert prof.key == first.key and costprofile.load(path) == prof
        assert counted["measure"] == 4
        # an explicit profile file is taken as it is
        assert costprofile.load_or_measure(sp, path=path, b_max=4) == costprofile.load(path)
        assert counted["measure"] == 4


def test_auto_profile_caches_and_the_override_wins(counted, target_path, tmp_path, monkeypatch):
    from pyllama_dspark.decode.api import Speculator

    # a 4-row curve measured beside other tests can read flat, and is then measured once more by
    # design (test_a_flat_cpu_curve_is_measured_again_and_never_cached): this test is about caching
    monkeypatch.setattr(costprofile, "plausible", lambda prof: True)
    with Speculator(target_path, None, n_ctx=512, n_threads=1) as sp:
        msgs = []
        a = costprofile.auto_profile(sp.target, echo=msgs.append, progress=False)
        assert counted["measure_target"] == 1 and len(msgs) == 1 and "measuring" in msgs[0]
        p = json.loads(costprofile.default_path(costprofile.target_key(sp.target)).read_text())
        _check_profile_dict(p, 4, 1, with_draft=False)
        b = costprofile.auto_profile(sp.target, echo=msgs.append, progress=False)
        assert counted["measure_target"] == 1 and b == a and len(msgs) == 1      # cached: silent, no measuring
        costprofile.default_path(a.key).write_text("{broken")
        costprofile.auto_profile(sp.target, echo=msgs.append, progress=False)
        assert counted["measure_target"] == 2
        fixed = dict(p, verify_ms=[7.0] * 4, verify_p10=[7.0] * 4, verify_p90=[7.0] * 4, key="given")
        f = tmp_path / "given.json"
        f.write_text(json.dumps(fixed))
        monkeypatch.setenv(costprofile.PROFILE_ENV, str(f))
        got = costprofile.auto_profile(sp.target, echo=msgs.append, progress=False)
        assert got.verify_ms == [7.0] * 4 and got.key == "given" and counted["measure_target"] == 2


def test_auto_curve_reads_one_sequences_sizes_three_times(target_path):
    """The auto curve's rounds: one whole round over B = 1..b_max, then (past the budget) only the
    sizes one sequence verifies (B <= FOCUS_B) until each has FOCUS_READINGS readings; within the
    budget, a round over those sizes between whole rounds.  Counted at the target's decode."""
    from pyllama_dspark.decode.api import Speculator

    f, b_max = costprofile.FOCUS_B, costprofile.FOCUS_B + 4
    with Speculator(target_path, None, n_ctx=512, n_threads=1) as sp:
        tgt, real = sp.target, sp.target.decode
        rows = []

        def decode(tokens, pos0, seq_id=0, all_outputs=True):
            if all_outputs:   # (the prompt's prefill asks for its last row only)
                rows.append(len(tokens))
            return real(tokens, pos0, seq_id, all_outputs)

        tgt.decode = decode
        try:
            prof = costprofile.measure_target(tgt, b_max=b_max, repeats=5, budget_s=0.0)
            past_budget = [rows.count(b) for b in range(1, b_max + 1)]
            rows.clear()
            prof2 = costprofile.measure_target(tgt, b_max=b_max, repeats=2, budget_s=1e9)
            within = [rows.count(b) for b in range(1, b_max + 1)]
        finally:
            del tgt.decode
    assert past_budget == [costprofile.FOCUS_READINGS] * f + [1] * 4 and prof.repeats == 1
    assert within == [3] * f + [2] * 4 and prof2.repeats == 2   # whole, focus, whole
    assert costprofile.FOCUS_READINGS == 3 and len(prof.verify_ms) == b_max


# ---- the commands ------------------------------------------------------------------------------

def test_profile_command_writes_its_file_and_table(target_path, dspark_draft_path, tmp_path):
    out = tmp_path / "prof.json"
    p = _cli("profile", "-m", target_path, "-md", dspark_draft_path, "-t", "1", "-c", "512", "--b-max", "6",
             "--repeats", "2", "-o", out, env={"PYLLAMA_DSPARK_CACHE": str(tmp_path / "cache")})
    assert p.returncode == 0, p.stderr[-3000:]
    prof = json.loads(out.read_text())
    _check_profile_dict(prof, 6, 2, with_draft=True)
    assert prof["key"] == costprofile.profile_key(target_path, dspark_draft_path, 512, 1, "auto", 0, 6)
    assert prof["settings"]["target"] == target_path and prof["settings"]["draft"] == dspark_draft_path
    assert prof["settings"]["n_threads"] == 1 and prof["settings"]["b_max"] == 6
    lines = p.stdout.strip().splitlines()
    assert lines[-1] == f"saved {out}" and lines[0].split()[:2] == ["B", "ms"]
    for b, line in zip(range(1, 7), lines[1:7]):     # the table prints the file's numbers
        cols = line.split()
        m = prof["verify_ms"][b - 1]
        assert int(cols[0]) == b and float(cols[1]) == pytest.approx(m, abs=0.006)
        assert float(cols[4]) == pytest.approx(1e3 / m, rel=0.01, abs=0.06)
        assert float(cols[5]) == pytest.approx(m / b, abs=0.006)
    assert f"draft block {prof['draft_ms']:.2f} ms" in p.stdout


@pytest.fixture(scope="module")
def calibration(target_path, dspark_draft_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("cal")
    out, png = d / "cal.json", d / "rel.png"
    p = _cli("calibrate", "-m", target_path, "-md", dspark_draft_path, "-t", "1", "-c", "512", "--prompts", GSM8K,
             "--limit", "4", "-n", "16", "-np", "2", "-o", out, "--png", png)
    assert p.returncode == 0, p.stderr[-3000:]
    return out, png, p.stdout


def test_calibrate_writes_a_calibration_bound_to_the_draft(calibration, dspark_draft_path):
    out, png, stdout = calibration
    cal = json.loads(out.read_text())
    assert cal["draft_sha256"] == hashlib.sha256(Path(dspark_draft_path).read_bytes()).hexdigest()
    assert len(cal["temperatures"]) == 7 and _finite_pos(cal["temperatures"])
    assert cal["n_fit"] > 0 and cal["n_eval"] > 0
    assert cal["report"] and [r["position"] for r in cal["report"]] == list(range(1, len(cal["report"]) + 1))
    for r in cal["report"]:
        assert r["n"] >= 0 and 0.0 <= r["survival"] <= 1.0
        for k in ("ece_raw", "ece_sts"):
            assert r[k] is None or (isinstance(r[k], float) and (math.isnan(r[k]) or 0.0 <= r[k] <= 1.0)), r
        assert r["auc"] is None or math.isnan(r["auc"]) or 0.0 <= r["auc"] <= 1.0, r
    assert f"fit on {cal['n_fit']} blocks, evaluated on {cal['n_eval']}" in stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_takes_the_calibration_for_its_draft_only(calibration, target_path, dspark_draft_path,
                                                     dflash_draft_path, tmp_path, llama_refs):
    out, _, _ = calibration
    base = ["run", "-m", target_path, "-p", "The capital of France is", "--raw", "-n", "8", "--temp", "0",
            "-t", "1", "-c", "512", "--json", "--schedule", "static", "--conf-min", "0.3", "--calibration", out]
    p = _cli(*base, "-md", dspark_draft_path)
    assert p.returncode == 0, p.stderr[-3000:]
    prompt = llama_refs.llm.tokenize(b"The capital of France is", add_bos=True, special=True)
    assert json.loads(p.stdout)["tokens"] == llama_refs.greedy(prompt, 8)
    other = tmp_path / "other.gguf"
    from pyllama_dspark.gguf.testing import make_test_draft

    make_test_draft(target_path, other, kind="dspark", n_layers=1, markov_rank=8, seed=9)
    p = _cli(*base, "-md", other)
    assert p.returncode != 0 and "another draft" in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]


def test_bench_schedule_reuses_the_cached_profile(target_path, dspark_draft_path, tmp_path):
    cache = tmp_path / "cache"
    env = {"PYLLAMA_DSPARK_CACHE": str(cache)}
    # a sentinel curve where bench-schedule looks for this machine's profile (b_max 32, its settings)
    key = costprofile.profile_key(target_path, dspark_draft_path, 512, 1, "auto", 0, 32)
    sentinel = dict(key=key, settings={}, batch_sizes=list(range(1, 33)), verify_ms=[12.345] * 32,
                    verify_p10=[12.345] * 32, verify_p90=[12.345] * 32, draft_ms=1.5, draft_spread=[1.5, 1.5],
                    overhead_ms=0.25, repeats=9, version=costprofile.PROFILE_VERSION)
    (cache / "profiles").mkdir(parents=True)
    path = cache / "profiles" / f"{key}.json"
    path.write_text(json.dumps(sentinel))
    p = _cli("bench-schedule", "-m", target_path, "-md", dspark_draft_path, "-t", "1", "-c", "512",
             "--prompts", GSM8K, "--limit", "1", "-n", "12", "--requests", "2", "--accuracies", "0.9", "--json",
             env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "12.35" in p.stderr and "9 repeats" in p.stderr, "the cached profile was not the one used"
    assert json.loads(path.read_text()) == sentinel            # and it was not measured again
    rows = json.loads(p.stdout)
    configs = {"no draft", "fixed", "static 0.5", "profiled", "auto"}
    sources = (f"draft {Path(dspark_draft_path).name}", "oracle:0.9")
    assert {(r["R"], r["proposer"]) for r in rows} == {(2, s) for s in sources}
    for R in (2,):
        for src in sources:
            got = {r["config"]: r for r in rows if r["R"] == R and r["proposer"] == src}
            # the oracle reports no confidences: the schedules that need them run for the draft only
            assert set(got) == (configs if src.startswith("draft") else configs - {"static 0.5", "profiled"})
            assert all(_finite_pos([r["tok_s"], r["vs_no_draft"]]) and r["tau"] >= 1.0 for r in got.values())
            assert got["no draft"]["tau"] == 1.0 and got["no draft"]["vs_no_draft"] == 1.0
        oracle_fixed = next(r for r in rows if r["R"] == R and r["proposer"] == "oracle:0.9" and r["config"] == "fixed")
        assert oracle_fixed["tau"] > 2.0, "an oracle right on 90% of its blocks must get long runs accepted"


def test_a_flat_cpu_curve_is_measured_again_and_never_cached(counted, target_path, monkeypatch):
    """A curve measured on a busy machine is flat (every decode waits alike): it is measured once
    more, and cached only when the new one is plausible; otherwise used for the run alone."""
    from pyllama_dspark.decode.api import Speculator

    with Speculator(target_path, None, n_ctx=512, n_threads=1) as sp:
        measured = costprofile.measure_target(sp.target)  # the counted stand-in: B = 1..4, one round
        # the shape of an idle CPU (4 rows cost ~3x one); a curve measured beside other tests can
        # itself read flat, so the steep one is written, not measured
        real = costprofile.Profile(**dict(measured.__dict__, verify_ms=[15.0, 24.0, 33.0, 41.0]))
        assert costprofile.plausible(real)
        flat = costprofile.Profile(**dict(real.__dict__, verify_ms=[3050.0] * 4))
        curves = [flat, flat]
        monkeypatch.setattr(costprofile, "measure_target", lambda target, **kw: curves.pop(0))
        msgs = []
        got = costprofile.auto_profile(sp.target, echo=msgs.append, progress=False)
        path = costprofile.default_path(costprofile.target_key(sp.target))
        assert got.verify_ms == [3050.0] * 4 and not path.exists() and not curves
        assert any("not cached" in m for m in msgs)
        curves[:] = [flat, real]
        got = costprofile.auto_profile(sp.target, echo=msgs.append, progress=False)
        assert got.verify_ms == real.verify_ms and costprofile.load(path).verify_ms == real.verify_ms
        # a flat curve already in the cache (written before this check existed) is measured again
        costprofile.save(flat, path)
        curves[:] = [real]
        assert costprofile.auto_profile(sp.target, echo=msgs.append, progress=False).verify_ms == real.verify_ms
        assert not curves and costprofile.load(path).verify_ms == real.verify_ms
