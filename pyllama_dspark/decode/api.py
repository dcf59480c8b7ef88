"""Python API: a target (+ optional DSpark/DFlash draft) opened from paths, generating text.

    from pyllama_dspark import Speculator
    with Speculator("target.gguf", "draft.gguf") as sp:
        for ev in sp.stream("Explain RoPE.", max_tokens=64):   # Chunk ... then Done
            ...
        done = sp.generate([1, 2, 3], max_tokens=32)            # token ids work too
        done = sp.generate("Hi", 32, sampling=SamplingParams(temperature=1.0, seed=7))  # T > 0
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Union

from pyllama_dspark.drafts.spec import DraftSpec, parse_draft
from pyllama_dspark.speculative import costprofile
from pyllama_dspark.chat.prompt import build_chat_prompt
from pyllama_dspark.speculative.drafter import DraftModelProposer, NoDraft, Proposer, check_n_max, clamp_n_max
from pyllama_dspark.decode.engine import SpecDecoder
from pyllama_dspark.decode.cycle import Chunk, Done
from pyllama_dspark.llama.models import open_models
from pyllama_dspark.llama.handles import ContextSettings, Owned
from pyllama_dspark.llama.rpc import parse_endpoints
from pyllama_dspark.speculative import policy_memory
from pyllama_dspark.speculative.oracle import OracleDraft
from pyllama_dspark.speculative.policy import VerifyPolicy
from pyllama_dspark.speculative.policy_factory import make_policy
from pyllama_dspark.speculative.sampling import SamplingParams

Prompt = Union[str, Sequence[int]]


class Speculator(Owned):
    """Owns a Target, an optional Draft and the decoder over them; close() frees all of it."""

    _what = "Speculator"

    def __init__(self, target_path: str, draft_path: Union[str, DraftSpec, None] = None, *,
                 n_ctx: int = 4096, n_batch: int = 512, n_ubatch: int = 512,
                 n_threads: Optional[int] = None, flash_attn: str = "auto", n_gpu_layers: Union[int, str] = "auto",
                 n_max: int = 7, proposer: Optional[Proposer] = None, verbose: bool = False, n_seq: int = 1,
                 schedule: Union[str, VerifyPolicy, None] = "auto", cost_profile=None, kv_unified: bool = False,
                 rpc: Union[str, Sequence[str], None] = None, tensor_split: Sequence[float] = (),
                 n_gpu_layers_draft: Union[int, str, None] = None, conf_min: Optional[float] = None,
                 p_survival_min: Optional[float] = None, calibration: Optional[str] = None, regime: str = "any",
                 backend_sampling: str = "auto"):
        """``n_seq``: sequences the contexts hold (``n_ctx`` is shared among them), for a
        :class:`~pyllama_dspark.decode.loop.Decoder` over ``target`` / ``proposer``; ``stream``/``generate`` use
        sequence 0.

        ``schedule``: how much of each drafted block to verify: ``"auto"`` (default: Algorithm 1
        on this machine's cost curve, drafting only when it pays; the curve is measured once per
        target and settings, <= ~20 s, and cached), ``"off"`` / None (verify every draft, llama.cpp's
        fixed block), or a :class:`~.policy.VerifyPolicy`.  ``cost_profile``: the auto schedule's
        cost curve (a profile path, :class:`~.costprofile.Profile` or :class:`~.schedule.CostModel`)
        instead of the cached / measured one.  ``kv_unified``: one KV buffer for all ``n_seq``
        sequences, each of which may then use all of ``n_ctx`` (llama-server's ``-kvu``).

        ``n_gpu_layers``: llama.cpp's ``-ngl``, a count, ``"auto"`` (the default, as llama.cpp's:
        every layer on the GPU when the model fits, fewer when not, none without a GPU) or ``"all"``.
        ``backend_sampling``: greedy rows read out on the device, only their top 2 copied back
        (llama.cpp's ``-bs``; :mod:`~pyllama_dspark.llama.backend_sampling`): ``"auto"`` (on when the
        layers are offloaded), ``"on"`` or ``"off"``.
        ``rpc``: llama.cpp RPC servers (``"host:port,..."``, llama-server's ``--rpc``) that the
        ``n_gpu_layers`` offloaded layers go to, split by ``tensor_split`` (``-ts``); each is probed
        first (:class:`~pyllama_dspark.llama.rpc.RpcEndpointError` if unreachable or busy).
        ``n_gpu_layers_draft``: the draft's offloaded layers (``-ngld``; None: as the target's).

        ``draft_path``: what ``-md`` takes (:mod:`~pyllama_dspark.drafts.spec`): a GGUF path,
        ``"random[:TYPE]"`` (a random-weight draft matched to the target), or ``"oracle:P[:TYPE]"``:
        the oracle proposer (:class:`~pyllama_dspark.speculative.oracle.OracleDraft`, greedy only),
        the target's greedy continuation, each block right with probability P, after a real pass of
        the draft matched to the target; or a :class:`~pyllama_dspark.drafts.spec.DraftSpec`.
        ``conf_min`` / ``p_survival_min`` / ``calibration``: the static / survival schedules'
        thresholds and an STS calibration file (``pyllama-dspark calibrate``).
        ``regime``: ``greedy`` / ``sampled`` / ``any``, what the auto schedule's learned acceptance
        is kept per across processes (:mod:`~pyllama_dspark.speculative.policy_memory`)."""
        check_n_max(n_max)
        if int(n_seq) <= 0:
            raise ValueError(f"n_seq must be >= 1, got {n_seq}")
        self.settings = ContextSettings(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=n_threads,
                                        flash_attn=flash_attn, n_gpu_layers=n_gpu_layers, verbose=verbose,
                                        n_seq_max=int(n_seq), kv_unified=bool(kv_unified),
                                        rpc=tuple(parse_endpoints(rpc)), tensor_split=tuple(tensor_split or ()),
                                        n_gpu_layers_draft=n_gpu_layers_draft, backend_sampling=backend_sampling)
        self.settings.validate()
        spec = parse_draft(draft_path)   # what -md names, parsed once (drafts/spec.py)
        oracle_p = spec.oracle_p if spec is not None else None
        draft_path = spec.file(target_path) if spec is not None else None
        # validates the pairing from the files before llama.cpp sees them (it aborts on mismatches)
        self.target, self.draft, self.warnings = open_models(target_path, draft_path, self.settings)
        try:
            if oracle_p is not None:
                self.proposer = OracleDraft(self.target, DraftModelProposer(self.draft), oracle_p)
            elif self.draft is not None:
                self.proposer: Proposer = proposer or DraftModelProposer(self.draft)
            else:
                self.proposer = proposer or NoDraft()
            # clamped once here (a warning, as llama.cpp), not on every stream
            self.n_max = int(n_max) if isinstance(self.proposer, NoDraft) else clamp_n_max(n_max, self.proposer)
        except BaseException:
            self.target.close()
            raise
        self._closed = False
        # the decoder exists (verifying every draft) before the policy is made: the profiled schedule
        # with no cached profile measures the full cost curve through it (_measure_full)
        self.decoder = SpecDecoder(self.target, self.proposer)
        try:
            self.decoder.policy = make_policy(self.target, self.draft, "off" if schedule is None else schedule,
                                              proposer=self.proposer, cost_profile=cost_profile, conf_min=conf_min,
                                              p_survival_min=p_survival_min, calibration=calibration,
                                              gamma=self.n_max, measure_full=self._measure_full, regime=regime)
        except BaseException:
            self.close()
            raise

    @property
    def policy(self) -> Optional[VerifyPolicy]:
        """The verification policy of ``stream``/``generate`` (None: every draft verified)."""
        return self.decoder.policy

    def _measure_full(self):
        """The full cost profile (target and draft) of the profiled schedule, cached; verify
        batches up to 32, or n_batch when smaller (a decode takes at most n_batch tokens)."""
        import sys

        print("pyllama-dspark: profiling this machine (cached for next time)...", file=sys.stderr, flush=True)
        return costprofile.load_or_measure(self, b_max=min(costprofile.AUTO_B_MAX, self.target.n_batch))

    # ---- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the draft and the target (their contexts and models); what ``auto`` learned is
        saved for the next process.  Also done by ``with``; a second call does nothing."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if getattr(self, "decoder", None) is not None:
            policy_memory.save(self.decoder.policy)   # what auto learned, for the next process
        self.proposer.close()
        self.target.close()  # closes the draft first


    # ---- prompts -------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True) -> List[int]:
        """The target's token ids of ``text`` (special tokens parsed; BOS as the vocabulary asks
        when ``add_special``)."""
        self._alive()
        return self.target.tokenize(text, add_special=add_special, parse_special=True)

    def chat_prompt(self, messages: Sequence[dict]):
        """The prompt of a chat (``[{"role", "content"}, ...]``) through the GGUF's chat template
        (llama-cpp-python's chat formatting): its token ids and the template's stop strings."""
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
               sampling: Optional[SamplingParams] = None, reuse_prefix: bool = False,
               **request) -> Iterator[Union[Chunk, Done]]:
        """Yield Chunk events (tokens + text) and finally a Done with text, tokens and stats.

        ``sampling``: None or temperature 0 = greedy; else lossless speculative sampling with
        llama.cpp's sampler chain (:class:`~.sampling.SamplingParams`).  ``reuse_prefix``: decode
        only the part of the prompt the memories do not already hold (see SpecDecoder.stream).
        ``request``: ``grammar``, ``logit_bias``, ``n_probs``, ``post_sampling_probs`` (see
        :meth:`~.loop.Decoder.submit`)."""
        self._alive()
        tokens, stop = self._prompt(prompt, chat, stop)
        self.prepare(tokens, max_tokens)
        return self.decoder.stream(tokens, max_tokens, n_max=self.n_max if n_max is None else n_max, stop=stop,
                                   ignore_eos=ignore_eos, sampling=sampling, reuse_prefix=reuse_prefix, **request)

    def prepare(self, tokens: Sequence[int], max_tokens: int) -> None:
        """With ``-md oracle:P``: decode the reference continuation of ``tokens`` now (``stream``
        does it otherwise, before its timing starts), e.g. outside a benchmark's clock."""
        self._alive()
        if isinstance(self.proposer, OracleDraft) and not self.proposer.set.knows(tokens):
            self.decoder.forget()   # the reference decode uses the target's sequence 0
            self.proposer.prepare([list(tokens)], max_tokens)

    def generate(self, prompt: Prompt, max_tokens: int = 256, **kw) -> Done:
        """:meth:`stream` run to its end: the ``Done`` event (text, tokens, finish reason, stats)."""
        done = None
        for ev in self.stream(prompt, max_tokens, **kw):
            if isinstance(ev, Done):
                done = ev
        return done
