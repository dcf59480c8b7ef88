"""OpenAI Responses on ``serve`` (``POST /v1/responses``, ``/v1/responses/input_tokens``): the request
converted into a chat-completions body (llama-server's ``server_chat_convert_responses_to_chatcmpl``,
``tools/server/server-chat.cpp``) and run on the chat path; the reply shaped as a ``response``
object and its stream of events, with every field OpenAI's API gives (``output_index``,
``content_index``, ``sequence_number``), which the ``openai`` SDK's stream accumulator reads.

The conversion (as llama-server; where we differ, said here and in docs/serve.md):

* ``instructions`` -> a system message first; ``input`` a string -> one user message, or items:
  messages (``user`` / ``system`` / ``developer`` with ``input_text`` parts or a string; ``assistant``
  with ``output_text`` / ``refusal`` parts or a string), ``function_call`` (-> the assistant's tool
  calls), ``function_call_output`` (-> a ``role: "tool"`` message; text parts joined),
  ``reasoning`` (its ``content`` text -> ``reasoning_content``; an item with no ``content``, e.g. only
  ``encrypted_content``, is skipped where llama-server refuses it).  Consecutive assistant items
  merge into one assistant message.  ``input_image`` / ``input_file`` and unknown items are a 400;
* ``tools``: ``function`` tools; other tool types (``web_search``, ``file_search``, ...) are skipped,
  as llama-server skips them.  ``tool_choice``: ``auto`` / ``none`` / ``required`` or
  ``{"type": "function", "name"}``;
* ``max_output_tokens`` -> ``max_tokens``; ``text.format`` of type ``json_schema`` / ``json_object``
  -> ``response_format`` (llama-server ignores ``text``); every other field goes to the chat request
  as it is (``temperature``, ``top_p``, ``stop``, ``seed``, ``parallel_tool_calls``, ...), as
  llama-server passes them;
* ``previous_response_id`` is a 400 (nothing is kept between requests: send the whole
  conversation); ``store`` is accepted and nothing is stored; ``reasoning.effort``, ``include``,
  ``metadata``, ``truncation``, ``user``, ``service_tier``, ``prompt_cache_key`` are ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Dict, Iterator, List, Optional

from pyllama_dspark.serve.oai_request import RequestError

__all__ = ["to_chat_body", "response_object", "ResponseShaper", "new_id"]

_DROP = ("input", "instructions", "tools", "tool_choice", "max_output_tokens", "text", "reasoning", "store",
         "previous_response_id", "include", "metadata", "truncation", "user", "service_tier", "prompt_cache_key",
         "background", "safety_identifier", "prompt", "max_tool_calls", "conversation")


def _bad(message: str, param: str = "input") -> RequestError:
    return RequestError(message, param=param)


def _parts_text(parts: Any, allowed: tuple, where: str) -> str:
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise _bad(f"{where} must be a string or a list of content parts")
    out = []
    for k, p in enumerate(parts):
        t = p.get("type") if isinstance(p, dict) else None
        if t in ("input_image", "input_file", "input_audio"):
            raise _bad(f"{where}[{k}]: {t} is not supported (this server runs a text-only model)")
        if t not in allowed:
            raise _bad(f"{where}[{k}]: content part type must be one of {', '.join(allowed)}, got {t!r}")
        text = p.get("refusal") if t == "refusal" else p.get("text")
        if not isinstance(text, str):
            raise _bad(f"{where}[{k}] needs a string {'refusal' if t == 'refusal' else 'text'}")
        out.append(text)
    return "".join(out)


def _assistant(msgs: List[dict]) -> dict:
    """The assistant message the next assistant item merges into (a new one if the last is not)."""
    if not msgs or msgs[-1]["role"] != "assistant":
        msgs.append({"role": "assistant", "content": ""})
    return msgs[-1]


def _items(items: list, msgs: List[dict]) -> None:
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object")
        kind, role = item.get("type"), item.get("role")
        if role in ("user", "system", "developer") and kind in (None, "message"):
            msgs.append({"role": role, "content": _parts_text(item.get("content"), ("input_text",), f"{where}.content")})
        elif role == "assistant" and kind in (None, "message"):
            text = _parts_text(item.get("content"), ("output_text", "input_text", "refusal"), f"{where}.content")
            m = _assistant(msgs)
            m["content"] += text
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise _bad(f"{where}: a function_call needs string 'call_id', 'name' and 'arguments'")
            _assistant(msgs).setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{where}: a function_call_output needs a string 'call_id'")
            out = _parts_text(item.get("output"), ("input_text", "output_text"), f"{where}.output")
            msgs.append({"role": "tool", "tool_call_id": item["call_id"], "content": out})
        elif kind == "reasoning":
            content = item.get("content")
            if not content:
                continue        # only a summary / encrypted_content: nothing a local model can read
            text = _parts_text(content, ("reasoning_text",), f"{where}.content")
            m = _assistant(msgs)
            m["reasoning_content"] = m.get("reasoning_content", "") + text
        else:
            raise _bad(f"{where}: cannot tell what this item is (type {kind!r}, role {role!r})")


def _text_format(text: Any) -> Optional[dict]:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    t = fmt.get("type") if isinstance(fmt, dict) else None
    if t == "text":
        return None
    if t == "json_object":
        return {"type": "json_object"}
    if t == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("text.format of type json_schema needs a 'schema' object", "text")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "schema"), "schema": fmt["schema"]}}
    raise _bad(f"text.format.type must be text, json_object or json_schema, got {t!r}", "text")


def to_chat_body(body: Any) -> Dict[str, Any]:
    """The chat-completions body of a Responses request (module doc); RequestError (400)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None)
    if "input" not in body:
        raise _bad("'input' is required")
    if body.get("previous_response_id"):
        raise _bad("'previous_response_id' is not supported: this server keeps no responses; "
                   "send the whole conversation in 'input'", "previous_response_id")
    msgs: List[dict] = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise _bad("instructions must be a string", "instructions")
        msgs.append({"role": "system", "content": body["instructions"]})
    inp = body["input"]
    if isinstance(inp, str):
        msgs.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        _items(inp, msgs)
    else:
        raise _bad("'input' must be a string or a list of items")
    out = {k: v for k, v in body.items() if k not in _DROP}
    out["messages"] = msgs
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("'tools' must be a list", "tools")
        conv = []
        for k, t in enumerate(tools):
            if not isinstance(t, dict):
                raise _bad(f"tools[{k}] must be an object", "tools")
            if t.get("type") != "function":
                continue
            fn = {key: v for key, v in t.items() if key != "type"}
            conv.append({"type": "function", "function": fn})
        if conv:
            out["tools"] = conv
    tc = body.get("tool_choice")
    if tc is not None and "tools" in out:
        if isinstance(tc, dict) and tc.get("type") == "function":
            if not isinstance(tc.get("name"), str):
                raise _bad("tool_choice of type function needs a 'name'", "tool_choice")
            tc = {"type": "function", "function": {"name": tc["name"]}}
        out["tool_choice"] = tc
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    rf = _text_format(body.get("text"))
    if rf is not None:
        out["response_format"] = rf
    return out


# ---- the reply ------------------------------------------------------------------------------------
def new_id(prefix: str = "resp_") -> str:
    return prefix + uuid.uuid4().hex[:24]


def _usage(n_prompt: int, n_cached: int, n_generated: int) -> Dict[str, Any]:
    return {"input_tokens": n_prompt, "input_tokens_details": {"cached_tokens": n_cached},
            "output_tokens": n_generated, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": n_prompt + n_generated}


def _envelope(rid: str, model: str, created: int, status: str, output: List[dict],
              usage: Optional[dict] = None, incomplete: bool = False) -> Dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "usage": usage}


def _reasoning_item(iid: str, text: str, status: str = "completed") -> dict:
    return {"id": iid, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else [], "encrypted_content": ""}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(iid: str, text: str, status: str = "completed") -> dict:
    return {"id": iid, "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text)] if status == "completed" else []}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"id": "fc_" + call_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def response_object(rid: str, model: str, message: Dict[str, Any], finish_reason: Optional[str],
                    n_prompt: int, n_cached: int, n_generated: int) -> Dict[str, Any]:
    """The ``response`` of a chat reply (``message``: the chat completion's message)."""
    out: List[dict] = []
    if message.get("reasoning_content"):
        out.append(_reasoning_item(new_id("rs_"), message["reasoning_content"]))
    if message.get("content"):
        out.append(_message_item(new_id("msg_"), message["content"]))
    for c in message.get("tool_calls") or []:
        out.append(_call_item(c["id"], c["function"]["name"], c["function"]["arguments"]))
    incomplete = finish_reason == "length"
    return _envelope(rid, model, int(time.time()), "incomplete" if incomplete else "completed", out,
                     _usage(n_prompt, n_cached, n_generated), incomplete)


class ResponseShaper:
    """Chat-completion deltas in, Responses stream events out (``(event name, data)`` pairs): one
    output item per kind in the order they come (reasoning, the message, each function call), each
    done before the next is added; ``sequence_number`` on every event."""

    def __init__(self, rid: str, model: str):
        self.rid, self.model, self.created = rid, model, int(time.time())
        self.seq = 0
        self.output: List[dict] = []        # finished items
        self.item: Optional[dict] = None    # the open one
        self.key: Optional[str] = None      # "reasoning" | "message" | "call:<n>"

    def _ev(self, name: str, **data) -> tuple:
        data = {"type": name, **data, "sequence_number": self.seq}
        self.seq += 1
        return name, data

    def start(self, n_prompt: int) -> Iterator[tuple]:
        env = _envelope(self.rid, self.model, self.created, "in_progress", [])
        yield self._ev("response.created", response=env)
        yield self._ev("response.in_progress", response=env)

    def _close(self) -> Iterator[tuple]:
        it, n = self.item, len(self.output)
        if it is None:
            return
        if it["type"] == "reasoning":
            text = it.pop("_text")
            it.update(_reasoning_item(it["id"], text))
            yield self._ev("response.reasoning_text.done", item_id=it["id"], output_index=n, content_index=0, text=text)
        elif it["type"] == "message":
            text = it.pop("_text")
            it.update(_message_item(it["id"], text))
            yield self._ev("response.output_text.done", item_id=it["id"], output_index=n, content_index=0, text=text,
                           logprobs=[])
            yield self._ev("response.content_part.done", item_id=it["id"], output_index=n, content_index=0,
                           part=_text_part(text))
        else:
            it["status"] = "completed"
            yield self._ev("response.function_call_arguments.done", item_id=it["id"], output_index=n,
                           arguments=it["arguments"])
        yield self._ev("response.output_item.done", output_index=n, item=dict(it))
        self.output.append(it)
        self.item = self.key = None

    def _open(self, key: str, item: dict) -> Iterator[tuple]:
        if self.key == key:
            return
        yield from self._close()
        self.key, self.item = key, item
        n = len(self.output)
        shown = {k: v for k, v in item.items() if not k.startswith("_")}
        yield self._ev("response.output_item.added", output_index=n, item=shown)
        if item["type"] == "message":
            yield self._ev("response.content_part.added", item_id=item["id"], output_index=n, content_index=0,
                           part=_text_part(""))

    def delta(self, d: Dict[str, Any]) -> Iterator[tuple]:
        """The events of one chat-completion delta."""
        n = len(self.output)
        if d.get("reasoning_content"):
            yield from self._open("reasoning", {**_reasoning_item(new_id("rs_"), "", "in_progress"), "_text": ""})
            n = len(self.output)
            self.item["_text"] += d["reasoning_content"]
            yield self._ev("response.reasoning_text.delta", item_id=self.item["id"], output_index=n, content_index=0,
                           delta=d["reasoning_content"])
        if d.get("content"):
            yield from self._open("message", {**_message_item(new_id("msg_"), "", "in_progress"), "_text": ""})
            n = len(self.output)
            self.item["_text"] += d["content"]
            yield self._ev("response.output_text.delta", item_id=self.item["id"], output_index=n, content_index=0,
                           delta=d["content"], logprobs=[])
        for tc in d.get("tool_calls") or []:
            fn = tc.get("function") or {}
            yield from self._open(f"call:{tc['index']}",
                                  _call_item(tc.get("id", ""), fn.get("name", ""), "", "in_progress"))
            n = len(self.output)
            if fn.get("arguments"):
                self.item["arguments"] += fn["arguments"]
                yield self._ev("response.function_call_arguments.delta", item_id=self.item["id"], output_index=n,
                               delta=fn["arguments"])

    def done(self, ev: Any) -> Iterator[tuple]:
        """The events that end the stream of a finished job (``ev``: its Done)."""
        yield from self._close()
        st = ev.stats
        incomplete = ev.finish_reason == "length"
        env = _envelope(self.rid, self.model, self.created, "incomplete" if incomplete else "completed",
                        self.output, _usage(st.n_prompt, st.n_cached, st.n_generated), incomplete)
        yield self._ev("response.incomplete" if incomplete else "response.completed", response=env)

    def error(self, e: RequestError) -> tuple:
        return self._ev("error", code=e.type, message=e.message, param=e.param)
