"""What the cache holds for a target, for the user: ``pyllama-dspark profile --show`` and ``--reset``.

The automatic schedule plans with two things it keeps in ``<cache>/profiles/``: the verify cost
curve measured once per target and settings (:mod:`.costprofile`), and what it learned in earlier
processes per target, settings, draft and proposer (:mod:`.policy_memory`).  ``--show`` prints the
curve auto uses for the given settings with its spread and verdict (:func:`.costprofile.problems`),
when and under which load it was measured, and every learned state for the target file;
``--reset`` deletes both for the target file, whatever the settings and drafts.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import List, Tuple

from pyllama_dspark.speculative import costprofile, profile_check


def _same_file(a, b) -> bool:
    return bool(a) and bool(b) and os.path.realpath(a) == os.path.realpath(b)


def _profiles_dir() -> Path:
    return costprofile.default_path("x").parent


def files_for(target_path: str) -> Tuple[List[Path], List[Path]]:
    """(cost curves, learned states) in the cache that belong to ``target_path``."""
    curves, learned = [], []
    for f in sorted(_profiles_dir().glob("*.json")):
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        if f.name.startswith("learned-"):
            if _same_file((data.get("about") or {}).get("target"), target_path):
                learned.append(f)
        elif _same_file((data.get("settings") or {}).get("target"), target_path):
            curves.append(f)
    return curves, learned


def _when(t) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "unknown"


def show(target) -> str:
    """The report for an open target (its settings as loaded pick the curve auto uses)."""
    key = costprofile.target_key(target)
    path = costprofile.default_path(key)
    lines = [f"target: {target.path}", f"auto's cost curve for these settings: {path}"]
    env = os.environ.get(costprofile.PROFILE_ENV)
    if env:
        lines.append(f"  (${costprofile.PROFILE_ENV} is set: every run uses {env} instead)")
    if not path.exists():
        lines.append("  none cached: the next run with a draft measures it (~10-20 s)")
    else:
        try:
            prof = costprofile.load(path)
        except (ValueError, TypeError) as e:
            prof = None
            lines.append(f"  unreadable ({e}): the next run measures it again")
        if prof is not None:
            why = profile_check.stale(prof.made_by) + costprofile.problems(prof)
            load = prof.load or {}
            lines.append(f"  measured {_when(prof.measured_at)} by {prof.made_by or 'an older version'}; "
                         f"{prof.repeats} rounds; load: {load.get('others_cores', '?')} other cores busy of "
                         f"{load.get('n_cpus', '?')}, steal {load.get('steal_cores', '?')}, "
                         f"this process {load.get('cpu_s', '?')} CPU s in {load.get('wall_s', '?')} s")
            lines.append("  verdict: " + ("accepted" if not why else "rejected, the next run measures it again: "
                                          + "; ".join(why)))
            lines.append(prof.table())
    _, learned = files_for(target.path)
    lines.append(f"what auto learned for {os.path.basename(target.path)} ({len(learned)} file(s)):")
    for f in learned:
        lines.extend("  " + x for x in _learned_lines(f))
    if not learned:
        lines.append("  nothing yet")
    return "\n".join(lines)


def _learned_lines(f: Path) -> List[str]:
    data = json.loads(f.read_text())
    about, st = data.get("about") or {}, data.get("state") or {}
    acc = ", ".join(f"{x:.2f}" for x in st.get("acc", []))
    draft = {r: round(v, 2) for r, v in (st.get("draft_ms") or {}).items()}
    cells = {k: round(v[0], 2) for k, v in sorted((st.get("cycle_ms") or {}).items())}
    return [f"{f.name}: draft {about.get('draft')}, proposer {about.get('proposer')}, block {about.get('gamma')}, "
            f"{about.get('regime')} sampling; saved {_when(data.get('saved_at'))}",
            f"  acceptance per position [{acc}] over {st.get('cycles', 0)} cycles; draft pass ms per R {draft}",
            f"  cycle ms per (R:rows) {cells}; probe gap {st.get('probe_gap')}, plain cycles since a probe "
            f"{st.get('skipped')}"]


def reset(target_path: str) -> str:
    """Delete the cached curves and learned states of ``target_path``; says what went."""
    curves, learned = files_for(target_path)
    for f in curves + learned:
        try:
            f.unlink()
        except OSError:
            pass
    return (f"removed {len(curves)} cost curve(s) and {len(learned)} learned state(s) of {target_path} from "
            f"{_profiles_dir()}: the next run measures and learns again")
