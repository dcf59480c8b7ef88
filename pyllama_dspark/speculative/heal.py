"""Learned costs heal: what an earlier process taught the automatic schedule (:mod:`.policy_memory`)
is checked against what this process measures, and dropped where live cycles contradict it.

A state learned while the machine was busy (a draft pass of 139 ms for one of a few, cycles several
times their cost) would otherwise steer every later process: auto would plan plain decoding and
probe so rarely, and learn so slowly from each probe (a running estimate moves a few % a sample),
that drafting which pays would never be taken again.  The checks, each bounded (docs/schedule.md):

* **at restore**: a draft pass dearer than DRAFT_VS_VERIFY target verifies of the same rows is not a
  drafter's (a DSpark drafter is a few of the target's layers and its head): the learned costs are
  dropped, and the process measures the draft as a fresh one does (two passes);
* **a process's first pass** is cold (it costs at least a warm one): when it is cheaper than the
  learned warm pass, the learned figure is lowered to it at once;
* **the first HEAL_SAMPLES cycles of a restored cell**, and the first HEAL_SAMPLES warm passes: a
  median off the learned figure by more than HEAL_FACTOR replaces it; for a plain cell (the machine's
  own speed), every learned cost is dropped: it was learned on a machine in another state;
* **a probe's loss**: the first one measured in a process replaces a learned one off by more than
  HEAL_FACTOR;
* **the cached curve**: plain cycles of one sequence that run at less than 1 / STALE_FASTER or more
  than STALE_SLOWER of its t(1) mark it stale; it is dropped from the cache at close, and the next
  process measures it again (a running process never re-measures);
* while a learned draft pass or probe loss is not measured in this process, probes come at least
  every :data:`.probes.MAX_PROBE_GAP` plain cycles (:func:`.probes.budget_gap`), so a learned figure
  too dear to ever plan drafting is measured again within that many cycles.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)

#: a learned figure off what this process measures by more than this factor is replaced
HEAL_FACTOR = 2.0
#: in-process samples of a restored figure before it is judged
HEAL_SAMPLES = 3
#: a learned draft pass may cost at most this many target verifies of the block's rows
DRAFT_VS_VERIFY = 2.0
#: plain one-sequence cycles this much faster / slower than the cached curve's t(1) mark it stale
STALE_FASTER = 1.6
STALE_SLOWER = 2.5


def restored(p) -> None:
    """Policy ``p`` was just started from an earlier process's state: note what came from it, and
    drop learned draft costs that no drafter can have."""
    p._restored_cells = set(p._cycle_ms)
    p._heal = {}
    p._heal_probe = set(p._probe_ms)
    if p.cost is None:
        return
    for r, ms in p._draft_ms.items():
        verify = p.cost.t_verify(r * (p.gamma + 1))
        if ms > DRAFT_VS_VERIFY * verify:
            forget_costs(p, f"a learned draft pass of {ms:.1f} ms for {r} block(s) costs {ms / verify:.1f}x "
                            f"the target's verify of its {r * (p.gamma + 1)} rows")
            return


def forget_costs(p, why: str) -> None:
    """Drop every cost ``p`` restored (draft pass, cycle cells, excesses, probe losses, the cold
    pass): this process measures them anew, the draft in two passes as a fresh process does."""
    log.info("pyllama-dspark: the schedule's learned costs are dropped: %s", why)
    p._draft_ms, p._draft_ms_n = {}, {}
    p._restored_draft, p._draft_passes, p._cold_ms = False, 0, None
    # the cells measured here: those never restored, and restored ones by their samples here
    keep = {c: (float(np.median(v)), len(v)) for c, v in p._heal.items() if c in p._restored_cells and v}
    keep.update({c: v for c, v in p._cycle_ms.items() if c not in p._restored_cells})
    p._cycle_ms = keep
    p._cycle_used = {c: v[0] for c, v in keep.items()}
    p._extra_ms, p._extra_used, p._probe_ms = {}, {}, {}
    p._restored_cells, p._heal, p._heal_probe = set(), {}, set()
    p._cost_version += 1
    p._version += 1


def _off(x: float, ref: float) -> bool:
    return ref > 0 and x > 0 and not (1.0 / HEAL_FACTOR <= x / ref <= HEAL_FACTOR)


def cycle(p, cell, ms: float) -> None:
    """A cycle of ``cell`` (R, rows) took ``ms``: judge a restored cell on its first HEAL_SAMPLES
    cycles here, and the cached curve on the first plain cycles of one sequence."""
    r, rows = cell
    if cell == (1, 1) and p.profile_path and getattr(p, "profile_stale", None) is None:
        got = p._heal.setdefault(("curve",), [])
        if len(got) < HEAL_SAMPLES:
            got.append(ms)
            if len(got) == HEAL_SAMPLES:
                speed = float(np.median(got)) / max(p.cost.t_verify(1), 1e-9)
                if speed < 1.0 / STALE_FASTER or speed > STALE_SLOWER:
                    p.profile_stale = f"plain cycles of one sequence ran at {speed:.2f}x its t(1)"
    if cell not in p._restored_cells:
        return
    got = p._heal.setdefault(cell, [])
    got.append(ms)
    if len(got) < HEAL_SAMPLES:
        return
    p._restored_cells.discard(cell)
    m = float(np.median(got))
    old = p._cycle_ms.get(cell, (m, 0))[0]
    if not _off(m, old):
        return
    p._cycle_ms[cell] = (m, len(got))
    p._cycle_used[cell] = m
    p._cost_version += 1
    p._version += 1
    if rows == r:   # the machine's own speed: everything else learned with it is off too
        forget_costs(p, f"plain cycles of {r} sequence(s) run in {m:.2f} ms here, {old:.2f} ms learned")


def cold_pass(p, r: int, ms_full: float, estimate: float) -> None:
    """A process's first (cold) pass cost ``ms_full`` as a full block, over a learned warm
    ``estimate``: a warm pass costs at most that much, so a learned figure above it comes down."""
    if estimate <= 0 or ms_full >= estimate or r not in p._draft_ms:
        return
    f = ms_full / estimate
    p._draft_ms[r] *= f
    p._draft_ms_n = {k: v * f if k[0] == r else v for k, v in p._draft_ms_n.items()}
    p._version += 1


def warm_pass(p, r: int, ms_full: float) -> bool:
    """A warm pass of R = ``r`` blocks cost ``ms_full`` as a full block: True when the first
    HEAL_SAMPLES of them contradicted the learned figure and replaced it."""
    if not p._restored_draft or r not in p._draft_ms:
        return False
    got = p._heal.setdefault(("draft", r), [])
    if len(got) >= HEAL_SAMPLES:
        return False
    got.append(ms_full)
    if len(got) < HEAL_SAMPLES:
        return False
    m = float(np.median(got))
    if not _off(m, p._draft_ms[r]):
        return False
    p._draft_ms[r] = m
    p._draft_ms_n = {k: v for k, v in p._draft_ms_n.items() if k[0] != r}
    p._version += 1
    return True


def probe_loss(p, first: bool, loss: float) -> bool:
    """A probe of kind ``first`` lost ``loss`` ms: True when it replaced a learned loss it shows too
    dear by more than HEAL_FACTOR (the first probe of that kind in this process only; a dearer probe
    is a stall as before, capped by the running loss: one slow probe must not poison it again)."""
    if first not in p._heal_probe:
        return False
    p._heal_probe.discard(first)
    old = p._probe_ms.get(first)
    if old is None or not (old[0] > 0 and loss < old[0] / HEAL_FACTOR):
        return False
    p._probe_ms[first] = (loss, 1)
    p._version += 1
    return True
