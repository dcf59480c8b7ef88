"""llama-server's native ``POST /completion`` (also ``/completions``, as llama-server routes it).

Request fields: those of :func:`~.oai_request.parse_request` with kind ``"native"`` (``prompt`` as
text, token ids or a mix, ``n_predict``, ``stream``, ``stop``, ``cache_prompt``, ``n_probs``,
``post_sampling_probs``, ``grammar``, ``json_schema``, ``logit_bias``, ``ignore_eos``,
``return_tokens``, the sampling fields).  Response (server-task.cpp ``to_json_non_oaicompat``)::

    {"index", "content", "tokens", "id_slot", "stop": true, "model", "tokens_predicted",
     "tokens_evaluated", "generation_settings", "prompt", "has_new_line", "truncated",
     "stop_type": "eos" | "word" | "limit", "stopping_word", "tokens_cached", "timings",
     "completion_probabilities" (with n_probs > 0, not streaming)}

``tokens`` holds the generated ids only with ``return_tokens`` (llama-server's rule; else ``[]``).
Streaming sends ``data: {...}`` events, one per engine chunk, ``{"index", "content", "tokens"
(the chunk's ids), "stop": false, "id_slot", "tokens_predicted", "tokens_evaluated"
[, "completion_probabilities"]}``, then the final object above with empty ``content`` and
``tokens``; no ``[DONE]`` line (llama-server ends its native stream without one).
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Optional

from fastapi import Request
from sse_starlette.sse import EventSourceResponse

from pyllama_dspark.decode.cycle import Chunk, Done
from pyllama_dspark.decode.timings import llama_timings

from pyllama_dspark.serve import openai_format as fmt
from pyllama_dspark.serve.oai_request import GenRequest
from pyllama_dspark.serve.slots import Cancelled

LLAMA_DEFAULT_SEED = 0xFFFFFFFF   # what llama-server reports for a random seed (-1)


def stop_type(done: Done) -> str:
    if done.finish_reason == "length":
        return "limit"
    return "word" if done.stop_word else "eos"


def generation_settings(vals: Dict[str, Any], *, n_predict: int = -1, stop=(), ignore_eos: bool = False,
                        stream: bool = False, n_probs: int = 0, post_sampling_probs: bool = False,
                        logit_bias: Optional[Dict[int, float]] = None, grammar: Optional[str] = None,
                        only_metrics: bool = False) -> Dict[str, Any]:
    """llama-server's ``task_params::to_json`` for the fields that apply here (``only_metrics``:
    the shorter form of ``/props``' ``default_generation_settings.params``).  ``vals``: the
    request's sampling values under llama-server's names (defaults merged)."""
    seed = vals.get("seed", -1)
    seed = LLAMA_DEFAULT_SEED if seed is None or int(seed) < 0 else int(seed)
    out: Dict[str, Any] = {
        "seed": seed, "temperature": vals.get("temperature"), "top_k": vals.get("top_k"),
        "top_p": vals.get("top_p"), "min_p": vals.get("min_p"), "repeat_last_n": vals.get("penalty_last_n"),
        "repeat_penalty": vals.get("repeat_penalty"), "presence_penalty": vals.get("presence_penalty"),
        "frequency_penalty": vals.get("frequency_penalty"),
    }
    if not only_metrics:
        out["stop"] = list(stop)
    out.update({"max_tokens": n_predict, "n_predict": n_predict, "ignore_eos": ignore_eos, "stream": stream})
    if not only_metrics:
        # -inf (a banned token) is written as null, as llama-server's JSON library writes it
        out["logit_bias"] = [{"bias": b if math.isfinite(b) else None, "token": t}
                             for t, b in (logit_bias or {}).items()]
    out["n_probs"] = n_probs
    if not only_metrics:
        out["grammar"] = grammar or ""
    out["post_sampling_probs"] = post_sampling_probs
    return out


def request_settings(srv: Any, req: GenRequest, job: Any) -> Dict[str, Any]:
    return generation_settings(srv.sampling_values(req), n_predict=req.max_tokens, stop=job.stop,
                               ignore_eos=req.ignore_eos, stream=req.stream, n_probs=job.n_probs,
                               post_sampling_probs=req.post_sampling_probs, logit_bias=job.logit_bias,
                               grammar=job.grammar)


def final_json(srv: Any, req: GenRequest, job: Any, done: Done, model: str) -> Dict[str, Any]:
    """The last (or only) response of a native completion."""
    st = done.stats
    target = srv.pool.front.target
    prompt = target.detokenize(job.prompt_tokens, special=True).decode("utf-8", "replace")
    n_prompt, n_gen = int(st.n_prompt), int(st.n_generated)
    out: Dict[str, Any] = {
        "index": 0,
        "content": "" if req.stream else done.text,
        "tokens": list(done.tokens) if req.return_tokens and not req.stream else [],
        "id_slot": job.slot,
        "stop": True,
        "model": model,
        "tokens_predicted": n_gen,
        "tokens_evaluated": n_prompt,
        "generation_settings": request_settings(srv, req, job),
        "prompt": prompt,
        "has_new_line": "\n" in done.text,
        # the context ran out before the request's own limit (llama-server: truncated + limit)
        "truncated": done.finish_reason == "length" and n_prompt + n_gen + 1 >= srv.pool.n_ctx,
        "stop_type": stop_type(done),
        "stopping_word": done.stop_word or "",
        # what the slot's memory holds afterwards: the prompt and every generated token but the last
        "tokens_cached": n_prompt + max(0, n_gen - 1),
        "timings": llama_timings(st),
    }
    if not req.stream and job.n_probs > 0:
        probs = srv.final_probs(done, req)
        if probs:
            out["completion_probabilities"] = probs
    return out


def partial_json(srv: Any, req: GenRequest, job: Any, ev: Chunk, n_decoded: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {"index": 0, "content": ev.text, "tokens": list(ev.tokens), "stop": False,
                           "id_slot": job.slot, "tokens_predicted": n_decoded,
                           "tokens_evaluated": len(job.prompt_tokens)}
    if job.n_probs > 0 and ev.probs:
        out["completion_probabilities"] = srv.probs(ev.probs, req)
    return out


async def _stream(srv: Any, req: GenRequest, job: Any, events, model: str):
    n_decoded = 0
    try:
        while True:
            ev = await events.get()
            if isinstance(ev, Chunk):
                n_decoded += len(ev.tokens)
                if ev.tokens or ev.text:
                    yield {"data": json.dumps({**partial_json(srv, req, job, ev, n_decoded),
                                               **fmt.chunk_extras(req, ev, srv.piece)})}
            elif isinstance(ev, Done):
                yield {"data": json.dumps(final_json(srv, req, job, ev, model))}
                return
            elif isinstance(ev, Cancelled):
                return
            elif isinstance(ev, BaseException):
                e = srv.engine_error(ev)
                yield {"data": json.dumps(fmt.error_body(e.message, e.type, e.code))}
                return
    finally:
        job.cancel()   # normal end: no-op; client gone: stop the generation


def add_native_routes(app: Any, srv: Any) -> None:
    """Register ``POST /completion`` and ``POST /completions`` on ``app`` (``srv``: the server's
    :class:`~.server.Serving`)."""

    async def completion(request: Request):
        req, job, events = await srv.start(request, "native")
        model = srv.config.model_id
        if req.stream:
            return EventSourceResponse(_stream(srv, req, job, events, model), sep="\n", ping=15)
        ev = await srv.wait_done(request, job, events)
        if not isinstance(ev, Done):
            return ev   # the client went away: the response nobody reads
        return final_json(srv, req, job, ev, model)

    for path in ("/completion", "/completions"):
        app.add_api_route(path, completion, methods=["POST"])


__all__: List[str] = ["add_native_routes", "final_json", "generation_settings", "partial_json", "stop_type"]
