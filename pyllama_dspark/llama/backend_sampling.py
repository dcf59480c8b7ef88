"""Greedy read-out on the device: llama.cpp's backend sampling, per sequence of one context.

A greedy row needs two numbers, its argmax and (for the near-tie count) the gap to the runner-up,
yet a plain decode copies every output row's n_vocab logits to the host, where they are scanned:
on a GPU, (1 + k) x 152k floats a verify and 8 x 152k a draft pass, a large share of a 2 ms step.
With a sampler chain of one top-k(2) attached to a sequence (``llama_set_sampler``, the vendored
llama.h's backend sampling), llama.cpp computes the two candidates in the graph and copies back
only them; when every output row of a decode belongs to such a sequence it copies no logits at all
(``needs_raw_logits`` in llama-context.cpp).  The shim's ``dspark_argmax_rows`` reads those rows
transparently, so the accept rule does not change.

A sequence whose request needs the full row (sampling at T > 0, a grammar, penalties, logit bias,
log-probabilities, a drafter drawing from its rows) has no sampler; attaching or detaching one makes
llama.cpp re-reserve its graph on the next decode, so the state is changed only when it differs.

``mode``: ``"on"``, ``"off"`` or ``"auto"`` (on when the model's layers are offloaded to a GPU or
RPC device, off on a CPU, where the logits never leave host memory and ggml's CPU top-k, a
partial sort per row, costs more than the shim's vector scan), llama.cpp's ``-bs`` /
``--spec-draft-backend-sampling``.

``$PYLLAMA_DSPARK_DEVICE_READOUT``: ``top2`` (the default: the top-2 gap keeps the near-tie
count) or ``argmax`` (llama.cpp's greedy sampler: only the token comes back, one reduction a row,
and no gap is known, so no near-tie is counted).  Which is faster depends on the device's top-k.
"""

from __future__ import annotations

import os
from typing import Dict

from llama_cpp import llama_cpp as ll

MODES = ("auto", "on", "off")
READOUTS = ("top2", "argmax")


def readout_kind() -> str:
    kind = os.environ.get("PYLLAMA_DSPARK_DEVICE_READOUT", "top2")
    if kind not in READOUTS:
        raise ValueError(f"PYLLAMA_DSPARK_DEVICE_READOUT must be one of {READOUTS}, got {kind!r}")
    return kind


def check_mode(mode) -> str:
    if mode not in MODES:
        raise ValueError(f"backend_sampling must be one of {MODES}, got {mode!r}")
    return mode


class DeviceSamplers:
    """The read-out chains (top-2, or argmax: :func:`readout_kind`) of one llama.cpp context, one
    chain per sequence that has one.

    The chains are owned here: a chain is initialised for the device when attached, so a detached
    one is freed, never attached again.  :meth:`close` detaches and frees them all (before the
    context is freed, or after: the context does not own them)."""

    def __init__(self, ctx, enabled: bool):
        self.ctx = ctx
        self.enabled = bool(enabled)
        self.kind = readout_kind() if enabled else "top2"
        self.supported = True          # False once llama.cpp refused a chain (e.g. -sm tensor)
        self._chains: Dict[int, object] = {}
        self.n_changes = 0

    def has(self, seq_id: int) -> bool:
        return seq_id in self._chains

    def want(self, seq_id: int, on: bool) -> bool:
        """Attach (``on``) or detach the sequence's chain if that changes anything; returns
        whether the sequence now has one.  Never attaches when disabled or unsupported."""
        on = bool(on) and self.enabled and self.supported
        if on == (seq_id in self._chains):
            return on
        self.n_changes += 1
        if not on:
            chain = self._chains.pop(seq_id)
            ll.llama_set_sampler(self.ctx, seq_id, None)
            ll.llama_sampler_free(chain)
            return False
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_k(2) if self.kind == "top2"
                                   else ll.llama_sampler_init_greedy())
        if not ll.llama_set_sampler(self.ctx, seq_id, chain):
            ll.llama_sampler_free(chain)
            self.supported = False
            return False
        self._chains[seq_id] = chain
        return True

    def close(self, ctx_alive: bool = True) -> None:
        for seq_id, chain in list(self._chains.items()):
            if ctx_alive and self.ctx:
                ll.llama_set_sampler(self.ctx, seq_id, None)
            ll.llama_sampler_free(chain)
        self._chains.clear()
