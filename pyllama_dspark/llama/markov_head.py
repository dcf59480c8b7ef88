"""The draft's Markov head as an owned native handle (``bias(prev) = W2 . W1[prev]`` on the backend
its weights live on), for drafts drawn at T > 0 (:mod:`~pyllama_dspark.speculative.draft_sampling`)."""

from __future__ import annotations

import os

import numpy as np

from pyllama_dspark.errors import NativeError
from pyllama_dspark.llama import _native as nat
from pyllama_dspark.llama.backend import check_gguf_file
from pyllama_dspark.llama.handles import Owned


class MarkovHead(Owned):
    """The draft's Markov head on the backend its weights live on: bias(prev) = W2 . W1[prev]."""

    _what = "Markov head"

    def __init__(self, draft_path: str, use_gpu: bool = False, n_threads: int = 0):
        check_gguf_file(draft_path)
        self.handle = nat.markov_new(os.fsencode(os.fspath(draft_path)), 1 if use_gpu else 0, n_threads)
        if not self.handle:
            raise NativeError(f"loading the Markov head: {nat.error_message()}")
        self._closed = False
        self.rank = int(nat.markov_rank(self.handle))
        self.n_vocab = int(nat.markov_n_vocab(self.handle))
        self.n_vocab_draft = int(nat.markov_n_vocab_draft(self.handle))
        self.backend = nat.markov_backend_name(self.handle).decode()

    def close(self) -> None:
        if getattr(self, "handle", None):
            nat.markov_free(self.handle)
            self.handle = None
        self._closed = True

    def _ids(self, prev) -> np.ndarray:
        ids = np.ascontiguousarray(prev, dtype=np.int32).reshape(-1)
        if ids.size == 0:
            raise ValueError("need at least one previous token")
        if ids.min() < 0 or ids.max() >= self.n_vocab:
            raise ValueError(f"token ids must be in 0..{self.n_vocab - 1}")
        return ids

    def bias(self, prev) -> np.ndarray:
        self._alive()
        ids = self._ids(prev)
        out = np.empty((ids.size, self.n_vocab_draft), dtype=np.float32)
        nat.check(nat.markov_bias(self.handle, nat.ptr_i32(ids), ids.size, nat.ptr_f32(out)), "Markov bias")
        return out

    def w1_rows(self, prev) -> np.ndarray:
        self._alive()
        ids = self._ids(prev)
        out = np.empty((ids.size, self.rank), dtype=np.float32)
        nat.check(nat.markov_w1_rows(self.handle, nat.ptr_i32(ids), ids.size, nat.ptr_f32(out)), "Markov W1 rows")
        return out

    def bias_w1(self, prev) -> tuple:
        """(bias rows [n, n_vocab_draft], W1 rows [n, rank]) for prev, in one device call."""
        self._alive()
        ids = self._ids(prev)
        bias = np.empty((ids.size, self.n_vocab_draft), dtype=np.float32)
        w1 = np.empty((ids.size, self.rank), dtype=np.float32)
        nat.check(nat.markov_bias_w1(self.handle, nat.ptr_i32(ids), ids.size, nat.ptr_f32(bias), nat.ptr_f32(w1)),
                  "Markov bias + W1 rows")
        return bias, w1