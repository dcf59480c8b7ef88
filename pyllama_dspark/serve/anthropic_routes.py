"""The Anthropic Messages routes of ``serve`` (:mod:`.anthropic` converts and shapes):

* ``POST /v1/messages``: the request converted to chat completions and run on their path (DSpark,
  the schedule, grammars, every tool-call format, the prompt cache); the reply as Anthropic's
  ``message``, or with ``"stream": true`` as its events (``message_start``, ``ping``,
  ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``, ``message_stop``);
* ``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, the prompt's tokens as
  ``/v1/messages`` would decode them (tools included).

Every error on them is Anthropic's ``{"type": "error", "error": {...}}`` (in a stream, an ``error``
event).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from pyllama_dspark.decode.cycle import Done
from pyllama_dspark.serve import anthropic as an
from pyllama_dspark.serve.oai_request import RequestError, parse_request

__all__ = ["add_anthropic_routes"]


def _error(e: RequestError) -> JSONResponse:
    return JSONResponse(an.error_body(e), status_code=e.code)


def add_anthropic_routes(app: FastAPI, srv: Any) -> None:
    """Add the routes to ``app``; ``srv``: the server's :class:`~.server.Serving`."""

    async def _body(request: Request):
        srv.auth(request)
        raw = await srv.body(request)
        return raw, an.to_chat_body(raw)

    @app.post("/v1/messages")
    async def messages(request: Request):
        try:
            raw, body = await _body(request)
            req, job, events = await srv.start(request, "chat", body)
        except RequestError as e:
            return _error(e)
        model = raw.get("model") if isinstance(raw.get("model"), str) else srv.config.model_id
        mid = an.new_id()
        if req.stream:
            return EventSourceResponse(_events(job, events, an.EventShaper(mid, model)), sep="\n", ping=15)
        try:
            ev = await srv.wait_done(request, job, events)
        except RequestError as e:
            return _error(e)
        if not isinstance(ev, Done):
            return ev
        resp = srv.completion(req, job, ev, "chat", model)
        choice, st = resp["choices"][0], ev.stats
        return an.message_object(mid, model, choice["message"], choice["finish_reason"], ev.stop_word,
                                 st.n_prompt, st.n_cached, st.n_generated)

    async def _events(job, events, shaper: "an.EventShaper"):
        def sse(pair):
            return {"event": pair[0], "data": json.dumps(pair[1], ensure_ascii=False)}

        for pair in shaper.start(len(job.prompt_tokens), 0):
            yield sse(pair)
        async for what, ev in srv.replies(job, events):
            if what == "delta":
                for pair in shaper.delta(ev):
                    yield sse(pair)
            elif what == "text":
                for pair in shaper.delta({"content": ev.text}):
                    yield sse(pair)
            elif what == "done":
                st = ev.stats
                for name, data in shaper.finish(ev.finish_reason, ev.stop_word, st.n_generated):
                    if name == "message_delta":
                        data["usage"].update(input_tokens=st.n_prompt - st.n_cached, cache_read_input_tokens=st.n_cached)
                    yield sse((name, data))
            else:
                yield sse(("error", an.error_body(ev)))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        try:
            _, body = await _body(request)
            tokens = await run_in_threadpool(srv.prompt_tokens, parse_request(body, "chat"))
        except RequestError as e:
            return _error(e)
        return {"input_tokens": len(tokens)}
