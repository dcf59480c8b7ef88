"""Scheduling math against hand-computed cases (pure functions)."""

from __future__ import annotations

import numpy as np
import pytest

from pyllama_dspark.speculative.schedule import (
    CostModel, apply_sts, calibration_report, ece, fit_sts, joint_labels, retrospective_schedule, roc_auc,
    schedule, should_draft, static_cut, survival, survival_cut,
)


def test_static_and_survival_cuts():
    c = [0.9, 0.8, 0.95, 0.4, 0.99]
    assert static_cut(c, 0.5) == 3
    assert static_cut(c, 0.85) == 1
    assert static_cut(c, 0.0) == 5
    np.testing.assert_allclose(survival(c), [0.9, 0.72, 0.684, 0.2736, 0.270864])
    assert survival_cut(c, 0.7) == 2      # a = .9, .72 | .684 < .7
    assert survival_cut(c, 0.95) == 0
    assert survival_cut([], 0.5) == 0


def test_cost_model_extrapolates_and_validates():
    cm = CostModel([10, 12, 14], draft_ms=[5])
    assert cm.t_verify(3) == 14 and cm.t_verify(5) == pytest.approx(18)
    # beyond the table: the slope of the last half, so one flat last step does not flatten it
    assert CostModel([8, 14, 20, 26, 32, 32.1]).t_verify(8) > 36   # last-two-points slope: 32.3
    assert cm.sps(1) == pytest.approx(100.0)
    assert cm.t_draft(3) == 15
    with pytest.raises(ValueError):
        CostModel([])
    with pytest.raises(ValueError):
        cm.t_verify(0)


def test_paper_counterexample_early_stop_vs_retrospective():
    # Appendix A: SPS(1)=1, SPS(2)=0.5, SPS(3)=0.45, a1 = 0.8; c2 depends on the drafted x1
    cost = CostModel([1000.0, 2000.0, 1000.0 / 0.45])
    decisions_x1 = set()
    for c2 in (0.9, 0.0):
        surv = [[0.8, 0.8 * c2]]
        s = schedule(surv, cost, drafted=False)
        # whether x1 is verified is decided from a1 and the cost curve only: the same for both x1
        decisions_x1.add(s.lengths[0] >= 1)
        # (the one-step test alone would stop at B=2: Theta1 = 1.8*0.5 = 0.9 <= Theta0 = 1.0; the
        # curve ahead, B=3 at 0.45 with up to 2 tokens of survival <= 0.8, can pay, so x1 is admitted)
        assert s.lengths[0] >= 1
    assert decisions_x1 == {True}
    assert schedule([[0.8, 0.72]], cost, drafted=False).lengths == [2]
    assert schedule([[0.8, 0.0]], cost, drafted=False).lengths == [1]   # committed to x1, no rollback
    # without the early stop the admission of x1 depends on x1 itself (through c2): it leaks
    hi = retrospective_schedule([[0.8, 0.72]], cost, drafted=False)
    lo = retrospective_schedule([[0.8, 0.0]], cost, drafted=False)
    assert hi.lengths == [2] and hi.throughput == pytest.approx((1 + 0.8 + 0.72) * 0.45)
    assert lo.lengths == [0]


def test_schedule_stop_never_reads_later_survivals():
    # a cost curve where x1 alone cannot pay and x1 + x2 might: the one-step test would stop, the
    # retrospective search would admit x1 only when a2 turns out high; ours decides on a1 alone
    cost = CostModel([1000.0, 2000.0, 2100.0])
    for a1 in (0.3, 0.6, 0.95):
        first = {schedule([[a1, a1 * c2]], cost, drafted=False).lengths[0] >= 1 for c2 in (0.0, 0.2, 0.5, 1.0)}
        assert len(first) == 1
        # and it matches the optimistic bound: 1 + 2*a1 tokens in 2.1 s beats 1 token in 1 s
        assert first == {(1 + 2 * a1) / 2.1 > 1.0}
    retro = {retrospective_schedule([[0.6, 0.6 * c2]], cost, drafted=False).lengths[0] >= 1 for c2 in (0.0, 1.0)}
    assert retro == {True, False}


def test_schedule_single_request_unimodal_curve():
    # flat-ish verify cost (memory-bound GPU): verifying more almost never costs more
    cost = CostModel([10, 10.5, 11, 11.5, 12, 12.5, 13, 13.5])
    s = schedule([[0.9, 0.8, 0.6, 0.3, 0.1]], cost, drafted=False)
    # Theta_l = tau_l / t(1+l) per ms: 1/10, 1.9/10.5, 2.7/11, 3.3/11.5, 3.6/12 = .3, 3.7/12.5 = .296
    assert s.lengths == [4]
    assert s.batch == 5 and s.expected_tokens == pytest.approx(1 + 0.9 + 0.8 + 0.6 + 0.3)
    assert s.throughput == pytest.approx(3.6 / 12 * 1e3)


def test_schedule_compute_bound_cpu_never_drafts_weak_tokens():
    # CPU-like linear cost: B tokens cost B x one step
    cost = CostModel([10.0 * b for b in range(1, 17)])
    s = schedule([[0.9, 0.81, 0.73]], cost, drafted=False)
    assert s.lengths == [0]  # (1+0.9)/20ms < 1/10ms
    assert not should_draft([[0.99] * 7], CostModel([10.0 * b for b in range(1, 17)], draft_ms=[1]))


def test_schedule_draft_cost_is_in_the_objective():
    cost = CostModel([10, 10.2, 10.4, 10.6], draft_ms=[0.0])
    assert schedule([[0.5]], cost).lengths == [1]
    # the same survival no longer pays when the draft pass itself costs 30 ms... except it is sunk
    # within the cycle; what matters is whether drafting pays at all
    assert should_draft([[0.5]], cost)
    assert not should_draft([[0.5]], CostModel([10, 10.2, 10.4, 10.6], draft_ms=[30.0]))


def test_schedule_multi_request_global_order_and_ties():
    cost = CostModel([10, 10, 10, 10, 10, 20, 30, 40, 50, 60])  # free up to B=5, then linear
    surv = [[0.9, 0.5], [0.8, 0.7, 0.2]]
    s = schedule(surv, cost, drafted=False)
    # admission order: (0,1)=.9, (1,1)=.8, (1,2)=.7 -> B=5 (free), then (0,2)=.5 -> B=6 costs 2x: stop
    assert s.lengths == [1, 2] and s.batch == 5
    assert [(r, j) for r, j, _ in s.path] == [(0, 1), (1, 1), (1, 2)]
    # exact ties: lower request index first, prefixes stay contiguous
    t = schedule([[0.6, 0.6], [0.6]], CostModel([10] * 10), drafted=False)
    assert t.lengths == [2, 1]


def test_schedule_jagged_curve_crosses_a_slow_batch_size():
    # jagged SPS: B=3 is slow (e.g. a bad kernel split), B=4 fast again
    cost = CostModel([10, 10, 30, 10.5])
    s = schedule([[0.95, 0.9, 0.85]], cost, drafted=False)
    # .95 pays at B=2; .9 alone lands on the slow B=3, but .9 + up to one more token of survival
    # <= .9 at B=4 pays, so it is admitted; .85 then pays at B=4
    assert s.lengths == [3] and s.batch == 4
    assert s.throughput == pytest.approx((1 + 0.95 + 0.9 + 0.85) / 10.5 * 1e3)
    # the same first two decisions when the third survival is worthless: committed, left in the
    # slow batch size rather than rolled back by looking at a3
    t = schedule([[0.95, 0.9, 0.0]], cost, drafted=False)
    assert t.lengths == [2] and t.batch == 3
    # the retrospective search rolls back to l = 1 there (its choice of x2 depended on a3)
    assert retrospective_schedule([[0.95, 0.9, 0.0]], cost, drafted=False).lengths == [1]
    # staircase like the CPU profiles (t jumps every 4 tokens): R = 4 requests of survival .9
    stairs = CostModel([8, 14, 17.5, 20, 25, 28.5, 32.5, 33, 40, 42, 45, 47, 52.5, 56, 58.5, 59])
    surv4 = [list(np.cumprod([0.9] * 3))] * 4
    r4 = schedule(surv4, stairs, drafted=True, draft_ms=4.0)
    assert r4.batch > 8   # the one-step test stopped at B=8 (B=9 costs 7 ms more)
    assert r4.throughput > 4 / (20 + 4) * 1e3


def test_schedule_measured_draft_cost_overrides_profile():
    cost = CostModel([10.0 * b for b in range(1, 9)], draft_ms=[20.0])
    s = [[0.99] * 7]
    assert not should_draft(s, cost)                 # 20 ms of drafting cannot pay on a linear curve
    assert not should_draft(s, cost, draft_ms=0.1)   # nor verification at 10 ms per token
    flat = CostModel([10, 10.5, 11, 11.5, 12, 12.5, 13, 13.5], draft_ms=[60.0])
    assert not should_draft([[0.9, 0.8]], flat)
    assert should_draft([[0.9, 0.8]], flat, draft_ms=1.0)


def test_ece_and_auc_hand_cases():
    assert ece([0.8] * 10, [1] * 8 + [0] * 2) == pytest.approx(0.0)
    assert ece([0.9] * 4, [1, 0, 0, 0]) == pytest.approx(0.65)
    assert roc_auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert roc_auc([0.5, 0.5], [0, 1]) == pytest.approx(0.5)
    assert np.isnan(roc_auc([0.2, 0.3], [1, 1]))


def test_sts_recovers_overconfidence():
    rng = np.random.default_rng(0)
    N, gamma = 20000, 4
    true_c = rng.uniform(0.3, 0.95, size=(N, gamma))
    # an overconfident head: logit doubled
    raw = apply_sts(true_c, [0.5] * gamma)
    acc = rng.random((N, gamma)) < true_c
    n_acc = np.where(acc.all(1), gamma, np.argmin(acc, axis=1))
    temps = fit_sts(raw, n_acc)
    np.testing.assert_allclose(temps, 2.0, rtol=0.2)  # ECE of a product: a noisy objective
    rep = calibration_report(raw, n_acc, temps)
    assert all(r["ece_sts"] < r["ece_raw"] for r in rep)
    assert all(r["ece_sts"] < 0.02 for r in rep)
    assert all(0.6 < r["auc"] < 0.9 for r in rep)
    np.testing.assert_array_equal(joint_labels(np.array([0, 2]), 3), [[0, 0, 0], [1, 1, 0]])


def test_calibration_file_is_bound_to_the_draft(tmp_path):
    from pyllama_dspark.speculative.calibration import fit, load_calibration, reliability_png
    from pyllama_dspark.errors import DSparkError

    rng = np.random.default_rng(1)
    recs = []
    for _ in range(3000):
        c = rng.uniform(0.2, 0.99, size=7)
        true = apply_sts(c[None, :], [2.0] * 7)[0]          # the raw head is under-confident here
        acc = rng.random(7) < true
        n_acc = 7 if acc.all() else int(np.argmin(acc))
        recs.append((c, 7, n_acc))
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"GGUF fake draft bytes")
    cal = fit(recs[::2], recs[1::2], 7, str(draft))
    assert all(r["ece_sts"] <= r["ece_raw"] + 1e-9 for r in cal.report)
    assert cal.report[0]["ece_sts"] < 0.03 < cal.report[0]["ece_raw"]
    path = tmp_path / "cal.json"
    cal.save(path)
    assert load_calibration(path, str(draft)).temperatures == cal.temperatures
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF another draft")
    with pytest.raises(DSparkError, match="another draft"):
        load_calibration(path, str(other))
    reliability_png(recs[1::2], cal.temperatures, 7, tmp_path / "rel.png")
    assert (tmp_path / "rel.png").stat().st_size > 1000


# ---- the policy's running estimates (pure: no model) ------------------------------------------------

def test_policy_learns_draft_cost_and_acceptance_and_backs_off_probes():
    from pyllama_dspark.speculative.policy import VerifyPolicy

    linear = CostModel([10.0 * b for b in range(1, 33)], draft_ms=[50.0])
    pol = VerifyPolicy(mode="profiled", cost=linear, probe_every=4, probe_budget=1.0)
    # no measured draft pass for R = 2 yet: two passes are made to learn its cost (a process's
    # first pass is cold: a placeholder the second replaces)
    assert pol.want_draft(2)
    pol.observe_draft(2, 30.0)
    assert pol.want_draft(2)
    pol.observe_draft(2, 3.0)
    assert pol.draft_estimate(2) == pytest.approx(3.0) and pol.draft_estimate(4) == pytest.approx(6.0)
    # a draft whose first token is never accepted: the 0.9 prior is gone after a few cycles
    for _ in range(3):
        pol.update(1, 0, np.array([0.9]))
    assert pol._acc[0] < 0.3
    # on a linear (compute-bound) curve nothing pays now: skipped, with probes at 4, then 8 ... steps
    decisions = [pol.want_draft(2) for _ in range(4 + 8 + 16)]
    probes = [i for i, d in enumerate(decisions) if d]
    assert probes == [3, 3 + 8, 3 + 8 + 16]


def test_probes_stay_within_their_time_budget_and_verify_a_token():
    from pyllama_dspark.speculative.policy import VerifyPolicy

    # verifying b rows costs 10 + b ms, a draft pass 50 ms (the profile's: learn_costs off)
    cost = CostModel([10.0 + b for b in range(1, 33)], draft_ms=[50.0])
    pol = VerifyPolicy(mode="auto", cost=cost, probe_every=4, learn_costs=False)
    for _ in range(30):     # the first draft is never right
        pol.update(2, 0)
    # a probe costs the draft pass plus one more verified row (51 ms); at 1% of 11 ms plain cycles
    # that is one probe per ceil(51 / 0.11) = 464 cycles (the geometric back-off alone would say 4)
    decisions = [pol.want_draft(1) for _ in range(928)]
    assert [i for i, d in enumerate(decisions) if d] == [463, 927]
    # the probe verifies a draft although the estimates say none pays (else it would learn nothing);
    # the next cycle is back to the schedule's own decision
    assert pol.lengths([None], [5]) == [1]
    assert pol.want_draft(1) is False
    # evidence that the drafts are right flips the (cached) decision: drafting pays again
    for _ in range(20):
        pol.update(7, 7)
    assert pol.want_draft(1) and pol.lengths([None], [7])[0] >= 4


def test_policy_online_correction_of_overconfident_heads():
    from pyllama_dspark.speculative.policy import VerifyPolicy

    flat = CostModel([10.0 + 0.01 * b for b in range(32)], draft_ms=[0.0])
    pol = VerifyPolicy(mode="profiled", cost=flat)
    raw = np.array([0.8, 0.8, 0.8])
    np.testing.assert_allclose(pol.corrected(raw), raw)   # no evidence yet: unchanged
    # the head says 0.8 at position 1, but only 1 in 4 are accepted
    for i in range(40):
        pol.update(1, 1 if i % 4 == 0 else 0, raw)
    c = pol.corrected(raw)
    assert 0.2 < c[0] < 0.35 and c[1] == pytest.approx(0.8)   # position 2 never verified: unchanged
    # static / survival thresholds keep their meaning on the (calibrated) head
    st = VerifyPolicy(mode="static", conf_min=0.5)
    st.update(1, 0, raw)
    np.testing.assert_allclose(st.corrected(raw), raw)
