"""``messages`` of a chat request, checked as llama-server reads them (``common_chat_msgs_parse_oaicompat``).

Each message becomes ``{"role", "content"}`` (text: a string, or the text parts of an array joined),
plus what an agent's conversation carries: an assistant turn's ``tool_calls`` and
``reasoning_content``, a ``tool`` result's ``tool_call_id``, a ``name``.  Whether the calls and ids
fit together is checked with the tools (:mod:`.oai_tools`)."""

from __future__ import annotations

from typing import Any, Dict, List

from pyllama_dspark.serve.oai_errors import RequestError, _typename

__all__ = ["ROLES", "parse_messages"]

ROLES = ("system", "user", "assistant", "tool", "developer", "function")


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


def _extras(m: dict, i: int, out: Dict[str, Any]) -> None:
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise RequestError(f"messages[{i}].tool_calls must be an array, got {_typename(calls)}", param="messages")
        if calls:
            out["tool_calls"] = calls
    for key in ("tool_call_id", "name", "reasoning_content"):
        v = m.get(key)
        if v is None:
            continue
        if not isinstance(v, str):
            raise RequestError(f"messages[{i}].{key} must be a string, got {_typename(v)}", param="messages")
        out[key] = v


def parse_messages(body: dict) -> List[Dict[str, Any]]:
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
        msg: Dict[str, Any] = {"role": role, "content": _content_text(m.get("content"), i)}
        _extras(m, i, msg)
        out.append(msg)
    return out
