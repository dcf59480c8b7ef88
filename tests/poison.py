"""A cache poisoned as a busy machine poisons it (issue 52): what tests/test_schedule_heal.py and
bench/poisoned_start.py plant into a clean cost curve and learned state (the JSON dicts of the
files, changed in place)."""

from __future__ import annotations

import numpy as np


def _busy(curve: dict, learned: dict):
    """The issue's figures: a curve measured beside a pip build (2x slow, spikes at 15, 18, 23),
    and the learned state of that busy run (draft pass 138.8 ms, cycles 2.5x)."""
    v = np.asarray(curve["verify_ms"]) * 2.0
    for b, f in ((15, 5.0), (18, 3.0), (23, 4.0)):
        v[b - 1] *= f
    curve.update(verify_ms=v.tolist(), verify_p10=(v * 0.9).tolist(), verify_p90=(v * 1.3).tolist())
    st = learned["state"]
    st["draft_ms"] = {r: 138.8 for r in st["draft_ms"]}
    st["draft_ms_n"] = {k: 138.8 for k in st["draft_ms_n"]}
    st["cycle_ms"] = {k: [v[0] * 2.5, v[1]] for k, v in st["cycle_ms"].items()}


def _inflated(curve: dict, learned: dict):
    """Every verify size B > 1 at 10x."""
    for k in ("verify_ms", "verify_p10", "verify_p90"):
        curve[k] = [curve[k][0]] + [x * 10.0 for x in curve[k][1:]]


def _dear_draft(curve: dict, learned: dict):
    """The learned draft pass at 100x its cost."""
    st = learned["state"]
    st["draft_ms"] = {r: v * 100.0 for r, v in st["draft_ms"].items()}
    st["draft_ms_n"] = {k: v * 100.0 for k, v in st["draft_ms_n"].items()}


#: name -> poison(curve, learned)
POISONS = {"busy": _busy, "inflated-10x": _inflated, "draft-100x": _dear_draft}
