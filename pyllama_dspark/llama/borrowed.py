"""A target context owned by llama-cpp-python's ``Llama``, borrowed with feature capture on."""

from __future__ import annotations

import weakref
from typing import Optional, Sequence, Tuple

import numpy as np
from llama_cpp import llama_cpp as ll

from pyllama_dspark.llama import _native as nat
from pyllama_dspark.llama.handles import ContextSettings, Draft, Target
from pyllama_dspark.errors import ClosedError


class BorrowedTarget(Target):
    """A target context owned by someone else (llama-cpp-python's ``Llama``), with capture enabled.

    Same interface as :class:`Target` (decode, argmax, features, tokenize, drafts attach to it), but
    ``close()`` frees only what this object made (the shim's capture handle and the drafts attached
    to it), never the context or the model.  The owner must close this object before it frees the
    context (the integration layer hooks the owner's close for that).  Capture stays enabled on the
    context afterwards (turning it off would force llama.cpp to re-reserve its graph).
    """

    _what = "borrowed target"

    def __init__(self, ctx, settings: ContextSettings, capture_layers: Sequence[int] = (),
                 allow_last_layer: bool = False, path: Optional[str] = None):
        if not ctx:
            raise ClosedError("the llama_context to borrow is NULL (its owner was closed?)")
        self._drafts: "weakref.WeakSet[Draft]" = weakref.WeakSet()
        self.handle = None
        self._eog = None
        # the owner's model file (``Llama.model_path``): what the cost profile and the schedule's
        # memory are keyed by, as for a target this package opens itself
        self.path = str(path) if path else None
        self.settings = settings
        self.ctx = ctx
        self.model = ll.llama_get_model(ctx)
        self._read_sizes()
        self.n_seq_max = int(ll.llama_n_seq_max(ctx))
        # still closed while capture starts: a failure there frees nothing (close() is a no-op)
        self._start_capture(capture_layers, allow_last_layer)
        self._closed = False
        self._init_buffers()

    def close(self) -> None:
        if self._closed:
            return
        self._release_capture()
        # borrowed: forget the pointers, free nothing
        self.ctx = self.model = self.vocab = self.memory = None
        self._closed = True

    def decode_foreign_batch(self, batch) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """Decode a ``llama_batch`` built by the owner (e.g. ``LlamaBatch.batch``) through the shim.

        The rows (token, pos, seq id, output flag) go into one llama_decode on the same context, as
        the owner's own ``llama_decode(ctx, batch)`` would, but their layer inputs are captured.
        Returns (positions, seq_ids) of the decoded rows, or None *without decoding* when the batch
        cannot take this path (embedding input, a row in several sequences, empty or > n_batch rows):
        the caller then decodes it itself (no features for those rows).  Raises NativeError when
        llama_decode fails.
        """
        self._alive()
        n = int(batch.n_tokens)
        if n <= 0 or n > self.n_batch or bool(batch.embd) or not batch.token:
            return None
        n_seq = np.ctypeslib.as_array(batch.n_seq_id, shape=(n,))
        if np.any(n_seq != 1):
            return None
        tokens = np.ctypeslib.as_array(batch.token, shape=(n,)).astype(np.int32)
        pos = np.ctypeslib.as_array(batch.pos, shape=(n,)).astype(np.int32)
        outputs = np.ctypeslib.as_array(batch.logits, shape=(n,)).astype(np.int8)
        seq_ids = np.fromiter((batch.seq_id[i][0] for i in range(n)), dtype=np.int32, count=n)
        rc = nat.target_decode(self.handle, nat.ptr_i32(tokens), nat.ptr_i32(pos), nat.ptr_i32(seq_ids),
                               nat.ptr_i8(outputs), n)
        self.n_decodes += 1
        nat.check(rc, "target decode (llama-cpp-python batch)")
        return pos, seq_ids
