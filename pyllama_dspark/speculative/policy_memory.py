"""What the automatic schedule learned, kept across processes.

``pyllama-dspark run`` is one process per prompt.  Without a memory every process would start from
the optimistic prior (acceptance 0.9 at every position), pay a cold draft pass and a probe or two,
and learn again that this drafter does not pay on this machine.  So the learned state of a
cost-driven policy (:func:`state_of`: acceptance per position and its weight, the confidence
correction, the draft pass time per R and block, the measured cycle costs per (R, rows), the probe
back-off) is written at close into
the cache beside the cost curve, and the next process with the same target, settings, draft,
proposer, block and sampling regime starts from it.

Files: ``<cache>/profiles/learned-<key>.json``; ``$PYLLAMA_DSPARK_SCHEDULE_MEMORY=0`` neither reads nor
writes them (the test suite sets it, so that one test's runs do not steer another's).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np

from pyllama_dspark.speculative import costprofile, heal

MEMORY_ENV = "PYLLAMA_DSPARK_SCHEDULE_MEMORY"
#: 2: a file says what it is for (``about``: target, draft, proposer, ...; ``profile --show / --reset``)
MEMORY_VERSION = 2


def enabled() -> bool:
    return os.environ.get(MEMORY_ENV, "1").strip().lower() not in ("0", "off", "no", "false")


def memory_key(target, draft_path: Optional[str], proposer: str, gamma: int, mode: str, regime: str) -> str:
    """The target with its context settings (the cost curve's key), the draft file, the proposer
    (e.g. ``oracle:0.9``), the block, the schedule and the sampling regime (``greedy`` /
    ``sampled`` / ``any``): acceptance depends on all of them."""
    raw = json.dumps([MEMORY_VERSION, costprofile.target_key(target), costprofile._file_id(draft_path), proposer,
                      int(gamma), mode, regime])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def memory_file(key: str) -> Path:
    return costprofile.default_path(key).with_name(f"learned-{key}.json")


def attach(policy, target, draft_path: Optional[str], proposer: str, regime: str = "any") -> bool:
    """Bind ``policy`` to its memory file and start it from what is stored there; True when it
    restored something.  Does nothing (False) when the memory is off or the policy is not
    cost-driven."""
    if policy is None or not policy.uses_cost or not enabled():
        return False
    path = memory_file(memory_key(target, draft_path, proposer, policy.gamma, policy.mode, regime))
    policy.memory_path = str(path)
    policy.memory_about = dict(target=target.path, target_key=costprofile.target_key(target), draft=draft_path,
                               proposer=proposer, gamma=int(policy.gamma), mode=policy.mode, regime=regime)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(data, dict) or data.get("version") != MEMORY_VERSION:
        return False
    return policy.restore(data.get("state") or {})


def save(policy) -> bool:
    """Write what ``policy`` learned to its memory file (atomically; the last process to close
    wins).  Nothing is written for a policy that saw no cycle in this process."""
    stale = getattr(policy, "profile_stale", None)
    if stale and getattr(policy, "profile_path", None):
        costprofile.forget(policy.profile_path, stale)   # at close: a running process never re-measures
        policy.profile_path = None
    path = getattr(policy, "memory_path", None)
    if policy is None or not path or not enabled() or policy._cycles == 0:
        return False
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=p.name, suffix=".tmp", dir=p.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"version": MEMORY_VERSION, "about": getattr(policy, "memory_about", None),
                       "saved_at": round(time.time(), 1), "state": policy.learned()}, f)
        os.replace(tmp, p)
    except OSError:   # a read-only cache: the next process learns again, nothing worse
        return False
    return True


#: A restored running mean counts as at most this many samples (it keeps following this process).
RESTORED_SAMPLES = 10


def state_of(p) -> dict:
    """What policy ``p``'s running estimates hold (JSON-able): acceptance per position and its
    weight, the confidence correction's sums, the measured draft pass ms per R and per (R, block),
    the measured cycle costs per (R, rows) and over the curve per (R, drafting?) with their sample
    counts, what a cold first pass costs more, what probes measured to lose (:mod:`.probes`), the
    probe back-off and the plain cycles since the last probe (probes are spaced across processes,
    not restarted in each)."""
    out = dict(gamma=p.gamma, acc=p._acc.tolist(), n=p._n.tolist(), hit_sum=p._hit_sum.tolist(),
               conf_sum=p._conf_sum.tolist(), draft_ms={str(r): v for r, v in p._draft_ms.items()},
               draft_ms_n={f"{r}:{n}": v for (r, n), v in p._draft_ms_n.items()},
               cycle_ms={f"{r}:{k}": list(v) for (r, k), v in p._cycle_ms.items()},
               extra_ms={f"{r}:{int(d)}": list(v) for (r, d), v in p._extra_ms.items()},
               probe_gap=p._probe_gap, skipped=p._skipped, cycles=p._cycles)
    if p._cold_ms is not None:
        out["cold_ms"] = p._cold_ms
    if p._probe_ms:
        out["probe_ms"] = {str(int(first)): list(v) for first, v in p._probe_ms.items()}
    return out


def _pairs(raw, check, parts: int = 2) -> dict:
    """{"a:b": [mean, samples]} -> {(a, b): (mean, samples)} (keys of ``parts`` integers); ValueError
    on a key or value that does not fit."""
    out = {}
    for k, v in dict(raw or {}).items():
        key = tuple(int(x) for x in k.split(":"))
        mean, seen = float(v[0]), int(v[1])
        if len(key) != parts or not check(key) or not np.isfinite(mean) or seen < 1:
            raise ValueError(k)
        out[key] = (mean, min(seen, RESTORED_SAMPLES))
    return out


def load_state(p, state: dict, acc_floor: float) -> bool:
    """Start policy ``p`` from :func:`state_of` of an earlier process instead of the optimistic
    prior (acceptance floored at ``acc_floor``); False (nothing changed) when it does not fit ``p``."""
    try:
        if int(state["gamma"]) != p.gamma:
            return False
        arrays = [np.asarray(state[k], dtype=np.float64) for k in ("acc", "n", "hit_sum", "conf_sum")]
        draft_ms = {int(r): float(v) for r, v in dict(state.get("draft_ms") or {}).items()}
        draft_ms_n = {tuple(int(x) for x in k.split(":")): float(v)
                      for k, v in dict(state.get("draft_ms_n") or {}).items()}
        cycle_ms = _pairs(state.get("cycle_ms"), lambda k: 0 < k[0] <= k[1])
        extra_ms = _pairs(state.get("extra_ms"), lambda k: k[0] > 0 and k[1] in (0, 1))
        gap = int(state.get("probe_gap", p.probe_every))
        skipped = int(state.get("skipped", 0))
        cold = state.get("cold_ms")
        cold = None if cold is None else float(cold)
        probe_ms = {bool(k[0]): v for k, v in _pairs(state.get("probe_ms"), lambda k: k[0] in (0, 1), 1).items()}
    except (KeyError, TypeError, ValueError, IndexError):
        return False
    if any(a.shape != (p.gamma,) or not np.all(np.isfinite(a)) for a in arrays) or \
            not all(r > 0 and np.isfinite(v) and v >= 0 for r, v in draft_ms.items()) or \
            not all(len(k) == 2 and k[0] > 0 and 1 <= k[1] <= p.gamma and np.isfinite(v) and v >= 0
                    for k, v in draft_ms_n.items()) or \
            not all(v[0] >= 0 for v in cycle_ms.values()) or \
            (cold is not None and not (np.isfinite(cold) and cold >= 0)):
        return False
    acc, n, hit, conf = arrays
    p._acc = np.clip(acc, acc_floor, 1.0)
    p._n, p._hit_sum, p._conf_sum = np.maximum(n, 0), np.maximum(hit, 0), np.maximum(conf, 0)
    if p.learn_costs:
        p._draft_ms = draft_ms
        p._draft_ms_n = {k: v for k, v in draft_ms_n.items() if k[0] in draft_ms}
        p._restored_draft = bool(draft_ms)
        p._cold_ms = cold
        p._probe_ms = probe_ms
        if p.uses_cost:
            # the cycle costs as measured, and what the plan reads of them (cost_for rebuilds)
            p._cycle_ms, p._cycle_used = dict(cycle_ms), {k: v[0] for k, v in cycle_ms.items()}
            p._extra_ms = {(r, bool(d)): v for (r, d), v in extra_ms.items()}
            p._extra_used = {k: v[0] for k, v in p._extra_ms.items()}
            p._cost_version += 1
    p._probe_gap = max(1, min(gap, 16 * max(1, p.probe_every)))
    p._skipped = max(0, min(skipped, 10 ** 9))
    p._version += 1
    if p.learn_costs:
        heal.restored(p)   # what live cycles will check, and learned costs no drafter can have
    return True
