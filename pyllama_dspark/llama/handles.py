"""Owned llama.cpp models and contexts (target and draft), each with a deterministic close() (the
draft's Markov head: :mod:`.markov_head`).

Every native pointer is owned by exactly one object here; ``close()`` frees it (idempotent), a
context manager closes on exit, and any use after close raises :class:`ClosedError`.  A target
closes the drafts attached to it first (the draft context reads the target's embeddings through
``ctx_other``).  Everything that llama.cpp would abort on is validated before the call.  A target
context owned by someone else is :class:`~pyllama_dspark.llama.borrowed.BorrowedTarget`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import time
import weakref
from typing import List, Optional, Sequence

import numpy as np
import llama_cpp
from llama_cpp import llama_cpp as ll

from pyllama_dspark.llama import _native as nat
from pyllama_dspark.llama import recurrent, rpc
from pyllama_dspark.llama.backend import check_gguf_file, ensure_backend
from pyllama_dspark.llama.backend_sampling import DeviceSamplers
from pyllama_dspark.llama.offload import resolve_n_gpu_layers
from pyllama_dspark.llama.settings import ContextSettings  # noqa: F401  (re-exported: its historical home)
from pyllama_dspark.llama.draft_meta import DraftMeta
from pyllama_dspark.errors import ClosedError, DraftMismatchError, ModelFileError, NativeError



class Owned:
    """Base: a closed flag, a context manager, and a guard for use-after-close."""

    _closed = True
    _what = "object"

    def _alive(self):
        if self._closed:
            raise ClosedError(f"{self._what} is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def close(self):  # pragma: no cover - overridden
        self._closed = True


class _ModelCtx(Owned):
    """A llama_model + one llama_context over it.

    ``llama_ms``: milliseconds spent inside llama.cpp's decodes on this context (a decode waits
    for the device before it returns; an injection does not, its wait counts in the next decode),
    so that what the loop spends around them (the host's own work per cycle) can be reported."""

    llama_ms = 0.0
    samplers: DeviceSamplers = DeviceSamplers(None, False)   # none until a context is made (llama/backend_sampling.py)

    def _llama(self, fn, *args, sync: bool = True):
        """``fn(*args)`` (a native decode), timed into :attr:`llama_ms`; ``sync``: wait for the
        device to finish it (llama_synchronize) inside the timed span."""
        t = time.perf_counter()
        rc = fn(*args)
        if sync:
            ll.llama_synchronize(self.ctx)
        self.llama_ms += (time.perf_counter() - t) * 1e3
        return rc

    def _load(self, path: str, settings: ContextSettings, ctx_other=None) -> None:
        settings.validate()
        ensure_backend(settings.verbose)
        self.path = check_gguf_file(path)
        mp = ll.llama_model_default_params()
        if settings.rpc or rpc.in_use():  # explicit devices: this model's --rpc servers, else local only
            devices = rpc.model_devices(settings.rpc)
            mp.devices = ctypes.cast(devices, ctypes.c_void_p)
            offload_devs = [d for d in devices if d]
        else:
            offload_devs = rpc.local_gpu_devices() if ll.llama_supports_gpu_offload() else []
        ngl = resolve_n_gpu_layers(settings.n_gpu_layers, self.path, settings.n_ctx, offload_devs)
        mp.n_gpu_layers = ngl
        self.settings = dataclasses.replace(settings, n_gpu_layers_resolved=ngl)
        if settings.tensor_split:
            split = (ctypes.c_float * int(ll.llama_max_devices()))(*settings.tensor_split)
            mp.tensor_split = split
        self.model = ll.llama_model_load_from_file(os.fsencode(self.path), mp)
        if not self.model:
            raise ModelFileError(f"llama.cpp could not load {self.path}")
        cp = settings.context_params()
        if ctx_other is not None:
            cp.ctx_other = ctx_other
        self.ctx = ll.llama_init_from_model(self.model, cp)
        if not self.ctx:
            ll.llama_model_free(self.model)
            self.model = None
            raise NativeError(f"llama.cpp could not create a context for {self.path}")
        self._read_sizes()
        self.samplers = DeviceSamplers(self.ctx, self.settings.device_readout)
        self._closed = False

    def _read_sizes(self) -> None:
        """The vocabulary, sizes and memory of ``self.model`` / ``self.ctx``."""
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.n_vocab = int(ll.llama_vocab_n_tokens(self.vocab))
        self.n_embd = int(ll.llama_model_n_embd(self.model))
        self.n_ctx = int(ll.llama_n_ctx(self.ctx))
        self.n_batch = int(ll.llama_n_batch(self.ctx))
        self.memory = ll.llama_get_memory(self.ctx)
        # a recurrent state (hybrid models) rolls back by snapshots, up to n_rs_seq positions (llama/recurrent.py)
        self.recurrent, self.n_rs_seq = recurrent.is_recurrent(self.model), int(ll.llama_n_rs_seq(self.ctx))

    def _free_model_ctx(self) -> None:
        if getattr(self, "samplers", None) is not None:
            self.samplers.close(ctx_alive=bool(getattr(self, "ctx", None)))
        if getattr(self, "ctx", None):
            ll.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            ll.llama_model_free(self.model)
            self.model = None

    # ---- memory --------------------------------------------------------------------------------
    def seq_rm(self, seq_id: int, p0: int, p1: int = -1) -> None:
        self._alive()
        if not ll.llama_memory_seq_rm(self.memory, seq_id, p0, p1):
            raise NativeError(f"llama_memory_seq_rm({seq_id}, {p0}, {p1}) failed on {self._what}")

    def seq_pos_max(self, seq_id: int) -> int:
        self._alive()
        return int(ll.llama_memory_seq_pos_max(self.memory, seq_id))

    def seq_pos_range(self, seq_id: int) -> List[int]:
        """[smallest, largest] position the memory holds for the sequence ([-1, -1]: none)."""
        self._alive()
        return [int(ll.llama_memory_seq_pos_min(self.memory, seq_id)),
                int(ll.llama_memory_seq_pos_max(self.memory, seq_id))]

    def can_resume_at(self, seq_id: int, pos: int) -> bool:
        """Whether the memory still holds what a token at ``pos`` attends to once the positions
        from ``pos`` on are removed.  A sliding-window cache that is not full-size (``swa_full``
        off) overwrites positions older than the window: resuming far behind the newest position
        then needs the prompt decoded again (llama-server's rule: the sequence's smallest kept
        position must be below ``pos - n_swa``).  Removing a rejected draft tail is always fine."""
        self._alive()
        n_swa = int(ll.llama_model_n_swa(self.model))
        if pos <= 0 or n_swa <= 0:
            return True
        pos_min = int(ll.llama_memory_seq_pos_min(self.memory, seq_id))
        return pos_min <= 0 or pos_min < pos - n_swa

    def clear(self) -> None:
        self._alive()
        ll.llama_memory_clear(self.memory, True)

    # ---- outputs -------------------------------------------------------------------------------
    def argmax(self, i0: int, n: int, ids: np.ndarray, margins: np.ndarray) -> None:
        """ids[:n], margins[:n] <- argmax and top-2 gap of output rows i0..i0+n-1."""
        self._alive()
        nat.check(nat.argmax_rows(self.ctx, i0, n, nat.ptr_i32(ids), nat.ptr_f32(margins)), "argmax")

    def argmax_buffers(self, b: "RowBuffers", i0: int, n: int) -> None:
        """:meth:`argmax` of output rows i0.. into ``b.ids`` / ``b.margin``."""
        self._alive()
        nat.check(nat.argmax_rows(self.ctx, i0, n, *b.p_out), "argmax")

    def logits(self, i: int) -> np.ndarray:
        """A copy of output row i of the last decode (float32 [n_vocab])."""
        self._alive()
        ptr = ll.llama_get_logits_ith(self.ctx, i)
        if not ptr:
            raise NativeError(f"row {i} of the last decode has no logits (not flagged as output)")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def logits_view(self, i: int) -> np.ndarray:
        """Output row i of the last decode without a copy (float32 [n_vocab]); valid until the next
        decode on this context: copy it if it must outlive that."""
        self._alive()
        ptr = ll.llama_get_logits_ith(self.ctx, i)
        if not ptr:
            raise NativeError(f"row {i} of the last decode has no logits (not flagged as output)")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))


class RowBuffers:
    """A decode's rows (token, position, sequence, output flag) and its read-out (argmax, top-2
    gap), ``cap`` of each, with their ctypes pointers made once (a pointer costs a few microseconds
    to make, and the loop's verify decode uses them every cycle)."""

    def __init__(self, cap: int):
        self.tok = np.zeros(cap, dtype=np.int32)
        self.pos = np.zeros(cap, dtype=np.int32)
        self.seq = np.zeros(cap, dtype=np.int32)
        self.out = np.ones(cap, dtype=np.int8)
        self.ids = np.zeros(cap, dtype=np.int32)
        self.margin = np.zeros(cap, dtype=np.float32)
        self.p_rows = (nat.ptr_i32(self.tok), nat.ptr_i32(self.pos), nat.ptr_i32(self.seq), nat.ptr_i8(self.out))
        self.p_out = (nat.ptr_i32(self.ids), nat.ptr_f32(self.margin))


class Target(_ModelCtx):
    """The target model, its context and the shim's capture/decode handle."""

    _what = "target"

    def __init__(self, path: str, settings: Optional[ContextSettings] = None,
                 capture_layers: Sequence[int] = (), allow_last_layer: bool = False):
        self._drafts: "weakref.WeakSet[Draft]" = weakref.WeakSet()
        self.handle = None
        self._eog = None
        self._load(path, settings or ContextSettings())
        self._start_capture(capture_layers, allow_last_layer)
        self._init_buffers()

    def _start_capture(self, capture_layers: Sequence[int], allow_last_layer: bool) -> None:
        """Check the layer ids against the target and create the shim's capture/decode handle
        (on failure: ``close()``, then raise)."""
        self.n_layer = int(ll.llama_model_n_layer(self.model))
        ids = np.asarray(list(capture_layers), dtype=np.int32)
        hi = self.n_layer if allow_last_layer else self.n_layer - 1
        bad = [int(i) for i in ids if i < 0 or i > hi]
        if bad:
            self.close()
            raise DraftMismatchError(
                f"target layer ids {bad} are outside 0..{hi} for this target (n_layer = {self.n_layer})")
        self.capture_layers = [int(i) for i in ids]
        self.handle = nat.target_new(self.ctx, nat.ptr_i32(ids) if len(ids) else None, len(ids),
                                     1 if allow_last_layer else 0)
        if not self.handle:
            msg = nat.error_message()
            self.close()
            raise NativeError(f"enabling target feature capture: {msg}")

    def _init_buffers(self) -> None:
        self.feature_width = int(nat.target_feature_width(self.handle))
        self._ones = np.ones(self.n_batch, dtype=np.int8)
        self._zeros = np.zeros(self.n_batch, dtype=np.int8)
        self._seq = np.zeros(self.n_batch, dtype=np.int32)
        self._pos = np.arange(self.n_batch, dtype=np.int32)
        self.n_decodes = 0

    def close(self) -> None:
        if self._closed and not getattr(self, "model", None):
            return
        self._release_capture()
        self._free_model_ctx()
        self._closed = True

    def _release_capture(self) -> None:
        """Close the attached drafts, then free the shim's handle."""
        for d in list(getattr(self, "_drafts", ())):
            d.close()
        if getattr(self, "handle", None):
            nat.target_free(self.handle)
            self.handle = None

    # ---- tokens --------------------------------------------------------------------------------
    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = True) -> List[int]:
        self._alive()
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        cap = len(data) + 16
        buf = (ll.llama_token * cap)()
        n = ll.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (ll.llama_token * cap)()
            n = ll.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise NativeError("llama_tokenize failed")
        return list(buf[:n])

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        self._alive()
        buf = ctypes.create_string_buffer(64)
        n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> bytes:
        return b"".join(self.token_to_piece(t, special) for t in tokens)

    def is_eog(self, token: int) -> bool:
        return bool(self.eog_mask[token]) if 0 <= token < self.n_vocab else False

    @property
    def eog_mask(self) -> np.ndarray:
        """bool [n_vocab]: end-of-generation tokens (computed once)."""
        if self._eog is None:
            self._alive()
            self._eog = np.fromiter((ll.llama_vocab_is_eog(self.vocab, t) for t in range(self.n_vocab)),
                                    dtype=bool, count=self.n_vocab)
        return self._eog

    def meta(self, key: str) -> Optional[str]:
        self._alive()
        buf = ctypes.create_string_buffer(1 << 16)
        n = ll.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    # ---- decoding ------------------------------------------------------------------------------
    def decode(self, tokens: np.ndarray, pos0: int, seq_id: int = 0, all_outputs: bool = True) -> None:
        """Decode tokens at pos0.. of one sequence in one llama_decode (features captured)."""
        self._alive()
        n = len(tokens)
        if n > self.n_batch:
            raise ValueError(f"{n} tokens exceed n_batch={self.n_batch}")
        if pos0 + n > self.n_ctx:
            from pyllama_dspark.errors import ContextOverflowError
            raise ContextOverflowError(f"positions up to {pos0 + n} exceed the context ({self.n_ctx})")
        pos = self._pos[:n] + np.int32(pos0) if pos0 else self._pos[:n]
        outputs = self._ones if all_outputs else self._last_only(n)
        seq = self._seq[:n] if seq_id == 0 else np.full(n, seq_id, dtype=np.int32)
        rc = self._llama(nat.target_decode, self.handle, nat.ptr_i32(tokens), nat.ptr_i32(np.ascontiguousarray(pos)),
                         nat.ptr_i32(seq), nat.ptr_i8(outputs), n)
        self.n_decodes += 1
        nat.check(rc, "target decode")

    def decode_rows(self, tokens: np.ndarray, pos: np.ndarray, seq_ids: np.ndarray, outputs: np.ndarray) -> None:
        """General form: one row per entry (batched sequences)."""
        self._alive()
        n = len(tokens)
        rc = self._llama(nat.target_decode, self.handle, nat.ptr_i32(tokens), nat.ptr_i32(pos), nat.ptr_i32(seq_ids),
                         nat.ptr_i8(outputs), n)
        self.n_decodes += 1
        nat.check(rc, "target decode")

    def decode_buffers(self, b: "RowBuffers", n: int) -> None:
        """:meth:`decode_rows` of the first ``n`` rows of ``b`` (pointers made once: the loop's
        verify rows, every cycle)."""
        self._alive()
        rc = self._llama(nat.target_decode, self.handle, *b.p_rows, n)
        self.n_decodes += 1
        nat.check(rc, "target decode")

    def _last_only(self, n: int) -> np.ndarray:
        out = self._zeros[:n].copy()
        out[-1] = 1
        return out

    def copy_features_at(self, row0: int, n: int, address: int) -> None:
        """:meth:`features` written at ``address``: n rows of ``feature_width`` float32 the caller
        owns (a row of a buffer it grows), with no array or pointer object made per call."""
        self._alive()
        nat.check(nat.target_copy_features_at(self.handle, row0, n, address), "copy target features")

    def features(self, row0: int, n: int) -> np.ndarray:
        """Captured features of rows row0..row0+n-1 of the last decode: [n, n_layers*n_embd]."""
        self._alive()
        out = np.empty((n, self.feature_width), dtype=np.float32)
        nat.check(nat.target_copy_features(self.handle, row0, n, nat.ptr_f32(out)), "copy target features")
        return out


class Draft(_ModelCtx):
    """A DFlash/DSpark draft attached to a Target (shares its embeddings / lm_head)."""

    _what = "draft"

    def __init__(self, path: str, target: Target, settings: Optional[ContextSettings] = None):
        target._alive()
        self.handle = None
        self.target = target
        self._load(path, settings or target.settings, ctx_other=target.ctx)
        self.handle = nat.draft_new(self.ctx, target.handle, os.fsencode(self.path))
        if not self.handle:
            msg = nat.error_message()
            self.close()
            raise DraftMismatchError(msg)
        m = nat.DraftMeta()
        nat.check(nat.draft_get_meta(self.handle, ctypes.byref(m)), "draft metadata")
        self.meta = DraftMeta.from_native(m)
        target._drafts.add(self)
        self._pos0 = np.zeros(1, dtype=np.int32)
        self._seq = np.zeros(1, dtype=np.int32)

    def close(self) -> None:
        if self._closed and not getattr(self, "model", None):
            return
        if getattr(self, "handle", None):
            nat.draft_free(self.handle)
            self.handle = None
        self._free_model_ctx()
        self._closed = True

    def inject_captured(self, row0: int, n: int, pos0: int, seq_id: int = 0) -> None:
        """Inject the target's captured rows row0.. (last target decode) at pos0.. of seq_id."""
        self._alive()
        self._hidden_rows = 0
        nat.check(self._llama(nat.draft_inject_captured, self.handle, row0, n, pos0, seq_id, sync=False),
                  "draft inject")

    def inject(self, rows: np.ndarray, pos: np.ndarray, seq_id: int = 0) -> None:
        self._alive()
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        pos = np.ascontiguousarray(pos, dtype=np.int32)
        if rows.ndim != 2 or rows.shape[1] != self.target.feature_width or len(pos) != rows.shape[0]:
            raise ValueError(f"feature rows must be [n, {self.target.feature_width}] with n positions")
        self._hidden_rows = 0
        nat.check(self._llama(nat.draft_inject, self.handle, nat.ptr_f32(rows), rows.shape[0], nat.ptr_i32(pos), seq_id,
                              sync=False),
                  "draft inject")

    def decode_block(self, tokens: np.ndarray, pos0: int, seq_id: int = 0, hidden: bool = False) -> None:
        """One block [anchor, mask...] at pos0.. with every row flagged as output.

        ``hidden``: also extract every row's hidden state (see :meth:`hidden`); embeddings are on
        for this decode only (an injection batch with them on would compute outputs)."""
        self._alive()
        self._pos0[0] = pos0
        self._seq[0] = seq_id
        self._hidden_rows = 0
        if hidden:
            ll.llama_set_embeddings(self.ctx, True)
        try:
            nat.check(self._llama(nat.draft_decode_blocks, self.handle, nat.ptr_i32(tokens), len(tokens),
                                  nat.ptr_i32(self._pos0), nat.ptr_i32(self._seq), 1), "draft block decode")
        finally:
            if hidden:
                ll.llama_set_embeddings(self.ctx, False)
        if hidden:
            self._hidden_rows = len(tokens)

    def decode_blocks(self, tokens: np.ndarray, block_len: int, pos0: np.ndarray, seq_ids: np.ndarray,
                      hidden: bool = False) -> None:
        """Several equal-length blocks (one per sequence) in one decode; ``hidden`` as for
        :meth:`decode_block` (rows are numbered across the blocks)."""
        self._alive()
        self._hidden_rows = 0
        if hidden:
            ll.llama_set_embeddings(self.ctx, True)
        try:
            nat.check(self._llama(nat.draft_decode_blocks, self.handle, nat.ptr_i32(tokens), block_len,
                                  nat.ptr_i32(pos0), nat.ptr_i32(seq_ids), len(seq_ids)), "draft block decode")
        finally:
            if hidden:
                ll.llama_set_embeddings(self.ctx, False)
        if hidden:
            self._hidden_rows = len(tokens)

    def confidence(self, i0: int, n: int, out: np.ndarray) -> None:
        self._alive()
        nat.check(nat.draft_confidence(self.handle, i0, n, nat.ptr_f32(out)), "draft confidence")

    def hidden(self, i: int) -> np.ndarray:
        """Hidden state h of row i of the last block decode, which must have been made with
        ``hidden=True`` (the graph's ``t_embd``: output_norm, the input of the lm_head and of the
        confidence head).  A view (float32 [n_embd]) valid until the next decode or injection."""
        self._alive()
        if not (0 <= i < getattr(self, "_hidden_rows", 0)):
            raise NativeError(f"no hidden state for row {i}: decode the block with hidden=True first")
        ptr = ll.llama_get_embeddings_ith(self.ctx, i)
        if not ptr:
            raise NativeError(f"row {i} of the last draft decode has no hidden state")
        return np.ctypeslib.as_array(ptr, shape=(self.n_embd,))
