"""llama.cpp's own sampler chain through llama-cpp-python's bindings: the independent reference.

``LlamaChain(params, n_vocab, history)`` builds the chain common/sampling.cpp builds for these
parameters (penalties -> top_k -> top_p -> min_p -> temperature [-> dist(seed)]), with
``grammar=(vocab, gbnf, generated)`` llama.cpp's grammar sampler first (constrained sampling, the
grammar advanced over the ``generated`` tokens).  ``probs(row)``
applies it (without dist) to a logits row and returns the distribution dist would sample from;
``sample(ctx, idx)`` samples with llama.cpp's dist sampler from a context's output row.
"""

from __future__ import annotations

import ctypes
from typing import Iterable, Optional

import numpy as np
from llama_cpp import llama_cpp as ll

from pyllama_dspark.speculative.sampling_params import SamplingParams

_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(ll.llama_token_data)


class LlamaChain:
    def __init__(self, params: SamplingParams, n_vocab: int, history: Iterable[int] = (),
                 seed: Optional[int] = None, grammar=None):
        self.n_vocab = n_vocab
        self.chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        add = lambda s: ll.llama_sampler_chain_add(self.chain, s)
        if grammar is not None:
            vocab, gbnf, generated = grammar
            g = ll.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
            assert g, "the reference grammar does not parse"
            for t in generated:
                ll.llama_sampler_accept(g, int(t))
            add(g)
        last_n = params.penalty_last_n if params.penalty_last_n >= 0 else 4096  # -1: "whole sequence" (short here)
        self.penalties = ll.llama_sampler_init_penalties(n_vocab, last_n, params.repeat_penalty,
                                                         params.frequency_penalty, params.presence_penalty)
        add(self.penalties)
        add(ll.llama_sampler_init_top_k(params.top_k))
        add(ll.llama_sampler_init_top_p(params.top_p, 0))
        add(ll.llama_sampler_init_min_p(params.min_p, 0))
        add(ll.llama_sampler_init_temp(params.temperature))
        if seed is not None:
            add(ll.llama_sampler_init_dist(seed))
        for t in history:
            ll.llama_sampler_accept(self.penalties, int(t))

    def close(self):
        if self.chain:
            ll.llama_sampler_free(self.chain)  # frees the samplers it owns
            self.chain = None

    def __del__(self):
        self.close()

    def accept(self, token: int) -> None:
        ll.llama_sampler_accept(self.penalties, int(token))

    def probs(self, row: np.ndarray) -> np.ndarray:
        """Dense distribution after the chain (softmax of the surviving, tempered logits)."""
        data = np.empty(self.n_vocab, dtype=_TOKEN_DATA)
        data["id"] = np.arange(self.n_vocab)
        data["logit"] = np.asarray(row, dtype=np.float32)
        data["p"] = 0.0
        arr = ll.llama_token_data_array(
            data=data.ctypes.data_as(ctypes.POINTER(ll.llama_token_data)), size=self.n_vocab, selected=-1,
            sorted=False)
        ll.llama_sampler_apply(self.chain, ctypes.byref(arr))
        kept = data[: arr.size]
        z = kept["logit"].astype(np.float64)
        e = np.exp(z - z.max())
        out = np.zeros(self.n_vocab)
        out[kept["id"]] = e / e.sum()
        return out

    def sample(self, ctx, idx: int) -> int:
        """llama_sampler_sample on output row idx of ctx (the chain must have a dist sampler)."""
        return int(ll.llama_sampler_sample(self.chain, ctx, idx))
