"""``DSpark``: llama-cpp-python's ``create_completion`` / ``create_chat_completion`` on our engine.

    from pyllama_dspark import DSpark
    with DSpark("target.gguf", "draft.gguf") as ds:              # or DSpark.from_llama(llm, "draft.gguf")
        r = ds.create_chat_completion([{"role": "user", "content": "Hi"}], temperature=0)
        r["choices"][0]["message"]["content"], r["usage"], r["timings"]["draft_n_accepted"]

Same arguments, same dict / chunk schema as ``llama_cpp.Llama`` (plus llama-server's ``timings`` on
non-streaming responses and on the last stream chunk).  Generation runs on
:class:`~pyllama_dspark.decode.engine.SpecDecoder` (greedy at temperature 0, lossless speculative sampling
above).  Prompts: a string is tokenized as ``Llama.create_completion`` does (BOS/EOS as the vocabulary
asks, special tokens parsed); chat messages go through llama-cpp-python's own chat handler — the one
``Llama`` would pick (the GGUF's template, or the ``chat_format`` / ``chat_handler`` given) — called
with a stand-in ``llama`` whose ``create_completion`` is ours, so the prompt, stop strings and the
chat dict conversion are llama-cpp-python's.

``DSpark.from_llama(llm, draft)`` runs on the Llama's own context and model (no second copy of the
weights); it resets the Llama's token cache before each generation (the KV then holds our sequence)
and is closed, before the context is freed, when the Llama closes.

``grammar`` (a ``LlamaGrammar``), ``response_format`` (llama-cpp-python's chat handlers turn it into
a grammar) and ``logit_bias`` work as in ``Llama``, under speculation (llama.cpp's grammar engine,
:mod:`~pyllama_dspark.llama.grammar`).  ``tools`` / ``tool_choice`` give ``serve``'s tool calls
(:mod:`.dspark_tools`: the same prompt, grammar and parse) unless a ``chat_handler`` / ``chat_format``
was chosen.  Not supported (a clear ValueError): logprobs, logits_processor, stopping_criteria,
suffix, mirostat, typical_p != 1.  Repeat / presence /
frequency penalties work as in ``Llama`` (over the generated tokens, before the greedy pick at
temperature 0).
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Union

from llama_cpp import llama_chat_format as lcf

from pyllama_dspark.integrations import openai_dicts as oai
from pyllama_dspark.integrations.dspark_tools import legacy_tools, tool_chat, tool_plan, wants_tools
from pyllama_dspark.decode.api import Speculator
from pyllama_dspark.speculative import policy_memory
from pyllama_dspark.speculative.policy_factory import make_policy
from pyllama_dspark.chat.prompt import chat_formatter
from pyllama_dspark.speculative.drafter import DraftModelProposer, NoDraft, check_n_max, clamp_n_max
from pyllama_dspark.decode.engine import SpecDecoder
from pyllama_dspark.decode.cycle import Chunk, Done
from pyllama_dspark.decode.trace import trace_json
from pyllama_dspark.errors import ContextOverflowError
from pyllama_dspark.llama.borrowed import BorrowedTarget
from pyllama_dspark.llama.handles import Draft, Owned
from pyllama_dspark.llama.prompt_state import PromptStore
from pyllama_dspark.integrations.llama_plugin import borrow_target, close_with_context, llama_ctx, llama_settings
from pyllama_dspark.speculative.sampling_params import SamplingParams


def _unsupported(**given) -> None:
    bad = [k for k, v in given.items() if v]
    if bad:
        raise ValueError(f"DSpark does not support {', '.join(bad)} (use llama_cpp.Llama with "
                         f"DSparkDraftModel for those)")


def _grammar_text(grammar) -> Optional[str]:
    """GBNF of a ``LlamaGrammar`` (or of a GBNF string); None for no grammar."""
    if grammar is None or isinstance(grammar, str):
        return grammar
    text = getattr(grammar, "_grammar", None)
    if not isinstance(text, str):
        raise TypeError(f"grammar must be a llama_cpp.LlamaGrammar or GBNF text, got {type(grammar).__name__}")
    return text


class _LlamaStandIn:
    """What llama-cpp-python's chat handlers use of their ``llama`` argument, backed by a DSpark."""

    def __init__(self, owner: "DSpark"):
        self._owner = owner
        self.verbose = False
        self.last: Optional[Done] = None
        self.trace_on = False             # create_chat_completion(dspark_trace=True)
        self.trace: Optional[dict] = None   # the trace of the completion chunk last pulled

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> List[int]:
        return self._owner.target.tokenize(text, add_special=add_bos, parse_special=special)

    def create_completion(self, prompt, stopping_criteria=None, **kw):
        # the only stopping criteria a chat format adds is llama-cpp-python's Jinja "last token is
        # the template's EOS id": an end-of-generation token, where the engine stops anyway
        return self._owner._completion(prompt, stand_in=self, **kw)


class DSpark(Owned):
    """Target (+ DSpark/DFlash draft) with llama-cpp-python's completion API and schema."""

    _what = "DSpark"

    def __init__(self, target_path: str, draft_path: Optional[str] = None, *, n_max: int = 7,
                 n_ctx: int = 4096, n_batch: int = 512, n_ubatch: int = 512, n_threads: Optional[int] = None,
                 flash_attn: str = "auto", n_gpu_layers: Union[int, str] = "auto", chat_format: Optional[str] = None,
                 chat_handler=None, last_n_tokens_size: int = 64, verbose: bool = False,
                 schedule="auto", cost_profile=None, cache_prompt: bool = False, cache_ram: int = 0, rpc=None,
                 tensor_split=(), n_gpu_layers_draft: Union[int, str, None] = None, backend_sampling: str = "auto"):
        """``schedule``: ``"auto"`` (default: verify drafts only where it pays on this machine's
        measured, cached cost curve), ``"off"`` (every draft verified, llama.cpp's fixed block) or
        a :class:`~.policy.VerifyPolicy`; ``cost_profile`` as for :class:`~.api.Speculator`.
        ``cache_prompt``: keep the memories (target and draft) between calls and decode only the
        part of the next prompt they lack, as ``Llama`` reuses its cached prefix: turn k of a chat
        decodes the new turn only.  Off by default: a prefix decoded in other batch shapes than a
        fresh prefill changes the logits' last bits, so greedy output can differ from a fresh
        call's at a numerical near-tie.  ``cache_ram``: with ``cache_prompt``, MiB of host RAM
        (llama-server's ``--cache-ram``; -1: no limit; 0, the default: none, as ``Llama`` without
        ``set_cache``) that keeps the memories of other conversations: a conversation that comes back
        after another one is restored instead of prefilled again.  ``rpc``, ``tensor_split``, ``n_gpu_layers_draft``,
        ``backend_sampling``: llama.cpp RPC servers for the offloaded layers and the device read-out,
        as for :class:`~.api.Speculator`."""
        self._sp = Speculator(target_path, draft_path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch,
                              n_threads=n_threads, flash_attn=flash_attn, n_gpu_layers=n_gpu_layers,
                              n_max=n_max, verbose=verbose, schedule=schedule, cost_profile=cost_profile,
                              rpc=rpc, tensor_split=tensor_split, n_gpu_layers_draft=n_gpu_layers_draft,
                              backend_sampling=backend_sampling)
        self._setup(self._sp.target, self._sp.draft, self._sp.proposer, self._sp.n_max, str(target_path),
                    None, last_n_tokens_size, policy=self._sp.policy)
        self.cache_prompt = bool(cache_prompt)
        self._use_store(cache_ram, n_ctx)
        self.warnings = list(self._sp.warnings)
        self._handler = chat_handler or self._handler_from_gguf(chat_format)
        # tools through our own path (serve's) unless a chat handler / format was chosen
        self._own_tools = chat_handler is None and (chat_format is None or chat_format.startswith("chat_template."))

    @classmethod
    def from_llama(cls, llm, draft_path: Optional[str] = None, *, n_max: int = 7, schedule="auto",
                   cost_profile=None, cache_prompt: bool = False, cache_ram: int = 0) -> "DSpark":
        """A DSpark over an existing ``llama_cpp.Llama``: its context, model, chat format and
        ``last_n_tokens_size``.  Closing the DSpark leaves the Llama usable; closing the Llama
        closes the DSpark first.  ``cache_prompt``: as for the constructor, as long as the Llama
        itself did not decode in between (its tokens then replaced ours in the shared memory).
        ``cache_ram``: as for the constructor."""
        ctx = llama_ctx(llm)
        check_n_max(n_max)
        self = cls.__new__(cls)
        self._sp = None
        if draft_path is not None:
            target, settings, found = borrow_target(llm, draft_path)
            try:
                draft = Draft(draft_path, target, settings)
                proposer = DraftModelProposer(draft)
            except BaseException:
                target.close()
                raise
        else:
            target, draft, proposer, found = BorrowedTarget(ctx.ctx, llama_settings(llm), path=llm.model_path), None, NoDraft(), []
        try:
            # a first-use cost measurement decodes in the Llama's context: its cached prefix is gone
            policy = make_policy(target, draft, "off" if schedule is None else schedule, cost_profile=cost_profile,
                                 gamma=int(n_max), on_measured=llm.reset, progress=bool(llm.verbose))
        except BaseException:
            target.close()
            raise
        self._setup(target, draft, proposer, int(n_max), str(llm.model_path), llm, llm.last_n_tokens_size,
                    policy=policy)
        self.cache_prompt = bool(cache_prompt)
        self._use_store(cache_ram, llm.n_ctx())
        self.warnings = found
        self._handler = (llm.chat_handler or llm._chat_handlers.get(llm.chat_format)
                         or lcf.get_chat_completion_handler(llm.chat_format))
        fmt = llm.chat_format
        self._own_tools = llm.chat_handler is None and (fmt is None or fmt.startswith("chat_template.")
                                                        or fmt in ("chatml", "llama-3", "mistral-instruct"))
        close_with_context(self, ctx)
        return self

    def _setup(self, target, draft, proposer, n_max, model_name, llm, last_n, policy=None) -> None:
        self.target, self.draft, self.proposer = target, draft, proposer
        # clamp once here (with llama.cpp's warning), not on every request
        self.n_max = n_max if isinstance(proposer, NoDraft) else clamp_n_max(n_max, proposer)
        self.model_path = model_name
        self._llm = llm
        self.last_n_tokens_size = int(last_n)
        self.decoder = SpecDecoder(target, proposer, policy=policy)
        self.last_stats = None
        self._closed = False

    def _use_store(self, cache_ram: int, n_ctx: int) -> None:
        """The RAM prompt cache of ``cache_prompt`` sessions (llama/prompt_state.py), or none."""
        if int(cache_ram) != 0:
            self.decoder.store = PromptStore(int(cache_ram), limit_tokens=int(n_ctx))

    @property
    def prompt_cache_info(self) -> Optional[dict]:
        """The RAM prompt cache's counts (states, bytes, tokens, hits, misses, ...), or None."""
        store = self.decoder.store
        return None if store is None else store.info()

    def _handler_from_gguf(self, chat_format: Optional[str]):
        """The chat handler ``Llama`` would pick for this GGUF (or for ``chat_format``)."""
        if chat_format is None or chat_format.startswith("chat_template."):
            # chat.chat_formatter mirrors Llama's choice: a recognised template's built-in format,
            # else the GGUF template through Jinja2ChatFormatter, else llama-2
            return lcf.chat_formatter_to_chat_completion_handler(chat_formatter(self.target))
        return lcf.get_chat_completion_handler(chat_format)

    # ---- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the draft and the contexts this DSpark opened (a borrowed Llama stays open and usable);
        what ``auto`` learned is saved for the next process.  Also done by ``with`` and at exit; a
        second call does nothing."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if self._sp is not None:
            self._sp.close()
        else:
            policy_memory.save(self.decoder.policy)   # what auto learned, for the next process
            self.proposer.close()
            self.target.close()   # borrowed: frees our capture handle and the draft, not the Llama
        self._llm = None

    # ---- llama-cpp-python's API --------------------------------------------------------------
    def create_completion(self, prompt: Union[str, List[int]], suffix: Optional[str] = None,
                          max_tokens: Optional[int] = 16, temperature: float = 0.8, top_p: float = 0.95,
                          min_p: float = 0.05, typical_p: float = 1.0, logprobs: Optional[int] = None,
                          echo: bool = False, stop: Optional[Union[str, List[str]]] = None,
                          frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                          repeat_penalty: float = 1.0, top_k: int = 40, stream: bool = False,
                          seed: Optional[int] = None, tfs_z: float = 1.0, mirostat_mode: int = 0,
                          mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, model: Optional[str] = None,
                          stopping_criteria=None, logits_processor=None, grammar=None, logit_bias=None,
                          dspark_trace: bool = False):
        """Like ``Llama.create_completion``: a completion dict, or an iterator of chunks (stream).
        ``dspark_trace`` (streaming): every chunk carries ``dspark_trace``, what its tokens were
        (accepted drafts or the target's own) and what each cycle drafted, verified and accepted
        (:mod:`~pyllama_dspark.decode.trace`, the schema of ``serve``'s field of that name)."""
        _unsupported(stopping_criteria=stopping_criteria is not None)
        return self._completion(prompt, suffix=suffix, max_tokens=max_tokens, temperature=temperature,
                                top_p=top_p, min_p=min_p, typical_p=typical_p, logprobs=logprobs, echo=echo,
                                stop=stop, frequency_penalty=frequency_penalty,
                                presence_penalty=presence_penalty, repeat_penalty=repeat_penalty, top_k=top_k,
                                stream=stream, seed=seed, mirostat_mode=mirostat_mode, model=model,
                                logits_processor=logits_processor, grammar=grammar, logit_bias=logit_bias,
                                dspark_trace=dspark_trace)

    __call__ = create_completion

    def create_chat_completion(self, messages, functions=None, function_call=None, tools=None,
                               tool_choice=None, temperature: float = 0.2, top_p: float = 0.95, top_k: int = 40,
                               min_p: float = 0.05, typical_p: float = 1.0, stream: bool = False,
                               stop: Optional[Union[str, List[str]]] = None, seed: Optional[int] = None,
                               response_format=None, max_tokens: Optional[int] = None,
                               presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                               repeat_penalty: float = 1.0, tfs_z: float = 1.0, mirostat_mode: int = 0,
                               mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, model: Optional[str] = None,
                               logits_processor=None, grammar=None, logit_bias=None,
                               logprobs: Optional[bool] = None, top_logprobs: Optional[int] = None,
                               parallel_tool_calls: Optional[bool] = None, chat_template_kwargs: Optional[dict] = None,
                               dspark_trace: bool = False):
        """Like ``Llama.create_chat_completion`` (the prompt and the dict conversion are done by
        llama-cpp-python's chat handler); ``timings`` is added to the response / the last chunk.
        With ``tools`` (or tool turns in ``messages``) and the GGUF's own template: ``serve``'s tool
        calls (:mod:`.dspark_tools`; ``parallel_tool_calls`` as in the OpenAI API,
        ``chat_template_kwargs`` as llama-server's, e.g. ``{"enable_thinking": False}``).
        ``dspark_trace`` (streaming, without tools): every content chunk carries ``dspark_trace``
        (see :meth:`create_completion`)."""
        self._alive()
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        _unsupported(logprobs=bool(logprobs))
        tools, tool_choice = legacy_tools(tools, tool_choice, functions, function_call)
        if self._own_tools and wants_tools(messages, tools):
            _unsupported(grammar=grammar is not None, response_format=response_format is not None,
                         logits_processor=logits_processor is not None)
            plan = tool_plan(self.target, list(messages), tools, tool_choice, parallel_tool_calls, chat_template_kwargs)

            def run(tokens, g):
                for ev in self._run(tokens, g, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                    min_p=min_p, typical_p=typical_p, stop=stop, frequency_penalty=frequency_penalty,
                                    presence_penalty=presence_penalty, repeat_penalty=repeat_penalty, top_k=top_k,
                                    seed=seed, mirostat_mode=mirostat_mode, logit_bias=logit_bias):
                    if isinstance(ev, Done):
                        self.last_stats = ev.stats
                    yield ev
            return tool_chat(self.target, plan, run, stream=stream, n_completion=self._n_completion,
                             model=model if model is not None else self.model_path, stop=stop)
        stand_in = _LlamaStandIn(self)
        stand_in.trace_on = bool(dspark_trace)
        out = self._handler(
            llama=stand_in, messages=list(messages), functions=functions, function_call=function_call,
            tools=tools, tool_choice=tool_choice, temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=min_p, typical_p=typical_p, logprobs=logprobs, top_logprobs=top_logprobs, stream=stream,
            stop=[] if stop is None else stop, seed=seed, response_format=response_format,
            max_tokens=max_tokens, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            repeat_penalty=repeat_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
            mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, model=model,
            logits_processor=logits_processor, grammar=grammar, logit_bias=logit_bias)
        if stream:
            return self._chat_chunks_with_timings(out, stand_in)
        last = stand_in.last
        if last is not None and isinstance(out, dict):
            out["timings"] = oai.timings(last.stats)
        return out

    @staticmethod
    def _chat_chunks_with_timings(chunks, stand_in: _LlamaStandIn):
        for ch in chunks:
            if ch["choices"] and ch["choices"][0].get("finish_reason") is not None and stand_in.last is not None:
                ch["timings"] = oai.timings(stand_in.last.stats)
            # llama-cpp-python turns each completion chunk into one chat chunk (after the first,
            # a role-only chunk): the trace goes with the chunk of the same tokens
            if stand_in.trace is not None and ch["choices"] and ch["choices"][0]["delta"].get("role") is None:
                ch["dspark_trace"], stand_in.trace = stand_in.trace, None
            yield ch

    # ---- the shared core ---------------------------------------------------------------------
    def _prompt_tokens(self, prompt) -> List[int]:
        if isinstance(prompt, str):
            # Llama.create_completion: BOS/EOS as the vocabulary asks, special tokens parsed
            toks = self.target.tokenize(prompt.encode("utf-8"), add_special=True, parse_special=True)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            toks = list(prompt)
        else:
            raise TypeError("prompt must be a str or a list of token ids")
        if not toks:
            raise ValueError("the prompt is empty (and this vocabulary adds no BOS token)")
        return toks

    def _sampling(self, temperature, top_k, top_p, min_p, seed, repeat_penalty, presence_penalty,
                  frequency_penalty, typical_p, mirostat_mode) -> Optional[SamplingParams]:
        _unsupported(mirostat=mirostat_mode not in (0, None), typical_p=typical_p not in (1.0, None))
        t = float(temperature)
        if t < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        # as llama-cpp-python's Llama: its penalties sampler sees the generated tokens only (not the
        # prompt) and comes before the greedy pick at temperature 0
        pen = dict(repeat_penalty=float(repeat_penalty), presence_penalty=float(presence_penalty),
                   frequency_penalty=float(frequency_penalty), penalty_last_n=self.last_n_tokens_size,
                   penalize_prompt=False)
        if t == 0.0:
            greedy = SamplingParams(temperature=0.0, **pen)
            return greedy if greedy.has_penalties else None
        return SamplingParams(temperature=t, top_k=int(top_k), top_p=float(top_p), min_p=float(min_p),
                              seed=seed, **pen)

    def _completion(self, prompt, *, stand_in: Optional[_LlamaStandIn] = None, suffix=None, max_tokens=16,
                    temperature=0.8, top_p=0.95, min_p=0.05, typical_p=1.0, logprobs=None, echo=False, stop=None,
                    frequency_penalty=0.0, presence_penalty=0.0, repeat_penalty=1.0, top_k=40, stream=False,
                    seed=None, mirostat_mode=0, model=None, logits_processor=None, grammar=None,
                    logit_bias=None, dspark_trace=False, **_ignored):
        self._alive()
        _unsupported(suffix=suffix is not None, logprobs=logprobs is not None,
                     logits_processor=logits_processor is not None)
        gbnf = _grammar_text(grammar)
        tokens = self._prompt_tokens(prompt)
        if echo and not isinstance(prompt, str):
            raise ValueError("echo needs a text prompt")
        events = self._run(tokens, gbnf, max_tokens=max_tokens, temperature=temperature, top_p=top_p, min_p=min_p,
                           typical_p=typical_p, stop=stop, frequency_penalty=frequency_penalty,
                           presence_penalty=presence_penalty, repeat_penalty=repeat_penalty, top_k=top_k, seed=seed,
                           mirostat_mode=mirostat_mode, logit_bias=logit_bias,
                           trace=bool(stream and (dspark_trace or (stand_in is not None and stand_in.trace_on))))
        head = (oai.new_completion_id(), oai.now(), model if model is not None else self.model_path)
        if stream:   # like Llama: echo applies to non-streaming responses only
            return self._chunks(events, head, len(tokens), stand_in)
        done = None
        for ev in events:
            if isinstance(ev, Done):
                done = ev
        self._finish(done, stand_in)
        return oai.completion(*head, (prompt if echo else "") + done.text, done.finish_reason,
                              oai.usage(len(tokens), self._n_completion(done)), oai.timings(done.stats))

    def _run(self, tokens: List[int], grammar, *, max_tokens=16, temperature=0.8, top_p=0.95, min_p=0.05,
             typical_p=1.0, stop=None, frequency_penalty=0.0, presence_penalty=0.0, repeat_penalty=1.0, top_k=40,
             seed=None, mirostat_mode=0, logit_bias=None, trace=False):
        """The engine's events for a tokenized prompt (``grammar``: GBNF text or a compiled Grammar)."""
        bias = {int(k): float(v) for k, v in logit_bias.items()} if logit_bias else None
        n_ctx = self.target.n_ctx
        if len(tokens) >= n_ctx:
            raise ContextOverflowError(f"Requested tokens ({len(tokens)}) exceed context window of {n_ctx}")
        if max_tokens is None or max_tokens <= 0 or max_tokens + len(tokens) >= n_ctx:
            max_tokens = n_ctx - len(tokens)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        sampling = self._sampling(temperature, top_k, top_p, min_p, seed, repeat_penalty, presence_penalty,
                                  frequency_penalty, typical_p, mirostat_mode)
        if self._llm is not None:
            if self._llm.n_tokens:   # the Llama decoded since our last call: the memory is its, not ours
                self.decoder.forget()
            self._llm.reset()   # the shared KV is about to hold our sequence, not the Llama's
        return self.decoder.stream(tokens, int(max_tokens), n_max=self.n_max, stop=stops, sampling=sampling,
                                   reuse_prefix=self.cache_prompt, grammar=grammar, logit_bias=bias, trace=trace)

    def _chunks(self, events, head, n_prompt: int, stand_in) -> Iterator[dict]:
        for ev in events:
            if isinstance(ev, Chunk):
                if ev.trace is not None:   # dspark_trace: every chunk, its text empty or not
                    tr = trace_json(ev.tokens, ev.trace, self._piece)
                    if stand_in is not None:
                        stand_in.trace = tr
                    yield {**oai.completion_chunk(*head, ev.text), "dspark_trace": tr}
                elif ev.text:
                    yield oai.completion_chunk(*head, ev.text)
            else:
                self._finish(ev, stand_in)
                yield oai.completion_chunk(*head, "", ev.finish_reason,
                                           oai.usage(n_prompt, self._n_completion(ev)), oai.timings(ev.stats))

    def _piece(self, token: int) -> bytes:
        return bytes(self.target.token_to_piece(int(token), False))

    def _finish(self, done: Done, stand_in) -> None:
        self.last_stats = done.stats
        if stand_in is not None:
            stand_in.last = done

    def _n_completion(self, done: Done) -> int:
        """Completion tokens as llama-cpp-python counts them: an ending EOG token is not one."""
        n = len(done.tokens)
        if n and done.finish_reason == "stop" and self.target.is_eog(done.tokens[-1]):
            n -= 1
        return n
