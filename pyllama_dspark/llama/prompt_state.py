"""Prompt states kept in host RAM: what a sequence's continuation needs, saved and restored
(llama-server's ``server_prompt_cache``, ``--cache-ram``).

A :class:`PromptState` is one sequence's state copied to the host:

* the target's memory of the sequence (``llama_state_seq_get_data_ext``, all of it: the attention
  cells and, on a hybrid target, the recurrent state after the newest position);
* the draft's part, given by the proposer (the draft's memory and the captured feature rows it
  keeps on the host until its next block): any object with ``nbytes`` and ``restore``;
* the target's context checkpoints of the sequence (:class:`~.recurrent.Checkpoint`, hybrid targets),
  which travel with it;
* the tokens those memories hold.

Its size is known before it is taken (``llama_state_seq_get_size_ext``), so that a state that
would break the limit is never copied.  :class:`PromptStore` keeps states in the order they were
saved and, as llama-server does:

* a state whose tokens are all held by a kept state's tokens is not saved again; kept states whose
  tokens the new one holds are dropped (they are obsolete);
* a state larger than the whole limit is not saved; otherwise the oldest states go until the new
  one fits;
* :meth:`PromptStore.take_best` hands out the kept state that both keeps more of its own tokens and
  covers more of the new prompt than what the slot holds, among those that keep at least a quarter
  of their tokens (a small overlap does not throw a long prompt away), and forgets it (it now lives
  in the slot's memories);
* a token limit (the context size) grows with what the byte limit can hold at the states' mean
  size per token.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np
from llama_cpp import llama_cpp as ll

from pyllama_dspark.errors import NativeError

__all__ = ["SeqBytes", "PromptState", "PromptStore", "seq_state_size", "common_prefix", "MIB"]

MIB = 1 << 20
#: llama-server's --cache-ram default, in MiB (-1: no limit, 0: off)
CACHE_RAM_MIB = 8192
#: llama-server's rule: a kept state must keep at least this fraction of its tokens to be used
MIN_KEEP = 0.25


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    m = min(a.size, b.size)
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


def seq_state_size(ctx, seq_id: int, flags: int = 0) -> int:
    """Bytes of a sequence's state in a context (0: all of it)."""
    # size_t llama_state_seq_get_size_ext(struct llama_context * ctx, llama_seq_id seq_id,
    #                                     llama_state_seq_flags flags);
    return int(ll.llama_state_seq_get_size_ext(ctx, seq_id, flags))


class SeqBytes:
    """A sequence's state in one context, copied to the host (``size``: from :func:`seq_state_size`)."""

    __slots__ = ("data", "nbytes")

    def __init__(self, ctx, seq_id: int, size: int, flags: int = 0):
        # size_t llama_state_seq_get_data_ext(struct llama_context * ctx, uint8_t * dst, size_t size,
        #                                     llama_seq_id seq_id, llama_state_seq_flags flags);
        self.data = np.empty(max(int(size), 1), dtype=np.uint8)
        got = int(ll.llama_state_seq_get_data_ext(ctx, self._ptr(), size, seq_id, flags))
        if got != size:
            raise NativeError(f"llama_state_seq_get_data_ext wrote {got} of {size} bytes of sequence {seq_id}")
        self.nbytes = int(size)

    def _ptr(self):
        return self.data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))

    def restore(self, ctx, seq_id: int, flags: int = 0) -> None:
        """The sequence's state in ``ctx`` replaced by this one."""
        # size_t llama_state_seq_set_data_ext(struct llama_context * ctx, const uint8_t * src, size_t size,
        #                                     llama_seq_id dest_seq_id, llama_state_seq_flags flags);
        got = int(ll.llama_state_seq_set_data_ext(ctx, self._ptr(), self.nbytes, seq_id, flags))
        if got != self.nbytes:
            raise NativeError(f"llama_state_seq_set_data_ext read {got} of {self.nbytes} bytes into sequence {seq_id}")


@dataclass
class PromptState:
    tokens: np.ndarray                    # what the memories hold, at positions 0..
    target: SeqBytes
    draft: object = None                  # the proposer's part (nbytes, restore(seq)) or None
    checkpoints: list = field(default_factory=list)   # recurrent.Checkpoint, oldest first

    @property
    def nbytes(self) -> int:
        return (self.target.nbytes + (self.draft.nbytes if self.draft is not None else 0)
                + sum(c.nbytes for c in self.checkpoints))


class PromptStore:
    """Prompt states in host RAM within ``limit_mib`` MiB (-1: no limit; llama-server's
    ``--cache-ram``) and ``limit_tokens`` tokens (0: none; grows with what the bytes allow).
    Thread-safe: the slots of ``serve -nocb`` share one store."""

    def __init__(self, limit_mib: int = CACHE_RAM_MIB, limit_tokens: int = 0):
        if int(limit_mib) == 0:
            raise ValueError("a prompt store needs a limit other than 0 (0 turns the cache off)")
        self.limit_bytes = 0 if int(limit_mib) < 0 else int(limit_mib) * MIB
        self.limit_tokens = max(0, int(limit_tokens))
        self.states: List[PromptState] = []
        self.hits = self.misses = self.saved = self.evicted = 0
        self._lock = threading.RLock()

    # ---- sizes ------------------------------------------------------------------------------------
    def size(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self.states)

    def n_tokens(self) -> int:
        with self._lock:
            return sum(int(s.tokens.size) for s in self.states)

    def info(self) -> dict:
        """What /metrics and /slots show."""
        with self._lock:
            return {"states": len(self.states), "bytes": self.size(), "tokens": self.n_tokens(),
                    "limit_bytes": self.limit_bytes, "hits": self.hits, "misses": self.misses,
                    "saved": self.saved, "evicted": self.evicted}

    # ---- saving -----------------------------------------------------------------------------------
    def holds(self, tokens: np.ndarray) -> bool:
        """Whether a kept state's tokens begin with all of ``tokens``."""
        with self._lock:
            return any(common_prefix(s.tokens, tokens) == tokens.size for s in self.states)

    def save(self, tokens: np.ndarray, size: int, take: Callable[[], PromptState]) -> bool:
        """Keep the state ``take()`` copies (``size`` bytes, known before it is taken), by the rules
        in the module's docstring; False where it is not kept."""
        with self._lock:
            if not tokens.size or self.holds(tokens):
                return False
            if self.limit_bytes and size > self.limit_bytes:
                return False
            self.states = [s for s in self.states if common_prefix(s.tokens, tokens) < s.tokens.size]
            while self.states and self.limit_bytes and self.size() + size > self.limit_bytes:
                self._pop_oldest()
            try:
                state = take()
            except MemoryError:
                self.limit_bytes = max(1, int(0.4 * self.size()))   # as llama-server: shrink, then trim
                self.update()
                return False
            self.states.append(state)
            self.saved += 1
            return True

    def _pop_oldest(self) -> None:
        self.states.pop(0)
        self.evicted += 1

    def update(self) -> None:
        """Trim to the limits (the oldest states first)."""
        with self._lock:
            while self.states and self.limit_bytes and self.size() > self.limit_bytes:
                self._pop_oldest()
            if self.limit_tokens:
                per_token = max(1.0, self.size() / max(1, self.n_tokens()))
                limit = max(self.limit_tokens, int(self.limit_bytes / per_token)) if self.limit_bytes else self.limit_tokens
                while self.states and self.n_tokens() > limit:
                    self._pop_oldest()

    # ---- loading ----------------------------------------------------------------------------------
    def take_best(self, held: Optional[np.ndarray], prompt: np.ndarray) -> Optional[PromptState]:
        """The kept state that serves ``prompt`` better than the slot's ``held`` tokens (removed
        from the store), or None; counts a hit or a miss."""
        with self._lock:
            lcp = 0 if held is None else common_prefix(held, prompt)
            keep_best = lcp / held.size if held is not None and held.size else -1.0
            sim_best = lcp / max(1, prompt.size)
            best = None
            for i, s in enumerate(self.states):
                n = common_prefix(s.tokens, prompt)
                keep, sim = n / max(1, s.tokens.size), n / max(1, prompt.size)
                if keep < MIN_KEEP:
                    continue
                if keep > keep_best and sim > sim_best:
                    best, keep_best, sim_best = i, keep, sim
            if best is None:
                self.misses += 1
                return None
            self.hits += 1
            return self.states.pop(best)
