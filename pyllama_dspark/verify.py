"""Accept rules: pure functions of arrays, no llama.cpp (unit-testable on synthetic inputs)."""

from __future__ import annotations

import numpy as np


def greedy_accept(drafted: np.ndarray, target_argmax: np.ndarray) -> int:
    """Number of leading draft tokens equal to the target's greedy choice.

    ``target_argmax[i]`` is the target's argmax after the verify row i (row 0 = the anchor), so the
    draft token ``drafted[i]`` is checked against ``target_argmax[i]``.  ``target_argmax`` has at
    least ``len(drafted) + 1`` entries; the emitted tokens are ``target_argmax[:n_acc + 1]`` (the
    accepted drafts followed by the target's own token at the first mismatch, or the bonus token).
    """
    n = len(drafted)
    if len(target_argmax) < n + 1:
        raise ValueError(f"need {n + 1} target rows for {n} drafts, got {len(target_argmax)}")
    if n == 0:
        return 0
    miss = np.flatnonzero(np.asarray(drafted) != np.asarray(target_argmax[:n]))
    return int(miss[0]) if miss.size else n


def greedy_emitted(drafted: np.ndarray, target_argmax: np.ndarray) -> np.ndarray:
    """The tokens a greedy verification emits: accepted drafts plus the target's next token."""
    n_acc = greedy_accept(drafted, target_argmax)
    return np.asarray(target_argmax[: n_acc + 1])
