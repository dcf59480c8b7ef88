"""The agents' APIs on ``serve``, each converted into a chat request and run on the chat path (DSpark,
the schedule, grammars, every tool-call format, the prompt cache):

* Anthropic Messages (:mod:`.anthropic`): ``POST /v1/messages`` -> Anthropic's ``message`` or, with
  ``"stream": true``, its events; ``POST /v1/messages/count_tokens`` -> ``{"input_tokens": N}``.
  Errors in Anthropic's shape (in a stream, an ``error`` event);
* OpenAI Responses (:mod:`.responses`): ``POST /v1/responses`` (and ``/responses``) -> a
  ``response`` or its events; ``POST /v1/responses/input_tokens`` (and ``/responses/input_tokens``)
  -> ``{"object": "response.input_tokens", "input_tokens": N}``.  Errors in OpenAI's shape.

``input_tokens`` / ``count_tokens`` count the prompt as the generating route would decode it (tools
included), as llama-server's ``handle_count_tokens`` does.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from pyllama_dspark.decode.cycle import Done
from pyllama_dspark.serve import anthropic as an
from pyllama_dspark.serve import responses as rs
from pyllama_dspark.serve.oai_request import RequestError, parse_request

__all__ = ["add_agent_routes"]


def _sse(pair) -> dict:
    return {"event": pair[0], "data": json.dumps(pair[1], ensure_ascii=False)}


def add_agent_routes(app: FastAPI, srv: Any) -> None:
    """Add the routes to ``app``; ``srv``: the server's :class:`~.server.Serving`."""

    async def _start(request: Request, convert: Callable[[Any], dict]):
        srv.auth(request)
        raw = await srv.body(request)
        req, job, events = await srv.start(request, "chat", convert(raw))
        model = raw.get("model") if isinstance(raw.get("model"), str) else srv.config.model_id
        return req, job, events, model

    async def _count(request: Request, convert: Callable[[Any], dict]) -> int:
        srv.auth(request)
        req = parse_request(convert(await srv.body(request)), "chat")
        return len(await run_in_threadpool(srv.prompt_tokens, req))

    async def _events(job, events, shaper):
        """The job's stream through ``shaper`` (:class:`.anthropic.EventShaper`, :class:`.responses.ResponseShaper`)."""
        for pair in shaper.start(len(job.prompt_tokens)):
            yield _sse(pair)
        async for what, ev in srv.replies(job, events):
            if what in ("delta", "text"):
                for pair in shaper.delta(ev if what == "delta" else {"content": ev.text}):
                    yield _sse(pair)
            elif what == "done":
                for pair in shaper.done(ev):
                    yield _sse(pair)
            else:
                yield _sse(shaper.error(ev))

    # ---- Anthropic Messages --------------------------------------------------------------------
    def _an_error(e: RequestError) -> JSONResponse:
        return JSONResponse(an.error_body(e), status_code=e.code)

    @app.post("/v1/messages")
    async def messages(request: Request):
        try:
            req, job, events, model = await _start(request, an.to_chat_body)
        except RequestError as e:
            return _an_error(e)
        mid = an.new_id()
        if req.stream:
            return EventSourceResponse(_events(job, events, an.EventShaper(mid, model)), sep="\n", ping=15)
        try:
            ev = await srv.wait_done(request, job, events)
        except RequestError as e:
            return _an_error(e)
        if not isinstance(ev, Done):
            return ev
        choice, st = srv.completion(req, job, ev, "chat", model)["choices"][0], ev.stats
        return an.message_object(mid, model, choice["message"], choice["finish_reason"], ev.stop_word,
                                 st.n_prompt, st.n_cached, st.n_generated)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        try:
            return {"input_tokens": await _count(request, an.to_chat_body)}
        except RequestError as e:
            return _an_error(e)

    # ---- OpenAI Responses (errors: the app's OpenAI-shaped handler) -----------------------------
    @app.post("/v1/responses")
    @app.post("/responses")
    async def responses(request: Request):
        req, job, events, model = await _start(request, rs.to_chat_body)
        rid = rs.new_id()
        if req.stream:
            return EventSourceResponse(_events(job, events, rs.ResponseShaper(rid, model)), sep="\n", ping=15)
        ev = await srv.wait_done(request, job, events)
        if not isinstance(ev, Done):
            return ev
        choice, st = srv.completion(req, job, ev, "chat", model)["choices"][0], ev.stats
        return rs.response_object(rid, model, choice["message"], choice["finish_reason"], st.n_prompt, st.n_cached,
                                  st.n_generated)

    @app.post("/v1/responses/input_tokens")
    @app.post("/responses/input_tokens")
    async def input_tokens(request: Request):
        return {"object": "response.input_tokens", "input_tokens": await _count(request, rs.to_chat_body)}
