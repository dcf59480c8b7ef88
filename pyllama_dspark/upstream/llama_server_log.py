"""What a ``llama-server`` log says about speculative decoding: the per-verification-step draft
counts (``LLAMA_TRACE=1`` makes the server log ``accepted A/D draft tokens`` once per verify step)
and the per-request acceptance summaries."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple


class SpecStep(Tuple[int, int]):
    """One verification step: (n_drafted, n_accepted). ``task`` / ``slot`` are kept as attributes."""

    task: int
    slot: int

    def __new__(cls, n_drafted: int, n_accepted: int, task: int = -1, slot: int = -1):
        obj = super().__new__(cls, (n_drafted, n_accepted))
        obj.task = task
        obj.slot = slot
        return obj

    @property
    def n_drafted(self) -> int:
        return self[0]

    @property
    def n_accepted(self) -> int:
        return self[1]


# LLAMA_TRACE=1 (server-context.cpp, post_decode): "accepted %2zu/%2zu draft tokens" at INFO level,
# optionally followed by " (restore checkpoint)"; debug level (-lv 5) also prints
# "accepted %d/%d draft tokens, new n_tokens = %d" for the same step -- used only as a fallback.
_RE_TRACE = re.compile(
    r"id\s+(\d+) \| task (-?\d+) \| accepted\s+(\d+)/\s*(\d+) draft tokens(?P<rest>[^\n]*)")
_RE_ACCEPTANCE = re.compile(
    r"id\s+(\d+) \| task (-?\d+) \| draft acceptance = ([0-9.]+) \(\s*(\d+) accepted /\s*(\d+) generated\)")


def parse_spec_steps(log_text: str, task: Optional[int] = None) -> List[SpecStep]:
    """Per-verification-step (n_drafted, n_accepted) from a llama-server log.

    Needs ``LLAMA_TRACE=1`` in the server's environment (or ``-lv 5``). n_accepted counts the
    draft tokens that matched the target (the target's own token after them is not included),
    exactly the quantity summed into ``timings.draft_n_accepted``. Steps where nothing was
    drafted (plain decoding) are not logged and therefore not listed.
    """
    trace: List[SpecStep] = []
    debug: List[SpecStep] = []
    for m in _RE_TRACE.finditer(log_text):
        slot, t, acc, drafted = int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4))
        if task is not None and t != task:
            continue
        step = SpecStep(drafted, acc, t, slot)
        if m.group("rest").startswith(", new n_tokens"):
            debug.append(step)
        else:
            trace.append(step)
    return trace if trace else debug


def parse_draft_acceptance(log_text: str, task: Optional[int] = None) -> List[Dict[str, Any]]:
    """The per-request summary lines ``draft acceptance = r (A accepted / D generated)``."""
    out = []
    for m in _RE_ACCEPTANCE.finditer(log_text):
        if task is not None and int(m.group(2)) != task:
            continue
        out.append({"slot": int(m.group(1)), "task": int(m.group(2)), "ratio": float(m.group(3)),
                    "accepted": int(m.group(4)), "generated": int(m.group(5))})
    return out
