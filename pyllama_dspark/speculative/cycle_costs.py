"""What a verify cycle of R sequences costs, as measured: the running estimates behind
:meth:`VerifyPolicy.observe_cycle` and :meth:`VerifyPolicy.cost_for` (the policy's fields, read and
written here so the statistics sit in one place).

A cycle cost is kept per (R, rows) as measured, and apart from that, per (R, drafting?), what
cycles cost over the one-sequence curve (the guess for the row counts never run).  On a 2-core CPU
a single cycle reads 0.8-1.45x of its cell's typical cost, so:

* a cell's estimate over its first MEDIAN_SAMPLES samples is their median (one cycle caught by
  the OS is not what the rows cost; a process's slow first plain cycle neither);
* a drafting cell measured fewer than EXPLORE_SAMPLES times is planned at the lower of its
  measurement and the curve's guess: a cell read once at a bad moment would otherwise fall out of
  the band of blocks auto tries (policy.EXPLORE_BAND) and stay wrong for good;
* after them, a running median-like estimate (:func:`log_step`), not a mean: a stall or a lucky
  cycle moves it by at most CLIP in log;
* a cell never run is guessed from the curve at the speed the plain cells measure now
  (:func:`curve_speed`) plus what drafting cycles cost over that;
* a drafting cell not measured lately is planned between its measurement and that guess
  (``forget_cycles``): a cell read high at a bad moment is not run again, so nothing else would
  revise it (on the 1.7B, a 4-row cell read 111 ms in three cycles where it runs in 64-72 kept
  auto off the block of 3 for a whole run).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from pyllama_dspark.speculative import heal

#: a cell's estimate is the median of its first this many cycles
MEDIAN_SAMPLES = 5
#: a drafting cell is planned optimistically until measured this many times (policy.EXPLORE_BAND's
#: blocks are tried until their cells are)
EXPLORE_SAMPLES = 3
#: one cycle counts at most this many times its cell's estimate (a stall is not what the rows cost)
STALL_CAP = 3.0
#: a cycle moves its cell's running cost by at most this much in log (a stall is not what rows cost)
CLIP = 0.2


def running_mean(old: Optional[float], seen: int, x: float, plain: bool) -> float:
    """A running mean (an EMA of rate 0.1 after ten samples) of what cycles cost over the curve at
    :func:`curve_speed` (which may be negative, hence not :func:`log_step`); a plain cycle's
    excess follows a drop at once (rate 0.5)."""
    if old is None:
        return x
    rate = max(0.1, 1.0 / (seen + 1))
    if plain and x < old:
        rate = max(rate, 0.5)
    return old + rate * (x - old)


def log_step(old: float, x: float, rate: float) -> float:
    """One step of a running median-like estimate: an EMA of log(ms) at ``rate``, each sample's
    move clipped to CLIP, so that a stall or a lucky cycle does not drag it (a running mean sits
    above the median of a cost with stalls; the plain cell's old fast drops sat below it: by 5-10%
    against drafting in a simulation, ``bench/policy_sim.py``)."""
    if old <= 0:
        return x
    return old * math.exp(rate * min(CLIP, max(-CLIP, math.log(max(x, 1e-9) / old))))


def running_cost(old: Optional[float], seen: int, x: float) -> float:
    """A cell's running cost: :func:`log_step` at rate max(0.1, 1 / (seen + 1))."""
    return x if old is None else log_step(old, x, max(0.1, 1.0 / (seen + 1)))


def step(used: dict, key, new: float) -> bool:
    """What the plan reads follows a measured estimate in steps (0.5 ms or 5%), not on every
    cycle: the plan is recomputed only when an input moved."""
    cur = used.get(key)
    if cur is None or abs(new - cur) > max(0.5, 0.05 * abs(cur)):
        used[key] = new
        return True
    return False


def observe(p, n_requests: int, n_rows: int, ms: float) -> None:
    """Policy ``p`` saw a cycle of ``n_requests`` sequences and ``n_rows`` rows take ``ms``."""
    moved = False
    plain = n_rows == n_requests
    cell = (n_requests, n_rows)
    old, seen = p._cycle_ms.get(cell, (None, 0))
    measured = ms
    if old is not None:
        ms = min(ms, STALL_CAP * old)
    raw = p._cycle_raw.setdefault(cell, [])
    if len(raw) == seen < MEDIAN_SAMPLES:   # (a restored cell has no raw samples)
        raw.append(ms)
        mean = float(np.median(raw))
    else:
        mean = running_cost(old, seen, ms)
    p._cycle_ms[cell] = (mean, seen + 1)
    moved |= p.forget_cycles > 0 and p._cycles - p._cell_at.get(cell, p._cycles) >= 64   # it had drifted
    p._cell_at[cell] = p._cycles
    if p.forget_cycles > 0 and p._cycles - p._cell_at.get("replanned", 0) >= 64:
        p._cell_at["replanned"] = p._cycles   # the cells not run drift toward their guess: replan now and then
        moved = True
    moved |= step(p._cycle_used, cell, mean) or (not plain and seen + 1 == EXPLORE_SAMPLES)
    key = (n_requests, not plain)
    old, seen = p._extra_ms.get(key, (None, 0))
    new = p._extra_ms[key] = (running_mean(old, seen, ms - curve_speed(p, n_requests) * p.cost.t_verify(n_rows), plain),
                              seen + 1)
    moved |= step(p._extra_used, key, new[0])
    # the plan reads them only once both kinds of cycle are known for R (before that, one
    # without the other would tilt the comparison by the difference it cannot see)
    if moved:
        p._cost_version += 1
        if p.extra_estimate(n_requests) != (0.0, 0.0):
            p._version += 1
            p._cost_bumps += 1
    heal.cycle(p, cell, measured)


def curve_speed(p, r: int) -> float:
    """How fast the machine runs now against the moment the curve was profiled: the plain cycle of
    R sequences as measured over the curve's t(R); 1 until one was measured.  A cached profile read
    in a slower phase (30% on this Xeon a day later) would otherwise make every guessed cell too
    cheap by the difference, the small ones most (an added excess, measured on long blocks, is
    most of a short block's cost)."""
    got = p._cycle_ms.get((r, r))
    return got[0] / max(p.cost.t_verify(r), 1e-9) if got else 1.0


def planned_cycles(p, r: int, top: int, plain: float, draft: float) -> list:
    """The plan's cycle ms of R = ``r`` sequences for 1..``top`` rows: as measured where run, else
    the curve at :func:`curve_speed` plus the measured excess (``plain`` / ``draft``); a drafting cell measured fewer
    than EXPLORE_SAMPLES times at the lower of the two, one not measured lately in between."""
    c = p.cost
    speed = curve_speed(p, r)
    out = []
    for k in range(1, top + 1):
        guess = max(1e-3, speed * c.t_verify(k) + (draft if k > r else plain))
        got = p._cycle_used.get((r, k))
        if got is None:
            out.append(guess)
        elif k > r and p._cycle_ms.get((r, k), (None, 0))[1] < EXPLORE_SAMPLES:
            out.append(min(got, guess))
        elif k > r and p.forget_cycles > 0:
            # halfway (in log) to the guess every forget_cycles cycles since it was last measured
            w = 0.5 ** (max(0, p._cycles - p._cell_at.get((r, k), 0)) / p.forget_cycles)
            out.append(max(got, 1e-3) ** w * guess ** (1.0 - w))
        else:
            out.append(got)
    return out
