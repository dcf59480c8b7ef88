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

**The RAM cache** (``store``: a :class:`~..llama.prompt_state.PromptStore`, ``--cache-ram``): when a
request is about to lose most of what its slot holds -- the slot was picked as the least recently
used one, or it keeps under half of its tokens -- the slot's state is saved to host RAM first, and
the kept state that serves the new prompt best (:meth:`~..llama.prompt_state.PromptStore.take_best`)
is restored into the slot in its place, as llama-server's ``get_available_slot`` does.  With
``--cache-idle-slots`` every idle slot's state is saved when a request starts
(:meth:`PromptCache.save_idle`).

**Checkpoints** (hybrid and recurrent targets, ``--ctx-checkpoints``): a recurrent state cannot be
cut back to an arbitrary position, so the prefill of such a slot stops 4 tokens before the prompt's
end and copies the recurrent state there (:meth:`PromptCache.checkpoint_at`, llama-server's last
checkpoint offset).  A returning prompt that parts from the slot's tokens before their end resumes
from the newest checkpoint before the parting point (restored, the attention cells cut after it)
instead of decoding everything again.  A slot keeps at most ``n_checkpoints`` of them, oldest
dropped first; they travel with the slot's state into the RAM cache.
"""

from __future__ import annotations

import itertools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from pyllama_dspark.llama.prompt_state import PromptState, SeqBytes, common_prefix, seq_state_size
from pyllama_dspark.llama.recurrent import Checkpoint, try_seq_rm

#: llama-server's --slot-prompt-similarity default
SLOT_PROMPT_SIMILARITY = 0.1


#: llama-server's --ctx-checkpoints default (checkpoints per slot)
CTX_CHECKPOINTS = 32
#: a hybrid slot's prefill stops this many tokens before the prompt's end for a checkpoint
CHECKPOINT_OFFSET = 4


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

    def __init__(self, similarity: float = SLOT_PROMPT_SIMILARITY, store=None,
                 n_checkpoints: int = CTX_CHECKPOINTS):
        if not 0.0 <= float(similarity) <= 1.0:
            raise ValueError(f"the slot prompt similarity must be in [0, 1], got {similarity}")
        if int(n_checkpoints) < 0:
            raise ValueError(f"--ctx-checkpoints must be >= 0, got {n_checkpoints}")
        self.similarity = float(similarity)
        self.store = store                      # a llama.prompt_state.PromptStore, or None
        self.n_checkpoints = int(n_checkpoints)
        self.checkpoints: Dict[int, List[Checkpoint]] = {}
        self.n_restored = 0                     # checkpoints restored (a hybrid prefix reused)
        # slots whose state was just restored from the RAM cache: llama.cpp's recurrent snapshots
        # (n_rs_seq) still hold the slot's previous decode, so no cut may use them until it decodes
        self._restored: set = set()
        self.tokens: Dict[int, np.ndarray] = {}
        # per slot: (the prompt, the logits row after it or None, the greedy token after it); the
        # row is None where it was read out on the device (greedy only: no row came back)
        self.prompt_row: Dict[int, Tuple[np.ndarray, Optional[np.ndarray], int]] = {}
        self._used: Dict[int, int] = {}
        self._clock = itertools.count()

    def clear(self) -> None:
        self.tokens.clear()
        self.prompt_row.clear()
        self.checkpoints.clear()

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
        self.checkpoints.pop(seq, None)
        self._used[seq] = next(self._clock)

    def pick(self, free: Sequence[int], prompt: np.ndarray) -> int:
        """The free slot a request with this prompt gets (llama-server's rule, see above)."""
        return pick_slot(free, prompt, self.tokens.get, self._used.get, self.similarity)

    def resume(self, target, prop, seq: int, prompt: np.ndarray, greedy: bool = False):
        """Where the prompt's decode starts in slot ``seq`` (the memories' tail from there removed),
        and, when they hold the whole prompt already (nothing to decode), the kept logits row, or
        for a ``greedy`` request whose row was read out on the device the kept token (an int)."""
        if self.store is not None:
            self._exchange(target, prop, seq, prompt)
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
        stale = seq in self._restored and getattr(target, "recurrent", False) and start < held.size
        self._restored.discard(seq)   # a decode follows (the row of a restored state is never kept)
        if stale or not try_seq_rm(target, seq, start):
            # a recurrent state cannot be cut back that far (llama/recurrent.py): from a checkpoint
            # before ``start``, or else decode it all
            start, row = self._from_checkpoint(target, seq, start), None
            if start == 0:
                return 0, None
        self.checkpoints[seq] = [c for c in self.checkpoints.get(seq, ()) if c.pos < start]
        if prop is not None:
            prop.rollback(start, seq)
        return start, row

    # ---- checkpoints (recurrent and hybrid targets) -------------------------------------------------
    def _from_checkpoint(self, target, seq: int, start: int) -> int:
        ckpts = [c for c in self.checkpoints.get(seq, ()) if c.pos < start]
        if not ckpts:
            return 0
        ckpts[-1].restore(target, seq)
        self.n_restored += 1
        return ckpts[-1].pos + 1

    def checkpoint_at(self, target, seq: int, start: int, n_prompt: int) -> Optional[int]:
        """Where the prefill of ``seq`` (decoding from ``start``) stops for a checkpoint: the
        number of prompt positions decoded when it is taken, or None (no checkpoint)."""
        if not (self.n_checkpoints and getattr(target, "recurrent", False)):
            return None
        at = n_prompt - CHECKPOINT_OFFSET
        return at if at > start else None

    def add_checkpoint(self, target, seq: int) -> None:
        """A checkpoint of ``seq`` at its newest position (the prefill stopped there)."""
        kept = self.checkpoints.setdefault(seq, [])
        c = Checkpoint(target, seq)
        kept[:] = [k for k in kept if k.pos != c.pos][-(self.n_checkpoints - 1):] if self.n_checkpoints > 1 else []
        kept.append(c)

    # ---- the RAM cache ------------------------------------------------------------------------------
    def _exchange(self, target, prop, seq: int, prompt: np.ndarray) -> None:
        """llama-server's update of its prompt cache when a slot is about to lose most of what it
        holds: save the slot's state, restore the kept one that serves ``prompt`` best."""
        held = self.tokens.get(seq)
        if held is not None and held.size:
            lcp = common_prefix(held, prompt)
            if lcp / max(1, prompt.size) > self.similarity and lcp / held.size >= 0.5:
                return   # the slot serves the prompt well: nothing to exchange
            self.save(target, prop, seq)
        state = self.store.take_best(held, prompt)
        if state is not None:
            target.seq_rm(seq, -1, -1)
            state.target.restore(target.ctx, seq)
            if prop is not None:
                prop.load_state(state.draft, seq)
            self.tokens[seq] = state.tokens
            self.prompt_row.pop(seq, None)
            self.checkpoints[seq] = list(state.checkpoints)
            self._restored.add(seq)
        self.store.update()

    def save(self, target, prop, seq: int) -> bool:
        """The slot's state into the RAM cache (if it holds something the cache does not)."""
        held = self.tokens.get(seq)
        if self.store is None or held is None or not held.size or self.store.holds(held):
            return False
        ckpts = list(self.checkpoints.get(seq, ()))
        size_t = seq_state_size(target.ctx, seq)
        size = size_t + (prop.state_size(seq) if prop is not None else 0) + sum(c.nbytes for c in ckpts)

        def take() -> PromptState:
            return PromptState(held.copy(), SeqBytes(target.ctx, seq, size_t),
                               prop.save_state(seq) if prop is not None else None, ckpts)

        return self.store.save(held, size, take)

    def save_idle(self, target, prop, idle: Sequence[int], clear: bool = False) -> None:
        """``--cache-idle-slots``: the state of every idle slot into the RAM cache; ``clear``
        (a unified KV buffer, where freed cells serve the other slots): the slots emptied too."""
        if self.store is None:
            return
        for seq in idle:
            self.save(target, prop, seq)
            if clear and self.tokens.get(seq) is not None:
                target.seq_rm(seq, -1, -1)
                if prop is not None:
                    prop.reset(seq)
                self.forget(seq)
        self.store.update()

    def info(self, slots: List[int]) -> List[dict]:
        return [{"id": s, "n_cached": self.n_cached(s)} for s in slots]
