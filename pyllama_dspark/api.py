"""Python API: a target (+ optional DSpark/DFlash draft) opened from paths, generating text.

    from pyllama_dspark import Speculator
    with Speculator("target.gguf", "draft.gguf") as sp:
        for ev in sp.stream("Explain RoPE.", max_tokens=64):   # Chunk ... then Done
            ...
        done = sp.generate([1, 2, 3], max_tokens=32)            # token ids work too
        done = sp.generate("Hi", 32, sampling=SamplingParams(temperature=1.0, seed=7))  # T > 0
"""

from __future__ import annotations

import os
from typing import Iterator, List, Optional, Sequence, Union

from .chat import build_chat_prompt
from .drafter import DraftModelProposer, NoDraft, Proposer
from .engine import Chunk, Done, SpecDecoder
from .models import open_models
from .handles import ContextSettings, Draft, Owned, Target
from .sampling import SamplingParams

Prompt = Union[str, Sequence[int]]


class Speculator(Owned):
    """Owns a Target, an optional Draft and the decoder over them; close() frees all of it."""

    _what = "Speculator"

    def __init__(self, target_path: str, draft_path: Optional[str] = None, *,
                 n_ctx: int = 4096, n_batch: int = 512, n_ubatch: int = 512,
                 n_threads: Optional[int] = None, flash_attn: str = "auto", n_gpu_layers: int = 0,
                 n_max: int = 7, proposer: Optional[Proposer] = None, verbose: bool = False, n_seq: int = 1):
        """``n_seq``: sequences the contexts hold (``n_ctx`` is shared among them), for a
        :class:`~.batch.BatchDecoder` over ``target`` / ``proposer``; ``stream``/``generate`` use
        sequence 0."""
        if int(n_max) <= 0:
            raise ValueError(f"n_max must be >= 1, got {n_max}")
        if int(n_seq) <= 0:
            raise ValueError(f"n_seq must be >= 1, got {n_seq}")
        self.settings = ContextSettings(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=n_threads,
                                        flash_attn=flash_attn, n_gpu_layers=n_gpu_layers, verbose=verbose,
                                        n_seq_max=int(n_seq))
        self.settings.validate()
        self.n_max = int(n_max)
        # validates the pairing from the files before llama.cpp sees them (it aborts on mismatches)
        self.target, self.draft, self.warnings = open_models(target_path, draft_path, self.settings)
        try:
            if self.draft is not None:
                self.proposer: Proposer = proposer or DraftModelProposer(self.draft)
            else:
                self.proposer = proposer or NoDraft()
        except BaseException:
            self.target.close()
            raise
        self.decoder = SpecDecoder(self.target, self.proposer)
        self._closed = False

    # ---- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self.proposer.close()
        self.target.close()  # closes the draft first

    # ---- prompts -------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True) -> List[int]:
        self._alive()
        return self.target.tokenize(text, add_special=add_special, parse_special=True)

    def chat_prompt(self, messages: Sequence[dict]):
        self._alive()
        return build_chat_prompt(self.target, messages)

    def _prompt(self, prompt: Prompt, chat: bool, stop: Sequence[str]):
        stop = list(stop)
        if isinstance(prompt, str):
            if chat:
                cp = self.chat_prompt([{"role": "user", "content": prompt}])
                return cp.tokens, stop + cp.stop
            return self.tokenize(prompt), stop
        return list(prompt), stop

    # ---- generation ----------------------------------------------------------------------------
    def stream(self, prompt: Prompt, max_tokens: int = 256, *, chat: bool = False, stop: Sequence[str] = (),
               n_max: Optional[int] = None, ignore_eos: bool = False,
               sampling: Optional[SamplingParams] = None, reuse_prefix: bool = False) -> Iterator[Union[Chunk, Done]]:
        """Yield Chunk events (tokens + text) and finally a Done with text, tokens and stats.

        ``sampling``: None or temperature 0 = greedy; else lossless speculative sampling with
        llama.cpp's sampler chain (:class:`~.sampling.SamplingParams`).  ``reuse_prefix``: decode
        only the part of the prompt the memories do not already hold (see SpecDecoder.stream)."""
        self._alive()
        tokens, stop = self._prompt(prompt, chat, stop)
        return self.decoder.stream(tokens, max_tokens, n_max=self.n_max if n_max is None else n_max, stop=stop,
                                   ignore_eos=ignore_eos, sampling=sampling, reuse_prefix=reuse_prefix)

    def generate(self, prompt: Prompt, max_tokens: int = 256, **kw) -> Done:
        done = None
        for ev in self.stream(prompt, max_tokens, **kw):
            if isinstance(ev, Done):
                done = ev
        return done
