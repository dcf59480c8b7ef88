"""Rolling back a target whose memory holds a recurrent state (hybrid models: Qwen3.5, LFM2,
Nemotron-H, ...), which cannot simply forget its newest positions as an attention cache does.

llama.cpp's recurrent memory keeps, per sequence, the states after each of the last ``n_rs_seq``
positions of the latest decode (``llama_context_params.n_rs_seq``, snapshots); ``seq_rm`` then cuts
a tail of up to ``n_rs_seq`` positions of that decode, once, and refuses anything else without
changing the memory (``src/llama-memory-recurrent.cpp``, ``llama_memory_hybrid::seq_rm``).  The
loop's rollback of a rejected draft tail is always such a cut when ``n_rs_seq`` is the draft's
block (:func:`snapshots_for`).  Deeper undos (the cost curve's trial decodes, the oracle's look
ahead) take a :class:`Checkpoint` of the recurrent state first and restore it after
(``llama_state_seq_get_data_ext`` / ``set_data_ext`` with ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``,
as llama-server's speculative checkpoints do); a prompt-cache cut that neither can serve decodes
the prompt again (:func:`try_seq_rm`).
"""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np
from llama_cpp import llama_cpp as ll

from pyllama_dspark.errors import NativeError

__all__ = ["is_recurrent", "snapshots_for", "try_seq_rm", "Checkpoint", "undone", "footprint"]

#: llama_state_seq_flags: the recurrent part only (an attention cache is cut by position instead)
PARTIAL_ONLY = int(ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)


def is_recurrent(model) -> bool:
    """Whether a llama_model's memory holds a recurrent state (recurrent or hybrid)."""
    # bool llama_model_is_recurrent(const struct llama_model * model);
    # bool llama_model_is_hybrid(const struct llama_model * model);
    return bool(ll.llama_model_is_recurrent(model)) or bool(ll.llama_model_is_hybrid(model))


def snapshots_for(block: int) -> int:
    """``n_rs_seq`` for a target verifying blocks of up to ``block`` drafts: a rejected tail is at
    most ``block`` positions of the verify decode (its anchor stays), as ``need_n_rs_seq()``
    gives llama-server's target (``common/common.h``: the draft's n_max)."""
    return max(0, int(block))


def try_seq_rm(target, seq_id: int, p0: int, p1: int = -1) -> bool:
    """``llama_memory_seq_rm``; False (the memory unchanged) where a recurrent state cannot be cut
    there."""
    # bool llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
    target._alive()
    return bool(ll.llama_memory_seq_rm(target.memory, seq_id, p0, p1))


class Checkpoint:
    """The recurrent state of one sequence at its newest position, copied to the host."""

    def __init__(self, target, seq_id: int):
        # size_t llama_state_seq_get_size_ext(struct llama_context * ctx, llama_seq_id seq_id,
        #                                     llama_state_seq_flags flags);
        # size_t llama_state_seq_get_data_ext(struct llama_context * ctx, uint8_t * dst, size_t size,
        #                                     llama_seq_id seq_id, llama_state_seq_flags flags);
        target._alive()
        self.pos = target.seq_pos_max(seq_id)
        n = int(ll.llama_state_seq_get_size_ext(target.ctx, seq_id, PARTIAL_ONLY))
        self.data = (ctypes.c_uint8 * max(n, 1))()
        got = int(ll.llama_state_seq_get_data_ext(target.ctx, self.data, n, seq_id, PARTIAL_ONLY))
        if got != n:
            raise NativeError(f"llama_state_seq_get_data_ext wrote {got} of {n} bytes of sequence {seq_id}")
        self.nbytes = n

    def restore(self, target, seq_id: int) -> None:
        """The sequence as it was when the checkpoint was taken: its recurrent state restored, the
        attention cache cut after the checkpoint's position."""
        # size_t llama_state_seq_set_data_ext(struct llama_context * ctx, const uint8_t * src, size_t size,
        #                                     llama_seq_id dest_seq_id, llama_state_seq_flags flags);
        target._alive()
        if int(ll.llama_state_seq_set_data_ext(target.ctx, self.data, self.nbytes, seq_id, PARTIAL_ONLY)) == 0:
            raise NativeError(f"llama_state_seq_set_data_ext could not restore sequence {seq_id}")
        target.seq_rm(seq_id, self.pos + 1, -1)


@contextlib.contextmanager
def undone(target, seq_id: int, pos0: int):
    """Decodes on ``seq_id`` from ``pos0`` on that are undone on exit: the positions from ``pos0``
    cut, and on a target with a recurrent state its state restored from a checkpoint taken at
    entry (the sequence then ends at ``pos0 - 1``)."""
    ckpt = Checkpoint(target, seq_id) if getattr(target, "recurrent", False) else None
    try:
        yield
    finally:
        if ckpt is not None:
            ckpt.restore(target, seq_id)
        target.seq_rm(seq_id, pos0, -1)


def footprint(target) -> dict:
    """What the recurrent state costs a sequence: one state's bytes (read after a one-token decode
    into sequence 0, which must be empty, and removed again) and its ``n_rs_seq`` snapshots'."""
    if target.seq_pos_max(0) >= 0:
        raise ValueError("footprint() needs an empty sequence 0")
    target.decode(np.zeros(1, dtype=np.int32), 0, 0)
    try:
        state = int(ll.llama_state_seq_get_size_ext(target.ctx, 0, PARTIAL_ONLY))
    finally:
        target.seq_rm(0, 0, -1)
    return {"n_rs_seq": int(target.n_rs_seq), "state_bytes": state, "snapshot_bytes": int(target.n_rs_seq) * state}


class VerifyCheckpoints:
    """A rejected tail on a recurrent state without snapshots (``n_rs_seq`` 0: llama.cpp has none
    for qwen3next), as llama-server's speculative checkpoints do it: each drafting sequence's state
    is copied before the verify decode; where the block is cut, the state is restored (the
    sequence ends before the anchor again) and the anchor and the accepted drafts are decoded once
    more, together for all sequences, after the step has read the verify's rows."""

    def __init__(self, target):
        self.target = target
        self._ckpt: dict = {}
        self._replay: list = []
        self.n_restored = 0

    @staticmethod
    def needed(target) -> bool:
        return bool(getattr(target, "recurrent", False)) and int(getattr(target, "n_rs_seq", 0)) == 0

    def take(self, seq_id: int) -> None:
        self._ckpt[seq_id] = Checkpoint(self.target, seq_id)

    def rollback(self, seq_id: int, pos0: int, kept) -> None:
        """Undo the verify of ``seq_id`` but for ``kept`` (the anchor and the accepted drafts, at ``pos0``..)."""
        self._ckpt.pop(seq_id).restore(self.target, seq_id)
        self._replay.append((seq_id, int(pos0), [int(t) for t in kept]))
        self.n_restored += 1

    def replay(self) -> None:
        """Decode the kept rows of every restored sequence (no outputs); forget the other checkpoints."""
        self._ckpt.clear()
        if not self._replay:
            return
        rows = [(t, p + i, s) for s, p, kept in self._replay for i, t in enumerate(kept)]
        self._replay = []
        tok, pos, seq = (np.asarray(c, dtype=np.int32) for c in zip(*rows))
        self.target.decode_rows(tok, pos, seq, np.zeros(len(rows), dtype=np.int8))
