"""One sequence as a generator of events: :class:`SpecDecoder` drives the loop (:mod:`.loop`)
with a single slot and yields each step's :class:`~.cycle.Chunk`, then one
:class:`~.cycle.Done`.

At temperature 0 the emitted tokens are exactly the target's greedy tokens.  At temperature > 0
(``sampling=SamplingParams(...)``) speculative sampling makes the output distributed exactly as
plain sampling from the target with the same sampler chain; a fixed seed makes it deterministic.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence, Union

from pyllama_dspark.decode.cycle import Chunk, Done, Started, Stats  # noqa: F401  (Stats: public here before)
from pyllama_dspark.decode.loop import Decoder
from pyllama_dspark.llama.handles import Target
from pyllama_dspark.speculative.drafter import Proposer
from pyllama_dspark.speculative.sampling import SamplingParams


def _largest_block(proposer: Optional[Proposer]) -> int:
    """The loop's n_max for a one-sequence decoder: whatever the proposer can draft (a stream's
    own n_max is clamped to it)."""
    return max(1, proposer.max_draft()) if proposer is not None else 1


class SpecDecoder:
    """Speculative decoding of one sequence (``seq_id``) on a Target with a pluggable Proposer."""

    def __init__(self, target: Target, proposer: Optional[Proposer] = None, *, seq_id: int = 0,
                 tie_eps: float = 1e-3, policy=None):
        """``policy``: a :class:`~pyllama_dspark.speculative.policy.VerifyPolicy` (None: verify every
        drafted token); its decisions use only the draft's own confidences and past cycles, so
        greedy and sampled output stay lossless."""
        self.target = target
        self.seq_id = int(seq_id)
        self.loop = Decoder(target, proposer, n_max=_largest_block(proposer),
                            policy=policy, streaming=True, tie_eps=tie_eps, slots=[self.seq_id], keep_memory=True)
        self._rid: Optional[int] = None   # the request of the stream in progress

    @property
    def proposer(self) -> Proposer:
        return self.loop.proposer

    @proposer.setter
    def proposer(self, proposer: Proposer) -> None:
        self._detach()
        self.loop.n_max = _largest_block(proposer)
        self.loop.proposer = proposer

    @property
    def policy(self):
        return self.loop.policy

    @policy.setter
    def policy(self, policy) -> None:
        self.loop.policy = policy

    @property
    def tie_eps(self) -> float:
        return self.loop.tie_eps

    def stream(self, prompt: Sequence[int], max_tokens: int = 256, *, n_max: int = 7,
               stop: Sequence[str] = (), ignore_eos: bool = False,
               sampling: Optional[SamplingParams] = None,
               reuse_prefix: bool = False, **request) -> Iterator[Union[Chunk, Done]]:
        """Yield a Chunk per cycle, then one Done with the whole result and its Stats.

        ``sampling`` None (or temperature <= 0) is greedy decoding; otherwise speculative sampling
        with llama.cpp's sampler chain and these parameters.  ``n_max``: the draft block (clamped
        to what the drafter produces).

        ``reuse_prefix``: keep what the memories already hold of this prompt (from the previous
        stream on this decoder, finished or abandoned at a Chunk) and decode only the rest; the
        same prompt again costs no target decode at all.  Off by default: a partial re-decode
        changes batch shapes, hence the last bits of the logits, versus a fresh prefill.

        ``request``: ``grammar``, ``logit_bias``, ``n_probs``, ``post_sampling_probs`` (see
        :meth:`~.loop.Decoder.submit`).

        The arguments are checked here, before the first event is asked for."""
        self._detach()
        rid = self.loop.submit(prompt, max_tokens, stop, sampling=sampling, ignore_eos=ignore_eos, n_max=n_max,
                               reuse_prefix=reuse_prefix, **request)
        self._rid = rid
        return self._events(rid)

    @property
    def store(self):
        """The :class:`~..llama.prompt_state.PromptStore` this decoder's slot saves to and restores
        from (None: none); slots of ``serve -nocb`` share one."""
        return self.loop.cache.store

    @store.setter
    def store(self, store) -> None:
        self.loop.cache.store = store

    def forget(self) -> None:
        """Drop what the prompt cache believes the memories hold (someone else decoded there)."""
        self._detach()
        self.loop.cache.forget(self.seq_id)

    def cached_tokens(self):
        """The tokens this decoder's memories hold for the prompt cache (int32; empty: none)."""
        import numpy as np

        t = self.loop.cache.tokens.get(self.seq_id)
        return np.zeros(0, dtype=np.int32) if t is None else t

    def _detach(self) -> None:
        """End the stream in progress, if any (abandoned by its reader): its slot is freed and the
        memories keep what they hold for a later ``reuse_prefix``."""
        if self._rid is not None:
            self.loop.cancel(self._rid)
            self.loop.poll()
            self._rid = None

    def _events(self, rid: int) -> Iterator[Union[Chunk, Done]]:
        loop = self.loop
        try:
            while self._rid == rid:
                loop.step()
                for r, ev in loop.poll():
                    if r != rid or isinstance(ev, Started):
                        continue
                    if isinstance(ev, Done):
                        self._rid = None
                    yield ev
        finally:
            if self._rid == rid:
                self._detach()

    def generate(self, prompt: Sequence[int], max_tokens: int = 256, **kw) -> Done:
        done = None
        for ev in self.stream(prompt, max_tokens, **kw):
            if isinstance(ev, Done):
                done = ev
        return done
