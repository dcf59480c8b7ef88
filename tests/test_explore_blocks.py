"""auto tries the blocks it plans near its best until their cycles are measured (EXPLORE_BAND), and
keeps what it measured across processes.  The laws are written out by hand: R = 4 sequences,
acceptance 0.8 at every position (known), a full draft pass of 8 ms (a block of n:
8 (0.05 + 0.95 n / 7)), the one-sequence curve t(b) = 10 + (b - 1) / 4 ms, a plain cycle t(4) (the
machine at the curve's speed) and a drafting cycle measured at t(32) + 6, so every block's cycle is
guessed at t(4 (n + 1)) + 6."""

from __future__ import annotations

import numpy as np
import pytest

from pyllama_dspark.speculative.policy import EXPLORE_BAND, EXPLORE_SAMPLES, VerifyPolicy
from pyllama_dspark.speculative.schedule import CostModel


def t(b):
    return 10.0 + (b - 1) / 4


def theta(n, cycle):
    """Tokens per second of R = 4 blocks of n, every draft verified."""
    if n == 0:
        return 4 / (t(4) / 1e3)
    factor = 1.0 if n >= 7 else 0.05 + 0.95 * n / 7
    return 4 * (1 + np.cumprod(np.full(n, 0.8)).sum()) / ((cycle(4 * (n + 1)) + 8.0 * factor) / 1e3)


def guessed(k):
    return t(k) + 6.0


def policy(**kw):
    p = VerifyPolicy(mode="auto", cost=CostModel([t(b) for b in range(1, 33)], [8.0]), gamma=7, **kw)
    p._acc, p._n = np.full(7, 0.8), np.full(7, 1e12)
    p.observe_draft(4, 8.0)
    p.observe_draft(4, 8.0)
    p.observe_cycle(4, 4, t(4))
    return p


def run(p, cycle, n_cycles=25):
    """The blocks auto drafts over n_cycles, each cycle costing cycle(rows)."""
    seq = []
    for _ in range(n_cycles):
        n = p.draft_length(4, 7)
        seq.append(n)
        p.observe_cycle(4, 4 * (n + 1), cycle(4 * (n + 1)))
    return seq


def test_blocks_within_the_band_are_tried_most_promising_first_until_measured():
    """By hand: theta(5) = 535.1 is the top and theta(6) = 532.8 ties it within 0.5%, so the plan is
    6 (near-ties go to the longer block); the band keeps theta >= 0.85 * 535.1: blocks 5, 4, 7, 3,
    2 in that order (block 1, 374, is out).  Each is drafted until its cycle has EXPLORE_SAMPLES = 3
    measurements (block 7's 32 rows have one already), then the plan's 6 for good.  The cycles
    cost what was guessed, so the plan does not move."""
    assert (EXPLORE_BAND, EXPLORE_SAMPLES) == (0.15, 3)
    th = {n: theta(n, guessed) for n in range(1, 8)}
    top = max(th.values())
    assert max(th, key=th.get) == 5 and th[6] >= 0.995 * top
    band = sorted((n for n in th if n != 6 and th[n] >= 0.85 * top), key=lambda n: -th[n])
    assert band == [5, 4, 7, 3, 2] and th[1] < 0.85 * top
    want = [n for n in band for _ in range(2 if n == 7 else 3)]
    p = policy()
    assert p.draft_length(4, 7) == p._plan(4, 7)[0]   # no drafting cycle measured: the curve for all
    p.observe_cycle(4, 32, guessed(32))
    got = run(p, guessed)
    assert got == want + [6] * (25 - len(want))
    assert p._plan(4, 7)[0] == 6 and all(p._cycle_ms[(4, 4 * (n + 1))][1] >= 3 for n in band)


def test_a_block_the_curve_overprices_is_found_and_kept():
    """The same, but 16 rows (blocks of 3) really cost t(16) - 5: by hand theta(3) = 951.7, the best
    by far.  After block 3's first measured cycle the plan is 3; blocks whose schedule verifies the
    same 16 rows (4 and up, now cut to 3 drafts each) are not tried for it, and nothing else is in
    the band any more: 3 from then on."""
    true = lambda k: t(k) - 5.0 if k == 16 else guessed(k)   # noqa: E731
    th = {n: theta(n, true) for n in range(1, 8)}
    assert max(th, key=th.get) == 3 and sorted(th.values())[-2] < 0.85 * th[3]
    p = policy()
    p.observe_cycle(4, 32, guessed(32))
    got = run(p, true)
    assert got[:9] == [5, 5, 5, 4, 4, 4, 7, 7, 3] and got[9:] == [3] * 16
    assert p._plan(4, 7)[0] == 3


def test_a_cell_read_slow_once_is_measured_again_and_its_median_kept():
    """Blocks of 6 (28 rows) are run 20 times without trying others, then one cycle of 24 rows (R
    = 4 blocks of 5) reads 2x its cost (the OS took the core).  Measured once, that cell is planned
    at the lower of its reading and the curve's guess, so block 5 stays in the band as a full
    block, is verified in full (24 rows, the schedule's own lengths) until its cell has three
    cycles, and the cell is their median, guessed(24).  Planned at its slow reading instead, the
    schedule would cut block 5 to 23 rows and the cell would keep 43.5 for good."""
    p = policy()
    p.observe_cycle(4, 32, guessed(32))
    p.explore_band = 0.0
    assert {n for n, _ in run_verified(p, guessed, 20)} == {6}
    p.observe_cycle(4, 24, 2 * guessed(24))
    p.explore_band = EXPLORE_BAND
    got = run_verified(p, guessed, 40)
    assert got.count((5, 24)) == 2 and (5, 23) not in got
    assert p._cycle_ms[(4, 24)] == (pytest.approx(guessed(24)), 3)
    assert p.cost_for(4).t_verify(24) == pytest.approx(guessed(24)) and got[-5:] == [(6, 28)] * 5
    # a cell dearer than its guess is planned at the guess until its third cycle, then as measured
    q = policy()
    q.observe_cycle(4, 32, guessed(32))
    q.explore_band = 0.0
    run_verified(q, guessed, 20)
    for i in range(3):
        q.observe_cycle(4, 24, 1.15 * guessed(24))
        guess = t(24) + q.extra_estimate(4)[1]   # the drafting excess, moved a little by these cycles
        assert guess < 1.15 * guessed(24)
        assert q.cost_for(4).t_verify(24) == pytest.approx(guess if i < 2 else 1.15 * guessed(24))


def run_verified(p, cycle, n_cycles):
    """(block, rows verified) per cycle, the rows from the policy's own verify lengths."""
    seq = []
    for _ in range(n_cycles):
        n = p.draft_length(4, 7)
        rows = sum(ell + 1 for ell in p.lengths([None] * 4, [n] * 4))
        seq.append((n, rows))
        p.observe_cycle(4, rows, cycle(rows))
    return seq


def test_no_band_no_trying_and_bad_bands_refused():
    p = policy(explore_band=0.0)
    p.observe_cycle(4, 32, guessed(32))
    assert run(p, guessed, 10) == [6] * 10
    for bad in (-0.1, 1.0, 2.0):
        with pytest.raises(ValueError, match="explore_band"):
            VerifyPolicy(mode="auto", cost=CostModel([1.0]), explore_band=bad)


def test_measured_cycles_are_kept_across_processes():
    """learned() -> restore() carries the cycle costs (per (R, rows) and over the curve, with their
    sample counts capped at 10), so the next process plans on them at once and tries no block
    again; a state whose cycle entries do not fit is refused whole."""
    def fresh():
        return VerifyPolicy(mode="auto", cost=CostModel([t(k) for k in range(1, 33)], [8.0]), gamma=7)
    true = lambda k: t(k) - 5.0 if k == 16 else guessed(k)   # noqa: E731
    a = policy()
    a.observe_cycle(4, 32, guessed(32))
    run(a, true)
    st = a.learned()
    assert st["cycle_ms"]["4:16"] == [pytest.approx(true(16)), 17] and st["extra_ms"]["4:0"] == [0.0, 1]
    b = fresh()
    assert b.restore(st)
    assert b._cycle_ms[(4, 16)] == (pytest.approx(true(16)), 10) and b._cycle_ms[(4, 24)][1] == 3
    assert b.cost_for(4).t_verify(16) == pytest.approx(true(16)) and b._plan(4, 7)[0] == 3
    # the blocks tried in one process are not tried again in the next
    e = policy()
    e.observe_cycle(4, 32, guessed(32))
    run(e, guessed)
    f = fresh()
    assert f.restore(e.learned()) and run(f, guessed) == [6] * 25
    for bad in ({"4:16": [1.0]}, {"4:16": [1.0, 0]}, {"4:3": [1.0, 2]}, {"0:1": [1.0, 2]}, {"4:16": [-1.0, 2]},
                {"4:16": [float("nan"), 2]}, {"4": [1.0, 2]}, {"4:x": [1.0, 2]}):
        c = fresh()
        assert not c.restore({**st, "cycle_ms": bad}) and c._cycle_ms == {} and c._acc.tolist() == [0.9] * 7
    assert not fresh().restore({**st, "extra_ms": {"4:2": [1.0, 1]}})
    # a memory written before cycle costs were kept still restores (nothing measured: the curve)
    old = {k: v for k, v in st.items() if k not in ("cycle_ms", "extra_ms")}
    d = fresh()
    assert d.restore(old) and d.cost_for(4) is d.cost
