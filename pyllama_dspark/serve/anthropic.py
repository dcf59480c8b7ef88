"""Anthropic Messages on ``serve`` (``POST /v1/messages``, ``/v1/messages/count_tokens``): the request
converted into a chat-completions body (llama-server's ``server_chat_convert_anthropic_to_oai``,
``tools/server/server-chat.cpp``), so that it takes the one request path chat completions take; the
reply shaped as Anthropic's ``message`` object and its stream of events (llama-server's
``to_json_anthropic`` / ``format_anthropic_sse``, ``server-task.cpp``).

The conversion (what llama-server does, and where we differ on purpose):

* ``system`` (a string or text blocks, joined) becomes the first message; Claude Code's
  ``x-anthropic-billing-header: ...; cch=XXXXX;`` has its per-request ``cch`` stamp replaced by
  ``fffff`` so that the prompt cache still matches (``normalize_anthropic_billing_header``);
* a message's blocks: ``text`` -> content, ``thinking`` -> ``reasoning_content``, ``tool_use`` ->
  a tool call (``input`` as its JSON arguments), ``tool_result`` -> a ``role: "tool"`` message after
  it (text blocks joined); ``redacted_thinking`` is dropped; ``image`` / ``document`` and unknown
  blocks are a 400 (llama-server passes images to a multimodal model; ``serve`` has none);
* ``tools`` (``input_schema`` -> ``parameters``), ``tool_choice``: ``auto``, ``any`` ->
  ``required``, ``tool`` -> that tool, ``none`` -> none, ``disable_parallel_tool_use`` ->
  ``parallel_tool_calls: false``.  llama-server maps ``tool`` to ``required`` (any tool) and drops
  ``none``; we do what Anthropic defines;
* ``stop_sequences`` -> ``stop``, ``max_tokens`` (4096 when missing), ``temperature``, ``top_p``,
  ``top_k``, ``stream``, ``chat_template_kwargs`` as they are;
* ignored, as llama-server ignores them: ``metadata``, ``cache_control`` on any block, ``service_tier``,
  ``container``, ``mcp_servers``, ``context_management``; ``thinking`` is accepted and its
  ``budget_tokens`` not enforced (llama-server sets a reasoning budget; ``serve`` has none).

Errors on these routes use Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``
(llama-server answers them in OpenAI's shape).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Dict, Iterator, List, Optional

from pyllama_dspark.serve.oai_request import RequestError

__all__ = ["to_chat_body", "normalize_billing_header", "message_object", "EventShaper", "error_body", "new_id",
           "stop_reason"]

DEFAULT_MAX_TOKENS = 4096
_PASS = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs")
_BILLING = "x-anthropic-billing-header:"


def _bad(message: str, param: Optional[str] = None) -> RequestError:
    return RequestError(message, param=param)


def normalize_billing_header(text: str) -> str:
    """Claude Code's billing header with its per-request ``cch=`` stamp made constant (five ``f``s),
    as llama-server does; any other text unchanged."""
    if not text.startswith(_BILLING):
        return text
    i = text.find("cch=", len(_BILLING))
    if i < 0:
        return text
    j = i + 4
    if j + 5 < len(text) and text[j + 5] == ";":
        return text[:j] + "fffff" + text[j + 5:]
    return text


def _text_of(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _bad(f"{where} must be a string or a list of text blocks", where)
    out = []
    for k, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise _bad(f"{where}[{k}]: only text blocks are supported here, got {kind!r}", where)
        out.append(b["text"])
    return "".join(out)


def _convert_message(i: int, msg: Any) -> List[dict]:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise _bad(f"{where} must be an object", "messages")
    role = msg.get("role")
    if role not in ("user", "assistant"):
        raise _bad(f"{where}.role must be 'user' or 'assistant', got {role!r}", "messages")
    content = msg.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content blocks", "messages")
    text, reasoning, calls, results = [], [], [], []
    for k, b in enumerate(content):
        w = f"{where}.content[{k}]"
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise _bad(f"{w} must be a content block with a 'type'", "messages")
        t = b["type"]
        if t == "text":
            if not isinstance(b.get("text"), str):
                raise _bad(f"{w}.text must be a string", "messages")
            text.append(b["text"])
        elif t == "thinking":
            reasoning.append(str(b.get("thinking") or ""))
        elif t == "redacted_thinking":
            continue
        elif t == "tool_use" and role == "assistant":
            if not isinstance(b.get("id"), str) or not b["id"] or not isinstance(b.get("name"), str):
                raise _bad(f"{w}: a tool_use block needs a string 'id' and 'name'", "messages")
            args = b.get("input", {})
            if not isinstance(args, dict):
                raise _bad(f"{w}.input must be an object", "messages")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
        elif t == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str) or not b["tool_use_id"]:
                raise _bad(f"{w}: a tool_result block needs a string 'tool_use_id'", "messages")
            c = b.get("content", "")
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": "" if c is None else _text_of(c, f"{w}.content")})
        elif t in ("image", "document"):
            raise _bad(f"{w}: {t} blocks are not supported (this server runs a text-only model)", "messages")
        else:
            raise _bad(f"{w}: unsupported content block type {t!r} in a {role} message", "messages")
    out: List[dict] = []
    if text or calls or reasoning:
        m: Dict[str, Any] = {"role": role, "content": "".join(text)}
        if calls:
            m["tool_calls"] = calls
        if reasoning:
            m["reasoning_content"] = "".join(reasoning)
        out.append(m)
    return out + results


def _tool_choice(tc: Any, body: dict) -> None:
    if not isinstance(tc, dict) or not isinstance(tc.get("type"), str):
        raise _bad("tool_choice must be an object with a 'type'", "tool_choice")
    t = tc["type"]
    if t == "auto":
        body["tool_choice"] = "auto"
    elif t == "any":
        body["tool_choice"] = "required"
    elif t == "none":
        body["tool_choice"] = "none"
    elif t == "tool":
        if not isinstance(tc.get("name"), str):
            raise _bad("tool_choice of type 'tool' needs a 'name'", "tool_choice")
        body["tool_choice"] = {"type": "function", "function": {"name": tc["name"]}}
    else:
        raise _bad(f"tool_choice.type must be auto, any, tool or none, got {t!r}", "tool_choice")
    if tc.get("disable_parallel_tool_use") is True:
        body["parallel_tool_calls"] = False


def to_chat_body(body: Any) -> Dict[str, Any]:
    """The chat-completions body of an Anthropic Messages request (module doc); RequestError (400)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    msgs: List[dict] = []
    if body.get("system") is not None:
        system = body["system"]
        if isinstance(system, list):
            system = "".join(normalize_billing_header(t) for t in
                             (_text_of([b], "system") for b in system))
        elif isinstance(system, str):
            system = normalize_billing_header(system)
        else:
            raise _bad("system must be a string or a list of text blocks", "system")
        msgs.append({"role": "system", "content": system})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' is required: a non-empty list", "messages")
    for i, m in enumerate(messages):
        msgs += _convert_message(i, m)
    out: Dict[str, Any] = {"messages": msgs}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools must be a list", "tools")
        conv = []
        for k, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise _bad(f"tools[{k}] must be an object with a 'name'", "tools")
            if t.get("type") not in (None, "custom"):
                raise _bad(f"tools[{k}]: server tools ({t.get('type')!r}) are not supported", "tools")
            conv.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                          "parameters": t.get("input_schema", {})}})
        if conv:
            out["tools"] = conv
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], out)
        if "tools" not in out:
            out.pop("tool_choice", None)
            out.pop("parallel_tool_calls", None)
    if body.get("stop_sequences") is not None:
        out["stop"] = body["stop_sequences"]
    out["max_tokens"] = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    for key in _PASS:
        if key in body:
            out[key] = body[key]
    return out


# ---- the reply ------------------------------------------------------------------------------------
def new_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def stop_reason(finish_reason: Optional[str]) -> str:
    """Anthropic's stop_reason of a chat finish reason (llama-server's mapping)."""
    return {"tool_calls": "tool_use", "length": "max_tokens"}.get(finish_reason or "", "end_turn")


def _usage(n_prompt: int, n_cached: int, n_generated: int) -> Dict[str, int]:
    return {"cache_read_input_tokens": n_cached, "input_tokens": n_prompt - n_cached, "output_tokens": n_generated}


def message_object(mid: str, model: str, message: Dict[str, Any], finish_reason: Optional[str],
                   stop_word: Optional[str], n_prompt: int, n_cached: int, n_generated: int) -> Dict[str, Any]:
    """Anthropic's ``message`` of a chat reply (``message``: the chat completion's message)."""
    blocks: List[dict] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for c in message.get("tool_calls") or []:
        try:
            args = json.loads(c["function"]["arguments"])
        except ValueError:
            args = {}
        blocks.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                       "input": args if isinstance(args, dict) else {}})
    reason = "stop_sequence" if stop_word else stop_reason(finish_reason)
    return {"id": mid, "type": "message", "role": "assistant", "content": blocks, "model": model,
            "stop_reason": reason, "stop_sequence": stop_word or None,
            "usage": _usage(n_prompt, n_cached, n_generated)}


class EventShaper:
    """Chat-completion deltas in, Anthropic stream events out (``(event name, data)`` pairs): one
    content block per kind in the order they come (thinking, text, each tool call), each closed
    when the next one opens (a thinking block after its ``signature_delta``)."""

    def __init__(self, mid: str, model: str):
        self.mid, self.model = mid, model
        self.index = -1             # the open block's index
        self.open: Optional[str] = None    # "thinking" | "text" | "tool:<n>"

    def start(self, n_prompt: int) -> Iterator[tuple]:
        """``message_start`` (the prompt's tokens as input: the cached count is known at the end) and a ping."""
        msg = {"id": self.mid, "type": "message", "role": "assistant", "content": [], "model": self.model,
               "stop_reason": None, "stop_sequence": None, "usage": _usage(n_prompt, 0, 0)}
        yield "message_start", {"type": "message_start", "message": msg}
        yield "ping", {"type": "ping"}

    def _close(self) -> Iterator[tuple]:
        if self.open is None:
            return
        if self.open == "thinking":
            yield "content_block_delta", {"type": "content_block_delta", "index": self.index,
                                          "delta": {"type": "signature_delta", "signature": ""}}
        yield "content_block_stop", {"type": "content_block_stop", "index": self.index}
        self.open = None

    def _to(self, kind: str, block: dict) -> Iterator[tuple]:
        if self.open != kind:
            yield from self._close()
            self.index += 1
            self.open = kind
            yield "content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block}

    def _delta(self, delta: dict) -> tuple:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}

    def delta(self, d: Dict[str, Any]) -> Iterator[tuple]:
        """The events of one chat-completion delta."""
        if d.get("reasoning_content"):
            yield from self._to("thinking", {"type": "thinking", "thinking": ""})
            yield self._delta({"type": "thinking_delta", "thinking": d["reasoning_content"]})
        if d.get("content"):
            yield from self._to("text", {"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": d["content"]})
        for tc in d.get("tool_calls") or []:
            fn = tc.get("function") or {}
            yield from self._to(f"tool:{tc['index']}", {"type": "tool_use", "id": tc.get("id", ""),
                                                        "name": fn.get("name", ""), "input": {}})
            if fn.get("arguments"):
                yield self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]})

    def done(self, ev: Any) -> Iterator[tuple]:
        """The events that end the stream of a finished job (``ev``: its Done)."""
        yield from self._close()
        st = ev.stats
        reason = "stop_sequence" if ev.stop_word else stop_reason(ev.finish_reason)
        yield "message_delta", {"type": "message_delta",
                                "delta": {"stop_reason": reason, "stop_sequence": ev.stop_word or None},
                                "usage": {"output_tokens": st.n_generated, "input_tokens": st.n_prompt - st.n_cached,
                                          "cache_read_input_tokens": st.n_cached}}
        yield "message_stop", {"type": "message_stop"}

    def error(self, e: RequestError) -> tuple:
        return "error", error_body(e)


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(e: RequestError) -> Dict[str, Any]:
    """Anthropic's error object for a refused request."""
    kind = _ERROR_TYPES.get(e.code, "api_error" if e.code >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}
