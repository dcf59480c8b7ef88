"""The prompt cache of the loop's sequence slots (llama-server's ``cache_prompt``).

With ``keep_memory`` a finished request leaves its slot's memories as they are: the target's KV
cells and the draft's injected features for the prompt and the generated tokens (all but the last,
which was never decoded).  :class:`PromptCache` remembers, per slot, which tokens those are, the
logits row after the last prompt decoded there, and when the slot was last used.  A new request
then gets a slot by llama-server's rule (``server-context.cpp``, ``get_available_slot``):

* among the free slots that hold something, the one whose tokens share the longest common prefix
  with the prompt, as a fraction of the prompt's length, if that fraction is above
  ``similarity`` (``--slot-prompt-similarity``, 0.1 by default; 0 turns the rule off);
* otherwise the least recently used free slot.

:meth:`PromptCache.resume` then says where the prompt's decode starts: the memories keep the common
prefix (both are cut there: target cells and draft features follow the same prefix) and only the
rest is decoded, its features injected into the draft as a fresh prefill would inject them.  At
least one prompt token is always decoded again, for the logits row after the prompt, unless the
slot kept that very row (the same prompt again).  A sliding-window target whose cache no longer
holds the window before the resume point decodes the whole prompt (``Target.can_resume_at``).
"""

from __future__ import annotations

import itertools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from pyllama_dspark.llama.recurrent import try_seq_rm

#: llama-server's --slot-prompt-similarity default
SLOT_PROMPT_SIMILARITY = 0.1


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    m = min(a.size, b.size)
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


def pick_slot(free: Sequence[int], prompt: np.ndarray, held: Callable[[int], Optional[np.ndarray]],
              last_used: Callable[[int], Optional[int]], similarity: float = SLOT_PROMPT_SIMILARITY) -> int:
    """llama-server's slot choice among ``free`` slots: the best prompt similarity above
    ``similarity`` (``held(slot)``: the tokens its memories hold), else the least recently used
    (``last_used(slot)``: a clock value, None for never)."""
    best, best_sim = None, 0.0
    if similarity > 0.0 and prompt.size:
        for seq in free:
            h = held(seq)
            if h is None or not h.size:
                continue
            sim = common_prefix(h, prompt) / prompt.size
            if sim > best_sim and sim > similarity:
                best, best_sim = seq, sim
    if best is not None:
        return best
    return min(free, key=lambda s: -1 if last_used(s) is None else last_used(s))


class PromptCache:
    """Per slot: the tokens its memories hold, the row after its last prompt, its last use."""

    def __init__(self, similarity: float = SLOT_PROMPT_SIMILARITY):
        if not 0.0 <= float(similarity) <= 1.0:
            raise ValueError(f"the slot prompt similarity must be in [0, 1], got {similarity}")
        self.similarity = float(similarity)
        self.tokens: Dict[int, np.ndarray] = {}
        # per slot: (the prompt, the logits row after it or None, the greedy token after it); the
        # row is None where it was read out on the device (greedy only: no row came back)
        self.prompt_row: Dict[int, Tuple[np.ndarray, Optional[np.ndarray], int]] = {}
        self._used: Dict[int, int] = {}
        self._clock = itertools.count()

    def clear(self) -> None:
        self.tokens.clear()
        self.prompt_row.clear()

    def n_cached(self, seq: int) -> int:
        t = self.tokens.get(seq)
        return 0 if t is None else int(t.size)

    def keep(self, seq: int, tokens: np.ndarray) -> None:
        """The slot's memories hold ``tokens`` at positions 0.. (a request just finished there)."""
        self.tokens[seq] = tokens
        self._used[seq] = next(self._clock)

    def forget(self, seq: int) -> None:
        self.tokens.pop(seq, None)
        self.prompt_row.pop(seq, None)
        self._used[seq] = next(self._clock)

    def pick(self, free: Sequence[int], prompt: np.ndarray) -> int:
        """The free slot a request with this prompt gets (llama-server's rule, see above)."""
        return pick_slot(free, prompt, self.tokens.get, self._used.get, self.similarity)

    def resume(self, target, prop, seq: int, prompt: np.ndarray, greedy: bool = False):
        """Where the prompt's decode starts in slot ``seq`` (the memories' tail from there removed),
        and, when they hold the whole prompt already (nothing to decode), the kept logits row, or
        for a ``greedy`` request whose row was read out on the device the kept token (an int)."""
        held = self.tokens.pop(seq, None)
        if held is None:
            return 0, None
        start = common_prefix(held, prompt)
        kept = self.prompt_row.get(seq)
        if (start == prompt.size and kept is not None and np.array_equal(kept[0], prompt)
                and (kept[1] is not None or greedy) and target.can_resume_at(seq, start)):
            row = kept[1] if kept[1] is not None else kept[2]
        else:
            row = None
            start = min(start, prompt.size - 1)
            if not target.can_resume_at(seq, start):
                return 0, None   # an SWA cache no longer holds the window before start: decode it all
        if not try_seq_rm(target, seq, start):
            return 0, None   # a recurrent state cannot be cut back that far (llama/recurrent.py): decode it all
        if prop is not None:
            prop.rollback(start, seq)
        return start, row

    def info(self, slots: List[int]) -> List[dict]:
        return [{"id": s, "n_cached": self.n_cached(s)} for s in slots]
