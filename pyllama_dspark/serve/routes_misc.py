"""llama-server's small endpoints (tools/server/server-context.cpp), registered by :func:`add_misc_routes`.

* ``POST /tokenize`` ``{"content": text | [text or id, ...], "add_special": false,
  "parse_special": true, "with_pieces": false}`` -> ``{"tokens": [id, ...]}`` or, with pieces,
  ``[{"id", "piece"}]`` (the piece as text, or its byte values when it is not valid UTF-8);
* ``POST /detokenize`` ``{"tokens": [...]}`` -> ``{"content": text}`` (special tokens rendered);
* ``POST /apply-template`` ``{"messages": [...]}`` -> ``{"prompt": text}``: the prompt a chat
  request would decode, from the same chat template (with ``tools``, as the template renders them);
* ``GET /props``: ``default_generation_settings`` (``params``, ``n_ctx``), ``total_slots``,
  ``model_alias``, ``model_path``, ``modalities``, ``endpoint_slots`` / ``_props`` / ``_metrics``,
  ``chat_template``, ``bos_token``, ``eos_token``, ``build_info``, ``is_sleeping``, and ours:
  ``dspark`` (``draft``, ``draft_kind``, ``n_max``: the draft the server runs);
* ``GET /slots``: the pool's ``slots_info()`` (llama-server's per-slot objects; ``?fail_on_no_slot=1``
  answers 503 when no slot is idle);
* ``GET /metrics``: Prometheus text (:mod:`.metrics`) when the server runs with ``--metrics``,
  else 501 with llama-server's message.

Token ids outside the vocabulary are a 400 here (llama.cpp would read out of bounds).
"""

from __future__ import annotations

from typing import Any, Dict, List

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from pyllama_dspark.serve import metrics as met
from pyllama_dspark.serve.native import generation_settings
from pyllama_dspark.serve.tool_serving import render_prompt
from pyllama_dspark.serve.oai_request import RequestError, _bool, _is, _typename, parse_request, tokenize_mixed


def is_valid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_typename(body)}")
    return body


def _check_ids(ids: List[int], n_vocab: int, param: str) -> None:
    bad = [t for t in ids if t < 0 or t >= n_vocab]
    if bad:
        raise RequestError(f"token ids must be in 0..{n_vocab - 1}, got {bad[:5]}", param=param)


def tokenize_body(body: Any, target: Any) -> Dict[str, Any]:
    """``/tokenize``'s answer for a decoded body."""
    body = _object(body)
    add_special = _bool(body, "add_special", False)
    parse_special = _bool(body, "parse_special", True)
    with_pieces = _bool(body, "with_pieces", False)
    content = body.get("content")
    if content is None:
        return {"tokens": []}
    if not (isinstance(content, str) or isinstance(content, list)
            and all(isinstance(p, str) or _is(p, int) for p in content)):
        raise RequestError("'content' must be a string or an array of strings and token ids", param="content")
    if isinstance(content, list):
        _check_ids([p for p in content if not isinstance(p, str)], target.n_vocab, "content")
    toks = tokenize_mixed(content, lambda text, add: target.tokenize(text, add, parse_special), add_special)
    if not with_pieces:
        return {"tokens": toks}
    out = []
    for t in toks:
        piece = bytes(target.token_to_piece(t, True))
        out.append({"id": t, "piece": piece.decode("utf-8") if is_valid_utf8(piece) else list(piece)})
    return {"tokens": out}


def detokenize_body(body: Any, target: Any) -> Dict[str, Any]:
    body = _object(body)
    toks = body.get("tokens")
    if toks is None:
        return {"content": ""}
    if not isinstance(toks, list) or not all(_is(t, int) for t in toks):
        raise RequestError("'tokens' must be an array of token ids", param="tokens")
    _check_ids(toks, target.n_vocab, "tokens")
    return {"content": target.detokenize(toks, special=True).decode("utf-8", "replace")}


def _token_text(target: Any, which: str) -> str:
    try:
        from llama_cpp import llama_cpp as ll

        tok = int(getattr(ll, "llama_vocab_" + which)(target.vocab))
        return bytes(target.token_to_piece(tok, True)).decode("utf-8", "replace") if tok >= 0 else ""
    except Exception:   # no vocabulary to ask (a stand-in target)
        return ""


def _build_info() -> str:
    from importlib import metadata

    def ver(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "unknown"

    return f"pyllama-dspark {ver('pyllama-dspark')} (llama-cpp-python {ver('llama-cpp-python')})"


def props_body(srv: Any) -> Dict[str, Any]:
    pool, config = srv.pool, srv.config
    target = pool.front.target
    meta = getattr(target, "meta", None)
    template = (meta("tokenizer.chat_template") if callable(meta) else None) or ""
    vals = dict(config.sampling_defaults)
    return {
        "default_generation_settings": {"params": generation_settings(vals, only_metrics=True), "n_ctx": pool.n_ctx},
        "total_slots": pool.n_slots,
        "model_alias": config.model_id,
        "model_path": config.model_path or config.model_id,
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": True,
        "endpoint_props": False,
        "endpoint_metrics": bool(config.metrics),
        "chat_template": template,
        "bos_token": _token_text(target, "bos"),
        "eos_token": _token_text(target, "eos"),
        "build_info": _build_info(),
        "is_sleeping": False,
        # the draft the server runs (the web page shows it): its file, kind and block (0: no draft)
        "dspark": {k: config.model_meta.get(k) for k in ("draft", "draft_kind", "n_max")},
        **({"recurrent_state": config.model_meta["recurrent_state"]} if "recurrent_state" in config.model_meta else {}),
    }


def slots_body(pool: Any) -> List[Dict[str, Any]]:
    """``pool.slots_info()`` when the pool has it, else what the pool tells of each slot."""
    info = getattr(pool, "slots_info", None)
    if callable(info):
        return list(info())
    busy = list(getattr(pool, "busy", []) or [])
    n_busy = pool.n_busy
    spec = getattr(pool.front, "draft", None) is not None
    return [{"id": i, "n_ctx": pool.n_ctx, "speculative": spec,
             "is_processing": bool(busy[i]) if i < len(busy) else i < n_busy} for i in range(pool.n_slots)]


def add_misc_routes(app: Any, srv: Any) -> None:
    """Register the small endpoints on ``app`` (``srv``: the server's :class:`~.server.Serving`)."""

    @app.post("/tokenize")
    async def tokenize(request: Request):
        srv.auth(request)
        return await run_in_threadpool(tokenize_body, await srv.body(request), srv.pool.front.target)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        srv.auth(request)
        return await run_in_threadpool(detokenize_body, await srv.body(request), srv.pool.front.target)

    @app.post("/apply-template")
    async def apply_template(request: Request):
        srv.auth(request)
        req = parse_request(await srv.body(request), "chat")
        if req.tools is not None:   # tools and tool turns: the template renders them (tool_serving)
            plan = await run_in_threadpool(render_prompt, srv.pool.front.target, req)
            return {"prompt": plan.prompt}
        try:
            cp = await run_in_threadpool(srv.pool.front.chat_prompt, req.messages)
        except ValueError as e:
            raise RequestError(f"cannot apply the chat template: {e}", param="messages") from e
        return {"prompt": cp.text}

    @app.get("/props")
    async def props(request: Request):
        srv.auth(request)
        return await run_in_threadpool(props_body, srv)

    @app.get("/slots")
    async def slots(request: Request):
        srv.auth(request)
        info = slots_body(srv.pool)
        if request.query_params.get("fail_on_no_slot") and all(s.get("is_processing") for s in info):
            raise RequestError("no slot available", type="unavailable_error", code=503)
        return JSONResponse(info)

    @app.get("/metrics")
    async def metrics(request: Request):
        srv.auth(request)
        if not srv.config.metrics:
            raise RequestError(met.NOT_ENABLED, type="not_supported_error", code=501)
        text = await run_in_threadpool(srv.metrics.render)
        return Response(text, media_type=met.CONTENT_TYPE,
                        headers={"Process-Start-Time-Unix": str(srv.metrics.t_start)})


__all__ = ["add_misc_routes", "detokenize_body", "props_body", "slots_body", "tokenize_body"]
