"""Gemma 4's conversation as llama.cpp renders it (for :mod:`.gemma4`, the codec).

* :func:`adjust_prompt`: llama.cpp opens the model's turn when the template left the prompt after a
  closed turn (``common_chat_params_init_gemma4``);
* :func:`adjust_messages`: a ``null`` in an earlier call's arguments prints as nothing, as in
  llama.cpp's template engine (Jinja2 would print ``None``);
* :func:`legacy_messages`: an older template (no ``OpenAI Chat Completions`` branch, as chat.cpp
  tests) wants the tool results folded into the assistant turn (``convert_tool_responses_gemma4``).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List

__all__ = ["adjust_prompt", "adjust_messages", "legacy_messages"]


def adjust_prompt(prompt: str) -> str:
    """llama.cpp opens the model's turn when the template left the prompt after a closed turn (an
    assistant message with content, calls and their results last)."""
    return prompt + "<|turn>model\n" if prompt.endswith("<turn|>\n") else prompt


class _Null:
    """A JSON null in an earlier call's arguments: llama.cpp's template engine prints it as nothing,
    Jinja2 would print ``None``."""

    def __str__(self) -> str:
        return ""


def _nulls(v: Any) -> Any:
    if v is None:
        return _Null()
    if isinstance(v, dict):
        return {k: _nulls(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_nulls(x) for x in v]
    return v


def adjust_messages(msgs: List[dict]) -> List[dict]:
    """Arguments and tool results as llama.cpp's engine renders them (nulls print as nothing)."""
    out = []
    for m in msgs:
        if _has_calls(m):
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _nulls(c["function"]["arguments"])}}
                                     if isinstance(c.get("function"), dict) else c for c in m["tool_calls"]]}
        if isinstance(m.get("tool_responses"), list):
            m = {**m, "tool_responses": _nulls(m["tool_responses"])}
        out.append(m)
    return out


def _has_calls(m: dict) -> bool:
    return isinstance(m.get("tool_calls"), list) and bool(m["tool_calls"])


def legacy_messages(msgs: List[dict]) -> List[dict]:
    """An older Gemma 4 template (no ``OpenAI Chat Completions`` branch) wants one assistant message
    with ``tool_calls``, ``tool_responses`` and the next reply's content (llama.cpp's
    ``convert_tool_responses_gemma4``)."""
    out: List[dict] = []
    i = 0
    while i < len(msgs):
        m = msgs[i]
        if m.get("role") != "assistant" or not _has_calls(m):
            out.append(m)
            i += 1
            continue
        calls, responses = list(m["tool_calls"]), []
        i += 1
        while i < len(msgs) and msgs[i].get("role") == "tool":
            r = msgs[i]
            body = r.get("content")
            if isinstance(body, str):
                try:
                    body = json.loads(body)
                except ValueError:
                    pass
            k = len(responses)
            name = calls[k].get("function", {}).get("name", "") if k < len(calls) else ""
            responses.append({"name": name or r.get("tool_call_id", ""), "response": body})
            i += 1
        new: Dict[str, Any] = {"role": "assistant", "tool_calls": calls}
        if responses:
            new["tool_responses"] = responses
        if i < len(msgs) and msgs[i].get("role") == "assistant" and not _has_calls(msgs[i]) \
                and msgs[i].get("content"):
            new["content"] = msgs[i]["content"]
            i += 1
        if isinstance(m.get("reasoning_content"), str):
            new["reasoning_content"] = m["reasoning_content"]
        out.append(new)
    return out
