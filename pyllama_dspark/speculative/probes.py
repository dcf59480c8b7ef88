"""When the automatic schedule probes, and what a probe costs: the probe parts of
:class:`~.policy.VerifyPolicy` (the policy's fields, read and written here, as :mod:`.cycle_costs`
does for the cycle costs).

While drafting does not pay, auto decodes plain and drafts now and then (a probe) to keep its
estimates alive.  A probe is one cycle of the drafting block of fewest planned ms a token, all of it
verified (:func:`probe_block`); probes are spaced so that what they lose against plain decoding stays
within ``probe_budget`` of the plain decoding time (:func:`budget_gap`).

What a probe loses is planned (the block's planned cycle over what plain decoding makes of the
same time, plus a cold pass's extra when it is a process's first) and **measured**: its draft pass,
the rows deferred since the last pass included, and its verify cycle, less what plain decoding
would have taken for the tokens it emitted (:func:`ended`).  A probe in a fresh process of ``run``
on SmolLM2 (the shipped drafter, T = 0) was planned at 9 ms and lost 15-27: the catch-up of every
row since the prompt, the draft context's first decode and the target's first decode of that many
rows in the process (18 ms for 3 rows against 15 on the curve).  Spaced on the plan, those probes
came every ~150 cycles and cost ~2.5% of a 96-token run instead of 1%.  The spacing now reads the
larger of the two, apart for a process's first pass (cold) and later ones.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from pyllama_dspark.speculative import heal
from pyllama_dspark.speculative.schedule import survival

#: while only cycle costs move, the gap is recomputed at most once in this many cycles (as a plain
#: plan: policy.REPLAN_PLAIN_CYCLES)
REPLAN_PLAIN_CYCLES = 32
#: a probe's measured loss is a running mean at this rate (a probe is rare: few samples)
RATE = 0.3
#: one probe counts at most this many times the running loss (a stall is not what a probe costs)
STALL_CAP = 3.0
#: while a draft pass or a probe loss learned by an earlier process is not measured in this one,
#: probes come at least every this many plain cycles, whatever the budget says: a learned cost too
#: dear for drafting to ever be planned is measured again within that many cycles (.heal).  Above
#: the budget's own gap for a drafter that does not pay (~470 cycles for the random SmolLM2 draft):
#: it bounds a poisoned figure, it does not add probes where the figures are right
MAX_PROBE_GAP = 1024


def probe_block(p, n_requests: int, n_max: int):
    """(block, ms it is planned to lose against plain decoding) of a probe: the drafting block of
    fewest planned ms a token, all of it verified; None (the full block, one token verified) with
    ``probe_plan`` off or the draft pass not measured yet.  Drafting stops when the estimates read
    low, and only probes revise them: the full-block probe cost 3-4 plain cycles on a 1.7B target,
    came every ~300 cycles and never revised the block that would pay (with the oracle at 0.3,
    auto froze on plain decoding at 0.93x of the block of 3, its first position read 0.75 for 0.9);
    a block near break-even loses little, so it is revised often."""
    if not p.probe_plan or p.draft_estimate(n_requests) is None:
        return None
    r, n_max = max(1, n_requests), max(1, min(int(n_max), p.gamma))
    c = p.cost_for(r)
    surv = survival(p.hopeful()[:n_max])
    plain = plain_ms_per_token(p, r)
    best = None
    for n in range(1, n_max + 1):
        tokens = r * (1.0 + float(surv[:n].sum()))
        ms = p.draft_estimate(r, n) + c.t_verify(r * (n + 1)) + c.overhead_ms
        if best is None or ms / tokens < best[2]:
            best = (n, max(0.0, ms - tokens * plain), ms / tokens)
    return best[:2]


def plain_ms_per_token(p, r: int) -> float:
    """What plain decoding of R sequences costs a token, as the plan reads it."""
    c = p.cost_for(r)
    return (c.t_verify(r) + c.overhead_ms) / r


def budget_gap(p, n_requests: int) -> int:
    """Plain cycles between probes for the probes to cost <= probe_budget of the decoding time:
    the larger of the planned and the measured loss of a probe of this kind (a process's first
    pass or a later one), recomputed only when an input changed."""
    r = max(1, n_requests)
    first = p._draft_passes == 0   # a process's first pass also pays what a cold pass costs more
    cold = (p._cold_ms or 0.0) if first else 0.0
    hit = p._gaps.get(r)
    if hit is not None and hit[0] == (p._version, cold, first):
        return hit[1]
    learned = (p._version - p._cost_bumps, cold, first)
    if hit is not None and hit[2] == learned and p._cycles - hit[3] < REPLAN_PLAIN_CYCLES:
        return hit[1]   # only a cycle cost moved, and lately (as policy._pays_now)
    c = p.cost_for(r)
    draft = p.draft_estimate(r)
    planned = probe_block(p, r, p.gamma)
    probe = cold + (planned[1] if planned is not None else
                    (c.t_draft(r) if draft is None else draft) + c.t_verify(2 * r) - c.t_verify(r))
    got = p._probe_ms.get(first)
    if got is not None:
        probe = max(probe, got[0])
    gap = int(np.ceil(max(0.0, probe) / (max(p.probe_budget, 1e-6) * max(c.t_verify(r), 1e-6))))
    if (p._restored_draft and p._draft_passes == 0) or first in p._heal_probe:
        gap = min(gap, MAX_PROBE_GAP)   # a learned figure not measured here yet (.heal)
    p._gaps[r] = ((p._version, cold, first), gap, learned, p._cycles)
    return gap


# ---- a probe's measured loss: want_draft -> observe_draft -> update (per request) -> observe_cycle ----
def begin(p) -> None:
    """This cycle is a probe (want_draft said so): start adding up what it costs and makes."""
    p._probe_now = [p._draft_passes == 0, 0.0, 0]


def drafted(p, ms: float) -> None:
    """The probe's draft pass took ``ms``, whole (the rows it caught up and a cold start included)."""
    if p._probe_now is not None:
        p._probe_now[1] += ms


def accepted(p, n_accepted: int) -> None:
    """One request of the probe emitted ``n_accepted + 1`` tokens."""
    if p._probe_now is not None:
        p._probe_now[2] += n_accepted + 1


def ended(p, n_requests: int, cycle_ms: float) -> Optional[float]:
    """The probe's verify cycle took ``cycle_ms``: its loss (pass + cycle - tokens x plain ms a
    token) joins the running mean of its kind; returns it (None: not a probe, or nothing drafted)."""
    now, p._probe_now = p._probe_now, None
    if now is None or now[1] <= 0.0 or not np.isfinite(cycle_ms):
        return None
    first, draft_ms, tokens = now
    loss = draft_ms + cycle_ms - tokens * plain_ms_per_token(p, n_requests)
    if heal.probe_loss(p, first, loss):
        return loss
    old = p._probe_ms.get(first)
    if old is None:
        p._probe_ms[first] = (loss, 1)
    else:
        if old[0] > 0:
            loss = min(loss, STALL_CAP * old[0])
        p._probe_ms[first] = (old[0] + max(RATE, 1.0 / (old[1] + 1)) * (loss - old[0]), old[1] + 1)
    p._version += 1
    return loss
