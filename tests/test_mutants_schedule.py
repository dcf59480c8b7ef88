"""Mutation-score tests for speculative/schedule.py: the cost curve, the cuts, Algorithm 1 and the
calibration statistics on cases computed by hand (numbers worked out in the comments)."""

import math

import numpy as np
import pytest

from pyllama_dspark.speculative.schedule import (DEFAULT_GRID, CostModel, _can_pay, _candidates, apply_sts, calibration_report,
                                          ece, fit_sts, joint_labels, retrospective_schedule, roc_auc, schedule,
                                          should_draft, static_cut, survival, survival_cut)


def test_cost_model_checks():
    for bad in ([], [1.0, 0.0], [[1.0, 2.0]], [-1.0]):
        with pytest.raises(ValueError, match="^verify_ms must be a non-empty list of positive times$"):
            CostModel(bad)
    for bad in ([], [1.0, -0.1]):
        with pytest.raises(ValueError, match="^draft_ms must be non-negative$"):
            CostModel([1.0], bad)
    c = CostModel([1, 2], [[0.5]])
    assert c.verify_ms.dtype == np.float64 and c.draft_ms.tolist() == [0.5] and c.overhead_ms == 0.0
    assert CostModel([1.0]).draft_ms.tolist() == [0.0]
    with pytest.raises(ValueError, match="^batch size must be >= 1$"):
        c.t_verify(0)


def test_cost_curve_extrapolation_by_hand():
    # 5 points: least squares over the last 3, x = 2, 3, 4, y = 15, 16, 30: slope 15 / 2 = 7.5
    c = CostModel([10, 11, 15, 16, 30])
    assert [c.t_verify(b) for b in (1, 3, 5, 6, 7)] == pytest.approx([10.0, 15.0, 30.0, 37.5, 45.0])
    assert isinstance(c.t_verify(2), float)
    # 4 points: last 2 (14, 20): slope 6
    assert CostModel([10, 12, 14, 20]).t_verify(6) == pytest.approx(32.0)
    # 2 points falling: slope clipped at 0
    assert CostModel([10, 5]).t_verify(4) == 5.0
    # 3 points: k = max(2, 2) = 2: slope 9 - 1 = 8 (all 3 would give 4)
    assert CostModel([1, 1, 9]).t_verify(4) == pytest.approx(17.0)
    # 1 point: proportional
    assert CostModel([4.0]).t_verify(3) == 12.0 and CostModel([4.0]).t_verify(1) == 4.0
    r = c.t_verify_range(4, 6)
    assert r.dtype == np.float64 and r.tolist() == pytest.approx([16.0, 30.0, 37.5])
    # the range is t_verify over each batch size, inside the table and past it, to the last bit
    assert c.t_verify_range(1, 9).tolist() == [c.t_verify(b) for b in range(1, 10)]
    assert CostModel([4.0]).t_verify_range(1, 3).tolist() == [4.0, 8.0, 12.0]
    assert c.t_verify_range(5, 4).size == 0
    with pytest.raises(ValueError, match="^batch size must be >= 1$"):
        c.t_verify_range(0, 3)
    assert c.sps(5) == pytest.approx(1e3 / 30.0)


def test_draft_cost_by_hand():
    d = CostModel([1.0], [2.0, 3.0])
    assert [d.t_draft(n) for n in (-1, 0, 1, 2, 3, 4)] == [0.0, 0.0, 2.0, 3.0, 4.5, 6.0]
    assert CostModel([1.0], [1.5]).t_draft(3) == 4.5
    assert isinstance(d.t_draft(1), float)


def test_cuts_by_hand():
    assert survival([]).size == 0
    assert survival([0.5, 0.5, 0.5]).tolist() == [0.5, 0.25, 0.125]
    assert static_cut([0.9, 0.5, 0.95], 0.5) == 3          # >= conf_min stays
    assert static_cut([0.9, 0.5, 0.95], 0.6) == 1
    assert static_cut([0.4], 0.5) == 0 and static_cut([], 0.5) == 0
    assert survival_cut([0.5, 0.5, 0.5], 0.25) == 2         # a_2 = 0.25 >= 0.25
    assert survival_cut([0.5, 0.5, 0.5], 0.26) == 1
    assert survival_cut([0.5, 0.5, 0.5], 0.0) == 3 and survival_cut([0.1], 0.5) == 0


def test_candidates_order():
    assert _candidates([[0.9, 0.5], [0.9, 0.0], [0.95]]) == [(0.95, 2, 1), (0.9, 0, 1), (0.9, 1, 1), (0.5, 0, 2)]
    assert _candidates([[0.5, 0.5]]) == [(0.5, 0, 1), (0.5, 0, 2)]
    # a tie across requests: the lower request index first, whatever the prefix length
    assert _candidates([[0.9, 0.5], [0.5]]) == [(0.9, 0, 1), (0.5, 0, 2), (0.5, 1, 1)]
    assert _candidates([[]]) == []


def test_can_pay_by_hand():
    sec = [0.010, 0.030]   # (t_verify(b + m) + t_fixed) / 1e3 for m = 1, 2
    assert _can_pay(1.0, 0.5, 100.0, sec)              # m = 1: 1.5 / 0.01 = 150 > 100
    assert not _can_pay(1.0, 0.5, 150.0, sec)          # 150 not > 150, m = 2: 2 / 0.03
    assert _can_pay(1.0, 0.5, 150.0, [0.030, 0.010])   # m = 2: 200 (reads ahead)
    assert not _can_pay(1.0, 0.5, 150.0, [0.030])      # only 1 remaining
    assert not _can_pay(1.0, 0.5, 100.0, [0.015])      # t_fixed 5 ms: 1.5 / 0.015 = 100
    assert not _can_pay(1.0, 0.5, 0.0, [])             # nothing left to admit


def test_schedule_by_hand():
    cost = CostModel([10, 10, 10, 20])
    # theta0 = 1 / 0.01 = 100; +0.9: 190; +0.8: 270; +0.1 at B = 4: 2.8 / 0.02 = 140 < 270: stop
    s = schedule([[0.9, 0.8, 0.1]], cost)
    assert s.lengths == [2] and s.batch == 3
    assert s.throughput == pytest.approx(270.0) and s.expected_tokens == pytest.approx(2.7)
    assert [(r, j) for r, j, _ in s.path] == [(0, 1), (0, 2)]
    assert [th for _, _, th in s.path] == pytest.approx([190.0, 270.0])
    # a draft pass of 10 ms: 1 / 0.02 = 50; 95; 135; 2.8 / 0.03 = 93.3: stop
    s = schedule([[0.9, 0.8, 0.1]], cost, draft_ms=10.0)
    assert s.lengths == [2] and s.throughput == pytest.approx(135.0)
    assert schedule([[0.9, 0.8, 0.1]], cost, drafted=False, draft_ms=10.0).throughput == pytest.approx(270.0)
    c2 = CostModel([10, 10, 10, 20], [10.0], overhead_ms=5.0)
    assert schedule([[0.9, 0.8, 0.1]], c2).throughput == pytest.approx(2.7 / 0.025)
    assert schedule([[0.9, 0.8, 0.1]], c2, drafted=False).throughput == pytest.approx(2.7 / 0.015)
    with pytest.raises(ValueError, match="^no requests$"):
        schedule([], cost)


def test_schedule_crosses_a_slow_batch_size_and_two_requests():
    # t(3) = 30 between fast sizes: theta 100, 190, 2.8/0.03 = 93 (admitted: 3.7/0.01 ahead), 370, 460
    s = schedule([[0.9, 0.9, 0.9, 0.9]], CostModel([10, 10, 30, 10, 10]))
    assert s.lengths == [4] and s.batch == 5 and s.throughput == pytest.approx(460.0)
    # R = 2: B starts at 2, theta0 = 2 / 0.01 = 200; admits 0.9 (r 0), 0.8 (r 1), then 0.3 at B = 5: 20 ms
    cost = CostModel([10, 10, 10, 10, 20])
    s = schedule([[0.9, 0.3], [0.8]], cost)
    assert s.lengths == [1, 1] and s.batch == 4 and s.throughput == pytest.approx(370.0)
    assert [(r, j) for r, j, _ in s.path] == [(0, 1), (1, 1)]
    assert schedule([[0.0], [0.0]], cost).lengths == [0, 0]
    assert schedule([[], []], cost).lengths == [0, 0] and schedule([[], []], cost).throughput == 200.0


def test_non_monotone_survival_stops_admission_but_not_the_retrospective_search():
    cost = CostModel([10.0] * 5)
    s = schedule([[0.5, 0.8]], cost)
    assert s.lengths == [0] and s.throughput == 100.0 and s.path == []
    r = retrospective_schedule([[0.5, 0.8]], cost)
    assert r.lengths == [1] and r.throughput == pytest.approx(150.0)


def test_retrospective_schedule_by_hand():
    cost = CostModel([10, 10, 30, 10], [10.0])
    # with the 10 ms draft pass: 1/0.02 = 50, 1.9/0.02 = 95, 2.1/0.04 = 52.5, 2.3/0.02 = 115: best [3]
    r = retrospective_schedule([[0.9, 0.2, 0.2]], cost)
    assert r.lengths == [3] and r.throughput == pytest.approx(115.0) and r.batch == 4
    assert r.expected_tokens == pytest.approx(2.3)
    r = retrospective_schedule([[0.9, 0.2, 0.2]], cost, drafted=False)
    assert r.lengths == [3] and r.throughput == pytest.approx(230.0)
    # nothing pays: plain decoding
    r = retrospective_schedule([[0.01]], CostModel([10, 100]))
    assert r.lengths == [0] and r.throughput == 100.0 and r.batch == 1 and r.expected_tokens == 1.0
    # an exact tie keeps the shorter prefix: 1 / 0.01 = 2 / 0.02
    r = retrospective_schedule([[1.0]], CostModel([10, 20]))
    assert r.lengths == [0] and r.throughput == 100.0
    c = CostModel([10, 10], overhead_ms=10.0)
    assert retrospective_schedule([[0.5]], c).throughput == pytest.approx(1.5 / 0.02)


def test_should_draft_by_hand():
    cost = CostModel([10, 10])
    assert should_draft([[0.9]], cost)
    assert not should_draft([[0.9]], cost, draft_ms=100.0)     # 1.9 / 0.11 < 100
    assert not should_draft([[0.0]], cost)                     # 100 is not > 100
    assert should_draft([[0.9]], CostModel([10, 10], [5.0]))   # 1.9 / 0.015 = 126.7 > 100
    assert not should_draft([[0.9]], CostModel([10, 10], [10.0]))   # 1.9 / 0.02 = 95
    # the overhead is in both: 1.9 / 0.02 = 95 vs 1 / 0.02 = 50 ... then with a 15 ms pass 1.9/0.035 = 54 > 50
    assert should_draft([[0.9]], CostModel([10, 10], [15.0], overhead_ms=10.0))
    assert not should_draft([[0.9]], CostModel([10, 10], [20.0], overhead_ms=10.0))   # 1.9 / 0.04 = 47.5


def test_apply_sts_by_hand():
    # sigmoid(logit(0.8) / 2) = sigmoid(ln 4 / 2) = 2 / 3; T = 1 leaves 0.8; 0.5 stays 0.5
    out = apply_sts(np.array([[0.8, 0.8, 0.5]]), [2.0])
    assert out.tolist()[0] == pytest.approx([2 / 3, 0.8, 0.5])
    assert apply_sts(np.array([0.8, 0.8]), [2.0, 1.0, 5.0]) == pytest.approx([2 / 3, 0.8])
    assert apply_sts(np.array([0.8]), [0.5]) == pytest.approx([16 / 17])
    edge = apply_sts(np.array([1.0, 0.0]), [1.0, 1.0])
    assert edge[0] == pytest.approx(1 - 1e-7, abs=1e-12) and edge[1] == pytest.approx(1e-7, abs=1e-12)


def test_ece_by_hand():
    assert ece([], []) == 0.0
    # bins 1, 1, 9: (2 * |0.125 - 0.5| + |0.9 - 1|) / 3
    assert ece([0.1, 0.15, 0.9], [0, 1, 1]) == pytest.approx(0.85 / 3)
    assert ece([1.0], [0]) == 1.0                               # p = 1 goes in the last bin
    # 10 bins split 0.095 | 0.105 ((0.905 + 0.105) / 2); 11 bins would not (|0.1 - 0.5| = 0.4)
    assert ece([0.095, 0.105], [1, 0]) == pytest.approx(0.505)
    assert ece([0.4, 0.6], [1, 0], n_bins=2) == pytest.approx(0.6)
    assert ece([0.4, 0.6], [1, 0], n_bins=1) == pytest.approx(0.0)
    assert isinstance(ece([0.5], [1]), float)


def test_roc_auc_by_hand():
    assert roc_auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert roc_auc([0.2, 0.5, 0.5, 0.9], [0, 1, 0, 1]) == pytest.approx(0.875)   # one tie counts half
    assert roc_auc([0.3, 0.3, 0.3, 0.1], [1, 0, 1, 0]) == pytest.approx(0.75)    # a three-way tie
    assert roc_auc([0.5, 0.5], [0, 1]) == pytest.approx(0.5)
    assert roc_auc([0.9, 0.1], [0, 1]) == 0.0 and roc_auc([0.1, 0.9, 0.9, 0.9], [0, 1, 1, 1]) == 1.0
    assert math.isnan(roc_auc([0.1, 0.2], [1, 1])) and math.isnan(roc_auc([0.1, 0.2], [0, 0]))


def test_joint_labels_and_fit_sts_by_hand():
    assert joint_labels(np.array([0, 2, 3]), 3).tolist() == [[0, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert joint_labels(np.array([1]), 2).dtype == np.float64
    conf = np.full((4, 2), 0.8)
    # half of the blocks accepted their first draft: the largest temperature pulls 0.8 toward 0.5
    t = fit_sts(conf, np.array([2, 2, 0, 0]))
    assert t[0] == pytest.approx(8.0)
    # all accepted: the smallest temperature pushes the survival toward 1
    t = fit_sts(conf, np.array([2, 2, 2, 2]))
    assert t.tolist() == pytest.approx([0.25, 0.25])
    # a confidence of 0.5 is the same at every temperature: the first grid value wins the ties
    assert fit_sts(np.full((3, 1), 0.5), np.array([1, 0, 1])).tolist() == [DEFAULT_GRID[0]]
    # position 2 verified by no block: it keeps temperature 1
    t = fit_sts(conf, np.array([1, 1, 1, 1]), np.array([1, 1, 1, 1]))
    assert t[1] == 1.0 and t[0] == pytest.approx(0.25)
    # position 2 of the blocks that verified it only: 2 of 2 accepted -> smallest temperature
    t = fit_sts(conf, np.array([2, 2, 0, 0]), np.array([2, 2, 1, 1]), grid=[1.0, 0.5])
    assert t.tolist() == [1.0, 0.5]
    assert fit_sts(np.full((2, 1), 0.8), np.array([1, 0]), n_bins=1, grid=[4.0, 0.5]).tolist() == [4.0]
    # the bins decide: one bin compares means (|0.58 - 0.5| at T = 4), ten bins each block
    # ((0.37 + 0.53) / 2 at T = 4 against (0.01 + 0.69) / 2 at T = 0.5)
    two = np.array([[0.9], [0.6]])
    assert fit_sts(two, np.array([1, 0]), n_bins=1, grid=[4.0, 0.5]).tolist() == [4.0]
    assert fit_sts(two, np.array([1, 0]), grid=[4.0, 0.5]).tolist() == [0.5]
    # the default is 10 bins (11 would pick the other temperature here)
    three = np.array([[0.78], [0.24], [0.87]])
    assert fit_sts(three, np.array([1, 0, 0]), grid=[0.5, 2.0]).tolist() == [0.5]
    assert fit_sts(three, np.array([1, 0, 0]), grid=[0.5, 2.0], n_bins=11).tolist() == [2.0]
    # an empty grid scales nothing
    assert fit_sts(conf, np.array([2, 2, 0, 0]), grid=[]).tolist() == [1.0, 1.0]


def test_calibration_report_by_hand():
    conf = np.array([[0.8, 0.5], [0.6, 0.5]])
    rep = calibration_report(conf, np.array([2, 0]), [2.0])
    a = math.sqrt(1.5) / (1 + math.sqrt(1.5))       # sigmoid(ln 1.5 / 2)
    assert rep[0] == pytest.approx(dict(position=1, n=2, survival=0.5, ece_raw=0.4, ece_sts=(1 / 3 + a) / 2,
                                        auc=1.0, temperature=2.0))
    r1 = dict(rep[1])
    assert math.isnan(r1.pop("auc"))
    assert r1 == pytest.approx(dict(position=2, n=2, survival=0.5, ece_raw=0.45,
                                    ece_sts=(2 / 3 + a / 2) / 2, temperature=1.0))
    rep = calibration_report(conf, np.array([2, 0]), [1.0, 3.0], np.array([2, 1]))
    assert rep[1]["n"] == 1 and rep[1]["survival"] == 1.0 and rep[1]["temperature"] == 3.0
    assert rep[1]["ece_raw"] == pytest.approx(0.6)
    rep = calibration_report(conf, np.array([2, 0]), [1.0, 1.0], np.array([1, 0]))
    assert rep[1]["n"] == 0 and math.isnan(rep[1]["survival"]) and rep[0]["n"] == 1
    rep = calibration_report(np.array([[0.9, 0.8], [0.6, 0.3], [0.7, 0.2]]), np.array([2, 1, 1]), [1.0, 1.0], n_bins=1)
    assert rep[1]["auc"] == pytest.approx(1.0) and rep[0]["ece_raw"] == pytest.approx(abs(2.2 / 3 - 1))
    # one bin: |mean p - mean y| = |0.733 - 0.667|; ten bins would give (0.1 + 0.4 + 0.7) / 3
    rep = calibration_report(np.array([[0.9], [0.6], [0.7]]), np.array([1, 1, 0]), [1.0], n_bins=1)
    assert rep[0]["ece_raw"] == pytest.approx(0.2 / 3) and rep[0]["ece_sts"] == pytest.approx(0.2 / 3, abs=1e-6)
