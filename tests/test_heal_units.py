"""The rules by which learned costs heal (speculative/heal.py), on the policy alone with a given
curve (our own logic: no model needed), each against the bound docs/schedule.md states; plus the
profile checks (speculative/profile_check.py) on the curves of the issue, a borrowed ``Llama``'s
profile keyed by its model file, ``profile --show / --reset`` and ``profile`` writing what auto reads.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from pyllama_dspark.speculative import costprofile, heal, policy_memory, probes, profile_check
from pyllama_dspark.speculative.policy import VerifyPolicy
from pyllama_dspark.speculative.schedule import CostModel

#: a quiet 2-core CPU's SmolLM2 curve (docs: 5.2, 10.5, 13.0, 15.1, ... monotone)
QUIET = [5.2 + 3.0 * (b - 1) for b in range(1, 33)]


def _policy():
    return VerifyPolicy(mode="auto", cost=CostModel(QUIET, draft_ms=[0.0], overhead_ms=0.1))


def _learned(**over):
    """A state as a quiet machine leaves it: draft pass 1.5 ms, plain cycle 5.4, a block of 7 at 27."""
    p = _policy()
    p._draft_ms, p._draft_ms_n = {1: 1.5}, {(1, 7): 1.5}
    p._cycle_ms = {(1, 1): (5.4, 10), (1, 8): (27.0, 10)}
    p._extra_ms = {(1, False): (0.2, 10), (1, True): (1.0, 10)}
    p._cycles = 40
    st = p.learned()
    st.update(over)
    return st


def _restored(state):
    p = _policy()
    assert p.restore(state)
    return p


def test_a_draft_pass_no_drafter_can_have_is_dropped_at_restore():
    ok = _restored(_learned())
    assert ok._draft_ms == {1: 1.5} and ok._restored_draft
    # 100x: 150 ms for a block whose 8 target rows verify in 26 ms
    bad = _restored(_learned(draft_ms={"1": 150.0}, draft_ms_n={"1:7": 150.0}))
    assert bad._draft_ms == {} and not bad._restored_draft and bad._draft_passes == 0
    assert bad.want_draft(1) and bad.want_draft(1), "a fresh process's two passes measure the draft again"
    assert (1, 1) not in bad._cycle_ms, "restored cycle costs go with it"


def test_a_cold_first_pass_cheaper_than_the_learned_warm_pass_lowers_it():
    p = _restored(_learned(draft_ms={"1": 15.0}, draft_ms_n={"1:7": 15.0}))   # 10x: kept at restore
    assert p._draft_ms[1] == 15.0
    p.observe_draft(1, 2.0)      # a cold pass costs at least a warm one: 2 ms bounds it
    assert p._draft_ms[1] == pytest.approx(2.0) and p.draft_estimate(1) == pytest.approx(2.0)
    q = _restored(_learned())
    q.observe_draft(1, 4.0)      # a cold pass dearer than the learned warm one: nothing to heal
    assert q._draft_ms[1] == 1.5


def test_warm_passes_off_by_more_than_the_factor_replace_the_learned_one():
    p = _restored(_learned(draft_ms={"1": 0.2}, draft_ms_n={"1:7": 0.2}))   # learned 7x too cheap
    p.observe_draft(1, 3.0)   # cold: kept apart
    for ms in (1.4, 1.6):
        p.observe_draft(1, ms)
    assert p._draft_ms[1] < 1.0   # two warm passes: not judged yet (a log step each)
    p.observe_draft(1, 1.5)
    assert p._draft_ms[1] == pytest.approx(1.5), "the median of the first 3 warm passes replaces it"


def test_a_restored_plain_cycle_off_by_more_than_the_factor_drops_every_learned_cost():
    p = _restored(_learned(cycle_ms={"1:1": [14.0, 10], "1:8": [70.0, 10]}))   # learned on a busy machine
    for _ in range(heal.HEAL_SAMPLES - 1):
        p.observe_cycle(1, 1, 5.4)
    assert (1, 8) in p._cycle_ms
    p.observe_cycle(1, 1, 5.4)
    assert p._cycle_ms == {(1, 1): (5.4, 3)} and p._draft_ms == {} and p._draft_passes == 0


def test_a_restored_drafting_cell_is_judged_on_its_first_cycles():
    p = _restored(_learned(cycle_ms={"1:1": [5.4, 10], "1:8": [270.0, 10]}))   # one cell 10x
    for _ in range(heal.HEAL_SAMPLES):
        p.observe_cycle(1, 8, 27.0)
    assert p._cycle_ms[(1, 8)] == (27.0, 3) and p._draft_ms == {1: 1.5}
    q = _restored(_learned())
    for _ in range(heal.HEAL_SAMPLES):
        q.observe_cycle(1, 8, 30.0)   # within the factor: the running estimate, as before
    assert q._cycle_ms[(1, 8)][0] < 30.0


def test_probes_come_within_the_bound_whatever_the_learned_loss():
    p = _restored(_learned(probe_ms={"1": [5000.0, 10]}))   # a process's first probe (its pass is cold)
    assert probes.budget_gap(p, 1) == probes.MAX_PROBE_GAP   # 5 s a probe: ~100,000 cycles by the budget
    fresh = _policy()
    fresh._draft_ms, fresh._draft_passes, fresh._probe_ms = {1: 1.5}, 2, {False: (5000.0, 10)}
    assert probes.budget_gap(fresh, 1) > probes.MAX_PROBE_GAP, "figures measured here: the budget alone"
    probes.begin(p)
    probes.drafted(p, 1.5)
    probes.accepted(p, 0)
    probes.ended(p, 1, 10.0)   # the first probe here lost ~6 ms, not 5 s: it replaces the learned loss
    assert p._probe_ms[True][0] < 10.0
    q = _restored(_learned(probe_ms={"1": [5.0, 10]}))
    probes.begin(q)
    probes.drafted(q, 1000.0)   # a stalled first probe: no heal upward, the stall cap as before
    probes.accepted(q, 0)
    probes.ended(q, 1, 10.0)
    assert q._probe_ms[True][0] <= 5.0 + 0.3 * (3 * 5.0 - 5.0) + 1e-9


def test_live_plain_cycles_far_off_the_cached_curve_drop_it_at_close(tmp_path, monkeypatch):
    monkeypatch.setenv(policy_memory.MEMORY_ENV, "1")
    curve = tmp_path / "curve.json"
    curve.write_text("{}")
    p = _policy()
    p.profile_path = str(curve)
    for _ in range(heal.HEAL_SAMPLES):
        p.observe_cycle(1, 1, 5.0)     # the curve's own speed
    assert p.profile_stale is None
    q = _policy()
    q.profile_path = str(curve)
    q.cost = CostModel([x * 2.5 for x in QUIET], draft_ms=[0.0])   # a curve read 2.5x slow
    for _ in range(heal.HEAL_SAMPLES):
        q.observe_cycle(1, 1, 5.4)
    assert q.profile_stale and curve.exists()
    policy_memory.save(q)
    assert not curve.exists()


# ---- the checks of a measured curve ----------------------------------------------------------------

def test_the_issue_curves_are_rejected_and_a_quiet_one_is_not():
    assert profile_check.shape(QUIET) == []
    busy = [10.7, 24.5, 30.0, 29.3, 40.9] + [45.0 + 5 * b for b in range(27)]
    busy[14], busy[15], busy[17], busy[22] = 226.0, 90.0, 171.0, 240.0
    assert any("B = 15" in w for w in profile_check.shape(busy))
    spike = list(QUIET)
    spike[8], spike[24] = 874.0, 746.0
    assert profile_check.shape(spike)
    inflated = [QUIET[0]] + [x * 10 for x in QUIET[1:]]
    assert any("single rows" in w for w in profile_check.shape(inflated))
    assert any("flat" in w for w in profile_check.shape([30.0] * 32))
    noisy = profile_check.shape(QUIET, [x * 0.6 for x in QUIET], [x * 1.4 for x in QUIET], [5] * 32)
    assert any("noisy" in w for w in noisy)


def test_contention_is_read_from_the_load_record():
    quiet = dict(n_cpus=2, others_cores=0.05, steal_cores=0.0)
    assert profile_check.contention(quiet, 2) == []
    assert profile_check.contention(dict(quiet, others_cores=0.6), 2)           # no spare core
    assert profile_check.contention(dict(quiet, others_cores=1.0), 1) == []     # one spare core, one busy
    assert profile_check.contention(dict(quiet, others_cores=1.5), 1)
    assert profile_check.contention(dict(quiet, steal_cores=0.5), 1)


def test_a_curve_made_by_another_version_is_stale():
    assert profile_check.stale(profile_check.made_by()) == []
    assert profile_check.stale(dict(profile_check.made_by(), llama_cpp="0.0.1"))
    assert profile_check.stale({})


def test_the_load_watch_sees_this_process_work():
    w = profile_check.LoadWatch()
    x = 0
    for i in range(2_000_000):
        x += i
    got = w.stop()
    assert got["cpu_s"] > 0.5 * got["wall_s"] and got["n_cpus"] == len(os.sched_getaffinity(0))


# ---- borrowed targets, profile --show / --reset, profile -> auto -------------------------------------

def test_a_borrowed_llama_is_keyed_by_its_model_file(target_path, tmp_path):
    from llama_cpp import Llama

    from pyllama_dspark.gguf.target_writer import make_test_target
    from pyllama_dspark.integrations.dspark import DSpark

    other = make_test_target(tmp_path / "other.gguf", "llama")
    keys = []
    for path in (target_path, other, target_path):
        llm = Llama(model_path=path, n_ctx=512, verbose=False)
        try:
            ds = DSpark.from_llama(llm, None, schedule="off")
            assert os.path.realpath(ds.target.path) == os.path.realpath(path)
            keys.append(costprofile.target_key(ds.target))
        finally:
            llm.close()
    assert keys[0] != keys[1] and keys[0] == keys[2]


def _cli_env(tmp_path):
    return {"PYLLAMA_DSPARK_CACHE": str(tmp_path), costprofile.PROFILE_ENV: ""}


def test_profile_show_and_reset(target_path, tmp_path, monkeypatch):
    from cli_runner import cli
    from pyllama_dspark.decode.api import Speculator

    env = _cli_env(tmp_path)
    monkeypatch.setenv("PYLLAMA_DSPARK_CACHE", str(tmp_path))
    with Speculator(target_path, None, n_ctx=512, n_threads=1, schedule="off") as sp:
        key = costprofile.target_key(sp.target)
        settings = dict(target=target_path, draft=None, n_ctx=512, n_threads=1, flash_attn="auto",
                        n_gpu_layers=0, b_max=32)
    good = costprofile.Profile(key=key, settings=settings, batch_sizes=list(range(1, 33)), verify_ms=QUIET,
                               verify_p10=QUIET, verify_p90=QUIET, draft_ms=0.0, repeats=5,
                               readings=[5] * 32, made_by=profile_check.made_by(),
                               load=dict(n_cpus=2, others_cores=0.01, steal_cores=0.0))
    costprofile.save(good, costprofile.default_path(key))
    learned = costprofile.default_path(key).with_name("learned-abc.json")
    learned.write_text(json.dumps({"version": policy_memory.MEMORY_VERSION, "about": dict(
        target=target_path, draft="d.gguf", proposer="dspark", gamma=7, regime="greedy"), "state": _learned()}))
    p = cli("profile", "-m", target_path, "-c", "512", "-t", "1", "--show", env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "verdict: accepted" in p.stdout and "learned-abc.json" in p.stdout and "[0.90" in p.stdout, p.stdout
    spiky = dict(json.loads(costprofile.default_path(key).read_text()))
    spiky["verify_ms"] = QUIET[:8] + [874.0] + QUIET[9:]
    costprofile.default_path(key).write_text(json.dumps(spiky))
    p = cli("profile", "-m", target_path, "-c", "512", "-t", "1", "--show", env=env)
    assert "verdict: rejected" in p.stdout and "B = 9" in p.stdout, p.stdout
    p = cli("profile", "-m", target_path, "--reset", env=env)
    assert p.returncode == 0 and "removed 1 cost curve(s) and 1 learned state(s)" in p.stdout, p.stdout
    assert not costprofile.default_path(key).exists() and not learned.exists()


def test_profile_writes_the_curve_auto_reads(target_path, dspark_draft_path, tmp_path, monkeypatch):
    """``profile -md DRAFT`` keys its full profile by the draft too; the verify curve also goes where
    auto reads it, so a run with that draft plans on what ``profile`` measured."""
    from click.testing import CliRunner

    from pyllama_dspark.cli.main import main
    from pyllama_dspark.decode.api import Speculator

    monkeypatch.setenv("PYLLAMA_DSPARK_CACHE", str(tmp_path))
    monkeypatch.delenv(costprofile.PROFILE_ENV, raising=False)
    real = costprofile.measure

    def measured(sp, **kw):   # the real measurement, its curve replaced by a quiet machine's (tests run beside others)
        prof = real(sp, **dict(kw, repeats=1))
        return costprofile.Profile(**dict(prof.__dict__, verify_ms=QUIET, verify_p10=QUIET, verify_p90=QUIET,
                                          load=dict(prof.load, others_cores=0.0)))

    monkeypatch.setattr(costprofile, "measure", measured)
    r = CliRunner().invoke(main, ["profile", "-m", target_path, "-md", dspark_draft_path, "-c", "512", "-t", "1"])
    assert r.exit_code == 0, r.output
    assert "the curve the auto schedule reads" in r.output, r.output
    with Speculator(target_path, None, n_ctx=512, n_threads=1, schedule="off") as sp:
        got = costprofile.known_profile(sp.target)
    assert got is not None and np.allclose(got.verify_ms, QUIET) and got.settings["draft"] is None
