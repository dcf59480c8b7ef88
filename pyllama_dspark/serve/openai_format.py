"""OpenAI-style response dicts, laid out as llama-server returns them (tools/server/server-task.cpp).

Pure builders: chat completions and their stream chunks, text completions and their chunks,
``usage``, error bodies and the ``/v1/models`` list.  ``timings`` (llama-server's object, see
:mod:`pyllama_dspark.decode.timings`) goes on every non-streaming response and on the last chunk.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Dict, Optional

FINGERPRINT = "pyllama-dspark"


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(n_prompt: int, n_generated: int) -> Dict[str, Any]:
    return {"completion_tokens": int(n_generated), "prompt_tokens": int(n_prompt),
            "total_tokens": int(n_prompt) + int(n_generated)}


def _base(cid: str, model: str, obj: str, created: Optional[int]) -> Dict[str, Any]:
    return {"id": cid, "object": obj, "created": int(created if created is not None else time.time()),
            "model": model, "system_fingerprint": FINGERPRINT}


def chat_completion(cid: str, model: str, text: str, finish_reason: str, n_prompt: int, n_generated: int,
                    timings: Optional[dict] = None, created: Optional[int] = None) -> Dict[str, Any]:
    out = _base(cid, model, "chat.completion", created)
    out["choices"] = [{"index": 0, "finish_reason": finish_reason,
                       "message": {"role": "assistant", "content": text}}]
    out["usage"] = usage(n_prompt, n_generated)
    if timings is not None:
        out["timings"] = timings
    return out


def chat_chunk(cid: str, model: str, created: int, delta: Dict[str, Any], finish_reason: Optional[str] = None,
               timings: Optional[dict] = None) -> Dict[str, Any]:
    out = _base(cid, model, "chat.completion.chunk", created)
    out["choices"] = [{"index": 0, "finish_reason": finish_reason, "delta": delta}]
    if timings is not None:
        out["timings"] = timings
    return out


def text_completion(cid: str, model: str, text: str, finish_reason: str, n_prompt: int, n_generated: int,
                    timings: Optional[dict] = None, created: Optional[int] = None) -> Dict[str, Any]:
    out = _base(cid, model, "text_completion", created)
    out["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
    out["usage"] = usage(n_prompt, n_generated)
    if timings is not None:
        out["timings"] = timings
    return out


def text_chunk(cid: str, model: str, created: int, text: str, finish_reason: Optional[str] = None,
               timings: Optional[dict] = None) -> Dict[str, Any]:
    out = _base(cid, model, "text_completion", created)
    out["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
    if timings is not None:
        out["timings"] = timings
    return out


def usage_chunk(kind: str, cid: str, model: str, created: int, n_prompt: int, n_generated: int,
                timings: Optional[dict] = None) -> Dict[str, Any]:
    """The extra last chunk of ``stream_options.include_usage``: empty choices, usage (+ timings)."""
    out = _base(cid, model, "chat.completion.chunk" if kind == "chat" else "text_completion", created)
    out["choices"] = []
    out["usage"] = usage(n_prompt, n_generated)
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
