"""DSpark as llama-cpp-python's own speculative drafter (a ``LlamaDraftModel``).

    from llama_cpp import Llama
    from pyllama_dspark import DSparkDraftModel

    llm = Llama("target.gguf", n_ctx=4096, flash_attn=True)
    drafter = DSparkDraftModel(llm, "draft.gguf", n_max=7)     # attaches itself: llm.draft_model
    llm.create_chat_completion([{"role": "user", "content": "Hi"}], temperature=0)   # unchanged
    drafter.n_drafted, drafter.n_accepted                        # the speculative path at work

How llama-cpp-python drives it (``Llama.generate``): it evaluates [anchor, drafts] with its own
``eval`` (n_batch chunks through ``LlamaContext.decode``), samples every row with its own sampler,
keeps the drafts that equal what it sampled, rolls its KV back with
``LlamaContext.kv_cache_seq_rm(-1, n_tokens, -1)`` and calls ``draft_model(input_ids)`` with the
committed tokens plus the new anchor.  The drafter only sees that call, after ``eval`` returned, and
llama.cpp keeps the captured layer inputs of the *last* decode only.  So:

Features for every chunk.  Attaching replaces ``decode`` on this Llama's ``LlamaContext`` instance
(not the class) by one that sends the very same rows (tokens, positions, sequence, output flags) to
the same context through the shim's capture batch (:meth:`BorrowedTarget.decode_foreign_batch`)
and, right after each decode, injects that chunk's captured rows into the draft KV at their
positions.  A prompt of any length, chunked by n_batch, thus lands in the draft chunk by chunk.

KV sync.  The draft KV mirrors the target KV for positions ``< covered``:
* each hooked decode at positions p0..p0+n-1 first drops draft positions >= p0 (llama-cpp-python
  always drops the target's tail before it evaluates there), then injects the rows;
* ``kv_cache_seq_rm`` (rejected drafts, prompt-prefix reuse in ``generate``) is mirrored on the
  draft and lowers ``covered``; ``kv_cache_clear``, ``kv_cache_seq_shift`` and ``load_state``
  (llama-cpp-python's prompt cache) empty the draft and set ``covered`` to 0;
* ``draft_model(input_ids)``: the anchor sits at ``pos0 = len(input_ids) - 1 == llm.n_tokens``.  If
  ``covered < pos0`` (after a state restore, or a Llama that decoded before attaching) the missing
  positions are re-derived once: the target re-decodes ``input_ids[covered:pos0]`` (same tokens,
  same positions, capture on) and the rows are injected; then the block is drafted.
Anything the hook cannot mirror (an embedding batch, rows in several sequences) empties the draft
and lets the next call re-derive.  Proposals never change what llama-cpp-python emits: it verifies
every draft with its own sampler, so the plug-in is as lossless as llama-cpp-python's speculative
path itself (at T=0: exactly the target's greedy tokens).

Llama settings touched on attach: ``llm._logits_all = True`` (every verify row needs logits; what
``Llama(draft_model=...)`` sets in its constructor) and, when ``llm.scores`` has fewer than n_ctx
rows, a full-size ``scores`` array (llama-cpp-python 0.3.36's speculative path otherwise fails
once positions pass n_batch).  ``detach()`` / ``close()`` restore the Llama's methods, its previous
``draft_model`` and ``_logits_all``.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Any, List, Optional

import numpy as np
from llama_cpp import llama_cpp as ll
from llama_cpp.llama_speculative import LlamaDraftModel

from pyllama_dspark.llama.amx import check_model
from pyllama_dspark.speculative.drafter import DraftModelProposer, check_n_max, clamp_n_max
from pyllama_dspark.errors import ClosedError, UnsupportedArchError
from pyllama_dspark.gguf.info import read_draft_info, validate_pair
from pyllama_dspark.gguf.target_info import read_target_info
from pyllama_dspark.llama.borrowed import BorrowedTarget
from pyllama_dspark.llama.handles import ContextSettings, Draft, Owned

_FA_NAMES = {
    int(ll.LLAMA_FLASH_ATTN_TYPE_AUTO): "auto",
    int(ll.LLAMA_FLASH_ATTN_TYPE_ENABLED): "on",
    int(ll.LLAMA_FLASH_ATTN_TYPE_DISABLED): "off",
}

_EMPTY = np.zeros(0, dtype=np.intc)


def llama_settings(llm) -> ContextSettings:
    """The context settings of a ``Llama`` (used for a draft context that sits beside it)."""
    cp = llm.context_params
    return ContextSettings(
        n_ctx=int(llm.n_ctx()), n_batch=int(llm.n_batch), n_ubatch=int(cp.n_ubatch),
        n_threads=int(cp.n_threads), n_threads_batch=int(cp.n_threads_batch),
        flash_attn=_FA_NAMES.get(int(cp.flash_attn_type), "auto"),
        # llama-cpp-python's n_gpu_layers: -1 is every layer (llama.cpp's "all"), 0 none
        n_gpu_layers=_llama_ngl(int(getattr(llm.model_params, "n_gpu_layers", 0))), verbose=bool(llm.verbose))


def _llama_ngl(n: int):
    return "all" if n < 0 else n


def llama_ctx(llm):
    """The live ``LlamaContext`` of a ``Llama`` (clear errors for anything else)."""
    from llama_cpp import Llama

    if not isinstance(llm, Llama):
        raise TypeError(f"expected a llama_cpp.Llama, got {type(llm).__name__}")
    ctx = getattr(llm, "_ctx", None)
    if ctx is None or not getattr(ctx, "ctx", None):
        raise ClosedError("this Llama is closed (its llama_context was freed)")
    return ctx


def borrow_target(llm, draft_path: str):
    """Validate a draft against a Llama's model file, then enable capture on the Llama's context.

    Returns (BorrowedTarget, settings, warnings)."""
    ctx = llama_ctx(llm)
    dinfo = read_draft_info(draft_path)
    tinfo = read_target_info(llm.model_path)
    found = list(validate_pair(dinfo, tinfo) or [])
    if tinfo.hybrid:
        raise UnsupportedArchError(
            f"{os.path.basename(llm.model_path)}: {tinfo.arch} keeps a recurrent state beside its attention cache, "
            f"and a Llama rolls rejected drafts back with kv_cache_seq_rm(-1, ...), which a recurrent state cannot "
            f"serve (its context also has no snapshots: n_rs_seq 0). Draft on it with "
            f"DSpark(target_path, draft_path) instead (docs/targets.md)")
    check_model(llm.model)      # AMX-repacked weights would crash once capture is on
    settings = llama_settings(llm)
    target = BorrowedTarget(ctx.ctx, settings, capture_layers=dinfo.target_layer_ids,
                            allow_last_layer=bool(tinfo.accepts_final_layer_id), path=llm.model_path)
    return target, settings, found


def close_with_context(obj, llama_context) -> None:
    """Close ``obj`` right before ``llama_context`` frees its native context (weakly held)."""
    ref = weakref.ref(obj)

    def _close_first():
        o = ref()
        if o is not None:
            o.close()

    llama_context._exit_stack.callback(_close_first)


class DSparkDraftModel(Owned, LlamaDraftModel):
    """A DSpark/DFlash draft attached to an existing ``llama_cpp.Llama`` as its ``draft_model``.

    ``n_max``: draft tokens per block (clamped to what the draft produces, with a warning).
    ``refill``: re-derive missing features by re-decoding the committed tokens (see the module
    notes); False turns drafting off for such a sequence instead.
    ``trace``: keep ``(pos0, anchor, drafts)`` of every proposal in ``self.trace`` (debugging, tests).
    ``schedule``: ``"auto"`` (default): hand llama-cpp-python only the drafts that pay on this
    machine's cost curve (none at all, and no draft work, while drafting does not pay);
    ``"off"``: every block in full (llama.cpp's fixed block); or a :class:`~.policy.VerifyPolicy`.
    Counters: ``n_calls``, ``n_proposed`` (tokens returned), ``n_drafted`` / ``n_accepted`` (drafts
    whose verification outcome was seen / of those, the ones llama-cpp-python kept), ``n_refilled``
    (positions re-derived), ``n_skipped`` (calls answered with no draft).
    """

    _what = "DSpark draft model"

    def __init__(self, llm, draft_path: str, *, n_max: int = 7, refill: bool = True, trace: bool = False,
                 schedule="auto", cost_profile=None):
        self._closed = True
        check_n_max(n_max)
        ctx = llama_ctx(llm)
        if isinstance(llm.draft_model, DSparkDraftModel) and not llm.draft_model._closed:
            raise ValueError("this Llama already has a DSpark draft model attached; close() it first")
        self.target, self.settings, self.warnings = borrow_target(llm, draft_path)
        try:
            self.draft = Draft(draft_path, self.target, self.settings)
            self.proposer = DraftModelProposer(self.draft)
            self.n_max = clamp_n_max(n_max, self.proposer)
            from pyllama_dspark.speculative.policy_factory import make_policy

            # a first-use cost measurement decodes in the Llama's context: its cached prefix is gone
            self.policy = make_policy(self.target, self.draft, "off" if schedule is None else schedule,
                                      proposer=self.proposer, cost_profile=cost_profile, gamma=self.n_max,
                                      on_measured=llm.reset, progress=bool(llm.verbose))
        except BaseException:
            self.target.close()
            raise
        self.refill = bool(refill)
        self.trace: Optional[List[tuple]] = [] if trace else None
        self.block = self.draft.meta.block_size
        self._llm = weakref.ref(llm)
        self._lctx = ctx
        self.covered = 0
        self._pending = None            # (pos0, anchor, drafts) of the last proposal
        self.n_calls = self.n_proposed = self.n_drafted = self.n_accepted = 0
        self.n_refilled = self.n_skipped = 0
        self._install(llm, ctx)
        self._closed = False
        close_with_context(self, ctx)

    # ---- attach / detach ---------------------------------------------------------------------
    def _install(self, llm, ctx) -> None:
        self._saved = {"draft_model": llm.draft_model, "_logits_all": llm._logits_all}
        orig_decode, orig_rm, orig_clear = ctx.decode, ctx.kv_cache_seq_rm, ctx.kv_cache_clear
        orig_shift, orig_load = ctx.kv_cache_seq_shift, llm.load_state
        me = weakref.ref(self)

        def decode(batch):
            d = me()
            if d is None or d._closed:
                return orig_decode(batch)
            return d._on_decode(batch, orig_decode)

        def kv_cache_seq_rm(seq_id: int, p0: int, p1: int) -> bool:
            ok = orig_rm(seq_id, p0, p1)
            d = me()
            if ok and d is not None and not d._closed and seq_id in (-1, 0):
                d._on_seq_rm(p0, p1)
            return ok

        def kv_cache_clear():
            orig_clear()
            d = me()
            if d is not None and not d._closed:
                d._forget()

        def kv_cache_seq_shift(seq_id: int, p0: int, p1: int, shift: int):
            orig_shift(seq_id, p0, p1, shift)
            d = me()
            if d is not None and not d._closed:
                d._forget()

        def load_state(state):
            orig_load(state)
            d = me()
            if d is not None and not d._closed:
                d._forget()

        ctx.decode, ctx.kv_cache_seq_rm, ctx.kv_cache_clear = decode, kv_cache_seq_rm, kv_cache_clear
        ctx.kv_cache_seq_shift = kv_cache_seq_shift
        llm.load_state = load_state
        llm._logits_all = True
        n_ctx = int(llm.n_ctx())
        if llm.scores.shape[0] < n_ctx:
            # rows are touched only where written: the memory is committed lazily
            llm.scores = np.ndarray((n_ctx, llm.scores.shape[1]), dtype=np.single)
        llm.draft_model = self

    def _uninstall(self) -> None:
        llm, ctx = self._llm(), self._lctx
        for name in ("decode", "kv_cache_seq_rm", "kv_cache_clear", "kv_cache_seq_shift"):
            ctx.__dict__.pop(name, None)
        if llm is not None:
            llm.__dict__.pop("load_state", None)
            if llm.draft_model is self:
                llm.draft_model = self._saved["draft_model"]
                llm._logits_all = self._saved["_logits_all"] or llm.draft_model is not None

    def close(self) -> None:
        """Detach from the Llama (which keeps working without speculation) and free the draft."""
        if self._closed:
            return
        self._closed = True
        try:
            from pyllama_dspark.speculative import policy_memory

            policy_memory.save(self.policy)   # what auto learned, for the next process
            self._uninstall()
        finally:
            self.target.close()   # closes the draft context first
            self._pending = None

    detach = close

    # ---- KV mirroring ------------------------------------------------------------------------
    def _forget(self) -> None:
        self.proposer.reset(0)
        self.covered = 0

    def _on_seq_rm(self, p0: int, p1: int) -> None:
        p0 = max(0, int(p0))
        if p1 is None or p1 < 0:
            self.proposer.rollback(p0, 0)
            self.covered = min(self.covered, p0)
        elif p1 > p0:
            self.proposer.catch_up(0)
            self.draft.seq_rm(0, p0, int(p1))   # a hole: mirror it exactly

    def _on_decode(self, batch, orig_decode):
        res = self.target.decode_foreign_batch(batch.batch)
        if res is None:                          # not a plain single-sequence batch: no features
            orig_decode(batch)
            self._forget()
            return None
        pos, seq = res
        if np.any(seq != 0):
            self._forget()
            return None
        p0, n = int(pos[0]), len(pos)
        contiguous = bool(np.all(pos == np.arange(p0, p0 + n, dtype=pos.dtype)))
        self.proposer.rollback(p0, 0)
        if contiguous and p0 <= self.covered:
            # kept on the host until the next block is drafted (no draft work while none is)
            self.proposer.observe_later(0, n, p0, 0)
            self.covered = p0 + n
        else:
            self.covered = min(self.covered, p0 if contiguous else int(pos.min()))
        return None

    def _refill(self, input_ids: np.ndarray, pos0: int) -> None:
        """Re-derive features for positions covered..pos0-1 by re-decoding them on the target."""
        tgt, start = self.target, self.covered
        tgt.seq_rm(0, start, -1)
        self.proposer.rollback(start, 0)
        toks = np.ascontiguousarray(input_ids[start:pos0], dtype=np.int32)
        for c0 in range(0, len(toks), tgt.n_batch):
            chunk = toks[c0:c0 + tgt.n_batch]
            tgt.decode(chunk, start + c0, 0, all_outputs=False)
            self.proposer.observe(0, len(chunk), start + c0, 0)
        self.n_refilled += len(toks)
        self.covered = pos0

    # ---- the LlamaDraftModel hook --------------------------------------------------------------
    def __call__(self, input_ids, /, **kwargs: Any) -> np.ndarray:
        self._alive()
        llm = self._llm()
        if llm is None:
            raise ClosedError("the Llama this draft model was attached to is gone")
        ids = np.asarray(input_ids)
        self.n_calls += 1
        pos0 = len(ids) - 1
        self._resolve(ids, pos0)
        if pos0 < 1 or pos0 != llm.n_tokens or pos0 + self.block > self.target.n_ctx:
            # the anchor must directly follow what the target holds; the block must fit the draft KV
            self.n_skipped += 1
            return _EMPTY
        pol = self.policy
        if pol is not None and not pol.want_draft(1):
            self.n_skipped += 1     # drafting does not pay here now: plain decoding, no draft work
            return _EMPTY
        self.proposer.rollback(pos0, 0)
        self.covered = min(self.covered, pos0)
        if self.covered < pos0:
            if not self.refill:
                self.n_skipped += 1
                return _EMPTY
            self._refill(ids, pos0)
        t0 = time.perf_counter()
        prop = self.proposer.propose(int(ids[-1]), pos0, self.n_max, 0)
        drafts = prop.tokens[: max(0, self.target.n_ctx - pos0 - 1)]
        conf = prop.confidence
        if pol is not None:
            if pol.mode != "off" and len(drafts):
                drafts = drafts[:pol.lengths([conf], [len(drafts)])[0]]
            pol.observe_draft(1, (time.perf_counter() - t0) * 1e3)
        self.n_proposed += len(drafts)
        self._pending = (pos0, int(ids[-1]), drafts.copy(), None if conf is None else conf.copy())
        if self.trace is not None:
            self.trace.append((pos0, int(ids[-1]), tuple(int(t) for t in drafts)))
        return drafts.astype(np.intc)

    def _resolve(self, ids: np.ndarray, pos0: int) -> None:
        """Score the previous proposal against what llama-cpp-python committed since."""
        if self._pending is None:
            return
        p, anchor, drafts, conf = self._pending
        self._pending = None
        if pos0 <= p or ids[p] != anchor:
            return   # another sequence: the outcome of that block was never seen
        seen = ids[p + 1: pos0 + 1]
        k = min(len(drafts), len(seen))
        match = drafts[:k] == seen[:k]
        n_acc = int(np.argmin(match)) if not match.all() else k
        self.n_drafted += len(drafts)
        self.n_accepted += n_acc
        if self.policy is not None:
            self.policy.update(len(drafts), n_acc, conf if len(drafts) else None)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens since attaching (0.0 before any draft)."""
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    def stats(self) -> dict:
        """The counters as a dict: ``calls``, ``proposed``, ``drafted``, ``accepted``, ``refilled``,
        ``skipped`` (``n_calls`` ... ``n_skipped``, described above)."""
        return {"calls": self.n_calls, "proposed": self.n_proposed, "drafted": self.n_drafted,
                "accepted": self.n_accepted, "refilled": self.n_refilled, "skipped": self.n_skipped}


def attach_dspark(llm, draft_path: str, **kw) -> DSparkDraftModel:
    """Attach a DSpark/DFlash draft to ``llm`` (``llm.draft_model``) and return the drafter."""
    return DSparkDraftModel(llm, draft_path, **kw)
