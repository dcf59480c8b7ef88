"""OpenAI-style request bodies (as llama-server accepts them) -> a checked :class:`GenRequest`.

Pure Python, no HTTP: the server calls :func:`parse_request` on the decoded JSON body and turns a
:class:`RequestError` into an HTTP error with an OpenAI-style body.  Unknown fields are ignored
(llama-server ignores them too); a known field of the wrong type or out of range is an error.

Fields (``/v1/chat/completions`` and ``/v1/completions``): ``messages`` (chat) / ``prompt``
(completion: a string, a list of token ids, or a one-element list of strings), ``max_tokens``
(aliases ``max_completion_tokens``, ``n_predict``; -1 = until the context is full),
``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``, ``repeat_penalty``,
``presence_penalty``, ``frequency_penalty``, ``stop`` (string or list), ``stream``,
``stream_options.include_usage``, ``ignore_eos``, ``n`` (must be 1), ``model`` (echoed only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union


class RequestError(Exception):
    """A request the server refuses: HTTP ``code`` with an OpenAI-style error body."""

    def __init__(self, message: str, type: str = "invalid_request_error", code: int = 400,
                 param: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.type = type
        self.code = code
        self.param = param


# sampling fields and their checks: (python types, lower bound, upper bound)
_NUM = (int, float)
_SAMPLING_FIELDS = {
    "temperature": (_NUM, 0.0, None),
    "top_k": ((int,), None, None),
    "top_p": (_NUM, 0.0, 1.0),
    "min_p": (_NUM, 0.0, 1.0),
    "seed": ((int,), None, None),
    "repeat_penalty": (_NUM, 0.0, None),
    "presence_penalty": (_NUM, None, None),
    "frequency_penalty": (_NUM, None, None),
}

ROLES = ("system", "user", "assistant", "tool", "developer", "function")


@dataclass
class GenRequest:
    kind: str                                   # "chat" | "completion"
    messages: Optional[List[Dict[str, str]]] = None
    prompt: Optional[Union[str, List[int]]] = None
    max_tokens: int = -1                        # -1: until EOS / the context is full
    stop: List[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    model: Optional[str] = None
    sampling: Dict[str, Any] = field(default_factory=dict)   # only the fields the client sent


def _typename(v: Any) -> str:
    return "null" if v is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                     list: "array", dict: "object"}.get(type(v), type(v).__name__)


def _is(v: Any, types) -> bool:
    return isinstance(v, types) and not isinstance(v, bool)


def _int_field(body: dict, name: str) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is(v, int):
        raise RequestError(f"'{name}' must be an integer, got {_typename(v)}", param=name)
    return v


def _content_text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                raise RequestError(f"messages[{i}].content: only text parts are supported", param="messages")
        return "".join(parts)
    raise RequestError(f"messages[{i}].content must be a string or an array of text parts, got {_typename(content)}",
                       param="messages")


def _messages(body: dict) -> List[Dict[str, str]]:
    msgs = body.get("messages")
    if msgs is None:
        raise RequestError("'messages' is required", param="messages")
    if not isinstance(msgs, list):
        raise RequestError(f"'messages' must be an array, got {_typename(msgs)}", param="messages")
    if not msgs:
        raise RequestError("'messages' must not be empty", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object, got {_typename(m)}", param="messages")
        role = m.get("role")
        if not isinstance(role, str):
            raise RequestError(f"messages[{i}].role must be a string", param="messages")
        if role not in ROLES:
            raise RequestError(f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)}", param="messages")
        out.append({"role": role, "content": _content_text(m.get("content"), i)})
    return out


def _prompt(body: dict) -> Union[str, List[int]]:
    p = body.get("prompt")
    if p is None:
        raise RequestError("'prompt' is required", param="prompt")
    if isinstance(p, str):
        return p
    if isinstance(p, list):
        if not p:
            raise RequestError("'prompt' must not be empty", param="prompt")
        if all(_is(t, int) for t in p):
            return list(p)
        if len(p) == 1 and isinstance(p[0], str):
            return p[0]
        if all(isinstance(t, str) for t in p):
            raise RequestError("several prompts in one request are not supported; send one prompt per request",
                               param="prompt")
        raise RequestError("'prompt' must be a string or an array of token ids", param="prompt")
    raise RequestError(f"'prompt' must be a string or an array of token ids, got {_typename(p)}", param="prompt")


def _stop(body: dict) -> List[str]:
    s = body.get("stop")
    if s is None:
        return []
    if isinstance(s, str):
        return [s] if s else []
    if isinstance(s, list) and all(isinstance(x, str) for x in s):
        return [x for x in s if x]
    raise RequestError("'stop' must be a string or an array of strings", param="stop")


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"'{name}' must be a boolean, got {_typename(v)}", param=name)
    return v


def parse_request(body: Any, kind: str) -> GenRequest:
    """Check a decoded JSON body for ``kind`` = "chat" or "completion"; raise RequestError."""
    if kind not in ("chat", "completion"):
        raise ValueError(f"kind must be 'chat' or 'completion', got {kind!r}")
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_typename(body)}")
    req = GenRequest(kind=kind)
    if kind == "chat":
        req.messages = _messages(body)
    else:
        req.prompt = _prompt(body)

    n_given = [k for k in ("max_tokens", "max_completion_tokens", "n_predict") if body.get(k) is not None]
    if n_given:
        n = _int_field(body, n_given[0])
        if n < -1 or n == 0:
            raise RequestError(f"'{n_given[0]}' must be >= 1 (or -1 for no limit), got {n}", param=n_given[0])
        req.max_tokens = n

    n_choices = _int_field(body, "n")
    if n_choices is not None and n_choices != 1:
        raise RequestError("only n = 1 is supported", param="n")

    req.stop = _stop(body)
    req.stream = _bool(body, "stream")
    req.ignore_eos = _bool(body, "ignore_eos")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise RequestError("'stream_options' must be an object", param="stream_options")
        req.include_usage = _bool(so, "include_usage")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"'model' must be a string, got {_typename(model)}", param="model")
    req.model = model

    for name, (types, lo, hi) in _SAMPLING_FIELDS.items():
        v = body.get(name)
        if v is None:
            continue
        if types == (int,):
            v = _int_field(body, name)
        elif not _is(v, types):
            raise RequestError(f"'{name}' must be a number, got {_typename(v)}", param=name)
        if v != v:  # NaN
            raise RequestError(f"'{name}' must not be NaN", param=name)
        if lo is not None and v < lo:
            raise RequestError(f"'{name}' must be >= {lo}, got {v}", param=name)
        if hi is not None and v > hi:
            raise RequestError(f"'{name}' must be <= {hi}, got {v}", param=name)
        req.sampling[name] = v
    return req
