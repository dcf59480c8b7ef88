"""Mutation-score tests for speculative/policy.py: VerifyPolicy's running estimates, probes and cuts, and
policy_for, against values worked out by hand (numbers in the comments)."""

import math

import numpy as np
import pytest

from pyllama_dspark.speculative import probes
from pyllama_dspark.speculative.policy import ACC_FLOOR, COST_MODES, MODES, VerifyPolicy
from pyllama_dspark.speculative.policy_factory import policy_for
from pyllama_dspark.speculative.schedule import CostModel

FLAT = CostModel([10.0] * 16)
NEVER = CostModel([10.0, 100.0], [50.0])        # one more verified token costs 90 ms: never pays


def test_constants_and_checks():
    assert MODES == ("off", "static", "survival", "profiled", "auto") and COST_MODES == ("profiled", "auto")
    assert ACC_FLOOR == 1e-3
    with pytest.raises(ValueError, match=r"^schedule must be one of \('off', .*, got 'fast'$"):
        VerifyPolicy(mode="fast")
    for m in COST_MODES:
        with pytest.raises(ValueError, match=f"^the {m} schedule needs a cost profile$"):
            VerifyPolicy(mode=m)
    for kw in (dict(conf_min=1.1), dict(conf_min=-0.1), dict(p_survival_min=1.5), dict(p_survival_min=-1.0)):
        with pytest.raises(ValueError, match=r"^conf_min and p_survival_min must be in \[0, 1\]$"):
            VerifyPolicy(mode="static", **kw)
    for m in (-0.01, 1.0):
        with pytest.raises(ValueError, match=r"^draft_margin must be in \[0, 1\)$"):
            VerifyPolicy(mode="auto", cost=FLAT, draft_margin=m)
    assert VerifyPolicy(mode="auto", cost=FLAT, draft_margin=0.0).draft_margin == 0.0
    VerifyPolicy(mode="static", conf_min=1.0, p_survival_min=0.0)
    VerifyPolicy(mode="static", conf_min=0.0, p_survival_min=1.0)
    p = VerifyPolicy(mode="auto", cost=FLAT, gamma=3, probe_every=5)
    assert p._acc.tolist() == [0.9, 0.9, 0.9] and p._n.tolist() == [0, 0, 0] and p._probe_gap == 5
    assert p._hit_sum.tolist() == [0, 0, 0] and p._conf_sum.tolist() == [0, 0, 0]
    d = VerifyPolicy()
    assert (d.mode, d.conf_min, d.p_survival_min, d.gamma, d.ema, d.probe_every, d.probe_budget, d.learn_costs,
            d.draft_margin) == ("off", 0.0, 0.0, 7, 0.1, 16, 0.01, True, 0.03)
    assert [VerifyPolicy(mode=m, cost=FLAT).needs_confidence for m in MODES] == [False, True, True, True, False]
    assert [VerifyPolicy(mode=m, cost=FLAT).uses_cost for m in MODES] == [False, False, False, True, True]


def test_calibrated():
    p = VerifyPolicy(mode="static")
    assert p.calibrated([0.8]).tolist() == [0.8]
    p = VerifyPolicy(mode="static", temperatures=[2.0])
    assert p.calibrated(np.array([0.8, 0.8])) == pytest.approx([2 / 3, 0.8])
    assert p.calibrated(np.array([])).size == 0


def test_observe_draft_and_estimate():
    p = VerifyPolicy(mode="auto", cost=FLAT)
    assert p.draft_estimate(1) is None
    v = p._version
    for bad in ((0, 5.0), (-1, 5.0), (1, float("nan")), (1, float("inf")), (1, -1.0)):
        p.observe_draft(*bad)
    assert p._draft_ms == {} and p._version == v
    p.observe_draft(1, 50.0)                      # a process's first (cold) pass: a placeholder
    assert p._draft_ms == {1: 50.0} and p._version == v + 1
    p.observe_draft(1, 10.0)                      # the second pass replaces it
    assert p._draft_ms == {1: 10.0} and p._version == v + 2
    p.observe_draft(1, 20.0)                      # 10 e^(0.2 * 0.2): log(2) clipped at CLIP = 0.2
    assert p._draft_ms[1] == pytest.approx(10.0 * math.exp(0.04)) and p._version == v + 3
    p.observe_draft(1, 0.0)                       # (a free pass: clipped the other way)
    assert p._draft_ms[1] == pytest.approx(10.0)
    p.observe_draft(4, 20.0)
    assert p.draft_estimate(1) == pytest.approx(10.0) and p.draft_estimate(4) == 20.0
    assert p.draft_estimate(2) == pytest.approx(10.0 * 2)       # nearest: R = 1
    assert p.draft_estimate(3) == pytest.approx(20.0 * 3 / 4)   # nearest: R = 4
    assert p.draft_estimate(8) == pytest.approx(40.0)
    q = VerifyPolicy(mode="auto", cost=FLAT, learn_costs=False)
    q.observe_draft(1, 10.0)
    assert q._draft_ms == {} and q.draft_estimate(1) is None


def test_want_draft_learns_pays_and_probes():
    assert VerifyPolicy().want_draft(1) and VerifyPolicy(mode="static").want_draft(3)
    p = VerifyPolicy(mode="auto", cost=NEVER)
    assert p.want_draft(1) and not p._probing     # nothing measured yet: two passes to learn the cost
    p.observe_draft(1, 5.0)
    assert p.want_draft(1) and not p._probing     # the first pass of a process is cold
    p.observe_draft(1, 5.0)
    assert not p.want_draft(1)
    p = VerifyPolicy(mode="auto", cost=FLAT, learn_costs=False)
    assert all(p.want_draft(r) for r in (1, 2, 0)) and p._skipped == 0
    # never pays; probes every 2, then 4, 8, ... cycles (the budget gap: ceil(140 / (100 * 10)) = 1)
    p = VerifyPolicy(mode="auto", cost=NEVER, learn_costs=False, probe_every=2, probe_budget=100.0)
    got = [p.want_draft(1) for _ in range(16)]
    assert got == [False, True] + [False] * 3 + [True] + [False] * 7 + [True] + [False] * 2
    assert p._probe_gap == 16 and p._skipped == 2
    for _ in range(200):
        p.want_draft(1)
    assert p._probe_gap == 32                      # capped at 16 * probe_every
    p = VerifyPolicy(mode="auto", cost=NEVER, learn_costs=False, probe_every=0)
    assert not any(p.want_draft(1) for _ in range(50))
    # a probe marks the cycle
    p = VerifyPolicy(mode="auto", cost=NEVER, learn_costs=False, probe_every=1, probe_budget=100.0)
    assert p.want_draft(1) and p._probing
    assert not p.want_draft(1) and not p._probing


def test_budget_gap_by_hand():
    # probe = draft 50 + t(2) - t(1) = 140 ms; gap = ceil(140 / (0.01 * 10)) = 1400
    p = VerifyPolicy(mode="auto", cost=NEVER, learn_costs=False)
    assert p._budget_gap(1) == 1400 and p._budget_gap(0) == 1400
    assert p._gaps[1][:2] == ((p._version, 0.0, True), 1400)
    p = VerifyPolicy(mode="auto", cost=NEVER, probe_budget=0.5, probe_plan=False)   # the full-block probe
    p.observe_draft(1, 99.0)                       # the cold first pass, replaced by the second
    p.observe_draft(1, 10.0)                       # measured 10 ms: ceil(100 / 5) = 20
    assert p._budget_gap(1) == 20
    p.observe_draft(1, 60.0)                       # 10 e^(0.2 * 0.2) = 10.41 (clipped): ceil(100.41 / 5) = 21
    assert p._budget_gap(1) == 21
    # a sub-millisecond decode: probe 0.1 + 0.1 ms over 1% of 0.5 ms = 40 cycles
    sub = VerifyPolicy(mode="auto", cost=CostModel([0.5, 0.6], [0.1]), learn_costs=False)
    assert sub._budget_gap(1) == 40
    q = VerifyPolicy(mode="auto", cost=CostModel([10.0, 10.0]), learn_costs=False)
    assert q._budget_gap(1) == 0                   # a free probe
    z = VerifyPolicy(mode="auto", cost=NEVER, learn_costs=False, probe_budget=0.0)
    assert z._budget_gap(1) in (14_000_000, 14_000_001)   # budget floored at 1e-6 (ceil of 1.4e7 + rounding)
    # R = 2: t_draft(2) = 100, t(4) = 100 + 90 * 2 = 280, t(2) = 100: 280 / (0.01 * 100) = 280
    assert p._budget_gap.__self__ is p and VerifyPolicy(mode="auto", cost=NEVER, learn_costs=False)._budget_gap(2) == 280


def test_a_probe_runs_the_best_drafting_block_spaced_by_what_it_loses():
    # a flat 30 ms draft pass, t(k) = 10, 12, 14, 16, 23.2, 40, ...: acceptance 0.9 everywhere
    # (known) gives 1.9, 2.71, 3.439, 4.0951, 4.68559 tokens for blocks 1..5 at 42, 44, 46, 53.2, 70
    # ms: 22.1, 16.2, 13.38, 12.99, 14.9 ms a token against plain decoding's 10, so drafting does not
    # pay and the probe is the block of 4 (the fewest ms a token, not the smallest loss: block 3's
    # 11.61 ms), all verified; it loses 53.2 - 40.951 = 12.249 ms: ceil(12.249 / (1% of 10)) = 123
    cost = CostModel([10.0, 12.0, 14.0, 16.0, 23.2, 40.0, 50.0, 60.0], [30.0])
    p = VerifyPolicy(mode="auto", cost=cost, learn_costs=False, probe_every=1)
    p._acc, p._n = np.full(7, 0.9), np.full(7, 1e9)
    p._draft_ms = {1: 30.0}
    p._draft_ms_n = {(1, k): 30.0 for k in range(1, 8)}
    assert p._plan(1, 7)[0] == 0
    n, loss = p._probe_block(1, 7)
    assert n == 4 and abs(loss - 12.249) < 1e-3
    assert p._budget_gap(1) == 123
    assert sum(p.want_draft(1) for _ in range(122)) == 0 and p.want_draft(1) and p._probing
    assert p.draft_length(1, 7) == 4 and p.lengths([None], [4]) == [4] and not p._probing
    p._probing = True   # every drafted token of a probe is verified (the schedule would cut 7 at 4)
    assert p.lengths([None], [7]) == [7]
    assert p.lengths([None], [7]) == [4]
    # the full-block probe (probe_plan off): draft 30 + t(2) - t(1) = 32 ms: 320 cycles, one token
    q = VerifyPolicy(mode="auto", cost=cost, learn_costs=False, probe_every=1, probe_plan=False)
    q._acc, q._n, q._draft_ms, q._draft_ms_n = p._acc, p._n, p._draft_ms, p._draft_ms_n
    assert q._budget_gap(1) == 320
    q._probing = True
    assert q.draft_length(1, 7) == 7


def test_probes_are_spaced_by_the_larger_of_their_planned_and_measured_loss():
    """What a probe loses is measured (its whole pass, catch-up and cold start included, plus its
    cycle, less plain decoding's ms for the tokens it emitted), kept per kind (a process's first
    pass or a later one) across processes, and spaces the probes when it exceeds the plan."""
    cost = CostModel([10.0, 12.0, 14.0, 16.0, 23.2, 40.0, 50.0, 60.0], [30.0])

    def policy():
        p = VerifyPolicy(mode="auto", cost=cost, probe_every=1, ema=0.0)   # acceptance known: it stays
        p._acc, p._n = np.full(7, 0.9), np.full(7, 1e9)
        p._draft_ms, p._restored_draft = {1: 30.0}, True
        p._draft_ms_n = {(1, k): 30.0 for k in range(1, 8)}
        return p

    p = policy()
    assert p._budget_gap(1) == 123                 # planned: block 4 loses 12.249 ms (see above)
    assert sum(p.want_draft(1) for _ in range(122)) == 0 and p.want_draft(1) and p._probing
    assert p.draft_length(1, 7) == 4
    p.observe_draft(1, 66.8, 4)                    # the process's first pass: 36.8 ms over a warm one
    assert p.lengths([None], [4]) == [4]
    p.update(4, 1)                                 # 2 tokens
    p.observe_cycle(1, 5, 23.2)                    # loss 66.8 + 23.2 - 2 x 10 = 70
    assert p._probe_ms == {True: (pytest.approx(70.0), 1)} and p._cold_ms == pytest.approx(36.8)
    assert p._budget_gap(1) == 123                 # a later probe of this process: none measured yet
    assert p.learned()["probe_ms"] == {"1": [pytest.approx(70.0), 1]}
    q = policy()
    assert q.restore(p.learned()) and q._probe_ms == {True: (pytest.approx(70.0), 1)}
    assert q._budget_gap(1) == 700                 # first pass: max(36.8 + 12.249, 70) over 1% of 10 ms
    assert not q.want_draft(1)                     # (one plain cycle first: drafting cycles known, plain not)
    q.update(0, 0)
    q.observe_cycle(1, 1, 10.0)
    q._skipped = 699
    assert q.want_draft(1) and q._probing
    q.observe_draft(1, 60.0, 4)
    q.update(4, 3)                                 # 4 tokens: 60 + 23.2 - 40 = 43.2 (within 2x: no heal)
    q.observe_cycle(1, 5, 23.2)
    assert q._probe_ms[True] == (pytest.approx(70.0 + 0.5 * (43.2 - 70.0)), 2)
    r = policy()
    # q's cold pass read 30 over a warm one: cold 36.8 + 0.3 (30 - 36.8) = 34.76; max(34.76 + 12.249, 56.6)
    assert r.restore(q.learned()) and r._budget_gap(1) == 566   # the measured loss
    # a plain cycle is not a probe; a stalled probe counts at most 3x the running loss
    assert not r.want_draft(1)
    r.update(0, 0)
    r.observe_cycle(1, 1, 10.0)
    assert r._probe_ms[True] == q._probe_ms[True]
    r._skipped = 10 ** 6
    assert r.want_draft(1) and r._probing
    r.observe_draft(1, 1000.0, 4)
    r.update(4, 0)
    r.observe_cycle(1, 5, 23.2)
    assert r._probe_ms[True] == (pytest.approx(56.6 + (3 * 56.6 - 56.6) / 3), 3)
    for bad in ({"2": [1.0, 1]}, {"1": [float("nan"), 1]}, {"1": [1.0, 0]}, {"x": [1.0, 1]}):
        assert not policy().restore({**p.learned(), "probe_ms": bad})


def test_a_pass_is_learned_without_the_rows_it_caught_up():
    p = VerifyPolicy(mode="auto", cost=NEVER, gamma=3)
    p.observe_draft(1, 40.0, caught_ms=10.0)   # a process's first pass, kept whole (cold: its probe pays it)
    p.observe_draft(1, 18.0, caught_ms=10.0)   # 8 ms of drafting: the first cost 32 more
    assert p._cold_ms == 32.0 and p._draft_ms_n == {(1, 3): 8.0} and p._draft_ms == {1: 8.0}
    p.observe_draft(1, 100.0, caught_ms=92.0)  # after a long plain stretch: 8 ms again, no move
    assert p._draft_ms_n == {(1, 3): 8.0} and p.draft_estimate(1) == 8.0
    r = VerifyPolicy(mode="auto", cost=NEVER, gamma=3)
    assert r.restore(p.learned())
    r.observe_draft(1, 70.0, caught_ms=50.0)   # restored: a process's first pass is cold, whole: 70 - 8
    assert r._cold_ms == 32.0 + 0.3 * (62.0 - 32.0) and r.draft_estimate(1) == 8.0


def test_a_drafting_cell_not_run_lately_drifts_halfway_to_its_guess_every_forget_cycles():
    cost = CostModel([10.0, 20.0, 30.0, 40.0], [5.0])
    p = VerifyPolicy(mode="auto", cost=cost, gamma=3)
    for rows, ms in ((1, 10.0), (4, 80.0), (2, 20.0)):
        for _ in range(5):
            p.observe_cycle(1, rows, ms)
    # speed 10 / t(1) = 1; drafting cycles cost 40 and 0 over the curve: excess 20 (a plain mean);
    # the 4-row cell reads 80, its guess is 40 + 20 = 60; the 2-row cell reads 20, its guess 40
    assert p.cost_for(1).t_verify(4) == 80.0 and p.cost_for(1).t_verify(2) == 20.0
    p._cycles = p._cell_at[(1, 4)] + 400
    p._cell_at[(1, 1)] = p._cycles - 1   # plain cycles ran all along
    p.observe_cycle(1, 1, 10.0)   # 64 cycles on: the plan is rebuilt (the plain cell does not move)
    assert abs(p.cost_for(1).t_verify(4) - (80.0 * 60.0) ** 0.5) < 1e-9       # halfway in log
    assert abs(p.cost_for(1).t_verify(2) - (20.0 * 40.0) ** 0.5) < 1e-9       # a cheap read drifts up alike
    assert p.cost_for(1).t_verify(1) == 10.0                                  # the plain cell is kept
    p._cycles += 400
    p._cell_at[(1, 1)] = p._cycles - 1
    p.observe_cycle(1, 1, 10.0)
    assert abs(p.cost_for(1).t_verify(4) - 80.0 ** 0.25 * 60.0 ** 0.75) < 1e-9
    # measured again at 60: the cell steps to 80 e^(-0.2 / 6) = 77.4 and what the plan reads stays 80
    # (a step under 5%), the excess by 2 of 20 (under its step): as measured, 80
    p.observe_cycle(1, 4, 60.0)
    assert p.cost_for(1).t_verify(4) == 80.0
    q = VerifyPolicy(mode="auto", cost=cost, gamma=3, forget_cycles=0)
    for rows, ms in ((1, 10.0), (4, 80.0), (2, 20.0)):
        for _ in range(5):
            q.observe_cycle(1, rows, ms)
    q._cycles = 10 ** 6
    q.observe_cycle(1, 1, 10.0)
    assert q.cost_for(1).t_verify(4) == 80.0


def test_pays_now_follows_the_running_estimates():
    # a 10 ms verify, draft 12 ms: with acceptance 0.9 everywhere drafting pays; after misses it does not
    cost = CostModel([10.0] * 8 + [10.0], [12.0])
    p = VerifyPolicy(mode="auto", cost=cost, learn_costs=False, gamma=4)
    assert p._pays_now(1) and p.want_draft(1) and p._probe_gap == 16
    assert p._pays[1] == (p._version, True)
    for _ in range(40):
        p.update(1, 0)
    assert not p._pays_now(1) and not p.want_draft(1)
    p._pays[1] = (p._version, True)                # cached per version
    # the measured draft pass counts: free in the profile, 1 s measured
    m = VerifyPolicy(mode="auto", cost=CostModel([10.0, 10.0]))
    assert m._pays_now(1)
    m.observe_draft(1, 1000.0)
    assert not m._pays_now(1)
    assert p._pays_now(1)


def test_lengths_static_survival_off():
    off = VerifyPolicy()
    assert off.lengths([None, None], [3, 0]) == [3, 0]
    st = VerifyPolicy(mode="static", conf_min=0.5)
    assert st.lengths([None], [0]) == [0]
    assert st.lengths([np.array([0.9, 0.6, 0.4, 0.9]), None, np.array([0.3])], [4, 0, 1]) == [2, 0, 0]
    assert st.lengths([np.array([0.9, 0.6, 0.9, 0.4])], [3]) == [3]     # only the drafted part counts
    with pytest.raises(ValueError, match="^the static schedule needs a draft with a confidence head$"):
        st.lengths([None], [2])
    sv = VerifyPolicy(mode="survival", p_survival_min=0.25)
    assert sv.lengths([np.array([0.5, 0.5, 0.5])], [3]) == [2]
    with pytest.raises(ValueError, match="^the survival schedule needs a draft with a confidence head$"):
        sv.lengths([None], [1])
    cal = VerifyPolicy(mode="static", conf_min=0.7, temperatures=[2.0])     # 0.8 -> 2/3 < 0.7
    assert cal.lengths([np.array([0.8, 0.9])], [2]) == [0]


def test_lengths_profiled_and_auto():
    cost = CostModel([10, 10, 10, 20, 40, 80])
    pr = VerifyPolicy(mode="profiled", cost=cost, learn_costs=False)
    with pytest.raises(ValueError, match="^the profiled schedule needs a draft with a confidence head$"):
        pr.lengths([None], [2])
    # ratio (0 + 1) / (0 + 1) = 1: survivals 0.9, 0.72, 0.072: 190, 262, then 2.692 / 0.02 < 262
    assert pr.lengths([np.array([0.9, 0.8, 0.1])], [3]) == [2]
    # R = 2 (the second request's anchor row is in the batch): 200, 2.9 / 0.01 = 290, then B = 4 costs 20 ms
    assert pr.lengths([np.array([0.9, 0.8, 0.1]), None], [3, 0]) == [1, 0]
    assert pr.lengths([None], [0]) == [0]
    assert pr.lengths([None, np.array([0.9, 0.8, 0.1])], [0, 3]) == [0, 1]   # R = 2 as above, the other order
    au = VerifyPolicy(mode="auto", cost=cost, learn_costs=False, gamma=2)
    au._acc[:] = [0.9, 0.1]
    # no confidence head: running acceptance 0.9, 0.1, then the last one repeated: survivals 0.9, 0.09, 0.009:
    # 190, 1.99 / 0.01 = 199, then B = 4 (20 ms): 2.0 / 0.02 = 100
    assert au.lengths([None], [3]) == [2]

    au._acc[:] = [0.9, 0.9]
    assert au.lengths([None], [4]) == [2]         # 190, 271, then 3.439 / 0.02 = 172 (B = 4: 20 ms)
    assert au.lengths([None, None], [1, 1]) == [1, 0]   # 2 / 0.01 = 200, 2.9 / 0.01 = 290, 3.8 / 0.02 = 190
    # beyond gamma the last running acceptance repeats: 0.9, 0.8, 0.5, then 0.5 again: survivals 0.9, 0.72,
    # 0.36, 0.18; B = 5 costs 10.805 ms: 3.16 / 0.010805 = 292 < 2.98 / 0.01 = 298 (0.8 repeated would pay)
    g3 = VerifyPolicy(mode="auto", cost=CostModel([10, 10, 10, 10, 10.805]), learn_costs=False, gamma=3)
    g3._acc[:] = [0.9, 0.8, 0.5]
    assert g3.lengths([None], [4]) == [3]
    g3._acc[:] = [0.9, 0.8, 0.8]
    assert g3.lengths([None], [4]) == [4]         # 0.9, 0.72, 0.576, 0.46: 3.657 / 0.010805 = 338 > 319.6
    assert VerifyPolicy(mode="auto", cost=CostModel([10, 10, 10, 10, 10.805]), learn_costs=False,
                        gamma=3).lengths([None], [4]) == [4]   # 0.9 everywhere
    # a probe verifies at least one token of every drafted block
    nv = VerifyPolicy(mode="auto", cost=NEVER, learn_costs=False, probe_every=1, probe_budget=100.0)
    assert nv.lengths([np.array([0.9])], [1]) == [0]
    assert nv.want_draft(1) and nv._probing
    assert nv.lengths([np.array([0.9]), None], [1, 0]) == [1, 0] and not nv._probing
    assert nv.lengths([np.array([0.9])], [1]) == [0]
    # the learned draft cost is part of Theta: t(1) = 10, t(2) = 20; without a draft cost 1.9 / 0.02 = 95 < 100
    le = VerifyPolicy(mode="profiled", cost=CostModel([10.0, 20.0]))
    assert le.lengths([np.array([0.9])], [1]) == [0]
    le.observe_draft(1, 10.0)                     # 1 / 0.02 = 50 < 1.9 / 0.03 = 63
    assert le.lengths([np.array([0.9])], [1]) == [1]
    # two blocks: the R = 2 estimate (scaled from R = 1: 20 ms): 2 / 0.04 = 50, 2.9 / 0.05, 3.8 / 0.06
    assert le.lengths([np.array([0.9]), np.array([0.9])], [1, 1]) == [1, 1]
    le.observe_draft(2, 0.0)                      # measured free at R = 2: 2 / 0.02 = 100 > 2.9 / 0.03, 3.8 / 0.04
    assert le.lengths([np.array([0.9]), np.array([0.9])], [1, 1]) == [0, 0]
    assert le.lengths([np.array([0.9]), None], [1, 0]) == [1, 0]   # one block: the R = 1 estimate (10 ms)


def test_update_and_corrected_by_hand():
    p = VerifyPolicy(mode="auto", cost=FLAT, gamma=3)
    v = p._version
    p.update(3, 1, np.array([0.5, 0.6, 0.7]))
    # k = 0: hit, rate max(0.1, 1/2): 0.9 + 0.5 * 0.1 = 0.95; k = 1: miss: 0.9 - 0.5 * 0.9 = 0.45; k = 2 not tried
    assert p._acc.tolist() == pytest.approx([0.95, 0.45, 0.9])
    assert p._n.tolist() == [1, 1, 0] and p._version == v + 2
    assert p._hit_sum.tolist() == pytest.approx([1.0, 0.0, 0.0]) and p._conf_sum.tolist() == pytest.approx([0.5, 0.6, 0])
    assert (p._cycles, p._verified, p._draft_cycles) == (1, 3, 1)
    # ratios (1 + 1) / (0.5 + 1), 1 / 1.6, 1 / 1
    assert p.corrected(np.array([0.5, 0.5, 0.5, 0.5])) == pytest.approx([2 / 3, 0.3125, 0.5, 0.5])
    assert p.corrected(np.array([0.9])) == pytest.approx([1.0])          # clipped at 1
    p.update(2, 2, np.array([1.0, 1.0]))
    # k = 0: rate max(0.1, 1/3): 0.95 + 0.05 / 3; sums decay by 0.97
    assert p._acc[0] == pytest.approx(0.95 + 0.05 / 3) and p._acc[1] == pytest.approx(0.45 + 0.55 / 3)
    assert p._hit_sum[:2].tolist() == pytest.approx([1.97, 1.0]) and p._conf_sum[:2].tolist() == pytest.approx([1.485, 1.582])
    p.update(0, 0)
    assert (p._cycles, p._verified, p._draft_cycles) == (3, 5, 2)
    # without confidences the sums stay; beyond gamma nothing is counted
    q = VerifyPolicy(mode="auto", cost=FLAT, gamma=2, ema=0.5)
    q.update(5, 5)
    assert q._n.tolist() == [1, 1] and q._hit_sum.tolist() == [0, 0] and q._acc.tolist() == pytest.approx([0.95, 0.95])
    q.update(2, 2, np.array([0.2]))                # fewer confidences than verified drafts: the rest uncounted
    assert q._conf_sum.tolist() == pytest.approx([0.2, 0.0])
    q._conf_sum[:] = 0.0
    q.update(1, 1, np.array([0.2, 0.3]))           # only the verified confidences count
    assert q._conf_sum.tolist() == pytest.approx([0.2, 0.0])
    for _ in range(100):
        q.update(1, 0)
    assert q._acc[0] == ACC_FLOOR
    # ema wins once 1 / (n + 1) is below it
    r = VerifyPolicy(mode="auto", cost=FLAT, gamma=1, ema=0.3)
    for _ in range(3):
        r.update(1, 1)
    r._acc[0] = 0.5
    r.update(1, 0)                                  # rate max(0.3, 1/5) = 0.3
    assert r._acc[0] == pytest.approx(0.35)
    assert VerifyPolicy(mode="static").corrected(np.array([0.5])).tolist() == [0.5]
    assert p.corrected(np.array([])).size == 0
    # calibrated confidences are what the sums see
    s = VerifyPolicy(mode="auto", cost=FLAT, gamma=1, temperatures=[2.0])
    s.update(1, 1, np.array([0.8]))
    assert s._conf_sum[0] == pytest.approx(2 / 3)


def test_summary_lines():
    assert VerifyPolicy().summary([3, 3]) == "schedule off: every drafted token verified (llama.cpp's fixed block)"
    st = VerifyPolicy(mode="static", conf_min=0.5)
    assert st.summary([3, 0, 1]) == "schedule static: verified 1.33 drafts/cycle (2 of 3 cycles verified drafts)"
    assert st.summary([]) == "schedule static: verified 0.00 drafts/cycle (0 of 0 cycles verified drafts)"
    st.update(2, 1)
    st.update(0, 0)
    assert st.summary() == "schedule static: verified 1.00 drafts/cycle (1 of 2 cycles verified drafts)"
    cost = CostModel([10.0] * 7 + [40.0], [5.0])
    au = VerifyPolicy(mode="auto", cost=cost)
    tail = (": on this machine verifying 7 drafts costs 4.0 target steps and a draft pass 0.5, and the draft's "
            "acceptance does not cover it (--schedule off forces the fixed block)")
    assert au.summary([0, 0, 1]) == "schedule auto: verified 0.33 drafts/cycle (1 of 3 cycles verified drafts)" + tail
    assert au.summary([1, 0]) == "schedule auto: verified 0.50 drafts/cycle (1 of 2 cycles verified drafts)"
    assert au.summary([]) == "schedule auto: verified 0.00 drafts/cycle (0 of 0 cycles verified drafts)"
    au.observe_draft(1, 20.0)
    assert au.summary([0]).endswith("costs 4.0 target steps and a draft pass 2.0, and the draft's acceptance does "
                                    "not cover it (--schedule off forces the fixed block)")
    assert st.summary([3]) == "schedule static: verified 3.00 drafts/cycle (1 of 1 cycles verified drafts)"
    c2 = CostModel([10.0, 20.0, 30.0, 40.0], [5.0])
    t2 = VerifyPolicy(mode="auto", cost=c2, gamma=3)
    assert t2.summary([0]).endswith(": on this machine verifying 3 drafts costs 4.0 target steps and a draft pass 0.5, "
                                    "and the draft's acceptance does not cover it (--schedule off forces the fixed block)")
    g = VerifyPolicy(mode="profiled", cost=cost, gamma=3)
    assert "verifying 3 drafts costs 1.0 target steps" in g.summary([0])


class Profile:
    def __init__(self, fixed):
        self.fixed = fixed

    def cost_model(self):
        return FLAT


def test_policy_for():
    assert policy_for("off", has_draft=True, has_confidence=True) is None
    assert policy_for(None, has_draft=False, has_confidence=False) is None
    assert policy_for("auto", has_draft=False, has_confidence=False) is None
    for m in ("static", "survival", "profiled"):
        with pytest.raises(ValueError, match=f"^the {m} schedule needs a draft$"):
            policy_for(m, has_draft=False, has_confidence=True)
        with pytest.raises(ValueError, match=f"^the {m} schedule needs a draft with a confidence head \\(use auto or off\\)$"):
            policy_for(m, has_draft=True, has_confidence=False)
    with pytest.raises(ValueError, match=r"^schedule must be one of \('off', 'static', 'survival', 'profiled', 'auto'\), got 'x'$"):
        policy_for("x", has_draft=True, has_confidence=True)
    with pytest.raises(ValueError, match="^the static schedule needs conf_min$"):
        policy_for("static", has_draft=True, has_confidence=True)
    with pytest.raises(ValueError, match="^the survival schedule needs p_survival_min$"):
        policy_for("survival", has_draft=True, has_confidence=True)
    with pytest.raises(ValueError, match="^the auto schedule needs a cost profile$"):
        policy_for(None, has_draft=True, has_confidence=False)
    with pytest.raises(ValueError, match="^the profiled schedule needs a cost profile$"):
        policy_for("profiled", has_draft=True, has_confidence=True, cost_source=lambda: None)
    p = policy_for(None, has_draft=True, has_confidence=True, conf_min=0.4, p_survival_min=0.2, gamma=5,
                   temperatures=[1.5])
    assert (p.mode, p.conf_min, p.p_survival_min, p.gamma, p.temperatures, p.cost) == ("static", 0.4, 0.2, 5, [1.5], None)
    p = policy_for(None, has_draft=True, has_confidence=True, p_survival_min=0.2)
    assert (p.mode, p.conf_min, p.p_survival_min, p.gamma) == ("survival", 0.0, 0.2, 7)
    calls = []
    p = policy_for(None, has_draft=True, has_confidence=False, cost_source=lambda: calls.append(1) or FLAT)
    assert p.mode == "auto" and p.cost is FLAT and p.learn_costs and calls == [1]
    assert p.conf_min == 0.0 and p.p_survival_min == 0.0
    assert policy_for("static", has_draft=True, has_confidence=True, conf_min=0.5,
                      cost_source=lambda: calls.append(2)).cost is None and calls == [1]
    p = policy_for("auto", has_draft=True, has_confidence=True, cost_source=Profile(True))
    assert p.cost is FLAT and not p.learn_costs
    p = policy_for("profiled", has_draft=True, has_confidence=True, cost_source=Profile(False))
    assert p.cost is FLAT and p.learn_costs and p.mode == "profiled"
    assert policy_for("auto", has_draft=True, has_confidence=True, cost_source=FLAT).learn_costs

    class Unfixed:
        def cost_model(self):
            return FLAT

    p = policy_for("auto", has_draft=True, has_confidence=True, cost_source=Unfixed())
    assert p.cost is FLAT and p.learn_costs


def test_learned_and_restore_by_hand():
    """learned() -> restore() carries every running estimate into a fresh policy; a restored draft
    figure is not replaced by the new process's cold first pass; a state that does not fit is refused."""
    a = VerifyPolicy(mode="auto", cost=NEVER, gamma=3, probe_plan=False)
    a.observe_draft(1, 40.0)
    a.observe_draft(1, 8.0)
    a.update(3, 1)                                 # hit at 0, miss at 1: acc [0.95, 0.45, 0.9]
    st = a.learned()
    assert st["acc"] == pytest.approx([0.95, 0.45, 0.9]) and st["n"] == [1, 1, 0] and st["draft_ms"] == {"1": 8.0}
    b = VerifyPolicy(mode="auto", cost=NEVER, gamma=3, probe_plan=False)
    v = b._version
    assert b.restore(st) and b._version == v + 1
    assert b._acc.tolist() == pytest.approx([0.95, 0.45, 0.9]) and b._n.tolist() == [1, 1, 0]
    assert b.draft_estimate(1) == 8.0
    assert not b.want_draft(1)                     # known not to pay: no pass forced to learn the cost
    b.observe_draft(1, 500.0)                      # this process's cold first pass: ignored
    assert b.draft_estimate(1) == 8.0
    b.observe_draft(1, 18.0)                       # 8 e^(0.2 * 0.2): log(18 / 8) clipped at 0.2
    assert b.draft_estimate(1) == pytest.approx(8.0 * math.exp(0.04))
    for bad in ({**st, "gamma": 4}, {**st, "acc": [0.5, 0.5]}, {**st, "n": [1, float("nan"), 0]},
                {**st, "draft_ms": {"0": 3.0}}, {**st, "draft_ms": {"1": -3.0}}, {"gamma": 3}, {}):
        c = VerifyPolicy(mode="auto", cost=NEVER, gamma=3, probe_plan=False)
        assert not c.restore(bad) and c._acc.tolist() == [0.9] * 3 and c._draft_ms == {}
    # out-of-range values are clamped: acceptance to [ACC_FLOOR, 1], the probe gap to 16 * probe_every
    c = VerifyPolicy(mode="auto", cost=NEVER, gamma=3, probe_plan=False)
    assert c.restore({**st, "acc": [2.0, 0.0, -1.0], "probe_gap": 10 ** 6})
    assert c._acc.tolist() == [1.0, ACC_FLOOR, ACC_FLOOR] and c._probe_gap == 16 * c.probe_every
    # with fixed costs the draft figure is the profile's: not restored
    f = VerifyPolicy(mode="auto", cost=NEVER, gamma=3, learn_costs=False)
    assert f.restore(st) and f._draft_ms == {}
    for bad in ({**st, "cold_ms": -1.0}, {**st, "cold_ms": float("nan")}, {**st, "cold_ms": "x"},
                {**st, "skipped": "many"}):
        assert not VerifyPolicy(mode="auto", cost=NEVER, gamma=3).restore(bad)
    assert c.restore({**st, "skipped": -5}) and c._skipped == 0


def test_a_process_first_probe_pays_its_cold_pass_and_probes_are_spaced_across_processes():
    """`run` is one process per prompt: the plain cycles since the last probe carry over to the next
    process (else every process long enough would probe), and a probe that is a process's first
    pass is charged what a cold pass costs more (graph, pages, the rows deferred since the prompt)."""
    a = VerifyPolicy(mode="auto", cost=NEVER, gamma=3, probe_plan=False)
    a.observe_draft(1, 40.0)                       # cold first pass (no memory) ...
    a.observe_draft(1, 8.0)                        # ... and the warm second one: 32 ms more
    assert a._cold_ms == 32.0
    # NEVER: t(1) = 10, t(2) = 100; probe = draft 8 + 90 = 98 ms over 1% of 10 ms: 980 cycles
    assert a._budget_gap(1) == 980
    st = a.learned()
    assert st["cold_ms"] == 32.0 and st["skipped"] == 0
    b = VerifyPolicy(mode="auto", cost=NEVER, gamma=3, probe_plan=False)
    assert b.restore(st) and b._cold_ms == 32.0
    # its first pass would be cold: ceil((32 + 98) / 0.1) = 1300, capped while the learned draft pass
    # is not measured in this process (a learned figure too dear is measured again within the cap)
    assert b._budget_gap(1) == probes.MAX_PROBE_GAP == 1024
    assert not any(b.want_draft(1) for _ in range(500))
    assert b.learned()["skipped"] == 500
    c = VerifyPolicy(mode="auto", cost=NEVER, gamma=3, probe_plan=False)
    assert c.restore(b.learned()) and c._skipped == 500
    got = [c.want_draft(1) for _ in range(524)]   # 500 + 524 = 1024: the probe is the 524th call
    assert not any(got[:-1]) and got[-1] and c._probing and c._skipped == 0
    c.observe_draft(1, 50.0)                       # c's cold first pass: 42 more than 8
    assert c._cold_ms == pytest.approx(32.0 + 0.3 * 10.0) and c.draft_estimate(1) == 8.0
    assert c._budget_gap(1) == 980                 # warm now: no cold charge


def _theta_by_hand(acc, n, t, draft_full, gamma=7, share=0.05):
    """Tokens per second of drafting a block of n and verifying all of it (the law, written out)."""
    surv = np.cumprod(acc[:n])
    factor = 1.0 if n >= gamma else share + (1 - share) * n / gamma
    return (1 + surv.sum()) / ((t(1 + n) + draft_full * factor) / 1e3)


@pytest.mark.parametrize("acc0, draft_full", [(0.8, 8.0), (0.6, 8.0), (0.95, 2.0), (0.9, 30.0), (0.5, 20.0)])
def test_draft_length_is_the_block_that_pays_most(acc0, draft_full):
    """A memory-bound-like curve t(B) = 10 + (B - 1) ms: each verified row costs 1 ms, so every
    admitted draft pays and the best block trades its acceptance against its pass
    (0.05 fixed + 0.95 per drafted row of the full block's time)."""
    from pyllama_dspark.speculative.policy import DRAFT_FIXED_SHARE

    assert DRAFT_FIXED_SHARE == 0.05
    t = lambda b: 10.0 + (b - 1)   # noqa: E731
    cost = CostModel([t(b) for b in range(1, 33)], [draft_full])
    p = VerifyPolicy(mode="auto", cost=cost, gamma=7, learn_costs=False)
    p._acc, p._n = np.full(7, acc0), np.full(7, 1e12)   # known acceptance: no optimism margin
    thetas = [1 / (t(1) / 1e3)] + [_theta_by_hand(p._acc, n, t, draft_full) for n in range(1, 8)]
    best = int(np.argmax(thetas))
    # drafting must beat plain decoding by 3%; near-ties (0.5%) among blocks go to the longer one
    pays = thetas[best] > 1.03 * thetas[0]
    want = max(n for n in range(8) if thetas[n] >= thetas[best] * 0.995) if pays else 0
    assert p._plan(1, 7)[0] == want
    assert p._pays_now(1) == (want > 0)
    if want:
        assert p.draft_length(1, 7) == want and p.draft_length(1, 3) == min(3, p._plan(1, 3)[0] or 3)
        p._conf_seen = True                      # confidences may cut later: one more draft
        assert p.draft_length(1, 7) == min(7, want + 1)
    p._probing = True
    assert p.draft_length(1, 7) == 7             # a probe drafts the full block
    assert VerifyPolicy().draft_length(4, 5) == 5 and VerifyPolicy(mode="static").draft_length(1, 7) == 7


def test_block_factor_and_short_pass_estimates():
    p = VerifyPolicy(mode="auto", cost=FLAT, gamma=7)
    assert p.block_factor(None) == 1.0 and p.block_factor(7) == 1.0 and p.block_factor(9) == 1.0
    assert p.block_factor(3) == pytest.approx(0.05 + 0.95 * 3 / 7) and p.block_factor(0) == p.block_factor(1)
    p.observe_draft(1, 99.0)
    f3 = 0.05 + 0.95 * 3 / 7
    p.observe_draft(1, 10.0 * f3, 3)             # a 3-draft pass: 10 ms for the full block
    assert p.draft_estimate(1) == pytest.approx(10.0) and p.draft_estimate(1, 3) == pytest.approx(10.0 * f3)


def test_the_plan_is_optimistic_about_what_it_saw_rarely():
    """The plan reads a + 0.5 sqrt(max(a(1-a), 0.05) / (n+1)) per position (the law written out),
    and the verify schedule the running estimate alone."""
    p = VerifyPolicy(mode="auto", cost=FLAT, gamma=3)
    p._acc, p._n = np.array([0.6, 0.99, 0.0]), np.array([3.0, 1.0, 1e12])
    want = [0.6 + 0.5 * np.sqrt(0.24 / 4), 1.0, 0.0 + 0.5 * np.sqrt(0.05 / (1e12 + 1))]
    assert p.hopeful().tolist() == pytest.approx(want, rel=1e-12)


def test_an_untried_position_is_planned_no_higher_than_the_one_before_it():
    """A position never verified (n = 0) is planned at min(its own hope, the planned position
    before it), in order along the block; a verified one at its own hope, above its predecessor
    too; with nothing verified the prior stands (every position 1.0).  And what it changes: a
    drafter seen right at position 1 once in two (0.45, n = 1), later positions never reached,
    no longer plans drafting as paying on a curve where 7 drafts at survival 0.63 would (5.4
    tokens for 4.7 steps) but geometric survival (2.6 tokens at most) does not."""
    p = VerifyPolicy(mode="auto", cost=FLAT, gamma=5)
    h0 = 0.5 + 0.5 * np.sqrt(0.25 / 2)
    p._acc, p._n = np.array([0.5, 0.9, 0.3, 0.9, 0.9]), np.array([1.0, 0.0, 4.0, 0.0, 0.0])
    h2 = 0.3 + 0.5 * np.sqrt(0.21 / 5)
    assert p.hopeful().tolist() == pytest.approx([h0, h0, h2, h2, h2], rel=1e-12)
    p._acc, p._n = np.array([0.5, 0.9, 0.95, 0.9, 0.9]), np.array([1.0, 0.0, 9.0, 0.0, 0.0])
    h2 = min(1.0, 0.95 + 0.5 * np.sqrt(0.05 / 10))
    assert p.hopeful().tolist() == pytest.approx([h0, h0, h2, h2, h2], rel=1e-12)
    assert VerifyPolicy(mode="auto", cost=FLAT, gamma=4).hopeful().tolist() == [1.0] * 4
    # plain step 10 ms, two rows 17 ms, then 5 ms a row (8 rows: 47 ms), the pass free: a block of
    # 7 at survival 0.626 each gives 5.4 tokens / 47 ms > 1 / 10 ms; geometric survival gives at
    # most 1.63 / 17 ms (one draft verified) < 1 / 10 ms
    cost = CostModel([10.0, 17.0] + [17.0 + 5.0 * (k - 2) for k in range(3, 33)], [1e-6])
    q = VerifyPolicy(mode="auto", cost=cost, gamma=7, draft_margin=0.0)
    q._acc, q._n = np.array([0.45] + [0.9] * 6), np.array([1.0] + [0.0] * 6)
    assert q._plan(1, 7)[0] == 0
    q._n[:] = 1.0
    q._acc[:] = [0.45] + [0.999] * 6
    q._version += 1   # (the plan is cached per version of the estimates)
    assert q._plan(1, 7)[0] > 0   # the same first position with later ones seen right: it pays


def test_one_early_rejection_does_not_switch_drafting_off():
    """One draft per block pays when its acceptance a gives (1 + a) / 17 ms > 1 / 10 ms, i.e. a > 0.7
    (plain step 10 ms; two rows 15.7 ms plus a one-draft pass of 1.3 ms; three rows never pay).  A
    drafter right 90% of the time, seen once right then once wrong (running estimate 0.633, plan
    0.633 + 0.139), must keep drafting; one never right stops within five verified cycles."""
    cost = CostModel([10.0, 15.7] + [1000.0] * 30, [1.3 / (0.05 + 0.95 / 7)])
    good = VerifyPolicy(mode="auto", cost=cost, gamma=7, learn_costs=False)
    good.update(1, 1)
    good.update(1, 0)
    assert good._acc[0] == pytest.approx(0.63333, abs=1e-4)
    assert good.want_draft(1) and good._plan(1, 7)[0] >= 1
    bad = VerifyPolicy(mode="auto", cost=cost, gamma=7, learn_costs=False)
    stopped = None
    for i in range(5):
        if not bad.want_draft(1):
            stopped = i
            break
        bad.update(1, 0)
    assert stopped is not None and stopped <= 4, stopped


def test_a_measured_block_size_is_its_own_estimate_and_is_remembered():
    p = VerifyPolicy(mode="auto", cost=FLAT, gamma=7)
    p.observe_draft(1, 99.0)                       # cold placeholder
    p.observe_draft(1, 10.0)                       # full block: 10 ms
    p.observe_draft(1, 6.0, 3)                     # a 3-draft pass measured at 6 ms (not 0.457 x 10)
    assert p.draft_estimate(1, 3) == pytest.approx(6.0)
    f5 = 0.05 + 0.95 * 5 / 7                        # unmeasured sizes: the full-block equivalent, scaled
    full = 10.0 * math.exp(0.2 * 0.2)              # 10 -> 6 / 0.457 = 13.1: log(1.31) clipped at 0.2
    assert p.draft_estimate(1, 5) == pytest.approx(full * f5)
    assert p.draft_estimate(1) == pytest.approx(10.0)   # the measured full block
    p.observe_draft(1, 8.0, 3)                     # 6 e^(0.2 * 0.2): log(8 / 6) clipped at 0.2
    assert p.draft_estimate(1, 3) == pytest.approx(6.0 * math.exp(0.04))
    q = VerifyPolicy(mode="auto", cost=FLAT, gamma=7)
    assert q.restore(p.learned()) and q.draft_estimate(1, 3) == pytest.approx(6.0 * math.exp(0.04))
    for bad in ({"1:0": 1.0}, {"1:8": 1.0}, {"x": 1.0}, {"1:3": -1.0}):
        r = VerifyPolicy(mode="auto", cost=FLAT, gamma=7)
        assert not r.restore({**p.learned(), "draft_ms_n": bad})


def test_cycle_costs_over_the_curve_enter_the_plan_once_both_are_known():
    """A cell never run is guessed from the one-sequence curve at the speed the plain cycles run at
    now (their cost over t(R): a cached profile may be from a slower or faster moment) plus what
    drafting cycles cost over that (accepting, injecting, rolling back); both are used only once
    both kinds of cycle are known (until then, and for moves under 0.5 ms / 5%, the cached plan
    stays valid).  t(B) = 10 + (B - 1) ms, a full pass of 8 ms, acceptance 0.8 (the law written
    out): plain cycles at 1.3 t(1), so every row count at 1.3 t(B); with 20 ms more per drafting
    cycle drafting pays (it would not, were the curve read at its own speed) and not at 40 ms."""
    t = lambda b: 10.0 + (b - 1)   # noqa: E731
    cost = CostModel([t(b) for b in range(1, 33)], [8.0])

    def policy(e_draft):
        p = VerifyPolicy(mode="auto", cost=cost, gamma=7)
        p._acc, p._n = np.full(7, 0.8), np.full(7, 1e12)
        p.observe_draft(1, 8.0)
        p.observe_draft(1, 8.0)
        p.observe_cycle(1, 1, 1.3 * t(1))
        assert p.extra_estimate(1) == (0.0, 0.0) and p._plan(1, 7)[0] > 0   # drafting cycles not seen yet
        p.observe_cycle(1, 8, 1.3 * t(8) + e_draft)
        assert p.extra_estimate(1) == pytest.approx((0.0, e_draft))
        assert p.cost_for(1).t_verify(5) == pytest.approx(1.3 * t(5) + e_draft)
        return p

    def best(e_draft, speed=1.3):
        def theta(n):
            if n == 0:
                return 1 / (speed * t(1) / 1e3)
            factor = 1.0 if n >= 7 else 0.05 + 0.95 * n / 7
            return (1 + np.cumprod(np.full(n, 0.8)).sum()) / ((speed * t(1 + n) + 8.0 * factor + e_draft) / 1e3)
        th = [theta(n) for n in range(8)]
        return int(np.argmax(th)) if max(th[1:]) > 1.03 * th[0] else 0   # (the 3% draft margin)

    assert best(20.0) == 7 and best(20.0, speed=1.0) == 0 and best(40.0) == 0 and best(0.0) > 0
    p = policy(20.0)
    assert p._plan(1, 7)[0] == best(20.0) and p._pays_now(1)
    q = policy(40.0)
    assert q._plan(1, 7)[0] == 0 and not q._pays_now(1)
    # the plan follows a moving estimate in steps, not on every cycle
    v = p._version
    p.observe_cycle(1, 1, 1.3 * t(1) + 0.4)        # the median of 13 and 13.4: within 0.5 ms of 13
    assert p._version == v and p.extra_estimate(1) == pytest.approx((0.0, 20.0))
    r = VerifyPolicy(mode="auto", cost=cost, gamma=7)
    w = r._version
    for ms in (1.0, 9.0, 1.0, 9.0):               # plain cycles only: the plan does not read them yet
        r.observe_cycle(2, 2, t(2) + ms)
    assert r._version == w
    for _ in range(30):
        p.observe_cycle(1, 1, 1.6 * t(1))           # the machine slows down: every guess with it
    assert p._version > v and p.cost_for(1).t_verify(5) == pytest.approx(1.6 * t(5) + 20.0)


def test_a_cycle_of_r_sequences_costs_what_its_rows_cost_when_run():
    """The one-sequence curve says R = 4 blocks of 7 (32 rows) cost t(32) = 25.5 ms
    (t(b) = 10 + (b - 1) / 2); measured, such a cycle costs 60 ms (per-sequence work) while 4 blocks
    of 2 (12 rows) cost t(12) + 1.  The plain cycle (4 rows) costs t(4) + 1: the curve's speed now
    is s = 12.5 / 11.5.  The plan reads the measured rows and, for rows not run, s t(rows) plus what
    drafting cycles cost over that (their running mean: the mean of the six, 15.97).  The law by
    hand, acceptance 0.8, every draft verified, a full pass 8 ms (a block of n:
    8 (0.05 + 0.95 n / 7)): 4 (1 + sum 0.8^j) / (c(4 (n + 1)) + pass(n)) is best at n = 2 (0.51
    tokens/ms against 0.24 at n = 7); reading the guesses instead, n = 5 would win (0.33)."""
    t = lambda b: 10.0 + (b - 1) / 2   # noqa: E731
    cost = CostModel([t(b) for b in range(1, 33)], [8.0])
    p = VerifyPolicy(mode="auto", cost=cost, gamma=7)
    p._acc, p._n = np.full(7, 0.8), np.full(7, 1e12)
    p.observe_draft(4, 8.0)
    p.observe_draft(4, 8.0)
    p.observe_cycle(4, 4, t(4) + 1.0)
    assert p.cost_for(4) is cost                     # drafting cycles not seen yet: the profile's curve
    for rows, ms in ((12, t(12) + 1.0), (32, 60.0)):
        for _ in range(3):                           # (a cell measured fewer times is read optimistically)
            p.observe_cycle(4, rows, ms)
    c4 = p.cost_for(4)
    assert c4.t_verify(4) == pytest.approx(t(4) + 1) and c4.t_verify(12) == pytest.approx(t(12) + 1)
    assert c4.t_verify(32) == pytest.approx(60.0)
    s = (t(4) + 1) / t(4)
    xd = ((t(12) + 1 - s * t(12)) + (60.0 - s * t(32))) / 2
    assert c4.t_verify(20) == pytest.approx(s * t(20) + xd) and c4.t_verify(2) == pytest.approx(s * t(2))
    assert p.cost_for(1) is cost                     # R = 1 has measured nothing

    def best(c):
        def theta(n):
            if n == 0:
                return 4 / (c(4) / 1e3)
            factor = 1.0 if n >= 7 else 0.05 + 0.95 * n / 7
            return 4 * (1 + np.cumprod(np.full(n, 0.8)).sum()) / ((c(4 * (n + 1)) + 8.0 * factor) / 1e3)
        return int(np.argmax([theta(n) for n in range(8)]))

    measured = {4: t(4) + 1, 12: t(12) + 1, 32: 60.0}
    assert best(lambda k: measured.get(k, s * t(k) + xd)) == 2 and best(lambda k: s * t(k) + (0 if k == 4 else xd)) == 5
    p.explore_band = 0.0                             # (no other block tried: see the exploring test)
    assert p._plan(4, 7)[0] == 2 and p.draft_length(4, 7) == 2
    # a stall is not what the rows cost: one sample counts at most 3x the estimate (the cell is the
    # median of its first cycles: 12.5 and 37.5)
    p.observe_cycle(4, 4, 1000.0)
    assert p._cycle_ms[(4, 4)][0] == pytest.approx((12.5 + 3 * 12.5) / 2)


def test_one_plain_cycle_is_run_when_only_drafting_cycles_were_measured():
    """The plan reads measured cycle costs only once plain and drafting cycles of R are both known;
    where drafting pays from the start no plain cycle would ever be run, and the measured drafting
    costs would never count.  So after a drafting cycle of R sequences, one plain cycle is run."""
    t = lambda b: 10.0 + (b - 1) / 2   # noqa: E731
    p = VerifyPolicy(mode="auto", cost=CostModel([t(b) for b in range(1, 33)], [1.0]), gamma=7)
    p._acc, p._n = np.full(7, 0.95), np.full(7, 1e12)
    assert p.want_draft(4)                          # the first two passes learn the draft's cost
    p.observe_draft(4, 1.0)
    p.observe_draft(4, 1.0)
    assert p.want_draft(4)                          # pays: 4 * 6.7 tokens in 26.5 ms vs 4 in 11.5
    p.observe_cycle(4, 32, 40.0)
    assert p.cost_for(4) is p.cost and not p.want_draft(4) and not p._probing
    assert p.want_draft(1)                          # R = 1 measured no drafting cycle yet
    p.observe_cycle(4, 4, t(4) + 1.0)
    assert p.want_draft(4) and p.cost_for(4).t_verify(32) == pytest.approx(40.0)
    p.observe_cycle(4, 32, 40.0)
    assert p.want_draft(4)                          # known now: no more plain cycles forced


def test_a_slow_start_of_plain_cycles_is_forgotten_at_once():
    """A cell's first five cycles give its median, then a running median-like estimate (an EMA of
    log ms at rate max(0.1, 1 / (n + 1)), each move clipped at 0.2): a process's slow first plain
    cycle (30 ms, then nine of 10) is forgotten at once, 10; drafting cycles (60, then nine of 40)
    read 40, where their mean would be 42 (their excess over the curve, at the plain cycles' speed
    10 / t(1) = 1, keeps the running mean: 42 - t(8)); a rise to 20 ms moves the plain cell by
    e^(0.1 * 0.2), not by 0.1 * 10 ms."""
    t = lambda b: 10.0 + (b - 1)   # noqa: E731
    p = VerifyPolicy(mode="auto", cost=CostModel([t(b) for b in range(1, 33)], [8.0]), gamma=7)
    for ms in [30.0] + [10.0] * 9:
        p.observe_cycle(1, 1, ms)
    for ms in [60.0] + [40.0] * 9:
        p.observe_cycle(1, 8, ms)
    assert p._cycle_ms[(1, 1)][0] == pytest.approx(10.0)
    assert p._cycle_ms[(1, 8)][0] == pytest.approx(40.0)
    assert p._extra_ms[(1, True)][0] == pytest.approx(42.0 - t(8))
    p.observe_cycle(1, 1, 20.0)
    assert p._cycle_ms[(1, 1)][0] == pytest.approx(10.0 * math.exp(0.1 * 0.2))


def test_a_plain_plan_is_held_while_only_cycle_costs_move():
    """REPLAN_PLAIN_CYCLES: while plain decoding wins, cycle costs that move re-plan at most once in
    32 cycles; what the drafts are worth (an acceptance update with a verified draft) re-plans at once."""
    from pyllama_dspark.speculative.policy import REPLAN_PLAIN_CYCLES

    assert REPLAN_PLAIN_CYCLES == 32
    p = VerifyPolicy(mode="auto", cost=NEVER, gamma=3, probe_every=0)
    p.observe_draft(1, 50.0)
    p.observe_draft(1, 50.0)
    p.observe_cycle(1, 2, 100.0)       # a drafting cycle measured, then plain ones: both kinds known
    plans = []
    orig = p._plan
    p._plan = lambda r, n: plans.append(p._cycles) or orig(r, n)
    for i in range(100):
        assert not p.want_draft(1)
        p.update(0, 0)
        p.observe_cycle(1, 1, 10.0 if (i // 3) % 2 else 16.0)   # a plain cell that keeps moving
    assert p._cost_bumps >= 8                            # the costs moved ...
    assert 3 <= len(plans) <= 5                          # ... yet it re-planned every 32 cycles
    assert all(b - a >= REPLAN_PLAIN_CYCLES for a, b in zip(plans, plans[1:]))
    n = len(plans)
    p.update(1, 0)                                       # a verified draft: learned something
    assert not p.want_draft(1) and len(plans) == n + 1   # re-planned at once
    # the probe spacing alike: recomputed at most every 32 cycles while only cycle costs move
    gaps = []
    import pyllama_dspark.speculative.probes as probes
    orig_block = probes.probe_block
    probes.probe_block = lambda *a: gaps.append(p._cycles) or orig_block(*a)
    try:
        for i in range(100):
            p._budget_gap(1)
            p.update(0, 0)
            p.observe_cycle(1, 1, 10.0 if (i // 3) % 2 else 16.0)
    finally:
        probes.probe_block = orig_block
    assert 3 <= len(gaps) <= 5 and all(b - a >= REPLAN_PLAIN_CYCLES for a, b in zip(gaps, gaps[1:]))
