"""OpenAI-style response dicts, laid out as llama-server returns them (tools/server/server-task.cpp).

Pure builders: chat completions and their stream chunks, text completions and their chunks,
``usage`` (with ``prompt_tokens_details.cached_tokens``), error bodies, the ``/v1/models`` list,
and token probabilities (:func:`probs_json`, llama-server's ``probs_vector_to_json``: the same
``[{id, token, bytes, logprob, top_logprobs}]`` list sits in chat ``choices[0].logprobs.content``,
completion ``choices[0].logprobs.content`` and native ``completion_probabilities``).  ``timings``
(llama-server's object, see :mod:`pyllama_dspark.decode.timings`) goes on every non-streaming
response and on the last chunk.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from pyllama_dspark.decode.trace import trace_json

# what llama-server writes for log(0): the lowest float (its JSON library would turn -inf into null)
LOG_ZERO = float(np.finfo(np.float32).min)

FINGERPRINT = "pyllama-dspark"


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(n_prompt: int, n_generated: int, n_cached: int = 0) -> Dict[str, Any]:
    """llama-server's usage: ``prompt_tokens`` counts the whole prompt, cached part included."""
    return {"completion_tokens": int(n_generated), "prompt_tokens": int(n_prompt),
            "total_tokens": int(n_prompt) + int(n_generated),
            "prompt_tokens_details": {"cached_tokens": int(n_cached)}}


def logarithm(p: float) -> float:
    return LOG_ZERO if p == 0.0 else math.log(p)


def valid_utf8_len(b: bytes) -> int:
    """llama-server's ``validate_utf8``: the length without a multi-byte character cut at the end."""
    n = len(b)
    for i in range(1, min(4, n) + 1):
        c = b[n - i]
        if (c & 0xE0) == 0xC0 and i < 2 or (c & 0xF0) == 0xE0 and i < 3 or (c & 0xF8) == 0xF0 and i < 4:
            return n - i
    return n


def _tok(tid: int, piece: bytes, p: float, post: bool) -> Dict[str, Any]:
    return {"id": int(tid), "token": piece[:valid_utf8_len(piece)].decode("utf-8", "replace"),
            "bytes": list(piece), ("prob" if post else "logprob"): (float(p) if post else logarithm(p))}


def probs_json(probs: Optional[Sequence[Any]], piece: Callable[[int], bytes], post_sampling: bool) -> List[dict]:
    """llama-server's ``probs_vector_to_json`` over :class:`~pyllama_dspark.speculative.logprobs.TokenProb`
    entries: per token ``{id, token, bytes, logprob, top_logprobs: [{id, token, bytes, logprob}]}``
    (``prob`` / ``top_probs`` with ``post_sampling_probs``); ``piece(id)``: the token's bytes."""
    out = []
    for tp in probs or ():
        d = _tok(tp.id, piece(tp.id), tp.prob, post_sampling)
        d["top_probs" if post_sampling else "top_logprobs"] = [_tok(i, piece(i), p, post_sampling) for i, p in tp.top]
        out.append(d)
    return out


def logprobs_obj(content: Optional[List[dict]]) -> Optional[Dict[str, Any]]:
    """``{"content": [...]}``, or None when there are no probabilities."""
    return {"content": content} if content else None


def _base(cid: str, model: str, obj: str, created: Optional[int]) -> Dict[str, Any]:
    return {"id": cid, "object": obj, "created": int(created if created is not None else time.time()),
            "model": model, "system_fingerprint": FINGERPRINT}


def chat_completion(cid: str, model: str, text: str, finish_reason: str, n_prompt: int, n_generated: int,
                    timings: Optional[dict] = None, created: Optional[int] = None, n_cached: int = 0,
                    logprobs: Optional[List[dict]] = None, message: Optional[dict] = None) -> Dict[str, Any]:
    """``logprobs``: :func:`probs_json`'s list (llama-server: ``choices[0].logprobs`` only when non-empty);
    ``message``: the assistant message when it is more than ``text`` (tool calls, reasoning)."""
    out = _base(cid, model, "chat.completion", created)
    choice: Dict[str, Any] = {"index": 0, "finish_reason": finish_reason,
                              "message": message if message is not None else {"role": "assistant", "content": text}}
    if logprobs:
        choice["logprobs"] = logprobs_obj(logprobs)
    out["choices"] = [choice]
    out["usage"] = usage(n_prompt, n_generated, n_cached)
    if timings is not None:
        out["timings"] = timings
    return out


def chat_chunk(cid: str, model: str, created: int, delta: Dict[str, Any], finish_reason: Optional[str] = None,
               timings: Optional[dict] = None, logprobs: Optional[List[dict]] = None) -> Dict[str, Any]:
    out = _base(cid, model, "chat.completion.chunk", created)
    choice: Dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "delta": delta}
    if logprobs:
        choice["logprobs"] = logprobs_obj(logprobs)
    out["choices"] = [choice]
    if timings is not None:
        out["timings"] = timings
    return out


def text_completion(cid: str, model: str, text: str, finish_reason: str, n_prompt: int, n_generated: int,
                    timings: Optional[dict] = None, created: Optional[int] = None, n_cached: int = 0,
                    logprobs: Optional[List[dict]] = None) -> Dict[str, Any]:
    """``choices[0].logprobs``: null, or ``{"content": [...]}`` (llama-server's form, not OpenAI's
    legacy ``tokens`` / ``token_logprobs`` arrays)."""
    out = _base(cid, model, "text_completion", created)
    out["choices"] = [{"index": 0, "text": text, "logprobs": logprobs_obj(logprobs), "finish_reason": finish_reason}]
    out["usage"] = usage(n_prompt, n_generated, n_cached)
    if timings is not None:
        out["timings"] = timings
    return out


def text_chunk(cid: str, model: str, created: int, text: str, finish_reason: Optional[str] = None,
               timings: Optional[dict] = None, logprobs: Optional[List[dict]] = None) -> Dict[str, Any]:
    out = _base(cid, model, "text_completion", created)
    out["choices"] = [{"index": 0, "text": text, "logprobs": logprobs_obj(logprobs), "finish_reason": finish_reason}]
    if timings is not None:
        out["timings"] = timings
    return out


def usage_chunk(kind: str, cid: str, model: str, created: int, n_prompt: int, n_generated: int,
                timings: Optional[dict] = None, n_cached: int = 0) -> Dict[str, Any]:
    """The extra last chunk of ``stream_options.include_usage``: empty choices, usage (+ timings)."""
    out = _base(cid, model, "chat.completion.chunk" if kind == "chat" else "text_completion", created)
    out["choices"] = []
    out["usage"] = usage(n_prompt, n_generated, n_cached)
    if timings is not None:
        out["timings"] = timings
    return out


def error_body(message: str, type: str = "invalid_request_error", code: int = 400,
               param: Optional[str] = None) -> Dict[str, Any]:
    err: Dict[str, Any] = {"code": int(code), "message": message, "type": type}
    if param is not None:
        err["param"] = param
    return {"error": err}


def models_list(model_id: str, meta: Optional[Dict[str, Any]] = None, created: Optional[int] = None) -> Dict[str, Any]:
    m: Dict[str, Any] = {"id": model_id, "object": "model",
                         "created": int(created if created is not None else time.time()),
                         "owned_by": "pyllama-dspark"}
    if meta:
        m["meta"] = meta
    return {"object": "list", "data": [m]}


def chunk_extras(req: Any, ev: Any, piece: Callable[[int], bytes]) -> Dict[str, Any]:
    """What a streamed chunk adds for the request: ``timings`` (``timings_per_token``) and
    ``dspark_trace`` (``dspark_trace``), from the Chunk ``ev``; {} when neither was asked."""
    extra: Dict[str, Any] = {}
    if getattr(req, "timings_per_token", False) and ev.timings is not None:
        extra["timings"] = ev.timings
    if getattr(req, "trace", False) and ev.trace is not None:
        extra["dspark_trace"] = trace_json(ev.tokens, ev.trace, piece)
    return extra
