"""OpenAI-compatible HTTP front end (FastAPI + uvicorn + sse-starlette) over a :class:`SlotPool`.

Endpoints as llama-server routes them: ``POST /v1/chat/completions`` (and ``/chat/completions``),
``POST /v1/completions`` (OpenAI; ``"stream": true`` sends server-sent events ending with
``data: [DONE]``), ``POST /completion`` and ``/completions`` (llama-server's native form,
:mod:`.native`), ``POST /tokenize``, ``/detokenize``, ``/apply-template``, ``GET /props``,
``/slots``, ``/metrics`` (with ``config.metrics``; :mod:`.routes_misc`), ``GET /`` (the web page,
:mod:`.webui`), ``POST /v1/messages`` and
``/v1/messages/count_tokens`` (Anthropic Messages), ``POST /v1/responses`` and
``/v1/responses/input_tokens`` (OpenAI Responses; :mod:`.agent_routes`), ``GET /v1/models`` (and
``/models``), ``GET /health`` (and ``/v1/health``).  Every non-streaming response and the last
stream chunk carry llama-server's ``timings`` object; ``usage`` carries
``prompt_tokens_details.cached_tokens``; with ``logprobs`` / ``n_probs`` the token probabilities
are laid out as llama-server lays them out (:func:`.openai_format.probs_json`).  Request fields:
:mod:`.oai_request` (grammar / JSON schema, logit bias, probabilities, ``cache_prompt`` ... are
checked there and go on the :class:`~.slots.Job`).

Errors are OpenAI-style bodies ``{"error": {"code", "message", "type"}}``: bad JSON / wrong types
-> 400 ``invalid_request_error``, a prompt that does not fit the context -> 400
``exceed_context_size_error``, a missing / wrong API key -> 401 ``authentication_error``,
unknown routes -> 404, anything unexpected -> 500; the server keeps serving after each.
A client that disconnects (streaming or not) cancels its generation and frees its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from pyllama_dspark.serve import openai_format as fmt
from pyllama_dspark.decode.cycle import Chunk, Done
from pyllama_dspark.errors import ContextOverflowError
from pyllama_dspark.serve.metrics import ServerMetrics
from pyllama_dspark.serve.agent_routes import add_agent_routes
from pyllama_dspark.serve.native import add_native_routes
from pyllama_dspark.serve.oai_request import (GenRequest, RequestError, check_grammar, grammar_text, parse_json_body,
                                              parse_request, resolve_logit_bias, tokenize_mixed)
from pyllama_dspark.serve.routes_misc import add_misc_routes
from pyllama_dspark.serve.slots import Cancelled, Job, SlotPool
from pyllama_dspark.serve.tool_serving import ToolReply, tool_prompt
from pyllama_dspark.serve.webui import add_webui_routes
from pyllama_dspark.decode.timings import llama_timings
from pyllama_dspark.speculative.sampling_params import SamplingParams

log = logging.getLogger("pyllama_dspark.serve.server")


def sampling_defaults(p: SamplingParams) -> Dict[str, Any]:
    """A request's sampling defaults (llama-server's request field names) from ``p``."""
    return {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
            "seed": -1 if p.seed is None else p.seed, "repeat_penalty": p.repeat_penalty,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "penalty_last_n": p.penalty_last_n}


# llama-server's sampling defaults (common_params_sampling, the SamplingParams defaults); `serve
# --temp ...` changes them
LLAMA_SERVER_SAMPLING = sampling_defaults(SamplingParams())

_DISCONNECT_POLL_S = 0.25


@dataclass
class ServerConfig:
    model_id: str
    api_key: Optional[str] = None
    sampling_defaults: Dict[str, Any] = field(default_factory=lambda: dict(LLAMA_SERVER_SAMPLING))
    model_meta: Dict[str, Any] = field(default_factory=dict)
    metrics: bool = False                  # `serve --metrics`: GET /metrics answers (else 501, as llama-server)
    model_path: Optional[str] = None       # /props "model_path" (default: model_id)
    webui: bool = True                     # GET / serves the web page (`serve --no-webui`: off)


def sampling_for(req: GenRequest, defaults: Dict[str, Any]):
    """SamplingParams for a request (None = plain greedy), or RequestError when the values are invalid."""
    vals = dict(defaults)
    vals.update(req.sampling)
    if float(vals.get("temperature", 0.0)) <= 0.0:
        # llama.cpp penalizes before its greedy pick: the penalties (only they) still apply at T = 0
        pen = {k: vals[k] for k in ("repeat_penalty", "presence_penalty", "frequency_penalty", "penalty_last_n")
               if k in vals}
        try:
            greedy = SamplingParams(temperature=0.0, **pen)
        except (TypeError, ValueError) as e:
            raise RequestError(str(e)) from e
        return greedy if greedy.has_penalties else None
    fields = SamplingParams.__dataclass_fields__
    kw = {k: v for k, v in vals.items() if k in fields}
    if kw.get("seed") is not None and int(kw["seed"]) < 0:
        kw["seed"] = None
    try:
        return SamplingParams(**kw)
    except (TypeError, ValueError) as e:
        raise RequestError(str(e)) from e


def prepare_prompt(pool: SlotPool, req: GenRequest) -> Tuple[List[int], List[str]]:
    """Token ids and stop strings of a request; RequestError when it cannot be served."""
    sp = pool.front
    stop = list(req.stop)
    if req.kind == "chat":
        try:
            cp = sp.chat_prompt(req.messages)
        except ValueError as e:
            raise RequestError(f"cannot apply the chat template: {e}", param="messages") from e
        tokens, stop = list(cp.tokens), stop + list(cp.stop)
    elif isinstance(req.prompt, str):
        tokens = sp.tokenize(req.prompt)
    else:   # token ids, or llama-server's mix of text pieces and ids
        n_vocab = sp.target.n_vocab
        bad = [t for t in req.prompt if not isinstance(t, str) and (t < 0 or t >= n_vocab)]
        if bad:
            raise RequestError(f"prompt token ids must be in 0..{n_vocab - 1}, got {bad[:5]}", param="prompt")
        tokens = tokenize_mixed(req.prompt, lambda text, add: sp.target.tokenize(text, add, True), True)
    if not tokens:
        raise RequestError("the prompt is empty after tokenization", param="prompt")
    n_ctx = pool.n_ctx
    if len(tokens) >= n_ctx:
        raise RequestError(f"request ({len(tokens)} tokens) exceeds the available context size ({n_ctx} tokens), "
                           f"try increasing it", type="exceed_context_size_error", code=400)
    return tokens, stop



def engine_constraints(pool: SlotPool, req: GenRequest, grammar: bool = True
                       ) -> Tuple[Optional[str], Optional[Dict[int, float]]]:
    """The request's grammar (GBNF, checked: it compiles against the target; ``grammar=False``: not
    read, a request with tools has its own) and its logit bias (token id -> bias); RequestError when
    they cannot be served."""
    target = pool.front.target
    try:
        gbnf = grammar_text(req) if grammar else None
        if gbnf is not None:
            check_grammar(gbnf, target)
    except ImportError as e:
        raise RequestError(f"grammar constraints are not available in this build: {e}", type="not_supported_error",
                           code=501, param="grammar") from e
    bias = None
    if req.logit_bias:
        bias = resolve_logit_bias(req.logit_bias, lambda text: target.tokenize(text, False, False), target.n_vocab)
    if req.ignore_eos:   # llama-server's ignore_eos: every end-of-generation token banned (server-schema.cpp)
        bias = {**(bias or {}), **{int(t): -math.inf for t in np.flatnonzero(target.eog_mask)}}
    return gbnf, bias


def _error_response(e: RequestError) -> JSONResponse:
    return JSONResponse(fmt.error_body(e.message, e.type, e.code, e.param), status_code=e.code)


def _engine_error(e: BaseException) -> RequestError:
    if isinstance(e, (ContextOverflowError, ValueError)):
        return RequestError(str(e))
    return RequestError(f"generation failed: {e}", type="server_error", code=500)


class Serving:
    """What the routes share (here, :mod:`.native`, :mod:`.routes_misc`): the pool, the config, the
    metrics, the API-key check, body decoding, starting a job and waiting for its end, and token
    probabilities laid out as llama-server lays them out."""

    engine_error = staticmethod(_engine_error)

    def __init__(self, pool: SlotPool, config: ServerConfig):
        self.pool = pool
        self.config = config
        self.metrics = ServerMetrics(pool)
        self._pieces: Dict[int, bytes] = {}

    def auth(self, request: Request) -> None:
        key = self.config.api_key
        if not key:
            return
        given = request.headers.get("authorization") or request.headers.get("x-api-key") or ""
        if given.startswith("Bearer "):
            given = given[len("Bearer "):]
        if given != key:
            log.warning("unauthorized: Invalid API Key")
            raise RequestError("Invalid API Key", type="authentication_error", code=401)

    async def body(self, request: Request) -> Any:
        return parse_json_body(await request.body())

    # ---- token probabilities -------------------------------------------------------------------
    def piece(self, token: int) -> bytes:
        """A token's text as generation emits it (special tokens not rendered), cached."""
        p = self._pieces.get(token)
        if p is None:
            p = self._pieces[token] = bytes(self.pool.front.target.token_to_piece(int(token), False))
        return p

    def probs(self, probs: Optional[list], req: GenRequest) -> List[dict]:
        return fmt.probs_json(probs, self.piece, req.post_sampling_probs)

    def final_probs(self, done: Done, req: GenRequest) -> List[dict]:
        """A finished request's probabilities; after a stop string, without as many tokens as the
        stop string has (llama-server's ``send_final_response``)."""
        probs = list(done.probs or [])
        if done.stop_word and probs:
            n = len(self.pool.front.target.tokenize(done.stop_word, False, False))
            probs = probs[:len(probs) - min(len(probs), n)]
        return self.probs(probs, req)

    def sampling_values(self, req: GenRequest) -> Dict[str, Any]:
        vals = dict(self.config.sampling_defaults)
        vals.update(req.sampling)
        return vals

    # ---- generation ----------------------------------------------------------------------------
    async def start(self, request: Request, kind: str, body: Any = None):
        """Parse and check a generation request (``body``: already decoded, else the request's),
        submit its Job; (request, job, event queue)."""
        self.auth(request)
        req = parse_request(await self.body(request) if body is None else body, kind)
        sampling = sampling_for(req, self.config.sampling_defaults)
        pool = self.pool
        reply = None
        if req.kind == "chat" and req.tools is not None:   # tools: prompt and grammar of tool_serving
            plan, tokens, gbnf = await run_in_threadpool(tool_prompt, pool, req)
            stop = list(req.stop)
            own, bias = await run_in_threadpool(engine_constraints, pool, req, gbnf is None)
            gbnf = own if gbnf is None else gbnf    # tool_choice "none": the request's own grammar, if any
            reply = ToolReply(plan, pool.front.target, stop)
        else:
            tokens, stop = await run_in_threadpool(prepare_prompt, pool, req)
            gbnf, bias = await run_in_threadpool(engine_constraints, pool, req)
        max_tokens = req.max_tokens if req.max_tokens > 0 else pool.n_ctx
        loop = asyncio.get_running_loop()
        events: "asyncio.Queue[Any]" = asyncio.Queue()
        metrics = self.metrics

        streaming = bool(req.stream)

        def on_event(ev: Any) -> None:   # from the worker thread
            if isinstance(ev, (Done, BaseException)) and not isinstance(gbnf, (str, type(None))):
                gbnf.close()   # a lazy grammar: the decoder worked on its own copy, now done
            if not streaming and isinstance(ev, Chunk):
                # a non-streaming reply needs only its Done: no event-loop wake-up per step (on a
                # 2-core machine each one takes CPU from llama.cpp's threads)
                return
            if isinstance(ev, Done):
                try:
                    metrics.observe(ev.stats)
                except Exception as e:   # never lose the event over a metric
                    log.warning("metrics: %s", e)
            loop.call_soon_threadsafe(events.put_nowait, ev)

        job = Job(tokens, max_tokens, on_event, stop=stop, sampling=sampling, ignore_eos=req.ignore_eos,
                  grammar=gbnf, logit_bias=bias, n_probs=min(req.n_probs, int(pool.front.target.n_vocab)),
                  post_sampling_probs=req.post_sampling_probs, cache_prompt=req.cache_prompt, reply=reply,
                  n_max=req.n_max, trace=streaming and (req.trace or req.timings_per_token))
        try:
            pool.submit(job)
        except RuntimeError as e:   # the pool is closed: the server is shutting down
            raise RequestError(f"the server is shutting down ({e})", type="unavailable_error", code=503) from e
        return req, job, events

    def prompt_tokens(self, req: GenRequest) -> List[int]:
        """The prompt tokens a chat request would decode (its tools included); RequestError."""
        if req.tools is None:
            return prepare_prompt(self.pool, req)[0]
        _, tokens, g = tool_prompt(self.pool, req)
        if g is not None and not isinstance(g, str):
            g.close()       # a lazy grammar, not used
        return tokens

    def completion(self, req: GenRequest, job: Job, ev: Done, kind: str, model: str) -> Dict[str, Any]:
        """A finished job's OpenAI response (a chat completion with the parsed message where the
        request had tools, else a chat or text completion)."""
        st = ev.stats
        lp = self.final_probs(ev, req) if job.n_probs > 0 else None
        if job.reply is not None:
            parsed, _, reason = job.reply.finish(ev, streamed=False)
            msg = ToolReply.message(parsed) if parsed is not None else None
            return fmt.chat_completion(fmt.new_id(kind), model, ev.text, reason, st.n_prompt, st.n_generated,
                                       llama_timings(st), n_cached=st.n_cached, logprobs=lp, message=msg)
        build = fmt.chat_completion if kind == "chat" else fmt.text_completion
        return build(fmt.new_id(kind), model, ev.text, ev.finish_reason, st.n_prompt, st.n_generated,
                     llama_timings(st), n_cached=st.n_cached, logprobs=lp)

    async def replies(self, job: Job, events: "asyncio.Queue[Any]"):
        """A streamed job's events: ``("delta", d)`` (a chat delta of a tool request; before them
        ``("trace", chunk)``, the Chunk, when the job traces), ``("text", chunk)`` (a Chunk of any
        other), then ``("done", Done)`` (its finish reason
        "tool_calls" when calls came, their last deltas before it) or ``("error", RequestError)``;
        nothing more after a cancel.  The job is cancelled when the consumer goes away."""
        tools = job.reply is not None and job.reply.differ is not None
        try:
            while True:
                ev = await events.get()
                if isinstance(ev, Chunk) and tools:
                    if job.trace:
                        yield "trace", ev
                    for d in job.reply.deltas(ev.tokens):
                        yield "delta", d
                elif isinstance(ev, Chunk):
                    yield "text", ev
                elif isinstance(ev, Done):
                    if tools:   # the last deltas, and "tool_calls" as the finish reason
                        _, last, ev.finish_reason = job.reply.finish(ev, streamed=True)
                        for d in last:
                            yield "delta", d
                    yield "done", ev
                    return
                elif isinstance(ev, Cancelled):
                    return
                elif isinstance(ev, BaseException):
                    yield "error", _engine_error(ev)
                    return
        finally:
            # normal end: no-op; client gone (generator cancelled / closed): stop the generation
            job.cancel()

    async def wait_done(self, request: Request, job: Job, events: "asyncio.Queue[Any]"):
        """The job's Done (non-streaming), or a 499 response when the client went away."""
        loop_time = asyncio.get_running_loop().time
        try:
            next_poll = loop_time() + _DISCONNECT_POLL_S
            while True:
                try:
                    ev = await asyncio.wait_for(events.get(), max(0.0, next_poll - loop_time()))
                except asyncio.TimeoutError:
                    ev = None
                if loop_time() >= next_poll:
                    # by the clock, not only when no event came: a non-streaming job emits events
                    # all the time while it decodes
                    next_poll = loop_time() + _DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        log.info("task %d: client disconnected, cancelling", job.task_id)
                        job.cancel()
                        return JSONResponse(fmt.error_body("client disconnected", "server_error", 499),
                                            status_code=499)
                if ev is None:
                    continue
                if isinstance(ev, Done):
                    return ev
                if isinstance(ev, Cancelled):
                    raise RequestError("the request was cancelled", type="unavailable_error", code=503)
                if isinstance(ev, BaseException):
                    raise _engine_error(ev)
        finally:
            job.cancel()  # no-op once finished; stops the generation if this handler is cancelled


def create_app(pool: SlotPool, config: ServerConfig) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # the server is stopping: cancel what is still queued or running and free the contexts
        # (waits for a close already under way, e.g. started by the signal handler of `serve`)
        await run_in_threadpool(pool.close)

    app = FastAPI(title="pyllama-dspark", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    srv = Serving(pool, config)
    app.state.pool = pool
    app.state.config = config
    app.state.serving = srv

    # ---- errors --------------------------------------------------------------------------------
    @app.exception_handler(RequestError)
    async def _on_request_error(request: Request, e: RequestError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(request: Request, e: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        return JSONResponse(fmt.error_body(str(e.detail), kind, e.status_code), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _on_error(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(fmt.error_body(f"internal error: {e}", "server_error", 500), status_code=500)

    # ---- simple endpoints ----------------------------------------------------------------------
    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        return {"status": "ok", "slots_idle": pool.n_slots - pool.n_busy, "slots_processing": pool.n_busy}

    @app.get("/v1/models")
    @app.get("/models")
    async def models(request: Request):
        srv.auth(request)
        return fmt.models_list(config.model_id, config.model_meta)

    add_misc_routes(app, srv)
    if config.webui:
        add_webui_routes(app)
    add_native_routes(app, srv)
    add_agent_routes(app, srv)

    # ---- OpenAI generation ---------------------------------------------------------------------
    async def _complete(request: Request, kind: str):
        req, job, events = await srv.start(request, kind)
        model = req.model or config.model_id
        if req.stream:
            return EventSourceResponse(_stream(req, job, events, kind, model), sep="\n", ping=15)
        ev = await srv.wait_done(request, job, events)
        if not isinstance(ev, Done):
            return ev
        return srv.completion(req, job, ev, kind, model)

    async def _stream(req: GenRequest, job: Job, events: "asyncio.Queue[Any]", kind: str, model: str):
        cid, created = fmt.new_id(kind), int(time.time())

        def chunk(text: Optional[str] = None, finish: Optional[str] = None, timings=None, role: bool = False,
                  probs: Optional[list] = None, extra: Optional[dict] = None):
            lp = srv.probs(probs, req) if probs and job.n_probs > 0 else None
            if kind == "chat":
                delta: Dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                out = fmt.chat_chunk(cid, model, created, delta, finish, timings, logprobs=lp)
            else:
                out = fmt.text_chunk(cid, model, created, text or "", finish, timings, logprobs=lp)
            return json.dumps({**out, **extra} if extra else out)

        if kind == "chat":
            yield {"data": chunk(role=True, text="")}
        async for what, ev in srv.replies(job, events):
            if what == "delta":
                yield {"data": json.dumps(fmt.chat_chunk(cid, model, created, ev))}
            elif what == "trace":   # a tool request's chunk: its trace before its deltas
                yield {"data": json.dumps({**fmt.chat_chunk(cid, model, created, {}),
                                           **fmt.chunk_extras(req, ev, srv.piece)})}
            elif what == "text":
                extra = fmt.chunk_extras(req, ev, srv.piece)
                if ev.text or (ev.probs and job.n_probs > 0) or extra:
                    yield {"data": chunk(ev.text, probs=ev.probs, extra=extra)}
            elif what == "done":
                st = ev.stats
                t = llama_timings(st)
                if req.include_usage:
                    yield {"data": chunk(finish=ev.finish_reason)}
                    yield {"data": json.dumps(fmt.usage_chunk(kind, cid, model, created, st.n_prompt,
                                                              st.n_generated, t, n_cached=st.n_cached))}
                else:
                    yield {"data": chunk(finish=ev.finish_reason, timings=t)}
                yield {"data": "[DONE]"}
            else:
                yield {"data": json.dumps(fmt.error_body(ev.message, ev.type, ev.code))}

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        return await _complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(request, "completion")

    return app
