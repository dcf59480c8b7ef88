"""Accept rules: pure functions of arrays, no llama.cpp (unit-testable on synthetic inputs)."""

from __future__ import annotations

from typing import Optional

import numpy as np


def greedy_accept(drafted: np.ndarray, target_argmax: np.ndarray, eog: Optional[np.ndarray] = None) -> int:
    """Number of leading draft tokens equal to the target's greedy choice.

    ``target_argmax[i]`` is the target's argmax after the verify row i (row 0 = the anchor), so the
    draft token ``drafted[i]`` is checked against ``target_argmax[i]``.  ``target_argmax`` has at
    least ``len(drafted) + 1`` entries; the emitted tokens are ``target_argmax[:n_acc + 1]`` (the
    accepted drafts followed by the target's own token at the first mismatch, or the bonus token).

    ``eog`` (bool per vocabulary id) applies llama.cpp's rule: an accepted end-of-generation draft
    that is not the last draft ends acceptance there (it becomes the emitted target token and is
    not counted as accepted); a trailing one is accepted.
    """
    n = len(drafted)
    if len(target_argmax) < n + 1:
        raise ValueError(f"need {n + 1} target rows for {n} drafts, got {len(target_argmax)}")
    if n == 0:
        return 0
    drafted = np.asarray(drafted)
    miss = np.flatnonzero(drafted != np.asarray(target_argmax[:n]))
    n_acc = int(miss[0]) if miss.size else n
    if eog is not None and n_acc > 0:
        ends = np.flatnonzero(eog[drafted[:min(n_acc, n - 1)]])
        if ends.size:
            n_acc = int(ends[0])
    return n_acc


def greedy_emitted(drafted: np.ndarray, target_argmax: np.ndarray, eog: Optional[np.ndarray] = None) -> np.ndarray:
    """The tokens a greedy verification emits: accepted drafts plus the target's next token."""
    n_acc = greedy_accept(drafted, target_argmax, eog)
    return np.asarray(target_argmax[: n_acc + 1])
